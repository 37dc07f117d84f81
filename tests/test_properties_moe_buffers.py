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

from hypothesis import given, settings, strategies as st

from megatron_memguard.estimator.states import stage_states
from megatron_memguard.layout import ShardGroup

from test_properties_moe_identities import EXAMPLES, PROPERTY, Job, _layout, core, corner_jobs  # noqa: F401 (the fixture)


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


def test_an_untied_embedding_with_mtp_has_its_own_bucket_on_the_first_stage():
    """megatron-core marks the first stage's word embedding shared_embedding with PP > 1 when the output layer is
    tied to it or MTP keeps a copy (LanguageModule.setup_embeddings_and_output_layer, 0.16.1 and 0.19.2), and the
    distributed optimizer gives it a bucket of its own (param_and_grad_buffer.py _does_param_require_new_bucket).
    The job the DDP property found (TP 1, PP 2, DP 2, untied, MTP 1; stage 0 = embedding [1024, 64] and two MoE
    layers with biases, 2 experts of width 8). By hand, per layer 11,008 buffer elements of which 206 padding (each
    start aligned to 64: qkv bias 96 -> 32, router bias 2 -> 62, two fc1 biases 8 -> 56 each): the layers' bucket
    is [0, 22,016) (a multiple of lcm(2, 128)), the embedding's [22,016, 87,552). DP rank 0 owns [0, 11,008) of the
    first (layer 1: 10,802 real elements) and [22,016, 54,784) of the second (32,768): 43,570 fp32 = 174,280 B,
    megatron-core's own count. Without MTP the embedding is not shared: one bucket [0, 87,552), rank 0's half
    [0, 43,776) holds both layers (21,604 real) and 21,760 embedding rows' elements: 43,364."""
    flags = ("--transformer-impl transformer_engine --num-layers 4 --hidden-size 64 --num-attention-heads 2 "
             "--kv-channels 16 --ffn-hidden-size 32 --seq-length 16 --max-position-embeddings 16 --micro-batch-size 1 "
             "--global-batch-size 2 --pipeline-model-parallel-size 2 --tokenizer-type NullTokenizer --vocab-size 1000 "
             "--bf16 --position-embedding-type rope --normalization RMSNorm --num-experts 2 --moe-router-topk 1 "
             "--moe-ffn-hidden-size 8 --moe-token-dispatcher-type alltoall --moe-router-pre-softmax "
             "--untie-embeddings-and-output-weights --use-distributed-optimizer").split()
    from megatron_memguard import layout_from_flags
    for era in ("0.16", "0.19"):
        with_mtp = layout_from_flags(flags + ["--mtp-num-layers", "1"], world_size=4, megatron_version=era)
        without = layout_from_flags(flags, world_size=4, megatron_version=era)
        for r in (0, 1):
            assert stage_states(with_mtp, 0, r).main_param_bytes == 4 * 43_570
        assert stage_states(without, 0, 0).main_param_bytes == 4 * 43_364
        assert stage_states(with_mtp, 0).buffer_numel == stage_states(without, 0).buffer_numel == 87_552


@st.composite
def odd_dp_jobs(draw) -> Job:
    """A corner job with its data-parallel size times 3, 5 or 6 (the global batch with it): data-parallel and
    expert-data-parallel groups that are not powers of two, where a bucket's end is padded to lcm(DP, 128) and
    not to 128 (param_and_grad_buffer.py _pad_end_of_bucket_if_needed, 0.16.1 / 0.19.2)."""
    job = draw(corner_jobs())
    k = draw(st.sampled_from([3, 5, 6]))
    flags = list(job.flags)
    i = flags.index("--global-batch-size") + 1
    flags[i] = str(k * int(flags[i]))
    return Job(flags=tuple(flags), world=k * job.world, core=job.core)


@settings(PROPERTY, max_examples=max(1, EXAMPLES // 20))      # (half the property above's: the same build)
@given(odd_dp_jobs(), st.booleans())
def test_optimizer_shards_over_groups_not_powers_of_two_are_megatron_cores(core, job, overlap):  # noqa: F811
    """The property above over DP x CP and expert-DP groups of 3, 5, 6, 10, 12, ... ranks: each bucket padded to
    lcm(group, 128) elements, each rank's slice a 1 / group of it, as megatron-core's own buffers."""
    test_every_dp_and_expert_dp_ranks_optimizer_shard_is_megatron_cores.hypothesis.inner_test(core, job, overlap)
