"""Probes for MoE runs of the referee: the routing each MoE layer produced, and module labels.

`install(model_chunks, tracker)` (called by the worker after the model is built, for MoE models only):

* **routing**: a forward hook on every MoE layer's router records how many of this rank's tokens
  chose each expert (``routing_map.sum(0)``, length E), and a wrapper around the token dispatcher's
  ``dispatch_postprocess`` records ``tokens_per_expert`` for this rank's local experts (length E_l)
  and the rows handed to the experts (N). One record per MoE layer per forward (micro-batch), with the
  phase label of the schedule step (``itN fwd [cK] mbM``; a ``bwd`` label marks a recomputed forward).
  The counting runs with the tracker switched off, so it allocates nothing that is measured.
* **module labels**: allocations made inside a transformer layer's submodules carry
  `` L<n>.<module>`` after the schedule label (``attn``, ``mlp`` for dense MLPs, and for MoE layers
  ``router``, ``shared_experts``, ``experts`` and the dispatcher steps ``dispatch_preprocess``,
  ``token_dispatch``, ``dispatch_postprocess``, ``combine_preprocess``, ``token_combine``,
  ``combine_postprocess``), so the dump at the peak names the module that made each saved tensor.
  Backward allocations keep the schedule label only (autograd runs outside the module hooks).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List

import torch
from torch.utils._python_dispatch import _disable_current_modes

_DISPATCH_STEPS = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "combine_preprocess",
                   "token_combine", "combine_postprocess")


class _Labels:
    """A stack of phase labels: entering a module appends its tag, leaving restores the outer label."""

    def __init__(self, tracker):
        self.tracker = tracker
        self.stack: List[str] = []

    def enter(self, tag: str) -> None:
        outer = self.tracker.phase
        self.stack.append(outer)
        base = outer.split(" L", 1)[0]  # the schedule label without an enclosing module tag
        self.tracker.set_phase(f"{base} {tag}")

    def leave(self) -> None:
        if self.stack:
            self.tracker.set_phase(self.stack.pop())

    def schedule_label(self) -> str:
        return self.tracker.phase.split(" L", 1)[0]


def _label_module(module: torch.nn.Module, tag: str, labels: _Labels) -> None:
    module.register_forward_pre_hook(lambda m, a: labels.enter(tag))
    module.register_forward_hook(lambda m, a, o: labels.leave())


def _label_method(obj: Any, name: str, tag: str, labels: _Labels, after=None) -> None:
    orig = getattr(obj, name)

    @functools.wraps(orig)
    def wrapped(*a, **k):
        labels.enter(tag)
        try:
            out = orig(*a, **k)
            if after is not None:
                after(out)
            return out
        finally:
            labels.leave()

    setattr(obj, name, wrapped)


def install(model_chunks, tracker) -> List[Dict[str, Any]]:
    """Label modules and record routing; returns the (growing) list of routing records."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    labels = _Labels(tracker)
    routing: List[Dict[str, Any]] = []
    for chunk in model_chunks:
        for layer in chunk.modules():
            if not isinstance(layer, TransformerLayer):
                continue
            n = layer.layer_number
            _label_module(layer.self_attention, f"L{n}.attn", labels)
            mlp = layer.mlp
            if not isinstance(mlp, MoELayer):
                _label_module(mlp, f"L{n}.mlp", labels)
                continue
            _install_moe_layer(mlp, n, labels, routing)
    return routing


def _install_moe_layer(moe, n: int, labels: _Labels, routing: List[Dict[str, Any]]) -> None:
    current: Dict[str, Any] = {}

    def on_router(module, inputs, output):
        probs, routing_map = output
        with _disable_current_modes():
            per_expert = routing_map.sum(dim=0).tolist()
        current.clear()
        current.update({
            "phase": labels.schedule_label(), "layer": n,
            "tokens": int(routing_map.shape[0]),  # T: tokens entering this layer on this rank
            "routed_per_expert": [int(x) for x in per_expert],  # this rank's token copies per expert
            "probs_dtype": str(probs.dtype).replace("torch.", ""),
        })

    def on_dispatched(out):
        dispatched, tokens_per_expert, _ = out
        # a host tensor (or list); never through torch.as_tensor, whose referee wrapper registers it
        tpe = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
        rec = dict(current)
        rec["tokens_per_local_expert"] = [int(x) for x in tpe]  # what this rank's experts received
        rec["expert_input_rows"] = int(dispatched.shape[0])  # N (with drop-and-pad: the padded rows)
        routing.append(rec)

    _label_module(moe.router, f"L{n}.router", labels)
    moe.router.register_forward_hook(on_router)
    _label_module(moe.experts, f"L{n}.experts", labels)
    if moe.shared_experts is not None:
        _label_module(moe.shared_experts, f"L{n}.shared_experts", labels)
    d = moe.token_dispatcher
    for step in _DISPATCH_STEPS:
        _label_method(d, step, f"L{n}.{step}", labels, after=on_dispatched if step == "dispatch_postprocess" else None)


def summarize(routing: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per MoE layer: the largest N seen, and its ratio to the balanced expectation T·k·ETP."""
    out: Dict[str, Any] = {}
    for r in routing:
        key = str(r["layer"])
        s = out.setdefault(key, {"max_expert_input_rows": 0, "max_tokens_per_local_expert": 0, "forwards": 0})
        s["forwards"] += 1
        s["max_expert_input_rows"] = max(s["max_expert_input_rows"], r["expert_input_rows"])
        s["max_tokens_per_local_expert"] = max(s["max_tokens_per_local_expert"],
                                               max(r["tokens_per_local_expert"] or [0]))
    return out
