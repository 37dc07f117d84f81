"""The gradient buffers and distributed-optimizer shards of MoE layouts against megatron-core's own
DistributedDataParallel (hypothesis, derandomized): every (pipeline rank, virtual stage) of a drawn corner job
(tests/test_properties_moe_identities.py corner_jobs: EP, ETP != TP, PP with VPP, uneven first / last stages,
layout strings, --moe-layer-freq lists, shared experts, MTP, tied / untied, MLA, optimizer instances) is built by
real megatron-core (tests/e2e/moe_rank_params.py: 0.16.1 in this venv, 0.19.2 in $MEMGUARD_PY312's) and wrapped
in its DistributedDataParallel with the distributed optimizer over stand-in data-parallel groups of the job's
sizes; DistributedOptimizer._build_model_gbuf_range then gives each rank's slice. memguard's stage state must
have the build's padded buffer sizes, and for every DP rank and every expert-DP rank its fp32 main weights and
Adam moments must be exactly that pair of slices.
"""
from __future__ import annotations

from hypothesis import given, strategies as st

from megatron_memguard.estimator.states import stage_states
from megatron_memguard.layout import ShardGroup

from test_properties_moe_identities import PROPERTY, Job, _layout, core, corner_jobs  # noqa: F401 (the fixture)


@PROPERTY
@given(corner_jobs(), st.booleans())
def test_every_dp_and_expert_dp_ranks_optimizer_shard_is_megatron_cores(core, job, overlap):  # noqa: F811
    """Per stage: the dense and expert DDP buffers' padded sizes add up to memguard's buffer_numel (gradients:
    4 bytes per element, padding included), and for each DP x CP rank r and expert-data-parallel rank m (each
    over its optimizer instance) memguard's main weights and both Adam moments are 4 bytes per element of the
    real parameters in r's slices of the dense buffers plus m's slices of the expert buffers. With
    --overlap-grad-reduce the buffers are cut into buckets (the first stage's; a tied embedding's own bucket), each
    padded and sliced on its own."""
    extra = ("--use-distributed-optimizer",) + (("--overlap-grad-reduce",) if overlap else ())
    job = Job(flags=tuple(x for x in job.flags if x != "--use-distributed-optimizer") + extra,
              world=job.world, core=job.core)
    L = _layout(job, core.era)
    inst = L.num_distributed_optimizer_instances
    ddp = {"dp_cp": L.dp * L.cp, "edp": L.parallel.shard_size(ShardGroup.EXPERT_DP) * inst, "instances": inst,
           "overlap": overlap}
    v = L.vpp if L.vpp and L.vpp > 1 else None
    ranks = [[p, c, 0, 0, 0] for p in range(L.pp) for c in (range(v) if v else [None])]
    recs = core.ranks(Job(flags=job.flags, world=job.world, core=dict(job.core, ddp=ddp)), L, ranks)
    dense_group, edp = L.parallel.shard_size(ShardGroup.DENSE_DP), L.parallel.shard_size(ShardGroup.EXPERT_DP)
    for p in range(L.pp):
        bufs = [b for r in recs if r["rank"][0] == p for b in r["ddp"]]
        dense = [b for b in bufs if b["kind"] == "dense"]
        expert = [b for b in bufs if b["kind"] == "expert"]
        assert all(len(b["owned"]) == dense_group for b in dense) and all(len(b["owned"]) == edp for b in expert)
        assert stage_states(L, p).buffer_numel == sum(b["numel"] for b in bufs), p
        assert stage_states(L, p).grad_bytes == 4 * sum(b["numel"] for b in bufs), p
        for r in range(dense_group):
            for m in range(edp):
                owned = sum(b["owned"][r] for b in dense) + sum(b["owned"][m] for b in expert)
                s = stage_states(L, p, r, m)
                assert s.main_param_bytes == s.exp_avg_bytes == s.exp_avg_sq_bytes == 4 * owned, (p, r, m)
