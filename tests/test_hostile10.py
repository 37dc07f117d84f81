"""Regressions of issue hostile10 (benchmarks/hostile_input.py's hostile10 group): hostile input to what landed last
(NeMo 2 / Bridge PEFT wildcards, --cp-comm-type, attention backends, plan's cluster speeds, NeMo 1 optimizer nulls,
the Megatron hook and its runtime monitor). Each is the smallest input that broke the promise (a hang, an internal
error, or a value taken silently), with what memguard does now."""
from __future__ import annotations

import types

import pytest

from fuzz_util import YAML_SEEDS, run_memguard

PLAN = ["plan", "--gpus", "8", "--seq-length", "2048", "--global-batch-size", "64", "--model", "llama-3.2-1b"]


def one_error(o, text: str) -> None:
    assert not o.problems, o.describe()
    lines = [line for line in o.err.splitlines() if line.strip()]
    assert o.code == 2 and len(lines) == 1, (o.code, o.err)
    assert lines[0] == "memguard: error: " + text, lines[0]


# --- '*' patterns in PEFT target_modules ------------------------------------------------------------------------
from test_peft_nemo2 import LLAMA3_8B_LORA  # noqa: E402


def _targets(targets: str, cpu_limit: float | None = None):
    return run_memguard(["estimate", "--json", "--config", "ft.yaml"], {"ft.yaml": LLAMA3_8B_LORA + f"  target_modules: "
                                                                       f"{targets}\n"}, cpu_limit=cpu_limit)


def test_a_star_pattern_that_matches_nothing_is_refused_at_once():
    # '^' + '(.*)' per star + '$' (Bridge 0.6.2 / NeMo 2.5 peft/utils.py wildcard_match): Python's re backtracks through
    # every split of a 60-character module name among 17 groups before it fails; memguard ran past 60 s on it
    o = _targets("['*" + ".*" * 16 + "Z']", cpu_limit=2.0)
    one_error(o, "peft.target_modules: PEFT target '*" + ".*" * 16 + "Z': it matches none of linear_qkv, linear_proj, "
                 "linear_fc1, linear_fc2 is not modelled yet; memguard will not guess its memory")


def test_regex_syntax_beside_stars_is_refused_by_name():
    one_error(_targets("['*linear_qkv|linear_proj']"),
              "peft.target_modules: PEFT target '*linear_qkv|linear_proj': regular-expression syntax (|) beside '*' and "
              "'.'; memguard matches Bridge's '*' wildcards and '.' only is not modelled yet; memguard will not guess its memory")
    one_error(_targets("['(*']"), "peft.target_modules: '(*' is not a valid pattern (missing ), unterminated subpattern "
                                  "at position 1)")


def test_anchors_the_frameworks_add_anyway_keep_their_meaning():
    import json
    # '^' + '^(.*)linear_qkv' + '$' and '(.*).linear_qkv$' + '$' match what '*linear_qkv' matches: every layer's qkv
    for targets in ("['^*linear_qkv']", "['*.linear_qkv$']"):
        o = _targets(targets)
        assert o.code in (0, 1) and not o.problems, o.describe()
        assert json.loads(o.out)["layout"]["peft"]["target_modules"] == ["linear_qkv"]


# --- memguard plan's cluster speeds and --explain ---------------------------------------------------------------
def test_plan_cluster_speeds_out_of_physical_bounds():
    one_error(run_memguard([*PLAN, "--gemm-efficiency", "5e-324"]),   # (a ZeroDivisionError before)
              "--gemm-efficiency: must be at least 0.01 of peak (memguard's bound: an H100's fp32 CUDA cores alone reach "
              "6.8% of its bf16 tensor-core peak), got 5e-324")
    one_error(run_memguard([*PLAN, "--attention-efficiency", "1e-308"]),   # (steps of 10**300 s before)
              "--attention-efficiency: must be at least 0.01 of peak (memguard's bound: an H100's fp32 CUDA cores alone "
              "reach 6.8% of its bf16 tensor-core peak), got 1e-308")
    for v in ("inf", "1e308", "0.5"):
        one_error(run_memguard([*PLAN, "--network-gbps", v]),
                  "--network-gbps: must be from 1 to 72,000 Gb/s per GPU (memguard's bounds: 1 Gb/s Ethernet; 10 x "
                  f"NVLink 5's 7,200 Gb/s per GPU and direction), got {float(v)!r}")


def test_plan_explain_refuses_a_key_given_twice():
    # tp=1,tp=2 explained TP 2 without a word
    one_error(run_memguard([*PLAN, "--explain", "tp=1,tp=2"]), "--explain: tp is given twice ('tp=1' and 'tp=2')")
    one_error(run_memguard([*PLAN, "--explain", "rc=full,recompute=none"]),
              "--explain: recompute is given twice ('rc=full' and 'recompute=none')")


# --- NeMo 1 optimizer keys --------------------------------------------------------------------------------------
NEMO1 = dict((n, t) for n, t, _ in YAML_SEEDS)["nemo1_llama.yaml"]


def _nemo1(*sets: str):
    argv = ["estimate", "--config", "c.yaml", "--vocab-size", "32000"]
    for s in sets:
        argv += ["--set", s]
    return run_memguard(argv, {"c.yaml": NEMO1})


@pytest.mark.parametrize("name", ["fused_adam", "distributed_fused_adam", "mcore_distributed_optim"])
def test_nemo1_null_distributed_optimizer_instances(name):
    # NeMo 2.5.0 megatron_base_model.py passes cfg.optim.get('num_distributed_optimizer_instances', 1) -- None for a
    # null -- to initialize_model_parallel_for_nemo for every optimizer; megatron-core 0.16.1 parallel_state.py then
    # computes (DP x CP) % None and the run stops
    one_error(_nemo1(f"model.optim.name={name}", "model.optim.num_distributed_optimizer_instances=null"),
              "model.optim.num_distributed_optimizer_instances: is null: NeMo passes None to megatron-core's "
              "initialize_model_parallel, which fails at start-up ((DP x CP) % None), not its default 1 (set "
              "model.optim.num_distributed_optimizer_instances=1 or drop the key)")


def test_nemo1_overlap_switches_take_true_or_false():
    # NeMo hands the value to DistributedDataParallelConfig as it is (a word is true there); memguard read 'x' as false
    one_error(_nemo1("model.optim.name=mcore_distributed_optim", "model.optim.overlap_grad_sync=x"),
              "model.optim.overlap_grad_sync: must be true or false, got 'x'")
    one_error(_nemo1("model.optim.name=distributed_fused_adam", "model.optim.overlap_param_sync=[1]"),
              "model.optim.overlap_param_sync: must be true or false, got [1]")


# --- --cp-comm-type and attention_backend -----------------------------------------------------------------------
from test_readers_bridge import FLAT  # noqa: E402


def _bridge(*sets: str):
    argv = ["estimate", "--config", "c.yaml", "--gpus", "8"]
    for s in sets:
        argv += ["--set", s]
    return run_memguard(argv, {"c.yaml": FLAT})


def test_cp_comm_types_transformer_engine_lacks():
    # TE 2.11 / 2.20.2 attn_forward_func_with_cp: "Unsupported communication type" for any other; memguard sized them
    # as the p2p ring
    for v, shown in (("flash", "'flash'"), ("A2A", "'A2A'"), ("7", "7")):
        one_error(_bridge("model.context_parallel_size=2", f"model.cp_comm_type={v}"),
                  f"model.cp_comm_type: unknown communication type {shown} (Transformer Engine takes p2p, all_gather, a2a, "
                  "a2a+p2p)")
    flags = ("--num-layers 4 --hidden-size 768 --num-attention-heads 12 --seq-length 4096 --max-position-embeddings 4096 "
             "--micro-batch-size 1 --global-batch-size 16 --tokenizer-type NullTokenizer --vocab-size 1000 --bf16 "
             "--context-parallel-size 2").split()
    one_error(run_memguard(["estimate", "--world-size", "8", "--", *flags, "--cp-comm-type", "allgather"]),
              "--cp-comm-type: unknown communication type 'allgather' (Transformer Engine takes p2p, all_gather, a2a, "
              "a2a+p2p) (write all_gather)")
    # megatron-core 0.16.1 / 0.19.2 TransformerConfig.__post_init__: a list has one type per layer
    one_error(run_memguard(["estimate", "--world-size", "8", "--", *flags, "--cp-comm-type", "p2p", "p2p", "p2p"]),
              "--cp-comm-type: gives 3 communication types for 4 layers (megatron-core's TransformerConfig asserts one "
              "per layer, or a single type)")
    one_error(_bridge("model.context_parallel_size=2", "model.cp_comm_type=[]"),
              "model.cp_comm_type: gives 0 communication types for 4 layers (megatron-core's TransformerConfig asserts "
              "one per layer, or a single type)")
    # without context parallelism Megatron never reads it
    o = _bridge("model.cp_comm_type=flash")
    assert o.code in (0, 1) and not o.problems, o.describe()


def test_an_attention_backend_that_is_no_attnbackend():
    one_error(_bridge("model.attention_backend={_target_: x}"),
              "model.attention_backend: expects an AttnBackend (flash, fused, unfused, local, auto), got {'_target_': 'x'}")


def test_muon_choices_of_megatrons_argparse():
    from fuzz_util import SMALL
    one_error(run_memguard(["estimate", "--world-size", "8", "--", *SMALL, "--optimizer", "muon", "--muon-scale-mode", "x"]),
              "--muon-scale-mode: must be one of spectral, unit_rms_norm, shape_scaling (Megatron's choices), got 'x'")


# --- the Megatron hook and its runtime monitor ------------------------------------------------------------------
class _Raising(types.SimpleNamespace):
    """A namespace whose --memguard* attributes raise when read (a framework's lazy config object)."""

    def __getattribute__(self, name):
        if name.startswith("memguard"):
            raise KeyError(name)
        return super().__getattribute__(name)


def test_the_hook_goes_on_when_reading_its_settings_raises():
    from megatron_memguard.megatron import hook
    from megatron_memguard.runtime.reporting import ErrorReporter
    lines, calls = [], []
    saved = (hook.STATE.error, hook.STATE.decision)
    hook.STATE.error = ErrorReporter(lines.append, prefix="[memguard]")
    try:
        ns = _Raising(num_layers=4)
        out = hook._wrap_validate(lambda args, defaults=None: calls.append(args) or args)(ns, {})
    finally:
        hook.STATE.error, hook.STATE.decision = saved
    # Megatron's validate_args ran once on the same namespace; one line says memguard is out of the way
    assert out is ns and calls == [ns]
    assert lines == ["[memguard] internal error in reading the --memguard settings (KeyError: 'memguard'); training "
                     "continues without it, further memguard errors are counted silently"]


@pytest.mark.parametrize("field, value, shown", [("max_allocated", float("nan"), "nan"),
                                                 ("max_allocated", float("inf"), "inf"),
                                                 ("allocated", -5, "-5"), ("device_used", True, "True"),
                                                 ("reserved", 2**64, str(2**64)), ("max_reserved", 1.5, "1.5")])
def test_a_memory_source_returning_garbage_gives_no_verdict(field, value, shown):
    from test_runtime_monitor import Collect, monitor, reading
    from megatron_memguard.runtime import StaticSource
    r = reading(2.0)     # twice the predicted peak: a real reading like it warns
    c = Collect()
    m = monitor(StaticSource(type(r)(**{**r.to_dict(), field: value})), c, interval=1)
    for it in (1, 2, 3):
        m.step(it)
    s = m.finish()
    # nan gave "max allocated nan B exceeds the predicted 48.83 GiB by nan%"; -5 a negative peak in the summary
    assert m.warned is None and m.samples == 0 and s["max"] == {"max_allocated": None, "max_reserved": None,
                                                                "device_used": None}
    assert c.lines[0] == (f"[memguard] rank 3: internal error in source read (ValueError: the memory source's {field} is "
                          f"{shown}, not a byte count (0 to 2**63)); training continues without it, further memguard "
                          "errors are counted silently")
    assert m.errors == 3


# --- NeMo 2 PEFT '???' ------------------------------------------------------------------------------------------
def test_nemo2_peft_left_at_the_missing_marker():
    # a checkpoint's model_transform: '???' was read as no PEFT: a full fine-tuning estimate of a LoRA run
    ckpt = ("_target_: nemo.collections.llm.gpt.model.llama.LlamaModel\nconfig:\n  _target_: "
            "nemo.collections.llm.gpt.model.llama.Llama3Config8B\n  seq_length: 2048\nmodel_transform: '???'\n")
    one_error(run_memguard(["estimate", "--config", "model.yaml", "--world-size", "8", "--", "--micro-batch-size", "1",
                            "--global-batch-size", "64"], {"model.yaml": ckpt}),
              "model_transform: is ??? (OmegaConf's missing marker): NeMo 2 rebuilds the config with the text '???' as "
              "the value, not a default (set model_transform=lora (or dora, none))")
    # a field at '???' said 'is null'
    one_error(_targets_text(LLAMA3_8B_LORA.replace("  dim: 8\n", "  dim: '???'\n")),
              "peft.dim: is ??? (OmegaConf's missing marker): NeMo 2 rebuilds the config with the text '???' as the "
              "value, not a default, and LoRA cannot build the adapters with it (drop peft.dim or give a value)")


def _targets_text(text: str):
    return run_memguard(["estimate", "--config", "ft.yaml"], {"ft.yaml": text})
