"""Regressions found by the structured-mutation fuzz (tests/test_fuzz_structured.py, issue hostile2): each is
the smallest input that broke the promise (a traceback, an internal error, a hang), with the one-line error
memguard now gives."""
from __future__ import annotations

from fuzz_util import run_memguard


def _one_error(o) -> str:
    assert not o.problems, o.describe()
    lines = [line for line in o.err.splitlines() if line.strip()]
    assert o.code == 2 and lines, (o.code, o.err)
    return lines[0]


def test_srun_with_a_lone_dash_as_its_program():
    # found in tests/data/launch/nemo_launcher_gpt3_5b.sbatch with '--no-container-mount-home -': srun's getopt
    # takes a lone '-' as the program (it is no option); memguard indexed its second character
    o = run_memguard(["check", "--file", "run.sh"], {"run.sh": "srun --ntasks 8 - pretrain_gpt.py --num-layers 2\n"})
    assert "cannot understand the launcher '-'" in _one_error(o)


# --- the Megatron hook: a namespace whose fields are not what Megatron's parser leaves ----------------------
def _namespace(shape: str = "legacy 0.16"):
    import copy

    from mutate_util import hook_namespaces
    return copy.deepcopy(hook_namespaces()[shape])


def test_hook_settings_that_argparse_did_not_convert_are_refused_by_flag():
    # a --memguard* value in the namespace that is not what the flag's type gives (set by other code than
    # argparse): ArgumentTypeError escaped validate_args with a traceback; now pretrain_gpt.py's one-line error
    from mutate_util import run_hook
    for field, value, flag in (("memguard_threshold", "abc", "--memguard-threshold"),
                               ("memguard_log_interval", "abc", "--memguard-log-interval"),
                               ("memguard_threshold", float("nan"), "--memguard-threshold"),
                               ("memguard_profile", {"a": 1}, "--memguard-profile"),
                               ("memguard", True, "--memguard")):
        ns = _namespace()
        setattr(ns, field, value)
        o = run_hook(ns)
        assert o.problems(mutated_settings=True) == [], (field, value, o)
        assert o.exit2.startswith("pretrain_gpt.py: error: " + flag + ": invalid "), o.exit2


def test_hook_setting_of_none_is_its_default():
    from mutate_util import run_hook
    ns = _namespace()
    ns.memguard, ns.memguard_threshold = None, None
    o = run_hook(ns)
    assert o.problems(mutated_settings=True) == [] and o.carried_on and o.action == "fits", o


def test_hook_rank_that_is_no_integer():
    # args.rank = {} (not what Megatron sets): int({}) was an internal error; the check does not depend on it
    from mutate_util import run_hook
    for rank in ({}, [0], "abc", float("nan")):
        ns = _namespace()
        ns.rank = rank
        o = run_hook(ns)
        assert o.problems(mutated_settings=False) == [] and o.action == "fits", (rank, o)


def test_hook_list_where_megatron_takes_one_value():
    # tokenizer_type: [1, 2] in a --yaml-cfg namespace reached the Layout, whose hash failed ('unhashable type:
    # list'): an internal error; now the setting is refused by name and training goes on unchecked
    from mutate_util import run_hook
    ns = _namespace("yaml-cfg")
    ns.tokenizer_type = [1, 2]
    o = run_hook(ns)
    assert o.problems(mutated_settings=False) == [] and o.action == "unsupported", o
    assert any("tokenizer_type: must be a single value, got [1, 2]" in line for line in o.emitted), o.emitted


def test_config_path_with_a_nul_character():
    # found as --config '\x00' (a path read from a file can hold one): os.open raised ValueError ('embedded
    # null byte'), an internal error; every reader's file goes through files.read_bytes
    for argv in (["estimate", "--config", "a\x00b"], ["estimate", "--world-size", "8", "--", "--yaml-cfg", "a\x00b"]):
        o = run_memguard(argv)
        assert "'a\\x00b': not a file name (it holds a NUL character)" in _one_error(o)


def test_plan_with_an_ffn_narrower_than_tensor_parallel():
    # nemo-launcher llama2-7b with ffn_hidden_size = its tensor_model_parallel_size (1): the planner timed TP 2,
    # whose FC1 has 1 // 2 = 0 columns per rank, and divided by the GEMM's zero tiles
    flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 1 --seq-length 128 "
             "--max-position-embeddings 128 --tokenizer-type NullTokenizer --vocab-size 100 --bf16").split()
    o = run_memguard(["plan", "--gpus", "2", "--seq-length", "128", "--global-batch-size", "8", "--tp", "2", "--", *flags])
    assert not o.problems and o.code in (0, 1), o.describe()
    from megatron_memguard.gpus import lookup_gpu
    from megatron_memguard.planner.kernels import gemm_seconds
    assert gemm_seconds(4096, 0, 64, lookup_gpu("H100-80GB")) == 0.0   # no columns: no work


def test_hook_site_profile_that_cannot_be_read():
    # memguard_profile = 'abc' in the namespace (no such file; argparse checks the flag's file, other code may
    # set the field, or the file may go between parsing and validation): an internal error; now the check says
    # why it cannot estimate and training goes on
    from mutate_util import run_hook
    ns = _namespace()
    ns.memguard_profile = "abc"
    o = run_hook(ns)
    assert o.problems(mutated_settings=True) == [] and o.action == "unsupported" and o.carried_on, o
    assert any("--memguard-profile: cannot read site profile: abc: no such file" in line and "training continues" in line
               for line in o.emitted), o.emitted


def test_nemo_archive_of_empty_members():
    # a .nemo of a few KiB: an xz tar of identical empty members (200,000 in 15 KiB took 5 s of CPU and every
    # member's TarInfo in memory; a 1 MB one, minutes); the reader stops after MAX_NEMO_MEMBERS
    import lzma
    import tarfile

    from megatron_memguard.readers.detect import MAX_NEMO_MEMBERS
    ti = tarfile.TarInfo("model_weights/a.distcp")
    archive = lzma.compress(ti.tobuf(format=tarfile.GNU_FORMAT) * 30_000 + b"\0" * 1024, preset=0)
    assert len(archive) < 20_000
    o = run_memguard(["estimate", "--config", "model.nemo", "--gpus", "8"], {"model.nemo": archive}, cpu_limit=2.0)
    assert f"no model_config.yaml in the first {MAX_NEMO_MEMBERS:,} members of this .nemo archive" in _one_error(o)


def test_megatron_flag_with_a_unicode_dash_is_refused():
    # '—tensor-model-parallel-size 2' (an em dash pasted from a document) was a note, 'ignored stray argument', and
    # the estimate went on with TP 1; Megatron's argparse exits on it ('unrecognized arguments'), so memguard refuses
    # it by name, in flags after '--' and in launch scripts alike
    flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
             "--micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 100").split()
    for dash, name in (("\u2014", "em dash (U+2014)"), ("\u2013", "en dash (U+2013)"), ("\u2212\u2212", "minus sign (U+2212)")):
        o = run_memguard(["estimate", "--world-size", "2", "--", *flags, dash + "tensor-model-parallel-size", "2"])
        assert _one_error(o) == (f"memguard: error: {dash}tensor-model-parallel-size: starts with {name}, not '--': "
                                 "Megatron's argparse does not recognise it and exits (write --tensor-model-parallel-size)")
    script = "torchrun --nproc-per-node 2 pretrain_gpt.py " + " ".join(flags) + " \u2014sequence-parallel\n"
    o = run_memguard(["check", "--file", "run.sh"], {"run.sh": script})
    assert "\u2014sequence-parallel: starts with em dash (U+2014)" in _one_error(o)
    o = run_memguard(["estimate", "--world-size", "2", "--", *flags, "\u2014not-a-megatron-flag"])   # no flag: a note
    assert o.code == 0 and not o.problems


def test_validate_stray_argument_of_100000_characters_is_cut():
    # 'memguard validate FILE X...' with a second, long positional (a value moved off its option): the error
    # printed it whole, a stderr line of 100,056 characters
    o = run_memguard(["validate", "c.yaml", "x" * 100_000])
    assert _one_error(o) == ("memguard validate: error: 'xxxxxxxxxxxxxxxxxxxxxxxx...xxxxxxxxxxxxxxxxxxxxxxxx' "
                             "(100000 characters) is not a KEY=VALUE override")


def test_bridge_list_option_holding_a_mapping():
    # a Megatron-Bridge run_config with recompute_modules: [core_attn, {a: 1}] (found through bridge.preflight):
    # the mapping reached 'm not in RECOMPUTE_MODULES', unhashable, an internal error; now refused by key
    import textwrap

    from test_readers_bridge import FLAT
    text = textwrap.dedent(FLAT).replace("  bf16: true\n", "  bf16: true\n  recompute_granularity: selective\n"
                                         "  recompute_modules: [core_attn, {a: 1}]\n", 1)
    o = run_memguard(["estimate", "--config", "run_config.yaml", "--gpus", "8"], {"run_config.yaml": text})
    assert _one_error(o) == "memguard: error: model.recompute_modules: must be a list of values, got ['core_attn', {'a': 1}]"
