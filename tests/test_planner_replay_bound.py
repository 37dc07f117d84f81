"""The planner's memory bound under full recompute (one layer's replay) and the search that sets bounded-out
layouts aside untimed (issue plancap: plans of Mixtral at 131,072 tokens where nothing fits)."""
import random

from megatron_memguard.planner.bounds import layer_activation_bytes, memory_lower_bound, replay_bytes
from megatron_memguard.planner.search import Planner
from megatron_memguard.planner.space import Constraints, enumerate_space, make_candidate

from conftest import LLAMA2_7B
from planner_util import make_planner
from test_planner_search import GPT_LOCAL


def test_replay_term_by_hand():
    """GPT_LOCAL (24 layers, hidden 2048, 16 heads, bf16, --transformer-impl local: unfused attention) at seq 2048,
    TP 2, MBS 1, no SP. Under full recompute each layer keeps its input, s x h x 2 bytes = 2048 x 2048 x 2 =
    8 MiB; the replay of one layer saves again all it keeps without recompute, less that input. Unfused
    attention keeps the s x s softmax output of its 16 / 2 = 8 heads, 8 x 2048 x 2048 x 2 bytes = 64 MiB
    (DotProductAttention, megatron-core), so the replay is at least that."""
    P = make_planner(GPT_LOCAL, 8, 2048, 8)
    full = make_candidate(P.shape, P.cluster, 8, tp=2, recompute="full", sp=False)
    none = make_candidate(P.shape, P.cluster, 8, tp=2, recompute="none", sp=False)
    ckpt = 2048 * 2048 * 2
    assert layer_activation_bytes(P.shape, full) == ckpt
    assert replay_bytes(P.shape, full) == layer_activation_bytes(P.shape, none) - ckpt
    assert replay_bytes(P.shape, full) >= 8 * 2048 * 2048 * 2
    assert replay_bytes(P.shape, none) == 0          # no replay without full recompute
    # PP 1 (one stage, 4 micro-batches of 2 sequences at DP 4: min(PP, m) = 1 held): the bound grows by the replay
    # or the logits, whichever is larger (the logits are freed before the first replay)
    base = memory_lower_bound(P.shape, full, P.timer.stage_params, replay=True)
    assert base >= 24 * ckpt + replay_bytes(P.shape, full)


def test_bound_with_the_replay_stays_below_the_estimate():
    """A property draw: full-recompute layouts (dense, unfused and fused attention; Mixtral) are never bounded
    above the estimator's device total, or the planner could drop a layout that fits."""
    rng = random.Random(7)
    for model, gpus, seq, gbs in ((GPT_LOCAL, 32, 2048, 64), (LLAMA2_7B, 32, 4096, 64)):
        P = make_planner(model, gpus, seq, gbs)
        cands = [c for c in enumerate_space(P.shape, P.cluster, gbs, Constraints()) if c.recompute == "full"]
        for c in rng.sample(cands, min(25, len(cands))):
            est = P.estimate(P.layout(c))
            assert memory_lower_bound(P.shape, c, P.timer.stage_params, replay=True) <= est.peak_device_bytes, c.name
    from test_planner_moe import mixtral_planner
    p = mixtral_planner(gpus=64, seq=8192, gbs=64)
    cands = [c for c in enumerate_space(p.shape, p.cluster, p.gbs, Constraints(allow_ep_across_nodes=True))
             if c.recompute == "full"]
    for c in rng.sample(cands, min(20, len(cands))):
        try:
            L = p.layout(c)
        except Exception:
            continue
        est = p.estimate(L)
        lb = memory_lower_bound(p.shape, c, p.timer.stage_params, p.timer.stage_expert_params, p.timer.moe_layers_on,
                                replay=True)
        assert lb <= max(s.device_total_bytes for s in est.stages), c.name


def _plain_visit(planner: Planner):
    """The planner with visit_order ignoring `aside` and no replay bound: every candidate timed and met in order,
    every layout the bound without the replay keeps estimated in its place, as before."""
    order = Planner.visit_order

    def visit(self, cands, rule, aside=None):
        return order(self, cands, rule)
    planner.visit_order = visit.__get__(planner)
    planner.replay_bound = lambda c: 0.0
    return planner


def _summary(res):
    d = res.search_dict()
    d.pop("seconds")
    return (d, [e.candidate for e in res.entries], res.smallest_bound, [(f, c) for f, c, _ in res.closest])


def test_setting_bounded_out_layouts_aside_changes_no_count():
    """The search counts, ranks, smallest bound and closest layouts are those of a visit in order that times
    every candidate and estimates what the bound without the replay keeps: a plan that fits (time rule with its window, and the fujii2024 rule that stops at the
    top-th fit) and one where nothing fits."""
    # (GPT_LOCAL at 4% of 80 GB: nothing fits, 1,024 of 1,044 bounded out; at 8%: fewer fit than the top asked)
    cases = [(LLAMA2_7B, 32, 4096, 64, 0.8), (LLAMA2_7B, 8, 4096, 64, 0.8), (GPT_LOCAL, 8, 2048, 16, 0.15),
             (GPT_LOCAL, 8, 2048, 16, 0.04), (GPT_LOCAL, 8, 2048, 16, 0.08)]
    nothing = 0
    for model, gpus, seq, gbs, threshold in cases:
        for rule, top in (("time", 3), ("fujii2024", 2), ("time", 1)):
            a = make_planner(model, gpus, seq, gbs, threshold=threshold).plan(Constraints(), top=top, rule=rule)
            b = _plain_visit(make_planner(model, gpus, seq, gbs, threshold=threshold)).plan(
                Constraints(), top=top, rule=rule)
            assert _summary(a) == _summary(b), (model[:4], gpus, rule, top)
            assert a.pruned_by_bound > 0
            nothing += not a.entries
    assert nothing >= 2
