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
    (["--kv-channels", "320"], "head dim"),                          # flash-attn 2: head dim <= 256
    (["--kv-channels", "100"], "head dim"),                          # flash-attn 2: head dim % 8 == 0
    (["--flash-attention-version", "3"], "--flash-attention-version 3"),   # FA3 runs on sm90 only
])
def test_a100_falls_back_to_cudnn_where_flash_attn_2_cannot_run(extra, why):
    choice = select(lay(*extra), lookup_gpu("A100"))
    assert choice.selected == "fused" and why in choice.why


def test_fp32_is_not_moved_to_flash():
    # neither flash-attn nor cuDNN takes fp32 q/k/v (TE runs UnfusedDotProductAttention): not modelled for auto
    L = layout_from_flags([f for f in LLAMA if f != "--bf16"], world_size=8)
    choice = select(L, lookup_gpu("A100"))
    assert choice.selected == "fused" and "unfused" in choice.why


DET = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


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


def _add_errors(r: dict, L, gpu, est, flash_err: list, fused_err: list) -> None:
    """The record's measured peak allocated against ``est`` (flash-attn) and the same layout with cuDNN fused."""
    from accuracy_megatron_ci import _numbers
    measured = max(_numbers(r["mem_max_allocated_bytes"]))
    fused = estimate(L.replace(attention_backend="fused"), gpu=gpu, dp_rank="last")
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
