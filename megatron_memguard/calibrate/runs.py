"""Read the runs ``memguard calibrate`` learns from: memguard's runtime JSONL files or Megatron's own logs.

Each path given is one run: a log file, or a directory of one run's files (memguard-rankNNNNN.jsonl, or
Megatron's stdout / stderr of any ranks). A directory whose entries are all directories is a collection:
each subdirectory is a run. A run's configuration comes from its JSONL ``start`` record (the layout the
hook or callback estimated), else from ``--config`` / flags (the same for every run), else from the argument
table Megatron prints at start-up.
"""
from __future__ import annotations

import dataclasses
import os
from collections import Counter
from typing import Any, Callable, Sequence

from ..config import RawConfig
from ..errors import MemguardError, ReaderError
from ..gpus import GpuSpec
from ..layout import FLAT, FLAT_REQUIRED, Layout
from ..report.megatron_log import MegatronLog, read_megatron_logs, skipped_memory_lines
from ..report.megatron_run import rank_position, raw_from_log, tp_pp_dp_mapping
from ..report.runlog import RankRun, read_run
from ..resolve import resolve
from .bridge_runs import bridge_run, is_bridge_run
from .gpu_evidence import Finding, infer_gpu, jsonl_evidence, megatron_evidence, settle
from .model import CalibrationRun, Observation


def expand(paths: Sequence[str]) -> list[str]:
    """One entry per run: a directory of directories stands for its subdirectories."""
    out = []
    for p in paths:
        if os.path.isdir(p):
            entries = sorted(os.path.join(p, e) for e in os.listdir(p) if not e.startswith("."))
            if entries and all(os.path.isdir(e) for e in entries):
                out.extend(entries)
                continue
        if not os.path.exists(p):
            raise ReaderError(f"{p}: no such file or directory")
        out.append(p)
    return out


def _is_jsonl(path: str) -> bool:
    if os.path.isdir(path):
        return any(e.endswith(".jsonl") for e in os.listdir(path))
    return path.endswith(".jsonl")


def layout_from_dict(d: dict[str, Any], where: str) -> Layout:
    """A Layout from its ``to_dict()`` (the JSONL start record's context); ReaderError for another version's."""
    unknown = [k for k in d if k not in FLAT]
    if unknown:
        raise ReaderError(f"{where}: the recorded layout has fields this memguard does not know ({', '.join(unknown[:4])}); "
                          "give the run's configuration with --config")
    missing = [name for name in FLAT_REQUIRED if name not in d]
    if missing:
        raise ReaderError(f"{where}: the recorded layout lacks '{missing[0]}'; give the run's configuration with --config")
    try:
        return Layout.from_dict(d)
    except (TypeError, ValueError) as e:
        raise ReaderError(f"{where}: the recorded layout cannot be read ({e}); give the run's configuration with --config") from None


def _jsonl_run(path: str, gpu: GpuSpec | None, layout_of: Callable[[], Layout] | None) -> tuple[CalibrationRun, Finding]:
    log = read_run([path])
    starts = [r.start for r in log.ranks if r.start]
    ctx = (starts[0] or {}).get("context") or {} if starts else {}
    predicted = (starts[0] or {}).get("predicted") or {} if starts else {}
    device = predicted.get("device") or "gpu"
    if layout_of is not None:
        layout = layout_of()
        source = "memguard JSONL + the given configuration"
    elif isinstance(ctx.get("layout"), dict):
        layout = layout_from_dict(ctx["layout"], path)
        source = "memguard JSONL"
    else:
        raise ReaderError(f"{path}: the JSONL start records carry no layout (written by an older memguard); give the "
                          "run's configuration with --config")
    found = infer_gpu(path, jsonl_evidence(log, path, decision=gpu is None), gpu)
    obs = [_jsonl_observation(r, layout) for r in log.ranks if r.samples and r.pp_rank is not None and 0 <= r.pp_rank < layout.pp]
    if not obs:
        raise ReaderError(f"{path}: no rank with samples and a pipeline stage")
    return CalibrationRun(name=path, layout=layout, gpu=found.gpu, observations=obs, device=device, source=source), found


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _positions(r: RankRun, L: Layout) -> tuple[int, int | None]:
    """(dense optimizer index, expert-DP optimizer index or None) of a JSONL rank, as the runtime hook predicted
    it (_integration.build_monitor): the distributed optimizer's own ``optimizer_rank`` (the DP x CP group) else
    the plain ``dp_rank``; the expert position megatron-core gave (``expert_optimizer_rank``), else worked out
    from that index and ``tp_rank`` (Parallelism.expert_dp_rank: TP ranks past ETP x EP sit further in the
    expert group than TP rank 0), else None (an older log: TP rank 0's position, as before)."""
    ctx = (r.start or {}).get("context") or {}
    dp = _int(ctx.get("optimizer_rank"))
    dp = dp if dp is not None else (_int(ctx.get("dp_rank")) or 0)
    if L.moe is None:
        return dp, None
    edp = _int(ctx.get("expert_optimizer_rank"))
    if edp is None and _int(ctx.get("tp_rank")) is not None:
        edp = L.parallel.expert_dp_rank(dp, ctx["tp_rank"])
    return dp, edp


def _jsonl_observation(r: RankRun, L: Layout) -> Observation:
    last = r.samples[-1].actual
    dev = max((s for s in r.samples if s.actual.get("device_used")), key=lambda s: s.actual["device_used"], default=None)
    dp, edp = _positions(r, L)
    return Observation(rank=r.rank, pp_rank=r.pp_rank or 0, dp_rank=dp, expert_dp_rank=edp, steady=last.get("allocated"),
                       peak_allocated=r.peak("max_allocated"), peak_reserved=r.peak("max_reserved"),
                       device_used=dev.actual["device_used"] if dev else None,
                       reserved=dev.actual.get("reserved") if dev else None)


def megatron_observations(log: MegatronLog, L: Layout, tp_pp_dp: bool) -> list[Observation]:
    obs = []
    for rank in log.ranks:
        if rank >= L.world_size:
            continue
        lines = log.rank_lines(rank)
        steady = [m for m in lines if not m.at_checkpoint and m.iteration]
        dev = max((m for m in lines if m.device_used), key=lambda m: m.device_used or 0, default=None)
        # the rank's own stage and optimizer slices, as memguard report predicts it (rank_position)
        pos = rank_position(rank, L, tp_pp_dp)
        obs.append(Observation(rank=rank, pp_rank=pos.pp, dp_rank=pos.optimizer_rank,
                               expert_dp_rank=pos.expert_optimizer_rank,
                               steady=steady[-1].allocated if steady else None,
                               peak_allocated=max(m.max_allocated for m in lines),
                               peak_reserved=max(m.max_reserved for m in lines),
                               device_used=dev.device_used if dev else None, reserved=dev.reserved if dev else None))
    return obs


def _megatron_run(path: str, gpu: GpuSpec | None, device: str, raw_of: Callable[[MegatronLog], RawConfig],
                  resolve_kw: dict[str, Any]) -> tuple[CalibrationRun, Finding]:
    log = read_megatron_logs([path])
    if not log.memory and not log.iteration_times:
        raise ReaderError(f"{path}: no Megatron memory lines ('[Rank N] (after K iterations) memory (MB) | ...') and no "
                          "memguard-rank*.jsonl files" + skipped_memory_lines(log))
    raw = raw_of(log)
    L = resolve(raw, world_size=resolve_kw.get("world_size") or raw.world_size,
                megatron_version=resolve_kw.get("megatron_version"), vocab_size=resolve_kw.get("vocab_size"))
    obs = megatron_observations(log, L, tp_pp_dp_mapping(raw))
    found = infer_gpu(path, megatron_evidence(log), gpu) if device == "gpu" else Finding(gpu)
    return CalibrationRun(name=path, layout=L, gpu=found.gpu, observations=obs, device=device,
                          source="Megatron log (" + ("argument table" if raw.source.startswith("the argument table")
                                                     else raw.source) + ")", raw=raw,
                          iteration_times=list(log.iteration_times)), found


def read_runs(paths: Sequence[str], *, gpu: GpuSpec | None = None, device: str = "gpu",
              raw: RawConfig | None = None, env: dict[str, str] | None = None,
              resolve_kw: dict[str, Any] | None = None) -> list[CalibrationRun]:
    """The runs under ``paths``. ``raw``: a configuration for every run (else each run's own); ``env``: the
    jobs' memory-relevant environment (Megatron logs do not show it)."""
    resolve_kw = resolve_kw or {}

    def with_env(r: RawConfig) -> RawConfig:
        return dataclasses.replace(r, env={**r.env, **(env or {})}) if env else r

    def raw_of(log: MegatronLog) -> RawConfig:
        return with_env(raw if raw is not None else raw_from_log(log))

    def layout_of() -> Layout:
        assert raw is not None
        r = with_env(raw)
        return resolve(r, world_size=resolve_kw.get("world_size") or r.world_size,
                       megatron_version=resolve_kw.get("megatron_version"), vocab_size=resolve_kw.get("vocab_size"))

    names = expand(paths)
    # (before any run is read: one log named 5,000 times was read and resolved 5,000 times, 20 s, to be refused here)
    same = sorted(n for n, k in Counter(names).items() if k > 1)
    if same:
        raise MemguardError("two runs have the same name: " + ", ".join(same))
    runs, found = [], {}
    for p in names:
        try:
            if _is_jsonl(p):
                run, f = _jsonl_run(p, gpu, layout_of if raw is not None else None)
            elif (blog := is_bridge_run(p)) is not None:     # Megatron-Bridge / NeMo 2 (calibrate/bridge_runs.py)
                run, f = bridge_run(p, blog, gpu, device, raw, env, resolve_kw)
            else:
                run, f = _megatron_run(p, gpu, device, raw_of, resolve_kw)
        except MemguardError as e:
            text = str(e)
            raise ReaderError(text if text.startswith(p) else f"{p}: {text}") from None
        runs.append(run)
        if run.device == "gpu":
            found[run.name] = f
    # the GPU over all runs: one type for all, the runs whose files do not settle it take the others' (gpu_evidence)
    settled = settle(found, gpu)
    for r in runs:
        if r.name in settled:
            r.gpu, note = settled[r.name]
            if note:
                r.notes.append(note)
    return runs


__all__ = ["read_runs", "expand", "layout_from_dict", "megatron_observations"]
