"""``--attention-backend auto``: the kernel Transformer Engine runs on the GPU, by hand from the source.

Sources: TE 2.11 and 2.20.2 ``pytorch/attention/dot_product_attention/utils.py`` ``get_attention_backend``
("Disabling FlashAttention to give FusedAttention preference on Hopper+" when both run and compute
capability >= 9.0; FlashAttention 2's head-dim / MLA / softmax-type / FP8 filters; TE 2.11's "Disabling
FusedAttention for determinism reasons on Blackwell", gone from TE 2.12); megatron-core 0.16.1 / 0.19.2
``language_module.py`` ``_set_attention_backend`` (auto leaves all three NVTE_*_ATTN at 1) and TE 2.11
``backends.py`` FlashAttention.forward for the tensors flash-attn keeps (see test_fp8_saved_original.py).
Measured: the A100 records of Megatron's CI (shared/groundtruth/megatron-functional-dev.jsonl)."""
import json
import os
import statistics
import sys

import pytest

from megatron_memguard import estimate, layout_from_flags, lookup_gpu
from megatron_memguard.cli.main import main
from megatron_memguard.estimator.attention_backend import select

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

MIB = 2**20
DET = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
# Llama-3.1-8B shape (32 heads, 8 query groups, head dim 128), TP 2, micro-batch 1, seq 4096, BF16
LLAMA = ["--num-layers", "4", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
         "--group-query-attention", "--num-query-groups", "8", "--seq-length", "4096", "--max-position-embeddings",
         "4096", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--vocab-size", "128256", "--bf16",
         "--tensor-model-parallel-size", "2", "--micro-batch-size", "1", "--global-batch-size", "8",
         "--use-distributed-optimizer"]


def lay(*extra, version=None, env=None):
    return layout_from_flags(LLAMA + list(extra), world_size=8, megatron_version=version, env=env)


@pytest.mark.parametrize("gpu, selected", [("A100-40GB", "flash"), ("A100-80GB", "flash"), ("H100-80GB", "fused"),
                                           ("H200-141GB", "fused"), ("B200", "fused"), ("GB200", "fused")])
@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
def test_auto_follows_the_compute_capability(gpu, selected, version):
    # sm80 keeps flash-attn 2, sm90 / sm100 prefer cuDNN when both run (both TE releases)
    choice = select(lay(version=version), lookup_gpu(gpu))
    assert (choice.requested, choice.selected) == ("auto", selected)
    assert ("sm80" if selected == "flash" else "sm") in choice.why


def test_unknown_gpu_keeps_fused_with_a_note():
    L = lay()
    for gpu in (None, lookup_gpu("MI300X")):
        assert select(L, gpu).selected == "fused"
    est = estimate(L)
    assert est.attention.selected == "fused"
    assert any(n.startswith("attention backend: auto: the GPU is unknown") for n in est.notes)
    assert not any("attention backend" in n for n in estimate(L, gpu=lookup_gpu("A100")).notes)


@pytest.mark.parametrize("extra", [["--attention-backend", "fused"], ["--attention-backend", "unfused"],
                                   ["--attention-backend", "flash"]])
def test_explicit_backends_are_kept_on_every_gpu(extra):
    for gpu in ("A100", "H100", None):
        choice = select(lay(*extra), lookup_gpu(gpu) if gpu else None)
        assert choice.selected == choice.requested == extra[1]


def test_local_spec_is_local():
    assert select(lay("--transformer-impl", "local"), lookup_gpu("A100")).selected == "local"


@pytest.mark.parametrize("extra, why", [
    (["--softmax-type", "off-by-one"], "no off-by-one softmax"),     # flash-attn: vanilla softmax only
    (["--kv-channels", "136"], "head dim"),                          # flash-attn 2 takes 136 (sm80); cuDNN on sm80
    (["--flash-attention-version", "3"], "--flash-attention-version 3"),   # FA3 runs on sm90 only
])
def test_a100_falls_back_to_cudnn_where_flash_attn_2_cannot_run(extra, why):
    choice = select(lay(*extra), lookup_gpu("A100"))
    if extra[1] == "136":
        # head dim 136: flash-attn 2 runs it (a multiple of 8, <= 256), so an A100 keeps flash
        assert choice.selected == "flash"
        return
    assert choice.selected == "fused" and why in choice.why


# Where neither flash-attn nor cuDNN runs, TE runs UnfusedDotProductAttention. fp32: "Filter: Data type" in
# get_attention_backend (TE 2.11 and 2.20.2 pytorch/attention/dot_product_attention/utils.py) keeps flash-attn
# and FusedAttention to bf16/fp16. Head dims: flash-attn 2's python filter (multiple of 8, <= 256) and the
# compiled cuDNN query (nvte_get_fused_attn_backend of the transformer_engine_cu12 2.11.0 wheel, called on a CPU
# with a stubbed CUDA runtime, bf16, sbhd, causal, GQA 32/8, s 4096, training, cuDNN 9.8 / 9.11 / 9.14):
# No_Backend (-1) for head dims 100, 264 and 320 on sm80, sm90 and sm100; MLA 192/128 and 136/128: -1 on sm80.
@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
@pytest.mark.parametrize("gpu", ["A100", "H100", "H200", "B200", "GB200", None])
def test_fp32_runs_te_unfused_on_every_gpu(gpu, version):
    L = layout_from_flags([f for f in LLAMA if f != "--bf16"], world_size=8, megatron_version=version)
    choice = select(L, lookup_gpu(gpu) if gpu else None)
    assert (choice.requested, choice.selected) == ("auto", "unfused") and "fp32" in choice.why


@pytest.mark.parametrize("kv", ["100", "264", "320"])
@pytest.mark.parametrize("gpu", ["A100", "H100", "B200"])
def test_head_dims_no_fused_kernel_takes_run_te_unfused(gpu, kv):
    # TE 2.11 (megatron-core 0.16): No_Backend for 100, 264 and 320 on sm80, sm90 and sm100 (the query above)
    choice = select(lay("--kv-channels", kv, version="0.16.1"), lookup_gpu(gpu))
    assert choice.selected == "unfused" and f"kv_channels {kv}" in choice.why
    # TE 2.20.2: the same (its query, benchmarks/te_attention_query.py: the cuDNN-frontend checks reject them on sm80
    # and sm90; on sm100 264 and 320 pass the checks, and then no cuDNN plan serves them: the frontend's
    # override_heuristics_query says only its opt-in SM100 engine does)
    later = select(lay("--kv-channels", kv, version="0.19.2"), lookup_gpu(gpu))
    assert later.selected == "unfused" and f"kv_channels {kv}" in later.why


def test_head_dim_256_is_not_unfused():
    # flash-attn 2 runs 256 on sm80 / sm100 and cuDNN on sm90 (the same query: F16_arbitrary_seqlen on sm90)
    assert select(lay("--kv-channels", "256"), lookup_gpu("A100")).selected == "flash"
    assert select(lay("--kv-channels", "256"), lookup_gpu("H100")).selected == "fused"


# Blackwell, equal head dims above 128: the compiled query has no training backend on sm100 for 136 ... 256, in both
# TE releases (TE 2.11.0's C++ table, cuDNN 9.11 / 9.14 / 9.18 / 9.23: No_Backend for 136, 160, 192, 224, 256 on
# sm100 and sm103, F16_arbitrary_seqlen for 64 and 128; TE 2.20.2's query, cuDNN 9.18.1 / 9.20: "Num hidden_dim
# should be less than or equal to 128 and hidden_dim should be multiple of 8 when d_qk != d_v, unless both head dims
# are in (256, 512]"), while sm90 takes them up to 256 ("... less than or equal to 256"). flash-attn 2 takes them on
# sm100 (TE 2.11 / 2.20.2 utils.py: head dim <= 256, above 192 on sm80/90/100/120), so TE runs flash-attn 2 there.
@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
@pytest.mark.parametrize("kv", ["136", "160", "192", "224", "256"])
def test_blackwell_head_dims_above_128_run_flash_attn(kv, version):
    L = lay("--kv-channels", kv, version=version)
    for gpu in ("B200", "GB200"):
        choice = select(L, lookup_gpu(gpu))
        assert choice.selected == "flash" and "sm100" in choice.why and f"kv_channels {kv}" in choice.why
    assert select(L, lookup_gpu("H100")).selected == "fused"
    assert select(lay("--kv-channels", "128", version=version), lookup_gpu("B200")).selected == "fused"


def test_blackwell_head_dim_160_keeps_flash_attn_tensors():
    # auto on a B200 is the explicit flash estimate; flash-attn's contiguous q, k, v per TP rank:
    # 4096 tokens x (16 + 2 x 4 heads) x 160 x 2 B = 30 MiB, its [b, s, h, d] output 4096 x 16 x 160 x 2 B = 20 MiB
    from megatron_memguard.estimator.activations import layer_activations
    b200 = lookup_gpu("B200")
    L = lay("--kv-channels", "160")
    est = estimate(L, gpu=b200)
    assert est.attention.selected == "flash"
    assert [s.peak_allocated_bytes for s in est.stages] == \
        [s.peak_allocated_bytes for s in estimate(L.replace(attention_backend="flash"), gpu=b200).stages]
    saved = layer_activations(L.replace(attention_backend="flash")).saved
    assert saved["flash_qkv"] == 30 * MIB and saved["attention_output_bshd"] == 20 * MIB


MLA = ["--multi-latent-attention", "--q-lora-rank", "256", "--kv-lora-rank", "128", "--qk-head-dim", "128",
       "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128"]


def mla(*extra, version):
    # the Llama shape without GQA (mutually exclusive with MLA) and with MLA's head dims
    i = LLAMA.index("--group-query-attention")
    flags = LLAMA[:i] + LLAMA[i + 3:]          # drop --group-query-attention --num-query-groups 8
    return layout_from_flags(flags + list(extra), world_size=8, megatron_version=version)


def test_mla_on_an_a100_runs_te_unfused_under_te_211():
    # TE 2.11 (megatron-core 0.16): flash-attn 2 only for equal head dims, and cuDNN has no sm80 training
    # backend for 192/128 (the compiled query above)
    L16 = mla(*MLA, version="0.16.1")
    choice = select(L16, lookup_gpu("A100"))
    assert choice.selected == "unfused" and "MLA 192/128" in choice.why
    assert select(L16, lookup_gpu("H100")).selected == "fused"
    # head dims up to 128 keep cuDNN on sm80 (the query: 96/64 -> F16_arbitrary_seqlen)
    small = mla("--multi-latent-attention", "--q-lora-rank", "256", "--kv-lora-rank", "128", "--qk-head-dim", "64",
                "--qk-pos-emb-head-dim", "32", "--v-head-dim", "64", version="0.16.1")
    assert select(small, lookup_gpu("A100")).selected == "fused"
    est = estimate(L16, gpu=lookup_gpu("A100"))
    assert est.attention.selected == "unfused"
    assert est.stages[0].peak_allocated_bytes > estimate(L16, gpu=lookup_gpu("H100")).stages[0].peak_allocated_bytes


def test_mla_on_an_a100_runs_padded_flash_attn_under_te_220():
    # TE 2.20.2 (megatron-core >= 0.17): get_attention_backend checks flash-attn 2 at the padded head dim
    # max(192, 128) = 192 (utils.py fa2_padded_head_dim) and prefers it below sm90; the same holds for MLA head dims
    # cuDNN takes on sm80 (96/64: flash-attn 2 too)
    a100 = lookup_gpu("A100")
    L = mla(*MLA, version="0.19.2")
    choice = select(L, a100)
    assert choice.selected == "flash" and "padded" in choice.why
    small = mla("--multi-latent-attention", "--q-lora-rank", "256", "--kv-lora-rank", "128", "--qk-head-dim", "64",
                "--qk-pos-emb-head-dim", "32", "--v-head-dim", "64", version="0.19.2")
    assert select(small, a100).selected == "flash"
    # Hopper and Blackwell keep cuDNN (it has 192/128 there: sm90 up to 256, sm100 192/128 from cuDNN 9.11)
    assert select(L, lookup_gpu("H100")).selected == select(L, lookup_gpu("B200")).selected == "fused"


def test_padded_flash_attn_keeps_the_padded_tensors():
    # TE 2.20.2 dot_product_attention.py _pad_qkv_head_dim pads v [s, b, 16 heads, 128] to 192; FlashAttention.forward
    # copies q, k, v to contiguous [b, s, h, 192] (backends.py), kept by flash-attn with its [b, s, h, 192] output:
    # 4096 tokens x 16 heads (32 / TP 2) x 192 x 2 B = 24 MiB each; _trim_output gives linear_proj a new [s, b, h 128]
    # tensor, 4096 x 16 x 128 x 2 B = 16 MiB. The rope'd query / key (24 MiB each) and value (16 MiB) are kept by
    # no one.
    from megatron_memguard.estimator.activations import layer_activations
    L = mla(*MLA, version="0.19.2")
    flash = layer_activations(L.replace(attention_backend="flash")).saved
    fused = layer_activations(L.replace(attention_backend="fused")).saved
    assert flash["flash_qkv"] == 3 * 24 * MIB and flash["attention_output_bshd"] == 24 * MIB
    assert flash["proj_input"] == fused["proj_input"] == 16 * MIB
    assert (fused["query"], fused["key"], fused["value"]) == (24 * MIB, 24 * MIB, 16 * MIB)
    assert not {"query", "key", "value"} & set(flash)
    assert flash["softmax_stats"] == fused["softmax_stats"] == 16 * 4096 * 4
    # what changes is 72 + 24 MiB against 24 + 24 + 16 = 64 MiB per layer
    assert sum(flash.values()) - sum(fused.values()) == (72 + 24 - 64) * MIB
    a100 = lookup_gpu("A100")
    peak = lambda L: [s.peak_allocated_bytes for s in estimate(L, gpu=a100).stages]  # noqa: E731
    assert peak(L) == peak(L.replace(attention_backend="flash"))
    # an explicit fused has no kernel there: the compiled query gives No_Backend for MLA 192/128 on sm80 (TE 2.20.2,
    # benchmarks/results/te-attention-query.md), and Megatron's fused backend switches flash and unfused off
    from megatron_memguard.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        estimate(L.replace(attention_backend="fused"), gpu=a100)
    assert e.value.key == "--attention-backend" and "MLA 192/128" in str(e.value) and e.value.megatron_fails_later


@pytest.mark.parametrize("version, selected", [("0.16.1", "unfused"), ("0.19.2", "flash")])
def test_mla_head_dims_cudnn_cannot_train_on_blackwell(version, selected):
    # MLA 160/128 (qk 128 + rope 32): the compiled query has no sm100 backend (only 192/128 and both <= 128; TE 2.11.0
    # and 2.20.2 alike), so TE 2.11 (no flash-attn for MLA) runs its unfused attention and TE 2.20.2 flash-attn 2 at
    # the padded head dim 160
    L = mla("--multi-latent-attention", "--q-lora-rank", "256", "--kv-lora-rank", "128", "--qk-head-dim", "128",
            "--qk-pos-emb-head-dim", "32", "--v-head-dim", "128", version=version)
    assert select(L, lookup_gpu("B200")).selected == selected
    # sm90: TE 2.11's table has no backward for MLA with both head dims >= 128 but 192/128 from cuDNN 9.11 (the same
    # query: 160/128, 136/128, 256/128 -> No_Backend, 192/96 -> F16_arbitrary_seqlen); TE 2.20.2's takes it
    assert select(L, lookup_gpu("H100")).selected == selected.replace("flash", "fused")


def test_determinism_below_sm90_leaves_only_flash_attn():
    # TE 2.11 / 2.20.2 "Filter: Determinism": F16_arbitrary_seqlen is switched off in deterministic training below
    # sm90, so an A100 layer flash-attn cannot take (off-by-one softmax) runs TE's unfused attention
    L = lay("--softmax-type", "off-by-one", env=DET)
    assert select(lay("--softmax-type", "off-by-one"), lookup_gpu("A100")).selected == "fused"
    assert select(L, lookup_gpu("A100")).selected == "unfused"
    assert select(lay(env=DET), lookup_gpu("A100")).selected == "flash"


# A tiny fp32 GPT: 4 heads of 16, seq 64, micro-batch 2, TP 1, learned positions, attention dropout 0
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "2", "--vocab-size", "128",
        "--attention-dropout", "0"]


def test_tiny_fp32_layer_keeps_the_unfused_tensors(capsys):
    # TE 2.11 / 2.20.2 UnfusedDotProductAttention (backends.py) on fp32 scores: FusedScaleMaskSoftmax's kernel needs
    # fp16/bf16 (softmax.py is_kernel_available), so torch's softmax runs and keeps its fp32 output
    # b x heads x s x s x 4 B = 2 x 4 x 64 x 64 x 4 = 128 KiB; dropout 0 adds nothing (torch returns its input);
    # masked_fill_ keeps the mask OR'd with the data loader's [b, 1, s, s] one: 2 x 64 x 64 x 1 B = 8 KiB;
    # q, k, v are views of linear_qkv's output [s, b, 3h]: 64 x 2 x 192 x 4 B = 96 KiB
    assert main(["estimate", "--gpus", "1", "--gpu", "a100", "--detail", "--"] + TINY) == 0
    out = capsys.readouterr().out
    assert "attention backend: unfused (auto: Transformer Engine's unfused attention (flash-attn and cuDNN" in out
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines() if line.split()}
    assert rows["attention_probs"] == ["128.0", "KiB"]
    assert rows["causal_mask"] == ["8.0", "KiB"]
    assert rows["qkv_output"] == ["96.0", "KiB"]
    assert main(["estimate", "--json", "--gpus", "1", "--gpu", "h100", "--"] + TINY) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["attention_backend"]["selected"] == "unfused" and "fp32" in doc["attention_backend"]["why"]


def test_auto_on_fp32_is_the_explicit_unfused_estimate():
    from megatron_memguard.errors import ConfigError
    L = layout_from_flags(TINY, world_size=1)
    peak = lambda L, g: [s.peak_allocated_bytes for s in estimate(L, gpu=lookup_gpu(g)).stages]  # noqa: E731
    for g in ("A100", "H100", "B200"):
        unfused = peak(L.replace(attention_backend="unfused"), g)
        assert peak(L, g) == unfused
        # an explicit fused (or flash) has no fp32 kernel: "Filter: Data type" (TE 2.11 / 2.20.2 utils.py), and the
        # backend's NVTE_* variables switch the unfused one off
        for backend in ("fused", "flash"):
            with pytest.raises(ConfigError) as e:
                estimate(L.replace(attention_backend=backend), gpu=lookup_gpu(g))
            assert e.value.key == "--attention-backend" and "fp32" in str(e.value) and e.value.megatron_fails_later


def test_context_parallelism_has_no_kernel_without_flash_and_cudnn():
    # TE disables UnfusedDotProductAttention under context parallelism (utils.py, 2.11 and 2.20.2): no backend
    from megatron_memguard.errors import ConfigError
    L = layout_from_flags([f for f in LLAMA if f != "--bf16"] + ["--context-parallel-size", "2"], world_size=8)
    with pytest.raises(ConfigError) as e:
        estimate(L, gpu=lookup_gpu("H100"))
    assert e.value.key == "--context-parallel-size" and "fp32" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("seq, probs_per_score", [
    # TE's fused softmax kernel (16 < s < 16384, s % 8 == 0, b x heads % 4 == 0, s % batches per block == 0): the
    # bf16 probs only (2 B per score)
    (4096, 2),
    # s >= 16384: torch's softmax on an fp32 copy (softmax_in_fp32=True in UnfusedDotProductAttention), which keeps
    # its fp32 output, and the bf16 cast the bmm keeps: 4 + 2 B per score
    (16384, 6),
])
def test_explicit_unfused_follows_te_softmax_kernel_availability(seq, probs_per_score):
    from megatron_memguard.estimator.activations import layer_activations
    flags = [f if f != "4096" else str(seq) for f in LLAMA] + ["--attention-backend", "unfused", "--attention-dropout", "0"]
    la = layer_activations(layout_from_flags(flags, world_size=8))
    heads = 32 // 2                                                  # TP 2
    assert la.saved["attention_probs"] == heads * seq * seq * probs_per_score
    assert ("causal_mask" in la.saved) == (seq == 16384)
    if seq == 16384:
        assert la.saved["causal_mask"] == seq * seq                    # micro-batch 1: [1, 1, s, s] bool



@pytest.mark.parametrize("version, env, dropout, selected", [
    ("0.16.1", DET, "0.1", "flash"),   # TE 2.11 get_attention_backend: cuDNN off for determinism on sm100
    ("0.16.1", DET, "0.0", "flash"),
    ("0.16.1", {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1"}, "0.1", "fused"),
    # TE 2.12.0 / 2.14.1 nvte_get_fused_attn_backend (common/fused_attn/fused_attn.cpp), run with a stubbed
    # CUDA runtime for sm100, bf16, head dim 128, causal, deterministic training: F16_arbitrary_seqlen (1)
    # for cuDNN >= 9.18.1 and dropout 0.0, No_Backend (-1) for any dropout > 0 (cuDNN 9.17 ... 9.21) and
    # for cuDNN <= 9.18.0; TE 2.20.2's cuDNN-frontend check: "Deterministic algorithm is not supported on
    # blackwell architecture when dbias, rng/dropout, alibi is enabled". Megatron's default dropout is 0.1.
    ("0.19.2", DET, "0.1", "flash"),
    ("0.19.2", DET, "0.0", "fused"),   # memguard assumes cuDNN >= 9.18.1 there
    ("0.19.2", {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1"}, "0.1", "fused"),
])
def test_blackwell_under_determinism(version, env, dropout, selected):
    L = lay("--attention-dropout", dropout, version=version, env=env)
    assert select(L, lookup_gpu("B200")).selected == selected
    assert select(L, lookup_gpu("GB200")).selected == selected
    # Hopper keeps cuDNN's deterministic path (sub-backend 1 on sm90; the same stubbed query returns 1 with
    # dropout 0.1 on sm90) in both releases
    assert select(L, lookup_gpu("H100")).selected == "fused"


def test_deterministic_mode_flag_counts_like_the_environment():
    # Megatron's --deterministic-mode asserts NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (megatron/training/arguments.py)
    L = lay("--deterministic-mode", version="0.19.2", env=DET)
    choice = select(L, lookup_gpu("GB200"))
    assert choice.selected == "flash" and "attention dropout 0.1" in choice.why


def test_a100_auto_is_the_flash_estimate_and_h100_auto_the_fused_one():
    a100, h100 = lookup_gpu("A100"), lookup_gpu("H100")
    auto, flash, fused = lay(), lay("--attention-backend", "flash"), lay("--attention-backend", "fused")
    peak = lambda L, g: [s.peak_allocated_bytes for s in estimate(L, gpu=g).stages]  # noqa: E731
    assert peak(auto, a100) == peak(flash, a100) != peak(fused, a100)
    assert peak(auto, h100) == peak(fused, h100) != peak(flash, h100)


def test_detail_and_json_show_the_backend_and_flash_tensors(capsys):
    flags = ["--gpus", "8", "--gpu", "a100", "--detail", "--"] + LLAMA
    assert main(["estimate"] + flags) == 0
    out = capsys.readouterr().out
    assert "attention backend: flash (auto on sm80: flash-attn 2" in out
    # flash-attn's contiguous q, k, v per TP rank: 4096 tokens x (16 + 2 x 4 heads) x 128 x 2 B = 24 MiB;
    # its [b, s, h, d] output: 4096 x 16 x 128 x 2 B = 16 MiB
    assert any(line.split()[:3] == ["flash_qkv", "24.0", "MiB"] for line in out.splitlines())
    assert any(line.split()[:3] == ["attention_output_bshd", "16.0", "MiB"] for line in out.splitlines())
    assert main(["estimate", "--json", "--gpus", "8", "--gpu", "h100", "--"] + LLAMA) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["attention_backend"]["requested"] == "auto" and doc["attention_backend"]["selected"] == "fused"


def test_a100_ci_records_get_closer_with_flash():
    # the clean A100 records of Megatron's CI that run TE's auto backend without CP: the peak allocated
    # measured on the GPU against the estimate with flash-attn (what TE runs there) and with cuDNN
    from accuracy_megatron_ci import PLATFORM_GPU, load_records, record_raw
    from megatron_memguard.resolve import resolve
    flash_err, fused_err = [], []
    for r in load_records():
        if "a100" not in str(r["platform"]):
            continue
        L = resolve(record_raw(r))
        if L.transformer_impl != "transformer_engine" or L.attention_backend != "auto":
            continue
        gpu = lookup_gpu(PLATFORM_GPU[r["platform"]])
        est = estimate(L, gpu=gpu, dp_rank="last")
        assert est.attention.selected == "flash"
        _add_errors(r, L, gpu, est, flash_err, fused_err)
    assert len(flash_err) >= 16
    mean_abs = lambda e: statistics.mean(abs(x) for x in e)  # noqa: E731
    assert mean_abs(flash_err) < 0.8 * mean_abs(fused_err)
    assert mean_abs(flash_err) < 0.01
    assert sum(abs(a) > abs(b) + 1e-4 for a, b in zip(flash_err, fused_err)) == 0


def _cudnn_what_if(L):
    """``L`` with cuDNN fused attention: the same run made non-deterministic where it was deterministic
    (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 or --deterministic-mode leaves cuDNN no kernel below sm90 and on Blackwell with
    attention dropout, and an explicit fused there is refused: that run would stop at its first forward). cuBLAS's
    workspace, which --deterministic-mode also sets (overheads.py), is pinned to the record's, so only the attention
    kernel differs."""
    from megatron_memguard.estimator.overheads import DETERMINISTIC_CUBLAS_CONFIG
    env = {**dict(L.env), "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1"}
    if L.deterministic_mode:
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS_CONFIG)
    return L.replace(attention_backend="fused", deterministic_mode=False, env=tuple(sorted(env.items())))


def _add_errors(r: dict, L, gpu, est, flash_err: list, fused_err: list) -> None:
    """The record's measured peak allocated against ``est`` (flash-attn) and the same layout with cuDNN fused."""
    from accuracy_megatron_ci import _numbers
    measured = max(_numbers(r["mem_max_allocated_bytes"]))
    fused = estimate(_cudnn_what_if(L), gpu=gpu, dp_rank="last")
    flash_err.append(est.stages[-1].peak_allocated_bytes / measured - 1)
    fused_err.append(fused.stages[-1].peak_allocated_bytes / measured - 1)


def test_gb200_deterministic_ci_records_get_closer_with_flash():
    # the clean GB200 records of Megatron's CI that run TE's auto backend under NVTE_ALLOW_NONDETERMINISTIC_ALGO=0
    # with Megatron's default attention dropout 0.1 (no cuDNN backend there, see test_blackwell_under_determinism):
    # the peak allocated measured on the GPU against the estimate with flash-attn and with cuDNN
    from accuracy_megatron_ci import PLATFORM_GPU, load_records, record_raw
    from megatron_memguard.errors import MemguardError
    from megatron_memguard.resolve import resolve
    flash_err, fused_err = [], []
    for r in load_records():
        if "gb200" not in str(r["platform"]):
            continue
        try:
            L = resolve(record_raw(r))
        except MemguardError:
            continue
        if L.transformer_impl != "transformer_engine" or L.attention_backend != "auto":
            continue
        gpu = lookup_gpu(PLATFORM_GPU[r["platform"]])
        est = estimate(L, gpu=gpu, dp_rank="last")
        deterministic = dict(L.env).get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") == "0"
        assert est.attention.selected == ("flash" if deterministic and L.attention_dropout > 0 else "fused")
        if est.attention.selected != "flash":
            continue
        _add_errors(r, L, gpu, est, flash_err, fused_err)
    assert len(flash_err) >= 20
    mean_abs = lambda e: statistics.mean(abs(x) for x in e)  # noqa: E731
    assert mean_abs(flash_err) < 0.5 * mean_abs(fused_err)
    assert mean_abs(flash_err) < 0.01
    assert sum(abs(a) > abs(b) + 2e-3 for a, b in zip(flash_err, fused_err)) == 0


def test_the_hook_reads_the_backend_from_the_device_name():
    # the runtime hook maps torch's device name to the GPU table (runtime/device.py), then estimates with it
    from megatron_memguard.runtime.device import gpu_spec_for
    a100 = gpu_spec_for("NVIDIA A100-SXM4-80GB", int(79.35 * 2**30))
    h100 = gpu_spec_for("NVIDIA H100 80GB HBM3", int(79.11 * 2**30))
    assert (a100.name, h100.name) == ("A100-80GB", "H100-80GB")
    assert estimate(lay(), gpu=a100).attention.selected == "flash"
    assert estimate(lay(), gpu=h100).attention.selected == "fused"


def test_the_planner_leaves_cp_out_where_te_runs_its_unfused_attention():
    # an fp32 model: TE's unfused attention on every layout, which has no context parallelism (the estimate
    # refuses CP > 1 there), so no candidate has CP > 1 and every estimate models the unfused attention
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import LLAMA31_8B
    from planner_util import make_planner
    P = make_planner([f for f in LLAMA31_8B if f != "--bf16"][:], 64, 8192, 512)
    assert any("context parallelism is left out" in n and "fp32" in n for n in P.notes)
    res = P.plan(top=3)
    assert res.entries and all(e.candidate.cp == 1 for e in res.entries)
    assert all(e.estimate.attention.selected == "unfused" for e in res.entries)


def test_core_attn_recompute_keeps_neither_probs_nor_mask():
    # the mask is made inside the checkpointed core attention (get_full_mask / forward_torch_softmax), like the probs
    from megatron_memguard.estimator.activations import layer_activations
    L = layout_from_flags(TINY + ["--recompute-granularity", "selective"], world_size=1)
    saved = layer_activations(L.replace(attention_backend="unfused")).saved
    assert "attention_probs" not in saved and "causal_mask" not in saved


@pytest.mark.parametrize("backend", ["flash", "fused"])
def test_explicit_flash_or_fused_on_fp32_is_refused_by_the_cli_and_the_hook(backend):
    # TE 2.11.0 / 2.20.2 utils.py get_attention_backend "Filter: Data type": flash-attn and FusedAttention take
    # bf16/fp16 q/k/v only; _set_attention_backend (language_module.py, core 0.16.1 / 0.19.2) sets
    # NVTE_UNFUSED_ATTN=0 for flash and fused, so DotProductAttention.forward raises "No dot product attention
    # backend is available" at the first forward: refused by name, in one line
    import argparse
    from megatron.core.transformer.enums import AttnBackend
    from megatron_memguard.errors import ConfigError, ConfigErrors
    from megatron_memguard.megatron.preflight import raw_config_from_args
    from megatron_memguard.resolve import resolve
    fp32 = [f for f in LLAMA if f != "--bf16"]
    keys = lambda e: [x.key for x in getattr(e, "errors", [e])]  # noqa: E731
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(fp32 + ["--attention-backend", backend], world_size=8)
    assert keys(e.value) == ["--attention-backend"]
    assert "bf16 or fp16" in str(e.value) and "\n" not in str(e.value)
    # the hook reads Megatron's parsed namespace, where the backend is an AttnBackend
    ns = argparse.Namespace(**{a[2:].replace("-", "_"): b for a, b in zip(fp32, fp32[1:] + [None])
                               if a.startswith("--") and b is not None and not b.startswith("--")},
                            group_query_attention=True, swiglu=True, disable_bias_linear=True,
                            untie_embeddings_and_output_weights=True, world_size=8,
                            attention_backend=getattr(AttnBackend, backend))
    with pytest.raises((ConfigError, ConfigErrors)) as h:
        resolve(raw_config_from_args(ns), world_size=8)
    assert keys(h.value) == ["--attention-backend"]
    # the same job in bf16, or with the unfused backend, is estimated
    assert estimate(layout_from_flags(LLAMA + ["--attention-backend", backend], world_size=8)).stages
    assert estimate(layout_from_flags(fp32 + ["--attention-backend", "unfused"], world_size=8)).stages


def test_flash_by_name_on_mla_is_refused_under_te_211():
    # TE 2.11 get_attention_backend: "Disabling FlashAttention 2 as it does not support MLA", and Megatron's flash
    # backend switches fused and unfused off (language_module.py _set_attention_backend, core 0.16.1): no kernel, the
    # first forward raises. TE 2.20.2 pads instead (megatron-core 0.19: estimated, the padded tensors above)
    from megatron_memguard.errors import ConfigError, ConfigErrors
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        mla(*MLA, "--attention-backend", "flash", version="0.16.1")
    errors = getattr(e.value, "errors", [e.value])
    assert [x.key for x in errors] == ["--attention-backend"] and "\n" not in str(e.value)
    assert "multi-latent" in str(e.value) and e.value.megatron_fails_later
    assert mla(*MLA, "--attention-backend", "flash", version="0.19.2").attention_backend == "flash"
    # equal head dims (qk 64 + rope 64 = v 128) keep flash-attn 2 in TE 2.11
    equal = mla("--multi-latent-attention", "--q-lora-rank", "256", "--kv-lora-rank", "128", "--qk-head-dim", "64",
                "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128", "--attention-backend", "flash", version="0.16.1")
    assert equal.attention_backend == "flash"
    assert select(mla("--multi-latent-attention", "--q-lora-rank", "256", "--kv-lora-rank", "128", "--qk-head-dim",
                      "64", "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128", version="0.16.1"),
                  lookup_gpu("A100")).selected == "flash"
