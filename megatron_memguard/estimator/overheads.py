"""Costs only a real GPU has: library workspaces, the CUDA context, NCCL buffers, allocator slack.

Levels matter: cuBLAS and Transformer Engine workspaces are allocated through PyTorch's caching
allocator (they appear in ``torch.cuda.memory_allocated``); the CUDA context and NCCL's communicator
buffers are not (they appear only in ``nvidia-smi``); the caching allocator reserves more than it
hands out (``memory_reserved - memory_allocated``).
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import TYPE_CHECKING

from ..layout import Layout, ShardGroup, TensorKind
from ..units import MiB
from .params import layer_linear_shapes, mtp_stack_runs
from .result import Term, TermGroup, TermLevel

if TYPE_CHECKING:
    from .site import SiteConstants

_ACTIVATION = TensorKind.ACTIVATION  # (an enum member lookup costs more than the rest of p2p_tensor_bytes)

# CUDA context with lazy module loading (CUDA >= 11.7, PyTorch's default), incl. cuBLAS/cuDNN/NCCL
# kernels loaded on first use: typically 400-600 MiB per process on A100/H100 (nvidia-smi minus
# torch.cuda.memory_reserved right after initialisation).
CUDA_CONTEXT_BYTES = 512 * MiB
# NCCL allocates per communicator and channel a ring/tree buffer of NCCL_BUFFSIZE (default 4 MiB)
# for each peer direction; Megatron uses TP, PP (p2p), DP-CP and CP communicators in training.
NCCL_DEFAULT_BUFFSIZE = 4 * MiB
NCCL_CHANNELS = 16
# cuBLAS workspace per handle: PyTorch's default is ":4096:2:16:8" (2x4 MiB + 8x16 KiB), 32 MiB on
# Hopper and newer (torch's getChosenWorkspaceSize); CUBLAS_WORKSPACE_CONFIG overrides it.
CUBLAS_DEFAULT_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
CUBLAS_HOPPER_BYTES = 32 * MiB
# Caching-allocator slack on top of the peak of live tensors (reserved / allocated - 1).
FRAGMENTATION = 0.05

# memguard's bounds on the environment's sizes (resolve/runtime.py refuses what is beyond them): an NCCL buffer of 1 GiB
# (256 x the default; x 16 channels x 2 directions = 32 GiB per communicator), and PyTorch's std::stoi on each number
# of CUBLAS_WORKSPACE_CONFIG (CublasHandlePool.cpp parseChosenWorkspaceSize: beyond int32 it throws) with 1 TiB in all
MAX_NCCL_BUFFSIZE = 1 << 30
MAX_CUBLAS_NUMBER = 2**31 - 1
MAX_CUBLAS_WORKSPACE = 1 << 40
_NCCL_SIZE = re.compile(r"[0-9]+|0[xX][0-9a-fA-F]+")


def nccl_buffsize(text: str | None) -> int | None:
    """NCCL_BUFFSIZE in bytes, decimal or 0x hex as NCCL's strtoll(..., 0) reads it; None when unset or not a byte
    count within 1 B .. MAX_NCCL_BUFFSIZE (resolve/runtime.py refuses those, so NCCL's default is taken only for an
    unset variable)."""
    t = (text or "").strip()
    if len(t) > 20 or not _NCCL_SIZE.fullmatch(t):
        return None
    n = int(t, 16) if t[:2] in ("0x", "0X") else int(t)
    return n if 1 <= n <= MAX_NCCL_BUFFSIZE else None


def cublas_config_pairs(cfg: str) -> list[tuple[str, str]]:
    """CUBLAS_WORKSPACE_CONFIG's (size in KiB, count) pairs, ``:4096:8:16:8`` -> [("4096", "8"), ("16", "8")]: ASCII
    digits only, as PyTorch's regex reads them (CublasHandlePool.cpp)."""
    return re.findall(r":([0-9]+):([0-9]+)", cfg)


def env_size_problems(env: dict[str, str]) -> list[tuple[str, str]]:
    """(variable, rule) for each memory size in the job's environment memguard cannot take: an NCCL_BUFFSIZE that is
    not a byte count in its bounds, a CUBLAS_WORKSPACE_CONFIG number PyTorch's std::stoi throws on or a total beyond
    MAX_CUBLAS_WORKSPACE."""
    from ..numbers import shown
    out = []
    v = env.get("NCCL_BUFFSIZE")
    if v is not None and nccl_buffsize(v) is None:
        out.append(("NCCL_BUFFSIZE", f"must be a byte count from 1 to {MAX_NCCL_BUFFSIZE:,} (decimal or 0x hex; "
                    f"memguard's bound: 256 x NCCL's 4 MiB default), got {shown(v)}"))
    v = env.get("CUBLAS_WORKSPACE_CONFIG")
    if v:
        pairs = cublas_config_pairs(v)
        if any(len(x) > 10 or int(x) > MAX_CUBLAS_NUMBER for pair in pairs for x in pair):
            out.append(("CUBLAS_WORKSPACE_CONFIG", f"has a number beyond {MAX_CUBLAS_NUMBER:,} (PyTorch reads each with "
                        f"std::stoi, which throws), got {shown(v)}"))
        elif sum(int(k) * 1024 * int(c) for k, c in pairs) > MAX_CUBLAS_WORKSPACE:
            out.append(("CUBLAS_WORKSPACE_CONFIG", f"asks for more than 1 TiB of cuBLAS workspace (memguard's bound: "
                        f"beyond any GPU's memory), got {shown(v)}"))
    return out


def _hopper_or_newer(gpu_name: str | None) -> bool:
    return bool(gpu_name) and any(k in gpu_name for k in ("H100", "H200", "B200", "GB200"))


# --deterministic-mode sets CUBLAS_WORKSPACE_CONFIG=:4096:8 when the launcher left it unset
# (megatron/training/determinism.py, DETERMINISM_ENV_VAR_DEFAULTS, Megatron 0.19); before that,
# torch.use_deterministic_algorithms(True) refused cuBLAS calls without it.
DETERMINISTIC_CUBLAS_CONFIG = ":4096:8"


def cublas_config_bytes(L: Layout) -> int | None:
    """The workspace CUBLAS_WORKSPACE_CONFIG (or --deterministic-mode's default) sets, None if unset."""
    cfg = L.env_dict.get("CUBLAS_WORKSPACE_CONFIG") or (DETERMINISTIC_CUBLAS_CONFIG if L.deterministic_mode else None)
    if cfg:
        total = 0
        for size_kib, count in cublas_config_pairs(cfg):
            total += int(size_kib) * 1024 * int(count)
        if total:
            return total
    return None


def cublas_workspace_bytes(L: Layout, gpu_name: str | None, site: SiteConstants | None = None) -> int:
    configured = cublas_config_bytes(L)
    if configured is not None:
        return configured
    if site is not None and site.cublas_workspace is not None:
        return site.cublas_workspace
    if _hopper_or_newer(gpu_name):
        return CUBLAS_HOPPER_BYTES
    return CUBLAS_DEFAULT_BYTES


# The expert-parallel communicators (EP: the token dispatcher's; EXPERT-DP: the expert gradients' and the expert
# optimizer's). PyTorch creates a group's NCCL communicator, and NCCL its channel buffers, at the first collective
# on it (Megatron's init_process_group passes no device_id, so no eager init: megatron/training/initialize.py,
# core 0.19.2; parallel_state.py says so too, 0.16.1 and 0.19.2). Only MoE layers dispatch over EP, and the DDP
# expert buffers and the expert optimizer exist only for expert parameters (distributed_data_parallel.py,
# optimizer/__init__.py ``if len(moe_param_groups) > 0``, 0.16.1 and 0.19.2): a stage without MoE layers never
# runs a collective on either group.
MOE_COMMUNICATORS = ("EP", "EXPERT-DP")


def nccl_communicators(L: Layout, stage_has_moe: bool = True) -> list[str]:
    """The communicators Megatron's training uses on a rank and that NCCL gives buffers;
    ``stage_has_moe`` False: a pipeline stage of an MoE model without MoE layers."""
    comms = []
    if L.tp > 1:
        comms.append("TP")
    if L.pp > 1:
        comms.append("PP")
    if L.dp * L.cp > 1:
        comms.append("DP-CP")
    if L.cp > 1:
        comms.append("CP")
    m = L.moe
    if m is not None and stage_has_moe:
        # the token dispatcher's group (ETP x EP, or EP for alltoall) and the expert gradients' group
        if m.ep * m.etp > 1:
            comms.append("EP")
        if L.parallel.shard_size(ShardGroup.EXPERT_DP) * L.num_distributed_optimizer_instances > 1:
            comms.append("EXPERT-DP")
    return comms


def nccl_bytes(L: Layout, site: SiteConstants | None = None, stage_has_moe: bool = True) -> tuple[int, str]:
    buff = nccl_buffsize(L.env_dict.get("NCCL_BUFFSIZE")) or NCCL_DEFAULT_BUFFSIZE
    per = NCCL_CHANNELS * 2 * NCCL_DEFAULT_BUFFSIZE if site is None else site.nccl_per_communicator
    per = per * buff // NCCL_DEFAULT_BUFFSIZE
    comms = nccl_communicators(L, stage_has_moe)
    return per * len(comms), ", ".join(comms) or "none"


# PyTorch keeps one workspace per cuBLAS handle and one per cuBLASLt handle for the compute stream;
# both are sized by CUBLAS_WORKSPACE_CONFIG in the NVIDIA PyTorch containers Megatron runs in
# (recent open-source builds can share one allocation: TORCH_CUBLASLT_UNIFIED_WORKSPACE). Megatron's
# CI shows the pair: steady allocated memory exceeds model state by 2 x 32 MiB + TE's workspace with
# CUBLAS_WORKSPACE_CONFIG=:4096:8 on A100, H100 and GB200 alike.
BLAS_WORKSPACES = 2


# Transformer Engine's compute streams for multi-stream (grouped) GEMMs, each with its own cuBLAS
# workspace of te_workspace_bytes (TE 2.x); the measured 128 MiB (Hopper) / 16 MiB (A100) fix it at 4.
TE_GEMM_STREAMS = 4


def te_workspace_bytes(gpu_name: str | None, site: SiteConstants | None = None) -> int:
    if site is not None and site.te_workspace is not None:
        return site.te_workspace
    # transformer_engine/pytorch/cpp_extensions/gemm.py get_cublas_workspace_size_bytes():
    # 32 MiB + 1 KiB on compute capability >= 9 (Hopper, Blackwell), 4 MiB before
    return 32 * MiB + 1024 if _hopper_or_newer(gpu_name) else 4 * MiB


# Fixed terms that only a rank running an MoE layer allocates: TE's multi-stream workspaces on the first grouped
# GEMM (cpp_extensions/gemm.py get_cublas_workspace, TE 2.11), DeepEP's buffers on the first dispatch
# (megatron/core/transformer/moe/fused_a2a.py get_buffer, 0.19.2); under the local implementation TE's
# workspace serves only the router's GEMM.
MOE_RANK_TERMS = frozenset({"te_grouped_gemm_workspaces", "deepep_buffer", "deepep_rdma_buffer"})


def stage_fixed_terms(L: Layout, fixed: tuple[Term, ...], stage_has_moe: bool) -> tuple[Term, ...]:
    """The fixed terms of one pipeline stage: an MoE model's stage without an MoE layer (dense first layers of
    ``--moe-layer-freq``, an uneven split) never makes what only its MoE layers would."""
    if L.moe is None or stage_has_moe:
        return fixed
    drop = MOE_RANK_TERMS | ({"te_workspace"} if L.transformer_impl != "transformer_engine" else set())
    out = []
    for t in fixed:
        if t.name in drop:
            continue
        if t.name == "nccl_buffers":
            # the same bytes per communicator, without the expert-parallel groups this stage never uses
            every, dense = nccl_communicators(L), nccl_communicators(L, stage_has_moe=False)
            if len(dense) < len(every):
                if not dense:
                    continue
                per_detail = t.detail.rsplit(" (", 1)[0]
                t = Term(t.name, t.bytes // len(every) * len(dense), t.group, t.level,
                         f"{per_detail} ({', '.join(dense)}; no MoE layer here: no {', '.join(c for c in every if c not in dense)})")
        out.append(t)
    return tuple(out)


def gpu_fixed_terms(L: Layout, gpu_name: str | None, site: SiteConstants | None = None) -> list[Term]:
    """``site``: the site constants (None: memguard's defaults, estimator/site.py)."""
    ws = cublas_workspace_bytes(L, gpu_name, site)
    terms = [Term("cublas_workspaces", BLAS_WORKSPACES * ws, TermGroup.FIXED, TermLevel.ALLOCATED,
                  f"{BLAS_WORKSPACES} x {ws / 2**20:.2f} MiB cuBLAS/cuBLASLt workspaces of the compute stream "
                  "(CUBLAS_WORKSPACE_CONFIG or PyTorch's default)")]
    if L.transformer_impl == "transformer_engine" or L.moe is not None:
        # MoE: the router's gating GEMM is TE's general_gemm whenever TE is installed, also with the
        # local implementation (Megatron's CI: +32 MiB on H100/GB200, +4 MiB on A100 after the step)
        terms.append(Term("te_workspace", te_workspace_bytes(gpu_name, site), TermGroup.FIXED, TermLevel.ALLOCATED,
                          "Transformer Engine GEMM workspace"))
    if L.moe is not None and L.moe.moe_grouped_gemm and L.transformer_impl == "transformer_engine":
        # TEGroupedMLP's general_grouped_gemm runs on TE's compute streams, one cuBLAS workspace each
        # (Megatron's CI: the grouped-GEMM MoE tests hold 128 MiB more on H100/GB200, 16 MiB on A100)
        n = TE_GEMM_STREAMS
        terms.append(Term("te_grouped_gemm_workspaces", n * te_workspace_bytes(gpu_name, site), TermGroup.FIXED,
                          TermLevel.ALLOCATED, f"{n} Transformer Engine multi-stream grouped-GEMM workspaces"))
    if L.moe is not None and L.moe.moe_token_dispatcher_type == "flex":
        from .layers.moe import deepep_buffer_bytes
        terms.append(Term("deepep_buffer", deepep_buffer_bytes(L, L.moe), TermGroup.FIXED, TermLevel.DEVICE,
                          f"DeepEP's NVLink communication buffer ({L.moe.moe_flex_dispatcher_num_sms} SMs, "
                          f"{L.moe.etp * L.moe.ep} ranks), allocated outside PyTorch's allocator"))
        from .layers.moe import deepep_rdma_buffer_bytes
        rdma = deepep_rdma_buffer_bytes(L, L.moe)
        if rdma:
            terms.append(Term("deepep_rdma_buffer", rdma, TermGroup.FIXED, TermLevel.DEVICE,
                              f"DeepEP's RDMA buffer across {L.moe.etp * L.moe.ep // 8} nodes, in NVSHMEM's symmetric "
                              "heap (NVSHMEM's own reservation beyond it not counted)"))
    if L.tp_comm_overlap:
        from .userbuffers import describe, userbuffer_bytes
        terms.append(Term("tp_comm_userbuffers", userbuffer_bytes(L), TermGroup.FIXED, TermLevel.DEVICE, describe(L)))
    if L.kernels.symmetric_ar_type:
        from .userbuffers import symmetric_ar_bytes
        sym = symmetric_ar_bytes(L)
        if sym:
            terms.append(Term("symmetric_ar_buffer", sym, TermGroup.FIXED, TermLevel.DEVICE,
                              f"TE's symmetric-memory all-reduce ({L.kernels.symmetric_ar_type}) buffer of the row-parallel "
                              f"outputs [{L.seq_length // L.cp * L.micro_batch_size}, {L.hidden_size}], outside "
                              "PyTorch's allocator"))
    nccl, which = nccl_bytes(L, site)
    context = CUDA_CONTEXT_BYTES if site is None else site.cuda_context
    terms.append(Term("cuda_context", context, TermGroup.FIXED, TermLevel.DEVICE, "CUDA context and loaded kernels"))
    if nccl:
        default = site is None or site.nccl_per_communicator == NCCL_CHANNELS * 2 * NCCL_DEFAULT_BUFFSIZE
        per = f"{NCCL_CHANNELS} channels x 2 x NCCL_BUFFSIZE" if default else "the site's NCCL buffers"
        terms.append(Term("nccl_buffers", nccl, TermGroup.FIXED, TermLevel.DEVICE, f"{per} per communicator ({which})"))
    return terms


@lru_cache(maxsize=256)
def dummy_wgrad_shapes(L: Layout, has_output: bool, has_layers: bool = True,
                       kinds: frozenset | None = None, mtp: bool = False) -> frozenset[tuple[int, int]]:
    """Weight shapes for which Transformer Engine keeps a placeholder weight gradient.

    With gradient-accumulation fusion the weight gradient goes straight into megatron's main_grad,
    and autograd gets a dummy ``.grad`` instead (so that megatron DDP's hooks fire on the backward
    thread). TE's ``get_dummy_wgrad`` (transformer_engine/pytorch/module/base.py, read in 2.20.2)
    caches one such tensor per (shape, dtype) for the process lifetime. TE's Linear and
    LayerNormLinear call it (linear_proj/linear_fc2 and linear_qkv/linear_fc1 of megatron's TE spec);
    megatron-core >= 0.14 routes its own column/row-parallel layers to it too whenever TE is
    installed (tensor_parallel/layers.py), which adds the output layer [V/TP, h]. The cache fills
    only with the GEMMs the rank runs: ``kinds``, the layer kinds of the rank's stage (MoE models: a
    stage of dense layers only has no expert shapes; default: every kind of the model). ``mtp``: the stage
    runs the MTP block, whose layers' linears and eh_proj (a column-parallel [2h -> h] linear, bias-free:
    multi_token_prediction.py MultiTokenPredictionLayer.__init__, megatron-core 0.16.1 and 0.19.2) fill it
    too, also on a chunk without decoder layers (a layout ending '|mL')."""
    if not L.fused_wgrad:
        return frozenset()
    if has_output:
        # the layers' shapes (shared with the stages without the output layer), and output_layer's
        return dummy_wgrad_shapes(L, False, has_layers, kinds, mtp) | {(L.padded_vocab_size // L.tp, L.hidden_size)}
    if mtp:
        own = dummy_wgrad_shapes(L, False, has_layers, kinds)
        # the MTP layer (the last decoder layer's kind, params.mtp_layer_kind) and eh_proj's [h/TP, 2h] weight
        mtp_shapes = frozenset(sh for kind, _ in mtp_stack_runs(L) for sh in layer_linear_shapes(L, kind).values())
        return own | mtp_shapes | {(L.hidden_size // L.tp, 2 * L.hidden_size)}
    if has_layers and L.moe is not None:
        # the kinds the stage runs (MoE: the experts' and shared experts' TE linears)
        if kinds is None:
            from ..partition import model_kind_runs
            kinds = frozenset({k for k, _ in model_kind_runs(L)})
        return frozenset({sh for kind in kinds for sh in layer_linear_shapes(L, kind).values()})
    return frozenset(layer_linear_shapes(L).values()) if has_layers else frozenset()


@lru_cache(maxsize=256)
def dummy_wgrad_bytes(L: Layout, has_output: bool, has_layers: bool = True, kinds: frozenset | None = None,
                      mtp: bool = False) -> int:
    return (sum(r * c for r, c in dummy_wgrad_shapes(L, has_output, has_layers, kinds, mtp))
            * L.precision.bytes_of(TensorKind.PARAM))


def p2p_in_flight_bytes(L: Layout) -> tuple[int, int]:
    """The last pipeline send/receive buffer still referenced by an NCCL work object: NCCL keeps the
    tensors of point-to-point operations until its watchdog finds them completed (with
    TORCH_NCCL_AVOID_RECORD_STREAMS=1, as NVIDIA's containers set it; the record-stream path holds
    them the same way otherwise). Megatron's CI shows one such [s/CP, b, h] (/TP under sequence
    parallelism) buffer on the last pipeline rank, besides the retained inputs (core.py). Returns
    (bytes, count)."""
    if L.pp == 1:
        return 0, 0
    return p2p_tensor_bytes(L), 1


def p2p_tensor_bytes(L: Layout) -> int:
    """Bytes of one activation sent between pipeline stages: [s/CP, b, h], /TP under SP."""
    tokens = (L.seq_length // L.cp) * L.micro_batch_size // (L.tp if L.sequence_parallel else 1)
    return tokens * L.hidden_size * L.precision.bytes_of(_ACTIVATION)
