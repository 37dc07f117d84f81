"""The MoE estimator functions (megatron_memguard/estimator/layers/moe.py) against numbers one can redo by hand
and against the CPU referee's measurements on real megatron-core 0.16.1
(benchmarks/results/referee-moe-measured.json, written by benchmarks/referee/moe_grid.py; what each
module keeps is derived in benchmarks/referee/MOE-NOTES.md)."""
from __future__ import annotations

import json
import os
import pytest

from megatron_memguard.errors import ConfigError
from megatron_memguard.estimator.layers.moe import (
    MoeSpec, expert_data_parallel_size, expert_rows, experts_use_expert_buffer, moe_activations,
    moe_layers_in, moe_mlp_params, parse_moe_layer_freq, tokens_per_rank,
)
from benchmarks.referee.grids.dense import resolve_config
from benchmarks.referee.grids.moe import MOE_GRID
from megatron_memguard.estimator.params import chunk_params
from megatron_memguard.layout import Layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED = os.path.join(ROOT, "benchmarks", "results", "referee-moe-measured.json")
_DT = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def _referee() -> dict:
    with open(MEASURED) as f:
        return {c["name"]: c for c in json.load(f)["configs"] if c.get("status") == "ok"}


def _resolved(name: str) -> tuple[Layout, MoeSpec]:
    """The referee configuration's flags resolved by memguard (its MoE section included)."""
    cfg = next(c for c in MOE_GRID if c["name"] == name)
    L, _ = resolve_config(cfg["flags"], cfg["world_size"])
    return L, L.moe


# ---- which layers are MoE (megatron/training/arguments.py moe_freq_type) ----------------------------
def test_layer_freq_int_and_list_expressions():
    assert parse_moe_layer_freq(1, 4) == (True,) * 4
    assert parse_moe_layer_freq(2, 5) == (True, False, True, False, True)   # i % 2 == 0
    assert parse_moe_layer_freq("([0]*3+[1]*5)", 8) == (False,) * 3 + (True,) * 5
    assert parse_moe_layer_freq("[1,0]*2", 4) == (True, False, True, False)
    # DeepSeek-V3: 61 layers, first 3 dense -> 58 MoE layers
    assert sum(parse_moe_layer_freq("([0]*3+[1]*58)", 61)) == 58
    pat = parse_moe_layer_freq("([0]*3+[1]*58)", 61)
    assert moe_layers_in(pat, 0, 4) == 1 and moe_layers_in(pat, 4, 4) == 4


@pytest.mark.parametrize("value", ["([0]*3+[1]*4)", "[2,1]", "__import__('os')", "0", "[1]*", True,
                                   "(" * 3000 + "[1]" + ")" * 3000, "+".join(["[1]*99999"] * 900), "[1]*999999"])
def test_layer_freq_rejects_with_the_flag_named(value):
    with pytest.raises(ConfigError) as e:
        parse_moe_layer_freq(value, 8)
    assert "--moe-layer-freq" in str(e.value)


# ---- groups and buffers ------------------------------------------------------------------------------
def test_expert_data_parallel_size():
    # initialize_model_parallel: EDP = world / (ETP x EP x PP); 8 GPUs, TP4 PP2 EP2 ETP2 -> 1
    assert expert_data_parallel_size(8, 2, 2, 2) == 1
    # DeepSeek-V3-shaped: 1024 GPUs, PP16, EP64, ETP1 -> 1
    assert expert_data_parallel_size(1024, 16, 64, 1) == 1
    assert expert_data_parallel_size(4, 1, 2, 1) == 2
    with pytest.raises(ConfigError):
        expert_data_parallel_size(6, 1, 4, 1)


def test_which_version_puts_experts_in_the_expert_buffer():
    m = MoeSpec(num_experts=4, expert_model_parallel_size=1, expert_tensor_parallel_size=1)
    # moe-fp8.md 1.3: 0.16.1 allreduce = not (is_expert and EP > 1); 0.19: EP > 1 or ETP != TP
    assert not experts_use_expert_buffer(m, tp=2, megatron_version="0.16.1")
    assert experts_use_expert_buffer(m, tp=2, megatron_version="0.19")
    assert not experts_use_expert_buffer(m, tp=1, megatron_version="0.19")
    # referee moe_ep1_e4 (0.16.1, EP1): one DDP buffer, 0 expert params
    s = _referee()["moe_ep1_e4"]
    assert all(r["num_params_expert"] == 0 for r in s["ranks"])


# ---- parameters (MOE-NOTES.md "Parameters and persistent memory", measured on every rank) -------------
def _rank_params(L: Layout, m: MoeSpec, pp_rank: int = 0) -> tuple[int, int]:
    """(all, expert) parameters of one rank: its chunks' parameters (the MoE recipe on MoE layers)."""
    total = expert = 0
    for c in L.stage_chunks(pp_rank):
        ps = chunk_params(L, c)
        total += sum(p.numel for p in ps)
        expert += sum(p.numel for p in ps if p.expert)
    return total, expert


@pytest.mark.parametrize("name", ["moe_ep2_alltoall", "moe_ep2_allgather", "moe_ep2_shared", "moe_ep2_dense_first",
                                  "moe_tp2_sp_ep2", "moe_tp2_sp_ep2_etp1", "moe_pp2_ep2", "moe_ep2_shared_gate",
                                  "moe_ep2_etp2"])
def test_parameters_per_rank_equal_the_referee(name):
    c = _referee()[name]
    L, m = _resolved(name)
    for r in c["ranks"]:
        total, expert = _rank_params(L, m, r["pp_rank"])
        assert total == r["num_params"], (name, r["rank"])
        if experts_use_expert_buffer(m, L.tp, "0.16.1"):
            assert expert == r["num_params_expert"], (name, r["rank"])


def test_parameters_by_hand():
    # MOE-NOTES.md: 2·V·h + 4·(2h + h(h+2·128) + h² + E·h + E_l·3·F·h) + h = 8,067,328 with V 8064,
    # h 256, E 4, E_l 2, F 512; dense-first [0,1,1,1]: 7,771,392; expert params 4·2·3·F·h = 3,145,728
    L, m = _resolved("moe_ep2_alltoall")
    assert _rank_params(L, m) == (8_067_328, 3_145_728)
    assert _rank_params(*_resolved("moe_ep2_dense_first"))[0] == 7_771_392


def test_an_expert_tp_larger_than_tp_by_hand():
    """moe_ep2_etp2 (props8, 2026-11-30, core 0.16.1): TP 1, EP 2, ETP 2 on 4 ranks (expert DP 1, DP 4). Per layer
    linear_qkv (8 + 2 x 4) x 32 x 256 = 131,072, linear_proj 65,536, two RMSNorms 512, the router [4, 256] 1,024, and
    E / EP = 2 experts each split over ETP: fc1 [2 x 512 / 2, 256] 131,072 + fc2 [256, 512 / 2] 65,536: 591,360;
    4 layers, the untied [8064, 256] embedding and output layer 4,128,768 and the final norm: 6,494,464, the referee's
    count on each rank. The tokens each rank's experts see: its ETP group's T x k x ETP = 512 x 2 x 2 = 2,048 rows
    balanced (the alltoall dispatcher gathers the ETP group's tokens, token_dispatcher.py), the measured layers
    1,551-2,545 around it; the peak within 0.15% on every rank."""
    L, m = _resolved("moe_ep2_etp2")
    layer = 131_072 + 65_536 + 512 + 1_024 + 2 * (131_072 + 65_536)
    assert layer == 591_360
    assert _rank_params(L, m)[0] == 4 * layer + 2 * 8064 * 256 + 256 == 6_494_464
    assert expert_rows(m, tokens_per_rank(L)).balanced == 2_048
    rows = [rec["expert_input_rows"] for r in _referee()["moe_ep2_etp2"]["ranks"] for rec in r["routing"]]
    assert min(rows) < 2_048 < max(rows) and sum(rows) / len(rows) == 2_048


# ---- tokens ------------------------------------------------------------------------------------------
def test_expert_rows_balanced_worst_and_capacity():
    m = MoeSpec(num_experts=4, moe_router_topk=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    r = expert_rows(m, 512)
    assert (r.balanced, r.worst) == (1024, 2048)   # T·k·ETP; T·ETP·EP·min(k, E_l)
    # referee moe_ep2_capacity_pad: capacity factor 1.0, T 512, k 2, E 4 -> C 256, N = C·E·ETP = 1024 every step
    m = MoeSpec(num_experts=4, moe_router_topk=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    assert expert_rows(m, 512).balanced == expert_rows(m, 512).worst == 1024
    c = _referee()["moe_ep2_capacity_pad"]
    assert {rec["expert_input_rows"] for r in c["ranks"] for rec in r["routing"]} == {1024}
    # the referee's dropless runs stay within the worst-case bound
    for name in ("moe_ep2_alltoall", "moe_tp2_sp_ep2_etp1", "moe_ep2_shared"):
        c = _referee()[name]
        L, m = _resolved(name)
        bound = expert_rows(m, tokens_per_rank(L)).worst
        assert max(rec["expert_input_rows"] for r in c["ranks"] for rec in r["routing"]) <= bound


# ---- what an MoE layer keeps: every module of every MoE layer at the referee's peak --------------------
MODULES = ("router", "dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "experts",
           "shared_experts", "combine_preprocess", "token_combine", "combine_postprocess")


def _measured_layer(rank: dict, phase: str, layer: int) -> int:
    return sum(g["bytes"] for g in rank["peak_all_storages"]
               if any(g["phase"] == f"{phase} L{layer}.{mod}" for mod in MODULES))


def test_saved_and_held_bytes_equal_the_referee_per_layer():
    checked = 0
    for name, c in _referee().items():
        s = c["settings"]
        if "moe" in (s.get("recompute_modules") or []):
            continue
        if s.get("overlap_moe_expert_parallel_comm"):
            continue   # combined 1F1B bypasses schedules.forward_step: no per-micro-batch phase labels
        L, m = _resolved(name)
        for r in c["ranks"]:
            if " L" in r["peak_phase"]:
                continue   # the peak is inside a layer: its transients are live too
            words = r["peak_phase"].split()
            phase = " ".join(words[:3 if words[2].startswith("mb") else 4])
            for rec in r["routing"]:
                if rec["phase"] != phase:
                    continue
                assert rec["tokens"] == tokens_per_rank(L)
                a = moe_activations(L, m, rows=rec["expert_input_rows"])
                # (the permute's mapping is saved and held: one tensor while the micro-batch is in flight)
                want = a.total + a.held - a.mapping
                if m.moe_pad_expert_input_to_capacity:
                    want += 8 * m.num_experts * m.etp   # int64 chunk sizes: host memory on a GPU, counted on CPU
                assert _measured_layer(r, phase, rec["layer"]) == want, (name, r["rank"], rec["layer"])
                checked += 1
    assert checked >= 60


def test_recompute_moe_keeps_only_the_dispatcher_state():
    # MOE-NOTES.md: with --recompute-modules moe the layer keeps (p+1)·T·E + 8·T·k = 14,336 B per MoE
    # layer (the int64 mapping is the checkpointed forward's, held by the dispatcher)
    L, m = _resolved("moe_ep2_recompute_moe")
    a = moe_activations(L, m)
    # held: probs bf16 + bool map [T, E] = 3·512·4, the int64 mapping [T k] = 8·512·2, and the checkpoint's input
    # and its gradient after the step, 2 x [s, b, h] bf16 = 2·2·512·256 (MOE-NOTES.md: 149,496,824 - 147,399,672 =
    # 4 layers x 524,288)
    assert a.total == 0 and a.held == 3 * 512 * 4 + 8 * 512 * 2 + 4 * 512 * 256
    assert (149_496_824 - 147_399_672) // 4 == 4 * 512 * 256


def test_a2a_overlap_keeps_each_moe_layers_input_and_its_gradient():
    # --overlap-moe-expert-parallel-comm (combined 1F1B, fine_grained_callables.py 0.16.1 / 0.19.2):
    # dispatch_preprocess runs inside the layer's first schedule node, whose input is a detached leaf; the
    # probs the alltoall dispatcher holds until the layer's next forward keep that leaf (via its
    # AccumulateGrad node) and the gradient accumulated into it. Referee, same flags with and without the
    # overlap: 149,496,824 - 147,399,672 B after the step on both ranks = 4 MoE layers x 2 x [s, b, h] bf16
    L, m = _resolved("moe_ep2_a2a_overlap")
    assert m.overlap_moe_expert_parallel_comm and m.moe_token_dispatcher_type == "alltoall"
    # (probs and bool map [T, E], the int64 mapping [T k], and the leaf input with its gradient)
    assert moe_activations(L, m).held == 3 * 512 * 4 + 8 * 512 * 2 + 2 * 2 * 512 * 256
    plain, ovlp = _referee()["moe_ep2_alltoall"], _referee()["moe_ep2_a2a_overlap"]
    for a, b in zip(plain["ranks"], ovlp["ranks"]):
        assert b["live_bytes_after_step"] - a["live_bytes_after_step"] == 4 * 2 * 2 * 512 * 256



def test_a2a_overlap_peak_frees_the_nodes_inputs():
    """The combined 1F1B schedule frees the inputs of an MoE layer's dispatch, experts and combine nodes after their
    forward (ScheduleNode with free_input, ``untyped_storage().resize_(0)``: pipeline_parallel/utils.py and
    fine_grained_callables.py should_free_input, megatron-core 0.16.1 and 0.19.2): the permuted tokens [T k, h], the
    all-to-all output [N, h] and the experts' unpermuted output [N, h]. The referee's tracker missed a storage's own
    resize_ and counted them at the peak (6,192,780 / 6,418,980 B, the estimate -1.9% / -2.4%); re-measured with it,
    the overlap's peak is 481,620 / 688,294 B above moe_ep2_alltoall's (the previous micro-batch's embedding output
    and its gradient, 2 x [s, b, h] = 524,288 B, and its batch's mask and ids), under the 2 MiB memguard adds
    (each layer's input and its gradient that the held probs keep, 2 a T h x 4 layers: an upper bound at a forward
    peak, moe_dispatcher_state): the estimate is 0.4-0.9% high on both runs, recompute_moe's included."""
    from megatron_memguard import estimate
    ref = _referee()
    for name in ("moe_ep2_a2a_overlap", "moe_ep2_a2a_overlap_recompute_moe"):
        L, _ = _resolved(name)
        st = estimate(L, profile="local", device="cpu").stages[0]
        for r in ref[name]["ranks"]:
            assert 0 <= st.peak_allocated_bytes / r["peak_bytes"] - 1 <= 0.01, (name, r["rank"])
    T, h, a = 512, 256, 2
    for plain, ovlp in zip(ref["moe_ep2_alltoall"]["ranks"], ref["moe_ep2_a2a_overlap"]["ranks"]):
        assert 0 < ovlp["peak_bytes"] - plain["peak_bytes"] < 4 * 2 * a * T * h

# ---- the worst case next to the estimate ---------------------------------------------------------------
def test_worst_case_is_reported_and_bounds_the_estimate():
    from megatron_memguard import estimate
    L, m = _resolved("moe_ep2_alltoall")
    for st in estimate(L, profile="local", device="cpu").stages:
        w = st.moe["worst_case"]
        # T 512, k 2, EP 2, 2 local experts: balanced 1,024 rows, worst 512 x 2 x min(2, 2) = 2,048
        assert (st.moe["expert_rows_balanced"], st.moe["expert_rows_worst"]) == (1024, 2048)
        assert w["peak_allocated_bytes"] > st.peak_allocated_bytes
        # the referee's measured peaks (routing 1.2-1.4x balanced) lie between the two
        for r in _referee()["moe_ep2_alltoall"]["ranks"]:
            assert st.peak_allocated_bytes * 0.97 <= r["peak_bytes"] <= w["peak_allocated_bytes"]
    # drop-and-pad: the rows are fixed, the worst case is the estimate
    L, m = _resolved("moe_ep2_capacity_pad")
    st = estimate(L, profile="local", device="cpu").stages[0]
    assert st.moe["worst_case"]["peak_allocated_bytes"] == st.peak_allocated_bytes
    # dense models have no moe figures
    assert "moe" not in estimate(resolve_config(MOE_GRID[0]["dense_flags"], 1)[0]).stages[0].to_dict()


def test_worst_case_under_full_recompute_still_grows_with_the_rows():
    # Checkpointed layers keep no MoE bytes, but the backward remakes one MoE layer at a time; with
    # worst-case routing that layer's dispatched tokens alone grow by (worst - balanced) rows x h x 2 B.
    from megatron_memguard import estimate
    L, m = _resolved("moe_ep2_alltoall")
    L = L.replace(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    for st in estimate(L, profile="local", device="cpu").stages:
        rows = st.moe["expert_rows_worst"] - st.moe["expert_rows_balanced"]
        assert st.moe["worst_case"]["peak_allocated_bytes"] - st.peak_allocated_bytes >= rows * L.hidden_size * 2


def test_dense_layers_of_a_moe_model_keep_the_dense_recipe():
    # --moe-layer-freq 2 on 4 layers: layers 0 and 2 MoE, 1 and 3 dense; a dense layer's parameters are the
    # dense model's, an MoE layer's MLP is the router plus E/EP experts
    from megatron_memguard.estimator.params import layer_params
    from megatron_memguard.partition import MLP_DENSE, MLP_MOE
    L, m = _resolved("moe_ep2_alltoall")
    L2 = L.replace(moe=__import__("dataclasses").replace(m, moe_layer_pattern=(True, False, True, False)))
    kinds = [c.layer_kinds for c in L2.chunks][0]
    assert [k.mlp for k in kinds] == [MLP_MOE, MLP_DENSE, MLP_MOE, MLP_DENSE]
    dense = sum(p.numel for p in layer_params(L2, kind=kinds[1]))
    moe = sum(p.numel for p in layer_params(L2, kind=kinds[0]))
    # MOE-NOTES.md: dense MLP 3·h·640, MoE MLP E·h + E_l·3·F·h (h 256, F 512, E 4, E_l 2)
    assert moe - dense == 4 * 256 + 2 * 3 * 512 * 256 - 3 * 256 * 640


# ---- whole-model parameter counts of published MoE models -------------------------------------------
def _counts() -> dict:
    with open(os.path.join(ROOT, "tests", "data", "moe_reference_counts.json")) as f:
        return json.load(f)["models"]


def test_mixtral_8x7b_parameters():
    # 46,702,792,704: Mixtral-8x7B as transformers builds it from its config.json (tests/data/moe_reference_counts.json)
    from megatron_memguard import layout_from_flags
    from megatron_memguard.estimator.params import total_parameters
    flags = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
             "--num-query-groups 8 --seq-length 4096 --max-position-embeddings 32768 --swiglu --normalization RMSNorm "
             "--disable-bias-linear --untie-embeddings-and-output-weights --position-embedding-type rope --num-experts 8 "
             "--moe-router-topk 2 --tokenizer-type NullTokenizer --vocab-size 32000 --micro-batch-size 1 --bf16 "
             "--expert-model-parallel-size 8").split()
    L = layout_from_flags(flags, world_size=64, megatron_version="0.19")
    assert total_parameters(L) == _counts()["mixtral-8x7b"]["num_parameters"] == 46_702_792_704


def test_deepseek_v3_parameters():
    # 671,026,404,352 (transformers' DeepseekV3ForCausalLM on the meta device, MTP not built): MLA with the
    # latent norms (--qk-layernorm), 3 dense layers, 58 MoE layers of 256 experts + 1 shared
    import sys
    sys.path.insert(0, ROOT)
    from benchmarks.estimate_speed import DEEPSEEK_V3
    from megatron_memguard import layout_from_flags
    from megatron_memguard.estimator.params import total_parameters
    L = layout_from_flags(DEEPSEEK_V3 + ["--qk-layernorm"], world_size=1024, megatron_version="0.19")
    assert total_parameters(L) == _counts()["deepseek-v3"]["num_parameters"] == 671_026_404_352


# ---- properties over MoE layouts Megatron accepts -------------------------------------------------------
from hypothesis import given, settings, strategies as st  # noqa: E402

MOE_PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=60)


@st.composite
def moe_flags(draw):
    tp = draw(st.sampled_from([1, 2]))
    pp = draw(st.sampled_from([1, 2]))
    E = draw(st.sampled_from([2, 4, 8, 16]))
    ep = draw(st.sampled_from([d for d in (1, 2, 4, 8) if E % d == 0]))
    etp = draw(st.sampled_from(sorted({1, tp})))
    k = draw(st.integers(1, min(4, E)))
    world = pp * max(tp, etp * ep) * draw(st.sampled_from([1, 2]))
    world = world * (etp * ep * pp) // __import__("math").gcd(world, etp * ep * pp)   # lcm: both grids divide
    flags = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
             "--max-position-embeddings", "256", "--micro-batch-size", str(mbs := draw(st.sampled_from([1, 2]))),
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--disable-bias-linear",
             "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
             "--num-experts", str(E), "--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", str(etp),
             "--moe-router-topk", str(k), "--moe-ffn-hidden-size", "512",
             "--moe-token-dispatcher-type", draw(st.sampled_from(["allgather", "alltoall"])),
             "--moe-layer-freq", draw(st.sampled_from(["1", "2", "([0]*1+[1]*3)"]))]
    if tp > 1:
        flags.append("--sequence-parallel")
    if k == 1:
        flags.append("--moe-router-pre-softmax")
    flags += draw(st.sampled_from([["--bf16"], [], ["--fp16"], ["--bf16", "--moe-router-dtype", "fp32"]]))
    if pp == 2 and draw(st.booleans()):
        flags += ["--num-layers-per-virtual-pipeline-stage", "1"]
    flags += draw(st.sampled_from([[], ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                        "--recompute-num-layers", "1"],
                                   ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "moe"],
                                   ["--moe-grouped-gemm", "--recompute-granularity", "selective", "--recompute-modules",
                                    "moe_act", "shared_experts"]]))
    cp = draw(st.sampled_from([1, 2]))
    if "--bf16" not in flags and "--fp16" not in flags:
        # fp32: TE's attention has no kernel under context parallelism (flash-attn and cuDNN take bf16/fp16 only,
        # its unfused attention refuses CP: get_attention_backend, TE 2.11.0 / 2.20.2); memguard refuses it
        cp = 1
    world *= cp
    flags += ["--context-parallel-size", str(cp), "--global-batch-size", str(mbs * world // (tp * pp * cp) * 2 * pp)]
    for opt in ("--moe-grouped-gemm", "--use-distributed-optimizer", "--swiglu", "--moe-permute-fusion"):
        if draw(st.booleans()) and opt not in flags:
            flags.append(opt)
    if draw(st.booleans()):
        flags += ["--moe-shared-expert-intermediate-size", "256"]
    return flags, world


@MOE_PROPERTY
@given(moe_flags())
def test_every_moe_layout_estimates_consistently(fw):
    from megatron_memguard import estimate, layout_from_flags
    flags, world = fw
    L = layout_from_flags(flags, world_size=world, megatron_version="0.19")
    est = estimate(L, gpu_memory=80 * 2**30)
    m = L.moe
    for s in est.stages:
        assert all(t.bytes >= 0 for t in s.terms)
        assert sum(t.bytes for t in s.terms if t.level == "allocated") == s.peak_allocated_bytes
        assert s.moe["worst_case"]["peak_allocated_bytes"] >= s.peak_allocated_bytes
        assert s.moe["expert_rows_worst"] >= s.moe["expert_rows_balanced"] == tokens_per_rank(L) * m.moe_router_topk * m.etp
    # the experts of one rank: E/EP local experts of width F/ETP, (g+1)·F·h/ETP each, on every MoE layer
    g = 2 if L.gated_linear_unit else 1
    experts = sum(p.numel for c in L.chunks for p in chunk_params(L, c) if p.expert)   # every stage
    assert experts == m.num_moe_layers * m.local_experts * (g + 1) * 512 * 256 // m.etp
    # doubling EP halves a rank's expert parameters and leaves the dense ones
    if m.num_experts % (2 * m.ep) == 0:
        L2 = L.replace(moe=__import__("dataclasses").replace(m, expert_model_parallel_size=2 * m.ep))
        e2 = sum(p.numel for c in L2.chunks for p in chunk_params(L2, c) if p.expert)
        assert 2 * e2 == experts


# ---- the flex dispatcher (DeepEP) ------------------------------------------------------------------------
def test_deepep_buffer_and_rows_by_hand():
    from megatron_memguard import layout_from_flags
    from megatron_memguard.estimator.layers.moe import deepep_buffer_bytes, flex_rows
    flags = ("--num-layers 4 --hidden-size 7168 --num-attention-heads 56 --seq-length 4096 --micro-batch-size 1 "
             "--num-experts 64 --moe-router-topk 8 --expert-model-parallel-size 8 --moe-token-dispatcher-type flex "
             "--bf16 --disable-bias-linear --moe-router-pre-softmax").split()
    L = layout_from_flags(flags, world_size=8, megatron_version="0.19")
    # moe-fp8.md 1.6 (DeepEP csrc/config.hpp): C = 20 SMs / 2 = 10 channels, n = 8 ranks, r = 1;
    # per channel and rank (2r+3)·4 + 256 x (2·7168 + 8 + 128·8 + 128·4 + 128·4) = 4,196,372 B;
    # x 80 = 335,709,760, rounded up to 128 B: "about 336 MB" in the note
    assert deepep_buffer_bytes(L, L.moe) == 335_709_824
    # E 8, EP 4 (E_l 2), k 2: a token misses a rank's 2 experts with probability C(6,2)/C(8,2) = 15/28
    m = MoeSpec(num_experts=8, moe_router_topk=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1,
                moe_token_dispatcher_type="flex")
    assert flex_rows(m, 1000) == 1858 and flex_rows(m, 1000, worst=True) == 4000     # ceil(4000·13/28); T·EP


def test_deepep_across_nodes_by_hand():
    from megatron_memguard import estimate, layout_from_flags, lookup_gpu
    from megatron_memguard.estimator.layers.moe import deepep_buffer_bytes, deepep_rdma_buffer_bytes
    flags = ("--num-layers 4 --hidden-size 7168 --num-attention-heads 56 --seq-length 4096 --micro-batch-size 1 "
             "--num-experts 64 --moe-router-topk 8 --expert-model-parallel-size 16 --moe-token-dispatcher-type flex "
             "--bf16 --disable-bias-linear --moe-router-pre-softmax").split()
    L = layout_from_flags(flags, world_size=16, megatron_version="0.19")
    # deep-ep 1.0.0 deep_ep/buffer.py: 16 ranks dispatch Config(20, 16, 288, 20, 128), combine
    # Config(20, 2, 288, 28, 128): NVLink receive chunk 288, RDMA receive chunk 128. C = 10 channels, r = 2.
    # NVLink: 10 x 8 x [(2·2+3)·4 + 288 x (14336 + 8 + 1024 + 512 + 512)] = 377,673,920 -> 377,673,984
    assert deepep_buffer_bytes(L, L.moe) == 377_673_984
    # RDMA (csrc/kernels/internode.cu get_rdma_clean_meta, 128 scales and top-k): a token of
    # align16(14336 + 8 + 3 x 512) = 15,888 B; 15,888 x 128 x 2 ranks x 2 (send, receive) x 10 channels
    # = 81,346,560, plus (2·8+4) int32 x 2 x 2 x 10 = 3,200: 81,349,760 (a multiple of 128)
    assert deepep_rdma_buffer_bytes(L, L.moe) == 81_349_760
    fixed = {t.name: t for t in estimate(L, gpu=lookup_gpu("H100-80GB")).stages[0].terms}
    assert fixed["deepep_rdma_buffer"].bytes == 81_349_760 and fixed["deepep_rdma_buffer"].level == "device"
    # within a node there is no RDMA buffer
    L8 = layout_from_flags([f if f != "16" else "8" for f in flags], world_size=8, megatron_version="0.19")
    assert deepep_rdma_buffer_bytes(L8, L8.moe) == 0


def test_moe_mtp_layer_experts_go_to_the_expert_buffer():
    # MultiTokenPredictionLayer takes the last decoder layer's spec: with an MoE last layer the MTP layer
    # is MoE too, and its routed experts are expert parameters (the expert buffer, sharded over expert DP)
    from megatron_memguard import layout_from_flags
    from megatron_memguard.estimator.states import stage_states
    flags = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
             "--micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 1000 --bf16 --disable-bias-linear "
             "--num-experts 4 --moe-ffn-hidden-size 512 --expert-model-parallel-size 2 --moe-router-topk 2 "
             "--untie-embeddings-and-output-weights --position-embedding-type rope").split()
    L0 = layout_from_flags(flags, world_size=2, megatron_version="0.19")
    L1 = layout_from_flags(flags + ["--mtp-num-layers", "1"], world_size=2, megatron_version="0.19")
    from megatron_memguard.estimator.params import chunk_expert_numels
    e0 = sum(n for c in L0.chunks for n, _ in chunk_expert_numels(L0, c))
    e1 = sum(n for c in L1.chunks for n, _ in chunk_expert_numels(L1, c))
    # one more MoE layer's local experts: 2 x (fc1 [512, 256] + fc2 [256, 512]) (GELU, no gating)
    assert e1 - e0 == 2 * (512 * 256 + 256 * 512)
    assert stage_states(L1, 0).parameters > stage_states(L0, 0).parameters
    # and the stage's model state holds them: the MTP layer adds its dense part (enorm, hnorm, eh_proj
    # [256, 512], the layer's attention, norms and router, final norm) and its 2 local experts
    from megatron_memguard.estimator.params import chunk_numels
    dense0 = sum(n for c in L0.chunks for n, _ in chunk_numels(L0, c))
    dense1 = sum(n for c in L1.chunks for n, _ in chunk_numels(L1, c))
    assert stage_states(L1, 0).parameters - stage_states(L0, 0).parameters == (dense1 - dense0) + 2 * (2 * 512 * 256)
