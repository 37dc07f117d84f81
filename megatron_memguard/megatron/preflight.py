"""The pre-allocation decision, taken inside Megatron's ``validate_args`` (``validate_yaml`` for
``--yaml-cfg`` runs) before it runs for real.

1. Megatron's own ``validate_args`` runs on a deep copy of the raw arguments with its output
   silenced (it is not idempotent: it deletes deprecated attributes). If it rejects them, memguard
   stays out of the way and the real call reports Megatron's error.
2. The raw arguments (plus ``args_defaults``) become a ``RawConfig``; ``resolve`` applies Megatron's
   rules and ``estimate`` predicts every pipeline stage against this rank's GPU (or
   ``--memguard-gpu-memory``).
3. By mode: ``report`` prints the estimate; ``warn`` prints one line, or a warning with the breakdown
   when the critical stage exceeds the threshold; ``abort`` raises ``MemguardAbort`` (a clean
   ``SystemExit``) on every rank, rank 0 printing the breakdown and a layout that would fit;
   ``autotune`` searches (``megatron_memguard.autotune``) and returns the argument updates, each
   winning candidate first dry-run through Megatron's ``validate_args`` as well.

Everything here is a pure function of the arguments, the GPU memory and the threshold, so every rank
decides the same without communicating.
"""
from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import warnings
from typing import Any, Callable, Iterator, Mapping

from ..decision import ABORT_EXIT_CODE, PREFIX, Decision, MemguardAbort, expert_grid_failure, megatron_failure  # noqa: F401 (MemguardAbort: re-exported)
from ..autotune import autotune, describe_layout_choice
from ..config import RawConfig
from ..estimator import Estimate, estimate
from ..errors import MemguardError
from ..gpus import GpuSpec
from ..knobs import flag_text
from ..readers.megatron_namespace import raw_from_namespace
from .._integration import with_installed_te
from ..report.text import moe_line, render, stage_summary, verdict_line, worst_moe_stage
from ..resolve import resolve
from ..units import format_bytes
from .device import device_properties, gpu_spec_for
from .flags import Settings



@contextlib.contextmanager
def silenced() -> Iterator[None]:
    """Swallow stdout, stderr, warnings and logging (Megatron's validate_args prints the whole arg table)."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                yield
    finally:
        logging.disable(previous)


def copy_args(args: Any, depth: int = 0) -> Any:
    """A deep copy of Megatron's namespace for a dry run. A value that cannot be copied (a lock, a generator,
    an open file that other code hung on the namespace) is shared instead of failing the whole copy:
    ``validate_args`` replaces attributes rather than changing such objects in place."""
    try:
        return copy.deepcopy(args)
    except Exception:
        pass
    if depth < 4 and isinstance(getattr(args, "__dict__", None), dict) and not isinstance(args, type):
        try:
            ns = copy.copy(args)
            for k, v in vars(args).items():
                vars(ns)[k] = copy_args(v, depth + 1)
            return ns
        except Exception:
            pass
    return args


def dry_run(validate: Callable, args: Any, defaults: Mapping[str, Any] | None,
            updates: Mapping[str, Any] | None = None,
            assign: Callable[[Any, str, Any], None] = setattr) -> BaseException | None:
    """Run ``validate`` on a copy of ``args`` (with ``updates``, set by ``assign``); return its exception,
    or None if it passes."""
    ns = copy_args(args)
    for k, v in (updates or {}).items():
        assign(ns, k, v)
    try:
        with silenced():
            validate(ns, copy_args(dict(defaults or {})))
    except (Exception, SystemExit) as e:  # Megatron calls exit() for some deprecated flags
        return e
    return None


def _describe_exc(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def raw_config_from_args(args: Any, defaults: Mapping[str, Any] | None = None) -> RawConfig:
    """The RawConfig validate_args sees: parsed arguments with ``args_defaults`` filled in where unset."""
    ns = copy.copy(args)
    for k, v in (defaults or {}).items():
        if getattr(ns, k, None) is None:
            setattr(ns, k, v)
    return raw_from_namespace(ns)


def _settings_line(settings: Settings, gpu: GpuSpec | None, mem: int | None, source: str) -> str:
    where = f"{gpu.name if gpu else 'GPU'} {format_bytes(mem)}" if mem else "unknown GPU memory"
    site = f", site profile {settings.profile}" if settings.profile else ""
    return f"{PREFIX} mode {settings.mode}, threshold {settings.threshold:.0%}, {where} ({source}){site}"


def _rank(args: Any, environ: Mapping[str, str]) -> int:
    """This rank: Megatron's ``args.rank`` (an int it set from RANK), else RANK; a value that is no
    integer counts as rank 0 (the one that prints), as the check itself does not depend on it."""
    rank = getattr(args, "rank", None)
    for v in (rank, environ.get("RANK")) if rank is not None else (environ.get("RANK"),):
        if isinstance(v, bool) or v is None:
            continue
        try:
            return int(v)
        except (TypeError, ValueError, OverflowError):
            continue
    return 0


def decide(args: Any, defaults: Mapping[str, Any] | None, validate: Callable, settings: Settings, *,
           megatron_version: str | None, environ: Mapping[str, str] | None = None,
           emit: Callable[[str], None] | None = None,
           assign: Callable[[Any, str, Any], None] = setattr, validator: str = "validate_args") -> Decision:
    """Take the pre-allocation decision for ``args`` (the raw arguments, before validation). ``assign``
    sets an argument update where ``validate`` reads it (a ``--yaml-cfg`` namespace has sections);
    ``validator`` names ``validate`` in messages."""
    environ = os.environ if environ is None else environ
    rank0 = _rank(args, environ) == 0
    out: list[str] = []

    def say(text: str) -> None:
        out.append(text)

    d = Decision(mode=settings.mode, action="skipped", megatron_version=megatron_version)
    def check(updates: Mapping[str, Any] | None = None) -> BaseException | None:
        return dry_run(validate, args, defaults, updates, assign)
    check.validator = validator  # type: ignore[attr-defined]

    err = check()
    if err is not None:
        d.reason = f"Megatron's {validator} rejects the arguments ({_describe_exc(err)}); it will report it"
        return d

    # GPU memory of this rank's device (or the flag).
    if settings.gpu_memory:
        d.gpu_memory, d.gpu_memory_source = settings.gpu_memory, "--memguard-gpu-memory"
        name, _, _ = device_properties(environ)  # the device name still picks GPU-specific workspaces
        d.gpu = gpu_spec_for(name, settings.gpu_memory)
    else:
        name, total, src = device_properties(environ)
        d.gpu, d.gpu_memory, d.gpu_memory_source = gpu_spec_for(name, total), total, src

    try:
        raw = with_installed_te(raw_config_from_args(args, defaults))   # the TE the job loaded
        layout = resolve(raw, world_size=raw.world_size, megatron_version=megatron_version)
        site = None
        if settings.profile:
            from ..site_profile import load_site_profile
            # checked when parsed; read again here (a namespace set by other code, a file changed since)
            site = load_site_profile(settings.profile, key="--memguard-profile").constants
        # (inside: the estimate refuses what only the GPU decides, e.g. no TE attention backend under CP)
        est = estimate(layout, gpu=d.gpu, gpu_memory=d.gpu_memory, threshold=settings.threshold, site=site)
    except MemguardError as e:
        d.action, d.reason = "unsupported", str(e)
        later = megatron_failure(e) or _expert_grid_failure(args, environ)
        if rank0:
            (emit or print)(f"{PREFIX} cannot estimate this configuration: {e}; "
                            + (f"Megatron's {validator} accepts it but {later}" if later else "training continues unchecked"))
        return d
    d.layout, d.estimate = layout, est
    say(_settings_line(settings, d.gpu, d.gpu_memory, d.gpu_memory_source))

    if est.verdict == "unknown":
        d.action = "unknown"
        say(f"{PREFIX} GPU memory unknown ({d.gpu_memory_source or 'no device'}): give --memguard-gpu-memory to check; "
            "the estimate follows")
        say(render(est, colour=False, all_stages=settings.mode == "report"))
    elif settings.mode == "report":
        d.action = "reported"
        say(render(est, colour=False, all_stages=True))
    elif est.verdict == "fits":
        d.action = "fits"
        say(f"{PREFIX} {verdict_line(est)}")
        if any(s.moe for s in est.stages):   # the verdict assumes balanced routing: what imbalance may do
            w = worst_moe_stage(est)   # the stage whose worst case needs the most
            say(f"{PREFIX} pp{w.pp_rank} {moe_line(w, est.gpu_memory_bytes, est.threshold)}")
    elif settings.mode == "warn":
        d.action = "warned"
        say(f"{PREFIX} WARNING: the critical stage exceeds {settings.threshold:.0%} of GPU memory; training continues "
            "(--memguard abort stops here, --memguard autotune changes micro-batch / pipeline size)")
        say(render(est, colour=False))
    elif settings.mode == "abort":
        d.action = "abort"
        c = est.critical
        say(f"{PREFIX} ABORT: stage pp{c.pp_rank} needs {format_bytes(c.device_total_bytes)} = "
            f"{c.device_total_bytes / est.gpu_memory_bytes:.0%} of {format_bytes(est.gpu_memory_bytes)}, over the "
            f"{settings.threshold:.0%} threshold")
        say(render(est, colour=False))
        say(_suggestion(raw, est, d.gpu, settings, megatron_version, check))
        say(f"{PREFIX} aborting on every rank before any GPU memory is allocated (--memguard abort, exit code "
            f"{ABORT_EXIT_CODE}); --memguard warn trains anyway, --memguard autotune applies a layout that fits")
    elif settings.mode == "autotune":
        _autotune(d, raw, est, settings, megatron_version, check, say)
    d.message = "\n".join(out)
    if rank0 and d.message:
        (emit or print)(d.message)
    return d


def _accept(check: Callable[[Mapping[str, Any]], BaseException | None]):
    def accept(updates: Mapping[str, Any]) -> str | None:
        e = check(updates)
        return f"Megatron's {getattr(check, 'validator', 'validate_args')} rejects it ({_describe_exc(e)})" if e is not None else None
    return accept


def _suggestion(raw, est: Estimate, gpu, settings: Settings, version, check) -> str:
    try:
        r = autotune(raw, original=est, megatron_version=version, gpu=gpu, gpu_memory=est.gpu_memory_bytes,
                     threshold=settings.threshold, allow_recompute=settings.allow_recompute,
                     accept=_accept(check))
    except Exception as e:  # a suggestion is a courtesy
        return f"{PREFIX} (no suggestion: {_describe_exc(e)})"
    if r.chosen is None:
        return f"{PREFIX} no micro-batch / pipeline size" + (" / recompute" if settings.allow_recompute else "") + \
            " change found that fits:\n" + r.summary()
    ch = ", ".join(flag_text(k, new) for k, (_, new) in r.changes.items() if new is not None and new is not False)
    return (f"{PREFIX} a layout that fits: {describe_layout_choice(r.chosen.layout)} "
            f"({format_bytes(r.chosen.estimate.peak_device_bytes)}): {ch}")


def _expert_grid_failure(args, environ) -> str | None:
    return expert_grid_failure(lambda n: getattr(args, n, None),
                               getattr(args, "world_size", None) or environ.get("WORLD_SIZE"))


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _autotune(d: Decision, raw, est: Estimate, settings: Settings, version, check, say) -> None:
    r = autotune(raw, original=est, megatron_version=version, gpu=d.gpu, gpu_memory=d.gpu_memory,
                 threshold=settings.threshold, allow_recompute=settings.allow_recompute,
                 accept=_accept(check))
    d.autotune = r
    if r.chosen is not None:
        d.action = "tuned"
        d.updates = r.updates
        d.layout, d.estimate = r.chosen.layout, r.chosen.estimate
        changed = ", ".join(f"{k} {_shown(old) if old is not None else '(default)'} -> {_shown(new)}"
                            for k, (old, new) in r.changes.items())
        say(f"{PREFIX} autotune changed {changed}")
        say("\n".join(f"{PREFIX}   {line}" for line in r.summary().splitlines()))
        say(stage_summary(r.chosen.estimate))
        return
    # Nothing within the threshold: a tight job is not started either (it may run out of memory hours in).
    d.action = "abort"
    say(render(est, colour=False))
    say("\n".join(f"{PREFIX}   {line}" for line in r.summary().splitlines()))
    say(f"{PREFIX} autotune found no layout within {settings.threshold:.0%} of GPU memory; aborting on every rank "
        f"before any GPU memory is allocated (exit code {ABORT_EXIT_CODE})")
