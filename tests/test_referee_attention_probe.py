"""TE's unfused attention on fp32 scores against megatron-core's unfused attention measured on CPU.

Transformer Engine's UnfusedDotProductAttention (2.11 / 2.20.2 backends.py, softmax.py) cannot run on a CPU, but
on fp32 scores its FusedScaleMaskSoftmax takes torch's path (its kernel needs fp16/bf16): masked_fill_ and torch's
softmax, the ops megatron-core 0.16.1's local DotProductAttention runs. benchmarks/referee/attention_probe.py
measures what those keep (live bytes after the forward, one process per probe)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from benchmarks.referee.run import unsupported_reason  # noqa: E402

pytestmark = pytest.mark.skipif(unsupported_reason() is not None, reason=str(unsupported_reason()))

from megatron_memguard import layout_from_flags  # noqa: E402
from megatron_memguard.estimator.activations import layer_activations  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S, B, HEADS, D = 64, 2, 4, 16


def _probe(batch_mask: bool) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.referee.attention_probe", "--seq", str(S), "--batch", str(B),
           "--heads", str(HEADS), "--head-dim", str(D)] + (["--batch-mask"] if batch_mask else [])
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True).stdout
    return {(r["op"], r["dtype"]): r["bytes"] for r in json.loads(out.strip().splitlines()[-1])}


def _te_unfused(batch_mask: bool) -> dict:
    flags = ["--num-layers", "2", "--hidden-size", str(HEADS * D), "--num-attention-heads", str(HEADS),
             "--seq-length", str(S), "--max-position-embeddings", str(S), "--micro-batch-size", str(B),
             "--global-batch-size", str(B), "--vocab-size", "128", "--attention-dropout", "0",
             "--attention-backend", "unfused"]
    return layer_activations(layout_from_flags(flags, world_size=1), batch_mask).saved


@pytest.mark.parametrize("batch_mask", [False, True])
def test_fp32_probs_and_mask_match_the_measured_torch_path(batch_mask):
    measured = _probe(batch_mask)
    te = _te_unfused(batch_mask)
    # the fp32 softmax output: b x heads x s x s x 4 B = 128 KiB, measured and estimated
    assert measured[("_softmax", "float32")] == te["attention_probs"] == B * HEADS * S * S * 4
    if batch_mask:
        # megatron keeps the batch's own mask (made before, not counted); TE ORs it into a new [b, 1, s, s] one
        assert ("_to_copy", "bool") not in measured and te["causal_mask"] == B * S * S
    else:
        # without a batch mask both keep one [s, s] bool causal mask: 4 KiB
        assert measured[("_to_copy", "bool")] == te["causal_mask"] == S * S
    # nothing else is kept by the core attention (q, k, v are the caller's)
    assert sum(measured.values()) == B * HEADS * S * S * 4 + (0 if batch_mask else S * S)
