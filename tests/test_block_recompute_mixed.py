"""Full ``block`` recompute of a chunk of layers of different kinds (a dense layer under MoE layers:
--moe-layer-freq): the checkpointed layers replay after the layers above them have been back-propagated.

transformer_block.py ``_checkpointed_forward`` (megatron-core 0.16.1 and 0.19.2), method 'block': ``for l in
range(num_layers): if l < recompute_num_layers: checkpoint(custom(l, l + 1)) else: custom(l, l + 1)``: each of
the first k layers is checkpointed on its own and keeps its input; the layers above keep their saved tensors.
Backward runs the top layers first (autograd frees a node's saved tensors once its backward ran), then each
checkpointed layer replays its forward before its backward. So the replay of layer 0 is not added to the saved
tensors of the MoE layers above it (the upper bound memguard took before)."""
from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.estimator.core import chunk_activations

# PP 2, 6 layers, layer 0 dense and 1..5 MoE: stage 0 holds the dense layer under two MoE layers; a 32000 x 32
# embedding, mbs 3, seq 128, bf16, one micro-batch (the job hypothesis found: test_properties_layout_corners
# test_checkpointing_one_more_layer_never_raises_what_layers_keep)
JOB = ("--transformer-impl transformer_engine --num-layers 6 --hidden-size 32 --num-attention-heads 2 --kv-channels 16 "
       "--ffn-hidden-size 8 --seq-length 128 --max-position-embeddings 128 --micro-batch-size 3 --global-batch-size 3 "
       "--pipeline-model-parallel-size 2 --tokenizer-type NullTokenizer --vocab-size 32000 --hidden-dropout 0.0 "
       "--attention-dropout 0.0 --attention-backend auto --bf16 --position-embedding-type rope --disable-bias-linear "
       "--num-experts 8 --moe-router-topk 4 --moe-ffn-hidden-size 16 --moe-token-dispatcher-type allgather "
       "--moe-shared-expert-intermediate-size 48 --moe-layer-freq ([0]*1+[1]*5)").split()
BLOCK = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers"]


def _lay(*extra, era="0.19"):
    return layout_from_flags(JOB + list(extra), world_size=2, megatron_version=era)


def test_checkpointed_dense_layer_replays_after_the_moe_layers_above_it_freed():
    for era in ("0.16", "0.19"):
        L = _lay(*BLOCK, "1", era=era)
        c = L.stage_chunks(0)[0]
        (dense, one), (moe, two) = c.kind_runs
        assert (one, two) == (1, 2) and dense != moe
        d, m = layer_activations(L, True, dense), layer_activations(L, True, moe)
        ckpt = 128 * 3 * 32 * 2                      # the checkpointed input [s, b, h] in bf16
        a = chunk_activations(L, c)
        assert a.layers == ckpt + 2 * m.total
        # the top MoE layer's backward over everything kept, or layer 0's replay and backward once the two MoE
        # layers have freed their tensors
        assert a.bwd_top_extra == max(m.bwd_transient, d.total + d.bwd_transient - 2 * m.total)
        assert a.bwd_top_extra < d.total + max(d.bwd_transient, m.bwd_transient)   # the old upper bound


def test_checkpointing_the_bottom_layer_keeps_the_embedding_gradient_peak():
    # stage 0's peak is the end of its backward: the embedding's weight gradient [V, h] in bf16 with nothing held
    # (32000 x 32 x 2 B), with or without the dense layer checkpointed
    for extra in ((), (*BLOCK, "1")):
        s = estimate(_lay(*extra)).stages[0]
        assert s.peak_phase.startswith("end of backward")
        assert {t.name: t.bytes for t in s.terms}["backward_transient"] == 32000 * 32 * 2
        assert not [t for t in s.terms if str(t.group) == "activations"]


# A dense FP8 (tensorwise) job, TP 16, PP 2 with three layers on stage 0 (--decoder-last-pipeline-num-layers 1),
# vocabulary 50257 padded to 51200 (a multiple of 128 x TP): the case the property drew, with 16 key groups (one a TP
# rank) for its 1: with fewer groups than TP ranks each layer keeps the whole all-gathered qkv projection (props8,
# layers/attention.py qkv_kept_per_rank), which moves stage 0's peak into a backward away from what this test checks
DENSE = ("--transformer-impl transformer_engine --num-layers 4 --hidden-size 1792 --num-attention-heads 128 "
         "--kv-channels 64 --ffn-hidden-size 256 --seq-length 16 --max-position-embeddings 16 --micro-batch-size 14 "
         "--global-batch-size 14 --tensor-model-parallel-size 16 --pipeline-model-parallel-size 2 "
         "--tokenizer-type NullTokenizer --vocab-size 50257 --hidden-dropout 0.0 --attention-dropout 0.0 --bf16 "
         "--decoder-last-pipeline-num-layers 1 --group-query-attention --num-query-groups 16 "
         "--position-embedding-type rope --disable-bias-linear --fp8-format hybrid --fp8-recipe tensorwise").split()


def test_one_kind_chunk_replays_after_the_layers_above_it_freed():
    for era in ("0.16", "0.19"):
        for k in (1, 2, 3):
            L = layout_from_flags(DENSE + BLOCK + [str(k)], world_size=32, megatron_version=era)
            c = L.stage_chunks(0)[0]
            ((kind, n),) = c.kind_runs
            la = layer_activations(L, True, kind)
            a = chunk_activations(L, c)
            ckpt = 16 * 14 * 1792 * 2                  # the checkpointed input [s, b, h] in bf16
            assert n == 3 and a.layers == k * ckpt + (n - k) * la.total
            # the top layers' backward over all kept, or the replay of layer k - 1 (its saved tensors and working
            # set) once the n - k layers above it freed theirs, over the k checkpointed inputs
            assert a.bwd_top_extra == max(la.bwd_transient, la.total + la.bwd_transient - (n - k) * la.total)
            # stage 0's peak stays the embedding's weight gradient [51200 / 16, 1792] in bf16, nothing held
            s = estimate(L).stages[0]
            assert s.peak_phase.startswith("end of backward")
            assert {t.name: t.bytes for t in s.terms}["backward_transient"] == 51200 // 16 * 1792 * 2 == 11_468_800
