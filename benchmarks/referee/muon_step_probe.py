"""Measure the working set of Muon's optimizer step on CPU and print it next to memguard's formula.

    PYTHONPATH=. python benchmarks/referee/muon_step_probe.py

Needs megatron-core 0.19.2 (``TensorParallelMuon`` in megatron/core/optimizer/emerging_optimizers.py) and
the ``emerging_optimizers`` package it imports (PyPI ``emerging-optimizers``; 0.3.0 was measured, with its
dependency ``absl-py``). One parameter with a gradient; the first step creates the momentum, the second is
measured with the referee's live-bytes tracker (every storage an aten op creates, freed when it dies). The
parameter, gradient and momentum exist before, so the peak is the step's own temporaries. The TP modes
(``--muon-tp-mode duplicated`` / ``distributed``) run on two CPU ranks (gloo), rank 0 measured.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_memguard.estimator.muon import NsSpec, orthogonalize_peak, qkv_orthogonalize_peak  # noqa: E402

CASES = [
    # (label, shape, split shapes or None, nesterov, --muon-fp32-matmul-prec, memguard's bytes)
    ("linear_qkv, 8 query groups, split", (1536, 512), [64, 64, 64], False, "medium",
     lambda: qkv_orthogonalize_peak(8, (64, 64, 64), 512, NsSpec())),
    ("linear_qkv, 1 query group, split", (192, 512), [64, 64, 64], False, "medium",
     lambda: qkv_orthogonalize_peak(1, (64, 64, 64), 512, NsSpec())),
    ("linear_qkv, GQA 4:1, split", (8 * 384, 512), [256, 64, 64], False, "medium",
     lambda: qkv_orthogonalize_peak(8, (256, 64, 64), 512, NsSpec())),
    ("fc1 [1024, 512]", (1024, 512), None, False, "medium", lambda: orthogonalize_peak(1024, 512, NsSpec())),
    ("fc2 [512, 1024]", (512, 1024), None, False, "medium", lambda: orthogonalize_peak(512, 1024, NsSpec())),
    ("square [512, 512], fp32 Newton-Schulz", (512, 512), None, False, "highest",
     lambda: orthogonalize_peak(512, 512, NsSpec(fp32_matmul_prec="highest"))),
    ("fc1 [1024, 512], Nesterov", (1024, 512), None, True, "medium",
     lambda: orthogonalize_peak(1024, 512, NsSpec()) + 4 * 1024 * 512),
]


def second_step_peak(opt, p) -> int:
    """The live bytes the optimizer's second step adds at its peak (the first step makes the momentum)."""
    import torch

    from benchmarks.referee.livebytes import LiveBytesTracker
    p.grad = torch.randn(*p.shape)
    opt.step()
    p.grad = torch.randn(*p.shape)
    tr = LiveBytesTracker()
    with tr:
        opt.step()
    return tr.peak


def measure(shape, split, nesterov, prec) -> int:
    import torch
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    p = torch.nn.Parameter(torch.randn(*shape))
    if split:
        p.is_qkv, p.qkv_split_shapes = True, split
    opt = TensorParallelMuon([p], lr=0.1, momentum=0.9, nesterov=nesterov, split_qkv=bool(split),
                             is_qkv_fn=lambda q: getattr(q, "is_qkv", False), qkv_split_shapes=split,
                             fp32_matmul_prec=prec, extra_scale_factor=0.2)
    return second_step_peak(opt, p)


TP_CASES = [
    # (--muon-tp-mode, this rank's shard, partition_dim) on a TP group of 2
    ("duplicated", (512, 512), 0), ("duplicated", (512, 256), 1), ("duplicated", (64, 1024), 1),
    ("distributed", (512, 512), 0), ("distributed", (256, 1024), 1), ("distributed", (64, 1024), 0),
]


def _tp_worker(rank, world, port, mode, shape, pdim, q):  # pragma: no cover - runs in a spawned process
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    pgc = SimpleNamespace(tp=group, expt_tp=group, gtp_remat=None, expt_gtp_remat=None)
    p = torch.nn.Parameter(torch.randn(*shape))
    p.partition_dim = pdim
    opt = TensorParallelMuon([p], lr=0.1, momentum=0.9, nesterov=False, split_qkv=False, pg_collection=pgc,
                             tp_mode=mode, extra_scale_factor=0.2)
    peak = second_step_peak(opt, p)
    if rank == 0:
        q.put(peak)
    dist.destroy_process_group()


def measure_tp(mode, shape, pdim, port) -> int:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_tp_worker, args=(r, 2, port, mode, shape, pdim, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = q.get(timeout=300)
    for p in procs:
        p.join()
    return got


def main() -> int:
    try:
        from megatron.core.optimizer.emerging_optimizers import HAVE_EMERGING_OPTIMIZERS
    except ImportError as e:
        print(f"megatron-core 0.19 is needed: {e}")
        return 0
    if not HAVE_EMERGING_OPTIMIZERS:
        print("emerging_optimizers is not importable (pip install emerging-optimizers absl-py): nothing measured")
        return 0
    for label, shape, split, nesterov, prec, model in CASES:
        got, want = measure(shape, split, nesterov, prec), model()
        print(f"{label:40s} measured {got:>12,d} B  memguard {want:>12,d} B  {'ok' if got == want else 'DIFFERS'}")
    for i, (mode, shape, pdim) in enumerate(TP_CASES):
        got = measure_tp(mode, shape, pdim, 29650 + i)
        want = orthogonalize_peak(*shape, NsSpec(tp_mode=mode), group=2, partition_dim=pdim)
        label = f"TP 2 {mode}, shard {list(shape)}, partition_dim {pdim}"
        print(f"{label:40s} measured {got:>12,d} B  memguard {want:>12,d} B  {'ok' if got == want else 'DIFFERS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
