"""TP communication overlap: the userbuffers Transformer Engine allocates for ``--tp-comm-overlap``.

Sources (read for this module):

* megatron/training/initialize.py ``_initialize_tp_communicators`` (megatron-core 0.19.2): buffer shape
  ``[seq_length * micro_batch_size // CP, hidden_size]``; quantization modes ``[FP8]`` with
  ``--fp8-format`` (``[NONE]`` otherwise, FP4 included), plus ``NONE`` when ``--first-last-layers-bf16``
  keeps layers in BF16; ``initialize_ub`` gets no ``dtype``, so TE's default ``torch.bfloat16`` is the
  non-FP8 buffer dtype whatever the training precision.
* transformer_engine/pytorch/module/base.py ``initialize_ub`` (TE 2.11): twelve GEMMs per mode, their
  default method (ring_exchange: qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad; pipeline: proj_fprop,
  fc2_fprop; bulk: qkv_dgrad, qkv_wgrad, fc1_dgrad, fc1_wgrad; external: proj_wgrad, fc2_wgrad), which
  are reduce-scatters, which use a uint8 buffer in FP8 mode (``fp8_buf``: the all-gather GEMMs, and a
  pipeline GEMM whose user config asks for it), and the ``ub_cfgs`` rewrite that turns qkv_dgrad /
  fc1_dgrad into reduce-scatters when their method is not bulk.
* transformer_engine/common/comm_gemm_overlap (``CommOverlapBase``, ``CommOverlapP2PBase``; the class
  layout is in include/transformer_engine/comm_gemm_overlap.h of the transformer_engine_torch 2.11
  sdist, the allocation in comm_gemm_overlap.cpp): every buffer holds the whole shape, except a
  ring-exchange reduce-scatter, which keeps ``2 TP - 1`` chunks of ``rows / TP`` rows to reduce the
  received GEMM outputs at the end. The memory comes from ``register_user_buffer_collective`` (cuMemCreate
  with multicast, cudaMalloc with CUDA IPC), outside PyTorch's caching allocator: it shows in
  ``nvidia-smi``, not in ``torch.cuda.memory_allocated``. Each region is rounded up to the allocation
  granularity (2 MiB); the communicator's own flag region is not counted (docs/assumptions.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from ..units import MiB

UB_GEMMS = ("qkv_fprop", "qkv_dgrad", "qkv_wgrad", "proj_fprop", "proj_dgrad", "proj_wgrad",
            "fc1_fprop", "fc1_dgrad", "fc1_wgrad", "fc2_fprop", "fc2_dgrad", "fc2_wgrad")
# initialize_ub's tables (TE 2.11), in its order
_ALL_GATHER = ("qkv_fprop", "qkv_dgrad", "proj_dgrad", "proj_wgrad", "fc1_fprop", "fc1_dgrad", "fc2_dgrad", "fc2_wgrad")
_REDUCE_SCATTER = ("proj_fprop", "fc2_fprop", "qkv_wgrad", "fc1_wgrad")
_DGRAD_REDUCE_SCATTER = ("qkv_dgrad", "fc1_dgrad")
_METHODS = (("ring_exchange", ("qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad")),
            ("pipeline", ("proj_fprop", "fc2_fprop")),
            ("bulk", ("qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad")),
            ("external", ("proj_wgrad", "fc2_wgrad")))
# initialize_ub's default non-FP8 dtype (torch.bfloat16; Megatron passes none)
UB_DTYPE_BYTES = 2
# CUDA's minimum allocation granularity for cuMemCreate on current GPUs (each userbuffer region is one)
UB_GRANULARITY = 2 * MiB


@dataclass(frozen=True)
class UbGemm:
    """One GEMM's overlap as initialize_ub configures it."""
    gemm: str
    method: str
    reduce_scatter: bool
    fp8_buf: bool


@dataclass(frozen=True)
class Userbuffer:
    """One userbuffer: a GEMM's communicator in one quantization mode."""
    gemm: str
    mode: str               # "fp8" (uint8 buffers where fp8_buf) | "none" (bf16)
    method: str
    reduce_scatter: bool
    element_bytes: int
    rows: int
    cols: int
    chunks: int             # buffer = chunks x (rows / chunk_div) rows
    chunk_div: int
    bytes: int              # allocated, rounded to the granularity


def _parse(words: Iterable[str]) -> dict[str, dict[str, Any]]:
    user: dict[str, dict[str, Any]] = {}
    for w in words:
        left, value = w.split("=", 1)
        gemm, key = left.split(".", 1)
        user.setdefault(gemm, {})[key] = value if key == "method" else value == "1"
    return user


def ub_gemms(cfg_words: Iterable[str] = ()) -> tuple[UbGemm, ...]:
    """The twelve GEMMs as initialize_ub configures them from the user's ``ub_cfgs`` (its
    size-deciding settings, resolve/tp_overlap.py's words), in initialize_ub's creation order. Pure."""
    user = _parse(cfg_words)
    ag, rs = list(_ALL_GATHER), list(_REDUCE_SCATTER)
    methods = {m: list(names) for m, names in _METHODS}
    if user:
        for name in _DGRAD_REDUCE_SCATTER:
            new = user.get(name, {}).get("method")
            if new is not None and new != "bulk":
                # a dgrad overlapped with its reduce-scatter: its wgrad's buffer stays but gathers
                rs.remove(name.replace("dgrad", "wgrad"))
                ag.remove(name)
                rs.append(name)
                methods["bulk"].remove(name)
                methods[new].append(name)
    method_of = {n: m for m, names in methods.items() for n in names}
    out = []
    for m, names in methods.items():
        for name in names:
            cfg = dict(method=method_of[name], reduce_scatter=name in rs, fp8_buf=name in ag)
            if name in user:
                u = user[name]
                fp8_buf = (name in ag) or (bool(u.get("fp8_buf", False)) and name in methods["pipeline"])
                if "method" in u:
                    cfg["method"] = u["method"]
                if "is_reduce_scatter" in u:
                    cfg["reduce_scatter"] = bool(u["is_reduce_scatter"])
                cfg["fp8_buf"] = fp8_buf
            out.append(UbGemm(name, **cfg))
    return tuple(out)


def ub_problems(cfg_words: Iterable[str]) -> list[tuple[str, str]]:
    """(GEMM, rule) for the ``ub_cfgs`` initialize_ub rejects (TE 2.11 asserts / ValueError)."""
    user = _parse(cfg_words)
    out: list[tuple[str, str]] = []
    for name in _DGRAD_REDUCE_SCATTER:
        new = user.get(name, {}).get("method")
        wgrad = name.replace("dgrad", "wgrad")
        if new is not None and new != "bulk" and wgrad in user:
            out.append((wgrad, f"cannot be set when {name} overlaps its reduce-scatter (method {new})"))
    if out:
        return out
    gemms = {g.gemm: g for g in ub_gemms(cfg_words)}
    for g in gemms.values():
        if g.method == "pipeline" and not g.reduce_scatter:
            out.append((g.gemm, "the pipeline method needs a reduce-scatter GEMM (initialize_ub)"))
        if g.gemm in ("proj_wgrad", "fc2_wgrad"):
            dgrad = g.gemm.replace("wgrad", "dgrad")
            if g.method != "external" or gemms[dgrad].method != "ring_exchange":
                out.append((g.gemm, f"must use the external method with {dgrad} on ring_exchange (initialize_ub)"))
    return out


def ub_modes(L: Any) -> tuple[str, ...]:
    """initialize_ub's quantization modes as Megatron asks for them."""
    if not getattr(L, "fp8", None):
        return ("none",)
    if L.first_last_layers_bf16 and (L.num_layers_at_start_in_bf16 > 0 or L.num_layers_at_end_in_bf16 > 0):
        return ("fp8", "none")
    return ("fp8",)


def userbuffers(L: Any) -> tuple[Userbuffer, ...]:
    """Every userbuffer of a rank with ``--tp-comm-overlap`` (empty without it)."""
    if not L.tp_comm_overlap:
        return ()
    rows = L.seq_length * L.micro_batch_size // L.cp
    cols = L.hidden_size
    tp = L.tp
    out = []
    for mode in ub_modes(L):
        for g in ub_gemms(L.kernels.tp_comm_overlap_cfg):
            e = 1 if (mode == "fp8" and g.fp8_buf) else UB_DTYPE_BYTES
            full = rows * cols * e
            if g.method == "ring_exchange" and g.reduce_scatter:
                chunks, div = 2 * tp - 1, tp
                raw = full // tp * chunks
            else:
                chunks, div = 1, 1
                raw = full
            allocated = -(-raw // UB_GRANULARITY) * UB_GRANULARITY
            out.append(Userbuffer(g.gemm, mode, g.method, g.reduce_scatter, e, rows, cols, chunks, div, allocated))
    return tuple(out)


def userbuffer_bytes(L: Any) -> int:
    return sum(b.bytes for b in userbuffers(L))


def describe(L: Any) -> str:
    """The per-buffer breakdown for --detail: grouped by (mode, method, direction, dtype)."""
    bufs = userbuffers(L)
    if not bufs:
        return ""
    groups: dict[tuple, list[Userbuffer]] = {}
    for b in bufs:
        groups.setdefault((b.mode, b.method, b.reduce_scatter, b.element_bytes, b.chunks, b.chunk_div, b.bytes), []).append(b)
    rows, cols = bufs[0].rows, bufs[0].cols
    parts = []
    for (mode, method, rs, e, chunks, div, size), members in groups.items():
        dtype = "uint8" if e == 1 else "bf16"
        shape = f"{chunks} x [{rows}/{div}, {cols}]" if chunks > 1 else f"[{rows}, {cols}]"
        names = ",".join(m.gemm for m in members)
        parts.append(f"{names} ({'fp8 mode' if mode == 'fp8' else 'bf16 mode'}, {method} "
                     f"{'reduce-scatter' if rs else 'all-gather'}): {len(members)} x {shape} {dtype} = "
                     f"{len(members)} x {size / MiB:.1f} MiB")
    return (f"{len(bufs)} Transformer Engine userbuffers for TP overlap, outside PyTorch's allocator: "
            + "; ".join(parts))


# ----- --symmetric-ar-type ---------------------------------------------------------------------------
# torch.distributed._symmetric_memory.get_signal_pad_size() default (torch 2.14.1): each symmetric allocation
# carries a signal pad next to its data
SYMMETRIC_SIGNAL_PAD = 9216


def symmetric_ar_bytes(L: Any) -> int:
    """``--symmetric-ar-type``: TE's ``symmetric_all_reduce`` (transformer_engine/pytorch/distributed.py,
    TE 2.11) copies a row-parallel linear's output into a symmetric-memory tensor cached per (numel, dtype,
    group) and all-reduces there. Only the all-reduce path uses it: TP > 1 without sequence parallelism
    (``linear.py`` / ``layernorm_mlp.py``: with SP the output is reduce-scattered). linear_proj and linear_fc2
    (and a shared expert's fc2) all give ``[s b / CP, h]`` in the activation dtype: one buffer. Allocated by
    torch's symmetric-memory allocator (cuMemCreate), outside PyTorch's caching allocator; data + signal pad,
    rounded up to 2 MiB."""
    if (not getattr(L, "symmetric_ar_type", None) or L.tp == 1 or L.sequence_parallel
            or L.transformer_impl != "transformer_engine"):
        return 0
    raw = L.seq_length // L.cp * L.micro_batch_size * L.hidden_size * L.act_bytes + SYMMETRIC_SIGNAL_PAD
    return -(-raw // UB_GRANULARITY) * UB_GRANULARITY
