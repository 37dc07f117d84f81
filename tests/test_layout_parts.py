"""The layout's frozen parts (issue 15): one table from flat Megatron names to parts, the JSON document
round trip, shard groups and tensor dtypes."""
from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.estimator.result import GROUPS, LEVELS, Term, TermGroup, TermLevel
from megatron_memguard.layout import (FLAT, FLAT_NAMES, FLAT_REQUIRED, PARTS, Layout, Parallelism, ShardGroup,
                                      TensorKind)
from megatron_memguard.layout.flat import _RUNS, FP8_NAMES, MOE_ONLY, OMITTED_AT_DEFAULT

from property_space import specs

PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=100,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

SMALL = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
         "--micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 1000").split()


def small(*extra: str, world: int = 8) -> Layout:
    return layout_from_flags(SMALL + list(extra), world_size=world, megatron_version="0.19")


# ---------------------------------------------------------------------------------------------------
# One table: every flat name in exactly one part

def test_every_flat_name_maps_to_exactly_one_part():
    listed = [n for _, names in _RUNS for n in names.split()]
    assert len(listed) == len(set(listed)) == len(FLAT)          # no name listed twice
    owners: dict[str, list[str]] = {}
    for part, cls in PARTS.items():
        for f in dataclasses.fields(cls):
            owners.setdefault(f.name, []).append(part)
    assert all(len(v) == 1 for v in owners.values()), {k: v for k, v in owners.items() if len(v) > 1}
    assert {n: p[0] for n, p in owners.items()} == {n: p for n, p in FLAT.items() if p}
    assert [n for n, p in FLAT.items() if not p] == ["moe", "peft", "notes"]     # Layout's own fields
    # no flat name hides a part or a method of Layout
    assert not set(FLAT_NAMES) & ({f.name for f in dataclasses.fields(Layout)} - {"moe", "peft", "notes"})


def test_flat_names_read_their_part_and_are_read_only():
    L = small("--tensor-model-parallel-size", "2", "--bf16")
    for name, part in FLAT.items():
        if part:
            assert getattr(L, name) == getattr(getattr(L, part), name), name
    assert L.tensor_model_parallel_size == L.parallel.tp == 2 and L.hidden_size == L.shape.hidden_size == 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        L.hidden_size = 512  # type: ignore[misc]
    assert L.hidden_size == 256


def test_required_names_are_the_ones_without_a_default():
    # the settings resolve always writes; multi-latent attention's shape, the tokenizer and env have defaults
    assert "world_size" in FLAT_REQUIRED and "megatron_version" in FLAT_REQUIRED
    assert not {"tokenizer_type", "env", "notes", "kv_lora_rank", "q_lora_rank", "rope_type"} & set(FLAT_REQUIRED)
    kw = {k: v for k, v in small().to_dict().items() if k in FLAT_REQUIRED}
    kw["recompute_modules"] = tuple(kw["recompute_modules"])
    Layout.from_flat(**kw)  # enough to build one
    with pytest.raises(TypeError):
        Layout.from_flat(**{k: v for k, v in kw.items() if k != "hidden_size"})
    with pytest.raises(TypeError):
        Layout.from_flat(**kw, moe_router_topk=2)


# ---------------------------------------------------------------------------------------------------
# The JSON document

@PROPERTY
@given(specs())
def test_from_dict_inverts_to_dict(spec):
    L = layout_from_flags(spec.flags(), world_size=spec.world, megatron_version="0.19")
    d = L.to_dict()
    # a dense layout's document leaves out the MoE names (it reads as before MoE was modelled),
    # the FP8 / FP4 settings unless FP8 or FP4 is on, and the feature settings unless set (flat.OMITTED_AT_DEFAULT)
    assert list(d) == [n for n in FLAT_NAMES if (L.moe is not None or n not in MOE_ONLY) and n not in FP8_NAMES
                       and (n not in OMITTED_AT_DEFAULT or getattr(L, n) != OMITTED_AT_DEFAULT[n])]
    back = Layout.from_dict(json.loads(json.dumps(d)))
    assert back == L and hash(back) == hash(L) and back.notes == L.notes
    assert back.to_dict() == d


def test_document_keeps_megatrons_names_in_schema_order():
    # memguard.estimate/1 (docs/json-schema.md): the layout object starts with the world and the parallel
    # sizes and ends with the environment and the notes, as stored JSONL start records have it
    d = small().to_dict()
    assert list(d)[:4] == ["world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                           "virtual_pipeline_model_parallel_size"]
    assert list(d)[-2:] == ["env", "notes"]
    assert isinstance(d["recompute_modules"], list) and isinstance(d["env"], dict) and isinstance(d["notes"], list)


def test_replace_changes_one_setting_and_keeps_the_other_parts():
    L = small("--bf16")
    M = L.replace(transformer_impl="local")
    assert M.transformer_impl == "local" and L.transformer_impl == "transformer_engine"
    assert M.parallel is L.parallel and M.shape is L.shape and M.precision is L.precision
    assert M != L and M.replace(transformer_impl="transformer_engine") == L
    assert L.replace(notes=("x",)) == L                              # notes are not compared
    with pytest.raises(TypeError):
        L.replace(transformer="local")


# ---------------------------------------------------------------------------------------------------
# Shard groups

@pytest.mark.parametrize("dp, cp, instances, expected", [
    (4, 2, 2, 4),   # DP x CP = 8 ranks, two optimizer replicas of 4
    (8, 1, 1, 8),
    (1, 1, 1, 1),   # one rank: the whole state
    (2, 4, 1, 8),   # context-parallel ranks shard the optimizer too
    (2, 1, 2, 1),   # each replica is one rank
])
def test_dense_dp_shard_size_is_dp_times_cp_over_instances(dp, cp, instances, expected):
    p = Parallelism(world_size=dp * cp, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                    virtual_pipeline_model_parallel_size=None, context_parallel_size=cp, data_parallel_size=dp,
                    sequence_parallel=False, num_distributed_optimizer_instances=instances)
    assert p.shard_size(ShardGroup.DENSE_DP) == expected


def test_distributed_optimizer_shards_over_the_dense_dp_group():
    # world 16 = TP2 x CP2 x DP4; two optimizer instances: each shards over DP x CP / 2 = 4 ranks
    # (megatron/core/optimizer/distrib_optimizer.py), so Adam's fp32 state is a quarter of the replicated one
    flags = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--bf16"]
    L = small(*flags, "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2", world=16)
    assert L.data_parallel_size == 4 and L.parallel.shard_size(ShardGroup.DENSE_DP) == 4
    terms = {t.name: t for t in estimate(L).stages[0].terms}
    assert terms["adam_exp_avg"].detail.endswith("/ 4 (distributed optimizer)")
    replicated = {t.name: t for t in estimate(small(*flags, world=16)).stages[0].terms}
    # each rank owns 1/4 of the padded buffer, the padding rank holding at most one slice's worth more
    assert replicated["adam_exp_avg"].bytes / 4 <= terms["adam_exp_avg"].bytes < replicated["adam_exp_avg"].bytes / 2


# ---------------------------------------------------------------------------------------------------
# Tensor dtypes (megatron/training/arguments.py validate_args)

def test_dtypes_of_tensor_kinds():
    # --bf16 turns on fp32 gradient accumulation unless --grad-reduce-in-bf16; master weights and Adam fp32
    p = small("--bf16").precision
    assert [p.bytes_of(k) for k in (TensorKind.PARAM, TensorKind.ACTIVATION, TensorKind.GRAD_REDUCE,
                                    TensorKind.MAIN_GRAD, TensorKind.MAIN_PARAM, TensorKind.EXP_AVG,
                                    TensorKind.EXP_AVG_SQ)] == [2, 2, 4, 4, 4, 4, 4]
    assert small("--bf16", "--grad-reduce-in-bf16").precision.bytes_of(TensorKind.MAIN_GRAD) == 2
    # fp32 training: everything 4 bytes
    assert {small().precision.bytes_of(k) for k in TensorKind} == {4}
    # the precision-aware optimizer (TE FusedAdam) with 16-bit moments and main grads
    pa = small("--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16",
               "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16").precision
    assert pa.dtype_of(TensorKind.MAIN_GRAD) == "bf16" and pa.dtype_of(TensorKind.EXP_AVG) == "bf16"
    assert pa.dtype_of(TensorKind.MAIN_PARAM) == "fp32"


def test_fused_wgrad_is_gradient_accumulation_fusion():
    assert small("--bf16").fused_wgrad
    assert not small("--bf16", "--no-gradient-accumulation-fusion").fused_wgrad


# ---------------------------------------------------------------------------------------------------
# Term groups and levels keep their JSON strings

def test_term_groups_and_levels_are_their_strings():
    assert [str(g) for g in GROUPS] == ["weights", "gradients", "optimizer", "activations", "logits_loss",
                                        "transients", "fixed", "allocator"]
    assert [f"{lv}" for lv in LEVELS] == ["allocated", "reserved", "device"]
    t = Term("cuda_context", 1, TermGroup.FIXED, TermLevel.DEVICE)
    assert json.dumps(t.to_dict()) == json.dumps(Term("cuda_context", 1, "fixed", "device").to_dict())
    assert {"fixed": 1}[t.group] == 1 and t.level == "device"


def test_every_term_of_an_estimate_has_a_known_group_and_level():
    for L in (small("--bf16", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"),
              small("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")):
        for s in estimate(L).stages:
            for t in s.terms:
                assert TermGroup(t.group) in GROUPS and TermLevel(t.level) in LEVELS, t.name


@pytest.mark.parametrize("field", ["tensor_model_parallel_size", "pipeline_model_parallel_size",
                                   "virtual_pipeline_model_parallel_size", "context_parallel_size", "sequence_parallel"])
def test_parallelism_uses_megatron_cores_names(field):
    mpc = pytest.importorskip("megatron.core.model_parallel_config")
    assert field in {f.name for f in dataclasses.fields(Parallelism)}
    assert field in {f.name for f in dataclasses.fields(mpc.ModelParallelConfig)}


# ---------------------------------------------------------------------------------------------------
# Mixture of experts: the expert-data-parallel group and the moe part

MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--sequence-parallel", "--tensor-model-parallel-size", "2",
       "--pipeline-model-parallel-size", "2", "--context-parallel-size", "2", "--expert-model-parallel-size", "4",
       "--expert-tensor-parallel-size", "1", "--use-distributed-optimizer"]


def test_expert_dp_shard_size_by_hand():
    L = small(*MOE, world=32)
    # dense: DP = 32 / (TP2 PP2 CP2) = 4, sharded over DP x CP = 8; experts: EDP = 32 / (ETP1 EP4 PP2) = 4
    assert L.parallel.shard_size(ShardGroup.DENSE_DP) == 8
    assert L.parallel.shard_size(ShardGroup.EXPERT_DP) == 4
    L2 = small(*MOE, "--num-distributed-optimizer-instances", "2", world=32)
    assert L2.parallel.shard_size(ShardGroup.EXPERT_DP) == 2      # intra_partial_expert_data_parallel: 4 / 2


def test_moe_layout_round_trips_and_dense_documents_are_unchanged():
    L = small(*MOE, world=32)
    d = L.to_dict()
    assert d["expert_model_parallel_size"] == 4 and d["moe"]["num_experts"] == 8
    back = Layout.from_dict(json.loads(json.dumps(d)))
    assert back == L and hash(back) == hash(L) and back.to_dict() == d
    assert "moe" not in small().to_dict() and small().moe is None
