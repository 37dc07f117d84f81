"""Minimal CPU shims so that real megatron-core training steps run on a CPU-only torch build.

From ../../../shared/reference/cpu-megatron.md: current_device -> "cpu", device="cuda" factories
redirected, Tensor/Module.cuda() no-ops, CUDA type strings for the optimizer's dtype checks, a CPU
generator standing in for the CUDA RNG, synchronize() a no-op. They change where tensors live, not
what megatron-core allocates. (benchmarks/referee/shims.py on the referee branch is the full version
with allocation-faithful norms and fused Adam; these tests only need training to run.)
"""
import functools

import torch

_INSTALLED = False
_CUDA_GEN = torch.Generator()


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    torch.cuda.current_device = lambda: "cpu"
    # megatron-core falls back to torch.optim.Adam/AdamW without TE/apex; on CPU torch would run its
    # per-tensor loop with temporaries that TE's FusedAdam (what Megatron uses on GPUs) does not
    # allocate. The fused CPU kernel behaves like FusedAdam (the CPU referee's convention too).
    for name in ("Adam", "AdamW"):
        base = getattr(torch.optim, name)
        fused_cls = type(name, (base,), {"__init__": lambda self, *a, _b=base, **k: _b.__init__(self, *a, **{**k, "fused": True, "foreach": False})})
        setattr(torch.optim, name, fused_cls)
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self

    def wrap(name):
        orig = getattr(torch, name)

        @functools.wraps(orig)
        def f(*args, **kwargs):
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return orig(*args, **kwargs)
        setattr(torch, name, f)

    for name in ("empty", "zeros", "ones", "full", "arange", "rand", "randn", "randint", "eye", "tensor", "as_tensor",
                 "empty_strided", "linspace", "zeros_like", "ones_like", "empty_like", "full_like"):
        wrap(name)

    orig_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        args = tuple("cpu" if (_is_cuda(a) and not isinstance(a, int)) else a for a in args)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return orig_to(self, *args, **kwargs)
    torch.Tensor.to = to

    orig_type = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            s = orig_type(self)
            return "torch.cuda." + s[len("torch."):] if s.startswith("torch.") and not s.startswith("torch.cuda.") else s
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = "torch." + dtype[len("torch.cuda."):]
        return orig_type(self, dtype, non_blocking, **kwargs)
    torch.Tensor.type = type_

    torch.cuda.get_rng_state = lambda device="cuda": _CUDA_GEN.get_state()
    torch.cuda.set_rng_state = lambda s, device="cuda": _CUDA_GEN.set_state(s)
    torch.cuda.manual_seed = lambda seed: _CUDA_GEN.manual_seed(int(seed))
    torch.cuda.manual_seed_all = torch.cuda.manual_seed
    import megatron.core.tensor_parallel.random as mrandom
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: _CUDA_GEN.get_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: _CUDA_GEN.set_state(new_state)
