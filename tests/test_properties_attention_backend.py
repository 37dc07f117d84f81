"""``--attention-backend auto`` over GPUs, head dims, MLA, dtypes, CP, determinism, dropout and megatron-core releases.

The kernel Transformer Engine runs is checked against an oracle made of measurements and TE's Python source, not
of memguard's code:

* whether cuDNN has a training kernel for the head dims: the compiled C++ query ``nvte_get_fused_attn_backend`` of
  the transformer_engine_cu12 2.11.0 wheel and ``nvte_get_fused_attn_backend_v2`` of the 2.20.2 wheel, called on a
  CPU with a stubbed CUDA runtime and cuDNN (cuDNN 9.18.1; bf16, sbhd, causal, training; 1 = F16_arbitrary_seqlen,
  -1 = No_Backend; benchmarks/te_attention_query.py, benchmarks/results/te-attention-query.md), listed point by
  point in ``CUDNN_QUERY``;
* flash-attn 2's filters, determinism and the preference for cuDNN from sm90 (``get_attention_backend``, TE 2.11 and
  2.20.2 ``pytorch/attention/dot_product_attention/utils.py``; TE 2.20.2 pads MLA to the larger head dim).

Then the invariant users rely on: the estimate with ``auto`` is, term by term, the estimate with the selected kernel
asked for by name, and the layer keeps that kernel's tensors (flash-attn's [b, s, h, d] output, the unfused
attention's probs, neither for cuDNN); where only the unfused attention is left, context parallelism is refused
naming the flag.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, reject, settings, strategies as st

from megatron_memguard import estimate, layout_from_flags, lookup_gpu
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.estimator.attention_backend import select

EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))
PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=max(1, EXAMPLES // 2),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

SM = {"A100": 80, "H100": 90, "B200": 100, "GB200": 100}

# The compiled query per (TE release, sm): the (q/k head dim, v head dim) pairs that got F16_arbitrary_seqlen; every
# other pair probed got No_Backend. Probed: equal head dims 64, 100, 128, 136, 160, 192, 224, 256, 264 and the MLA
# pairs 192/128, 160/128, 96/64.
_EQUAL = [(d, d) for d in (64, 100, 128, 136, 160, 192, 224, 256, 264)]
_MLA = [(192, 128), (160, 128), (96, 64)]
CUDNN_QUERY = {
    ("2.11", 80): {(64, 64), (128, 128), (96, 64)},
    ("2.11", 90): {(64, 64), (128, 128), (136, 136), (160, 160), (192, 192), (224, 224), (256, 256), (192, 128),
                   (96, 64)},
    ("2.11", 100): {(64, 64), (128, 128), (192, 128), (96, 64)},
    ("2.20", 80): {(64, 64), (128, 128), (96, 64)},
    ("2.20", 90): {(64, 64), (128, 128), (136, 136), (160, 160), (192, 192), (224, 224), (256, 256), (192, 128),
                   (160, 128), (96, 64)},
    ("2.20", 100): {(64, 64), (128, 128), (192, 128), (96, 64)},
}
# (264, 264) on sm100 under TE 2.20.2 passes cuDNN-frontend's checks, then no cuDNN plan serves it (the frontend's
# override_heuristics_query: only its opt-in SM100 engine does), so TE gets No_Backend; the stub cuDNN hands out a plan


def oracle(te: str, sm: int, qk: int, v: int, half: bool, vanilla: bool, det: bool, dropout: float) -> str:
    """The kernel TE's get_attention_backend picks (module docstring)."""
    cudnn = half and (qk, v) in CUDNN_QUERY[(te, sm)]
    if det and (sm < 90 or (sm >= 100 and (te == "2.11" or dropout > 0))):
        cudnn = False                     # "Filter: Determinism" / the Blackwell deterministic query
    if det and not vanilla and te == "2.20":
        cudnn = False
    p = max(qk, v)                        # TE 2.20.2 pads MLA to it; TE 2.11 takes no MLA
    flash = half and vanilla and p % 8 == 0 and p <= 256 and (qk == v or te == "2.20")
    if flash and cudnn:
        return "fused" if sm >= 90 else "flash"
    return "flash" if flash else "fused" if cudnn else "unfused"


BASE = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
        "--max-position-embeddings", "256", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--vocab-size", "512",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--ffn-hidden-size", "512"]


@st.composite
def cases(draw):
    mla = draw(st.booleans())
    qk, v = draw(st.sampled_from(_MLA if mla else _EQUAL))
    return dict(gpu=draw(st.sampled_from(sorted(SM))), version=draw(st.sampled_from(["0.16.1", "0.19.2"])),
                mla=mla, qk=qk, v=v, dtype=draw(st.sampled_from(["--bf16", "--fp16", None])),
                cp=draw(st.sampled_from([1, 1, 2])), det=draw(st.booleans()),
                dropout=draw(st.sampled_from(["0", "0.1"])),
                vanilla=mla or draw(st.sampled_from([True, True, True, False])))


def _layout(c: dict, backend: str = "auto"):
    flags = BASE + ["--context-parallel-size", str(c["cp"]), "--attention-dropout", c["dropout"],
                    "--attention-backend", backend]
    if c["dtype"]:
        flags.append(c["dtype"])
    if c["mla"]:
        rope = {192: 64, 160: 32, 96: 32}[c["qk"]]
        flags += ["--multi-latent-attention", "--q-lora-rank", "64", "--kv-lora-rank", "32", "--qk-head-dim",
                  str(c["qk"] - rope), "--qk-pos-emb-head-dim", str(rope), "--v-head-dim", str(c["v"])]
    else:
        flags += ["--kv-channels", str(c["qk"])]
    if not c["vanilla"]:
        flags += ["--softmax-type", "off-by-one"]
    env = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"} if c["det"] else {}
    return layout_from_flags(flags, world_size=c["cp"], megatron_version=c["version"], env=env)


@PROPERTY
@given(cases())
def test_auto_runs_the_kernel_te_picks_and_estimates_it_by_name(c):
    try:
        L = _layout(c)
    except (ConfigError, ConfigErrors, NotModelledError):
        reject()
    gpu = lookup_gpu(c["gpu"])
    te = "2.11" if c["version"] == "0.16.1" else "2.20"
    expected = oracle(te, SM[c["gpu"]], c["qk"], c["v"], c["dtype"] is not None, c["vanilla"], c["det"],
                      float(c["dropout"]))
    choice = select(L, gpu)
    assert (choice.requested, choice.selected) == ("auto", expected), (c, choice.why)
    if expected == "unfused" and c["cp"] > 1:
        # TE disables its unfused attention under context parallelism: no kernel at all, refused naming the flag
        with pytest.raises(ConfigError) as e:
            estimate(L, gpu=gpu)
        assert e.value.key == "--context-parallel-size" and "\n" not in str(e.value)
        return
    try:
        by_name = _layout(c, expected)
    except (ConfigError, ConfigErrors) as e:
        # asking for the unfused attention by name under CP is refused by the reader; nothing else is
        assert expected == "unfused" and c["cp"] > 1, (c, str(e))
        return
    auto = estimate(L, gpu=gpu)
    named = estimate(by_name, gpu=gpu)
    for a, b in zip(auto.stages, named.stages):
        assert a.breakdown == b.breakdown, (c, expected)
    saved = layer_activations(choice.modelled_layout(L)).saved
    if expected == "unfused":
        assert "attention_probs" in saved
    elif expected == "flash" and not (c["mla"] and c["cp"] > 1):
        # flash-attn's own [b, s, h, d] output (MLA under CP keeps its CP-less model, as the fused kernel does)
        assert "attention_output_bshd" in saved and "attention_probs" not in saved
    else:
        assert "attention_probs" not in saved and "flash_qkv" not in saved
