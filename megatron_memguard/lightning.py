"""Lightning integration for NeMo 2 (and other Lightning-based Megatron training): a ``Callback`` that
checks the layout before the model is built and logs predicted vs actual peak memory per rank.

    from megatron_memguard.lightning import MemguardCallback
    trainer = nl.Trainer(..., strategy=nl.MegatronStrategy(tensor_model_parallel_size=2, ...),
                         callbacks=[MemguardCallback(mode="abort", log_dir="memguard-logs")])

What it reads (as NeMo 2.5's ``MegatronStrategy``, ``GPTModel`` and data modules name them):

* the world size: ``trainer.world_size`` (``num_nodes`` x devices);
* from ``trainer.strategy``: ``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
  ``virtual_pipeline_model_parallel_size``, ``context_parallel_size``, ``sequence_parallel``,
  ``expert_model_parallel_size`` ... and the DDP config (``ddp_config``: ``use_distributed_optimizer``,
  ``grad_reduce_in_fp32``, ``overlap_*``); attributes a plain Lightning strategy lacks take Megatron's
  defaults (no model parallelism);
* the precision: ``trainer.precision`` (``bf16-mixed``, ``16-mixed``, ``32-true``) and, for NeMo's
  ``MegatronMixedPrecision``, its ``dtype_config`` (``bf16`` / ``fp16``, ``params_dtype``,
  ``grad_reduce_in_fp32``, ``fp8``), read as NeMo applies it: with bf16 or fp16 the model is wrapped in
  megatron-core's Float16Module, which casts the parameters to that dtype whatever ``params_dtype`` says;
* the model config: ``pl_module.config`` (NeMo 2's GPTConfig: megatron-core TransformerConfig names,
  ``seq_length``, ``vocab_size``, ``share_embeddings_and_output_weights``, recomputation ...), or
  ``model_config=``; the vocabulary from ``config.vocab_size`` or ``pl_module.tokenizer.vocab_size``;
* the optimizer: ``pl_module.optim.config`` (megatron-core OptimizerConfig) when there is one;
* the batch: ``trainer.datamodule.micro_batch_size``, ``global_batch_size``, ``seq_length``.

These go through the NeMo 2 reader's mapping (megatron_memguard/readers/nemo2.py), then the same
resolve / estimate as every other input. ``setup("fit")`` runs before Lightning's ``configure_model``
(where NeMo 2 builds the model) and ``strategy.setup`` (where it moves to the GPU), so ``mode="abort"``
stops every rank before the model is allocated (PreflightAbort, exit code 3). From ``on_train_start``
each rank's monitor (megatron_memguard.runtime, as in the Megatron hook) samples its memory source
every ``interval`` optimizer steps (default: MEMGUARD_LOG_INTERVAL, else ``trainer.log_every_n_steps``)
after the step: a JSONL file per rank, the trainer's loggers (``log_metrics``), a warning at 5% over
the prediction, the breakdown next to an out-of-memory error, a summary at the end.

Needs Lightning (``lightning`` or ``pytorch_lightning``); importing this module works without it, and
the callback then says what it needs.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable, Mapping

from ._integration import (
    ABORT_EXIT_CODE, PREFIX, PreflightAbort, PreflightResult, attach_oom_observer, build_monitor, default_source,
    env_int, is_oom, parallel_ranks, run_preflight, to_plain,
)
from .config import RawConfig
from .errors import ReaderError
from .knobs import KNOBS
from .runtime.reporting import ErrorReporter
from .runtime.sinks import SCALARS, Sink

try:  # NeMo 2 uses lightning.pytorch
    import lightning.pytorch as _pl  # type: ignore
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        import pytorch_lightning as _pl  # type: ignore
    except ImportError:
        _pl = None

__all__ = ["ABORT_EXIT_CODE", "LoggerSink", "MemguardCallback", "PreflightAbort", "PreflightResult", "lightning_available",
           "raw_config"]

NEEDS_LIGHTNING = ("needs Lightning (pip install lightning; NeMo 2 installs it), which is not installed here. The rest "
                   "of memguard (memguard check / estimate, megatron_memguard.bridge.preflight) works without it")

_STRATEGY_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                  "context_parallel_size", "sequence_parallel", "expert_model_parallel_size", "expert_tensor_parallel_size",
                  "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                  "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                  "pipeline_model_parallel_layout", "microbatch_group_size_per_vp_stage",
                  "num_distributed_optimizer_instances")

# The datamodule's batch attributes: NeMo 2's data.* keys of the knob registry (micro / global batch, sequence).
_DATA_KEYS = tuple(key.split(".", 1)[1] for k in KNOBS for key in k.nemo2 if key.startswith("data."))


def lightning_available() -> bool:
    return _pl is not None


def _attr(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


def trainer_dict(trainer: Any, pl_module: Any, model_config: Any = None) -> dict:
    """The trainer, model and data module as the NeMo 2 YAML export would hold them."""
    cfg = model_config if model_config is not None else _attr(pl_module, "config")
    if cfg is None:
        raise ReaderError("the LightningModule has no .config (NeMo 2's GPTConfig: num_layers, hidden_size, "
                          "num_attention_heads, seq_length, ...); pass MemguardCallback(model_config=...)")
    mcfg = to_plain(cfg)
    if not isinstance(mcfg, dict):
        raise ReaderError(f"cannot read the model config, a {type(cfg).__name__}")
    model: dict[str, Any] = {"config": mcfg}
    tok = _attr(pl_module, "tokenizer")
    if tok is not None and _attr(tok, "vocab_size"):
        model["tokenizer"] = {"vocab_size": int(tok.vocab_size), "_target_": type(tok).__name__}
    strategy = _attr(trainer, "strategy")
    strat: dict[str, Any] = {}
    for name in _STRATEGY_KEYS:
        v = _attr(strategy, name)
        if v is not None:
            strat[name] = to_plain(v)
    ddp = _attr(strategy, "ddp_config")
    if ddp is None and not isinstance(_attr(strategy, "ddp"), (str, type(None))):
        ddp = _attr(strategy, "ddp")
    if ddp is not None:
        strat["ddp"] = to_plain(ddp)
    pp = _attr(trainer, "precision_plugin")
    name = type(pp).__name__
    plug: dict[str, Any] = {"_target_": name if "MixedPrecision" in name else "MixedPrecision",
                            "precision": str(_attr(trainer, "precision") or "32-true")}
    dc = _attr(pp, "dtype_config")   # NeMo's MegatronMixedPrecision: what it decided (bf16 / fp16 and the rest)
    if dc is not None:
        from .readers.nemo2 import _FP8_PLUGIN_KEYS
        for name in ("bf16", "fp16", "params_dtype", "grad_reduce_in_fp32", "fp8", "fp4", *_FP8_PLUGIN_KEYS):
            v = _attr(dc, name)
            if v is not None:
                plug[name] = to_plain(v)
    devices = _attr(trainer, "num_devices")
    nodes = _attr(trainer, "num_nodes") or 1
    doc: dict[str, Any] = {"model": model, "trainer": {"devices": devices, "num_nodes": nodes, "strategy": strat,
                                                        "plugins": plug}}
    dm = _attr(trainer, "datamodule")
    data = {name: _attr(dm, name) for name in _DATA_KEYS if _attr(dm, name) is not None}
    if "create_attention_mask" in (vars(dm) if dm is not None and hasattr(dm, "__dict__") else {}):
        data["create_attention_mask"] = bool(dm.create_attention_mask)
    doc["data"] = data
    optim = _attr(pl_module, "optim")
    ocfg = _attr(optim, "config")
    if ocfg is not None:
        doc["optim"] = {"config": to_plain(ocfg)}
    return doc


def raw_config(trainer: Any, pl_module: Any, model_config: Any = None) -> RawConfig:
    """The RawConfig of a Lightning trainer, its strategy, the model's config and the data module."""
    from .readers.nemo2 import read_nemo2

    raw = read_nemo2(trainer_dict(trainer, pl_module, model_config), "Lightning trainer", [])
    return replace(raw, source=f"Lightning trainer ({type(_attr(trainer, 'strategy')).__name__}) + "
                              f"{type(model_config if model_config is not None else _attr(pl_module, 'config')).__name__}",
                   best_effort=False)


class LoggerSink(Sink):
    """The monitor's ``sample`` values to the trainer's loggers (``log_metrics``: TensorBoard, W&B, CSV ...)."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def write(self, record: Mapping[str, Any]) -> None:
        if record.get("event") != "sample":
            return
        values: dict[str, float] = {}
        for tag, (group, key) in SCALARS:
            v = (record.get(group) or {}).get(key)
            if v is not None:
                values[tag] = float(v)
        if not values:
            return
        for lg in list(_attr(self.trainer, "loggers") or []):
            lg.log_metrics(values, step=record.get("iteration"))


_Base = _pl.Callback if _pl is not None else object


class MemguardCallback(_Base):  # type: ignore[misc, valid-type]
    """Pre-flight at ``setup("fit")`` and predicted vs actual memory while training (see the module doc).

    ``mode``: ``warn`` (default, or MEMGUARD), ``report``, ``abort``, ``off``. ``gpu`` / ``gpu_memory``: the
    GPU to check against (default MEMGUARD_GPU_MEMORY, else this rank's device). ``source``: a
    megatron_memguard.runtime MemorySource (default: CUDA; e.g. ``LiveBytesSource()`` on CPU). ``site_profile``: a
    ``memguard calibrate`` profile file (default MEMGUARD_PROFILE)."""

    def __init__(self, *, mode: str | None = None, world_size: int | None = None, gpu: Any = None, gpu_memory: Any = None,
                 threshold: float | None = None, log_dir: str | None = None, interval: int | None = None, source: Any = None,
                 reset_peak: bool = False, megatron_version: str | None = None, model_config: Any = None,
                 log_to_loggers: bool = True, emit: Callable[[str], None] | None = None, site_profile: str | None = None):
        if _pl is None:
            raise ImportError(f"megatron_memguard.lightning.MemguardCallback {NEEDS_LIGHTNING}")
        super().__init__()
        self.mode = mode
        self.world_size = world_size
        self.gpu, self.gpu_memory, self.threshold = gpu, gpu_memory, threshold
        self.site_profile = site_profile
        self.log_dir = log_dir if log_dir is not None else (os.environ.get("MEMGUARD_LOG_DIR") or None)
        self.interval = interval if interval is not None else env_int("MEMGUARD_LOG_INTERVAL")
        self.source = source
        self.reset_peak = reset_peak
        self.megatron_version = megatron_version
        self.model_config = model_config
        self.log_to_loggers = log_to_loggers
        self.emit = emit
        self.report = ErrorReporter()
        self.result: PreflightResult | None = None
        self.monitor = None
        self._source_started = False
        self._last_step: int | None = None

    # -- Lightning hooks ---------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        world = self.world_size or _attr(trainer, "world_size")
        src = "world_size" if self.world_size else "trainer.num_nodes x devices"
        self.result = run_preflight(lambda: raw_config(trainer, pl_module, self.model_config), mode=self.mode,
                                    world_size=world, world_size_from=src, gpu=self.gpu, gpu_memory=self.gpu_memory,
                                    threshold=self.threshold, megatron_version=self.megatron_version, emit=self.emit,
                                    rank0=_attr(trainer, "global_rank") in (0, None), label="Lightning pre-flight",
                                    site_profile=self.site_profile)
        if self.result.mode == "off":
            return
        try:
            if self.source is None:
                self.source = default_source()
            if self.source is not None and not self._source_started:
                self.source.start()   # before configure_model: a tracking source sees the model being built
                self._source_started = True
        except Exception as e:
            self.report("starting the memory source", e)
            self.source = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.result is None or self.result.mode == "off":
            return
        if self.source is None:
            if _attr(trainer, "global_rank") in (0, None):
                (self.emit or print)(f"{PREFIX} no CUDA device: runtime memory logging is off (pass source= to use "
                                     "another megatron_memguard.runtime memory source)")
            return
        self._last_step = None  # a second fit() starts counting afresh
        try:
            track = getattr(self.source, "track", None)
            if track is not None:  # tensors made before the source started (the module built before fit())
                track(*pl_module.parameters(), *pl_module.buffers())
            ranks = dict(parallel_ranks())
            ranks["rank"] = int(_attr(trainer, "global_rank") or 0)
            ranks["world_size"] = int(_attr(trainer, "world_size") or 1)
            interval = self.interval or _attr(trainer, "log_every_n_steps") or 100
            sinks = [LoggerSink(trainer)] if self.log_to_loggers and _attr(trainer, "loggers") else []
            est = self.result.estimate
            self.monitor = build_monitor(self.source, self.result, ranks=ranks, interval=int(interval), log_dir=self.log_dir,
                                         extra_sinks=sinks, reset_peak=self.reset_peak,
                                         context={"framework": "lightning", "strategy": type(trainer.strategy).__name__},
                                         report=self.report, emit=self.emit, threshold=est.threshold if est else 0.8)
            if self.source.device == "gpu":
                attach_oom_observer(self.monitor)
            self.monitor.start()
        except Exception as e:
            self.report("setting up the runtime monitor", e)
            self.monitor = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        m = self.monitor
        if m is None:
            return
        try:
            step = int(trainer.global_step)   # optimizer steps so far (Megatron's iteration numbering)
            if step > 0 and step != self._last_step:  # gradient accumulation: one sample per optimizer step
                self._last_step = step
                m.step(step)
        except Exception as e:
            self.report("the runtime sample", e)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close(exception)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._close()

    def _close(self, exc: BaseException | None = None) -> None:
        m = self.monitor
        if m is not None and not m.finished:
            try:
                if exc is not None and not m.oom_reported and is_oom(exc):
                    m.on_oom()
                m.finish()   # also stops the source
            except Exception as e:
                self.report("the end-of-training summary", e)
        elif self.source is not None and self._source_started and m is None:
            try:
                self.source.stop()
            except Exception:
                pass
        self._source_started = False
