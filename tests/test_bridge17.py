"""Regressions of issue bridge17 that run without Megatron-Bridge (tests/test_bridge_real.py holds the same readings
against the real Bridge 0.6.2): Bridge flags given another value than true / false are read by their truth, a
comm_overlap.tp_comm_overlap that Bridge's `is True` check lets through is a problem naming the key, and the
overlapped parameter gather Bridge runs without overlapped gradient reduction is estimated."""
from __future__ import annotations

import pytest

from fuzz_util import run_memguard
from test_readers_bridge import FLAT

BRIDGE = ["estimate", "--config", "c.yaml", "--gpus", "8"]
S = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
     "--micro-batch-size 1 --global-batch-size 16 --tokenizer-type NullTokenizer --vocab-size 1000 --bf16").split()


@pytest.mark.parametrize("value, on", [("'false'", True), ("no", True), ("2", True), ("0", False), ("''", False)])
def test_a_model_flag_is_its_truth_with_a_warning(value, on):
    # FLAT: TP 2 with sequence parallelism; model.sequence_parallel='false' is on in Bridge (a non-empty string)
    o = run_memguard(["validate", "c.yaml", "--gpus", "8", f"model.sequence_parallel={value}", "--json"],
                     {"c.yaml": FLAT})
    assert o.code == 0 and not o.problems, o.describe()
    assert f"model.sequence_parallel: {value if value != 'no' else repr(value)} is not true or false" in o.out, o.out
    assert f"so it is {'on' if on else 'off'}" in o.out


@pytest.mark.parametrize("sets", [["model.tensor_model_parallel_size=1"], ["model.sequence_parallel=false"]])
def test_tp_comm_overlap_true_but_not_true_where_bridge_would_switch_it_off_is_a_problem(sets):
    argv = [*BRIDGE, *[x for s in [*sets, "comm_overlap.tp_comm_overlap=1"] for x in ("--set", s)]]
    o = run_memguard(argv, {"c.yaml": FLAT})
    assert not o.problems and o.code == 2, o.describe()
    assert "comm_overlap.tp_comm_overlap: 1 is not true: Megatron-Bridge 0.6.2's CommOverlapConfig" in o.err, o.err
    # `true` is switched off there by Bridge itself (a warning), and estimated
    o = run_memguard([*BRIDGE, *[x for s in [*sets, "comm_overlap.tp_comm_overlap=true"] for x in ("--set", s)]],
                     {"c.yaml": FLAT})
    assert o.code == 0 and "Megatron-Bridge switches TP communication overlap off" in o.out, o.describe()


def test_param_gather_overlap_without_grad_reduce_overlap_is_bridges_and_not_megatron_lms():
    # FLAT's ddp: distributed optimizer, overlap_grad_reduce true; Bridge 0.6.2 (no validate_args) runs the pair
    o = run_memguard([*BRIDGE, "--set", "ddp.overlap_grad_reduce=false", "--set", "ddp.overlap_param_gather=true"],
                     {"c.yaml": FLAT})
    assert o.code == 0 and not o.problems, o.describe()
    # Megatron-LM's validate_args asserts it: its flags keep the error
    o = run_memguard(["validate", "--world-size", "8", "--", *S, "--use-distributed-optimizer", "--overlap-param-gather"])
    assert o.code == 1 and "--overlap-param-gather: needs --overlap-grad-reduce" in o.out, o.describe()
