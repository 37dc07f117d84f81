"""--overlap-moe-expert-parallel-comm with pipeline parallelism: megatron-core's combined 1F1B schedule.

Sources (megatron-core 0.16.1 and 0.19.2, the same in both): pipeline_parallel/schedules.py
``get_pp_rank_microbatches`` (one more warm-up micro-batch with the overlap) and
``forward_backward_pipelining_with_interleaving`` (steady step k runs forward k + warm-up and backward k
through ``combined_1f1b_schedule_for_interleaved_pipelining``); models/common/model_chunk_schedule_plan.py
``TransformerModelChunkSchedulePlan.run`` (the backward's loss / output layer first, the forward's output
layer and loss last, so a step is backward-then-forward in memory order).
"""
from __future__ import annotations

import os
import sys

import pytest

from megatron_memguard.errors import ConfigError, NotModelledError

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))
from schedule_reference import passes  # noqa: E402


def _held_after(events):
    """Virtual micro-batches in flight after each event, and the most ever in flight."""
    cur, most = 0, 0
    for fwd, _ in events:
        cur += 1 if fwd else -1
        most = max(most, cur)
    return most


def test_hand_derived_pp2_vpp2_rank0():
    # PP 2, VPP 2, 4 micro-batches in groups of 2, first rank. Schedule table (micro-batch, chunk):
    # (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1). Plain interleaving warms up (2-0-1)*2 + (2-1)*2 = 4
    # forwards; the overlap adds one: 5 (chunks 0,0,1,1,0). Steady steps k = 0..2 pair backward k (chunk
    # 1 - table[k].chunk) with forward k + 5 (table[k+5].chunk), backward first; then backwards 3..7.
    ev = passes(2, 2, 4, 2, 0, combined=True)
    F, B = True, False
    assert ev == ((F, 0), (F, 0), (F, 1), (F, 1), (F, 0),
                  (B, 1), (F, 0), (B, 1), (F, 1), (B, 0), (F, 1),
                  (B, 0), (B, 1), (B, 1), (B, 0), (B, 0))
    # as many virtual micro-batches in flight at most as the plain schedule (5), but one more warm-up
    # forward before the first backward, and each step's forward only after its backward
    assert _held_after(ev) == _held_after(passes(2, 2, 4, 2, 0)) == 5
    assert ev.index((B, 1)) == 5 and passes(2, 2, 4, 2, 0).index((B, 1)) == 5


def test_last_rank_and_short_runs():
    # last rank of PP 2 / VPP 4 / 4 micro-batches: warm-up (4-1)*2 + 1 = 7 of 16
    ev = passes(2, 4, 4, 2, 1, combined=True)
    assert [f for f, _ in ev[:8]] == [True] * 7 + [False]
    # fewer micro-batches than the warm-up: all forwards, then all backwards
    ev = passes(4, 2, 4, 4, 0, combined=True)
    assert [f for f, _ in ev] == [True] * 8 + [False] * 8
    # PP 1: forward 0, then (backward i, forward i + 1), then the last backward
    assert passes(1, 1, 3, 1, 0, combined=True) == ((True, 0), (False, 0), (True, 0), (False, 0), (True, 0), (False, 0))


def _megatron_schedule():
    try:
        from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table
    except Exception as e:   # pragma: no cover - the venvs have megatron-core
        pytest.skip(f"megatron-core not importable: {e}")
    return get_pp_rank_microbatches, get_schedule_table


class _Group:
    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class _P2P:
    """What get_pp_rank_microbatches reads of a P2PCommunicator: the PP group and the VPP size."""

    def __init__(self, pp: int, rank: int, vpp: int):
        self.pp_group = _Group(pp, rank)
        self.virtual_pipeline_model_parallel_size = vpp


@pytest.mark.parametrize("pp,vpp,m,group", [(2, 2, 4, 2), (2, 4, 4, 2), (4, 2, 8, 4), (4, 3, 12, 4), (2, 2, 6, 3),
                                            (4, 2, 4, 4)])
def test_matches_megatron_schedule(pp, vpp, m, group):
    get_pp_rank_microbatches, get_schedule_table = _megatron_schedule()
    table = get_schedule_table(m, vpp, group)
    for rank in range(pp):
        total, _, warm, remaining = get_pp_rank_microbatches(m, vpp, group, overlap_moe_expert_parallel_comm=True,
                                                             p2p_communicator=_P2P(pp, rank, vpp))
        ev = passes(pp, vpp, m, group, rank, combined=True)
        fwd = [c for f, c in ev if f]
        bwd = [c for f, c in ev if not f]
        assert len(fwd) == len(bwd) == total
        # the warm-up forwards before the first backward: Megatron's count (plain + 1, capped at the total)
        assert ev.index(next(e for e in ev if not e[0])) == warm
        # forwards visit the schedule table in order; backwards in reverse chunk order
        assert fwd == [c for _, c in table]
        assert bwd == [vpp - 1 - c for _, c in table]
        # a steady step: backward k immediately before forward k + warm-up
        steady = ev[warm:warm + 2 * remaining]
        assert all(not steady[i][0] and steady[i + 1][0] for i in range(0, len(steady), 2))


# ----- Megatron's rules (TransformerConfig.__post_init__, 0.16.1 and 0.19.2) ---------------------------

def _resolve(extra: list[str], version: str = "0.19.2"):
    from megatron_memguard.config import RawConfig
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    from megatron_memguard.resolve import resolve
    flags = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "1024",
             "--max-position-embeddings", "1024", "--micro-batch-size", "1", "--global-batch-size", "16", "--bf16",
             "--num-experts", "8", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
             "--overlap-moe-expert-parallel-comm", "--pipeline-model-parallel-size", "2",
             "--vocab-size", "32000", "--position-embedding-type", "rope", *extra]
    raw = parse_megatron_flags(flags)
    return resolve(RawConfig(args=raw.args, origin=raw.origin, source="test", world_size=8), megatron_version=version)


def test_pp_needs_virtual_stages():
    with pytest.raises(ConfigError, match="needs virtual pipeline stages"):
        _resolve([])
    L = _resolve(["--num-layers-per-virtual-pipeline-stage", "2"])
    assert L.pp == 2 and L.vpp == 2 and L.moe.overlap_moe_expert_parallel_comm


def test_mtp_rules_by_version():
    vpp = ["--num-layers-per-virtual-pipeline-stage", "2"]
    with pytest.raises(ConfigError, match="at most one MTP layer"):
        _resolve(vpp + ["--mtp-num-layers", "2"])
    assert _resolve(vpp + ["--mtp-num-layers", "1"]).mtp_num_layers == 1


def test_moe_recompute_under_the_overlap():
    vpp = ["--num-layers-per-virtual-pipeline-stage", "2", "--recompute-granularity", "selective"]
    # TransformerConfig.__post_init__ (0.17.1, 0.18.2, 0.19.2): "disable moe in recompute_modules"
    for version in ("0.17.1", "0.18.2", "0.19.2"):
        with pytest.raises(ConfigError, match="'moe' in --recompute-modules"):
            _resolve(vpp + ["--recompute-modules", "moe"], version=version)
    # 0.16.1 lets the pair through, and its combined 1F1B schedule runs the MoE layer's parts
    # (fine_grained_callables.py: route, preprocess, dispatch, routed_experts_compute, combine), never the
    # checkpointed MoELayer.forward: nothing is recomputed, every term equal to the run without 'moe'
    from megatron_memguard import estimate
    with_moe = _resolve(vpp + ["--recompute-modules", "moe"], version="0.16.1")
    without = _resolve(vpp[:2], version="0.16.1")
    assert with_moe.moe.moe_recompute == ()
    assert any("'moe' is not recomputed" in n for n in with_moe.notes)
    terms = [[(t.name, t.bytes) for t in s.terms] for s in estimate(with_moe).stages]
    assert terms == [[(t.name, t.bytes) for t in s.terms] for s in estimate(without).stages]
    # with CUDA graphs the partial-graph MoE layer (MoETransformerLayer) recomputes its own way: refused by name
    with pytest.raises(NotModelledError, match="--recompute-modules"):
        _resolve(vpp + ["--recompute-modules", "moe", "--cuda-graph-impl", "local"], version="0.16.1")


# ----- Megatron's CI: the fine-grained offloading test runs the overlap with PP 2 / VPP 4 ------------

def test_fine_grained_offloading_records():
    from accuracy_megatron_ci import evaluate, load_records
    from shared_data import MOE_RECORDS
    rows = [evaluate(r) for r in load_records(MOE_RECORDS, include_flagged=True)
            if "pp2_ep4_etp1_fine_grained_offloading/" in r["id"]]
    assert len(rows) == 2                 # H100 (clean) and GB200 (config drift since the golden)
    for row in rows:
        assert row.error is None
        # measured peaks 7.749 GiB (H100) and 7.717 GiB (GB200), torch.cuda.max_memory_allocated
        assert abs(row.peak_err) <= 0.05, (row.id, row.peak_err)
        # after the step (measured 4.927 / 4.925 GiB): model state, within 1%
        assert abs(row.steady_err) <= 0.01, (row.id, row.steady_err)
        # last rank: 7 warm-up forwards ((2-1-1)*2 + (4-1)*2 + 1) in flight at the peak
        assert "(7 held)" in row.phase


def test_offload_groups_take_unfused_probs_and_expert_inputs():
    from megatron_memguard.estimator.offload_activations import layer_groups
    mib = 1024 * 1024
    # unfused attention's softmax output [b, a/TP, s, s] bf16 (b 1, 16 heads per rank, s 4096: 512 MiB)
    # is saved inside the core_attn call; the dispatched tokens [N, h] inside expert_fc1; fc1's output
    # inside moe_act, fc2's input (the activation output) outside it
    saved = {"attention_probs": 1 * 16 * 4096 * 4096 * 2, "moe_expert_input": 8192 * 1024 * 2 + 8192 * 4,
             "moe_expert_activations": 8192 * 3 * 1024 * 2}
    outside = {"moe_expert_input": 8192 * 4, "moe_expert_activations": 8192 * 1024 * 2}
    groups = layer_groups(saved, ("core_attn", "expert_fc1", "moe_act"), 2, outside=outside)
    assert groups == {"core_attn": 512 * mib, "expert_fc1": 16 * mib, "moe_act": 32 * mib}


# ----- --delay-wgrad-compute (TE delay_wgrad_compute; schedule: TransformerLayerSchedulePlan.run) --------

def _delay_layout(delay: bool):
    flags = ["--pipeline-model-parallel-size", "1", "--swiglu", "--moe-ffn-hidden-size", "1024",
             "--moe-router-topk", "2", "--disable-bias-linear", "--kv-channels", "64"]
    return _resolve(flags + (["--delay-wgrad-compute"] if delay else []))


def _resolve_without_overlap(extra: list[str]):
    from megatron_memguard.config import RawConfig
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    from megatron_memguard.resolve import resolve
    raw = parse_megatron_flags(["--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8",
                                "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size", "1",
                                "--global-batch-size", "8", "--bf16", "--vocab-size", "32000", *extra])
    return resolve(RawConfig(args=raw.args, origin=raw.origin, source="test", world_size=8))


def test_early_attn_release_needs_the_overlap():
    # TransformerConfig.__post_init__ (0.19.2); with the overlap it is estimated with a note (errs high)
    for experts in ([], ["--num-experts", "8", "--expert-model-parallel-size", "2"]):
        with pytest.raises(ConfigError, match="--ep-overlap-early-attn-memory-release: needs --overlap-moe-expert-parallel-comm"):
            _resolve_without_overlap(experts + ["--ep-overlap-early-attn-memory-release"])
    L = _resolve(["--pipeline-model-parallel-size", "1", "--ep-overlap-early-attn-memory-release"])
    assert any("--ep-overlap-early-attn-memory-release" in n for n in L.notes)


def test_delay_wgrad_needs_the_overlap():
    for experts in ([], ["--num-experts", "8", "--expert-model-parallel-size", "2"]):
        with pytest.raises(ConfigError, match="--delay-wgrad-compute: needs --overlap-moe-expert-parallel-comm"):
            _resolve_without_overlap(experts + ["--delay-wgrad-compute"])


def test_delay_wgrad_keeps_inputs_and_output_gradients_by_hand():
    from megatron_memguard.estimator.activations import layer_activations
    from megatron_memguard.partition import MLP_MOE, LayerKind
    with_delay, without = _delay_layout(True), _delay_layout(False)
    assert with_delay.moe.delay_wgrad_compute and "delay_wgrad_compute" in with_delay.moe.to_dict()
    assert "delay_wgrad_compute" not in without.moe.to_dict()
    kind = LayerKind("attention", MLP_MOE)
    a, b = layer_activations(with_delay, True, kind), layer_activations(without, True, kind)
    assert a.saved == b.saved
    # one more step in the experts' backward and one at the layer's end
    assert len(a.bwd_steps) == len(b.bwd_steps) + 2
    # T = 1024 tokens (s 1024, b 1, TP 1), balanced N = T k = 2048 rows, F = 1024, SwiGLU (g = 2), bf16:
    # expert input gradient [N, h] + fc1 output gradient [N, 2F] + fc2 output gradient [N, h] + fc2 input [N, F]
    e, N, h, F, T = 2, 2048, 512, 1024, 1024
    expert_step = a.bwd_steps[3]
    fc1_step = b.bwd_steps[2]           # the fc1 step without delay: G + [N, 2F] + [N, h] (+ the overlap's layer)
    assert expert_step[0] == fc1_step[0] == frozenset({"moe_expert_activations"})
    assert expert_step[1] - fc1_step[1] == e * N * (h + F)
    # the layer's end: everything saved released; linear_qkv [Tf, h] in + [Tf, 3 x 8 x 64] out, linear_proj
    # [Tf, 512] in + [Tf, h] out, and the layer input gradient [T, h]
    names, w = a.bwd_steps[-1]
    assert names == frozenset(a.saved)
    assert w == e * T * h + e * T * (h + 3 * 8 * 64) + e * T * (8 * 64 + h)


def test_experts_wgrad_beside_the_dispatch_backward_by_hand():
    # --overlap-dispatch-backward-with-experts-wgrad (0.19.2 MoELayer._RegisterDelayedWgradForExperts): the
    # experts' wgrad runs on a side stream during the dispatch backward; their inputs and output
    # gradients stay through that step
    from megatron_memguard.estimator.activations import layer_activations
    from megatron_memguard.partition import MLP_MOE, LayerKind
    base = ["--pipeline-model-parallel-size", "1", "--swiglu", "--moe-ffn-hidden-size", "1024", "--moe-router-topk", "2",
            "--disable-bias-linear", "--kv-channels", "64"]
    with pytest.raises(ConfigError, match="cannot be used with --overlap-moe-expert-parallel-comm"):
        _resolve(base + ["--overlap-dispatch-backward-with-experts-wgrad"])

    def plain(extra):
        from megatron_memguard.config import RawConfig
        from megatron_memguard.readers.megatron_flags import parse_megatron_flags
        from megatron_memguard.resolve import resolve
        flags = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "1024",
                 "--max-position-embeddings", "1024", "--micro-batch-size", "1", "--global-batch-size", "16", "--bf16",
                 "--num-experts", "8", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
                 "--vocab-size", "32000", "--position-embedding-type", "rope", *base, *extra]
        raw = parse_megatron_flags(flags)
        return resolve(RawConfig(args=raw.args, origin=raw.origin, source="test", world_size=8))
    kind = LayerKind("attention", MLP_MOE)
    a = layer_activations(plain(["--overlap-dispatch-backward-with-experts-wgrad"]), True, kind)
    b = layer_activations(plain([]), True, kind)
    assert a.saved == b.saved and len(a.bwd_steps) == len(b.bwd_steps)
    e, N, h, F = 2, 2048, 512, 1024     # T 1024, k 2: N = 2048 rows; SwiGLU fc1 output [N, 2F]
    diff = [wa - wb for (_, wa), (_, wb) in zip(a.bwd_steps, b.bwd_steps)]
    # only the dispatch step: fc1 input [N, h] + fc1 output gradient [N, 2F] + fc2 input [N, F] + fc2 output gradient [N, h]
    assert diff == [0, 0, 0, e * N * (2 * h + 2 * F + F)] + [0] * (len(diff) - 4)


def test_pp1_overlap_records_after_the_step():
    """Megatron's CI gpt3_mcore_te_tp2_pp1_te_a2a_ovlp_8experts_etp1_ep4 (H100, GB200 and its 4-GPU twin):
    12 MoE layers, TP2 + SP, micro-batch 4 x 1024 tokens -> T = 2048 per rank, hidden 512, bf16. After the
    step each layer's dispatcher still holds probs whose autograd graph ends in the layer's detached input
    (moe_dispatcher_state): 12 x 2 x 2048 x 512 x 2 B = 48 MiB, which the records showed as a -3.6 to -3.9 %
    gap before it was counted (measured 1.451-1.456 GiB after the step)."""
    from accuracy_megatron_ci import evaluate, load_records
    from shared_data import MOE_RECORDS
    rows = [evaluate(r) for r in load_records(MOE_RECORDS) if "_a2a_ovlp_8experts_etp1_ep4" in r["id"]]
    assert len(rows) == 3
    for row in rows:
        assert row.error is None
        assert abs(row.steady_err) <= 0.01, (row.id, row.steady_err)
        assert abs(row.peak_err) <= 0.03, (row.id, row.peak_err)


def test_cuda_graphs_under_the_overlap():
    # TransformerConfig.__post_init__: under the overlap the transformer_engine graphs may not take moe or mlp
    # (core 0.16.1 to 0.19.2), and 0.16.1 / 0.17.1 assert cuda_graph_impl == "transformer_engine" whenever graphs
    # are on ("CUDA graph scope on moe and mlp is not supported with overlap_moe_expert_parallel_comm")
    vpp = ["--num-layers-per-virtual-pipeline-stage", "2"]
    with pytest.raises(ConfigError, match="--cuda-graph-impl: must be transformer_engine under"):
        _resolve(vpp + ["--cuda-graph-impl", "local"], version="0.16.1")
    with pytest.raises(ConfigError, match="--enable-cuda-graph: must be transformer_engine under"):
        _resolve(vpp + ["--enable-cuda-graph"], version="0.17.1")
    assert _resolve(vpp + ["--cuda-graph-impl", "local"]).cuda_graph_impl == "local"          # 0.19.2
    from megatron_memguard.errors import ConfigErrors
    with pytest.raises(ConfigErrors) as e:    # (with the mlp graph's own rule: every layer here is MoE)
        _resolve(vpp + ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn", "mlp"],
                 version="0.16.1")
    assert "--cuda-graph-scope: must not contain moe or mlp under --overlap-moe-expert-parallel-comm" in str(e.value)
    L = _resolve(vpp + ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn", "moe_router"])
    assert L.cuda_graph_modules == ("attn", "moe_router")


# ----- the CPU referee: the combined 1F1B schedule under PP 2 x VPP 2 (its own pipeline tensors) ------------

def test_referee_combined_schedule_pp2_vpp2():
    """benchmarks/results/referee-moe-combined-vpp.json (real megatron-core 0.16.1 on CPU, grids/moe.py's
    moe_pp2_vpp2_a2a_overlap: PP 2 x VPP 2, DP 2, EP 2, 4 micro-batches, --overlap-moe-expert-parallel-comm; kept apart
    from referee-moe-measured.json because moe_check.py derives no per-module rows for the combined schedule under
    PP): parameters exact, the state after the step within 1%, each rank's peak within 2% (the two DP ranks of a
    stage route differently: 1.5 MB apart on the first stage)."""
    import json
    from benchmarks.referee.grids.dense import resolve_config
    from benchmarks.referee.grids.moe import MOE_GRID
    from megatron_memguard import estimate
    with open(os.path.join(os.path.dirname(HERE), "benchmarks", "results", "referee-moe-combined-vpp.json")) as f:
        got = {c["name"]: c for c in json.load(f)["configs"]}["moe_pp2_vpp2_a2a_overlap"]
    cfg = next(c for c in MOE_GRID if c["name"] == "moe_pp2_vpp2_a2a_overlap")
    L, _ = resolve_config(cfg["flags"], cfg["world_size"])
    assert (L.pp, L.vpp, L.num_microbatches) == (2, 2, 4)
    est = estimate(L, profile="local", device="cpu")
    for r in got["ranks"]:
        st = est.stages[r["pp_rank"]]
        assert st.parameters == r["num_params"], r["rank"]
        assert abs(st.persistent_bytes / r["live_bytes_after_step"] - 1) <= 0.01, r["rank"]
        assert abs(st.peak_allocated_bytes / r["peak_bytes"] - 1) <= 0.02, (r["rank"], st.peak_allocated_bytes)
    # The last stage's peak, the forward of chunk 1's micro-batch 2 (combined step 3, after the backward of chunk 0's
    # micro-batch 1), by hand from the source: the loop's input_tensor_grad of step 2 (chunk 0 micro-batch 0: 1), the
    # step's backward input and its .grad (chunk 0 micro-batch 1, b_input_tensor: 2), the warm-up's last receive
    # (chunk 1 micro-batch 1, done: input and gradient, 2): 5 tensors of [s, b, h] bf16 = 256 x 2 x 256 x 2 B
    # (counting every receiving chunk's pair at every pass gave 4)
    last = est.stages[1]
    assert last.peak_phase == "forward of micro-batch 3, chunk 1 (3 held)"
    assert {t.name: t.bytes for t in last.terms}["pipeline_inputs_retained"] == 5 * 256 * 2 * 256 * 2


def _stored(name: str, config: str) -> dict:
    import json
    with open(os.path.join(os.path.dirname(HERE), "benchmarks", "results", name)) as f:
        return {c["name"]: c for c in json.load(f)["configs"]}[config]


def test_referee_after_step_schedule_tensors():
    """What the combined 1F1B schedule leaves after the step (referee-moe-combined-vpp.json, core 0.16.1): per MoE
    layer the dispatcher's probs keep an autograd graph ending in the layer's detached input (its storage and its
    .grad); per receiving chunk TransformerBlock keeps the received input and its .grad. On a receiving chunk the first
    layer's detached input is a view of the received tensor (ScheduleNode._forward detaches without a copy): three
    [s, b, h] tensors per receiving chunk, not four. Counted from the stored storages: bf16 [256, 2, 256] made by the
    schedule itself (phase 'it2 schedule', no layer), plus the router's and dispatch_preprocess's held maps; and
    one fp32 rotary table [s, d] per model chunk (its own RotaryEmbedding's lru_cache)."""
    from benchmarks.referee.grids.dense import resolve_config
    from benchmarks.referee.grids.moe import MOE_GRID
    from megatron_memguard import estimate
    got = _stored("referee-moe-combined-vpp.json", "moe_pp2_vpp2_a2a_overlap")
    cfg = next(c for c in MOE_GRID if c["name"] == "moe_pp2_vpp2_a2a_overlap")
    L, _ = resolve_config(cfg["flags"], cfg["world_size"])
    est = estimate(L, profile="local", device="cpu")
    t = 256 * 2 * 256 * 2
    for r in got["ranks"]:
        rows = r["after_step_all_storages"]
        schedule = [x for x in rows if x["phase"] == "it2 schedule" and x["shape"] == [256, 2, 256]]
        held_maps = sum(x["bytes"] for x in rows if x["phase"].endswith((".router", ".dispatch_preprocess")))
        tables = [x for x in rows if x["op"] == "cat" and x["shape"] == [256, 32] and x["dtype"] == "float32"]
        n = sum(x["count"] for x in schedule)
        # first stage: chunk 0 (embedding) 2 + chunk 1 (receiving) 3; last stage: 2 receiving chunks x 3
        assert n == (5 if r["pp_rank"] == 0 else 6)
        assert sum(x["bytes"] for x in schedule) == n * t
        terms = {x.name: x.bytes for x in est.stages[r["pp_rank"]].terms}
        # (at the peak the retained pairs are the pass's; after the step every receiving chunk's pair)
        retained = 2 * t * (1 if r["pp_rank"] == 0 else 2)
        assert terms["moe_dispatcher_state"] + retained == n * t + held_maps
        assert sum(x["count"] for x in tables) == 2 and terms["rotary_cache"] == sum(x["bytes"] for x in tables)
        # what is left: a few hundred bytes (Adam's step counters, loss-scale scalars, the routers' bookkeeping)
        assert 0 < r["live_bytes_after_step"] - est.stages[r["pp_rank"]].persistent_bytes < 512


@pytest.mark.parametrize("config,m", [("moe_pp2_vpp2_a2a_overlap", 4), ("moe_pp2_vpp2_a2a_overlap_mb6", 6),
                                      ("moe_pp2_vpp2_a2a_overlap_mb2", 2), ("moe_pp2_vpp2_l2_a2a_overlap", 4),
                                      ("moe_pp2_vpp2_l2_mixed_a2a_overlap", 4)])
def test_referee_combined_schedule_pass_by_pass(config, m):
    """benchmarks/results/referee-moe-combined-passes.json (moe_grid --pass-trace, core 0.16.1): the live bytes at every
    call of combined_1f1b_schedule_for_interleaved_pipelining in the second iteration, PP 2 x VPP 2 with 4, 6 and 2
    micro-batches. Megatron's calls are memguard's passes in order (warm-up forwards, steady backward + forward steps,
    cool-down backwards; compare_rank refuses otherwise), and each call peaks within 4% of memguard's value at that
    pass (the two DP ranks of a stage route differently: up to 5.5 MB apart at the same call). A backward no forward
    runs beside (the cool-down; with 2 micro-batches every backward, the first stage's peak) is taken at its own
    working set: at the paired one (one more MoE layer's saved tensors, 6.5 MiB here) those calls were 4% to 9.6% high."""
    from benchmarks.referee.combined_passes import compare_rank
    from benchmarks.referee.grids.dense import resolve_config
    from benchmarks.referee.grids.moe import MOE_GRID
    from megatron_memguard import estimate
    got = _stored("referee-moe-combined-passes.json", config)
    cfg = next(c for c in MOE_GRID if c["name"] == config)
    est = estimate(resolve_config(cfg["flags"], cfg["world_size"])[0], profile="local", device="cpu")
    for r in got["ranks"]:
        rows = compare_rank(got, r)
        # every virtual micro-batch (m x VPP 2) forwarded once and backwarded once
        assert sorted(x["f"] for x in rows if x["f"] is not None) == sorted(x["b"] for x in rows if x["b"] is not None) \
            == list(range(2 * m))
        for row in rows:
            assert abs(row["err"]) <= 0.04, (r["rank"], row["f"], row["b"], row["err"])
        top = max(x["predicted"] for x in rows)
        assert top == est.stages[r["pp_rank"]].peak_allocated_bytes      # the estimate's own walk, pass for pass
        assert abs(top / max(x["measured_peak"] for x in rows) - 1) <= 0.04, r["rank"]


@pytest.mark.parametrize("config", ["moe_pp2_vpp2_l2_a2a_overlap", "moe_pp2_vpp2_l2_mixed_a2a_overlap"])
def test_referee_combined_steps_of_two_layer_chunks(config):
    """2-layer chunks (8 layers, PP 2 x VPP 2, 4 micro-batches; all MoE, or each chunk a dense then an MoE layer):
    TransformerModelChunkSchedulePlan.run pairs forward layer i with backward layer n - 1 - i (model_chunk_schedule_plan.py,
    megatron-core 0.16.1), so a step holds the backward's remaining layers and the forward's layers made so far, about one
    layer more than the backward alone whichever i: memguard's backward-then-forward walk with one paired layer's working
    set. Every steady step (a call with a backward and a forward) lies within the two DP ranks' measured peaks at that
    call, widened by 0.5% (the DP ranks route differently: up to 8 MiB apart at the same step), and after the step
    each rank holds memguard's persistent bytes within 1 KiB (scalars: Adam's step counters, the 8 routers' bookkeeping)."""
    from benchmarks.referee.combined_passes import compare_rank
    from benchmarks.referee.grids.dense import resolve_config
    from benchmarks.referee.grids.moe import MOE_GRID
    from megatron_memguard import estimate
    got = _stored("referee-moe-combined-passes.json", config)
    cfg = next(c for c in MOE_GRID if c["name"] == config)
    est = estimate(resolve_config(cfg["flags"], cfg["world_size"])[0], profile="local", device="cpu")
    by_stage: dict = {}
    for r in got["ranks"]:
        by_stage.setdefault(r["pp_rank"], []).append(compare_rank(got, r))
        assert 0 <= r["live_bytes_after_step"] - est.stages[r["pp_rank"]].persistent_bytes < 1024, r["rank"]
    steps = 0
    for a, b in by_stage.values():
        for x, y in zip(a, b):
            if x["f"] is None or x["b"] is None:
                continue
            steps += 1
            lo, hi = sorted((x["measured_peak"], y["measured_peak"]))
            assert lo * 0.995 <= x["predicted"] <= hi * 1.005, (x["f"], x["b"], lo, hi, x["predicted"])
    assert steps == 3 + 5                # steady steps: 3 on the first stage (warm-up 5 of 8), 5 on the last


def test_received_input_counted_once_only_where_the_first_layer_is_moe():
    # 8 layers, PP 2 x VPP 2 (2 layers a chunk), every other layer MoE: the MoE layer first in each chunk ([1, 0] x 4)
    # or second ([0, 1] x 4), so each chunk has one MoE layer either way. Only where it is first is its held input
    # (moe_dispatcher_state) the received tensor pipeline_inputs_retained counts: one [s, b, h] bf16 less per
    # receiving chunk (s 1024, b 1, h 512: 1 MiB), 1 on the first stage (its chunk 0 gets the embedding's output) and
    # 2 on the last (referee-measured rule: test_referee_after_step_schedule_tensors)
    from megatron_memguard import estimate
    vpp = ["--num-layers-per-virtual-pipeline-stage", "2"]
    first = estimate(_resolve(vpp + ["--moe-layer-freq", "([1,0]*4)"]), device="cpu")
    second = estimate(_resolve(vpp + ["--moe-layer-freq", "([0,1]*4)"]), device="cpu")
    t = 1024 * 1 * 512 * 2
    for st_first, st_second, receiving in zip(first.stages, second.stages, (1, 2)):
        a = {x.name: x.bytes for x in st_first.terms}
        b = {x.name: x.bytes for x in st_second.terms}
        assert b["moe_dispatcher_state"] - a["moe_dispatcher_state"] == receiving * t


def test_pp1_single_microbatch_backward_runs_alone():
    # combined_1f1b_schedule_for_no_pipelining (combined_1f1b.py, megatron-core 0.16.1 and 0.19.2) runs micro-batch 0's
    # forward alone, then (backward i, forward i + 1) steps, then the last backward with f_model None: with one
    # micro-batch its only backward has no forward layer beside it. Large experts (F 16384, top-8 of 8, s 256) so that
    # the peak is in an MoE layer's backward: with 2 micro-batches the paired forward layer adds one MoE layer's share
    # (moe_layer_activations / 8 layers), with 1 it does not, and the working set is the one without the overlap
    from megatron_memguard import estimate
    moe = ["--pipeline-model-parallel-size", "1", "--moe-ffn-hidden-size", "16384", "--moe-router-topk", "8",
           "--seq-length", "256", "--max-position-embeddings", "256"]
    one = estimate(_resolve(moe + ["--global-batch-size", "8"]), device="cpu").stages[0]    # DP 8: m = 1
    two = estimate(_resolve(moe + ["--global-batch-size", "16"]), device="cpu").stages[0]   # m = 2
    a = {x.name: x.bytes for x in one.terms}
    b = {x.name: x.bytes for x in two.terms}
    assert one.peak_phase.startswith("backward") and two.peak_phase.startswith("backward")
    assert a["moe_layer_activations"] == b["moe_layer_activations"]
    assert b["backward_transient"] - a["backward_transient"] == a["moe_layer_activations"] // 8
    assert two.peak_allocated_bytes - one.peak_allocated_bytes == a["moe_layer_activations"] // 8
    # the working set of the same backward without --overlap-moe-expert-parallel-comm
    from megatron_memguard.estimator.core import _without_paired_forward
    L = _resolve(moe + ["--global-batch-size", "8"])
    off = estimate(_without_paired_forward(L), device="cpu").stages[0]
    assert {x.name: x.bytes for x in off.terms}["backward_transient"] == a["backward_transient"]
