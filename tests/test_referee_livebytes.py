"""Unit tests of the live-bytes tracker (no megatron needed)."""

import gc

import pytest
import torch

from benchmarks.referee.livebytes import LiveBytesTracker


def test_alloc_free_exact_bytes():
    tr = LiveBytesTracker()
    with tr:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 B
        b = torch.zeros(10, 10, dtype=torch.bfloat16)  # 200 B
        assert tr.current == 4200 and tr.peak == 4200
        v = a.view(10, 100)  # a view allocates nothing
        a.add_(1.0)  # in-place allocates nothing
        assert tr.current == 4200
        del a
        gc.collect()
        assert tr.current == 4200  # the view keeps the storage alive
        del v
        assert tr.current == 200
        c = torch.ones(5, dtype=torch.int64)  # 40 B
        assert tr.current == 240 and tr.peak == 4200
        del b, c
        assert tr.current == 0
    assert tr.peak == 4200


def test_peak_and_regions_and_dump():
    tr = LiveBytesTracker()
    with tr:
        keep = torch.empty(256, dtype=torch.float32)  # 1024 B
        with tr.region("r"):
            tr.set_phase("work")
            t1 = torch.empty(1024, dtype=torch.float32)  # 4096 B
            t2 = t1 * 2  # 4096 B
            del t1
            t3 = torch.empty(512, dtype=torch.bfloat16)  # 1024 B
            del t2, t3
        res = tr.region_result("r")
        assert res["start_bytes"] == 1024
        assert res["peak_bytes"] == 1024 + 4096 + 4096
        assert res["end_bytes"] == 1024
        assert res["peak_phase"] == "work"
        rows = tr.dump(res["peak_seq"])
        got = {(r["op"], r["dtype"], tuple(r["shape"])): r["bytes"] for r in rows}
        assert got == {("empty", "float32", (256,)): 1024, ("empty", "float32", (1024,)): 4096,
                       ("mul", "float32", (1024,)): 4096}
        del keep
    assert tr.current == 0


def test_backward_and_resize_are_tracked():
    tr = LiveBytesTracker()
    with tr:
        x = torch.randn(64, 64, requires_grad=True)  # 16384 B
        w = torch.randn(64, 64, requires_grad=True)  # 16384 B
        y = (x @ w).relu().sum()
        y.backward()
        # grads were created inside the mode by the autograd engine
        assert x.grad is not None
        live = tr.current
        assert live >= 4 * 16384
        del y
        x.grad = None
        w.grad = None
        assert tr.current == 2 * 16384
        t = torch.empty(10, dtype=torch.float32)
        t.resize_(1000)
        assert tr.current == 2 * 16384 + 4000
        del t, x, w
    assert tr.current == 0


def test_a_storages_own_resize_is_tracked():
    """megatron frees tensors whose Python objects live on with ``untyped_storage().resize_(0)`` (the combined 1F1B
    schedule's node inputs, pipeline_parallel/utils.py ScheduleNode with free_input) and Megatron-FSDP with
    TypedStorage ``_resize_`` (_free_storage / _alloc_storage): storage methods that no aten op reports. A GPU's
    caching allocator frees and allocates the block; so does the tracker now (it kept the bytes before)."""
    tr = LiveBytesTracker()
    with tr:
        x = torch.empty(1000, dtype=torch.float32)              # 4000 B
        x.untyped_storage().resize_(0)
        assert tr.current == 0
        x._typed_storage()._resize_(500)                        # 500 float32 again: 2000 B
        assert tr.current == 2000
        y = torch.empty(0)                                      # made empty (0 B: not tracked), then grown
        y.untyped_storage().resize_(4096)
        assert tr.current == 2000 + 4096
        del x, y
        assert tr.current == 0
    assert tr.peak == 6096            # 2000 + 4096 (the first 4000 B were freed before)
    # (the patch is the mode's only: outside it the storage method is torch's own again)
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_


def _bf16_products():
    """A bf16 linear layer's forward and backward (addmm, mm) and an attention's batched products (baddbmm, bmm)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g).bfloat16().requires_grad_()
    w = torch.randn(16, 32, generator=g).bfloat16().requires_grad_()
    b = torch.randn(16, generator=g).bfloat16()
    q = torch.randn(4, 64, 8, generator=g).bfloat16()
    k = torch.randn(4, 8, 64, generator=g).bfloat16()
    y = torch.nn.functional.linear(x, w, b)            # addmm [64, 16]
    y.sum().backward()                                  # mm: dx [64, 32], dw [16, 32]
    s = torch.baddbmm(torch.zeros(4, 64, 64, dtype=torch.bfloat16), q, k, alpha=0.5)   # [4, 64, 64]
    o = torch.bmm(s, q)                                 # [4, 64, 8]
    return (q, k), (y, x.grad, w.grad, s, o)


def test_fp32_products_keep_every_storage_of_the_bf16_kernels():
    """bf16 products computed in fp32 and rounded once (the referee's default) make the same storages, op by op, as
    the bf16 kernels: addmm's [64, 16] bf16 is 64 x 16 x 2 = 2048 B, baddbmm's [4, 64, 64] 32768 B, bmm's [4, 64, 8]
    4096 B, the weight gradient's mm [16, 32] 1024 B; the values are the fp32 products rounded to bf16."""
    runs = {}
    for fp32 in (False, True):
        tr = LiveBytesTracker(fp32_matmul=fp32)
        with tr:
            inputs, out = _bf16_products()
        runs[fp32] = ([tuple(r[2:6]) for r in tr.records], tr.peak, inputs, out)
    assert runs[True][:2] == runs[False][:2]
    made = {(op, shape): n for n, op, dtype, shape in runs[True][0] if dtype == "bfloat16"}
    assert made[("addmm", (64, 16))] == 2048 and made[("baddbmm", (4, 64, 64))] == 32768
    assert made[("bmm", (4, 64, 8))] == 4096 and made[("mm", (16, 32))] == 1024
    (q, k), (y, dx, dw, s, o) = runs[True][2:]
    assert torch.equal(o, torch.bmm(s.float(), q.float()).bfloat16())
    assert torch.equal(s, (0.5 * torch.bmm(q.float(), k.float())).bfloat16())
    # and within bf16's rounding of what the bf16 kernels give
    for a, b in zip(runs[True][3], runs[False][3]):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=2 ** -7)


def test_exact_bf16_switch(monkeypatch):
    """MEMGUARD_REFEREE_EXACT_BF16=1 keeps the bf16 kernels; another value is refused by name."""
    monkeypatch.setenv("MEMGUARD_REFEREE_EXACT_BF16", "1")
    assert LiveBytesTracker().fp32_matmul is False
    monkeypatch.setenv("MEMGUARD_REFEREE_EXACT_BF16", "0")
    assert LiveBytesTracker().fp32_matmul is True
    monkeypatch.setenv("MEMGUARD_REFEREE_EXACT_BF16", "yes")
    with pytest.raises(ValueError, match="MEMGUARD_REFEREE_EXACT_BF16='yes'"):
        LiveBytesTracker()
