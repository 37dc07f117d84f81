"""Read a Megatron-Bridge or NeMo 2 run for ``memguard calibrate``: its configuration from the ``run_config.yaml``
Bridge writes beside each checkpoint (NeMo 2: the checkpoint's ``context/model.yaml``), or ``--config``; its
memory reports and step times from its stdout (:mod:`..report.bridge_log`, :mod:`..report.megatron_log`); its GPU
as for Megatron logs.

Each measurement goes to the level it isolates (docs/calibrate.md): Bridge's ``mem-allocated-gigabytes`` is the
memory held after the optimizer step (the allocated level's workspaces), its ``mem-max-reserved-gigabytes`` over
``mem-max-allocated-gigabytes`` the allocator's slack; neither Bridge nor NeMo 2 prints device memory used, so these
runs never fit the CUDA context or NCCL buffers. Bridge's iteration line is Megatron's (``elapsed time per
iteration (ms)``); NeMo 2's progress line gives ``train_step_timing in s``, averaged over the logged interval: both
feed the time fit, the first logged interval left out (warm-up).
"""
from __future__ import annotations

import os
from typing import Any

from ..config import RawConfig
from ..errors import ConfigError, ConfigErrors, ReaderError
from ..gpus import GpuSpec
from ..layout import Layout
from ..report.bridge_log import BridgeLog, read_bridge_logs
from ..report.megatron_log import read_megatron_logs
from ..report.megatron_run import rank_position, tp_pp_dp_mapping
from ..resolve import resolve
from .gpu_evidence import Finding, infer_gpu, megatron_evidence
from .model import CalibrationRun, Observation

CONFIG_NAMES = ("run_config.yaml",)           # Megatron-Bridge, utils/checkpoint_utils.py CONFIG_FILE
NEMO2_CONFIG = os.path.join("context", "model.yaml")   # NeMo 2 checkpoints (nemo/lightning/io)
STEP_TIME_MIN_S = 0.5                         # 'Step Time : 0.50s' is within 1% of the step whatever its third digit
MAX_DEPTH = 4                                 # run/checkpoints/iter_0000100/run_config.yaml, run/ckpt/step=9/context


def find_config(path: str) -> str | None:
    """The run's own configuration file: the newest checkpoint's ``run_config.yaml`` (or NeMo 2's
    ``context/model.yaml``) in the run's directory, searched ``MAX_DEPTH`` deep; for a log file given alone, only
    a ``run_config.yaml`` beside it (its directory may hold other runs, or be a home directory)."""
    if not os.path.isdir(path):
        beside = os.path.join(os.path.dirname(os.path.abspath(path)), CONFIG_NAMES[0])
        return beside if os.path.isfile(beside) else None
    root = path
    found: list[str] = []
    base = root.rstrip(os.sep).count(os.sep)
    for d, dirs, files in os.walk(root):
        if d.count(os.sep) - base >= MAX_DEPTH:
            dirs[:] = []
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        if any(f in files for f in CONFIG_NAMES):
            found.append(os.path.join(d, CONFIG_NAMES[0]))
        elif os.path.basename(d) == "context" and "model.yaml" in files:
            found.append(os.path.join(d, "model.yaml"))
    # (checkpoint directories are named by iteration, zero-padded: the last in order is the newest)
    return sorted(found)[-1] if found else None


def world_size_of(blog: BridgeLog, raw: RawConfig, given: int | None, where: str) -> int:
    """The run's world size: ``--world-size`` (or --nnodes x --nproc-per-node), Bridge's HyperCommGrid line,
    Lightning's MEMBER line, DP from megatron-core's number of microbatches, the configuration's own; else a
    ReaderError naming the options."""
    if given:
        return given
    a = raw.args
    tp, pp, cp = (a.get("tensor_model_parallel_size") or 1, a.get("pipeline_model_parallel_size") or 1,
                  a.get("context_parallel_size") or 1)
    if blog.grid is not None:
        gtp, gpp, gcp, gdp = blog.grid
        return gtp * gpp * gcp * gdp
    if blog.world_size:
        return blog.world_size
    gbs, mbs = a.get("global_batch_size"), a.get("micro_batch_size") or 1
    if blog.microbatches and isinstance(gbs, int) and gbs % (mbs * blog.microbatches) == 0:
        return gbs // (mbs * blog.microbatches) * tp * pp * cp
    if raw.world_size:
        return raw.world_size
    raise ReaderError(f"{where}: the run's world size is not in its log (no '> initialized HyperCommGrid ... dp=N', "
                      "'Initializing distributed: ... MEMBER: 1/N' or 'setting number of microbatches to constant N' "
                      "line) nor in its configuration; give it with --world-size N (or --nnodes and --nproc-per-node)")


def bridge_observations(blog: BridgeLog, L: Layout, tp_pp_dp: bool) -> list[Observation]:
    """Per logged rank: the last report's allocated (after the optimizer step) and the peaks over its reports."""
    obs = []
    for rank, lines in sorted(blog.by_rank().items()):
        if rank >= L.world_size:
            continue
        pos = rank_position(rank, L, tp_pp_dp)
        steady = [m.allocated for m in lines if m.allocated is not None]
        peaks = [m.max_allocated for m in lines if m.max_allocated is not None]
        res = [m.max_reserved for m in lines if m.max_reserved is not None]
        obs.append(Observation(rank=rank, pp_rank=pos.pp, dp_rank=pos.optimizer_rank,
                               expert_dp_rank=pos.expert_optimizer_rank, steady=steady[-1] if steady else None,
                               peak_allocated=max(peaks) if peaks else None,
                               # the slack is peak reserved over peak allocated: one without the other shows nothing
                               peak_reserved=max(res) if res and peaks else None))
    return obs


def bridge_config(path: str, blog: BridgeLog, raw: RawConfig | None, env: dict[str, str] | None, world: int | None,
                  kind: str = "Megatron-Bridge") -> tuple[RawConfig, str]:
    """(the run's configuration with its world size, where it came from): ``raw`` (--config) else the run's own
    run_config.yaml / context/model.yaml; ReaderError naming what is missing."""
    import dataclasses

    from ..readers.detect import read_config_file

    if raw is None:
        cfg = find_config(path)
        if cfg is None:
            raise ReaderError(f"{path}: a {kind} log without its configuration: no run_config.yaml (Megatron-Bridge "
                              "writes it into each checkpoint directory) or context/model.yaml (NeMo 2) under the "
                              "run's directory; give it with --config FILE")
        raw = read_config_file(cfg, environ={})
        source = f"{kind} log + {os.path.relpath(cfg, path if os.path.isdir(path) else os.path.dirname(path))}"
    else:
        source = f"{kind} log + the given configuration"
    if env:
        raw = dataclasses.replace(raw, env={**raw.env, **env})
    return dataclasses.replace(raw, world_size=world_size_of(blog, raw, world, path)), source


def bridge_run(path: str, blog: BridgeLog, gpu: GpuSpec | None, device: str, raw: RawConfig | None,
               env: dict[str, str] | None, resolve_kw: dict[str, Any]) -> tuple[CalibrationRun, Finding]:
    """The run at ``path`` whose logs ``blog`` holds; ReaderError naming what is missing."""
    kind = "NeMo 2" if blog.nemo_progress and not blog.memory else "Megatron-Bridge"
    mlog = read_megatron_logs([path])
    times = list(mlog.iteration_times) or list(blog.nemo_times)
    notes = []
    if not times and blog.step_times:
        # (only rank 0's output: Bridge's 'Step Time' line, to 10 ms; a step under STEP_TIME_MIN_S would be off by
        # more than 1% for the rounding alone)
        times = [t for t in blog.step_times if t[1] >= STEP_TIME_MIN_S * 1000]
        notes.append(f"step times from Bridge's rank-0 'Step Time' lines (to 10 ms; {len(times)} of "
                     f"{len(blog.step_times)} at {STEP_TIME_MIN_S:g} s or more used): the last rank's iteration lines "
                     "are not in the files")
    usable = [m for m in blog.memory if m.allocated is not None or m.max_allocated is not None]
    if not usable and not times:
        why = ("its memory lines lack mem-allocated-gigabytes and mem-max-allocated-gigabytes (logger.memory_keys)"
               if blog.memory else
               "no memory report ('[Rank N] (after K iterations) memory (GB) | mem-allocated-gigabytes: ...', "
               "Bridge's training_log) and no step time ('elapsed time per iteration (ms)', Bridge's 'Step Time : X.XXs' of "
               f"{STEP_TIME_MIN_S:g} s or more, or NeMo 2's 'train_step_timing in s')")
        raise ReaderError(f"{path}: a {kind} log with no usable measurement: {why}")
    raw, source = bridge_config(path, blog, raw, env, resolve_kw.get("world_size"), kind)
    world = raw.world_size
    try:
        L = resolve(raw, world_size=world, megatron_version=resolve_kw.get("megatron_version"),
                    vocab_size=resolve_kw.get("vocab_size"))
    except (ConfigError, ConfigErrors) as e:
        if not source.endswith(NEMO2_CONFIG):
            raise
        # (NeMo 2's context/model.yaml is the model's config: the batch sizes live in the data module)
        raise ReaderError(f"{path}: {source.split(' + ')[1]} holds NeMo 2's model only and the layout needs more ({e}); "
                          "give the run's configuration with --config FILE (or its flags after --)") from None
    obs = bridge_observations(blog, L, tp_pp_dp_mapping(raw)) if usable else []
    if blog.memory and not obs:
        raise ReaderError(f"{path}: its memory lines name only ranks at or past the world size {world}")
    found = infer_gpu(path, megatron_evidence(mlog), gpu) if device == "gpu" else Finding(gpu)
    run = CalibrationRun(name=path, layout=L, gpu=found.gpu, observations=obs, device=device, source=source, raw=raw,
                         iteration_times=times)
    run.notes.extend(notes)
    if not obs:
        run.notes.append(f"{kind} log without memory reports: its step times join the time fit only")
    return run, found


def is_bridge_run(path: str) -> BridgeLog | None:
    """The Bridge / NeMo 2 lines of the run at ``path`` when it has any (None: a Megatron-LM log)."""
    try:
        blog = read_bridge_logs([path])
    except ReaderError:
        return None          # (the Megatron reader says what is wrong with the path)
    # (a Bridge run whose log lost its memory lines still has its run_config.yaml)
    return blog if blog.is_bridge or (find_config(path) or "").endswith(CONFIG_NAMES) else None


__all__ = ["bridge_run", "bridge_config", "is_bridge_run", "find_config", "world_size_of", "bridge_observations"]
