"""Megatron-Bridge integration: a pre-flight check on the ConfigContainer, and a training callback that
logs predicted vs actual peak memory per rank.

In a Bridge launch script, after the recipe is built and the overrides applied, before ``pretrain()``::

    from megatron_memguard.bridge import MemguardCallback, preflight

    cfg = llama3_8b_pretrain_config(...)                # the recipe
    cfg = process_config_with_overrides(cfg, ...)       # --config-file and KEY=VALUE overrides
    result = preflight(cfg, gpu="H100-80GB", mode="abort")   # exits with code 3 if it does not fit
    pretrain(cfg, forward_step, callbacks=[MemguardCallback(result, log_dir="memguard-logs")])

or, in one call, ``megatron_memguard.bridge.pretrain(cfg, forward_step, mode="abort", log_dir=...)``.

``preflight`` reads the ConfigContainer object (attribute access; flat ``GPTModelProvider`` models and
nested ``model.transformer`` builder configs) or its dict (``cfg.to_dict()``, a ``run_config.yaml`` loaded
with ``yaml.safe_load``) through the same mapping as ``memguard estimate --config run_config.yaml``
(megatron_memguard/readers/bridge.py). It needs neither Bridge nor torch (torch reads this rank's device
when no GPU is given). The world size is
``world_size=`` or WORLD_SIZE / SLURM_NTASKS (torchrun and srun set them), or the container's
``data_parallel_size`` x TP x PP x CP after Bridge's ``runtime_config_update``.

What was assumed of Megatron-Bridge (read in megatron-bridge 0.6.2 and 0.3.1,
``megatron/bridge/training/callbacks.py``, ``pretrain.py`` and ``train.py``):

* ``pretrain(config, forward_step_func, callbacks=...)`` takes a list of callback objects or a
  ``CallbackManager``; ``CallbackManager.add`` registers every method named like an event that is not
  ``Callback``'s own, so MemguardCallback need not subclass ``Callback`` (it does not, so that importing
  this module never imports Bridge).
* ``on_train_start`` fires after the model, optimizer and checkpoint exist, before the first step;
  ``on_train_step_end`` after each optimizer step, before ``train_state.step`` is incremented (so the
  iteration just completed is ``step + 1``, Megatron's numbering); ``on_train_end`` after the loop.
  Each gets a ``CallbackContext`` whose ``state`` (GlobalState) has ``cfg``, ``train_state.step``,
  ``tensorboard_logger`` and ``wandb_logger``.
* No callback fires between ``runtime_config_update`` and model construction, so the pre-flight runs in
  the launch script (or in ``megatron_memguard.bridge.pretrain``), not in a callback.
* Bridge initializes ``megatron.core.parallel_state``; the callback reads this rank's pipeline stage
  from it (when it is not initialized and the layout has PP > 1, the stage is unknown: no prediction).
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable, Mapping

from ._integration import (
    ABORT_EXIT_CODE, PREFIX, PreflightAbort, PreflightResult, attach_oom_observer, build_monitor, default_source,
    env_int, is_oom, parallel_ranks, run_preflight, to_plain,
)
from .config import RawConfig
from .errors import MemguardError, ReaderError
from .numbers import python_scalar
from .runtime.reporting import ErrorReporter

__all__ = ["ABORT_EXIT_CODE", "MemguardCallback", "PreflightAbort", "PreflightResult", "bridge_available", "config_dict",
           "preflight", "pretrain", "raw_config"]

NEEDS_BRIDGE = ("needs Megatron-Bridge (pip install megatron-bridge; it provides megatron.bridge.training), which is not "
                "installed here. megatron_memguard.bridge.preflight() works without it, on a ConfigContainer object or "
                "its dict")


def bridge_available() -> bool:
    try:
        return importlib.util.find_spec("megatron.bridge") is not None
    except (ImportError, ValueError):
        return False


def _require_bridge(what: str) -> None:
    if not bridge_available():
        raise ImportError(f"{what} {NEEDS_BRIDGE}")


def _python_numbers(doc: Any, depth: int = 0) -> Any:
    """A ConfigContainer dict with its NumPy numbers (sizes computed with NumPy) as Python ones; nesting past
    64 levels (more than any YAML memguard reads) is left for the reader to refuse."""
    if isinstance(doc, Mapping) and depth < 64:
        return {k: _python_numbers(v, depth + 1) for k, v in doc.items()}
    if isinstance(doc, list) and depth < 64:
        return [_python_numbers(v, depth + 1) for v in doc]
    return python_scalar(doc)


def config_dict(config: Any) -> dict:
    """A ConfigContainer (object or dict) as the plain dict its ``run_config.yaml`` dump holds."""
    if isinstance(config, Mapping):
        return _python_numbers(dict(config))
    doc = to_plain(config)
    if not isinstance(doc, dict):
        raise ReaderError(f"cannot read a {type(config).__name__} as a Megatron-Bridge ConfigContainer")
    dp = getattr(config, "data_parallel_size", None)
    if isinstance(dp, int) and "data_parallel_size" not in doc:
        doc["data_parallel_size"] = dp   # set by Bridge's runtime_config_update
    doc.setdefault("_target_", "megatron.bridge.training.config.ConfigContainer")
    return doc


def raw_config(config: Any, overrides: list[str] | None = None) -> RawConfig:
    """The RawConfig of a ConfigContainer object or dict (``KEY=VALUE`` overrides on top)."""
    from .readers._common import parse_overrides
    from .readers.bridge import read_bridge

    doc = config_dict(config)
    label = "ConfigContainer" if not isinstance(config, Mapping) else "ConfigContainer dict"
    return read_bridge(doc, label, parse_overrides(overrides or []))


def preflight(config: Any, world_size: int | None = None, gpu: Any = None, mode: str | None = None, *,
              gpu_memory: Any = None, threshold: float | None = None, megatron_version: str | None = None,
              profile: str = "auto", emit: Callable[[str], None] | None = None, strict: bool = False,
              environ: Mapping[str, str] | None = None, site_profile: str | None = None) -> PreflightResult:
    """Check a Megatron-Bridge ConfigContainer (object or dict) against GPU memory before ``pretrain()``.

    ``mode`` (default: the MEMGUARD variable, else ``warn``): ``report`` prints every stage's estimate;
    ``warn`` prints one line, or the breakdown when the critical stage exceeds ``threshold`` (0.8, or
    MEMGUARD_THRESHOLD); ``abort`` raises ``PreflightAbort`` (a SystemExit with code 3) on every rank
    when it does not fit, rank 0 printing the breakdown and a layout that fits; ``off`` does nothing.
    ``gpu``: a name from ``memguard gpus`` or a GpuSpec; ``gpu_memory``: bytes or ``"79.1GiB"``; default:
    MEMGUARD_GPU_MEMORY, else this rank's device. ``site_profile``: a ``memguard calibrate`` profile file
    (default MEMGUARD_PROFILE). A config memguard cannot read is reported and
    training goes on (``strict=True`` raises). Returns the decision (its ``estimate``, ``layout``)."""
    return run_preflight(lambda: raw_config(config), mode=mode, world_size=world_size,
                         world_size_from="world_size" if world_size else "", gpu=gpu, gpu_memory=gpu_memory,
                         threshold=threshold, megatron_version=megatron_version, profile=profile, emit=emit,
                         label="Megatron-Bridge pre-flight", environ=environ, strict=strict, site_profile=site_profile)


class MemguardCallback:
    """A Megatron-Bridge training callback: each rank compares its actual peak memory with its own
    pipeline stage's prediction every ``interval`` iterations (default MEMGUARD_LOG_INTERVAL, else
    ``cfg.logger.log_interval``), through megatron_memguard.runtime's monitor: JSONL per rank under
    ``log_dir`` (default MEMGUARD_LOG_DIR), Bridge's TensorBoard / W&B writers, a warning when a rank
    exceeds its prediction by 5%, the predicted breakdown next to an out-of-memory error, a summary.

    ``result``: the ``preflight()`` decision (its layout and GPU); without one the callback runs the
    pre-flight itself at ``on_train_start`` (mode ``report`` is not repeated: it warns). ``source``: a
    ``megatron_memguard.runtime`` MemorySource (default: CUDA). Needs Megatron-Bridge to be installed
    (``require_bridge=False`` skips the check, for driving it without Bridge)."""

    def __init__(self, result: PreflightResult | None = None, *, log_dir: str | None = None, interval: int | None = None,
                 source: Any = None, reset_peak: bool = False, gpu: Any = None, gpu_memory: Any = None,
                 threshold: float | None = None, writers: bool = True, emit: Callable[[str], None] | None = None,
                 require_bridge: bool = True, site_profile: str | None = None):
        if require_bridge:
            _require_bridge("megatron_memguard.bridge.MemguardCallback")
        self.result = result
        self._own_result = result is None   # the callback's own pre-flight, redone for each run
        self.log_dir = log_dir if log_dir is not None else (os.environ.get("MEMGUARD_LOG_DIR") or None)
        self.interval = interval if interval is not None else env_int("MEMGUARD_LOG_INTERVAL")
        self.source = source
        self.reset_peak = reset_peak
        self.gpu, self.gpu_memory, self.threshold = gpu, gpu_memory, threshold
        self.site_profile = site_profile
        self.writers = writers
        self.emit = emit
        self.report = ErrorReporter()
        self.monitor = None

    # -- Bridge events ---------------------------------------------------------------------------
    def on_train_start(self, context: Any) -> None:
        try:
            self._start(context)
        except Exception as e:
            self.report("setting up the runtime monitor", e)
            self.monitor = None

    def on_train_step_end(self, context: Any) -> None:
        m = self.monitor
        if m is None:
            return
        try:
            m.step(int(context.state.train_state.step) + 1)  # the step counter is incremented after this event
        except Exception as e:
            self.report("the runtime sample", e)

    def on_train_end(self, context: Any) -> None:
        self.close()

    # -- helpers ---------------------------------------------------------------------------------
    def start_source(self, source: Any = None) -> None:
        """Start the memory source (idempotent), as the Lightning callback does: ``pretrain`` calls it before
        Bridge builds the model; otherwise ``on_train_start`` does."""
        source = source if source is not None else self.source
        if source is None:
            return
        try:
            source.start()
        except Exception as e:
            self.report("starting the memory source", e)

    def close(self, exc: BaseException | None = None) -> None:
        m = self.monitor
        if m is None:
            return
        try:
            if exc is not None and not m.oom_reported and is_oom(exc):
                m.on_oom()
            m.finish()
        except Exception as e:
            self.report("the end-of-training summary", e)

    def _start(self, context: Any) -> None:
        from .runtime.sinks import WriterSink

        state = context.state
        cfg = getattr(state, "cfg", None)
        if self._own_result and cfg is not None:
            self.result = preflight(cfg, mode="warn", gpu=self.gpu, gpu_memory=self.gpu_memory, threshold=self.threshold,
                                    emit=self.emit, site_profile=self.site_profile)
        source = self.source if self.source is not None else default_source()
        if source is None:
            (self.emit or print)(f"{PREFIX} no CUDA device: runtime memory logging is off (pass source= to use another "
                                 "megatron_memguard.runtime memory source)")
            return
        self.start_source(source)
        track = getattr(source, "track", None)
        if track is not None:  # what was built before the source started (Bridge has no event before the model)
            track(*existing_tensors(getattr(context, "model", None), getattr(context, "optimizer", None)))
        interval = self.interval
        if interval is None:
            interval = getattr(getattr(cfg, "logger", None), "log_interval", None) or 100
        sinks = []
        if self.writers:
            tb = wb = None
            try:
                tb = getattr(state, "tensorboard_logger", None)
            except Exception:
                tb = None
            try:
                wb = getattr(state, "wandb_logger", None)
            except Exception:
                wb = None
            if tb is not None or wb is not None:
                sinks.append(WriterSink(tb, wb))
        self.monitor = build_monitor(source, self.result, ranks=parallel_ranks(), interval=int(interval),
                                     log_dir=self.log_dir, extra_sinks=sinks, reset_peak=self.reset_peak,
                                     context={"framework": "megatron-bridge"}, report=self.report, emit=self.emit,
                                     threshold=self.result.estimate.threshold if self.result and self.result.estimate else 0.8)
        if source.device == "gpu":
            attach_oom_observer(self.monitor)
        self.monitor.start()


def existing_tensors(model: Any, optimizer: Any) -> list:
    """The tensors a training run holds by ``on_train_start``: the model chunks' parameters, buffers and
    gradients (``.grad``, megatron-core's ``.main_grad`` views of its gradient buffer, the DDP param / grad
    buffers) and the optimizer's state (torch optimizers, and megatron-core's wrapped ``.optimizer``)."""
    out: list = []
    chunks = model if isinstance(model, (list, tuple)) else [model] if model is not None else []
    for chunk in chunks:
        for name in ("parameters", "buffers"):
            fn = getattr(chunk, name, None)
            if callable(fn):
                for t in fn():
                    out.append(t)
                    if name == "parameters":
                        out += [g for g in (getattr(t, "grad", None), getattr(t, "main_grad", None)) if g is not None]
        for buf in list(getattr(chunk, "buffers", None) if isinstance(getattr(chunk, "buffers", None), list) else []):
            out += [x for x in (getattr(buf, "param_data", None), getattr(buf, "grad_data", None)) if x is not None]
    seen: set = set()
    opt = optimizer
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        state = getattr(opt, "state", None)
        if isinstance(state, Mapping):
            for per_param in state.values():
                if isinstance(per_param, Mapping):
                    out += [v for v in per_param.values() if hasattr(v, "untyped_storage")]
        for group in getattr(opt, "param_groups", None) or []:
            if isinstance(group, Mapping):
                out += [p for p in group.get("params", ()) if hasattr(p, "untyped_storage")]
        opt = getattr(opt, "optimizer", None)
    return [t for t in out if hasattr(t, "untyped_storage")]


def pretrain(config: Any, forward_step_func: Any, callbacks: Any = None, *, world_size: int | None = None, gpu: Any = None,
             gpu_memory: Any = None, mode: str | None = None, threshold: float | None = None, log_dir: str | None = None,
             interval: int | None = None, source: Any = None, site_profile: str | None = None, **kwargs) -> Any:
    """Bridge's ``pretrain`` with the pre-flight first and the memguard callback added (a function
    wrapper for launch scripts): ``megatron_memguard.bridge.pretrain(cfg, forward_step, mode="abort")``."""
    _require_bridge("megatron_memguard.bridge.pretrain")
    from megatron.bridge.training.pretrain import pretrain as bridge_pretrain  # type: ignore

    result = preflight(config, world_size=world_size, gpu=gpu, gpu_memory=gpu_memory, mode=mode, threshold=threshold,
                       site_profile=site_profile)
    if result.mode == "off":  # off means off: no pre-flight and no runtime logging (as the hook and Lightning)
        return bridge_pretrain(config, forward_step_func, callbacks=callbacks, **kwargs)
    try:
        cb = MemguardCallback(result, log_dir=log_dir, interval=interval, source=source, gpu=gpu, gpu_memory=gpu_memory,
                              threshold=threshold)
        cb.start_source()   # before the model is built, so that a tracking source counts it as it is made
    except MemguardError:   # a bad setting (MEMGUARD_LOG_INTERVAL=x): named, as the pre-flight's own settings are
        raise
    except Exception as e:  # memguard's own bug: training goes on without the runtime log
        ErrorReporter()("setting up the runtime monitor", e)
        return bridge_pretrain(config, forward_step_func, callbacks=callbacks, **kwargs)
    if callbacks is None:
        callbacks = [cb]
    elif isinstance(callbacks, list):
        callbacks = list(callbacks) + [cb]
    else:  # a CallbackManager
        callbacks.add(cb)
    try:
        return bridge_pretrain(config, forward_step_func, callbacks=callbacks, **kwargs)
    except BaseException as e:
        cb.close(e)
        raise
