"""memguard's per-release facts against the real megatron.training of the installed release: megatron-core 0.17.1
(legacy era), 0.18.2 (the first config-container release) and 0.19.2, each in its own Python 3.12 venv
(tests/run.sh). What a release's parser and validate_args do is the measurement; memguard's release detection
from the argument table, its vocabulary padding and its "needs megatron-core X" gates must agree with it."""
import sys

import pytest

from conftest import LLAMA31_8B, H100, megatron_core_version, megatron_training_era

pytestmark = [
    pytest.mark.megatron_training,
    pytest.mark.skipif(megatron_training_era() is None, reason="needs a real megatron.training (Python 3.12, "
                       "megatron-core >= 0.17); tests/run.sh runs these in .venv312 and .venv312-core017/018"),
]

BASE = LLAMA31_8B + "--lr 1e-4 --train-iters 10 --micro-batch-size 1 --tensor-model-parallel-size 2".split()
INSTALLED = megatron_core_version()
VERSION = ".".join(map(str, INSTALLED or ()))


@pytest.fixture
def megatron(monkeypatch):
    """Megatron's own start-up on rank 0 of 8 (H100 properties): parse_args -> validate_args ->
    set_global_variables, what parse_and_validate_args (core >= 0.18) and initialize_megatron (core 0.17) run."""
    import torch
    from megatron.training import arguments, global_vars
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=None: H100)
    for k, v in (("WORLD_SIZE", "8"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("CUDA_DEVICE_MAX_CONNECTIONS", "1"),
                 ("MEMGUARD", "off")):   # the hook may be installed by other tests: keep it out of the way
        monkeypatch.setenv(k, v)

    def parse(flags):
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *[str(f) for f in flags]])
        return arguments.parse_args()

    def start(flags):
        args = parse(flags)
        global_vars.unset_global_variables()
        try:
            arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
            global_vars.set_global_variables(args, build_tokenizer=True)
        finally:
            global_vars.unset_global_variables()
        return args

    class M:
        pass
    m = M()
    m.parse, m.start = parse, start
    yield m


def test_release_is_read_from_its_own_argument_table(megatron, capsys, tmp_path):
    """validate_args prints the argument table; memguard report tells the release from it, and predicts with
    that release's rules: NullTokenizer counts an extra EOD token up to 0.17 (core 0.17.1
    megatron/core/tokenizers/text/libraries/null_tokenizer.py: vocab_size = vocab + 1; 0.18.2: vocab), which
    the tokenizer build pads to Megatron's padded_vocab_size (128256 [+1] -> multiple of 128 x TP 2)."""
    from megatron_memguard.report.megatron_era import era_of_table
    from megatron_memguard.report.megatron_log import read_megatron_logs
    from megatron_memguard.report.megatron_run import raw_from_log
    from megatron_memguard.resolve import resolve
    args = megatron.start(BASE)
    log = tmp_path / "rank0.log"
    log.write_text(capsys.readouterr().out)
    parsed = read_megatron_logs(str(log))
    guess = era_of_table(parsed.args)
    assert guess.version == f"{INSTALLED[0]}.{INSTALLED[1]}", guess.reason
    assert args.padded_vocab_size == (128512 if INSTALLED < (0, 18) else 128256)
    layout = resolve(raw_from_log(parsed), world_size=8, megatron_version=guess.version)
    assert layout.padded_vocab_size == args.padded_vocab_size


# Flags memguard ties to a megatron-core release ("needs megatron-core X"): the installed release's parser
# must reject whatever memguard says the release lacks.
GATED = {
    "lion": ["--optimizer", "lion"],
    "soap": ["--optimizer", "soap", "--use-distributed-optimizer"],
    "adaptive-muon": ["--optimizer", "adaptive_muon", "--use-distributed-optimizer"],
    "muon-scalar-lion": ["--optimizer", "muon", "--muon-scalar-optimizer", "lion"],
    "optimizer-cuda-graph": ["--optimizer-cuda-graph", "--use-distributed-optimizer"],
    "full-iteration-graph": ["--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad"],
    "offload-fraction": ["--fine-grained-activation-offloading", "--offload-modules", "core_attn",
                         "--activation-offload-fraction", "0.5"],
}


@pytest.mark.parametrize("name", list(GATED))
def test_what_memguard_says_a_release_lacks_its_parser_lacks(megatron, name):
    from megatron_memguard import layout_from_flags
    from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
    flags = BASE + GATED[name]
    try:
        megatron.parse(flags)
        parser_has = True
    except SystemExit as e:
        assert e.code == 2
        parser_has = False
    try:
        layout_from_flags(flags, world_size=8, megatron_version=VERSION)
        needs = None
    except NotModelledError:
        needs = None           # the release has it; memguard says it does not model it there
    except (ConfigError, ConfigErrors) as e:
        needs = str(e) if "needs megatron-core" in str(e) or "is not a flag of megatron-core" in str(e) else None
    assert not (parser_has and needs), f"megatron-core {VERSION}'s parser takes {GATED[name]}, memguard says: {needs}"
    assert parser_has or needs, f"megatron-core {VERSION}'s parser rejects {GATED[name]}; memguard does not say so"


def test_mtp_position_rule_is_the_releases(megatron):
    """validate_args of 0.17.1, 0.18.2 and 0.19.2 asserts rope or no position embedding with MTP; memguard, for the
    installed release, refuses the same job naming the flag."""
    from megatron_memguard import layout_from_flags
    from megatron_memguard.errors import ConfigError, ConfigErrors
    flags = [f for f in BASE if f not in ("--position-embedding-type", "rope")] + [
        "--position-embedding-type", "learned_absolute", "--mtp-num-layers", "1"]
    with pytest.raises(AssertionError, match="Multi-Token Prediction"):
        megatron.start(flags)
    with pytest.raises((ConfigError, ConfigErrors), match="--mtp-num-layers: needs --position-embedding-type rope or none"):
        layout_from_flags(flags, world_size=8, megatron_version=VERSION)


@pytest.mark.skipif(INSTALLED is not None and INSTALLED < (0, 18), reason="core 0.17.1's validate_args leaves the "
                    "distributed optimizer off; memguard refuses that (0.16.1's first step fails, docs/assumptions.md)")
def test_megatron_fsdp_switches_the_distributed_optimizer_on(megatron, monkeypatch):
    """core 0.18.2 and 0.19.2: --use-megatron-fsdp without --use-distributed-optimizer is switched on by
    validate_args, sharded optim_grads_params by default; memguard resolves the same for the installed release."""
    from megatron_memguard import layout_from_flags
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")      # Megatron-FSDP asserts it is not 1
    flags = BASE + ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
    args = megatron.start(flags)
    assert args.use_distributed_optimizer is True and args.data_parallel_sharding_strategy == "optim_grads_params"
    flat = layout_from_flags(flags, world_size=8, megatron_version=VERSION).to_dict()
    assert flat["use_distributed_optimizer"] is True and flat["data_parallel_sharding_strategy"] == "optim_grads_params"


# A few real flags of 0.18.2's or 0.19.2's parser (tests/test_flag_releases.py names their releases): the installed
# release's argparse rejects the flag exactly when memguard, told that release, refuses it by name.
RELEASE_FLAGS = [["--freeze-all-layers"], ["--megatron-fsdp-max-pool-double-buffer"],
                 ["--use-transformer-engine-op-fuser"], ["--muon-nesterov"], ["--moe-paged-stash"],
                 ["--fp4-param-gather"]]


@pytest.mark.parametrize("flag", RELEASE_FLAGS, ids=lambda f: f[0])
def test_flags_memguard_says_a_release_lacks_are_the_parsers(megatron, flag):
    from megatron_memguard import layout_from_flags
    from megatron_memguard.errors import ConfigError, ConfigErrors
    try:
        megatron.parse(BASE + flag)
        parser_has = True
    except SystemExit as e:
        assert e.code == 2
        parser_has = False
    try:
        layout_from_flags(BASE + flag, world_size=8, megatron_version=VERSION)
        refused = None
    except (ConfigError, ConfigErrors) as e:
        refused = str(e) if f"{flag[0]}: is not a flag of megatron-core" in str(e) else None
    except Exception:
        refused = None            # refused for another reason (its own rule): not a release verdict
    assert parser_has == (refused is None), (VERSION, flag, refused)


def test_megatron_fsdp_checkpoint_format_is_asserted(megatron, monkeypatch):
    """0.17.1, 0.18.2 and 0.19.2 validate_args: assert args.ckpt_format == "fsdp_dtensor" under --use-megatron-fsdp,
    and --ckpt-format defaults to torch_dist: leaving it out stops the job; memguard refuses it by the flag."""
    from megatron_memguard import layout_from_flags
    from megatron_memguard.errors import ConfigError, ConfigErrors
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    flags = BASE + ["--use-megatron-fsdp", "--use-distributed-optimizer"]
    with pytest.raises(AssertionError, match="fsdp_dtensor"):
        megatron.start(flags)
    with pytest.raises((ConfigError, ConfigErrors), match="--ckpt-format fsdp_dtensor"):
        layout_from_flags(flags, world_size=8, megatron_version=VERSION)
