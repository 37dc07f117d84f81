"""Stages with the same chunk shapes share their schedule-independent terms (estimator/core.py
_stage_prep): the estimate must be the one computed stage by stage, for every feature that adds terms.

The reference keys every stage by its rank (nothing shared); both runs must give the same JSON."""
from __future__ import annotations

import json

import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.estimator import core

# DeepSeek-V3's shape on 1,024 GPUs, PP16 x VPP2, EP 64 (benchmarks/estimate_speed.py): 13 middle
# stages share one shape, the first two and the last have their own.
DSV3 = ("--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 "
        "--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 "
        "--v-head-dim 128 --swiglu --normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights "
        "--position-embedding-type rope --num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 "
        "--moe-shared-expert-intermediate-size 2048 --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
        "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --moe-layer-freq ([0]*3+[1]*58) "
        "--pipeline-model-parallel-size 16 --expert-model-parallel-size 64 "
        "--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 8192 --bf16 "
        "--use-distributed-optimizer --tokenizer-type NullTokenizer --vocab-size 129280").split()
LAYOUT = ["--pipeline-model-parallel-layout", "Et|(tt|)*30L"]
VARIANTS = {
    "plain": LAYOUT,
    "mtp": ["--pipeline-model-parallel-layout", "Et|(tt|)*30mL", "--mtp-num-layers", "1"],
    "full recompute": LAYOUT + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                "--recompute-num-layers", "1"],
    "selective recompute": LAYOUT + ["--recompute-granularity", "selective", "--recompute-modules", "moe_act",
                                     "mla_up_proj"],
    "cuda graphs": LAYOUT + ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn"],
    "activation offloading": LAYOUT + ["--fine-grained-activation-offloading", "--offload-modules", "moe_act"],
    "optimizer offload": LAYOUT + ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5",
                                   "--use-precision-aware-optimizer"],
    "overlap (buckets on rank 0)": LAYOUT + ["--overlap-grad-reduce", "--overlap-param-gather"],
    "1F1B, sequence parallel": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                "--expert-tensor-parallel-size", "1",
                                "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "4"],
}


def _rank_keyed(L):
    return tuple(core._StageShape(("rank", r), r) for r in range(L.pp))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_shared_stage_terms_equal_stage_by_stage(name, monkeypatch):
    L = layout_from_flags(DSV3 + VARIANTS[name], world_size=1024, megatron_version="0.19")
    shapes = core._stage_shapes(L)
    assert len(set(shapes)) < L.pp          # some stages do share (else this checks nothing)
    shared = json.dumps(estimate(L).to_dict(), sort_keys=True)
    core._stage_prep.cache_clear()
    monkeypatch.setattr(core, "_stage_shapes", _rank_keyed)
    alone = json.dumps(estimate(L).to_dict(), sort_keys=True)
    core._stage_prep.cache_clear()
    assert shared == alone


def test_terms_made_at_first_read_do_not_depend_on_when_they_are_read():
    """StageEstimate.terms and .moe are made when first read (a planner reads the totals only): read after
    other estimates have refilled the caches, or after a pickle round trip, they are the ones read at once,
    and the allocated terms add up to the stage's peak allocated bytes."""
    import pickle
    from benchmarks.estimate_speed import _clear_caches
    L = layout_from_flags(DSV3 + VARIANTS["mtp"], world_size=1024, megatron_version="0.19")
    late = estimate(L)                       # nothing of it read yet
    pickled = pickle.dumps(estimate(L))
    _clear_caches()
    estimate(layout_from_flags(DSV3 + VARIANTS["full recompute"], world_size=1024, megatron_version="0.19"))
    now = json.dumps(estimate(L).to_dict(), sort_keys=True)
    assert json.dumps(late.to_dict(), sort_keys=True) == now
    assert json.dumps(pickle.loads(pickled).to_dict(), sort_keys=True) == now
    for s in late.stages:
        assert sum(t.bytes for t in s.terms if t.level == "allocated") == s.peak_allocated_bytes
        assert s.moe["worst_case"]["peak_allocated_bytes"] >= s.peak_allocated_bytes
