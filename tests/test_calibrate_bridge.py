"""memguard calibrate on Megatron-Bridge and NeMo 2 runs: the run directory Bridge leaves (stdout with its
training_log and GB memory reports, run_config.yaml in the checkpoint directory), made from memguard's estimate
under known site constants (tests/bridge_logs.py writes the lines with the libraries' own format strings). The fit
must recover the constants each line isolates, and refuse runs it cannot use by name."""
import random

import pytest

from bridge_logs import (grid_line, iteration_line, member_line, memory_line, memory_stats, microbatches_line,
                         nemo_progress_line, report_memory)
from megatron_logs import dp0_ranks, interleave
from test_readers_bridge import FLAT, SHAPE
from megatron_memguard import SiteConstants, estimate, lookup_gpu
from megatron_memguard.calibrate import calibrate
from megatron_memguard.calibrate.runs import read_runs
from megatron_memguard.errors import MemguardError
from megatron_memguard.readers.detect import read_config_file
from megatron_memguard.report.bridge_log import read_bridge_logs
from megatron_memguard.report.megatron_run import pp_rank_of
from megatron_memguard.resolve import resolve

MiB = 2**20
A100 = lookup_gpu("A100-80GB")
# (TP, PP, CP, Transformer Engine?, world size): local-layer runs tell the TE workspace from cuBLAS's
LAYOUTS = [(1, 1, 1, True, 8), (2, 1, 1, True, 8), (2, 2, 1, True, 8), (2, 2, 2, True, 16), (1, 2, 1, False, 8),
           (4, 1, 1, False, 8), (2, 1, 2, True, 8)]
TRUE = SiteConstants(cuda_context=700 * MiB, nccl_per_communicator=96 * MiB, allocator_fragmentation=0.12,
                     te_workspace=20 * MiB, cublas_workspace=16 * MiB)


def run_config(tp, pp, cp, te):
    """A Bridge ConfigContainer dump (the keys test_readers_bridge.FLAT has) at this layout."""
    text = FLAT
    for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        text = text.replace(f"  {k}: {SHAPE[k]}\n", f"  {k}: {dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp)[k]}\n")
    text = text.replace("  sequence_parallel: true\n", f"  sequence_parallel: {'true' if tp > 1 else 'false'}\n")
    if not te:
        text = text.replace("  bf16: true\ntrain", "  bf16: true\n  transformer_impl: local\ntrain")
    return text


def write_bridge_runs(root, layouts=LAYOUTS, site=TRUE, world_line="grid", noise=0.0, seed=1, config=True, step=None):
    """One directory per run: stdout.log (every rank's output behind torchrun's prefixes, interleaved; log_interval 5
    of 20 iterations: the memory reports at iteration 5 only, train_utils.py l.1236-1239) and
    checkpoints/iter_0000020/run_config.yaml."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i, (tp, pp, cp, te, world) in enumerate(layouts):
        text = run_config(tp, pp, cp, te)
        d = root / f"run{i}"
        (d / "checkpoints" / "iter_0000020").mkdir(parents=True)
        cfg = d / "checkpoints" / "iter_0000020" / "run_config.yaml"
        cfg.write_text(text)
        raw = read_config_file(str(cfg), environ={})
        L = resolve(raw, world_size=world)
        ms = step(raw, world) * 1000 if step else 1000.0
        if not config:
            cfg.unlink()
        est = estimate(L, gpu=A100, site=site, dp_rank=0)
        dp = world // (tp * pp * cp)
        lines = {"grid": [grid_line(tp, pp, cp, dp)], "member": [member_line(world)],
                 "microbatches": [microbatches_line(32 // (2 * dp))], "none": []}[world_line]
        lines.append("[NeMo I 2026-08-22 10:00:00 utils:123] Setting up optimizer")
        last = world - 1          # print_rank_last's iteration lines; each rank's report behind its launcher prefix
        streams = [[f"[default{last}]:" + iteration_line(it, 20, it * 32, 1.5 * ms if it == 5 else ms * (1 + it * 1e-5), 32)
                    for it in (5, 10, 15, 20)]]
        for r in dp0_ranks(tp, pp, dp, cp):
            st = est.stages[pp_rank_of(r, L)]
            steady, peak, res = (int(v * (1 + rng.gauss(0, noise))) for v in
                                 (st.persistent_bytes, st.peak_allocated_bytes, st.peak_reserved_bytes))
            streams.append([f"[default{r}]:" + memory_line(r, 5, memory_stats(steady, peak, res, res))])
        lines += interleave(*streams, seed=seed + i)      # the ranks' prints in a random order
        (d / "stdout.log").write_text("\n".join(lines) + "\n")
    return root


def test_report_memory_line_by_hand(tmp_path):
    # 30,123,456,789 bytes: / 1e9 = 30.123456789, 5 significant digits -> 30.123 (train_utils.py l.1289-1293)
    stats = memory_stats(30_123_456_789, 45_678_901_234, 47_000_000_000, 47_000_000_000)
    assert report_memory(stats)["mem-allocated-gigabytes"] == 30.123
    line = memory_line(3, 10, stats)
    assert line.startswith("[Rank 3] (after 10 iterations) memory (GB) | mem-allocated-gigabytes: 30.123 | ")
    (tmp_path / "out.log").write_text("[default3]:" + line + "\n")
    (m,) = read_bridge_logs(str(tmp_path)).memory
    # GB is 10**9 bytes (report_memory divides by 1.0e9), not GiB
    assert (m.rank, m.iteration, m.allocated, m.max_allocated, m.max_reserved) == \
        (3, 10, 30_123_000_000, 45_679_000_000, 47_000_000_000)


def test_recovers_known_constants_from_bridge_runs(tmp_path):
    runs = read_runs([str(write_bridge_runs(tmp_path))], gpu=A100)
    assert len(runs) == 7 and sum(len(r.observations) for r in runs) == 1 + 2 + 4 + 8 + 2 + 4 + 4
    assert all(r.source.startswith("Megatron-Bridge log + checkpoints/iter_0000020/run_config.yaml") for r in runs)
    assert [r.layout.world_size for r in runs] == [w for *_, w in LAYOUTS]
    res = calibrate(runs)
    got = res.fitted
    # report_memory keeps 5 significant digits of GB: these runs' figures (0.1-2 GB) to 10 kB-0.1 MB
    assert got["allocator_fragmentation"] == pytest.approx(0.12, abs=1e-3)
    assert got["te_workspace"] == pytest.approx(20 * MiB, abs=0.5 * MiB)
    assert got["cublas_workspace"] == pytest.approx(16 * MiB, abs=0.5 * MiB)
    # Bridge prints no device memory used: the CUDA context and NCCL buffers are never fitted from these runs
    for name in ("cuda_context", "nccl_per_communicator"):
        assert name not in got and next(c for c in res.constants if c.name == name).status == "too little data"


@pytest.mark.parametrize("world_line", ["member", "microbatches"])
def test_world_size_from_lightning_or_the_number_of_microbatches(tmp_path, world_line):
    runs = read_runs([str(write_bridge_runs(tmp_path, layouts=LAYOUTS[2:4], world_line=world_line))], gpu=A100)
    # microbatches: DP = 32 / (2 x 8) = 2 -> world 2 x TP 2 x PP 2 = 8; 32 / (2 x 8)... run 3: DP 2 x 8 = 16
    assert [r.layout.world_size for r in runs] == [8, 16]


def test_world_size_missing_is_named(tmp_path):
    write_bridge_runs(tmp_path, layouts=LAYOUTS[:1], world_line="none")
    with pytest.raises(MemguardError, match="world size is not in its log.*--world-size"):
        read_runs([str(tmp_path / "run0")], gpu=A100)
    (run,) = read_runs([str(tmp_path / "run0")], gpu=A100, resolve_kw={"world_size": 8})
    assert run.layout.world_size == 8


def test_missing_config_is_refused_by_name(tmp_path):
    write_bridge_runs(tmp_path, layouts=LAYOUTS[:1], config=False)
    with pytest.raises(MemguardError, match=r"Megatron-Bridge log without its configuration: no run_config.yaml.*--config"):
        read_runs([str(tmp_path / "run0")], gpu=A100)


def test_a_log_without_usable_measurements_is_refused(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "stdout.log").write_text(grid_line(1, 1, 1, 8) + "\nsome other line\n")
    with pytest.raises(MemguardError, match="Megatron-Bridge log with no usable measurement: no memory report"):
        read_runs([str(d)], gpu=A100)
    # memory lines that keep neither allocated figure (a logger.memory_keys of the user's)
    keys = {"reserved_bytes.all.current": "mem-reserved-bytes"}
    (d / "stdout.log").write_text(grid_line(1, 1, 1, 8) + "\n" + memory_line(0, 1, memory_stats(1, 2, 3, 3), keys) + "\n")
    with pytest.raises(MemguardError, match="lack mem-allocated-gigabytes"):
        read_runs([str(d)], gpu=A100)


def test_truncated_and_interleaved_lines_are_not_misread(tmp_path):
    stats = memory_stats(1_234_567_890, 2_345_678_901, 3_000_000_000, 3_000_000_000)
    a, b = memory_line(0, 5, stats), memory_line(1, 5, stats)
    log = tmp_path / "out.log"
    # rank 0's print cut inside 'mem-allocated-gigabytes: 1.2346' by rank 1's whole line (read: rank 1's own; rank
    # 0's '1.2' is not), then a file whose last line is cut at the same place
    cut = a[:a.index("1.2346") + 3]
    log.write_text("[default0]:" + cut + "[default1]:" + b + "\n" + "[default0]:" + cut)
    bl = read_bridge_logs(str(log))
    assert [(m.rank, m.allocated) for m in bl.memory] == [(1, 1_234_600_000)]
    assert bl.bad_lines == 1 and any("cut off" in n for n in bl.notes)


def test_step_times_from_bridge_and_nemo2_lines(tmp_path):
    runs = read_runs([str(write_bridge_runs(tmp_path, layouts=LAYOUTS[:1]))], gpu=A100)
    from megatron_memguard.calibrate.timeruns import measured_step
    # intervals 10, 15, 20 (the first, 1,500 ms of warm-up, left out): 1,000.1 / 1,000.15 / 1,000.2 ms, printed
    # with {:.1f} as 1000.1 / 1000.2 / 1000.2 -> median 1.0002 s
    assert measured_step(runs[0].iteration_times, "run")[0] == pytest.approx(1.0002, abs=1e-9)
    # NeMo 2's ProgressPrinter: 'train_step_timing in s' to 4 significant digits, iteration n - 1
    d = tmp_path / "nemo"
    d.mkdir()
    lines = [member_line(8)] + [nemo_progress_line(n, 100, {"lr": 3e-4, "global_batch_size": 32.0, "global_step": float(n - 1),
                                                              "reduced_train_loss": 10.47, "train_step_timing in s": t,
                                                              "consumed_samples": float(32 * n)})
                                for n, t in ((10, 2.5), (20, 1.23456), (30, 1.2))]
    assert "| train_step_timing in s: 1.235 |" in lines[2] and "iteration 19/99" in lines[2]
    (d / "out.log").write_text("\n".join(lines) + "\n")
    bl = read_bridge_logs(str(d))
    assert bl.world_size == 8 and bl.nemo_times == [(9, 2500.0, None), (19, 1235.0, None), (29, 1200.0, None)]
    assert measured_step(bl.nemo_times, "nemo")[0] == pytest.approx((1.235 + 1.2) / 2)
    # a NeMo 2 log needs its configuration too (NeMo 2 checkpoints keep it in context/model.yaml)
    with pytest.raises(MemguardError, match="NeMo 2 log without its configuration.*context/model.yaml"):
        read_runs([str(d)], gpu=A100)


def test_recovers_a_known_gemm_efficiency_from_bridge_step_times(tmp_path):
    # step times the planner's model gives each run's own layout at a GEMM efficiency of 0.5 (the A100 row's 0.78
    # otherwise); Bridge prints them to 0.1 ms, with 100-200 ppm of drift between intervals here
    from megatron_memguard.calibrate.timeruns import run_predictor
    from megatron_memguard.cli.calibrate import fit_times
    from megatron_memguard.time_constants import TIME_CONSTANTS

    known = {c.name: c.default(A100) for c in TIME_CONSTANTS}
    known["gemm_efficiency"] = 0.5
    runs = read_runs([str(write_bridge_runs(tmp_path, step=lambda raw, w: run_predictor(raw, A100, w)[0](known)))],
                     gpu=A100)
    tf, notes = fit_times(runs, {}, ["gemm_efficiency"], 3, None)
    assert tf is not None and tf.fitted["gemm_efficiency"] == pytest.approx(0.5, rel=0.002), notes


def test_memguard_report_reads_a_bridge_run(tmp_path):
    # made with memguard's default constants: report_memory's 5 significant digits are the only difference
    import json
    import subprocess
    import sys

    from conftest import ROOT
    from megatron_memguard.estimator.site import DEFAULT_SITE

    write_bridge_runs(tmp_path, layouts=LAYOUTS[2:3], site=DEFAULT_SITE)
    r = subprocess.run([sys.executable, "-m", "megatron_memguard.cli.main", "report", str(tmp_path / "run0"), "--gpu",
                        "A100-80GB", "--json"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    # TP 2 x PP 2 on 8 GPUs: Bridge's reports of DP rank 0 at each (TP, PP) position, ranks 0, 1, 4, 5
    assert [(x["rank"], x["pp_rank"]) for x in doc["ranks"]] == [(0, 0), (1, 0), (4, 1), (5, 1)]
    for x in doc["ranks"]:
        # GB to 5 significant digits of these 0.27-0.28 GB peaks: within 5 kB, under 2e-5
        assert abs(x["error_max_allocated"]) < 2e-5 and abs(x["error_max_reserved"]) < 2e-5
        assert x["actual_device_used"] is None         # Bridge prints no device memory used
    assert any("run_config.yaml" in n for n in doc["notes"])
    # without run_config.yaml and --config: the same named refusal as calibrate's
    (tmp_path / "run0" / "checkpoints" / "iter_0000020" / "run_config.yaml").unlink()
    r = subprocess.run([sys.executable, "-m", "megatron_memguard.cli.main", "report", str(tmp_path / "run0")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "no run_config.yaml" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_a_log_file_given_alone_takes_only_the_config_beside_it(tmp_path):
    write_bridge_runs(tmp_path, layouts=LAYOUTS[1:2])
    d = tmp_path / "run0"
    with pytest.raises(MemguardError, match="no run_config.yaml"):      # (the checkpoint's is not searched for)
        read_runs([str(d / "stdout.log")], gpu=A100)
    (d / "run_config.yaml").write_text((d / "checkpoints" / "iter_0000020" / "run_config.yaml").read_text())
    (run,) = read_runs([str(d / "stdout.log")], gpu=A100)
    assert run.source == "Megatron-Bridge log + run_config.yaml" and (run.layout.tp, run.layout.world_size) == (2, 8)
    assert [o.rank for o in run.observations] == [0, 1]


def test_a_nemo2_run_joins_the_time_fit_only(tmp_path):
    import os
    import shutil

    from benchmarks.shared_data import CONFIGS
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    from test_calibrate import BASE

    d = tmp_path / "nemo"
    (d / "ckpt" / "step=99" / "context").mkdir(parents=True)
    # a NeMo 2 checkpoint's context/model.yaml (shared/configs/nemo2): the model's config, no batch sizes
    shutil.copy(os.path.join(CONFIGS, "nemo2", "context_model.yaml"), d / "ckpt" / "step=99" / "context" / "model.yaml")
    lines = [member_line(8)] + [nemo_progress_line(n, 100, {"reduced_train_loss": 10.47, "train_step_timing in s": t})
                                for n, t in ((10, 2.5), (20, 1.2), (30, 1.2))]
    (d / "out.log").write_text("\n".join(lines) + "\n")
    with pytest.raises(MemguardError, match=r"context/model.yaml holds NeMo 2's model only .*--micro-batch-size"):
        read_runs([str(d)], gpu=A100)
    (run,) = read_runs([str(d)], gpu=A100, raw=parse_megatron_flags(BASE))
    assert run.source == "NeMo 2 log + the given configuration" and run.layout.world_size == 8   # MEMBER: 1/8
    assert run.observations == [] and run.iteration_times == [(9, 2500.0, None), (19, 1200.0, None), (29, 1200.0, None)]
    assert any("step times join the time fit only" in n for n in run.notes)


def test_rank_0_only_step_times_from_bridge_step_time_lines(tmp_path):
    from bridge_logs import step_time_line
    from megatron_memguard.calibrate.timeruns import measured_step

    write_bridge_runs(tmp_path, layouts=LAYOUTS[:1])
    d = tmp_path / "run0"
    # rank 0's file only: its report and Bridge's 'Step Time' lines, no iteration line (print_rank_last)
    text = (d / "stdout.log").read_text()
    keep = [x for x in text.splitlines() if "elapsed time per iteration" not in x]
    keep += [step_time_line(s, 150.0) for s in (3.2, 1.2345, 1.2, 1.25)]
    (d / "stdout.log").write_text("\n".join(keep) + "\n")
    (run,) = read_runs([str(d)], gpu=A100)
    # printed to 10 ms: 3.20 (warm-up, left out), 1.23 ({:.2f} of 1.2345), 1.20, 1.25 -> median 1.23 s
    assert measured_step(run.iteration_times, "run0") == (pytest.approx(1.23), 150.0, 3)
    assert any("'Step Time' lines" in n for n in run.notes)
    # steps under half a second, to 10 ms, would be off by more than 1%: not used (the memory reports still are)
    (d / "stdout.log").write_text("\n".join(keep[:-4] + [step_time_line(0.31, 90.0)] * 3) + "\n")
    (run,) = read_runs([str(d)], gpu=A100)
    assert run.iteration_times == [] and len(run.observations) == 1
