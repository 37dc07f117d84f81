"""What every layer recipe shares: the parameter record, the per-rank shapes of one micro-batch, and
the two parts a recipe returns for its activations.

A recipe is a module for one kind of token mixer (``attention``, ``mla``) or MLP (``dense``) giving
* ``param_rows(L)``: its parameters on one TP rank, in megatron-core's registration order, as rows
  (``ParamRow``); ``params(L, prefix)``: the same as Param objects;
* ``linear_shapes(L)``: [out, in] per TP rank of its linear weights;
* ``param_count(L)``: its parameters in the whole model (one layer, no TP split);
* ``activations(...)``: the tensors it keeps for backward per micro-batch and the working sets of its
  forward and backward steps (:class:`MixerActivations` / :class:`MlpActivations`).
``megatron_memguard.estimator.activations`` composes them into a transformer layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from ...layout import Layout


@dataclass(frozen=True)
class Param:
    name: str
    numel: int
    tp_replicated: bool = False      # same values on every TP rank (norms, row-parallel biases)
    shared_embedding: bool = False   # tied embedding / output copy: its own DDP bucket with dist-opt
    expert: bool = False             # a routed expert's weight: the expert DDP buffer (layers/moe.py)
    cols: int = 0                    # a matrix's input dimension per rank (rows = numel // cols); 0: not a matrix

    def __init__(self, name: str, numel: int, tp_replicated: bool = False, shared_embedding: bool = False,
                 expert: bool = False, cols: int = 0) -> None:
        # the frozen dataclass's __init__ sets each field through object.__setattr__; a cold estimate
        # makes every layer kind's parameter list, so the fields are stored directly (as Term's)
        d = self.__dict__
        d["name"] = name
        d["numel"] = numel
        d["tp_replicated"] = tp_replicated
        d["shared_embedding"] = shared_embedding
        d["expert"] = expert
        d["cols"] = cols


# A parameter as a recipe lists it: (name, numel, tp_replicated, shared_embedding, expert, cols), Param's
# fields in order. A cold estimate needs the sizes of every layer kind (the DDP buffers); the named Param
# objects are made from the same rows when a caller asks for them (param_objects).
ParamRow = tuple[str, int, bool, bool, bool, int]


def param_objects(rows: list[ParamRow], prefix: str = "") -> list[Param]:
    """The Param of each row, its name after ``prefix``."""
    return [Param(prefix + name, numel, tp, shared, expert, cols) for name, numel, tp, shared, expert, cols in rows]


def norm_rows(name: str, size: int, L: Layout) -> list[ParamRow]:
    rows = [(name + ".weight", size, True, False, False, 0)]
    if L.normalization == "LayerNorm":
        rows.append((name + ".bias", size, True, False, False, 0))
    return rows


def norm_params(name: str, size: int, L: Layout) -> list[Param]:
    return param_objects(norm_rows(name, size, L))


def norms_per_layer_norm(L: Layout) -> int:
    """Parameter vectors of one norm: weight and bias (LayerNorm) or weight (RMSNorm)."""
    return 2 if L.normalization == "LayerNorm" else 1


@dataclass(frozen=True)
class Shapes:
    s: int          # sequence length on this CP rank
    b: int          # micro-batch size
    T: int          # tokens of the sequence-sharded residual stream on this rank
    Tf: int         # tokens inside the tensor-parallel region (s*b)
    h: int
    a_t: int        # attention heads on this rank
    g_t: int        # query groups on this rank (at least 1)
    d: int          # head dim (kv_channels)
    f_t: int        # ffn hidden on this rank
    e: int          # bytes per activation element
    r: int          # bytes per residual-stream element (fp32 with --fp32-residual-connection)

    def __init__(self, s: int, b: int, T: int, Tf: int, h: int, a_t: int, g_t: int, d: int, f_t: int, e: int,
                 r: int) -> None:
        # made for every new layout (and kind of a heterogeneous one): the fields are stored directly (as Term's)
        self.__dict__.update(s=s, b=b, T=T, Tf=Tf, h=h, a_t=a_t, g_t=g_t, d=d, f_t=f_t, e=e, r=r)


@lru_cache(maxsize=256)
def shapes(L: Layout) -> Shapes:
    s = L.seq_length // L.cp
    b = L.micro_batch_size
    t = L.tp
    return Shapes(
        s=s, b=b, T=s * b // (t if L.sequence_parallel else 1), Tf=s * b, h=L.hidden_size,
        a_t=L.num_attention_heads // t, g_t=max(1, L.num_query_groups // t), d=L.kv_channels,
        f_t=L.ffn_hidden_size // t, e=L.act_bytes, r=4 if L.fp32_residual_connection else L.act_bytes,
    )


Step = tuple[frozenset, int]   # (saved names released / not yet created, working bytes)


def selective_modules(L: Layout) -> frozenset[str]:
    """The modules selective recompute recomputes: --recompute-modules, except 'moe' under the expert-parallel
    overlap (reachable on megatron-core 0.16 only, resolve/moe.py): its combined 1F1B schedule runs the MoE layer's
    parts through the fine-grained callables, never the checkpointed MoELayer.forward."""
    if L.recompute_granularity != "selective":
        return frozenset()
    mods = frozenset(L.recompute_modules)
    m = getattr(L, "moe", None)
    if "moe" in mods and m is not None and m.overlap_moe_expert_parallel_comm:
        mods -= {"moe"}
    return mods


def norm_stats(L: Layout, n_tokens: int) -> int:
    # fp32 mean and rstd per token (LayerNorm), rstd only (RMSNorm)
    return n_tokens * 4 * (2 if L.normalization == "LayerNorm" else 1)


def wgrad(L: Layout, rows: int, cols: int) -> int:
    """A weight gradient materialised before it is added to main_grad (no fused accumulation)."""
    return 0 if L.fused_wgrad else rows * cols * L.act_bytes


class MixerActivations(NamedTuple):
    """The token mixer's share of a layer: from the input norm to linear_proj's input.

    ``saved``: what it keeps for backward, in creation order. ``fwd_steps``: (names of the layer not
    yet created, working bytes) of its forward. ``bwd_steps``: its backward from linear_proj down to
    the input norm, (names released so far, working bytes including the gradient of the layer output).
    Immutable named tuples, like ``MlpActivations``: made for every layer kind of every new layout."""

    saved: dict[str, int]
    fwd_steps: tuple[Step, ...]
    bwd_steps: tuple[Step, ...]


class MlpActivations(NamedTuple):
    """The MLP's share of a layer after the pre-MLP norm: ``saved`` (kept for backward, unless the
    layer recomputes the MLP), ``names`` (all of them), ``bwd_steps`` from linear_fc2 down to linear_fc1
    (released so far, working bytes including the gradient of the layer output) and ``released``
    (every MLP name, released once linear_fc1's backward runs)."""

    saved: dict[str, int]
    names: frozenset
    bwd_steps: tuple[Step, ...]
    released: frozenset
    # working sets of its forward after the pre-MLP norm, (names of the layer not yet created, bytes):
    # none for the dense MLP (the mixer's are larger); the MoE dispatcher's buffers
    fwd_steps: tuple[Step, ...] = ()
