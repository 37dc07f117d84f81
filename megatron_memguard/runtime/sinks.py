"""Where the runtime monitor writes: JSONL per rank, TensorBoard / W&B writers, log lines.

Every record is a flat-ish JSON object with ``schema`` (``memguard.runtime/1``), ``event`` and
``rank``; the events and their fields are documented in docs/hook.md. Sinks never raise into the
monitor's caller: the monitor catches and reports their errors once.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping

SCHEMA = "memguard.runtime/1"


class Sink:
    def write(self, record: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class JsonlSink(Sink):
    """One JSON object per line, appended, flushed after every record (a crash loses nothing)."""

    def __init__(self, path: str):
        self.path = path
        d = os.path.dirname(path)
        if d:
            os.makedirs(d, exist_ok=True)
        from ..files import open_output

        # a named pipe nobody reads is an error here, and a full one a failed write: never a stalled step
        self._f = open_output(path, append=True, block=False)

    @staticmethod
    def path_for(log_dir: str, rank: int) -> str:
        return os.path.join(log_dir, f"memguard-rank{rank:05d}.jsonl")

    def write(self, record: Mapping[str, Any]) -> None:
        if self._f is None:
            return
        self._f.write(json.dumps(record, separators=(",", ":"), default=_jsonable) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _jsonable(x: Any) -> Any:
    if hasattr(x, "to_dict"):
        return x.to_dict()
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


# Scalar names written to TensorBoard / W&B for each sample (bytes; ratios are actual / predicted).
SCALARS = (
    ("memguard/max-allocated-bytes", ("actual", "max_allocated")),
    ("memguard/max-reserved-bytes", ("actual", "max_reserved")),
    ("memguard/device-used-bytes", ("actual", "device_used")),
    ("memguard/predicted-peak-allocated-bytes", ("predicted", "peak_allocated")),
    ("memguard/predicted-peak-reserved-bytes", ("predicted", "peak_reserved")),
    ("memguard/predicted-device-total-bytes", ("predicted", "device_total")),
    ("memguard/max-allocated-vs-predicted", ("ratio", "max_allocated")),
    ("memguard/max-reserved-vs-predicted", ("ratio", "max_reserved")),
    ("memguard/device-used-vs-predicted", ("ratio", "device_used")),
)


class WriterSink(Sink):
    """Scalars of ``sample`` events to a TensorBoard ``SummaryWriter`` (``add_scalar``) and/or a W&B
    run (``log``), as Megatron's ``get_tensorboard_writer()`` / ``get_wandb_writer()`` return them."""

    def __init__(self, tensorboard=None, wandb=None):
        self.tensorboard = tensorboard
        self.wandb = wandb

    def write(self, record: Mapping[str, Any]) -> None:
        if record.get("event") != "sample":
            return
        it = record.get("iteration")
        values: dict[str, float] = {}
        for tag, (group, key) in SCALARS:
            v = (record.get(group) or {}).get(key)
            if v is not None:
                values[tag] = v
        if self.tensorboard is not None:
            for tag, v in values.items():
                self.tensorboard.add_scalar(tag, v, it)
        if self.wandb is not None and values:
            self.wandb.log(values, it)


class CallbackSink(Sink):
    """Hand every record to a function (used by tests and by framework callbacks)."""

    def __init__(self, fn: Callable[[Mapping[str, Any]], None]):
        self.fn = fn

    def write(self, record: Mapping[str, Any]) -> None:
        self.fn(record)
