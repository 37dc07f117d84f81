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
    return spec.mtp_num_layers * depth_params(spec) + embedding_copy_params(spec)


@dataclass(frozen=True)
class MtpDepthActivations:
    """Bytes one MTP depth keeps per micro-batch in flight, outside its transformer layer."""

    embedding_norm_input: int       # enorm's input: the embedding of the shifted tokens [rows, h]
    eh_proj_input: int              # the concatenation [rows, 2h] saved by eh_proj
    final_norm_input: int           # final_layernorm's input [rows, h]
    output_layer_input: int         # this depth's chunk of the concatenated hidden states [rows, h]

    @property
    def total(self) -> int:
        return self.embedding_norm_input + self.eh_proj_input + self.final_norm_input + self.output_layer_input


def depth_activations(spec: MtpSpec) -> MtpDepthActivations:
    """The tensors one depth saves for backward besides its layer's and its loss's.

    With sequence parallelism eh_proj (column-parallel) saves its local input and gathers it again
    in backward, so every term is over the SP-split rows.
    """
    row_bytes = spec.rows * spec.hidden_size * spec.activation_bytes
    return MtpDepthActivations(embedding_norm_input=row_bytes, eh_proj_input=2 * row_bytes,
                               final_norm_input=row_bytes, output_layer_input=row_bytes)


def loss_buffers(spec: MtpSpec, per_head_bytes: int) -> int:
    """The D extra heads' saved loss tensors: each depth runs the output layer and cross entropy
    once and keeps what the main head keeps (``per_head_bytes``: the fp32 softmax and targets of the
    last stage's own head, from the head recipe) until the backward of the loss; plus the fp32
    per-token loss ``[b, s/CP]`` that ``MTPLossAutoScaler`` saves for each depth."""
    tokens = spec.seq_length * spec.micro_batch_size // spec.context_parallel_size
    return spec.mtp_num_layers * (per_head_bytes + 4 * tokens)


def fp32_softmax_bytes(spec: MtpSpec) -> int:
    """One depth's fp32 softmax kept by vocab-parallel cross entropy: ``4 * (s*b/CP) * V/TP``
    (megatron/core/tensor_parallel/cross_entropy.py, as for the main head)."""
    tokens = spec.seq_length * spec.micro_batch_size // spec.context_parallel_size
    return 4 * tokens * (spec.padded_vocab_size // spec.tensor_model_parallel_size)
