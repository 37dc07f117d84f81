"""The no-op block of a heterogeneous layer config (``no_op: true``; megatron-core 0.19.2
heterogeneous_layer_specs.py): the attention or the MLP is an IdentityOp, its norm an IdentityOp and its
bias-dropout-add an IdentityFuncOp. It holds no parameters and keeps nothing for backward; the layer
composition (``estimator.activations``) drops the norm, residual and dropout tensors of that half.

One module serves as both a mixer recipe and an MLP recipe (see ``base``)."""
from __future__ import annotations

from typing import Any

from .base import MixerActivations, MlpActivations, Param


def linear_shapes(L: Any) -> dict[str, tuple[int, int]]:
    return {}


def param_rows(L: Any) -> list:
    return []


def params(L: Any, prefix: str = "") -> list[Param]:
    return []


def param_count(L: Any) -> int:
    return 0


def reads_batch_mask(L: Any) -> bool:
    """A no-op mixer makes no tensors, with or without the batch's attention mask."""
    return False


def activations(L: Any, mods: set, *rest: Any) -> Any:
    """As a mixer (7 arguments) or as an MLP (3 arguments): nothing saved, no working set."""
    if len(rest) == 1:
        return MlpActivations(saved={}, names=frozenset(), bwd_steps=(), released=frozenset())
    return MixerActivations(saved={}, fwd_steps=(), bwd_steps=())


def bound_saved(L: Any, tp: int, b: int, seq: int, sp: bool, mods: set) -> int:
    return 0
