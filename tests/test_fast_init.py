"""Term, Param, MoeParam, StageEstimate, Estimate and the estimator's per-stage records (StageStates, Bucket,
ChunkBuffer, ChunkActivations, _StageShape, _StagePrep) and Chunk store their fields with a hand-written __init__ (speed, issue 16): its parameters must
stay the dataclass's fields, in order, with the same defaults."""
import dataclasses
import inspect

import pytest

from megatron_memguard.estimator.layers.base import Param
from megatron_memguard.estimator.layers.moe import MoeParam
from megatron_memguard.estimator.core import ChunkActivations, _StagePrep, _StageShape
from megatron_memguard.estimator.result import Estimate, StageEstimate, Term
from megatron_memguard.estimator.states import Bucket, ChunkBuffer, StageStates
from megatron_memguard.partition import Chunk


@pytest.mark.parametrize("cls", [Term, Param, MoeParam, StageEstimate, Estimate, StageStates, Bucket, ChunkBuffer, ChunkActivations, _StageShape,
                                 _StagePrep, Chunk])
def test_init_takes_the_fields_in_order_with_their_defaults(cls):
    fields = dataclasses.fields(cls)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields):
        assert p.default == (inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default)


def test_fields_stay_frozen_and_compared():
    t = Term("weights", 2 * 1024, "weights")
    assert t == Term("weights", 2048, "weights", "allocated", "") and hash(t) == hash(Term("weights", 2048, "weights"))
    assert dataclasses.replace(t, bytes=4096).bytes == 4096
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.bytes = 0
    p = Param("w", 4096 * 4096, True, False, True, 4096)
    assert (p.tp_replicated, p.shared_embedding, p.expert, p.cols) == (True, False, True, 4096)
    assert MoeParam("e", 8, expert=True) == MoeParam("e", 8, False, True, 0)
