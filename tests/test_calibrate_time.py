"""`memguard calibrate`'s time constants: fitted from measured step times (the real sweeps of
shared/groundtruth/throughput stand for a site's runs), refused when the runs cannot show them, written to the
site profile's time section and used by `memguard plan` (its options winning)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from megatron_logs import args_of, print_args
from megatron_memguard.calibrate.timefit import TimedRun, fit_time_constants
from megatron_memguard.calibrate.timeruns import measured_step
from megatron_memguard.errors import ConfigError, ReaderError
from megatron_memguard.report.megatron_log import read_megatron_logs
from megatron_memguard.site_profile import dump_site_profile, parse_site_profile

pq = pytest.importorskip("benchmarks.planner_quality")
ct = pytest.importorskip("benchmarks.calibrate_time")
if not os.path.exists(pq.FUJII_CSV):
    pytest.skip("shared/groundtruth/throughput is not here (MEMGUARD_SHARED)", allow_module_level=True)


def _sweep(family: str, name: str):
    sweeps = pq.fujii_sweeps() if family == "fujii" else pq.hagemann_sweeps()
    return next(s for s in sweeps if s.name == name)


def test_gemm_efficiency_fitted_on_a_measured_sheet_is_the_median_of_what_each_run_asks_for():
    # Hagemann et al.'s LLaMA-65B s2048 64-GPU sheet: 27 layouts that ran, measured step times (avg_step_time_s),
    # GEMMs 71-89% of each predicted step. The GEMM efficiency that makes run i exact is, by hand,
    # 0.78 x gemm_i / (measured_i - (predicted_i - gemm_i)) (the gemm term scales as 1 / efficiency); minimising
    # sum |log(measured / predicted)| over one constant gives the median of these, each weighed by the share of
    # its step that moves with the constant (gemm_i / predicted_i).
    sw = _sweep("hagemann", "LLaMA-65B s2048 64 x A100-80GB")
    runs = [r for r in ct.timed_runs(sw, ct.hagemann_steps()) if "full-rc" not in r.label]
    assert len(runs) == 27
    d = ct.defaults_of(sw)
    fit = fit_time_constants(runs, d)
    got = {c.name: c for c in fit.constants}
    assert got["gemm_efficiency"].fitted and got["gemm_efficiency"].runs == 27
    p = pq.planner_for(sw)
    cand = {s.run.label: s.candidate for s in pq.score(sw, p)}
    asks = []
    for r in runs:
        st = p.step_time(cand[r.label])
        g = next(t.seconds for t in st.terms if t.name == "gemm")
        asks.append((d["gemm_efficiency"] * g / (r.measured - (st.seconds - g)), g / st.seconds))
    asks.sort()
    half, acc = sum(w for _, w in asks) / 2, 0.0
    for eff, w in asks:
        acc += w
        if acc >= half:
            break
    assert got["gemm_efficiency"].value == pytest.approx(eff, abs=0.005)      # 0.657 and 0.656
    assert 0.6 < eff < 0.7
    assert fit.median_after < fit.median_before / 2       # the sheet's steps: 16% -> 5% (benchmarks/calibrate_time.py)


def test_constants_the_megatron_sweeps_cannot_tell_apart_keep_their_defaults():
    # Fujii et al.'s Megatron sweeps, all at sequence 8192: attention takes 16-23% of every step and GEMMs
    # 65-72%, nearly the same ratio everywhere, so the runs pin the attention efficiency only to far worse than 5%
    # once the GEMM efficiency is fitted; the network carries 5% of the step in fewer than 3 layouts
    runs = [r for sw in pq.fujii_sweeps() for r in ct.timed_runs(sw, {})]
    fit = fit_time_constants(runs, ct.defaults_of(pq.fujii_sweeps()[0]))
    got = {c.name: c for c in fit.constants}
    assert got["attention_efficiency"].status == "not identifiable" and not got["attention_efficiency"].fitted
    assert "gemm_efficiency" in got["attention_efficiency"].reason
    assert got["network_gbps"].status == "too little data" and got["network_gbps"].runs < 3
    assert "crosses nodes" in got["network_gbps"].reason


def test_too_few_runs_fit_nothing():
    sw = _sweep("hagemann", "LLaMA-65B s2048 64 x A100-80GB")
    runs = ct.timed_runs(sw, ct.hagemann_steps())[:2]
    fit = fit_time_constants(runs, ct.defaults_of(sw))
    assert not fit.fitted and {c.status for c in fit.constants} == {"too little data"}


def test_a_constant_the_runs_drive_to_its_bound_is_a_modelling_gap():
    # a run measured at a tenth of its predicted step would need a GEMM efficiency above 1: never a constant
    sw = _sweep("hagemann", "LLaMA-65B s2048 64 x A100-80GB")
    runs = [TimedRun(r.name, r.measured / 10, r.predict, r.label) for r in ct.timed_runs(sw, ct.hagemann_steps())[:6]]
    fit = fit_time_constants(runs, ct.defaults_of(sw))
    gemm = next(c for c in fit.constants if c.name == "gemm_efficiency")
    assert gemm.status == "at bound" and not gemm.fitted and "--gemm-efficiency" in gemm.reason
    assert len(fit.gaps) == 6


# ---- Megatron's iteration lines ---------------------------------------------------------------------------------
def iteration_line(it: int, total: int, ms: float, tflops: float | None = None) -> str:
    """training_log's line as megatron/training/training.py (0.19.2) prints it."""
    s = " [2026-08-22 10:00:00.000000]"
    s += ' iteration {:8d}/{:8d} |'.format(it, total)
    s += ' consumed samples: {:12d} |'.format(it * 8)
    s += ' elapsed time per iteration (ms): {:.1f} |'.format(ms)
    if tflops is not None:
        s += f' throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |'
    s += f' learning rate: {1e-4:.6E} |'
    s += f' global batch size: {8:5d} |'
    return s + ' lm loss: 1.050000E+01 | loss scale: 1.0 | grad norm: 3.142 |'


def test_step_time_skips_the_warm_up_line_and_takes_the_median():
    times = [(1, 9000.0, 10.0), (10, 1210.0, 150.0), (20, 1190.0, 152.0), (30, 5000.0, 40.0), (20, 1.0, None)]
    assert measured_step(times, "x") == (1.21, 150.0, 3)     # median of 1210, 1190, 5000 ms; the repeated 20 ignored
    assert measured_step([], "x") == (None, None, 0)
    with pytest.raises(ReaderError, match="only the first logged iteration"):
        measured_step([(1, 9000.0, None)], "run.log")


def test_iteration_lines_after_a_real_argument_table(tmp_path):
    # Megatron 0.19.2's own rank-0 start-up log (tests/data), then iteration lines as training.py prints them
    real = open(os.path.join(ROOT, "tests", "data", "megatron-0.19.2-rank0-start.log")).read()
    lines = [iteration_line(1, 100, 30000.0, 20.5), iteration_line(10, 100, 2512.3, 181.2),
             iteration_line(20, 100, 2498.7, 182.0),
             " iteration       30/     100 | elapsed time per iteration (ms): nan | learning rate: 1E-4 |",
             " iteration       40/     100 | elapsed time per iteration (ms): 1e999 |"]
    path = tmp_path / "run.log"
    path.write_text(real + "\n" + "\n".join(lines) + "\n")
    log = read_megatron_logs([str(path)])
    assert log.iteration_times == [(1, 30000.0, 20.5), (10, 2512.3, 181.2), (20, 2498.7, 182.0)]
    assert log.iterations[-2:] == [30, 40]          # counted as iterations, no time read from them
    assert measured_step(log.iteration_times, str(path)) == (pytest.approx(2.5055), pytest.approx(181.6), 2)
    # the planner times that run's own layout (TP2 PP2 SP, selective recompute, world 16, from the table)
    from megatron_memguard.calibrate.runs import read_runs
    from megatron_memguard.calibrate.timeruns import timed_run
    from megatron_memguard.gpus import lookup_gpu
    (run,) = read_runs([str(path)], gpu=lookup_gpu("H100-80GB"))
    t, why = timed_run(run.name, run.raw, run.gpu, run.layout.world_size, run.iteration_times)
    assert why is None and t.measured == pytest.approx(2.5055) and "TP2 PP2" in t.label
    assert t.predict({"gemm_efficiency": 0.65, "attention_efficiency": 0.45, "network_gbps": 400.0}) > 0


# ---- the command, the profile and the plan -----------------------------------------------------------------------
FUJII_LAYOUTS = ("Llama-3.1-8B s8192 16 x A100-40GB", "Llama-3.1-8B s8192 32 x A100-40GB")


def write_fujii_logs(root) -> list[tuple[str, float]]:
    """One Megatron log per measured layout of Fujii et al.'s 16- and 32-GPU sweeps: the argument table of the
    layout and iteration lines at the measured step (GBS x seq x model FLOPs per token / (GPUs x TFLOP/s))."""
    out = []
    for name in FUJII_LAYOUTS:
        sw = _sweep("fujii", name)
        fpt = pq.planner_for(sw).timer.flops_per_token
        for r in sw.runs:
            if r.failed:
                continue
            step = sw.gbs * sw.seq * fpt / (sw.world * r.throughput * 1e12)
            flags = list(sw.flags) + ["--tensor-model-parallel-size", str(r.tp), "--pipeline-model-parallel-size",
                                      str(r.pp), "--context-parallel-size", str(r.cp), "--micro-batch-size", str(r.mbs),
                                      "--global-batch-size", str(sw.gbs), "--seq-length", str(sw.seq),
                                      "--use-distributed-optimizer", "--train-iters", "100"] + (
                                     ["--sequence-parallel"] if r.tp > 1 else [])
            lines = print_args(args_of(flags, sw.world)) + [
                iteration_line(1, 100, 3 * step * 1000), iteration_line(10, 100, step * 1000),
                iteration_line(20, 100, step * 1000 * 1.002)]
            d = root / f"w{sw.world}-{r.label.replace(' ', '-')}"
            d.mkdir(parents=True)
            (d / "stdout.log").write_text("\n".join(lines) + "\n")
            out.append((r.label, step))
    return out


def _memguard(*argv):
    return subprocess.run([sys.executable, "-m", "megatron_memguard.cli.main", *argv], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})


def test_calibrate_learns_the_gemm_efficiency_from_megatron_logs_and_plan_uses_it(tmp_path):
    measured = write_fujii_logs(tmp_path / "runs")
    assert len(measured) == 21
    out = tmp_path / "site.yaml"
    r = _memguard("calibrate", str(tmp_path / "runs"), "--gpu", "A100-40GB", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    t = doc["time"]
    gemm = next(c for c in t["constants"] if c["name"] == "gemm_efficiency")
    att = next(c for c in t["constants"] if c["name"] == "attention_efficiency")
    assert gemm["fitted"] and att["status"] == "not identifiable"
    # Megatron's A100-40GB steps at 16-32 GPUs run below the A100 row's 0.78 (the growing per-step cost of
    # docs/planner.md section 5.2 is in them): a lower efficiency, within its bounds, with a lower median error
    assert 0.5 < gemm["value"] < 0.78
    assert t["median_abs_log_error_after"] < t["median_abs_log_error_before"]
    assert len(t["runs"]) == 21 and doc["time_fitted"] == {"gemm_efficiency": gemm["value"]}
    prof = parse_site_profile(__import__("yaml").safe_load(out.read_text()))
    assert prof.gpu == "A100-40GB" and prof.time == {"gemm_efficiency": pytest.approx(gemm["value"], abs=1e-5)}
    assert out.read_text().splitlines()[4] == "schema: memguard.site/2"
    # plan: the profile's GEMM efficiency sets the gemm term (it scales as 1 / efficiency); --gemm-efficiency wins
    plan = ["plan", "--gpus", "32", "--seq-length", "8192", "--global-batch-size", "1024", "--explain",
            "tp=4,pp=1,cp=2,mbs=1", "--json", "--", *pq.LLAMA31_8B]
    base = json.loads(_memguard(*plan[:1], "--gpu", "A100-40GB", *plan[1:]).stdout)["step_time_terms"]["gemm"]
    r = _memguard(*plan[:1], "--site-profile", str(out), *plan[1:])          # no --gpu: the profile's A100-40GB
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["step_time_terms"]["gemm"] == pytest.approx(base * 0.78 / prof.time["gemm_efficiency"], rel=1e-9)
    own = json.loads(_memguard(*plan[:1], "--site-profile", str(out), "--gemm-efficiency", "0.78",
                               *plan[1:]).stdout)["step_time_terms"]["gemm"]
    assert own == pytest.approx(base, rel=1e-9)
    # on another GPU the A100's constants are not applied (said in the notes)
    r = _memguard("plan", "--site-profile", str(out), "--gpu", "H100-80GB", "--gpus", "32", "--seq-length", "8192",
                  "--global-batch-size", "1024", "--top", "1", "--", *pq.LLAMA31_8B)
    assert r.returncode == 0 and "time constants were fitted on A100-40GB; not applied to H100-80GB" in r.stdout


def test_calibrate_refuses_too_few_timed_runs(tmp_path):
    write_fujii_logs(tmp_path / "all")
    runs = sorted(p for p in (tmp_path / "all").iterdir())[:2]
    r = _memguard("calibrate", *map(str, runs), "--gpu", "A100-40GB")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "too little data: 2 run(s) with no memory lines and fewer than 3 measured step times" in r.stderr


# ---- the profile's time section ----------------------------------------------------------------------------------
def test_profile_time_section_round_trip_and_refusals():
    text = dump_site_profile({}, gpu="A100-40GB", time={"gemm_efficiency": 0.68, "network_gbps": 100})
    doc = __import__("yaml").safe_load(text)
    assert doc["schema"] == "memguard.site/2"
    assert parse_site_profile(doc).time == {"gemm_efficiency": 0.68, "network_gbps": 100.0}
    old = __import__("yaml").safe_load(dump_site_profile({"cuda_context": 600 * 2**20}))
    assert old["schema"] == "memguard.site/1" and parse_site_profile(old).time == {}    # old profiles still read
    bad = [({**old, "time": {"gemm_efficiency": 0.7}, "gpu": "A100-40GB"}, "time", "needs schema memguard.site/2"),
           ({**doc, "gpu": None}, "time", "the profile needs 'gpu:'"),
           ({**doc, "time": {"gemm_eff": 0.7}}, "time.gemm_eff", "unknown time constant"),
           ({**doc, "time": {"gemm_efficiency": 1.5}}, "time.gemm_efficiency", "must be from 0.01 to 1"),
           ({**doc, "time": {"network_gbps": "fast"}}, "time.network_gbps", "expects a number"),
           ({**doc, "time": [0.7]}, "time", "expects a mapping"),
           ({**doc, "schema": "memguard.site/3"}, "schema", "newer memguard")]
    for d, key, text in bad:
        with pytest.raises(ConfigError) as e:
            parse_site_profile(d, "p.yaml")
        assert e.value.key == f"p.yaml: {key}" and text in str(e.value), str(e.value)
    assert math.isclose(parse_site_profile(doc).time["network_gbps"], 100.0)


def test_a_log_with_only_the_warm_up_line_is_named_not_a_traceback(tmp_path):
    write_fujii_logs(tmp_path / "all")
    runs = sorted(p for p in (tmp_path / "all").iterdir())[:3]
    log = runs[0] / "stdout.log"
    log.write_text("\n".join(line for line in log.read_text().splitlines()
                             if "iteration       10/" not in line and "iteration       20/" not in line) + "\n")
    r = _memguard("calibrate", *map(str, runs), "--gpu", "A100-40GB")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "fewer than 3 measured step times" in r.stderr and "only the first logged iteration (1)" in r.stderr
