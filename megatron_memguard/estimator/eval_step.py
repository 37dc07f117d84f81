"""The evaluation step (``--eval-micro-batch-size``): its forward-only peak per stage, a second figure beside the
training peak that the verdict weighs too.

megatron/training ``evaluate()`` (training.py, megatron-core 0.19.2; 0.18 added ``--eval-micro-batch-size``, 0.17.1
and 0.16.1 evaluate with the training micro-batch) puts the model in eval mode (no dropout), then, inside
``torch.no_grad()``, calls the training schedule with ``forward_only=True`` and ``micro_batch_size=
eval_micro_batch_size`` for ``eval_global_batch_size / (eval_micro_batch_size x DP)`` micro-batches. In that mode the
schedules (pipeline_parallel/schedules.py) keep no input or output tensor for a backward and autograd records no
graph: one micro-batch's forward runs at a time on a chunk and what it made is freed as it goes. The static memory
of training stays allocated: weights, the gradient buffer, the optimizer's states, the persistent buffers (the
GlobalMemoryBuffer grows to the larger micro-batch's request and stays), the workspaces and the pipeline inputs
retained after the last training step.

Per chunk the figure counts, at the eval micro-batch, the batch tensors of the micro-batch, the input received from
the previous stage (the schedule's ``input_tensor``, referenced until the chunk's forward returns), the previous
micro-batch's output on a stage that sends one without interleaving (``forward_backward_pipelining_without_
interleaving`` keeps it in ``output_tensor`` until the next ``forward_step`` returns: only the training path calls
``deallocate_output_tensor``; with one eval micro-batch there is none), under interleaving the stage's other receiving chunks' last inputs (each chunk's
``TransformerBlock.input_tensor`` keeps its last received activation: the eval micro-batch's once the chunk has run,
the training's input and gradient before), and the largest of
the forward moments: one layer's tensors with its working set (what training would save plus its forward working
set: an upper bound, as for --freeze-all-layers' first chunk, core._chunk_activations), the embedding's output, or
the output layer's logits with the loss's fp32 copy and targets (head.output_items: what the training step keeps
for backward, plus its forward transient). Virtual chunks run one after another: the stage's figure is its largest
chunk's. On a GPU the pipeline buffer NCCL still holds (``p2p_buffers_in_flight``) is the eval micro-batch's: the
forward-only schedule receives and sends tensors of the shape ``evaluate()`` passes it (``micro_batch_size=
eval_micro_batch_size``, get_tensor_shapes, schedules.py 0.16.1 and 0.19.2). An evaluation micro-batch no larger than
the training one gets no figure (resolve/batch.py): the training step's forward of such a micro-batch holds all of
this and its saved activations besides.
"""
from __future__ import annotations

from typing import Any

from ..layout import Chunk, Layout
from .activations import layer_activations
from .head import batch_items, embedding_items, output_items
from .overheads import p2p_in_flight_bytes, p2p_tensor_bytes
from .result import Term, phase_figure, slack_term

PHASE = "evaluation step (forward only, torch.no_grad)"


def unmodelled(L: Layout) -> str | None:
    """What keeps the evaluation step from being estimated on ``L`` (the note says so), or None."""
    if L.use_megatron_fsdp or L.use_torch_fsdp2:
        return "FSDP's parameter all-gathers in the forward-only step"
    if L.cuda_graph_impl != "none":
        return "CUDA graphs captured for the evaluation step"
    if L.cpu_offloading_num_layers or L.fine_grained_activation_offloading:
        return "activation offloading in the forward-only step"
    if getattr(L, "mtp_num_layers", 0):
        return "the MTP block's forward-only step"
    if L.freeze_all_layers:
        return "--freeze-all-layers' forward-only step"
    return None


def eval_layout(L: Layout) -> Layout:
    """The layout evaluate() runs: the eval micro-batch, eval mode (no dropout, hence no dropout masks), and no
    recomputation (under torch.no_grad nothing is saved: recompute drops nothing a working set does not hold)."""
    return L.replace(micro_batch_size=L.eval_micro_batch_size, hidden_dropout=0.0, attention_dropout=0.0,
                     recompute_granularity=None)


def _receives(c: Chunk) -> bool:
    """The chunk gets its input from a previous stage (all but the first stage's first chunk)."""
    return not (c.pp_rank == 0 and c.vpp_rank == 0)


def chunk_parts(E: Layout, c: Chunk, others_inputs: int = 0) -> dict[str, int]:
    """The activation parts of one chunk's forward-only step at the eval layout ``E``, named as the report shows
    them (the moment: the largest of one layer, the embedding and the loss); ``others_inputs``: the last inputs the
    stage's other chunks keep meanwhile (interleaving)."""
    parts: dict[str, int] = {}
    has_batch = c.has_embedding or c.has_output
    if has_batch:
        # tokens / positions / labels / loss mask / the dataloader's attention mask: alive for the whole forward
        b = batch_items(E, first=c.has_embedding, last=c.has_output)
        parts["eval_batch"] = sum(b.saved.values()) + b.fwd_transient
    if _receives(c):
        # the received activation, referenced by the schedule until forward_step returns
        parts["eval_received_input"] = p2p_tensor_bytes(E)
    if E.pp > 1 and E.vpp == 1 and not c.has_output and (E.eval_num_microbatches or 2) > 1:
        # forward_backward_pipelining_without_interleaving (schedules.py, 0.16.1 and 0.19.2) rebinds output_tensor
        # only when the next forward_step returns, and deallocate_output_tensor runs on the training path only: the
        # sent output of the previous micro-batch is live through this one's forward (the CPU referee's PP2 stage 0).
        # One eval micro-batch has no previous one: forward-only runs it as its only warm-up forward (the training's
        # output_tensor was a local of the training call). (None: a layout made without resolve: counted.)
        parts["eval_previous_output"] = p2p_tensor_bytes(E)
    if others_inputs:
        parts["eval_other_chunks_inputs"] = others_inputs
    moments: dict[str, int] = {}
    kinds = [kind for kind, n in c.kind_runs if n]
    if kinds:
        moments["eval_layer_forward"] = max(
            la.total + la.fwd_transient for la in (layer_activations(E, has_batch, k) for k in kinds))
    if c.has_embedding:
        moments["eval_embedding_forward"] = embedding_items(E).fwd_transient
    if c.has_output:
        o = output_items(E)
        moments["eval_logits_loss"] = sum(o.saved.values()) + o.fwd_transient
        tanh = o.saved.get("final_logit_softcap", 0)
        if tanh:
            # Gemma 2's softcap under no_grad keeps no tanh, but the output layer's logits, the tanh and the capped
            # logits coexist before the loss's fp32 copy is made (head._final_softcap)
            moments["eval_logits_loss"] += max(0, 3 * tanh - o.saved["loss_softmax_fp32"] - o.fwd_transient) - tanh
    if moments:
        name = max(moments, key=lambda k: moments[k])
        parts[name] = moments[name]
    return parts


def kept_input_bytes(L: Layout) -> int:
    """What one receiving chunk's ``TransformerBlock.input_tensor`` keeps between its forwards, at most: the last eval
    input once the chunk ran in the evaluation step (under torch.no_grad: no gradient), before that the training's last
    input and its gradient (pipeline_inputs_retained)."""
    return max(p2p_tensor_bytes(eval_layout(L)), 2 * p2p_tensor_bytes(L))


def stage_parts(L: Layout, pp_rank: int) -> dict[str, int]:
    """The largest chunk's forward-only parts on ``pp_rank`` (its chunks run one at a time; under interleaving the
    stage's other receiving chunks keep their last inputs meanwhile)."""
    E = eval_layout(L)
    chunks = L.stage_chunks(pp_rank)
    kept = kept_input_bytes(L)
    best: dict[str, int] = {}
    for c in chunks:
        others = sum(kept for o in chunks if o is not c and _receives(o))
        p = chunk_parts(E, c, others)
        if sum(p.values()) > sum(best.values()):
            best = p
    return best


_DETAILS = {
    "eval_batch": "the eval micro-batch's tokens, positions, labels, loss mask and attention mask",
    "eval_received_input": "the activation received from the previous stage, held until the chunk's forward returns",
    "eval_previous_output": "the previous eval micro-batch's output, sent on but held by the schedule until this "
                            "micro-batch's forward returns",
    "eval_other_chunks_inputs": "the last inputs the stage's other model chunks keep (TransformerBlock.input_tensor): "
                                "the eval micro-batch's, or the training's input and gradient before they run",
    "eval_layer_forward": "one layer's forward under torch.no_grad at the eval micro-batch: the tensors training "
                          "would save plus its working set (an upper bound)",
    "eval_embedding_forward": "the embedding's output before its tensor-parallel reduce",
    "eval_logits_loss": "logits [s, b_eval, V/TP], the loss's fp32 copy and targets, the final norm's and the output "
                        "layer's inputs",
}


def in_flight_terms(L: Layout, pp_rank: int, fixed: tuple[Term, ...]) -> tuple[Term, ...]:
    """A GPU stage's allocated fixed terms in the evaluation step: the pipeline buffer NCCL still holds
    (p2p_buffers_in_flight) is the eval micro-batch's; on a stage that only sends (the first, without interleaving)
    it is the previous output the schedule holds too (eval_previous_output), counted there once."""
    out = []
    for t in fixed:
        if t.name == "p2p_buffers_in_flight":
            if not any(_receives(c) for c in L.stage_chunks(pp_rank)):
                continue
            b, n = p2p_in_flight_bytes(eval_layout(L))
            t = Term(t.name, b, t.group, t.level,
                     f"{n} pipeline send/receive buffer of the eval micro-batch held by NCCL work objects")
        out.append(t)
    return tuple(out)


# the persistent buffers whose size follows the micro-batch, and the term naming each one's growth
_GROWTH = {
    "global_memory_buffer": ("eval_global_memory_buffer_growth",
                             "megatron's GlobalMemoryBuffer grown to the eval micro-batch's request (it stays)"),
    "moe_dispatcher_state": ("eval_moe_dispatcher_state_growth",
                             "the MoE token dispatchers' routing maps and probs at the eval micro-batch (kept until "
                             "each layer's next forward)"),
}


def eval_terms(L: Layout, pp_rank: int, static: tuple[Term, ...], buffers_growth: dict[str, int],
               fragmentation: float | None,
               device_terms: tuple[Term, ...]) -> tuple[Term, ...]:
    """The evaluation step's terms on ``pp_rank``: the training's ``static`` allocated terms (state, persistent
    buffers, workspaces, retained pipeline inputs), the buffers' growth at the eval micro-batch, the forward-only
    parts, then on a GPU (``fragmentation`` not None) the allocator's slack and the ``device_terms``."""
    rows = list(static)
    for buffer, grown in buffers_growth.items():
        if grown:
            name, detail = _GROWTH.get(buffer, (f"eval_{buffer}_growth", f"{buffer} grown to the eval micro-batch"))
            rows.append(Term(name, grown, "transients", "allocated", detail))
    for name, v in stage_parts(L, pp_rank).items():
        if v:
            group = "logits_loss" if name == "eval_logits_loss" else "activations"
            rows.append(Term(name, v, group, "allocated", _DETAILS[name]))
    if fragmentation is not None:
        rows.append(slack_term(sum(t.bytes for t in rows), fragmentation))
        rows += device_terms
    return tuple(rows)


def eval_figure(L: Layout, terms: tuple[Term, ...]) -> dict[str, Any]:
    """The evaluation step's levels (allocated, reserved, device total) and terms, as the JSON shows them."""
    return phase_figure(PHASE, terms, micro_batch_size=L.eval_micro_batch_size)
