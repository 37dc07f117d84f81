"""Regressions of issue hostile11 (benchmarks/hostile_input.py's hostile11 group): hostile input to the surfaces the
last sessions added (DeepSeek sparse attention, gated delta net, FP8 / FP4 recipes, Bridge's validation section,
NeMo 1 LoRA, Megatron logs for report / calibrate). Each is the smallest input that broke the promise (a value read
silently wrong, or taken where Megatron stops), with what memguard does now."""
from __future__ import annotations

import pytest

from fuzz_util import run_memguard
from megatron_logs import args_of, print_args, report_memory
from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, MemguardError
from megatron_memguard.estimator.layers import dsa as dsa_layer

from test_dsa import BASE as DSA, HYBRID as DSA_HYBRID, TP2
from test_readers_bridge import FLAT


def one_error(o, text: str) -> None:
    assert not o.problems, o.describe()
    lines = [line for line in o.err.splitlines() if line.strip()]
    assert o.code == 2 and len(lines) == 1, (o.code, o.err)
    assert lines[0] == "memguard: error: " + text, lines[0]


def _raises(flags, text: str, **kw) -> None:
    with pytest.raises(MemguardError) as e:
        layout_from_flags(flags, **kw)
    assert text in str(e.value), str(e.value)


# --- --experimental-attention-variant and --dsa-kernel-backend: compared as written ---------------------------------
def test_attention_variant_outside_megatrons_choices_is_refused():
    # TransformerConfig.experimental_attention_variant: Optional[Literal['gated_delta_net', 'dsa']] (0.16.1 and 0.19.2),
    # an argparse choice (training/argument_utils.py _extract_type: Literal -> choices). 'DSA' was read as dsa and
    # estimated; Megatron's argparse stops on it, and a config object's 'DSA' builds no DSA ('dsa' compared with ==)
    for v in ("DSA", " dsa", "Dsa", ""):
        one_error(run_memguard(["estimate", "--world-size", "2", "--", *DSA, *TP2, "--experimental-attention-variant", v]),
                  f"--experimental-attention-variant: must be one of gated_delta_net, dsa (Megatron's choices), got {v!r}")
    one_error(run_memguard(["estimate", "--world-size", "2", "--", *DSA, *TP2, "--dsa-kernel-backend", "None"]),
              "--dsa-kernel-backend: must be one of none, tilelang, cudnn (Megatron's choices), got 'None'")
    # the same through a Bridge config (no argparse: resolve/dsa.py names the rule)
    one_error(run_memguard(["estimate", "--config", "c.yaml", "--gpus", "8", "--set",
                            "model.experimental_attention_variant=DSA"], {"c.yaml": FLAT}),
              "model.experimental_attention_variant: must be one of gated_delta_net, dsa (TransformerConfig's Literal, "
              "compared as written), got 'DSA'")


# --- FP8 / FP4 format and recipe names --------------------------------------------------------------------------------
@pytest.mark.parametrize("sets, text", [
    # fp8_utils.get_fp8_recipe (0.19.2): 'if config.fp8 == "e4m3" ... elif config.fp8 == "hybrid" ... else: raise
    # ValueError("E4M3 and HYBRID are the only supported FP8 formats.")': 'HYBRID' was read as hybrid and estimated
    (["model.fp8=HYBRID"], "model.fp8: must be one of e4m3, hybrid (as written), got 'HYBRID'"),
    # ... 'config.fp8_recipe == Fp8Recipe.delayed' (a str enum: 'DELAYED' matches no member, the else raises)
    (["model.fp8=hybrid", "model.fp8_recipe=DELAYED"],
     "model.fp8_recipe: must be one of delayed, tensorwise, blockwise, mxfp8, custom (as written), got 'DELAYED'"),
    # fp4_utils.get_fp4_recipe: 'config.fp4_recipe == Fp4Recipe.nvfp4'
    (["model.fp4=E2M1"], "model.fp4: must be one of e2m1 (as written), got 'E2M1'"),
    (["model.fp4=e2m1", "model.fp4_recipe=NVFP4"], "model.fp4_recipe: must be one of nvfp4, custom (as written), got 'NVFP4'"),
])
def test_fp8_and_fp4_names_are_compared_as_written(sets, text):
    flat = FLAT.replace("mixed_precision: bf16_mixed\n", "")     # (the preset would overwrite the model's FP8 fields)
    argv = ["estimate", "--config", "c.yaml", "--gpus", "8"]
    for s in sets:
        argv += ["--set", s]
    one_error(run_memguard(argv, {"c.yaml": flat}), text)


# --- DSA top-k above the sequence --------------------------------------------------------------------------------------
def test_dsa_top_k_above_the_sequence_keeps_the_sequence():
    # fused_qk_topk_naive (experimental_attention_variant/dsa.py, 0.19.2): 'topk_k = min(index_topk, sk)'. A top-k of
    # 999,999 at seq 4096 was sized as int64 [1, 4096, 999999] (31 GiB of indices) and a 75 GiB forward transient
    big = layout_from_flags(DSA + TP2 + ["--dsa-indexer-topk", "999999"], world_size=2, megatron_version="0.19")
    full = layout_from_flags(DSA + TP2 + ["--dsa-indexer-topk", "4096"], world_size=2, megatron_version="0.19")
    saved, held = dsa_layer.layer_items(big, False)[:2]
    # no indexer loss (coefficient 0): DSAttention holds the indices [b, s, min(topk, s)] int64 = 1 x 4096 x 4096 x 8
    assert held["indexer_topk"] == 1 * 4096 * 4096 * 8 == 134_217_728
    assert dsa_layer.layer_items(big, False) == dsa_layer.layer_items(full, False)
    a, b = estimate(big, device="cpu").stages[0], estimate(full, device="cpu").stages[0]
    assert a.peak_allocated_bytes == b.peak_allocated_bytes
    # below the sequence nothing changes: [1, 4096, 512] int64
    assert dsa_layer.layer_items(layout_from_flags(DSA + TP2, world_size=2, megatron_version="0.19"), False)[1][
        "indexer_topk"] == 4096 * 512 * 8


# --- gated delta net: the variant flag in a hybrid model -----------------------------------------------------------------
def test_gated_delta_net_variant_in_a_hybrid_model_keeps_transformer_configs_rules():
    # TransformerConfig.__post_init__ (0.19.2) asserts linear_attention_freq and the linear heads' split whenever the
    # variant is gated_delta_net; the hybrid builder ignores the flag. memguard took a hybrid model with the flag and no
    # frequency (or with heads TP does not divide) when the pattern had no 'G'
    base = [*DSA_HYBRID, "--no-rope-fusion", "--mamba-state-dim", "16", "--mamba-head-dim", "32", "--mamba-num-groups", "2"]
    gdn = ["--experimental-attention-variant", "gated_delta_net"]
    _raises([*base, *gdn], "--linear-attention-freq: must be set with --experimental-attention-variant gated_delta_net, "
            "in a hybrid model too (TransformerConfig asserts it)", world_size=1, megatron_version="0.19")
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--linear-num-key-heads", "3",
           "--linear-num-value-heads", "6"]
    _raises([*base, *gdn, "--linear-attention-freq", "4", *tp2], "--linear-num-key-heads: (3) must be a multiple of "
            "the tensor-model-parallel x context-parallel size (2) (TransformerConfig)", world_size=2,
            megatron_version="0.19")
    # without the flag TransformerConfig checks none of it: the same layout resolves (no 'G' layer reads them)
    assert layout_from_flags([*base, *tp2], world_size=2, megatron_version="0.19").tp == 2
    # with the flag and a frequency the hybrid model is the one without the flag (the builder reads the pattern)
    with_flag = layout_from_flags([*base, *gdn, "--linear-attention-freq", "4"], world_size=1, megatron_version="0.19")
    without = layout_from_flags(base, world_size=1, megatron_version="0.19")
    assert estimate(with_flag, device="cpu").stages[0].peak_allocated_bytes == \
        estimate(without, device="cpu").stages[0].peak_allocated_bytes


# --- Megatron logs: negative memory counts -----------------------------------------------------------------------------
SMALL = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
         "--micro-batch-size 2 --global-batch-size 16 --tokenizer-type NullTokenizer --vocab-size 1000 --bf16 "
         "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --use-distributed-optimizer").split()


def _log(allocated_mb: str = "1024.00") -> str:
    head = "\n".join(print_args(args_of(SMALL, 8))) + "\n"
    lines = [report_memory(r, "(after 10 iterations)", 2**30, 2**31, 2**31 + 2**29, 2**31 + 2**30, device_used=2**32)
             for r in range(8)]
    return head + "\n".join(line.replace("allocated: 1024.00", f"allocated: {allocated_mb}") for line in lines) + "\n"


def test_memory_lines_with_negative_counts_are_not_read():
    # torch.cuda.memory_allocated() never goes below zero: '-1' MB was taken as a measurement (calibrate fitted
    # against -25.8 MiB of 'workspace', report printed it), as 1e400 MB already was not
    bad = _log("-1")
    one_error(run_memguard(["report", "run.log"], {"run.log": bad}),
              "run.log: no Megatron memory lines ('[Rank N] (after K iterations) memory (MB) | allocated: ...'); "
              "Megatron's report_memory prints them at the first logged iterations on data-parallel rank 0 of each "
              "model-parallel position, and every --log-memory-interval (8 memory line(s) with numbers no GPU reports, "
              "a negative or out-of-range count, were not read)")
    one_error(run_memguard(["calibrate", "a.log", "b.log", "c.log"], {"a.log": _log(), "b.log": _log(), "c.log": bad}),
              "c.log: no Megatron memory lines ('[Rank N] (after K iterations) memory (MB) | ...') and no "
              "memguard-rank*.jsonl files (8 memory line(s) with numbers no GPU reports, a negative or out-of-range "
              "count, were not read)")
    # beside readable lines: those are read, the others named once
    from megatron_memguard.report.megatron_log import read_megatron_logs
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "run.log")
        with open(p, "w") as f:
            f.write(_log() + bad.split("---\n")[-1])
        log = read_megatron_logs([p])
    assert (len(log.memory), log.bad_memory_lines) == (8, 8)
    assert all(m.allocated == 2**30 for m in log.memory)
    assert any("numbers no GPU reports" in n for n in log.notes)


# --- Megatron-Bridge: a section that is not a mapping ------------------------------------------------------------------
@pytest.mark.parametrize("line, cls", [("validation: x", "ValidationConfig"), ("validation: [1]", "ValidationConfig"),
                                       ("ddp: 5", "DistributedDataParallelConfig")])
def test_a_bridge_section_given_as_a_word_is_refused(line, cls):
    # ConfigContainer (Bridge 0.6.2) declares each section a dataclass: a word there fails on its first attribute.
    # memguard read the section as absent and estimated with its defaults (validation: x; ddp: 5 with DDP defaults)
    value = line.split(": ", 1)[1]
    shown = f"'{value}'" if value.isalpha() else value
    sec = line.split(":")[0]
    one_error(run_memguard(["estimate", "--config", "c.yaml", "--gpus", "8"], {"c.yaml": FLAT + line + "\n"}),
              f"{sec}: must be a mapping of {cls} fields, got {shown} (give the {sec}: section's fields or drop the key)")


# --- NeMo 1 LoRA: an empty target list -----------------------------------------------------------------------------------
def test_nemo1_lora_with_no_target_module_is_refused_in_nemo_1s_words():
    # LoraPEFTConfig (nemo_toolkit 2.2.1 peft_config.py) adds one adapter per listed module: [] adds none. The error
    # spoke of Bridge's rule (an empty list wraps every linear), which NeMo 1 does not have
    pytest.importorskip("omegaconf")
    from test_peft import NEMO1
    text = NEMO1.replace("target_modules: [attention, mlp_fc1]", "target_modules: []")
    one_error(run_memguard(["estimate", "--config", "c.yaml"], {"c.yaml": text}),
              "model.peft.lora_tuning.target_modules: is empty: NeMo 1's LoraPEFTConfig adds an adapter per listed "
              "module, so no parameter would be trained (name the modules, e.g. [attention_qkv])")


def test_config_error_keeps_the_key_for_each_case():
    # (the API raises what the CLI prints: the key the user wrote)
    with pytest.raises(ConfigError) as e:
        layout_from_flags([*DSA, *TP2, "--experimental-attention-variant", "DSA"], world_size=2)
    assert e.value.key == "--experimental-attention-variant"


# --- the job's memory-relevant environment --------------------------------------------------------------------------
def _script(env: str) -> dict[str, str]:
    return {"s.sh": f"export {env}\ntorchrun --nproc-per-node 8 pretrain_gpt.py {' '.join(SMALL)}\n"}


def test_nccl_buffsize_beyond_a_byte_count_is_an_error_naming_it():
    # a 400-digit NCCL_BUFFSIZE was an internal error (OverflowError in calibrate, in the estimate's nccl_buffers), a
    # 42-digit one 6.4e43 bytes of NCCL buffers ('will not fit'); a word or -1 was taken as the default silently
    rule = ("NCCL_BUFFSIZE: must be a byte count from 1 to 1,073,741,824 (decimal or 0x hex; memguard's bound: 256 x "
            "NCCL's 4 MiB default), got ")
    for v, shown in (("9" * 42, "'" + "9" * 42 + "'"), ("0", "'0'"), ("-1", "'-1'"), ("x", "'x'")):
        one_error(run_memguard(["estimate", "--config", "s.sh"], _script(f"NCCL_BUFFSIZE={v}")), rule + shown)
    one_error(run_memguard(["calibrate", "a.log", "b.log", "c.log", "--env", "NCCL_BUFFSIZE=" + "9" * 400],
                           {"a.log": _log(), "b.log": _log(), "c.log": _log()}),
              "a.log: " + rule + "'" + "9" * 24 + "..." + "9" * 24 + "' (400 characters)")
    # NCCL reads it with strtoll(..., 0): 0x800000 is 8 MiB, as 8388608 is (twice the 4 MiB default: 2 x the buffers)
    from megatron_memguard.estimator.overheads import nccl_buffsize, nccl_bytes
    assert nccl_buffsize("0x800000") == nccl_buffsize("8388608") == 8 * 2**20
    base = layout_from_flags(SMALL, world_size=8)
    doubled = layout_from_flags(SMALL, world_size=8, env={"NCCL_BUFFSIZE": "0x800000"})
    assert nccl_bytes(doubled)[0] == 2 * nccl_bytes(base)[0]


def test_cublas_workspace_config_beyond_pytorchs_parse_is_an_error_naming_it():
    # PyTorch (CublasHandlePool.cpp parseChosenWorkspaceSize) reads each ':SIZE:COUNT' number with std::stoi, which
    # throws beyond int32; memguard summed them into a workspace of 10^29 bytes
    one_error(run_memguard(["estimate", "--config", "s.sh"], _script("CUBLAS_WORKSPACE_CONFIG=:4096:" + "9" * 23)),
              "CUBLAS_WORKSPACE_CONFIG: has a number beyond 2,147,483,647 (PyTorch reads each with std::stoi, which "
              "throws), got ':4096:" + "9" * 23 + "'")
    one_error(run_memguard(["estimate", "--config", "s.sh"], _script("CUBLAS_WORKSPACE_CONFIG=:2147483647:2147483647")),
              "CUBLAS_WORKSPACE_CONFIG: asks for more than 1 TiB of cuBLAS workspace (memguard's bound: beyond any GPU's "
              "memory), got ':2147483647:2147483647'")
