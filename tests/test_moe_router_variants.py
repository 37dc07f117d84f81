"""The MoE settings that were refused or warn-only: the sqrtsoftplus score function, quantile-balancing routing,
the router's input jitter, forced biased routing, and the shared experts as a grouped GEMM.

Sources (megatron-core 0.19.2): transformer/moe/moe_utils.py ``topk_routing_with_score_function`` (sqrtsoftplus:
``softplus(logits.float()).sqrt()``; ``precomputed_indices``: ``torch.gather``), ``compute_routing_scores_for_aux_loss``,
``qb_dual_update``, ``apply_biased_logits``; transformer/moe/router.py ``TopKRouter.__init__`` (the fp32 ``qb_beta``,
``qb_beta_accum`` and int64 ``qb_beta_count`` buffers), ``quantile_balancing`` (its asserts), ``apply_input_jitter``;
transformer/moe/shared_experts.py ``FusedSharedExpertMLP``; transformer/transformer_config.py (expert bias needs
sigmoid or sqrtsoftplus; 0.16.1: sigmoid). Release gates read in the 0.17.1 / 0.18.2 wheels: sqrtsoftplus is in
0.18.2's moe_utils.py and not in 0.17.1's; quantile balancing and ``use_grouped_gemm_for_shared_expert`` are in
0.19.2 and not in 0.18.2.

The router tests at the end measure: they run megatron-core 0.19.2's own routing functions on CPU and count the
bytes autograd keeps saved (distinct storages, once the functions return), against memguard's terms.
"""
from __future__ import annotations

import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors
from megatron_memguard.estimator.layers.moe import (moe_activations, moe_param_rows, router_buffer_bytes,
                                                    router_saved, tokens_per_rank)

# 4 layers, h 512, TP 2 with SP, EP 2, 8 experts top-2, seq 1024 x micro-batch 4: T = 4096 / 2 = 2048 tokens a rank
MOE = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
       "--micro-batch-size 4 --global-batch-size 32 --bf16 --tensor-model-parallel-size 2 --sequence-parallel "
       "--expert-model-parallel-size 2 --num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
       "--moe-grouped-gemm --disable-bias-linear --swiglu --tokenizer-type NullTokenizer --vocab-size 50257").split()
T, E, K, H = 2048, 8, 2, 512
SHARED = ["--moe-shared-expert-intermediate-size", "1024"]
FUSED = ["--use-grouped-gemm-for-shared-expert", "--moe-shared-expert-glu-interleave-size", "32"]
MXFP8 = ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"]


def _layout(extra, version=None):
    return layout_from_flags(MOE + extra, world_size=8, megatron_version=version)


def _saved(extra, version=None):
    L = _layout(extra, version)
    assert tokens_per_rank(L) == T
    return moe_activations(L, L.moe).saved


def _errors(extra, version=None) -> str:
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        _layout(extra, version)
    return str(e.value)


# ----- sqrtsoftplus -----------------------------------------------------------------------------------------
def test_sqrtsoftplus_keeps_softplus_input_and_sqrt_output():
    s = _saved(["--moe-router-score-function", "sqrtsoftplus"])
    # fp32 softplus input [T, E] + fp32 sqrt output [T, E] + int64 top-k indices [T, k] + the normalisation's
    # gathered scores [T, k] fp32 and their sum [T, 1] fp32
    assert s["moe_router_scores"] == 4 * T * E + 4 * T * E + 8 * T * K + 4 * T * K + 4 * T == 188_416
    # sigmoid keeps one [T, E] fewer (its output only)
    assert s["moe_router_scores"] - _saved(["--moe-router-score-function", "sigmoid"])["moe_router_scores"] == 4 * T * E


def test_sqrtsoftplus_aux_loss_scores():
    s = _saved(["--moe-router-score-function", "sqrtsoftplus", "--moe-aux-loss-coeff", "1e-2"])
    # bf16 logits: the aux path's own fp32 copy for softplus, sqrt's output, the sum [T, 1]; + int64 tokens per
    # expert and the fp32 loss
    assert s["moe_aux_loss"] == 4 * T * E + 4 * T * E + 4 * T + 8 * E + 4
    # fp32 router: the softplus input is the logits themselves, already kept by the routing's softplus
    s32 = _saved(["--moe-router-score-function", "sqrtsoftplus", "--moe-aux-loss-coeff", "1e-2", "--moe-router-dtype", "fp32"])
    assert s32["moe_aux_loss"] == 4 * T * E + 4 * T + 8 * E + 4


def test_sqrtsoftplus_release_gate_and_expert_bias_rule():
    assert "sqrtsoftplus needs megatron-core >= 0.18" in _errors(["--moe-router-score-function", "sqrtsoftplus"], "0.17")
    assert _layout(["--moe-router-score-function", "sqrtsoftplus"], "0.18").moe.moe_router_score_function == "sqrtsoftplus"
    # TransformerConfig.__post_init__: aux-loss-free expert bias needs sigmoid or sqrtsoftplus (0.16.1: sigmoid)
    assert _layout(["--moe-router-score-function", "sqrtsoftplus", "--moe-router-enable-expert-bias"]).moe
    err = _errors(["--moe-router-enable-expert-bias"])
    assert "--moe-router-enable-expert-bias: needs --moe-router-score-function sigmoid or sqrtsoftplus" in err
    assert "needs --moe-router-score-function sigmoid" in _errors(["--moe-router-enable-expert-bias"], "0.16")


# ----- quantile balancing -----------------------------------------------------------------------------------
QB = ["--moe-router-load-balancing-type", "quantile_balancing"]


def test_quantile_balancing_router_state_and_saved_logits():
    L = _layout(QB)
    # fp32 qb_beta and qb_beta_accum [E] and an int64 scalar qb_beta_count per router
    assert router_buffer_bytes(L.moe) == 4 * E + 4 * E + 8 == 72
    terms = {t.name: t.bytes for t in estimate(L).stages[0].terms}
    assert terms["moe_router_buffers"] == 4 * 72                      # 4 MoE layers on the stage
    # softmax after top-k from precomputed indices: torch.gather keeps the bf16 logits [T, E] besides the
    # usual int64 indices and fp32 softmax [T, k]
    assert _saved(QB)["moe_router_scores"] == 12 * T * K + 2 * T * E == 81_920
    # the other score functions gather from scores they keep anyway
    for score in ("sigmoid", "sqrtsoftplus"):
        assert _saved(QB + ["--moe-router-score-function", score]) == _saved(["--moe-router-score-function", score])


def test_quantile_balancing_rules():
    assert "quantile_balancing needs megatron-core >= 0.19" in _errors(QB, "0.18")
    assert "--moe-router-fusion: does not work with quantile_balancing" in _errors(QB + ["--moe-router-fusion"])
    err = _errors(QB + ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"])
    assert "--moe-router-num-groups: group-limited routing does not work with quantile_balancing" in err
    # qb_dual_update asserts (tokens x top-k) % E == 0 over the TP x CP group's s x b = 1022 x 1 tokens
    err = _errors(QB + ["--seq-length", "1022", "--micro-batch-size", "1", "--global-batch-size", "8",
                        "--moe-router-topk", "1", "--moe-router-pre-softmax"])
    assert "quantile_balancing needs (sequence x micro-batch) x top-k = 1,022 x 1 divisible by --num-experts 8" in err
    assert _layout(QB + ["--seq-length", "1022", "--micro-batch-size", "1", "--global-batch-size", "8",
                         "--moe-router-topk", "4"]).moe           # 1,022 x 4 = 511 x 8
    # Megatron refuses a capacity factor with it (TransformerConfig.__post_init__)
    assert "--moe-expert-capacity-factor: only works with" in _errors(QB + ["--moe-expert-capacity-factor", "1.0"])


# ----- input jitter -----------------------------------------------------------------------------------------
def test_input_jitter_keeps_the_noise_and_the_jittered_input():
    # the noise [T, h] bf16 and, with shared experts keeping the norm output, the jittered copy [T, h] bf16
    s = _saved(["--moe-input-jitter-eps", "0.01"] + SHARED)
    assert s["moe_router_input_jitter"] == 2 * 2 * T * H == 4_194_304
    # without shared experts the jittered copy replaces the norm output: the noise only
    assert _saved(["--moe-input-jitter-eps", "0.01"])["moe_router_input_jitter"] == 2 * T * H
    L = _layout(["--moe-input-jitter-eps", "0.01"])
    assert not any("jitter" in n for n in L.notes)
    # 'moe' recompute checkpoints the whole layer: nothing of it stays
    assert "moe_router_input_jitter" not in _saved(["--moe-input-jitter-eps", "0.01", "--recompute-granularity",
                                                     "selective", "--recompute-modules", "moe"])


# ----- forced biased routing --------------------------------------------------------------------------------
def test_forced_biased_routing_marks_the_worst_case():
    L = _layout(["--moe-router-force-biased", "0.5"])
    st = estimate(L).stages[0]
    plain = estimate(_layout([])).stages[0]
    assert st.peak_allocated_bytes == plain.peak_allocated_bytes
    w = st.moe["worst_case"]
    assert w["forced_biased_std"] == 0.5 and "forced biased" in st.moe["routing"]
    # the dropless bound: every token of the ETP x EP = 4 ranks on this rank's 4 experts, min(k, 4) = 2 copies
    assert st.moe["expert_rows_worst"] == T * 2 * 2 * 2 and w["peak_allocated_bytes"] > st.peak_allocated_bytes
    assert "forced_biased_std" not in plain.moe["worst_case"]


# ----- shared experts as a grouped GEMM ---------------------------------------------------------------------
def test_fused_shared_expert_has_the_sequential_parameters():
    # FusedSharedExpertMLP hands linear_fc1.weight / linear_fc2.weight to TE's GroupedLinear ops (op.weight0 =
    # ...) kept in a tuple, not registered again: the same names and counts as SharedExpertMLP
    a, b = _layout(SHARED + MXFP8), _layout(SHARED + MXFP8 + FUSED)
    assert b.moe.use_grouped_gemm_for_shared_expert
    rows = [r for r in moe_param_rows(b, b.moe) if "shared" in r[0]]
    assert rows == [r for r in moe_param_rows(a, a.moe) if "shared" in r[0]]
    # fc1 [2 x 1024 / TP, 512] and fc2 [512, 1024 / TP]
    assert [(r[0], r[1]) for r in rows] == [("mlp.shared_experts.linear_fc1.weight", 1024 * 512),
                                            ("mlp.shared_experts.linear_fc2.weight", 512 * 512)]
    assert estimate(a).stages[0].parameters == estimate(b).stages[0].parameters


def _fp8_saved(extra):
    from megatron_memguard.estimator.fp8_layers import moe_saved_overrides
    L = _layout(extra)
    saved = moe_activations(L, L.moe).saved
    return {**saved, **moe_saved_overrides(L.fp8_spec, L, saved, act_bytes=2)}


def test_fused_shared_expert_keeps_the_gathered_input_and_weight_copies_quantized():
    """TE 2.14 ops/basic/grouped_linear.py: each GroupedLinear keeps its input and its per-forward quantized
    weight column-wise; ops/basic/swiglu.py ScaledSwiGLU its BF16 input. MXFP8 column-wise: 1 byte per element
    and one E8M0 scale per 32 rows of a column, scales padded to [round4(rows / 32), round128(cols)]."""
    a, b = _fp8_saved(SHARED + MXFP8), _fp8_saved(SHARED + MXFP8 + FUSED)
    gathered_input = 4096 * 512 + 4096 // 32 * 512                   # fc1's input [Tf = 4096, h = 512]
    fc1_weight = 1024 * 512 + 1024 // 32 * 512                       # [2 F_s / TP = 1024, 512]
    fc2_weight = 512 * 512 + 512 // 32 * 512                         # [512, F_s / TP = 512]
    assert b["moe_shared_experts"] - a["moe_shared_experts"] == gathered_input + fc1_weight + fc2_weight == 2_973_696
    # ... and TE's cached workspaces of linear_fc1 / linear_fc2 (row- and column-wise, never built on this path)
    # are gone: per MoE layer fc1 2 x 524,288 + 16,384 + 16,384, fc2 2 x 262,144 + 8,192 + 8,192; 4 MoE layers
    cache = [{t.name: t.bytes for t in estimate(_layout(x)).stages[0].terms}["fp8_weight_cache"]
             for x in (SHARED + MXFP8, SHARED + MXFP8 + FUSED)]
    assert cache[0] - cache[1] == 4 * (1_081_344 + 540_672) == 6_488_064


@pytest.mark.parametrize("flags, rule", [
    (MOE + SHARED + FUSED, "needs --fp8-recipe mxfp8 or --fp4-recipe nvfp4"),
    (MOE + SHARED + MXFP8 + ["--use-grouped-gemm-for-shared-expert"], "needs --moe-shared-expert-glu-interleave-size"),
    ([f for f in MOE if f != "--swiglu"] + SHARED + MXFP8 + FUSED, "needs a SwiGLU activation"),
])
def test_fused_shared_expert_rules(flags, rule):
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(flags, world_size=8)
    assert f"--use-grouped-gemm-for-shared-expert: {rule}" in str(e.value)


def test_fused_shared_expert_release_gate():
    # --use-grouped-gemm-for-shared-expert is in 0.19.2's parser, not 0.18.2's: refused as that argparse would
    # (resolve/releases.py, tests/test_flag_releases.py) before the section's own "needs megatron-core >= 0.19"
    assert "--use-grouped-gemm-for-shared-expert: is not a flag of megatron-core 0.18 (added in 0.19)" in _errors(
        SHARED + MXFP8 + FUSED, "0.18")


# ----- measured on megatron-core 0.19.2's own routing functions (CPU) ------------------------------------------
def _core_019():
    try:
        from megatron.core.transformer.moe import moe_utils
    except Exception:       # pragma: no cover - no megatron-core
        return None
    return moe_utils if hasattr(moe_utils, "qb_dual_update") else None


needs_019 = pytest.mark.skipif(_core_019() is None, reason="needs megatron-core 0.19 (tests/run.sh: .venv312)")


def _measure(score: str, *, pre=False, qb=False, aux=False, zloss=False, fp32=False) -> int:
    """Bytes autograd keeps saved by the router's score path as TopKRouter.routing runs it (z-loss, routing,
    aux-loss scores), on a non-leaf [T, E] logits tensor like the gating's output; distinct storages."""
    import gc
    import weakref
    import torch
    mu = _core_019()
    t, e, k = 64, 16, 4
    torch.manual_seed(0)
    logits = torch.randn(t, e, dtype=torch.float32 if fp32 else torch.bfloat16, requires_grad=True) * 1

    class Box:
        __slots__ = ("t", "__weakref__")

        def __init__(self, x):
            self.t = x
    refs = []

    def pack(x):
        b = Box(x)
        refs.append(weakref.ref(b))
        return b
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda b: b.t):
        lg, keep = logits, []
        if zloss:
            z = mu.z_loss_func(lg, 1e-3)
            lg = mu.MoEAuxLossAutoScaler.apply(lg, z)
        idx = None
        if qb:
            with torch.no_grad():
                idx, _ = mu.qb_dual_update(lg.detach().float(), k, torch.zeros(e))
        keep.append(mu.topk_routing_with_score_function(lg, k, use_pre_softmax=pre, score_function=score,
                                                         precomputed_indices=idx))
        if aux:
            keep.append(mu.compute_routing_scores_for_aux_loss(lg, k, score))
    gc.collect()
    seen = {}
    for r in refs:
        b = r()
        if b is not None:
            s = b.t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _memguard(score: str, *, pre=False, qb=False, aux=False, zloss=False, fp32=False) -> int:
    """memguard's router terms for the same T = 64, E = 16, k = 4, less what the probe leaves out: the aux-loss
    function's int64 tokens per expert and fp32 loss (8 E + 4)."""
    from types import SimpleNamespace
    from megatron_memguard.layout.moe import MoeSpec
    m = MoeSpec(num_experts=16, moe_router_topk=4, moe_router_score_function=score, moe_router_pre_softmax=pre,
                moe_router_load_balancing_type="quantile_balancing" if qb else "aux_loss",
                moe_aux_loss_coeff=1e-2 if aux else 0.0, moe_z_loss_coeff=1e-3 if zloss else None,
                moe_router_dtype="fp32" if fp32 else None)
    # one rank (TP = CP = 1): quantile balancing's indices are a view of its [T, k + 1] top-k
    out = router_saved(SimpleNamespace(act_bytes=2, tp=1, cp=1), m, 64)
    total = out["moe_router_scores"]
    if aux:
        total += out["moe_aux_loss"] - (8 * 16 + 4)
    if zloss:
        total += out["moe_z_loss"]
    return total


@needs_019
@pytest.mark.parametrize("score, pre", [("softmax", False), ("softmax", True), ("sigmoid", False),
                                        ("sqrtsoftplus", False)])
@pytest.mark.parametrize("fp32", [False, True])
@pytest.mark.parametrize("qb, aux, zloss", [(False, False, False), (True, False, False), (False, True, False),
                                            (False, False, True), (True, False, True), (False, True, True)])
def test_router_saved_bytes_match_megatron(score, pre, fp32, qb, aux, zloss):
    kw = dict(pre=pre, qb=qb, aux=aux, zloss=zloss, fp32=fp32)
    assert _memguard(score, **kw) == _measure(score, **kw)


@needs_019
def test_input_jitter_measured():
    # Router.apply_input_jitter on a fake router, then the gating's RouterGatingLinearFunction (torch.mm on CPU)
    import torch
    from types import SimpleNamespace
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.moe_utils import router_gating_linear
    t, h = 32, 64
    x = torch.randn(t, h, dtype=torch.bfloat16, requires_grad=True) * 1
    w = torch.randn(8, h, dtype=torch.bfloat16, requires_grad=True)
    fake = SimpleNamespace(config=SimpleNamespace(moe_input_jitter_eps=0.01), input_jitter=None)
    sizes = []

    def pack(y):
        sizes.append((y.untyped_storage().data_ptr(), y.untyped_storage().nbytes()))
        return y
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda y: y):
        jittered = TopKRouter.apply_input_jitter(fake, x)
        router_gating_linear(jittered, w, None, torch.bfloat16)
    kept = dict(sizes)
    kept.pop(x.untyped_storage().data_ptr(), None)      # (not kept: the noise needs no gradient)
    kept.pop(w.untyped_storage().data_ptr(), None)
    # the noise and the jittered input, each [t, h] bf16: what memguard counts with shared experts present
    assert sum(kept.values()) == 2 * 2 * t * h


def test_input_jitter_on_the_cpu_referee():
    """The CPU referee's runs of real megatron-core 0.16.1 with and without --moe-input-jitter-eps (shared experts
    of 384, EP 2, T = 512, h = 256, 4 MoE layers; benchmarks/results/referee-moe-measured.json): the peaks differ
    by memguard's 2 x 2 T h per MoE layer within the runs' routing noise (measured +2,123,800 and +2,083,852 B
    on the two ranks, estimated +2,097,152 B), parameters equal."""
    import json
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results",
                        "referee-moe-measured.json")
    with open(path) as f:
        by = {c["name"]: c for c in json.load(f)["configs"]}
    plain, jitter = by["moe_ep2_shared"]["ranks"], by["moe_ep2_shared_jitter"]["ranks"]
    est = 4 * 2 * 2 * 512 * 256
    for a, b in zip(plain, jitter):
        assert a["num_params"] == b["num_params"] == 9_246_976
        assert abs((b["peak_bytes"] - a["peak_bytes"]) / est - 1) < 0.02


@needs_019
@pytest.mark.parametrize("fp32", [False, True])
@pytest.mark.parametrize("gather", [1, 2])
def test_quantile_balancing_working_set_measured(fp32, gather):
    """Router.quantile_balancing's no-grad block (core 0.19.2 router.py) run on CPU under the referee's tracker
    of live tensor storages: the fp32 logits, their gather over TP x CP (all_gather_into_tensor's output buffer,
    filled here by a copy), and qb_dual_update's temporaries and top-k results, peak above the start."""
    import torch
    from types import SimpleNamespace
    from benchmarks.referee.livebytes import LiveBytesTracker
    from megatron.core.transformer.moe.moe_utils import qb_dual_update
    from megatron_memguard.estimator.layers.moe import quantile_balancing_transient
    from megatron_memguard.layout.moe import MoeSpec
    t, e, k = 512, 16, 4
    logits = torch.randn(t, e, dtype=torch.float32 if fp32 else torch.bfloat16)
    beta = torch.zeros(e)
    tracker = LiveBytesTracker()
    with tracker, tracker.region("qb"), torch.no_grad():
        logits_fp32 = logits.detach().to(dtype=torch.float32)
        if gather > 1:
            full = torch.empty((t * gather, e), dtype=torch.float32)
            full.copy_(logits_fp32.repeat(gather, 1))   # (the repeat stands for the other ranks' rows: freed at once)
        else:
            full = logits_fp32
        qb_dual_update(full, k, beta, update_beta=True)
    r = tracker.region_result("qb")
    m = MoeSpec(num_experts=e, moe_router_topk=k, moe_router_load_balancing_type="quantile_balancing",
                moe_router_dtype="fp32" if fp32 else None)
    L = SimpleNamespace(tp=gather, cp=1, act_bytes=2)
    assert r["peak_bytes"] - r["start_bytes"] == quantile_balancing_transient(L, m, t)
