"""Properties of context parallelism with an all-to-all (--cp-comm-type a2a: Transformer Engine's
AttnFuncWithCPAndQKVOA2A, estimator/layers/cp_attention.py) against the p2p ring on the same drawn jobs (tests/
property_space.py specs with CP): what a layer keeps differs from the ring's by exactly what docs/assumptions.md
("Context parallelism") says, and no stage keeps less.

Derandomized; MEMGUARD_PROPERTY_EXAMPLES sets the count (default 200, these use a quarter).
"""
from __future__ import annotations

import math
import os

from hypothesis import HealthCheck, given, settings, strategies as st

from megatron_memguard import estimate
from megatron_memguard.estimator.activations import layer_activations

from property_space import Spec, specs
from test_properties_features import layout

EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))
QUARTER = settings(derandomize=True, database=None, deadline=None, max_examples=max(1, EXAMPLES // 4),
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@st.composite
def cp_specs(draw):
    """A dense TE job with CP 2 to 8 and the cuDNN fused or the flash backend in bf16 / fp16 (TE's CP attention), its
    sequence a multiple of 2 CP (load balancing) and of CP x TP (the SP scatter)."""
    s = draw(specs(max_layers=8))
    cp = draw(st.sampled_from([2, 4, 8]))
    seq = math.lcm(2 * cp, cp * s.tp) * draw(st.sampled_from([1, 2, 4, 16]))
    return s.with_(impl="transformer_engine", backend=draw(st.sampled_from(["fused", "fused", "flash"])), cp=cp, seq=seq,
                   precision=draw(st.sampled_from(["bf16", "fp16"])))


class _Flags:
    """A spec's flags with more appended (test_properties_features.layout takes any object with flags() and world)."""

    def __init__(self, s, *more: str) -> None:
        self.s, self.more, self.world = s, list(more), s.world

    def flags(self) -> list[str]:
        return self.s.flags() + self.more


@QUARTER
@given(cp_specs())
def test_a2a_keeps_the_rings_bytes_and_the_output_before_its_exchange(s):
    """AttnFuncWithCPAndQKVOA2A saves the exchanged q, k, v in place of the ring's rope'd q and last K/V buffer (the
    same bytes: q + 2 kv), the same fp32 statistic, and the kernel's output before its exchange back, a tensor apart
    from the exchanged one linear_proj keeps (cuDNN: one [s/CP b, a d / TP] tensor more per layer; flash-attn: in
    place of the ring's [b, s, h, d] output copy, the same bytes). With core_attn recomputed or full recompute the
    layer keeps what the ring's does. So every stage's layer_activations term is the ring's or above it, and equal
    unless the cuDNN backend keeps its output apart. Two corners MEMGUARD_PROPERTY_EXAMPLES=1000 drew (2026-11-30):
    a stage's term is compared only where both peaks hold layers (a2a's backward has no ring buffers, so its peak can
    be the optimizer step, whose terms hold no activations: estimator/core.py), and full recompute keeps the ring's
    bytes only where it recomputes every layer of the chunk (block with --recompute-num-layers below the chunk's layers
    leaves the rest whole: megatron-core transformer_block.py _checkpointed_forward)."""
    ring = layout(_Flags(s))
    a2a = layout(_Flags(s, "--cp-comm-type", "a2a"))
    r, a = layer_activations(ring).saved, layer_activations(a2a).saved
    e = 4 if s.precision == "fp32" else 2
    q = s.mbs * s.seq // s.cp * (s.heads // s.tp) * s.kv_channels * e      # the rank's q (and output) bytes
    kept_apart = "softmax_stats" in r and s.backend == "fused"
    assert sum(a.values()) - sum(r.values()) == (q if kept_apart else 0)
    full = bool(s.recompute) and s.recompute[0] == "full"
    for sr, sa in zip(estimate(ring).stages, estimate(a2a).stages, strict=True):
        if "layer_activations" not in sr.breakdown or "layer_activations" not in sa.breakdown:
            continue                        # a peak outside forward / backward (the optimizer step)
        tr, ta = sr.breakdown["layer_activations"], sa.breakdown["layer_activations"]
        assert ta >= tr
        every_layer = full and (s.recompute[1] == "uniform" or s.recompute[2] >= max(c.num_layers for c in sa.chunks))
        if not kept_apart or every_layer:
            assert ta == tr


def test_a2a_under_block_recompute_of_no_layer_keeps_the_cudnn_output_apart_by_hand():
    """The corner EXAMPLES=1000 drew: --recompute-method block --recompute-num-layers 0 checkpoints no layer
    (transformer_block.py _checkpointed_forward: layers below recompute_num_layers only), so the one layer keeps what
    it keeps without recompute, and under a2a the cuDNN kernel's output before its exchange back is one tensor more
    than the ring's: mbs 4 x s / CP = 2 tokens x 2 heads x d 8 x 2 B (bf16) = 256 B."""
    s = Spec(backend="fused", cp=2, layers=1, heads=2, kv_channels=8, hidden=16, ffn=8, seq=4, mbs=4, vocab=8,
             bias=False, recompute=("full", "block", 0))
    ring, a2a = estimate(layout(_Flags(s))).stages[0], estimate(layout(_Flags(s, "--cp-comm-type", "a2a"))).stages[0]
    assert a2a.breakdown["layer_activations"] - ring.breakdown["layer_activations"] == 4 * 2 * 2 * 8 * 2
