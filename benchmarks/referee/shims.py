"""CPU shims that let real megatron-core (0.16.1) training steps run on a CPU-only torch build.

Rule for every shim: it may change *where* something runs, never *what gets allocated* compared
with the GPU code path that Megatron would take (apex / Transformer Engine installed, fusions off).
Where the CPU path of megatron-core would allocate differently from that GPU path (local fallbacks
for apex kernels, torch's composite RMSNorm, torch's single-tensor Adam), the shim restores the GPU
allocation pattern. Differences that cannot be avoided are listed in README.md.

`install(tracker=None)` applies all shims (idempotent). Each shim carries one comment line naming
the megatron-core call that needs it.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

_INSTALLED = False
_TRACKER = None  # the active LiveBytesTracker, if any (set by install / set_tracker)


def set_tracker(tracker) -> None:
    global _TRACKER
    _TRACKER = tracker


def _register(*tensors):
    """Register tensors created outside the dispatch mode (torch.tensor, fused-kernel outputs)."""
    if _TRACKER is None:
        return
    for t in tensors:
        if isinstance(t, torch.Tensor):
            _TRACKER.track(t, op=getattr(t, "_referee_op", "tensor"))


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, int):
        return True  # a bare device index means a CUDA device in megatron-core
    return False


def _fix_device_kw(kwargs):
    if "device" in kwargs and _is_cuda_device(kwargs["device"]):
        kwargs["device"] = "cpu"
    return kwargs


# ----------------------------------------------------------------------------------------------
# Fused-kernel emulation: run a computation with the tracker switched off and register only its
# outputs, as a single fused CUDA kernel would allocate only its outputs.
# ----------------------------------------------------------------------------------------------
def fused_kernel(fn, *args, **kwargs):
    with _disable_current_modes():
        out = fn(*args, **kwargs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    for o in outs:
        if isinstance(o, torch.Tensor):
            o._referee_op = "fused:" + getattr(fn, "__name__", "kernel")
    _register(*[o for o in outs if isinstance(o, torch.Tensor)])
    return out


# ----------------------------------------------------------------------------------------------
# Norm stand-in (LayerNorm / RMSNorm) with sequence-parallel support.
# GPU path it replaces: apex FusedLayerNorm / TE LayerNorm and RMSNorm / torch._fused_rms_norm on
# CUDA. All of them save for backward: the input (input dtype), the weight (and bias) and fp32
# per-token statistics (mean and rstd for LayerNorm, rstd for RMSNorm); they allocate only their
# outputs (y in input dtype; in backward dgrad in input dtype and wgrad/bgrad in param dtype).
# ----------------------------------------------------------------------------------------------
class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, zero_centered):
        shape = (x.shape[-1],)

        def layer_norm_fwd(x, weight, bias):
            w = weight + 1 if zero_centered else weight
            y, mean, rstd = torch.ops.aten.native_layer_norm(x, shape, w, bias, eps)
            return y, mean.float().view(-1), rstd.float().view(-1)

        y, mean, rstd = fused_kernel(layer_norm_fwd, x, weight, bias)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.zero_centered = zero_centered
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        zc = ctx.zero_centered

        def layer_norm_bwd(dy, x, weight, bias, mean, rstd):
            w = weight + 1 if zc else weight
            stat_shape = x.shape[:-1] + (1,)
            dx, dw, db = torch.ops.aten.native_layer_norm_backward(
                dy.contiguous(), x, (x.shape[-1],), mean.to(x.dtype).view(stat_shape),
                rstd.to(x.dtype).view(stat_shape), w, bias, [True, True, bias is not None],
            )
            return dx, dw.to(weight.dtype), (db.to(bias.dtype) if db is not None else None)

        dx, dw, db = fused_kernel(layer_norm_bwd, dy, x, weight, bias, mean, rstd)
        return dx, dw, db, None, None


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered):
        shape = (x.shape[-1],)

        def rms_norm_fwd(x, weight):
            w = weight + 1 if zero_centered else weight
            y, rstd = torch.ops.aten._fused_rms_norm(x, shape, w, eps)
            return y, rstd.float().view(-1)

        y, rstd = fused_kernel(rms_norm_fwd, x, weight)
        ctx.save_for_backward(x, weight, rstd)
        ctx.zero_centered = zero_centered
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        zc = ctx.zero_centered

        def rms_norm_bwd(dy, x, weight, rstd):
            w = (weight + 1 if zc else weight).float()
            xf = x.float()
            r = rstd.view(x.shape[:-1] + (1,))
            xhat = xf * r
            dyf = dy.float()
            dyw = dyf * w
            dx = r * (dyw - xhat * (dyw * xhat).mean(-1, keepdim=True))
            dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(0)
            return dx.to(x.dtype), dw.to(weight.dtype)

        dx, dw = fused_kernel(rms_norm_bwd, dy, x, weight, rstd)
        return dx, dw, None, None


class CpuFusedNorm(torch.nn.Module):
    """LayerNorm / RMSNorm with the constructor signature of megatron's FusedLayerNorm/TENorm.

    Weight (and bias) carry `sequence_parallel = config.sequence_parallel` as FusedLayerNorm sets
    it, so finalize_model_grads all-reduces their grads over TP when SP is on.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = True,
                 zero_centered_gamma: bool = False, normalization: Optional[str] = None):
        super().__init__()
        self.config = config
        self.normalization = normalization or config.normalization
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"unsupported normalization {self.normalization}")
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.eps = eps
        # Created in fp32 like apex FusedLayerNorm / torch.nn.LayerNorm; Float16Module casts them.
        self.weight = torch.nn.Parameter(torch.empty(hidden_size))
        if self.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.empty(hidden_size))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        sp = bool(config.sequence_parallel)
        setattr(self.weight, "sequence_parallel", sp)
        if self.bias is not None:
            setattr(self.bias, "sequence_parallel", sp)

    def reset_parameters(self):
        with torch.no_grad():
            if self.zero_centered_gamma:
                self.weight.zero_()
            else:
                self.weight.fill_(1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x):
        if self.normalization == "LayerNorm":
            return _LayerNormFn.apply(x, self.weight, self.bias, self.eps, self.zero_centered_gamma)
        return _RMSNormFn.apply(x, self.weight, self.eps, self.zero_centered_gamma)


# ----------------------------------------------------------------------------------------------
# Allocation-free multi_tensor_scale (apex/TE amp_C.multi_tensor_scale writes dst in place).
# ----------------------------------------------------------------------------------------------
def _multi_tensor_scale_inplace(chunk_size, noop_flag, tensor_lists, scale):
    for src, dst in zip(tensor_lists[0], tensor_lists[1]):
        torch.mul(src, scale, out=dst)


# ----------------------------------------------------------------------------------------------
# CPU stand-in for the CUDA RNG (a separate generator so that forking it never touches the CPU
# default generator, as on a GPU).
# ----------------------------------------------------------------------------------------------
_CUDA_GEN = torch.Generator()


def _cuda_get_rng_state(device="cuda"):
    return _CUDA_GEN.get_state()


def _cuda_set_rng_state(new_state, device=-1, graph_safe=False):
    _CUDA_GEN.set_state(new_state)


def _cuda_manual_seed(seed):
    _CUDA_GEN.manual_seed(int(seed))


class _NullCtx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _DummyStream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a, **k):
        return _DummyEvent()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _DummyEvent:
    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def install(tracker=None) -> None:
    """Apply all shims (idempotent). `tracker`: LiveBytesTracker to register untracked creations."""
    global _INSTALLED
    if tracker is not None:
        set_tracker(tracker)
    if _INSTALLED:
        return
    _INSTALLED = True

    # -- torch.cuda device queries ------------------------------------------------------------
    # rotary_pos_embedding.py (inv_freq.to(current_device())), param_and_grad_buffer.py buffers,
    # tensor_parallel/layers.py and mappings.py (device=torch.cuda.current_device()):
    torch.cuda.current_device = lambda: "cpu"
    # p2p_communication.py _communicate / schedules call torch.cuda.synchronize():
    torch.cuda.synchronize = lambda *a, **k: None
    # training.py-style empty_cache calls and DDP.free_overlap_buffers:
    torch.cuda.empty_cache = lambda *a, **k: None

    # -- CUDA streams / events: no-op stand-ins (CPU work is synchronous) -----------------------
    # distributed_data_parallel.py (num_distributed_optimizer_instances > 1) creates a
    # communication torch.cuda.Stream; param_and_grad_buffer.py enters torch.cuda.stream(...) and
    # calls wait_stream / torch.cuda.default_stream():
    torch.cuda.Stream = _DummyStream
    torch.cuda.Event = _DummyEvent
    torch.cuda.stream = lambda s=None: _NullCtx()
    torch.cuda.current_stream = lambda *a, **k: _DummyStream()
    torch.cuda.default_stream = lambda *a, **k: _DummyStream()
    # --overlap-moe-expert-parallel-comm (pipeline_parallel/utils.py ScheduleNode, fine_grained_callables.py):
    # NVTX ranges around each node and record_stream of tensors handed between the compute and comm
    # streams; neither allocates
    torch.cuda.nvtx.range_push = lambda *a, **k: None
    torch.cuda.nvtx.range_pop = lambda *a, **k: None
    torch.Tensor.record_stream = lambda self, *a, **k: None

    # -- Tensor.cuda / Module.cuda -------------------------------------------------------------
    # get_model's model_module.cuda(...), language_module.py weight.data.cuda(), data .cuda():
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self

    # -- hard-coded device="cuda" in factories (also reached in recomputation during backward) ---
    # transformer/utils.py get_default_causal_mask (torch.ones(..., device="cuda")), optimizer.py
    # and clip_grads.py (torch.tensor/zeros(..., device='cuda')), utils.local_multi_tensor_l2_norm:
    def _wrap_factory(name, register=False):
        orig = getattr(torch, name)

        @functools.wraps(orig)
        def f(*args, **kwargs):
            out = orig(*args, **_fix_device_kw(kwargs))
            if register and isinstance(out, torch.Tensor):
                out._referee_op = name  # torch.tensor() does not pass the Python dispatch key
                _register(out)
            return out

        setattr(torch, name, f)

    for _n in ("empty", "zeros", "ones", "full", "arange", "rand", "randn", "randint", "eye",
               "empty_strided", "linspace", "zeros_like", "ones_like", "empty_like", "full_like",
               "rand_like", "randn_like"):
        _wrap_factory(_n)
    for _n in ("tensor", "as_tensor"):
        _wrap_factory(_n, register=True)

    # Tensor.to("cuda") / Tensor.to(device=torch.device("cuda")):
    _orig_to = torch.Tensor.to

    def _to(self, *args, **kwargs):
        args = tuple("cpu" if _is_cuda_device(a) and not isinstance(a, int) else a for a in args)
        return _orig_to(self, *args, **_fix_device_kw(kwargs))

    torch.Tensor.to = _to

    # -- Tensor.type() strings -----------------------------------------------------------------
    # Float16OptimizerWithFloat16Params / DistributedOptimizer check
    # param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor'] ('torch.cuda.FloatTensor'):
    _orig_type = torch.Tensor.type

    def _type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            s = _orig_type(self)
            if s.startswith("torch.") and not s.startswith("torch.cuda."):
                s = "torch.cuda." + s[len("torch."):]
            return s
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = "torch." + dtype[len("torch.cuda."):]
        return _orig_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = _type

    # -- CUDA RNG -> CPU generator ---------------------------------------------------------------
    # tensor_parallel/random.py CudaRNGStatesTracker.add/fork, model_parallel_cuda_manual_seed,
    # CheckpointFunction (_get_all_rng_states/_set_all_rng_states):
    torch.cuda.get_rng_state = _cuda_get_rng_state
    torch.cuda.random.get_rng_state = _cuda_get_rng_state
    torch.cuda.set_rng_state = lambda s, device="cuda": _CUDA_GEN.set_state(s)
    torch.cuda.manual_seed = _cuda_manual_seed
    torch.cuda.manual_seed_all = _cuda_manual_seed
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: _cuda_get_rng_state()
    mrandom._set_cuda_rng_state = _cuda_set_rng_state

    # -- norms -----------------------------------------------------------------------------------
    # get_gpt_layer_local_spec -> LocalSpecProvider.layer_norm (WrappedTorchNorm refuses SP and
    # torch's CPU RMSNorm is a composite saving fp32 copies) and transformer_block.LayerNormImpl
    # (final norm): use the fused-kernel stand-in.
    import megatron.core.models.backends as mbackends
    import megatron.core.models.gpt.gpt_layer_specs as mspecs
    import megatron.core.transformer.transformer_block as mblock

    mbackends.LocalSpecProvider.layer_norm = lambda self, rms_norm=False, for_qk=False, **_: CpuFusedNorm
    mbackends.LNImpl = CpuFusedNorm
    mspecs.LNImpl = CpuFusedNorm
    mblock.LayerNormImpl = CpuFusedNorm
    # heterogeneous layer specs pick their norms themselves (LNImpl, WrappedTorchNorm for RMSNorm)
    import megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs as mhet
    mhet.LNImpl = mhet.WrappedTorchNorm = CpuFusedNorm

    # -- multi_tensor_scale local fallback ---------------------------------------------------------
    # optimizer.py _multi_tensor_copy_this_to_that and clip_grads.clip_grad_by_total_norm_fp32 use
    # megatron.core.utils.local_multi_tensor_scale (dst.copy_(src * scale): a temporary per
    # tensor) when apex/TE are absent; amp_C's kernel allocates nothing:
    import megatron.core.optimizer.clip_grads as mclip
    import megatron.core.optimizer.optimizer as mopt

    mclip.multi_tensor_scale_impl = _multi_tensor_scale_inplace
    mopt.multi_tensor_scale_impl = _multi_tensor_scale_inplace

    # -- asynchronous point-to-point sends ------------------------------------------------------
    # p2p_communication._p2p_ops (interleaved schedule, overlap_p2p_comm) isends an output and the
    # schedule then frees it with deallocate_output_tensor (out.data = torch.empty(1)) before the
    # send is waited for. On a GPU the send is ordered on the CUDA stream; gloo reads the buffer
    # later from its own thread, so it would send freed memory. Send an untracked snapshot instead
    # (no GPU counterpart, so it is not counted) and keep it until the send has completed.
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    _orig_isend = c10d.isend

    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        with _disable_current_modes():
            snap = tensor.detach().clone()
        work = _orig_isend(snap, dst=dst, group=group, tag=tag, group_dst=group_dst)
        _PENDING_SENDS.append((work, snap))
        _reap_sends()
        return work

    c10d.isend = isend
    dist.isend = isend

    _install_moe_shims()


# ----------------------------------------------------------------------------------------------
# Mixture of experts (megatron-core 0.16.1, local spec: SequentialMLP experts, TopKRouter).
# ----------------------------------------------------------------------------------------------
def _te_general_gemm(A, B, out_dtype=None, layout="TN", out=None, bias=None, grad=False):
    """Stand-in for megatron's te_general_gemm (TE general_gemm: one cuBLAS call that writes only
    its output, in `out_dtype`, from inputs of any precision). Layouts as TE names them: "TN" -> B·Aᵀ
    (+bias), "NN" -> B·A, "NT" -> Bᵀ·A."""

    def general_gemm(A, B, bias):
        a, b = A.float(), B.float()
        if layout == "TN":
            y = b @ a.t()
        elif layout == "NN":
            y = b @ a
        elif layout == "NT":
            y = b.t() @ a
        else:
            raise ValueError(f"layout {layout}")
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype or B.dtype)

    assert out is None, "the referee's te_general_gemm stand-in does not write into `out`"
    return [fused_kernel(general_gemm, A, B, bias), None, None, None]


def _swiglu(y):
    a, b = y.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(a) * b


def _swiglu_grad(g, y):
    a, b = y.float().chunk(2, dim=-1)
    s = torch.sigmoid(a)
    g = g.float()
    return torch.cat((g * s * (1 + a * (1 - s)) * b, g * a * s), dim=-1)


def _fused_swiglu_kernels():
    """Eager versions of megatron/core/fusions/fused_bias_swiglu.py's jit-fused functions, run as
    one fused kernel each (tracker off inside, only the outputs registered), as the compiled GPU
    kernels allocate only their outputs."""

    def swiglu_fwd(y):
        return _swiglu(y).to(y.dtype)

    def bias_swiglu_fwd(y, bias):
        return _swiglu(y + bias).to(y.dtype)

    def weighted_swiglu_fwd(y, w):
        return (_swiglu(y) * w.float()).to(y.dtype)

    def swiglu_bwd(g, y):
        return _swiglu_grad(g, y).to(y.dtype)

    def bias_swiglu_bwd(g, y, bias):
        return _swiglu_grad(g, y + bias).to(y.dtype)

    def weighted_swiglu_bwd(g, y, w):
        dy = _swiglu_grad(g.float() * w.float(), y)
        dw = (_swiglu(y) * g.float()).sum(dim=-1, keepdim=True)
        return dy.to(y.dtype), dw.to(w.dtype)

    def swiglu(y):
        return fused_kernel(swiglu_fwd, y)

    def bias_swiglu(y, bias):
        return fused_kernel(bias_swiglu_fwd, y, bias)

    def weighted_swiglu(y, weights):
        return fused_kernel(weighted_swiglu_fwd, y, weights)

    def swiglu_back(g, y):
        return fused_kernel(swiglu_bwd, g, y)

    def bias_swiglu_back(g, y, bias):
        return fused_kernel(bias_swiglu_bwd, g, y, bias)

    def weighted_swiglu_back(g, y, weights):
        return fused_kernel(weighted_swiglu_bwd, g, y, weights)

    return dict(swiglu=swiglu, bias_swiglu=bias_swiglu, weighted_swiglu=weighted_swiglu,
                swiglu_back=swiglu_back, bias_swiglu_back=bias_swiglu_back,
                weighted_swiglu_back=weighted_swiglu_back)


class _OutputGateFn(torch.autograd.Function):
    """Attention._apply_output_gate (``x * sigmoid(gate)``, @jit_fuser = torch.compile on GPUs) as the compiled
    kernel runs it: one fused kernel allocating only its output, keeping its two inputs for backward (what
    torch.compile's partitioner saves; the gate is a view of linear_qkv's output). Eager code would keep the
    fp32 sigmoid too, which is what the referee measured before this shim."""

    @staticmethod
    def forward(ctx, x, gate):
        ctx.save_for_backward(x, gate)
        return fused_kernel(_gate_fwd, x, gate)

    @staticmethod
    def backward(ctx, g):
        x, gate = ctx.saved_tensors
        return fused_kernel(_gate_bwd, g, x, gate)


def _gate_fwd(x, gate):
    return (x * torch.sigmoid(gate.contiguous().view(*x.shape).float())).to(x.dtype)


def _gate_bwd(g, x, gate):
    s = torch.sigmoid(gate.contiguous().view(*x.shape).float())
    gf = g.float()
    dx = (gf * s).to(x.dtype)
    dgate = (gf * x.float() * s * (1 - s)).to(gate.dtype).view(gate.shape)
    return dx, dgate


def _maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
    """moe_utils.maybe_move_tensor_to_cpu for a run where every tensor stands for a GPU tensor: the
    host copy (numpy for the all-to-all split sizes) is made untracked, as host memory is not GPU
    memory. Megatron's version copies only `tensor.is_cuda` tensors, so on CPU the split sizes stay
    tensors and `all_to_all_single` refuses them."""
    if not torch.is_tensor(tensor):
        return tensor
    with _disable_current_modes():
        host = tensor.detach().clone()
    return host.numpy() if as_numpy else host


def _uneven_list_collectives() -> None:
    """all_gather into / reduce_scatter from lists of unequal tensors, which gloo refuses.

    megatron's `_gather_along_first_dim` / `_reduce_scatter_along_first_dim` with split sizes (the
    alltoall dispatcher's gather and reduce-scatter over the expert-TP group, ETP > 1) pass lists whose
    tensors differ in rows. NCCL runs them as grouped broadcasts / reduces straight into and out of the
    caller's tensors; here the data moves through untracked padded copies and lands in the same caller
    tensors, so nothing extra is counted."""
    import torch.distributed as dist

    orig_all_gather, orig_reduce_scatter = dist.all_gather, dist.reduce_scatter

    def uneven(tensors):
        return len({tuple(t.shape) for t in tensors}) > 1

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if not uneven(tensor_list) or async_op:
            return orig_all_gather(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        with _disable_current_modes():
            send = tensor.new_zeros((rows,) + tuple(tensor.shape[1:]))
            send[: tensor.shape[0]].copy_(tensor)
            recv = [torch.empty_like(send) for _ in tensor_list]
            orig_all_gather(recv, send, group=group)
            for out, got in zip(tensor_list, recv):
                out.copy_(got[: out.shape[0]])

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not uneven(input_list) or async_op:
            return orig_reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
        with _disable_current_modes():
            full = torch.cat([t.contiguous() for t in input_list])
            dist.all_reduce(full, op=op, group=group)
            start = sum(t.shape[0] for t in input_list[: dist.get_rank(group)])
            output.copy_(full[start: start + output.shape[0]])

    dist.all_gather = all_gather
    dist.reduce_scatter = reduce_scatter


def _install_moe_shims() -> None:
    import megatron.core.fusions.fused_bias_swiglu as mswiglu
    import megatron.core.transformer.attention as mattention
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as mdispatch

    # MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize (device-to-host copy of the split sizes):
    mdispatch.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu
    # mappings._gather_along_first_dim / _reduce_scatter_along_first_dim with split sizes (ETP > 1):
    _uneven_list_collectives()

    # moe_utils.RouterGatingLinearFunction tests `te_general_gemm is not None`, a name 0.16.1 binds
    # only when TE imports (NameError without TE); Megatron MoE on a GPU runs TE's gemm:
    moe_utils.te_general_gemm = _te_general_gemm
    # fused_bias_swiglu's @jit_fuser (torch.compile) functions, used with --bias-swiglu-fusion (the
    # GPU default) by MLP, SharedExpertMLP and the experts' WeightedSwiGLUFunction:
    for name, fn in _fused_swiglu_kernels().items():
        setattr(mswiglu, name, fn)
    # Attention._apply_output_gate's @jit_fuser (torch.compile; under the referee's dispatch mode it runs
    # eagerly), used with --attention-output-gate:
    mattention.Attention._apply_output_gate = lambda self, x, gate: _OutputGateFn.apply(x, gate)


# Snapshot sends not yet seen completed. Send works megatron never waits for are not marked completed by
# gloo, so their snapshots stay until the process exits (never wait() on them here: a second wait() on a
# gloo send blocks forever).
_PENDING_SENDS: list = []


def _reap_sends() -> None:
    still = []
    for work, snap in _PENDING_SENDS:
        try:
            done = work is None or work.is_completed()
        except Exception:
            done = False
        if not done:
            still.append((work, snap))
    _PENDING_SENDS[:] = still


def configure_torch_optimizer(optimizer, kernel: str = "fused") -> None:
    """Choose the torch.optim kernel used under megatron's optimizer wrapper.

    megatron-core falls back to torch.optim.Adam/AdamW/SGD when TE/apex are absent; on CPU torch
    then picks its single-tensor loop, which allocates per-parameter temporaries that neither TE's
    FusedAdam (what Megatron uses on a GPU) nor apex allocate. kernel="fused" (default) selects
    torch's fused CPU kernel (no temporaries, like TE/apex FusedAdam); "foreach" reproduces torch's
    CUDA default without TE/apex (whole-list temporaries); "single" leaves torch's CPU default.
    """
    # ChainedOptimizer (dense + expert optimizers with MoE) refuses `.optimizer` when it holds several
    if hasattr(optimizer, "chained_optimizers"):
        opts = [getattr(o, "optimizer", o) for o in optimizer.chained_optimizers]
    else:
        inner = getattr(optimizer, "optimizer", optimizer)
        opts = [inner] if inner is not None else []
    for opt in opts:
        if opt is None or not isinstance(opt, torch.optim.Optimizer):
            continue
        for group in [opt.defaults] + list(opt.param_groups):
            if kernel == "fused":
                group["fused"] = True
                group["foreach"] = False
            elif kernel == "foreach":
                group["fused"] = None if "fused" in group and group["fused"] is None else False
                group["foreach"] = True
            elif kernel == "single":
                group["fused"] = None if "fused" in group and group["fused"] is None else False
                group["foreach"] = False
            else:
                raise ValueError(kernel)


# ----------------------------------------------------------------------------------------------
# Megatron-FSDP (distributed/fsdp/mcore_fsdp_adapter.py, megatron_fsdp.py): MegatronFSDP.__init__
# builds torch.device(f"cuda:{torch.cuda.current_device()}") to compare with its device, which
# the "cpu" answer above cannot form; the device index is 0 while the wrapper is built, and the
# buffers go to the CPU device passed in. Needs einops (its device-mesh helpers).
# ----------------------------------------------------------------------------------------------
def megatron_fsdp(config, ddp_config, module, disable_bucketing: bool = False):
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    # core 0.16.1 only: 0.19.2's adapter tells TE modules by class name (_detect_parallelism_type)
    if hasattr(mcore_fsdp_adapter, "TELinear") and not isinstance(mcore_fsdp_adapter.TELinear, type):
        # without Transformer Engine the adapter's TP check (_fix_tensor_parallel_attributes, TP > 1) tests
        # isinstance against megatron's TE stand-in (not a class); no module of the local spec is a TELinear,
        # and the attributes it sets only describe checkpoint DTensors: a class nothing is an instance of
        mcore_fsdp_adapter.TELinear = type("NoTELinear", (), {})

    # gradient_reduce_preprocessing: gloo has no PREMUL_SUM; the unfused path scales in place (mul_)
    # and sums, allocating nothing more
    ddp_config.gradient_reduce_div_fusion = False
    current = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    try:
        return FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=module,
                                        disable_bucketing=disable_bucketing, device=torch.device("cpu"))
    finally:
        torch.cuda.current_device = current
