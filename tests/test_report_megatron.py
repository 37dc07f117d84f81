"""memguard report on Megatron's own logs: the argument table Megatron 0.19.2 printed (tests/data, produced by
its real validate_args: tests/test_hook_container.py checks the same), report_memory and training_log lines as
Megatron's source prints them in both eras, interleaved with other ranks' output, and CUDA OOM forensics."""
import json
import os
import subprocess
import sys

import pytest

from conftest import LLAMA31_8B, ROOT
from megatron_logs import (args_of, dp0_ranks, interleave, oom_message, print_args, report_memory, training_log)
from megatron_memguard import estimate, layout_from_flags, lookup_gpu
from megatron_memguard.report.megatron_log import arg_value, parse_oom, read_megatron_logs
from megatron_memguard.report.megatron_run import pp_rank_of, raw_from_log
from megatron_memguard.resolve import resolve

GiB, MiB = 2**30, 2**20
START = os.path.join(ROOT, "tests", "data", "megatron-0.19.2-rank0-start.log")
# the flags that produced START (world size 16 from WORLD_SIZE)
FLAGS = LLAMA31_8B + ("--lr 1e-4 --train-iters 10 --mock-data --no-rope-fusion --micro-batch-size 2 "
                      "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel "
                      "--use-distributed-optimizer --recompute-granularity selective").split()
H100 = lookup_gpu("H100-80GB")


def layout():
    return layout_from_flags(FLAGS, world_size=16)


def stage_values(est, pp, alloc=1.0, reserved=1.0):
    s = est.stages[pp]
    return (int(s.persistent_bytes * alloc), int(s.peak_allocated_bytes * alloc), int(s.peak_reserved_bytes * reserved))


def test_megatrons_argument_table_reads_back_to_the_same_layout():
    log = read_megatron_logs(START)
    assert len(log.args) > 800 and log.args_tables == 1 and not log.memory
    # values as _print_args printed them: numbers, booleans, None, lists; dtypes stay text
    assert log.args["world_size"] == 16 and log.args["sequence_parallel"] is True and log.args["num_query_groups"] == 8
    assert log.args["params_dtype"] == "torch.bfloat16" and log.args["load"] is None
    # names of 48 characters and more are printed without dots
    assert log.args["inference_dynamic_batching_cuda_graph_mixed_prefill_count"] == 16
    raw = raw_from_log(log)
    got = resolve(raw, world_size=raw.world_size)
    assert got.to_dict() | {"notes": [], "env": {}} == layout().to_dict() | {"notes": [], "env": {}}


def test_values_of_the_table():
    assert arg_value("None") is None and arg_value("1e-08") == 1e-08 and arg_value("['core_attn', 'mlp']") == ["core_attn", "mlp"]
    assert arg_value("AttnBackend.auto") == "auto" and arg_value("torch.float32") == "torch.float32"
    assert arg_value("/data/my file.bin") == "/data/my file.bin" and arg_value("<|endoftext|>") == "<|endoftext|>"


def _combined_log(tmp_path, est, alloc=1.02, reserved=1.03, era="0.19", extra=(), prefix=True):
    """One stdout of the whole job (torchrun without --tee): rank 0's start, then the ranks' lines interleaved
    with warnings and a progress bar, as Megatron prints them."""
    L = est.layout
    streams = []
    for r in dp0_ranks(L.tp, L.pp, L.dp):
        steady, peak, res = stage_values(est, pp_rank_of(r, L), alloc, reserved)
        pre = f"[default{r % 8}]:" if prefix else ""
        streams.append([report_memory(r, f"(after {it} iterations)", steady, peak, res, res, era=era, prefix=pre)
                        for it in (1, 2)])
    streams.append([training_log(it, 10, 8 * it, 8) for it in (1, 2, 3)])
    streams.append(["/usr/lib/python3/dist-packages/torch/utils/data.py:12: UserWarning: something [Rank 3] about "
                    "memory (MB) that is no memory line", "Loading shards: 50%|#####     | 1/2\rLoading shards: "
                    "100%|##########| 2/2 [00:01<00:00]"])
    lines = open(START).read().splitlines() + interleave(*streams, seed=3) + list(extra)
    p = tmp_path / "train.log"
    p.write_text("\n".join(lines) + "\n")
    return p


def _report(*argv):
    return subprocess.run([sys.executable, "-m", "megatron_memguard.cli.main", "report", *argv], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})


def test_report_compares_each_logged_rank_with_its_stage(tmp_path):
    est = estimate(layout(), gpu=H100, dp_rank=0)
    log = _combined_log(tmp_path, est)
    r = _report(str(log), "--gpu", "H100-80GB", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    # report_memory prints on data-parallel rank 0: ranks 0, 1 (pp0) and 8, 9 (pp1) of TP 2 x DP 4 x PP 2
    assert [(x["rank"], x["pp_rank"]) for x in doc["ranks"]] == [(0, 0), (1, 0), (8, 1), (9, 1)]
    for x in doc["ranks"]:
        assert x["samples"] == 2 and x["predicted_peak_allocated"] == est.stages[x["pp_rank"]].peak_allocated_bytes
        assert x["error_max_allocated"] == pytest.approx(0.02, abs=1e-4)   # report_memory's 2 decimals of MiB
        assert x["error_max_reserved"] == pytest.approx(0.03, abs=1e-4)
    text = _report(str(log), "--gpu", "H100-80GB").stdout
    assert "source megatron report_memory" in text and "result: OK" in text and "+2.0%" in text


def test_old_number_format_and_the_tp_pp_dp_rank_order(tmp_path):
    flags = FLAGS + ["--use-tp-pp-dp-mapping"]
    L = layout_from_flags(flags, world_size=16)
    est = estimate(L, gpu=H100, dp_rank=0)
    lines = print_args(args_of(flags, 16))
    # order tp-cp-ep-pp-dp: data-parallel rank 0's ranks are 0, 1 (pp0) and 2, 3 (pp1)
    for r in (0, 1, 2, 3):
        steady, peak, res = stage_values(est, r // 2, 1.10)
        lines.append(f"{r}: " + report_memory(r, "(after 1 iterations)", steady, peak, res, res, era="old"))
    (tmp_path / "out.log").write_text("\n".join(lines) + "\n")
    r = _report(str(tmp_path), "--gpu", "H100-80GB", "--json")
    assert r.returncode == 1              # 10% over: beyond the 5% tolerance
    doc = json.loads(r.stdout)
    assert [(x["rank"], x["pp_rank"]) for x in doc["ranks"]] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert all(x["error_max_allocated"] == pytest.approx(0.10, abs=1e-6) for x in doc["ranks"])


def test_bad_logs_are_one_line_errors(tmp_path):
    (tmp_path / "empty.log").write_text("just some output\n[Rank 0] (after 1 iterations) memory (MB) | truncated\n")
    r = _report(str(tmp_path / "empty.log"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no Megatron memory lines" in r.stderr
    # memory lines but no argument table and no configuration
    (tmp_path / "mem.log").write_text(report_memory(0, "(after 1 iterations)", GiB, 2 * GiB, 3 * GiB, 3 * GiB) + "\n")
    r = _report(str(tmp_path / "mem.log"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no Megatron argument table" in r.stderr
    # ... which the flags after -- give
    r = _report(str(tmp_path / "mem.log"), "--world-size", "16", "--", *FLAGS)
    assert r.returncode in (0, 1) and "rank" in r.stdout and "pp0" in r.stdout
    r = _report(str(tmp_path / "missing.log"))
    assert r.returncode == 2 and "no such file or directory" in r.stderr


def test_oom_forensics_blames_the_transient_term(tmp_path):
    L = layout()
    est = estimate(L, gpu=H100, dp_rank=0)
    s = est.stages[1]
    held = int(s.peak_allocated_bytes * 1.08)             # 8% over the predicted peak when it failed
    msg = oom_message(requested=2 * GiB, capacity=int(79.11 * GiB), free=300 * MiB, process_used=held + 900 * MiB,
                      allocated=held, reserved=held + 200 * MiB)
    log = _combined_log(tmp_path, est, alloc=1.0, reserved=1.0, extra=["8: [rank8]: Traceback (most recent call last):",
                                                                       "8: [rank8]: " + msg])
    r = _report(str(log), "--gpu", "H100-80GB")
    assert r.returncode == 1
    out = r.stdout
    assert "out of memory on rank 8 (pp1) after iteration 3" in out
    need = (held + 2 * GiB) / s.peak_allocated_bytes - 1
    assert f"the prediction was low by at least {need:+.1%}" in out
    largest = max((t for t in s.terms if t.group in ("activations", "logits_loss", "transients") and t.level == "allocated"),
                  key=lambda t: t.bytes)
    assert f"blamed: {largest.name} (allocated)" in out
    doc = json.loads(_report(str(log), "--gpu", "H100-80GB", "--json").stdout)
    f = doc["oom_forensics"][0]
    assert (f["rank"], f["pp_rank"], f["term"], f["requested_bytes"]) == (8, 1, largest.name, 2 * GiB)
    assert f["needed_error"] == pytest.approx(need, abs=2e-4)


def test_oom_foreseen_and_fragmentation(tmp_path):
    L = layout()
    est = estimate(L, gpu=H100, dp_rank=0)
    s = est.stages[0]
    # a GPU of 80% of the predicted device total: the prediction itself does not fit, the estimate foresaw it
    cap = int(s.device_total_bytes * 0.8)
    small = oom_message(requested=GiB, capacity=cap, free=100 * MiB, process_used=cap - 100 * MiB,
                        allocated=cap - 3 * GiB, reserved=cap - 2 * GiB)
    # allocated within the prediction but 9 GiB reserved and unallocated: fragmentation
    held = int(s.peak_allocated_bytes * 0.9)
    frag = oom_message(requested=GiB, capacity=int(79.11 * GiB), free=200 * MiB, process_used=held + 9 * GiB + 900 * MiB,
                       allocated=held, reserved=held + 9 * GiB)
    for text, want in ((small, "the estimate foresaw it"), (frag, "blamed: allocator_fragmentation (reserved)")):
        p = tmp_path / "oom.log"
        p.write_text("\n".join(print_args(args_of(FLAGS, 16)) + [training_log(1, 10, 8, 8), "0: " + text]) + "\n")
        r = _report(str(p), "--gpu", "H100-80GB")
        assert r.returncode == 1 and "no memory lines; 1 out-of-memory error(s)" in r.stdout and want in r.stdout


def test_oom_message_of_older_torch():
    ev = parse_oom("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; "
                   "14.56 GiB already allocated; 3.44 MiB free; 14.66 GiB reserved in total by PyTorch) If reserved ...")
    assert (ev.requested, ev.capacity, ev.allocated, ev.reserved) == (20 * MiB, int(round(15.78 * GiB)),
                                                                      int(round(14.56 * GiB)), int(round(14.66 * GiB)))
    assert ev.reserved_unallocated == ev.reserved - ev.allocated and ev.needed == ev.allocated + 20 * MiB


def test_oom_reserved_slack_counts_cuda_graph_pools():
    """A CUDA graph's private pool (cuda_graph_pool, reserved level) is reserved but unallocated memory between
    replays: slack of the fragmentation plus the pool is as predicted, not blamed on fragmentation."""
    from megatron_memguard.report.megatron_log import OomEvent
    from megatron_memguard.report.oom import blame
    L = layout_from_flags(LLAMA31_8B + "--micro-batch-size 1 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                          "--use-distributed-optimizer --cuda-graph-impl transformer_engine".split(), world_size=16,
                          megatron_version="0.19.2")
    s = estimate(L, gpu=H100).stages[0]
    frag, pool = s.breakdown["allocator_fragmentation"], s.breakdown["cuda_graph_pool"]
    assert pool > 0.1 * frag

    def event(slack):
        held = int(s.peak_allocated_bytes * 0.95)
        return OomEvent(file="x.log", line=1, rank=0, device=0, requested=GiB, capacity=int(79.11 * GiB), free=0,
                        allocated=held, reserved_unallocated=slack, process_used=None, other_processes=0,
                        reserved=None, iteration=3)
    ok = blame(event(frag + pool), estimate(L, gpu=H100), 0, True)
    assert ok.term != "allocator_fragmentation"           # was blamed: frag + pool > 1.05 frag
    bad = blame(event(2 * (frag + pool)), estimate(L, gpu=H100), 0, True)
    assert (bad.term, bad.level) == ("allocator_fragmentation", "reserved") and "CUDA graph pools" in bad.why


# -- which Megatron printed the table (report/megatron_era.py) ---------------------------------------------------
_MARKERS_019 = ("freeze_all_layers", "override_ckpt_iteration", "yarn_beta_fast", "dataloader_inter_document_masking",
                "logits_save_dir")
_MARKERS_018 = ("cuda_graph_modules", "muon_nesterov")   # (fp4_param_gather: in 0.17.1's table already)


def _start_without(tmp_path, names, memory_lines=()):
    """START's table without the arguments ``names``: the table an older parser, which lacks them, prints."""
    lines = [l for l in open(START).read().splitlines() if not any(l.startswith(f"  {n} ") for n in names)]
    p = tmp_path / "train.log"
    p.write_text("\n".join(lines + list(memory_lines)) + "\n")
    return p


def test_era_of_megatrons_real_table(tmp_path):
    from megatron_memguard.report.megatron_era import era_of_table
    # 0.19.2's own table: the arguments megatron-core 0.19.0 added (absent from the 0.17.0 / 0.18.0 wheels'
    # megatron/training and megatron/core) are there
    g = era_of_table(read_megatron_logs(START).args)
    assert g.version == "0.19" and "freeze_all_layers" in g.reason
    # the table without 0.19's arguments: 0.18's; without 0.18's too: 0.17's (hybrid_layer_pattern, which
    # shared/reference/megatron.md lists as absent in 0.16.1); without that: 0.16
    log = read_megatron_logs(str(_start_without(tmp_path, _MARKERS_019)))
    assert era_of_table(log.args).version == "0.18"
    assert era_of_table(read_megatron_logs(str(_start_without(tmp_path, _MARKERS_019 + _MARKERS_018))).args).version == "0.17"
    g = era_of_table(read_megatron_logs(str(_start_without(tmp_path, _MARKERS_019 + _MARKERS_018 +
                                                                      ("hybrid_layer_pattern",)))).args)
    assert g.version == "0.16" and "none of" in g.reason
    # some of one release's arguments without the others: no release has that table
    g = era_of_table(read_megatron_logs(str(_start_without(tmp_path, _MARKERS_019[:2]))).args)
    assert g.version is None and "no release matches" in g.reason
    # an excerpt (or a cut-off table) proves nothing by what it lacks, but the newest markers still count
    few = {k: None for k in list(read_megatron_logs(START).args)[:50]}
    assert era_of_table(few).version is None and "only 50 arguments" in era_of_table(few).reason
    assert era_of_table(set(few) | set(_MARKERS_019)).version == "0.19"
    assert era_of_table(set(few) | set(_MARKERS_018), complete=True).version is None
    assert era_of_table(read_megatron_logs(START).args, complete=False).version == "0.19"


def test_report_predicts_an_older_table_with_its_eras_rules(tmp_path):
    """A 0.16-era table (none of the later arguments) is predicted with core 0.16's rules: NullTokenizer adds
    an EOD token there (vocabulary 128257, padded to 128512 for TP 2), so the embedding and output layer
    are larger than 0.19's 128256; --megatron-version overrides."""
    L16 = resolve(raw_from_log(read_megatron_logs(START)), world_size=16, megatron_version="0.16")
    est16 = estimate(L16, gpu=H100, dp_rank=0)
    est19 = estimate(layout(), gpu=H100, dp_rank=0)
    assert (L16.padded_vocab_size, est19.layout.padded_vocab_size) == (128512, 128256)
    mem = [report_memory(r, "(after 1 iterations)", *stage_values(est16, pp_rank_of(r, L16)),
                         stage_values(est16, pp_rank_of(r, L16))[2]) for r in dp0_ranks(2, 2, 4)]
    log = _start_without(tmp_path, _MARKERS_019 + _MARKERS_018 + ("hybrid_layer_pattern",), mem)
    doc = json.loads(_report(str(log), "--gpu", "H100-80GB", "--json").stdout)
    assert [x["predicted_peak_allocated"] for x in doc["ranks"]] == [est16.stages[x["pp_rank"]].peak_allocated_bytes
                                                                    for x in doc["ranks"]]
    assert any("megatron-core 0.16 rules assumed: its argument table has none of" in n for n in doc["notes"])
    doc = json.loads(_report(str(log), "--gpu", "H100-80GB", "--json", "--megatron-version", "0.19").stdout)
    assert [x["predicted_peak_allocated"] for x in doc["ranks"]] == [est19.stages[x["pp_rank"]].peak_allocated_bytes
                                                                    for x in doc["ranks"]]
    assert any("megatron-core 0.19 rules (--megatron-version)" in n for n in doc["notes"])


def test_report_judges_against_the_gpu_the_log_names(tmp_path):
    # `nvidia-smi -L` as the job printed it before training (the format tests/test_calibrate_gpu.py reads), naming
    # an A100 80GB: without --gpu the prediction is the A100-80GB one (its device total 79.35 GiB, gpus.py), as
    # `memguard calibrate` reads the same line (calibrate/gpu_evidence.py); --gpu H100-80GB contradicts it
    a100 = lookup_gpu("A100-80GB")
    est = estimate(layout(), gpu=a100, dp_rank=0)
    smi = [f"GPU {i}: NVIDIA A100-SXM4-80GB (UUID: GPU-5c7b0d2a-9e1f-4c3b-8a2d-1f0e9d8c7b6{i})" for i in range(2)]
    log = _combined_log(tmp_path, est, extra=smi)
    r = _report(str(log), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [x["predicted_peak_reserved"] for x in doc["ranks"]] == \
        [est.stages[x["pp_rank"]].peak_reserved_bytes for x in doc["ranks"]]
    # (the H100 prediction differs: Hopper's workspaces, PyTorch's cuBLAS 2 x 32 MiB instead of 2 x 8.125 MiB and
    # TE's 32 MiB + 1 KiB instead of 4 MiB: 2 x 25,034,752 + 29,361,152 = 79,430,656 bytes more per stage)
    h100 = estimate(layout(), gpu=H100, dp_rank=0)
    assert h100.stages[0].persistent_bytes - est.stages[0].persistent_bytes == 79_430_656
    assert est.gpu_memory_bytes == a100.memory_bytes != H100.memory_bytes
    assert any(n.startswith("GPU A100-80GB, from nvidia-smi -L 'NVIDIA A100-SXM4-80GB'") for n in doc["notes"]), doc["notes"]
    assert "the default" not in _report(str(log)).stdout
    r = _report(str(log), "--gpu", "H100-80GB")
    assert r.returncode == 2 and "--gpu H100-80GB conflicts with the run's own files" in r.stderr, r.stderr
    assert f"{log}:" in r.stderr and "A100-80GB" in r.stderr and "Traceback" not in r.stderr
    assert _report(str(log), "--gpu", "A100-80GB").returncode == 0
    # a log that names no GPU: the default, said so
    plain = _combined_log(tmp_path, estimate(layout(), gpu=H100, dp_rank=0))
    assert "H100-80GB (the default; --gpu names the run's GPU)" in _report(str(plain)).stdout


def test_report_reads_the_gpu_of_memguards_jsonl(tmp_path):
    # the runtime monitor's start record on an A100 80GB (torch.cuda.get_device_properties: name, total_memory),
    # its pre-flight told H100-80GB: the report says which GPU ran and that the predictions assumed another
    from test_calibrate_gpu import _jsonl_run
    d = tmp_path / "logs"
    _jsonl_run(d, {"name": "NVIDIA A100-SXM4-80GB", "total_memory": 85_198_045_184, "index": 0}, "H100-80GB")
    r = _report(str(d), "--json")
    notes = json.loads(r.stdout)["notes"]
    assert any(n.startswith("GPU A100-80GB, from the JSONL's device of rank 0") for n in notes), notes
    assert any(n.startswith("the recorded predictions assumed H100-80GB, but the run's device is A100-80GB")
               for n in notes), notes
    r = _report(str(d), "--gpu", "H100-80GB")
    assert r.returncode == 2 and "--gpu H100-80GB conflicts with the run's own files" in r.stderr, r.stderr
    assert str(d) in r.stderr and "Traceback" not in r.stderr
    # the pre-flight told the device's own GPU: nothing to say against it
    d2 = tmp_path / "logs2"
    _jsonl_run(d2, {"name": "NVIDIA A100-SXM4-80GB", "total_memory": 85_198_045_184, "index": 0}, "A100-80GB")
    notes = json.loads(_report(str(d2), "--json", "--gpu", "A100-80GB").stdout)["notes"]
    assert not any("recorded predictions assumed" in n for n in notes), notes
