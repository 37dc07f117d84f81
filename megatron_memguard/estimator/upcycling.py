"""MoE upcycling (``--moe-use-upcycling``): the start-up peak of a run that turns a dense checkpoint into the MoE
model, beside the training peak (which is an ordinary MoE run's).

megatron/training ``setup_model_and_optimizer`` (training.py, megatron-core 0.16; from 0.17 it fails at the dense
checkpoint's load, resolve/moe.py ``_upcycling``), in order:

1. the MoE model is built and wrapped in DDP (its parameters and gradient buffer) and its optimizer made: the
   fp32 main parameters (the distributed optimizer's shard, or Float16OptimizerWithFloat16Params' whole copies)
   exist from the optimizer's constructor; Adam's moments are made at the first step, after start-up;
2. with ``num_experts`` None, EP 1 and ``ffn_hidden_size`` x ``--moe-upcycling-granularity``, ``get_model``
   builds the dense model, wrapped in DDP the same way (its parameters and gradient buffer), and
   ``upcycling_utils.load_and_upcycle_model`` loads the dense checkpoint into it;
3. ``_convert_to_moe_state_dict`` deep-copies the dense model's and the MoE model's state dicts on the GPU
   (``copy.deepcopy(model.state_dict())``: one more copy of each model's parameters, in the parameter dtype) and
   fills the MoE one from the dense one: the start-up peak is there, with both copies alive;
4. the MoE model loads the result in place, a checkpoint is saved, and the dense model is deleted.

The figure counts what 1 to 3 hold; the checkpoint loader's own buffers (step 2) and TE's ``_extra_state`` entries
are left out. The fixed device terms (CUDA context, NCCL) are the training estimate's; buffers made at the first
forward (cuBLAS / TE workspaces, DeepEP's) are not there yet.
"""
from __future__ import annotations

from typing import Any

from ..layout import Layout
from .result import Term, phase_figure, slack_term

# device-level terms of the training estimate that exist before the first forward
_STARTUP_DEVICE_TERMS = ("cuda_context", "nccl_buffers")


def dense_layout(L: Layout) -> Layout:
    """The dense model megatron/training builds for upcycling: no experts, EP 1, FFN x granularity."""
    g = L.moe.moe_upcycling_granularity if L.moe is not None else 1
    return L.replace(moe=None, expert_model_parallel_size=1, expert_tensor_parallel_size=None,
                     ffn_hidden_size=L.ffn_hidden_size * g)


def startup_terms(L: Layout, pp_rank: int, dp_rank: int | str, device_terms: tuple[Term, ...],
                  fragmentation: float) -> tuple[Term, ...]:
    """The start-up terms of one rank of ``pp_rank`` (its allocated ones, the allocator's slack and the device
    ones), for ``dp_rank``'s optimizer shard."""
    from .states import stage_states
    moe = stage_states(L, pp_rank, dp_rank)
    D = dense_layout(L)
    dense = stage_states(D, pp_rank, dp_rank)
    p = L.param_bytes
    rows = [
        Term("upcycling_moe_model_state", moe.param_bytes + moe.grad_bytes + moe.main_param_bytes, "weights",
             "allocated", lambda: "the MoE model's parameters, gradient buffer and fp32 main parameters (Adam's "
                                  "moments come at the first step)"),
        Term("upcycling_dense_model", dense.param_bytes + dense.grad_bytes, "weights", "allocated",
             lambda: f"the dense model (FFN {D.ffn_hidden_size}, no experts) wrapped in DDP: {dense.parameters:,} "
                     "parameters and their gradient buffer"),
        Term("upcycling_state_dict_copies", (dense.parameters + moe.parameters) * p, "transients", "allocated",
             lambda: "copy.deepcopy of the dense and the MoE model's state dicts (_convert_to_moe_state_dict)"),
    ]
    rows.append(slack_term(sum(t.bytes for t in rows), fragmentation))
    rows += [t for t in device_terms if t.name in _STARTUP_DEVICE_TERMS]
    return tuple(rows)


def startup_figure(terms: tuple[Term, ...]) -> dict[str, Any]:
    """The start-up levels of ``terms`` (allocated, reserved, device total) and the terms, as the JSON shows them."""
    return phase_figure("upcycling start-up (_convert_to_moe_state_dict)", terms)
