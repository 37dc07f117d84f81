"""The search: only layouts the estimator says fit, exactly the fastest ones, and the published findings."""
import random
import shlex

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.planner.bounds import memory_lower_bound
from megatron_memguard.planner.export import megatron_flags
from megatron_memguard.planner.search import TIE_WINDOW, tie_break, tie_preference
from megatron_memguard.planner.space import Constraints, enumerate_space

from conftest import LLAMA2_7B, LLAMA31_70B, LLAMA31_8B
from planner_util import make_planner

# A GPT-3-style model on the local implementation: LayerNorm, biases, dropout, learned positions, tied
# embeddings, unfused attention, GELU: the other branch of every estimator table.
GPT_LOCAL = ("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --max-position-embeddings 2048 "
             "--transformer-impl local --tokenizer-type GPT2BPETokenizer --vocab-file v --merge-file m "
             "--bf16").split()


# A dense multi-latent-attention model shaped like MiniCPM3-4B (its config.json: q rank 768, kv rank 256,
# head dims 64 + 32 rope, v 64), 24 of its 62 layers.
MLA = ("--num-layers 24 --hidden-size 2560 --ffn-hidden-size 6400 --num-attention-heads 40 --multi-latent-attention "
       "--q-lora-rank 768 --kv-lora-rank 256 --qk-head-dim 64 --qk-pos-emb-head-dim 32 --v-head-dim 64 "
       "--max-position-embeddings 4096 --position-embedding-type rope --normalization RMSNorm --swiglu "
       "--disable-bias-linear --tokenizer-type NullTokenizer --vocab-size 73448 --bf16").split()


def test_no_layout_the_estimator_rejects_ever_appears():
    P = make_planner(LLAMA31_70B, 256, 8192, 512)
    res = P.plan(top=25)
    assert len(res.entries) == 25
    assert res.verdicts["tight"] + res.verdicts["will not fit"] > 0   # non-fitting layouts were met and dropped
    for e in res.entries:
        assert e.estimate.verdict == "fits"
        # independently: paste the flags the planner prints onto the model and estimate again
        flags = LLAMA31_70B + shlex.split(" ".join(megatron_flags(e.layout)))
        L = layout_from_flags(flags, world_size=256)
        assert L == e.layout
        est = estimate(L, gpu=P.cluster.gpu, threshold=0.8)
        assert est.verdict == "fits" and est.peak_device_bytes <= 0.8 * P.cluster.gpu_memory_bytes


def test_ranked_by_predicted_step_time():
    P = make_planner(LLAMA31_8B, 64, 8192, 512)
    res = P.plan(top=15, window=0)
    times = [e.time.seconds for e in res.entries]
    assert times == sorted(times)
    assert [e.rank for e in res.entries] == list(range(1, 16))


def test_ties_within_the_window_go_to_fujii_order():
    """With the tie window, each entry is within TIE_WINDOW of the fastest fitting layout not ranked before it
    (so never more than that slower than the k-th fastest), and among those it is the first in Fujii et al.'s
    order (least TP x CP x PP, then the largest micro-batch)."""
    P = make_planner(LLAMA31_8B, 64, 8192, 512)
    plain = P.plan(top=15, window=0).entries
    res = P.plan(top=15)
    assert [e.rank for e in res.entries] == list(range(1, 16))
    pool = {e.candidate: e.time.seconds for e in P.plan(top=60, window=0).entries}
    for k, e in enumerate(res.entries):
        left = {c: t for c, t in pool.items() if c not in {x.candidate for x in res.entries[:k]}}
        fastest = min(left.values())
        assert e.time.seconds <= (1 + TIE_WINDOW) * fastest
        assert e.time.seconds <= (1 + TIE_WINDOW) * plain[k].time.seconds
        rivals = [c for c, t in left.items() if t <= (1 + TIE_WINDOW) * fastest]
        assert tie_preference(e.candidate) == min(tie_preference(c) for c in rivals)


def test_best_first_search_finds_exactly_the_fastest_fitting_layouts():
    """Brute force on a small space: estimate every candidate, keep those that fit, sort by time."""
    P = make_planner(LLAMA31_8B, 16, 8192, 64)
    cons = Constraints(mbs=(1, 2), cp=(1, 2))
    cands = enumerate_space(P.shape, P.cluster, 64, cons)
    fits = []
    for c in cands:
        if P.estimate(P.layout(c)).verdict == "fits":
            fits.append(c)
    fits.sort(key=P.order_key("time"))
    res = P.plan(cons, top=12, window=0)
    assert [e.candidate for e in res.entries] == fits[:12]
    # with the tie window, the search continues just far enough to rank like the whole fitting set would
    key = P.tie_key()
    ranked = tie_break(fits, lambda c: P.step_time(c).seconds, key)
    for top in (1, 2, 5, 12):
        assert [e.candidate for e in P.plan(cons, top=top).entries] == ranked[:top]
    assert res.estimated < len(cands) / 4                 # the bound and best-first order saved most estimates


def test_best_first_visit_is_the_sorted_order_and_times_few_candidates():
    """The search visits candidates in the order a sort by the rule's key gives (equal keys in enumeration order),
    with step times computed only as far as it reads (TimeModel.step_time_bound below each step time). fp8 None and
    "off" on a bf16 model are two candidates with the same step time and key: exact ties, kept in their order."""
    P = make_planner(LLAMA31_8B, 16, 4096, 64)
    cons = Constraints(mbs=(1, 2), fp8=(None, "off"), recompute=("none", "selective", "full"))
    cands = enumerate_space(P.shape, P.cluster, 64, cons)
    head = []
    for c in P.visit_order(cands, "time"):
        head.append(c)
        if len(head) == 20:
            break
    timed = len(P.timer._cache)
    assert timed < len(cands) / 4, (timed, len(cands))       # 20 visited: most step times never computed
    where = {id(c): i for i, c in enumerate(cands)}
    for rule in ("time", "fujii2024"):
        key = P.order_key(rule)
        want = sorted(cands, key=key)
        assert list(P.visit_order(cands, rule)) == want
        assert want[:20] == head or rule != "time"
        ties = [i for i in range(len(want) - 1) if key(want[i]) == key(want[i + 1])]
        assert ties and all(where[id(want[i])] < where[id(want[i + 1])] for i in ties)
    for c in cands:
        assert P.timer.step_time_bound(c) <= P.step_time(c).seconds, c.name


def test_memory_lower_bound_stays_below_the_estimate():
    for model, gpus, gbs in ((LLAMA31_70B, 256, 512), (LLAMA31_8B, 64, 256), (LLAMA2_7B, 32, 128),
                             (GPT_LOCAL, 32, 128), (MLA, 32, 128)):
        P = make_planner(model, gpus, 2048 if model is GPT_LOCAL else 4096, gbs)
        cands = enumerate_space(P.shape, P.cluster, gbs, Constraints())
        rng = random.Random(1)
        for c in rng.sample(cands, min(120, len(cands))):
            lb = memory_lower_bound(P.shape, c, P.timer.stage_params)
            est = P.estimate(P.layout(c))
            assert lb <= est.peak_device_bytes, (c.name, lb, est.peak_device_bytes)
            assert lb >= 0.4 * est.peak_device_bytes or c.recompute == "full", c.name


def test_bound_counts_the_interleaved_warm_up():
    """Megatron's interleaved schedule (groups of PP micro-batches): rank 0 runs 2 (PP-1) + (VPP-1) PP
    warm-up chunk forwards and one more before its first backward, at most all m x VPP."""
    from megatron_memguard.planner.bounds import first_stage_layers_held
    from megatron_memguard.planner.space import Candidate

    def cand(pp, vpp, m, layers):
        return Candidate(1, pp, 1, vpp, None, None, False, 1, "none", True, 1, m, (layers,) * pp)
    assert first_stage_layers_held(cand(4, 3, 128, 6)) == 15 * 2          # 6 + 8 + 1 chunks of 2 layers
    assert first_stage_layers_held(cand(4, 2, 4, 8)) == 8 * 4             # capped at m x VPP = 8 chunks of 4
    assert first_stage_layers_held(cand(4, 1, 128, 6)) == 4 * 6           # 1F1B: PP micro-batches
    assert first_stage_layers_held(cand(4, 1, 2, 6)) == 2 * 6


def test_selective_recompute_modules_are_respected_by_the_bound():
    flags = LLAMA31_8B + ["--recompute-modules", "mlp", "core_attn"]
    P = make_planner(flags, 16, 8192, 64)
    for c in enumerate_space(P.shape, P.cluster, 64, Constraints(recompute=("selective",)))[:60]:
        assert memory_lower_bound(P.shape, c, P.timer.stage_params) <= P.estimate(P.layout(c)).peak_device_bytes
    for mods in (["mla_up_proj", "core_attn"], ["layernorm"]):
        P = make_planner(MLA + ["--recompute-modules", *mods], 16, 4096, 64)
        for c in enumerate_space(P.shape, P.cluster, 64, Constraints(recompute=("selective",)))[:60]:
            assert memory_lower_bound(P.shape, c, P.timer.stage_params) <= P.estimate(P.layout(c)).peak_device_bytes


def test_planner_parameters_match_the_estimator_for_mla():
    # the time model's and the bound's per-rank parameter counts (ModelShape) against the estimator's
    from megatron_memguard.estimator.params import chunk_params
    P = make_planner(MLA, 32, 4096, 128)
    for tp in (1, 2, 4, 8):
        L = layout_from_flags(MLA + ["--seq-length", "4096", "--tensor-model-parallel-size", str(tp),
                                     "--micro-batch-size", "1", "--global-batch-size", "128"], world_size=32)
        layer = [p for p in chunk_params(L, L.chunks[0]) if p.name.startswith("decoder.layers.0.")]
        assert P.shape.layer_params_per_rank(tp) == sum(p.numel for p in layer), tp


def test_fujii_rule_orders_by_model_parallelism_then_micro_batch():
    P = make_planner(LLAMA31_70B, 256, 8192, 512)
    res = P.plan(top=10, rule="fujii2024")
    keys = [(e.candidate.model_parallel, -e.candidate.mbs) for e in res.entries]
    assert keys == sorted(keys)
    assert all(e.estimate.verdict == "fits" for e in res.entries)


def test_nothing_fits():
    P = make_planner(LLAMA31_70B, 8, 8192, 64, gpu="A100-40GB")
    res = P.plan(top=5)
    assert res.entries == [] and res.smallest_bound is not None


# ---- the published findings, reproduced from the hardware model (docs/planner.md, "Findings") --------

def test_smallest_model_parallelism_that_fits_wins_when_memory_allows():
    """Llama-3.1-8B on 64 H100-80GB (8 nodes), seq 8192, GBS 512: TP1 does not fit without recomputation,
    TP2 does; the fastest layout is TP2 PP1 CP1 MBS1 without recomputation: the smallest TP*CP*PP that
    fits (Fujii et al.'s rule picks the same) and no activation checkpointing (Hagemann et al.)."""
    P = make_planner(LLAMA31_8B, 64, 8192, 512)
    best = P.plan(top=1).entries[0].candidate
    fujii = P.plan(top=1, rule="fujii2024").entries[0].candidate
    assert best.model_parallel == fujii.model_parallel == 2
    assert (best.tp, best.pp, best.cp, best.mbs, best.recompute) == (2, 1, 1, 1, "none")


def test_micro_batch_one_wins_at_long_sequences_with_many_virtual_stages():
    """Llama-3.1-70B on 1024 H100s at sequence 8192: the chosen layout has MBS 1 and no recomputation, the
    shape of NVIDIA's Llama-3 70B recipes (TP4 PP4 CP2, virtual stages). That MBS 1 is best everywhere is
    not claimed: Megatron ran Llama-3.1-8B faster with MBS 2 than with MBS 1 in every layout of Fujii et
    al.'s A100 sweeps where both fit (tests/test_planner_measured.py), and Hagemann et al.'s sweeps go
    both ways."""
    P = make_planner(LLAMA31_70B, 1024, 8192, 1024)
    res = P.plan(top=5)
    best = res.entries[0].candidate
    assert best.mbs == 1 and best.recompute == "none"
    assert (best.tp, best.pp, best.cp) == (4, 4, 2) and best.vpp > 1


def test_tp_stays_inside_nodes_even_when_allowed_to_leave():
    """Llama-3.1-70B on 128 H100-94GB in nodes of 4 (TSUBAME 4.0): with TP allowed across nodes, TP 8/16
    layouts are considered, but the fastest layouts keep TP within the node (TP <= 4) and use PP/CP."""
    P = make_planner(LLAMA31_70B, 128, 8192, 1024, gpu="H100-94GB")
    cons = Constraints(allow_tp_across_nodes=True)
    cands = enumerate_space(P.shape, P.cluster, 1024, cons)
    assert any(c.tp == 8 for c in cands) and any(c.tp == 16 for c in cands)
    res = P.plan(cons, top=5)
    assert res.entries and all(e.candidate.tp <= 4 for e in res.entries)
    # and on 8-GPU H100 nodes, TP 16 never beats TP 8 inside the node
    P8 = make_planner(LLAMA31_70B, 512, 8192, 1024)
    res8 = P8.plan(Constraints(allow_tp_across_nodes=True), top=5)
    assert all(e.candidate.tp <= 8 for e in res8.entries)


def test_tie_break_by_hand():
    """Times 1.00, 1.02, 1.05, 1.10 s preferred 3rd, 1st, 0th, 2nd. Window 3%: 1.02 (within 3% of 1.00, preferred),
    then 1.00 (1.05 is 5% away), 1.05, 1.10. Window 10%: all four are within 10% of 1.00: 1.05, 1.02, then 1.10
    (still within 10% of 1.00, preferred to it), 1.00. Window 0: the times' order."""
    items = [(1.00, 3), (1.02, 1), (1.05, 0), (1.10, 2)]
    times = lambda x: [t for t, _ in x]  # noqa: E731
    rank = lambda w: times(tie_break(items, lambda x: x[0], lambda x: (x[1],), w))  # noqa: E731
    assert rank(0.03) == [1.02, 1.00, 1.05, 1.10]
    assert rank(0.10) == [1.05, 1.02, 1.10, 1.00]
    assert rank(0.0) == [1.00, 1.02, 1.05, 1.10]


def test_the_bound_memo_keeps_vpp_siblings_apart():
    """The lower-bound memo's key held VPP only for MoE models: a dense PP2 layout got its VPP 1 sibling's bound
    (or the other way round, pruning a layout that fits). 12 layers on PP2 (6 a rank, 3 a chunk at VPP 2),
    m = 32 / 4 = 8: rank 0 holds min(PP, m) = 2 micro-batches of 6 layers in 1F1B, 2 (PP-1) + (VPP-1) PP + 1 = 5
    chunks of 3 layers interleaved (Megatron's warm-up, first_stage_layers_held)."""
    from megatron_memguard.planner.bounds import layer_activation_bytes, stage_state_bytes
    from megatron_memguard.planner.space import make_candidate
    small = ("--num-layers 12 --hidden-size 1024 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
             "--max-position-embeddings 4096 --bf16 --normalization RMSNorm --swiglu --disable-bias-linear "
             "--ffn-hidden-size 2816 --position-embedding-type rope --untie-embeddings-and-output-weights").split()
    P = make_planner(small, 8, 4096, 32)
    one = make_candidate(P.shape, P.cluster, 32, pp=2, vpp=1)
    two = make_candidate(P.shape, P.cluster, 32, pp=2, vpp=2)
    assert one.stage_layers == two.stage_layers == (6, 6) and one.m == two.m == 8
    per_layer = layer_activation_bytes(P.shape, one)
    first = stage_state_bytes(P.shape, two, P.timer.stage_params(two, 0))
    P.lower_bound(one)                       # the VPP 1 sibling first, as the search may meet them
    assert P.lower_bound(two) == first + 15 * per_layer
    Q = make_planner(small, 8, 4096, 32)
    Q.lower_bound(two)                       # and the other order: the VPP 1 layout keeps its own (smaller) bound
    assert Q.lower_bound(one) == P.lower_bound(one) < P.lower_bound(two)
