"""memguard calibrate on logs with known constants: Megatron logs (report_memory and the argument table as
Megatron prints them, tests/megatron_logs.py) and memguard's own JSONL, made from the estimate under a
known site. The fit must recover the constants, refuse too little data, and report what it must not fit."""
import json
import os
import random
import subprocess
import sys

import pytest

from conftest import ROOT
from megatron_logs import args_of, dp0_ranks, print_args, report_memory, training_log
from megatron_memguard import SiteConstants, estimate, layout_from_flags, lookup_gpu
from megatron_memguard.calibrate import CalibrationRun, Observation, TooLittleData, calibrate
from megatron_memguard.calibrate.runs import layout_from_dict, read_runs
from megatron_memguard.report.megatron_run import pp_rank_of
from megatron_memguard.site_profile import load_site_profile

MiB = 2**20
A100 = lookup_gpu("A100-80GB")
BASE = ("--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
        "--micro-batch-size 2 --global-batch-size 64 --bf16 --tokenizer-type NullTokenizer --vocab-size 32000 "
        "--use-distributed-optimizer --train-iters 10").split()
# (TP, PP, CP, extra flags, world size): 1 to 4 NCCL communicators, Transformer Engine and local layers
LAYOUTS = [(1, 1, 1, [], 8), (2, 1, 1, [], 8), (2, 2, 1, [], 8), (2, 2, 2, [], 16), (1, 2, 1, ["--transformer-impl", "local"], 8),
           (4, 1, 1, ["--transformer-impl", "local"], 8), (2, 1, 2, [], 8)]
TRUE = SiteConstants(cuda_context=700 * MiB, nccl_per_communicator=96 * MiB, allocator_fragmentation=0.12,
                     te_workspace=20 * MiB, cublas_workspace=16 * MiB)


def _flags(tp, pp, cp, extra):
    return BASE + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                   "--context-parallel-size", str(cp), *extra]


def write_runs(root, layouts=LAYOUTS, site=TRUE, noise=0.0, seed=1, distort=None, era="0.19"):
    """One directory per run with rank 0's stdout: the argument table, training_log and report_memory lines
    of iterations 1 and 2, the numbers of memguard's estimate under ``site`` (times 1 + N(0, noise))."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i, (tp, pp, cp, extra, world) in enumerate(layouts):
        flags = _flags(tp, pp, cp, extra)
        L = layout_from_flags(flags, world_size=world)
        est = estimate(L, gpu=A100, site=site, dp_rank=0)
        lines = ["using world size: ...", *print_args(args_of(flags, world))]
        for it in (1, 2):
            lines.append(training_log(it, 10, it * 64, 64))
            for r in dp0_ranks(L.tp, L.pp, L.dp, L.cp):
                st = est.stages[pp_rank_of(r, L)]
                vals = [st.persistent_bytes, st.peak_allocated_bytes, st.peak_reserved_bytes, st.device_total_bytes]
                if distort:
                    vals = distort(i, vals)
                steady, peak, res, dev = (int(v * (1 + rng.gauss(0, noise))) for v in vals)
                lines.append(report_memory(r, f"(after {it} iterations)", steady, peak, res, res,
                                           dev if era != "old" else None, era=era))
        d = root / f"run{i}"
        d.mkdir()
        (d / "stdout.log").write_text("\n".join(lines) + "\n")
    return root


def test_recovers_known_constants_from_megatron_logs(tmp_path):
    runs = read_runs([str(write_runs(tmp_path))], gpu=A100)
    assert len(runs) == 7 and sum(len(r.observations) for r in runs) == 25
    res = calibrate(runs)
    got = res.fitted
    # exact up to report_memory's two decimals of MiB
    assert got["cuda_context"] == pytest.approx(700 * MiB, abs=0.1 * MiB)
    assert got["nccl_per_communicator"] == pytest.approx(96 * MiB, abs=0.1 * MiB)
    assert got["allocator_fragmentation"] == pytest.approx(0.12, abs=1e-4)
    assert got["te_workspace"] == pytest.approx(20 * MiB, abs=0.05 * MiB)
    assert got["cublas_workspace"] == pytest.approx(16 * MiB, abs=0.05 * MiB)
    lv = {x.level: x for x in res.levels}
    assert all(x.accepted for x in lv.values())
    # device used: the defaults were up to 4% off on these runs; calibrated and held out, under 0.1%
    assert max(lv["device"].before.values()) > 0.04 and max(lv["device"].held_out.values()) < 1e-3
    assert not res.gaps


def test_noisy_logs_and_the_old_number_format(tmp_path):
    # 0.3% noise on every number; the unformatted floats of older Megatron (no device memory there)
    res = calibrate(read_runs([str(write_runs(tmp_path, noise=0.003, era="old"))], gpu=A100))
    got = res.fitted
    assert got["allocator_fragmentation"] == pytest.approx(0.12, abs=0.005)
    assert got["te_workspace"] == pytest.approx(20 * MiB, abs=4 * MiB)
    assert "cuda_context" not in got and next(c for c in res.constants if c.name == "cuda_context").status == "too little data"


def test_too_little_data_is_refused(tmp_path):
    runs = read_runs([str(write_runs(tmp_path, layouts=LAYOUTS[:2]))], gpu=A100)
    with pytest.raises(TooLittleData, match="too little data: 2 run"):
        calibrate(runs)


def test_nccl_buffers_need_different_communicators(tmp_path):
    # TP 2 on 8 GPUs three times (TP and DP communicators each): the context absorbs NCCL's buffers
    same = [(2, 1, 1, [], 8), (2, 1, 1, ["--micro-batch-size", "1"], 8), (2, 1, 1, ["--transformer-impl", "local"], 8)]
    res = calibrate(read_runs([str(write_runs(tmp_path, layouts=same))], gpu=A100))
    nccl = next(c for c in res.constants if c.name == "nccl_per_communicator")
    assert nccl.status == "not identifiable" and "cuda_context" in nccl.reason
    assert res.fitted["cuda_context"] == pytest.approx(700 * MiB + 2 * (96 - 128) * MiB, abs=0.1 * MiB)


def test_activation_gap_is_reported_not_fitted(tmp_path):
    # run 2's peak is 20% over its prediction (activations): a modelling gap, and the workspaces (fitted from
    # memory held between iterations) are not pulled by it
    def distort(i, v):
        return [v[0], v[1] * 1.2 if i == 2 else v[1], v[2] * 1.2 if i == 2 else v[2], v[3]]
    res = calibrate(read_runs([str(write_runs(tmp_path, distort=distort))], gpu=A100))
    assert res.fitted["te_workspace"] == pytest.approx(20 * MiB, abs=0.05 * MiB)
    gap = next(g for g in res.gaps if g.metric == "peak_allocated")
    assert [n for n, _ in gap.runs] == [str(tmp_path / "run2")] and gap.runs[0][1] == pytest.approx(-1 / 6, abs=0.002)
    assert "activations" in gap.what


def test_a_constant_beyond_its_bounds_is_a_gap(tmp_path):
    # every run holds 1.5 GiB more between iterations than the model: no workspace is that large
    def distort(i, v):
        return [v[0] + 1536 * MiB, v[1] + 1536 * MiB, v[2] + 1536 * MiB, v[3] + 1536 * MiB]
    res = calibrate(read_runs([str(write_runs(tmp_path, distort=distort))], gpu=A100), fit_only=["te_workspace",
                                                                                                 "cublas_workspace"])
    bound = [c for c in res.constants if c.status == "at bound"]
    assert bound and all("outside its bounds" in c.reason for c in bound)
    assert any("modelling gap" in g.what for g in res.gaps)


def test_runs_that_disagree_keep_the_defaults():
    # as in Megatron's GB200 records (docs/calibration.md): the same layout, half of the runs keep 24 MiB more
    # after the step than the other half, and nothing in their configuration says which
    L = layout_from_flags(_flags(2, 1, 1, []), world_size=8)
    st = estimate(L, gpu=A100, dp_rank=0).stages[0]
    runs = []
    for i in range(8):
        off = 24 * MiB if i % 2 else 0
        runs.append(CalibrationRun(f"r{i}", L, A100, [Observation(0, 0, 0, steady=st.persistent_bytes + off,
                                                                  peak_allocated=st.peak_allocated_bytes + off)]))
    res = calibrate(runs, fit_only=["te_workspace"])
    te = next(c for c in res.constants if c.name == "te_workspace")
    assert te.status == "inconsistent" and "the runs disagree" in te.reason and not res.fitted


def test_jsonl_runs_carry_their_layout(tmp_path):
    from megatron_memguard.runtime import MemoryMonitor, Prediction, Reading, StaticSource
    from megatron_memguard.runtime.sinks import JsonlSink
    for i, (tp, pp, cp, extra, world) in enumerate(LAYOUTS[:4]):
        L = layout_from_flags(_flags(tp, pp, cp, extra), world_size=world)
        true = estimate(L, gpu=A100, site=TRUE, dp_rank=0)
        d = tmp_path / f"run{i}"
        d.mkdir()
        for pp_rank in range(L.pp):
            st = true.stages[pp_rank]
            src = StaticSource(Reading(allocated=st.persistent_bytes, max_allocated=st.peak_allocated_bytes,
                                       reserved=st.peak_reserved_bytes, max_reserved=st.peak_reserved_bytes,
                                       device_used=st.device_total_bytes))
            rank = pp_rank * L.tp * L.dp
            m = MemoryMonitor(src, Prediction.from_stage(estimate(L, gpu=A100, dp_rank=0).stages[pp_rank]), rank=rank,
                              interval=1, sinks=[JsonlSink(JsonlSink.path_for(str(d), rank))],
                              context={"layout": L.to_dict(), "decision": {"gpu": "A100-80GB"}, "dp_rank": 0})
            m.start()
            m.step(1)
            m.finish()
    runs = read_runs([str(tmp_path)])
    assert [r.gpu.name for r in runs] == ["A100-80GB"] * 4 and runs[0].source == "memguard JSONL"
    assert runs[2].layout == layout_from_flags(_flags(2, 2, 1, []), world_size=8)
    res = calibrate(runs, fit_only=["allocator_fragmentation", "cuda_context", "nccl_per_communicator"])
    assert res.fitted["allocator_fragmentation"] == pytest.approx(0.12, abs=1e-4)
    assert res.fitted["cuda_context"] == pytest.approx(700 * MiB, abs=MiB)


def test_layout_from_dict_refuses_another_versions_layout():
    d = layout_from_flags(_flags(1, 1, 1, []), world_size=8).to_dict()
    assert layout_from_dict(dict(d), "x") == layout_from_flags(_flags(1, 1, 1, []), world_size=8)
    with pytest.raises(Exception, match="fields this memguard does not know"):
        layout_from_dict({**d, "moe_router_topk": 2}, "x")


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "megatron_memguard.cli.main", "calibrate", *argv], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})


def test_cli_writes_a_profile_the_estimator_takes(tmp_path):
    write_runs(tmp_path / "runs")
    out = tmp_path / "site.yaml"
    r = _cli(str(tmp_path / "runs"), "--gpu", "A100-80GB", "--out", str(out), "--name", "lab")
    assert r.returncode == 0, r.stderr
    assert "result: 5 constant(s) fitted" in r.stdout and "leave-one-out" in r.stdout
    prof = load_site_profile(str(out))
    assert prof.name == "lab" and prof.gpu == "A100-80GB" and prof.fit["runs"] == 7
    assert prof.constants.cuda_context == pytest.approx(700 * MiB, abs=0.1 * MiB)
    # --json, and --fit limits what moves
    doc = json.loads(_cli(str(tmp_path / "runs"), "--gpu", "A100-80GB", "--json", "--fit", "cuda_context").stdout)
    assert set(doc["fitted"]) == {"cuda_context"} and doc["profile"] is None


@pytest.mark.parametrize("argv, text", [
    (["--fit", "warp_drive"], "--fit: unknown constant(s) warp_drive"),
    (["--min-runs", "1"], "--min-runs: must be at least 2"),
])
def test_cli_bad_options_are_one_line(tmp_path, argv, text):
    write_runs(tmp_path)
    r = _cli(str(tmp_path), "--gpu", "A100-80GB", *argv)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and text in r.stderr


def test_cli_refuses_logs_without_memory_lines_and_too_few_runs(tmp_path):
    (tmp_path / "a.log").write_text("nothing here\n")
    r = _cli(str(tmp_path / "a.log"))
    assert r.returncode == 2 and "no Megatron memory lines" in r.stderr and r.stderr.count("\n") == 1
    write_runs(tmp_path / "two", layouts=LAYOUTS[:2])
    r = _cli(str(tmp_path / "two"), "--gpu", "A100-80GB")
    assert r.returncode == 2 and "too little data: 2 run(s)" in r.stderr


def test_guarded_fit_by_hand():
    from megatron_memguard.calibrate.fit import Row, guarded_fit
    # a pure offset theta; three runs measure 102 where the default 100 predicts 100 (-1.96%), two runs are
    # modelling gaps (their own terms 10 over: +12% at 102): capped, they neither pull theta nor keep it at 100
    rows = [Row(f"r{i}", 102.0, 0.0, (1.0,)) for i in range(3)] + [Row(f"g{i}", 100.0, 10.0, (1.0,)) for i in range(2)]
    assert guarded_fit(rows, [0.0], [1e3], [100.0], [100.0], 0.0025, 0.05).theta[0] == pytest.approx(102.0, abs=1e-6)
    # three runs ask for 104, one is exact at the default 100: it may get worse by the guard only, 100 x 0.25%
    rows = [Row("exact", 100.0, 0.0, (1.0,))] + [Row(f"r{i}", 104.0, 0.0, (1.0,)) for i in range(3)]
    g = guarded_fit(rows, [0.0], [1e3], [100.0], [100.0], 0.0025, 0.05)
    assert g.theta[0] == pytest.approx(100.25, abs=1e-6) and g.free[0] == pytest.approx(104.0, abs=1e-3)


def test_a_shift_within_the_runs_scatter_keeps_the_defaults(tmp_path):
    # runs made with the defaults, 0.3% noise on every number: whatever the fit asks for is within two standard errors
    runs = read_runs([str(write_runs(tmp_path, site=SiteConstants(), noise=0.003, seed=3))], gpu=A100)
    res = calibrate(runs, fit_only=["te_workspace", "cublas_workspace"])
    for c in res.constants[:2]:
        assert c.status == "within noise" and "standard error" in c.reason and not c.fitted, (c.name, c.status)


def test_a_constant_only_runs_with_one_setting_show_is_not_fitted(tmp_path):
    # every Transformer Engine run has CP 2 and no local run has: TE's workspace cannot be told from CP's modelling
    # error (as the cuBLAS default and CP 2 in half of Megatron's H100 records)
    layouts = [(2, 1, 2, [], 8), (2, 2, 2, [], 16), (1, 1, 2, [], 8), (1, 2, 1, ["--transformer-impl", "local"], 8),
               (4, 1, 1, ["--transformer-impl", "local"], 8)]
    res = calibrate(read_runs([str(write_runs(tmp_path, layouts=layouts))], gpu=A100), fit_only=["te_workspace"])
    te = next(c for c in res.constants if c.name == "te_workspace")
    assert te.status == "not identifiable" and "CP 2" in te.reason and not res.fitted


def test_a_steady_gap_neither_drags_nor_vetoes_the_workspaces(tmp_path):
    # runs 2 and 3 hold 30% more between iterations than their model state (a modelled-term gap, not a workspace):
    # capped out of the fit, they leave the workspaces where the five other runs put them, and are listed
    def distort(i, v):
        return [v[0] * 1.3 if i in (2, 3) else v[0], *v[1:]]
    res = calibrate(read_runs([str(write_runs(tmp_path, distort=distort))], gpu=A100),
                    fit_only=["te_workspace", "cublas_workspace"])
    assert res.fitted["te_workspace"] == pytest.approx(20 * MiB, abs=0.05 * MiB)
    assert res.fitted["cublas_workspace"] == pytest.approx(16 * MiB, abs=0.05 * MiB)
    gap = next(g for g in res.gaps if g.metric == "steady")
    assert sorted(n for n, _ in gap.runs) == [str(tmp_path / "run2"), str(tmp_path / "run3")]
    assert all(e == pytest.approx(-0.3 / 1.3, abs=0.002) for _, e in gap.runs)
