"""What the framework integrations (``megatron_memguard.bridge``, ``megatron_memguard.lightning``) share:
turning live config objects into plain mappings the readers understand, the pre-flight decision on a
``RawConfig`` (report / warn / abort), and building the runtime monitor (``megatron_memguard.runtime``:
the same monitor, sources and sinks as the Megatron hook) for one rank.

Nothing here imports torch, Lightning, NeMo or Megatron-Bridge at import time.
"""
from __future__ import annotations

import dataclasses
import enum
import os
import sys
import types
from typing import Any, Callable, Iterable, Mapping

from .config import RawConfig
from .errors import ConfigError, MemguardError
from .numbers import INT64_MAX, python_scalar, shown, to_int
from .runtime.reporting import ErrorReporter

from .decision import ABORT_EXIT_CODE, DEFAULT_MODE, DEFAULT_THRESHOLD, PREFIX, PREFLIGHT_MODES, PreflightAbort, PreflightResult

MODES = PREFLIGHT_MODES  # (the name the integrations used)


# --------------------------------------------------------------------------------------------------
# Live objects -> plain mappings
# --------------------------------------------------------------------------------------------------
def _qualname(obj: Any) -> str:
    mod = getattr(obj, "__module__", None) or ""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__
    return f"{mod}.{name}" if mod else str(name)


def to_plain(obj: Any, depth: int = 0, max_depth: int = 6, _seen: set | None = None) -> Any:
    """A config object (dataclasses such as Bridge's ConfigContainer and its model provider, NeMo 2's
    GPTConfig, SimpleNamespace, mappings) as the plain dict / list / scalar tree its YAML dump would
    hold: torch dtypes as ``torch.bfloat16``, functions as ``{_target_: module.name, _call_: false}``,
    enums by name, dataclasses with their ``_target_``. Objects it cannot represent become None."""
    obj = python_scalar(obj)    # (a NumPy number in a config object: the number it holds)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, enum.Enum):
        return obj.name
    tname = type(obj).__name__
    tmod = type(obj).__module__ or ""
    if tmod.startswith("torch") and tname == "dtype":
        return str(obj)
    if depth >= max_depth:
        return None
    _seen = set() if _seen is None else _seen
    if id(obj) in _seen:
        return None
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)) or tname == "partial":
        target = getattr(obj, "func", obj)
        return {"_target_": _qualname(target), "_call_": False}
    if isinstance(obj, type):
        return {"_target_": _qualname(obj), "_call_": False}
    if isinstance(obj, (types.ModuleType,)):
        return None
    _seen.add(id(obj))
    try:
        if isinstance(obj, Mapping):
            return {str(k): to_plain(v, depth + 1, max_depth, _seen) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [to_plain(v, depth + 1, max_depth, _seen) for v in obj]
        if dataclasses.is_dataclass(obj):
            out: dict[str, Any] = {"_target_": _qualname(type(obj))}
            for f in dataclasses.fields(obj):
                if f.name.startswith("__"):
                    continue
                try:
                    out[f.name] = to_plain(getattr(obj, f.name), depth + 1, max_depth, _seen)
                except Exception:
                    continue
            return out
        if isinstance(obj, types.SimpleNamespace) or (hasattr(obj, "__dict__") and not callable(obj)
                                                        and not tmod.startswith(("torch", "numpy"))):
            return {k: to_plain(v, depth + 1, max_depth, _seen) for k, v in vars(obj).items()
                    if not k.startswith("_") or k == "_target_"}
        if callable(obj):
            return {"_target_": _qualname(type(obj)), "_call_": False}
    finally:
        _seen.discard(id(obj))
    return None


# --------------------------------------------------------------------------------------------------
# World, rank, GPU
# --------------------------------------------------------------------------------------------------
def _dist():
    """torch.distributed when torch is already imported and a process group exists (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        dist = torch.distributed
        return dist if dist.is_available() and dist.is_initialized() else None
    except Exception:
        return None


def world_from_environment(environ: Mapping[str, str] | None = None) -> tuple[int | None, str]:
    environ = os.environ if environ is None else environ
    d = _dist()
    if d is not None:
        return int(d.get_world_size()), "torch.distributed"
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        v = _env_count(environ, name)
        if v is not None:
            return v, name
    return None, ""


def this_rank(environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    d = _dist()
    if d is not None:
        return int(d.get_rank())
    for name in ("RANK", "SLURM_PROCID"):
        v = _env_count(environ, name, minimum=0)
        if v is not None:
            return v
    return 0


def _env_count(environ: Mapping[str, str], name: str, minimum: int = 1) -> int | None:
    """A count from the environment (WORLD_SIZE, RANK, ...): None unless it is a number of GPUs a job can have."""
    from .numbers import MAX_WORLD_SIZE, number_from_text
    n = number_from_text(str(environ.get(name) or ""))
    return n if isinstance(n, int) and minimum <= n <= MAX_WORLD_SIZE else None


def parallel_ranks() -> dict[str, int]:
    """This rank's coordinates from megatron.core.parallel_state when model parallelism is initialized
    (NeMo 2 and Bridge initialize it); PP rank 0 and the process rank otherwise."""
    out = {"rank": this_rank(), "world_size": world_from_environment()[0] or 1, "pp_rank": 0, "pp_size": 1, "tp_rank": 0,
           "dp_rank": 0, "cp_rank": 0, "optimizer_rank": 0}
    mpu = sys.modules.get("megatron.core.parallel_state")
    if mpu is None:
        return out
    try:
        if not mpu.model_parallel_is_initialized():
            return out
    except Exception:
        return out
    for key, fn in (("pp_rank", "get_pipeline_model_parallel_rank"), ("pp_size", "get_pipeline_model_parallel_world_size"),
                    ("tp_rank", "get_tensor_model_parallel_rank"), ("dp_rank", "get_data_parallel_rank"),
                    ("cp_rank", "get_context_parallel_rank")):
        try:
            out[key] = int(getattr(mpu, fn)())
        except Exception:
            pass
    # The distributed optimizer shards over the DP x CP group of one optimizer instance
    # (process_groups_config.py: intra_dp_cp_group = get_data_parallel_group(with_context_parallel=True,
    # partial_data_parallel=True)); the plain DP rank is not this rank's shard index when CP > 1.
    try:
        out["optimizer_rank"] = int(mpu.get_data_parallel_rank(with_context_parallel=True, partial_data_parallel=True))
    except Exception:
        out["optimizer_rank"] = out["dp_rank"]
    # The expert parameters' distributed optimizer shards over the partial expert-data-parallel group
    # (process_groups_config.py: intra_expt_dp_group = get_expert_data_parallel_group(
    # partial_expert_data_parallel=True), core 0.16.1 and 0.19.2): a rank of TP rank != 0 can sit further in
    # it than TP rank 0 when TP > ETP x EP, so the hook takes the group's own rank
    try:
        out["expert_optimizer_rank"] = int(mpu.get_expert_data_parallel_rank(partial_expert_data_parallel=True))
    except Exception:
        pass
    return out


def expert_optimizer_rank(layout: Any, ranks: Mapping[str, int]) -> int | None:
    """This process's position in the expert-data-parallel optimizer group: megatron-core's own
    (``parallel_ranks``) when it gave one, else worked out from its dense optimizer rank and TP rank in
    megatron-core's rank order (``Parallelism.expert_dp_rank``); None for a dense model."""
    if getattr(layout, "moe", None) is None:
        return None
    if "expert_optimizer_rank" in ranks:
        return int(ranks["expert_optimizer_rank"])
    return layout.parallel.expert_dp_rank(int(ranks.get("optimizer_rank", ranks.get("dp_rank", 0))),
                                          int(ranks.get("tp_rank", 0)))


def resolve_gpu(gpu: Any = None, gpu_memory: Any = None,
                environ: Mapping[str, str] | None = None) -> tuple[Any, int | None, str]:
    """(GpuSpec or None, memory in bytes or None, where it came from). ``gpu``: a GPU table name or a
    GpuSpec (its memory unless ``gpu_memory`` is given); ``gpu_memory``: bytes or a size such as
    ``79.1GiB``; when neither is given, MEMGUARD_GPU_MEMORY, else this rank's device (as the Megatron
    hook reads it). A bad value raises ConfigError naming the argument or variable."""
    from .gpus import GpuSpec, lookup_gpu
    from .units import parse_bytes

    environ = os.environ if environ is None else environ
    spec = gpu if isinstance(gpu, GpuSpec) else (lookup_gpu(str(gpu), "gpu") if gpu else None)
    mem = None
    src = ""
    if gpu_memory is not None:
        mem = parse_bytes(gpu_memory if isinstance(gpu_memory, (int, float)) else str(gpu_memory), "gpu_memory")
        src = "gpu_memory"
    elif spec is None and environ.get("MEMGUARD_GPU_MEMORY"):  # gpu= and gpu_memory= win over the variable
        mem, src = parse_bytes(environ["MEMGUARD_GPU_MEMORY"], "MEMGUARD_GPU_MEMORY"), "MEMGUARD_GPU_MEMORY"
    if spec is not None:
        return spec, mem or spec.memory_bytes, src or f"gpu={spec.name}"
    from .runtime.device import device_properties, gpu_spec_for
    name, total, dsrc = device_properties(environ)
    if mem is not None:
        return gpu_spec_for(name, mem), mem, src
    if total:
        return gpu_spec_for(name, total), total, dsrc
    return None, None, dsrc or "no GPU"


# --------------------------------------------------------------------------------------------------
# The pre-flight decision
# --------------------------------------------------------------------------------------------------
def mode_from(mode: str | None, environ: Mapping[str, str] | None = None) -> str:
    """``mode``, else MEMGUARD, else ``warn``; a bad value raises ConfigError naming ``mode`` or MEMGUARD."""
    environ = os.environ if environ is None else environ
    key = "mode" if mode is not None else "MEMGUARD"
    m = str(mode if mode is not None else environ.get("MEMGUARD", DEFAULT_MODE)).strip().lower()
    if m == "autotune":
        raise ConfigError(key, "autotune is the Megatron hook's (it rewrites Megatron's arguments); the Bridge / "
                               "Lightning pre-flight reports, warns or aborts", "use report, warn or abort")
    if m not in MODES:
        raise ConfigError(key, f"unknown mode {m!r}", "use off, report, warn or abort")
    return m


def threshold_from(threshold: float | None, environ: Mapping[str, str] | None = None) -> float:
    """``threshold``, else MEMGUARD_THRESHOLD, else 0.8; must be in (0, 1.5] as the hook's
    ``--memguard-threshold`` (ConfigError naming ``threshold`` or MEMGUARD_THRESHOLD otherwise)."""
    environ = os.environ if environ is None else environ
    if threshold is not None:
        key, value = "threshold", threshold
    elif environ.get("MEMGUARD_THRESHOLD"):
        key, value = "MEMGUARD_THRESHOLD", environ["MEMGUARD_THRESHOLD"]
    else:
        return DEFAULT_THRESHOLD
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(key, f"expects a fraction of GPU memory such as 0.8, got {shown(value)}") from None
    if not 0 < v <= 1.5:
        raise ConfigError(key, f"must be in (0, 1.5], got {shown(value)}")
    return v


def run_preflight(raw_fn: Callable[[], RawConfig], *, mode: str | None = None, world_size: int | None = None,
                  world_size_from: str = "", gpu: Any = None, gpu_memory: Any = None, threshold: float | None = None,
                  megatron_version: str | None = None, profile: str = "auto", emit: Callable[[str], None] | None = None,
                  rank0: bool | None = None, label: str = "memguard", environ: Mapping[str, str] | None = None,
                  strict: bool = False, site_profile: str | None = None) -> PreflightResult:
    """Read the config (``raw_fn``), resolve and estimate it against the GPU, and act by ``mode``:
    ``report`` prints the estimate of every stage; ``warn`` (default) one line, or a warning with the
    breakdown when the critical stage exceeds the threshold; ``abort`` raises PreflightAbort on every
    rank (rank 0 prints the breakdown and a layout that fits). A config memguard cannot read or model
    is reported and training goes on (``strict=True`` raises instead), as is an internal error of
    memguard's own. ``site_profile``: a ``memguard calibrate`` profile file (else MEMGUARD_PROFILE). A bad
    ``mode`` / ``threshold`` / ``gpu`` / ``gpu_memory`` / ``site_profile`` (or MEMGUARD, MEMGUARD_THRESHOLD,
    MEMGUARD_GPU_MEMORY) raises ConfigError naming it; an unreadable MEMGUARD_PROFILE is reported and the
    defaults are used (``strict=True`` raises)."""
    from .estimator import estimate
    from .report.text import moe_line, render, verdict_line, worst_moe_stage
    from .resolve import resolve
    from .units import format_bytes

    environ = os.environ if environ is None else environ
    emit = emit or (lambda s: print(s, flush=True))
    rank0 = this_rank(environ) == 0 if rank0 is None else rank0
    mode = mode_from(mode, environ)
    threshold = threshold_from(threshold, environ)
    r = PreflightResult(mode=mode, action="skipped", taken_by="preflight")
    if mode == "off":
        return r
    from .site_profile import site_from
    try:
        site = site_from(site_profile, environ, key="site_profile")
    except ConfigError as e:
        if site_profile or strict:
            raise
        # MEMGUARD_PROFILE is set for a site; a profile gone bad under a queue of jobs must not stop them
        site = None
        if rank0:
            emit(f"{PREFIX} {label}: error: {e}; memguard's default site constants are used (training continues)")
    r.gpu, r.gpu_memory, r.gpu_memory_source = resolve_gpu(gpu, gpu_memory, environ)
    try:
        raw = with_installed_te(raw_fn())
        r.raw = raw
        if world_size is None:
            world_size, world_size_from = world_from_environment(environ)
        if world_size is None and raw.world_size:
            world_size, world_size_from = raw.world_size, raw.origin.get("world_size", "the config")
        if world_size is None:
            raise ConfigError("world_size", "the number of GPUs is unknown (no WORLD_SIZE / SLURM_NTASKS, no process "
                                            "group yet)", "pass world_size=N")
        r.world_size, r.world_size_from = world_size, world_size_from or "world_size"
        layout = resolve(raw, world_size=world_size, megatron_version=megatron_version)
        est = estimate(layout, profile=profile, gpu=r.gpu, gpu_memory=r.gpu_memory, threshold=threshold,
                       site=site.constants if site is not None else None)
    except MemguardError as e:
        if strict:
            raise
        r.action, r.reason = "unsupported", str(e)
        from .decision import expert_grid_failure, megatron_failure
        later = megatron_failure(e)
        if later is None and r.raw is not None:
            later = expert_grid_failure(r.raw.args.get, world_size, r.raw.key)
        if rank0:
            emit(f"{PREFIX} {label}: cannot estimate this configuration: {e}; "
                 + (later if later else "training continues unchecked"))
        return r
    except Exception as e:  # memguard's own bug: never the training's problem
        if strict:
            raise
        return _internal_error(r, label, e, emit if rank0 else None)
    r.layout, r.estimate = layout, est
    if est.verdict == "unknown":
        r.action = "unknown"
    elif mode == "report":
        r.action = "reported"
    elif est.verdict == "fits":
        r.action = "fits"
    else:
        r.action = "warned" if mode == "warn" else "abort"
    try:
        r.notes = list(raw.warnings) + [n for n in layout.notes if n not in raw.warnings]
        out: list[str] = []
        where = f"{r.gpu.name if r.gpu else 'GPU'} {format_bytes(r.gpu_memory)}" if r.gpu_memory else "unknown GPU memory"
        out.append(f"{PREFIX} {label}: mode {mode}, threshold {threshold:.0%}, {where} ({r.gpu_memory_source}); "
                   f"{world_size} ranks ({r.world_size_from}); {raw.source}")
        if r.action == "unknown":
            out.append(f"{PREFIX} GPU memory unknown ({r.gpu_memory_source}): pass gpu= or gpu_memory= to check; the estimate follows")
            out.append(render(est, colour=False))
        elif r.action == "reported":
            out.append(render(est, colour=False, all_stages=True))
        elif r.action == "fits":
            out.append(f"{PREFIX} {verdict_line(est)}")
            if any(s.moe for s in est.stages):   # the verdict assumes balanced routing
                w = worst_moe_stage(est)   # the stage whose worst case needs the most
                out.append(f"{PREFIX} pp{w.pp_rank} {moe_line(w, est.gpu_memory_bytes, est.threshold)}")
        elif r.action == "warned":
            out.append(f"{PREFIX} WARNING: the critical stage exceeds {threshold:.0%} of GPU memory; training continues "
                       "(mode='abort' stops here)")
            out.append(render(est, colour=False))
        else:
            c = est.critical
            out.append(f"{PREFIX} ABORT: stage pp{c.pp_rank} needs {format_bytes(c.device_total_bytes)} = "
                       f"{c.device_total_bytes / est.gpu_memory_bytes:.0%} of {format_bytes(est.gpu_memory_bytes)}, over the "
                       f"{threshold:.0%} threshold")
            out.append(render(est, colour=False))
            out.append(suggestion(raw, est, world_size, r.gpu, r.gpu_memory, threshold, megatron_version, profile))
            out.append(f"{PREFIX} aborting on every rank before training starts (exit code {ABORT_EXIT_CODE}); mode='warn' "
                       "trains anyway")
        r.message = "\n".join(out)
    except Exception as e:  # only the explanation failed: the decision stands
        if strict:
            raise
        r.message = (f"{PREFIX} {label}: {r.action} (critical stage pp{est.critical_stage}); internal error while "
                     f"explaining it ({type(e).__name__}: {e})")
    if rank0:
        emit(r.message)
    if r.action == "abort":
        raise PreflightAbort(r.message, r)
    return r


def _internal_error(r: PreflightResult, label: str, e: BaseException, emit: Callable[[str], None] | None) -> PreflightResult:
    text = f"{type(e).__name__}: {e}"
    r.action, r.reason = "skipped", f"memguard internal error ({text})"
    if emit is not None:
        emit(f"{PREFIX} {label}: internal error ({text}); training continues unchecked")
    return r


def suggestion(raw: RawConfig, est: Any, world_size: int | None, gpu: Any, gpu_memory: int | None, threshold: float,
               megatron_version: str | None, profile: str) -> str:
    """A layout that fits (micro-batch, pipeline size, recomputation), spelled with the config's keys."""
    from .autotune import autotune, describe_layout_choice
    from .units import format_bytes
    try:
        r = autotune(raw, world_size=world_size, megatron_version=megatron_version, gpu=gpu, gpu_memory=gpu_memory,
                     threshold=threshold, profile=profile, allow_recompute=True, original=est)
    except Exception as e:  # a suggestion is a courtesy
        return f"{PREFIX} (no suggestion: {type(e).__name__}: {e})"
    if r.chosen is None:
        return f"{PREFIX} no micro-batch / pipeline size / recompute change fits:\n" + r.summary()
    from .knobs import override_text
    ch = ", ".join(override_text(raw.key(k), new) for k, (_, new) in r.changes.items() if new is not None and new is not False)
    return (f"{PREFIX} a layout that fits: {describe_layout_choice(r.chosen.layout)} "
            f"({format_bytes(r.chosen.estimate.peak_device_bytes)}): {ch}")


# --------------------------------------------------------------------------------------------------
# The runtime monitor for one rank
# --------------------------------------------------------------------------------------------------
def default_source() -> Any:
    """CudaMemorySource when CUDA is available (torch already imported by the framework), else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if torch.cuda.is_available():
            from .runtime.torch_sources import CudaMemorySource
            return CudaMemorySource()
    except Exception:
        pass
    return None


def build_monitor(source: Any, result: Any, *, ranks: Mapping[str, int], interval: int, log_dir: str | None,
                  extra_sinks: Iterable[Any] = (), reset_peak: bool = False, context: Mapping[str, Any] | None = None,
                  report: ErrorReporter | None = None, emit: Callable[[str], None] | None = None,
                  threshold: float = DEFAULT_THRESHOLD, gather: Callable[[list[float]], Any] | None = None,
                  what: str = "pre-flight") -> Any:
    """The runtime monitor of this rank (the Megatron hook's and the callbacks'): its stage's prediction
    from ``result`` (a PreflightResult or the hook's Decision: its layout and GPU), on the source's device,
    a JSONL file per rank under ``log_dir``, the given sinks and the optional per-stage ``gather``.

    Each part may fail alone (reported through ``report``) without leaving this rank without a monitor:
    the ranks sharing a ``gather`` must all reach it."""
    from .estimator import estimate
    from .runtime.monitor import MemoryMonitor, Prediction
    from .runtime.sinks import JsonlSink

    report = report or ErrorReporter()
    prediction = stage_predictions = None
    note = ""
    layout = getattr(result, "layout", None)
    pp_size = ranks.get("pp_size", 1)
    if layout is None:
        reason = getattr(result, "reason", "") if result is not None else ""
        note = f"no {what} estimate ({reason or 'it did not run'})"
    elif layout.pp != pp_size:
        note = (f"this rank's pipeline stage is unknown (model parallelism is not initialized; the layout has PP "
                f"{layout.pp}): no prediction" if pp_size == 1 else
                f"pipeline size {pp_size} differs from the estimated layout's {layout.pp}: no prediction")
    else:
        try:
            est = estimate(layout, device=source.device, gpu=result.gpu, gpu_memory=result.gpu_memory,
                           threshold=threshold,
                           dp_rank=ranks.get("optimizer_rank", ranks.get("dp_rank", 0)),
                           site=getattr(getattr(result, "estimate", None), "site", None),
                           expert_dp_rank=expert_optimizer_rank(layout, ranks))
            prediction = Prediction.from_estimate(est, ranks.get("pp_rank", 0))
            stage_predictions = [Prediction.from_estimate(est, i) for i in range(len(est.stages))]
        except Exception as e:
            report("the runtime prediction", e)
            note = "the runtime prediction failed"
    sinks = []
    if log_dir:
        try:
            sinks.append(JsonlSink(JsonlSink.path_for(log_dir, ranks.get("rank", 0))))
        except Exception as e:
            report("opening the JSONL log", e)
    sinks.extend(extra_sinks)
    decision = None
    if result is not None:
        try:
            decision = result.to_dict()
        except Exception as e:
            report("recording the decision", e)
    ctx = {**dict(context or {}), "decision": decision, "note": note, **dict(ranks)}
    if layout is not None:
        try:  # what memguard calibrate needs to predict this run again with other site constants
            ctx["layout"] = layout.to_dict()
        except Exception as e:
            report("recording the layout", e)
    return MemoryMonitor(source, prediction, rank=ranks.get("rank", 0), pp_rank=ranks.get("pp_rank", 0), interval=interval,
                         reset_peak=reset_peak, sinks=sinks, emit=emit, emit_error=report.emit_error,
                         log_stages=ranks.get("rank", 0) == 0, stage_predictions=stage_predictions, gather=gather,
                         print_warnings=ranks.get("dp_rank", 0) == 0 and ranks.get("cp_rank", 0) == 0, context=ctx,
                         on_error=report)


_OOM = {"monitor": None, "attached": False}


def attach_oom_observer(monitor: Any) -> None:
    """Print the rank's predicted breakdown next to PyTorch's out-of-memory error (CUDA only)."""
    _OOM["monitor"] = monitor
    if _OOM["attached"]:
        return
    torch = sys.modules.get("torch")
    if torch is None:
        return
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    try:
        if attach is not None and torch.cuda.is_available():
            def observer(device, alloc, device_alloc, device_free):
                m = _OOM["monitor"]
                try:
                    if m is not None:
                        m.on_oom(device, alloc, device_alloc, device_free)
                except Exception:
                    pass
            attach(observer)
            _OOM["attached"] = True
    except Exception:
        pass


def is_oom(exc: BaseException) -> bool:
    """A CUDA out-of-memory error (torch.OutOfMemoryError, or a RuntimeError saying so). Never raises: it
    looks at an exception on its way out of training, which must leave as it came."""
    try:
        torch = sys.modules.get("torch")
        if torch is not None:
            oom = getattr(torch, "OutOfMemoryError", None) or getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
            if isinstance(oom, type) and isinstance(exc, oom):
                return True
        return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    except Exception:   # a torch stand-in without the class, an exception whose message cannot be made
        return False


def env_int(name: str, environ: Mapping[str, str] | None = None) -> int | None:
    """A positive integer from the environment variable ``name`` (None if unset); ConfigError naming it otherwise."""
    environ = os.environ if environ is None else environ
    v = environ.get(name)
    if v is None or v == "":
        return None
    return to_int(v, name, 1, INT64_MAX, "a 64-bit integer")


# --------------------------------------------------------------------------------------------------
# The Transformer Engine the job runs
# --------------------------------------------------------------------------------------------------
def installed_te_version() -> str | None:
    """``transformer_engine.__version__`` when the job has imported TE (Megatron's TE layers do), else its installed
    distribution's version; None when neither is there or readable. Never imports TE (nor torch), never raises."""
    try:
        te = sys.modules.get("transformer_engine")
        v = getattr(te, "__version__", None) if te is not None else None
        if not v:
            from importlib.metadata import version
            v = version("transformer_engine")
        return str(v).split("+", 1)[0] or None
    except Exception:
        return None


def with_installed_te(raw: RawConfig, version: str | None = None) -> RawConfig:
    """``raw`` with MEMGUARD_TE_VERSION set to the job's TE release (``installed_te_version``): inside a job the TE
    that is loaded is the truth, over the core release's default and over the variable (estimator/te_release.py)."""
    from .estimator.te_release import TE_VERSION_VAR, te_version_problem
    v = (version if version is not None else installed_te_version() or "").split("+", 1)[0]
    if not v or te_version_problem(v) or raw.env.get(TE_VERSION_VAR) == v:
        return raw
    return dataclasses.replace(raw, env={**raw.env, TE_VERSION_VAR: v})
