"""A chunk of layers of different kinds (hybrid Mamba patterns, --moe-layer-freq, heterogeneous layers): its working
sets composed layer by layer (estimator/core.py _mixed_transients, _mixed_replays). Autograd frees a node's saved
tensors once its backward has run (torch.autograd, retain_graph=False), so a layer's backward working set comes
after the layers above it have freed theirs; megatron-core 0.19.2 models/hybrid/hybrid_layer_specs.py builds a '*'
layer and a '-' layer as the two halves of one GPT TransformerLayer, so the pair must estimate as that layer."""
from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.estimator.core import _chunk_activations
from megatron_memguard.partition import LayerKind

COMMON = ("--hidden-size 192 --num-attention-heads 1 --kv-channels 16 --ffn-hidden-size 96 --seq-length 256 "
          "--max-position-embeddings 256 --micro-batch-size 3 --global-batch-size 24 --tensor-model-parallel-size 1 "
          "--pipeline-model-parallel-size 3 --tokenizer-type NullTokenizer --vocab-size 1000 "
          "--make-vocab-size-divisible-by 128 --position-embedding-type none --hidden-dropout 0 --attention-dropout 0 "
          "--fp16 --untie-embeddings-and-output-weights --disable-bias-linear").split()
MAMBA = "--mamba-state-dim 64 --mamba-head-dim 32 --mamba-num-groups 2".split()


def _pair(pattern="*-*-|*-*-|*-*-", extra=()):
    H = layout_from_flags(COMMON + MAMBA + ["--hybrid-layer-pattern=" + pattern, *extra], world_size=6)
    G = layout_from_flags(COMMON + ["--num-layers", "6", *extra], world_size=6)
    return H, G


def test_attention_mlp_pairs_estimate_as_gpt_layers():
    # the case the property suite found: the middle stage's backward peak was 193,536 B (0.6%) above the GPT
    # model's, the attention layer's backward working set counted on top of the MLP layer above it
    H, G = _pair()
    for sh, sg in zip(estimate(H).stages, estimate(G).stages):
        assert sh.peak_allocated_bytes == sg.peak_allocated_bytes and sh.breakdown == sg.breakdown
    # full uniform recompute of 2 hybrid layers = 1 GPT layer (recompute.py checkpointed_forward, 0.19.2)
    H2 = layout_from_flags(COMMON + MAMBA + ["--hybrid-layer-pattern=*-*-|*-*-|*-*-", "--recompute-granularity", "full",
                                             "--recompute-method", "uniform", "--recompute-num-layers", "2"],
                           world_size=6)
    G1 = layout_from_flags(COMMON + ["--num-layers", "6", "--recompute-granularity", "full", "--recompute-method",
                                     "uniform", "--recompute-num-layers", "1"], world_size=6)
    for sh, sg in zip(estimate(H2).stages, estimate(G1).stages):
        assert sh.peak_allocated_bytes == sg.peak_allocated_bytes and sh.breakdown == sg.breakdown


def test_a_layers_backward_working_set_comes_after_the_layers_above_freed_theirs():
    H, _ = _pair()
    attn = layer_activations(H, False, LayerKind("attention", "none"))
    mlp = layer_activations(H, False, LayerKind("none", "dense"))
    # two pairs on a middle stage, bottom to top: * - * -
    runs = ((LayerKind("attention", "none"), 1), (LayerKind("none", "dense"), 1)) * 2
    a = _chunk_activations(H, runs, False, False)
    assert a.layers == 2 * (attn.total + mlp.total)
    # the top MLP layer's working set over everything; the attention layer under it after the MLP layer freed its
    # tensors; the lower pair after the upper pair freed theirs
    want = max(mlp.bwd_transient, attn.bwd_transient - mlp.total, mlp.bwd_transient - attn.total - mlp.total,
               attn.bwd_transient - 2 * mlp.total - attn.total)
    assert a.bwd_top_extra == want
    # here the attention's working set exceeds the MLP layer's saved bytes plus its working set: the old upper bound
    # (the largest layer's working set over every layer) was above it
    assert attn.bwd_transient > mlp.bwd_transient and a.bwd_top_extra < attn.bwd_transient
