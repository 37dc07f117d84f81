"""Multi-token prediction (``--mtp-num-layers D``): what the extra depths cost on the last stage.

Megatron builds all D MTP layers on the last pipeline stage, in its last virtual chunk, unless a
``--pipeline-model-parallel-layout`` places them (megatron/core/transformer/multi_token_prediction.py,
``get_mtp_num_layers_to_build``; core 0.16.1 and 0.19.2 alike). Each depth is a small block around
one transformer layer of the last decoder layer's kind (``MultiTokenPredictionLayer.__init__``):

* ``enorm`` and ``hnorm`` (one norm each over h), ``eh_proj`` a column-parallel ``[2h -> h]`` linear
  without bias (``bias=False``), the transformer layer, and a ``final_layernorm``;
* forward (``_concat_embeddings``): the embedding of the shifted tokens goes through ``enorm`` (which
  saves its input), the previous hidden state through ``hnorm`` (its input is alive anyway),
  ``torch.cat`` of both feeds ``eh_proj`` (which saves the ``[rows, 2h]`` input), then the layer, then
  ``final_layernorm`` (which saves its input);
* ``MultiTokenPredictionBlock.forward`` returns ``torch.cat`` of the main and the D MTP hidden states;
  ``process_mtp_loss`` runs the output layer and the vocab-parallel cross entropy once per depth, and
  every depth's fp32 softmax is kept for backward until the loss backward runs: D more copies of the
  last stage's head (logits, fp32 softmax, targets) per micro-batch in flight.

With PP > 1 the last stage also builds the word embedding (``GPTModel.__init__`` builds it when
``pre_process or mtp_process``), kept in sync with the first stage over the embedding group; with
tied embeddings it still allocates its own output-layer weight (``skip_weight_param_allocation =
pre_process and share_embeddings_and_output_weights`` is False there), so the stage holds both.
The layer kind of the transformer layer inside each depth is the decoder's; its activations come
from the layer recipes, not from this module.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..layout import Layout

# core 0.19.2 runs the MTP heads' loop in the function process_mtp_loss (transformer/multi_token_prediction.py),
# called from GPTModel._postprocess: its last mtp_logits die when it returns, before the main head runs.
# 0.16.1 runs the loop inline, so they stay referenced. The 0.17.1 and 0.18.2 wheels call process_mtp_loss
# from _postprocess as 0.19.2 does.
MTP_LOSS_FUNCTION_SINCE = (0, 17)


def _version_tuple(text: str) -> tuple[int, int]:
    parts = (str(text).split(".") + ["0"])[:2]
    return int("".join(c for c in parts[0] if c.isdigit()) or 0), int("".join(c for c in parts[1] if c.isdigit()) or 0)


@dataclass(frozen=True)
class MtpSpec:
    """The flat Megatron settings MTP's extra memory depends on (names as in ``arguments.py``)."""

    mtp_num_layers: int
    hidden_size: int
    padded_vocab_size: int
    seq_length: int
    micro_batch_size: int
    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    normalization: str = "LayerNorm"            # LayerNorm has weight and bias, RMSNorm a weight only
    untie_embeddings_and_output_weights: bool = False
    position_embedding_type: str = "learned_absolute"
    max_position_embeddings: int | None = None
    activation_bytes: int = 2                   # bf16/fp16 activations; 4 for fp32 runs
    megatron_version: str = "0.19"              # decides whether the last depth's logits outlive its loss
    mtp_use_repeated_layer: bool = False        # one MTP layer built, applied at every depth (core 0.17+)

    @property
    def layers_built(self) -> int:
        """MTP layers (enorm, hnorm, eh_proj, transformer layer, final norm) built: D, or one with
        --mtp-use-repeated-layer (MultiTokenPredictionBlock._build_layers, core 0.19.2: "build one layer,
        use it for all depths"; forward takes ``self.layers[0]`` at every depth)."""
        return min(1, self.mtp_num_layers) if self.mtp_use_repeated_layer else self.mtp_num_layers

    @property
    def rows(self) -> int:
        """Token rows per rank in a layer: s*b/CP, split over TP too with sequence parallelism."""
        rows = self.seq_length * self.micro_batch_size // self.context_parallel_size
        return rows // self.tensor_model_parallel_size if self.sequence_parallel else rows


def norm_params(spec: MtpSpec) -> int:
    """One norm over the hidden size: weight (and bias for LayerNorm)."""
    return spec.hidden_size * (1 if spec.normalization == "RMSNorm" else 2)


def depth_params(spec: MtpSpec) -> int:
    """Parameters of one MTP depth outside its transformer layer, per TP rank: enorm, hnorm,
    final_layernorm (replicated over TP) and eh_proj (column-parallel ``[h/TP, 2h]``, no bias)."""
    h, tp = spec.hidden_size, spec.tensor_model_parallel_size
    return 3 * norm_params(spec) + (h // tp) * 2 * h


def embedding_copy_params(spec: MtpSpec) -> int:
    """The word embedding the last stage builds for MTP when it is not also the first stage
    (``[V/TP, h]``, plus the learned position table when the model uses one). With PP = 1 the only
    stage holds the embedding anyway: nothing extra. Tied or untied, the last stage keeps its own
    output-layer weight as well (see the module docstring), so the copy is always extra."""
    if spec.mtp_num_layers <= 0 or spec.pipeline_model_parallel_size <= 1:
        return 0
    words = spec.padded_vocab_size // spec.tensor_model_parallel_size * spec.hidden_size
    if spec.position_embedding_type == "learned_absolute":
        words += (spec.max_position_embeddings or spec.seq_length) * spec.hidden_size
    return words


def extra_params(spec: MtpSpec) -> int:
    """All MTP parameters on the last stage besides the D transformer layers."""
    return spec.layers_built * depth_params(spec) + embedding_copy_params(spec)


@dataclass(frozen=True)
class MtpActivations:
    """Bytes the MTP block keeps per micro-batch in flight, outside its transformer layers and heads."""

    embedding_norm_inputs: int      # enorm's input per depth: the embedding of the shifted tokens [rows, h]
    eh_proj_inputs: int             # the concatenation [rows, 2h] eh_proj saves, per depth
    final_norm_inputs: int          # final_layernorm's input [rows, h], per depth
    norm_stats: int                 # enorm, hnorm, final_layernorm statistics (fp32 per row), per depth
    token_ids: int                  # the rolled ids each depth's embedding saves (int64; + positions if learned)
    hidden_concat: int              # torch.cat of the main and the D hidden states [(1+D) rows, h]
    previous_depth_outputs: int = 0  # hnorm's input at depths 2..D: the depth before's output [rows, h] each

    @property
    def total(self) -> int:
        return (self.embedding_norm_inputs + self.eh_proj_inputs + self.final_norm_inputs + self.norm_stats
                + self.token_ids + self.hidden_concat + self.previous_depth_outputs)


def block_activations(spec: MtpSpec, checkpointed: bool = False) -> MtpActivations:
    """The tensors the MTP block saves for backward besides its layers' and its heads'.

    At depth 1 ``hnorm``'s input is the decoder's final hidden state; without MTP the output layer would
    save it, with MTP the output layer saves chunk 0 of the concatenation instead, so the concatenation
    counts whole (all 1+D chunks). At depth k >= 2 it is depth k-1's output, the final_layernorm output
    that ``MultiTokenPredictionBlock.forward`` appends to ``hidden_states_list`` and passes on as the next
    depth's ``hidden_states``: a tensor of its own (``torch.cat`` copies it into the concatenation), which
    hnorm saves (or the next depth's checkpoint, under uniform recompute): ``previous_depth_outputs``,
    D - 1 rows (transformer/multi_token_prediction.py, megatron-core 0.16.1 and 0.19.2 alike).
    With sequence parallelism eh_proj (column-parallel) saves its local input and gathers it again in
    backward, so every term is over the SP-split rows.

    ``checkpointed`` (full recompute, uniform: ``checkpointed(L)``): each depth's
    ``_proj_and_transformer_layer`` (enorm, hnorm, eh_proj, the layer, final_layernorm) runs inside the
    checkpoint, which keeps its inputs only: ``hidden_states`` (the decoder's output at depth 1, the
    depth before's at depths >= 2: ``previous_depth_outputs``) and ``decoder_input`` (the embedding of the
    rolled tokens, [rows, h]: the layer's checkpointed input in ``layer_activations`` counts it). The
    embedding runs outside it (its ids stay), and so does the concatenation. With --distribute-saved-activations
    CheckpointFunction keeps only a 1-D TP shard of ``hidden_states`` (the first input; ``decoder_input`` stays
    whole): at depth 1 a viewless copy of the decoder output's chunk view, while GPTModel.forward's frame still
    holds the decoder output itself until the forward returns; the shard is a new buffer
    (``split_tensor_into_1d_equal_chunks(new_buffer=True)``), counted with the depth's checkpointed input
    (core._mtp_layers). The decoder output is counted whole: at the last stage's peak, the forward of its one
    micro-batch in flight, it is (CPU referee, megatron-core 0.16.1, TP 2: the last stage's peak unchanged by the
    flag, as the estimate: the decoder layer's input shard frees what the depth's shard takes); a stage holding more
    micro-batches with the MTP block keeps the earlier ones' shards only (errs high there by [rows, h] per earlier
    micro-batch).
    """
    d, a = spec.mtp_num_layers, spec.activation_bytes
    row_bytes = spec.rows * spec.hidden_size * a
    stats = spec.rows * 4 * (1 if spec.normalization == "RMSNorm" else 2)   # rstd (and mean) in fp32
    tokens = spec.seq_length * spec.micro_batch_size // spec.context_parallel_size
    # the vocab-parallel embedding keeps the masked ids and the out-of-range mask with TP > 1, the ids
    # themselves otherwise; a learned position table keeps its (rolled) position ids too
    ids = tokens * 8 + (tokens if spec.tensor_model_parallel_size > 1 else 0)
    if spec.position_embedding_type == "learned_absolute":
        ids += tokens * 8
    inside = 0 if checkpointed else d   # depths whose enorm/eh_proj/final-norm tensors are kept
    return MtpActivations(embedding_norm_inputs=inside * row_bytes, eh_proj_inputs=inside * 2 * row_bytes,
                          final_norm_inputs=inside * row_bytes, norm_stats=inside * 3 * stats, token_ids=d * ids,
                          hidden_concat=(1 + d) * row_bytes if d else 0,
                          previous_depth_outputs=max(d - 1, 0) * row_bytes)


def logits_in_flight(spec: MtpSpec) -> int:
    """The last depth's logits ``[s*b/CP, V/TP]`` in the activation dtype: in core 0.16.1 the loop
    variable of ``GPTModel._postprocess`` still holds them while the main head computes its logits and
    loss, so they add to the last stage's forward transient. From core 0.17 the loop runs in the function
    ``process_mtp_loss``, which has returned (and dropped them) before the main head starts: nothing."""
    if spec.mtp_num_layers <= 0 or _version_tuple(spec.megatron_version) >= MTP_LOSS_FUNCTION_SINCE:
        return 0
    tokens = spec.seq_length * spec.micro_batch_size // spec.context_parallel_size
    return tokens * (spec.padded_vocab_size // spec.tensor_model_parallel_size) * spec.activation_bytes


def loss_buffers(spec: MtpSpec, per_head_bytes: int) -> int:
    """The D extra heads' saved loss tensors: each depth runs the output layer and cross entropy
    once and keeps what the main head keeps (``per_head_bytes``: the fp32 softmax and targets of the
    last stage's own head, from the head recipe) until the backward of the loss; plus, per depth,
    the rolled labels (int64) and loss mask (fp32) that ``loss_mask * mtp_loss`` saves, and the fp32
    per-token loss ``[b, s/CP]`` that ``MTPLossAutoScaler`` keeps."""
    tokens = spec.seq_length * spec.micro_batch_size // spec.context_parallel_size
    return spec.mtp_num_layers * (per_head_bytes + tokens * (8 + 4 + 4))


def fp32_softmax_bytes(spec: MtpSpec) -> int:
    """One depth's fp32 softmax kept by vocab-parallel cross entropy: ``4 * (s*b/CP) * V/TP``
    (megatron/core/tensor_parallel/cross_entropy.py, as for the main head)."""
    tokens = spec.seq_length * spec.micro_batch_size // spec.context_parallel_size
    return 4 * tokens * (spec.padded_vocab_size // spec.tensor_model_parallel_size)


# ----- from a Layout (flat Megatron names; ``mtp_num_layers`` is 0 when the layout has none) -------

def layers_built(L: Layout) -> int:
    """MTP layers a Layout builds (their parameters): ``mtp_num_layers``, or one with --mtp-use-repeated-layer."""
    d = getattr(L, "mtp_num_layers", 0) or 0
    return min(1, d) if getattr(L, "mtp_use_repeated_layer", False) else d


def checkpointed(L: Layout) -> bool:
    """Whether full recompute checkpoints the MTP depths: under ``--recompute-method uniform`` only.
    ``MultiTokenPredictionLayer._checkpointed_forward`` (transformer/multi_token_prediction.py, megatron-core
    0.16.1, 0.17.1, 0.18.2 and 0.19.2 alike) checkpoints each depth's ``_proj_and_transformer_layer`` under
    uniform (asserting ``recompute_num_layers == 1``: resolve/mtp.py refuses other counts) and, under block,
    warns "not supported for MTP yet. Skipping recompute." and runs it plainly: every depth keeps all its
    activations, whatever ``--recompute-num-layers`` (which counts decoder layers only)."""
    return L.recompute_granularity == "full" and L.recompute_method == "uniform"


def spec_of(L: Layout) -> MtpSpec:
    """The MTP spec of a Layout (its flat Megatron names)."""
    return MtpSpec(
        mtp_num_layers=getattr(L, "mtp_num_layers", 0) or 0, hidden_size=L.hidden_size,
        padded_vocab_size=L.padded_vocab_size, seq_length=L.seq_length, micro_batch_size=L.micro_batch_size,
        tensor_model_parallel_size=L.tensor_model_parallel_size, context_parallel_size=L.context_parallel_size,
        pipeline_model_parallel_size=L.pipeline_model_parallel_size, sequence_parallel=L.sequence_parallel,
        normalization=L.normalization, untie_embeddings_and_output_weights=L.untie_embeddings_and_output_weights,
        position_embedding_type=L.position_embedding_type, max_position_embeddings=L.max_position_embeddings,
        activation_bytes=L.act_bytes, megatron_version=L.megatron_version,
        mtp_use_repeated_layer=bool(getattr(L, "mtp_use_repeated_layer", False)))


def chunk_params(spec: MtpSpec, layer_params: list[tuple[str, int]],
                 embedding_copy: bool | None = None, layer_prefix: str = "transformer_layer.") -> list[tuple[str, int, bool]]:
    """The MTP block's parameters on the chunk that builds it, in registration order
    (``GPTModel.__init__``: embedding, decoder, mtp, output layer), as (name, numel, shared_embedding);
    ``layer_params``: (name, numel) of one layer of the last decoder layer's kind. The embedding copy is
    registered first, with the embedding: it is the weight the embedding group keeps in sync. GPTModel builds
    it on every MTP chunk that is not the first (``pre_process or mtp_process``; ``embedding_copy``, None:
    with PP > 1, the last stage's case), marked shared_embedding (language_module.py
    setup_embeddings_and_output_layer: ``mtp_process and not pre_process``, core 0.16.1 and 0.19.2).
    ``layer_prefix``: put before each name of ``layer_params`` (a hybrid depth's names carry their own)."""
    out: list[tuple[str, int, bool]] = []
    if spec.mtp_num_layers <= 0:
        return out
    h, tp = spec.hidden_size, spec.tensor_model_parallel_size
    if spec.pipeline_model_parallel_size > 1 if embedding_copy is None else embedding_copy:
        out.append(("embedding.word_embeddings.weight", spec.padded_vocab_size // tp * h, True))
        if spec.position_embedding_type == "learned_absolute":
            out.append(("embedding.position_embeddings.weight", (spec.max_position_embeddings or spec.seq_length) * h, False))
    norm = ["weight"] if spec.normalization == "RMSNorm" else ["weight", "bias"]
    for d in range(spec.layers_built):
        p = f"mtp.layers.{d}."
        out += [(p + f"enorm.{x}", h, False) for x in norm] + [(p + f"hnorm.{x}", h, False) for x in norm]
        out.append((p + "eh_proj.weight", h // tp * 2 * h, False))
        out += [(p + layer_prefix + name, n, False) for name, n in layer_params]
        out += [(p + f"final_layernorm.{x}", h, False) for x in norm]
    return out


def _head_loss_bytes(L: Layout) -> int:
    """What the output head keeps for its loss per micro-batch (head.py output_items: the fp32 softmax and the
    targets); every MTP depth's loss keeps as much (loss_buffers)."""
    from .head import output_items
    head = output_items(L).saved
    return sum(head.get(k, 0) for k in ("loss_softmax_fp32", "loss_targets"))


def _eh_proj_fp8_change(L: Layout, spec: MtpSpec, acts: MtpActivations) -> int:
    """FP8: eh_proj keeps its quantized input instead of the BF16 concatenation (estimator/fp8.py saved_input): the
    change to the D depths' saved bytes; 0 where eh_proj runs in BF16."""
    from .fp8 import saved_input
    from .fp8_layers import mtp_gemms
    eh = next((g for g in mtp_gemms(L) if g.name == "eh_proj"), None)
    if eh is None or checkpointed(L):   # under uniform recompute eh_proj's input is not kept (block_activations)
        return 0
    quantized = saved_input(L.fp8_spec, eh.tokens, eh.cols, sp_gathered=eh.sp_gathered).allocated
    return spec.mtp_num_layers * quantized - acts.eh_proj_inputs


def last_stage_items(L: Layout) -> tuple[dict[str, int], int]:
    """(saved terms per micro-batch in flight, extra forward transient at the loss) that MTP adds to the
    last stage's last chunk, besides its D layers' activations (the layer recipe's, counted as layers)."""
    if (getattr(L, "mtp_num_layers", 0) or 0) <= 0:   # spec_of's rule, without building the spec
        return {}, 0
    spec = spec_of(L)
    per_head = _head_loss_bytes(L)
    acts = block_activations(spec, checkpointed(L))
    block = acts.total + _eh_proj_fp8_change(L, spec, acts)
    from .fp8 import saved_input
    from .fp8_layers import output_proj_gemm
    head_gemm = output_proj_gemm(L)
    if head_gemm is not None and acts.hidden_concat:
        # --fp8-output-proj: each of the 1 + D head calls keeps a quantized copy of its chunk, not a view of
        # the BF16 concatenation (which nothing else keeps)
        block += (1 + spec.mtp_num_layers) * saved_input(L.fp8_spec, head_gemm.tokens, head_gemm.cols,
                                                         sp_gathered=head_gemm.sp_gathered).allocated - acts.hidden_concat
    saved = {"mtp_block_activations": block, "mtp_loss_buffers": loss_buffers(spec, per_head)}
    return saved, logits_in_flight(spec)


# ----- Megatron's mtp_standalone: the MTP block on a stage before the loss's (a layout's 'm' there) -----------
# megatron-core 0.16.1 to 0.19.2 alike (TransformerConfig.mtp_standalone from
# PipelineParallelLayerLayout.validate_layer_layout): the MTP chunk (mtp_process, not post_process) runs its
# decoder layers and the MTP block, and GPTModel._postprocess returns the block's torch.cat of the main and the D
# hidden states, [(1 + D) s/CP (/TP with SP), b, h], as the stage's output; the chunks after it (no decoder layer:
# decoder layers must come first) pass it on and the loss's chunk runs process_mtp_loss (0.17+; the same loop
# inline in 0.16.1) on it: 1 + D heads on torch.chunk views of the received tensor. P2P exchanges shapes first
# (p2p_communication.py: config.mtp_standalone), so the received tensors and their gradients are (1 + D)-fold.


def concat_bytes(L: Layout) -> int:
    """The (1 + D)-fold concatenated hidden states a standalone MTP chunk sends on: [(1 + D) rows, h]."""
    spec = spec_of(L)
    return (1 + spec.mtp_num_layers) * spec.rows * spec.hidden_size * spec.activation_bytes


def standalone_block_items(L: Layout) -> tuple[dict[str, int], int]:
    """(saved terms per micro-batch in flight, forward transient) of the MTP block on a chunk before the loss's.
    What block_activations counts, except the concatenation: it is the stage's output, sent on and then
    pseudo-deallocated (schedules.py deallocate_output_tensor; megatron/training sets deallocate_pipeline_outputs)
    and only alive while torch.cat makes it (the forward transient). Plus hnorm's input, the decoder's last hidden
    state [rows, h], which on the last stage the output layer's input item stands for."""
    spec = spec_of(L)
    acts = block_activations(spec, checkpointed(L))
    row = spec.rows * spec.hidden_size * spec.activation_bytes
    block = acts.total - acts.hidden_concat + row + _eh_proj_fp8_change(L, spec, acts)
    return {"mtp_block_activations": block}, acts.hidden_concat


def standalone_loss_items(L: Layout) -> tuple[dict[str, int], int]:
    """(saved terms per micro-batch in flight, extra forward transient) on the loss's chunk when the MTP block is
    on an earlier stage: the received concatenation, which the schedule keeps as the stage's input, and its copy:
    the loss's chunk has no decoder layer and no final norm, so its empty TransformerBlock returns
    ``hidden_states.clone()`` (transformer_block.py, megatron-core 0.16.1 and 0.19.2), whose views the 1 + D heads
    keep (with --fp8-output-proj each head keeps a quantized copy as well); the D extra heads' loss buffers, and
    the last depth's logits in 0.16.1 (logits_in_flight)."""
    spec = spec_of(L)
    per_head = _head_loss_bytes(L)
    received = 2 * concat_bytes(L)
    from .fp8_layers import output_proj_gemm
    from .fp8 import saved_input
    head_gemm = output_proj_gemm(L)
    if head_gemm is not None:
        received += (1 + spec.mtp_num_layers) * saved_input(L.fp8_spec, head_gemm.tokens, head_gemm.cols,
                                                            sp_gathered=head_gemm.sp_gathered).allocated
    return {"mtp_received_hidden": received, "mtp_loss_buffers": loss_buffers(spec, per_head)}, logits_in_flight(spec)
