"""The ends of the model: batch tensors, the embedding, the final norm, the output layer and the loss.

The last stage often peaks here: the output layer writes logits ``[s, b, V/t]`` in the param dtype,
vocab-parallel cross entropy works on an fp32 copy that it keeps for backward as the softmax, and in
backward the fp32 gradient and its cast back to the param dtype coexist
(megatron/core/tensor_parallel/cross_entropy.py; the fused native path keeps the same fp32 working
copy, fusions/fused_cross_entropy.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..layout import Layout
from .activations import _norm_stats, attention_kind, shapes


@dataclass(frozen=True)
class EndItems:
    saved: dict[str, int] = field(default_factory=dict)   # kept per micro-batch in flight
    fwd_transient: int = 0                              # extra at the worst point of the forward
    bwd_transient: int = 0                              # extra at the worst point of the backward
    # the output layer's extra when its weight gradient is accumulated (the logits' gradient freed):
    # where Megatron-FSDP allocates the first full gradient bucket (estimator/fsdp_layout.py)
    bwd_wgrad_moment: int = 0

    def __init__(self, saved: dict[str, int] | None = None, fwd_transient: int = 0, bwd_transient: int = 0,
                 bwd_wgrad_moment: int = 0) -> None:
        # made for the end chunks of every cold estimate: the fields are stored directly (as Term's)
        d = self.__dict__
        d["saved"] = {} if saved is None else saved
        d["fwd_transient"] = fwd_transient
        d["bwd_transient"] = bwd_transient
        d["bwd_wgrad_moment"] = bwd_wgrad_moment

    @property
    def total(self) -> int:
        return sum(self.saved.values())


def batch_items(L: Layout, first: bool, last: bool) -> EndItems:
    """Batch tensors a micro-batch keeps alive on this stage while it is in flight.

    pretrain_gpt.get_batch hands out tokens/position ids (first stage), labels/loss mask (last stage)
    and, with --create-attention-mask-in-dataloader (Megatron's default), a bool [b, 1, s, s] mask on
    every stage. The unfused torch softmax of the local spec keeps the mask for backward; fused
    kernels (flash/cuDNN, the causal scale-mask-softmax kernel) ignore it for causal masking, so it
    lives only during the forward of its micro-batch.
    """
    x = shapes(L)
    saved: dict[str, int] = {}
    fwd = 0
    tokens = x.b * x.s * 8
    if first:
        if L.tp > 1:
            saved["embedding_indices"] = tokens + x.b * x.s   # masked input ids + out-of-range mask
            fwd += tokens                                     # the original token ids during forward
        else:
            saved["embedding_indices"] = tokens               # the token ids themselves
        if L.position_embedding_type == "learned_absolute":
            saved["position_ids"] = tokens
    if last:
        fwd += x.b * x.s * (8 + 4)                            # labels (int64) and loss mask (fp32)
    if L.create_attention_mask_in_dataloader:
        mask = x.b * x.s * x.s
        if attention_kind(L) == "local_unfused":
            saved["attention_mask"] = mask
        else:
            fwd += mask
    return EndItems(saved=saved, fwd_transient=fwd)


def embedding_items(L: Layout) -> EndItems:
    """Embedding output transients: the full [s, b, h] before the TP reduce / SP reduce-scatter."""
    x = shapes(L)
    saved: dict[str, int] = {}
    if L.hidden_dropout > 0:
        saved["embedding_dropout_mask"] = x.T * x.h
    fwd = 2 * x.Tf * x.h * x.e
    return EndItems(saved=saved, fwd_transient=fwd)


def output_items(L: Layout) -> EndItems:
    """Final norm, output layer and vocab-parallel cross entropy on the last stage.

    Backward runs in three steps: the cross-entropy backward turns the kept fp32 softmax into the
    gradient in place, and autograd casts it to the logits' dtype (both alive); the output layer's
    backward then holds that gradient, its input gradient and, without fused weight-gradient
    accumulation, the dense [V/t, h] weight gradient; the fp32 buffer is gone by then.
    """
    x = shapes(L)
    v_t = L.padded_vocab_size // L.tp
    saved = {
        "final_norm_input": x.T * x.h * x.r,
        "final_norm_stats": _norm_stats(L, x.T),
        "output_layer_input": x.T * x.h * x.e,
    }
    if L.fp8_spec.fp8_output_proj and not L.mtp_num_layers:
        # --fp8-output-proj: TE's linear keeps its MXFP8-quantized input (column-wise, the local shard with
        # SP) instead of the BF16 one ColumnParallelLinear keeps (estimator/fp8.py saved_input). With MTP the
        # BF16 final hidden state stays (hnorm keeps it) and the heads' quantized inputs are the MTP block's
        from .fp8 import saved_input
        from .fp8_layers import output_proj_gemm
        g = output_proj_gemm(L)
        if g is not None:
            saved["output_layer_input"] = saved_input(L.fp8_spec, g.tokens, g.cols, sp_gathered=g.sp_gathered).allocated
    frozen_output = getattr(L, "peft", None) is not None
    if frozen_output:
        # PEFT freezes the output layer: megatron-core's LinearWithFrozenWeight keeps only its weight
        # (tensor_parallel/layers.py, core 0.16.1 and 0.19.2), no input for a weight gradient
        del saved["output_layer_input"]
    logits = x.Tf * v_t * x.e
    # --fp16-lm-cross-entropy changes nothing here: megatron-core's GPTModel stores the flag and never reads it,
    # and _VocabParallelCrossEntropy.calculate_logits_max upcasts the logits to fp32 on every path
    # (tensor_parallel/cross_entropy.py, core 0.16.1 and 0.19.2)
    if x.e == 4:
        # fp32 logits: .float() is a no-op and the softmax is made in place
        saved["loss_softmax_fp32"] = logits
        kept = logits
        fwd = 0
        cast = 0
    else:
        kept = x.Tf * v_t * 4
        saved["loss_softmax_fp32"] = kept                # exp(logits - max) / sum, kept for backward
        fwd = logits                                      # logits in the param dtype next to the fp32 copy
        cast = logits                                     # the fp32 gradient cast back, next to it
    if L.cross_entropy_loss_fusion and L.cross_entropy_fusion_impl == "native" and x.e == 2:
        # megatron's fused cross entropy runs as torch.compile'd functions (megatron/core/jit.py
        # jit_fuser): the in-place max-subtract/exp of the eager path produce a second fp32 buffer,
        # in forward (exp_logits next to the fp32 logits) and in backward (the gradient next to
        # the kept softmax); the cast to bf16 happens inside the fused backward.
        fwd += kept
        cast = kept + logits
    saved["loss_targets"] = x.Tf * (8 + 1)               # masked target ids (int64) and target mask
    # the output layer's weight gradient: fused into main_grad, deferred to the pipeline flush
    # (--defer-embedding-wgrad-compute), or materialised here
    wgrad = 0 if (L.fused_wgrad or L.defer_embedding_wgrad_compute or frozen_output) else v_t * x.h * x.e
    tanh, cap_step = _final_softcap(L, logits, kept)
    if tanh:
        saved["final_logit_softcap"] = tanh
        fwd = max(fwd, cap_step)
    bwd = max(cast, cap_step, -kept - tanh + logits + x.Tf * x.h * x.e + wgrad)
    return EndItems(saved=saved, fwd_transient=fwd, bwd_transient=bwd,
                    bwd_wgrad_moment=-kept - tanh + x.Tf * x.h * x.e + wgrad)


def _final_softcap(L: Layout, logits: int, kept: int) -> tuple[int, int]:
    """Gemma2OutputLayer's final logit softcapping (Megatron-Bridge 0.6.2 gemma2_provider.py ``logit_softcapping``:
    ``cap * torch.tanh(logits / cap)`` on the output layer's [s, b, V/TP] logits, in their dtype). Autograd keeps
    the tanh's output (tanh's backward reads its result; dividing and multiplying by a Python number keep nothing),
    so (bytes saved, the working set over everything the head saves at its worst softcap step): forward, the
    output layer's logits (the caller still holds them), the tanh and the capped logits being written, before the
    loss's fp32 copy exists; backward, once the loss's fp32 gradient is cast and freed, a logits-sized gradient in
    and one out at each of the three steps."""
    if not getattr(L, "final_logit_softcapping", 0.0):
        return 0, 0
    return logits, 2 * logits - kept


def tied_wgrad_wait(L: Layout, has_embedding: bool, has_output: bool) -> tuple[int, int]:
    """The output layer's weight gradient waiting for the embedding's, with tied weights on one chunk (PP 1).

    The output layer's forward takes the word embedding's weight (LanguageModule.shared_embedding_or_output_weight,
    megatron-core 0.16.1 and 0.19.2), so one AccumulateGrad node has two inputs, and autograd keeps the first
    gradient in that node's input buffer until the embedding's backward hands it the second (torch's InputBuffer).
    Without gradient-accumulation fusion that is the output layer's dense [V/TP, h] weight gradient
    (tensor_parallel/layers.py ``grad_output.t().matmul(total_input)``), held through every layer's backward; the
    embedding's dense gradient is then added into it in place. With the fusion it is TE's cached placeholder
    (``get_dummy_wgrad``, counted by dummy_wgrads), which autograd cannot add into (the cache shares its storage):
    the sum is a new [V/TP, h] tensor next to the embedding's gradient. Returns (bytes held during the layers'
    backward, bytes more at the embedding's backward)."""
    frozen = getattr(L, "peft", None) is not None or L.freeze_all_layers
    if not (has_embedding and has_output) or L.untie_embeddings_and_output_weights or frozen:
        return 0, 0
    wgrad = L.padded_vocab_size // L.tp * L.hidden_size * L.act_bytes
    return (0 if L.fused_wgrad else wgrad), wgrad


def deferred_wgrad_buffers(L: Layout) -> int:
    """--defer-embedding-wgrad-compute: the last stage keeps the output layer's input and its
    gradient of the first ``--wgrad-deferral-limit`` micro-batches (all of them for 0) until the
    pipeline flush computes the weight gradient (megatron/core/tensor_parallel/layers.py,
    pipeline_parallel/schedules.py finish_embedding_wgrad_compute)."""
    if not L.defer_embedding_wgrad_compute:
        return 0
    x = shapes(L)
    n = L.num_microbatches if L.wgrad_deferral_limit == 0 else min(L.wgrad_deferral_limit, L.num_microbatches)
    return n * (x.T * x.h * x.e + x.Tf * (L.padded_vocab_size // L.tp) * x.e)
