"""Hostile Megatron training logs for `memguard report` / `memguard calibrate`: many ranks, many memory
lines, floods of out-of-memory messages, and numbers no GPU prints. Bounded CPU and output; the
numbers that are reported are the ones planted in the log (MiB as report_memory prints them)."""
import pytest

from fuzz_util import SMALL, run_memguard
from megatron_logs import args_of, oom_message, print_args, report_memory

GiB = 2**30
ARGS = "\n".join(print_args(args_of(SMALL, 8))) + "\n"


def test_twenty_thousand_ranks_are_grouped_in_one_pass():
    # one memory line per rank: each rank's lines were found by a scan of every line (quadratic: 8 s)
    log = ARGS + "\n".join(report_memory(r, "(after 10 iterations)", GiB, 2 * GiB, 2 * GiB, 2 * GiB)
                           for r in range(20_000)) + "\n"
    o = run_memguard(["report", "run.log"], {"run.log": log}, cpu_limit=4.0)
    assert not o.problems and o.code == 1, o.describe()
    assert "20000 rank(s)" in o.out and "ranks beyond the configuration's world size (8) have no prediction" in o.out


def test_a_flood_of_out_of_memory_messages_is_bounded():
    # 20,000 repeats of PyTorch's message (launchers repeat it): 64 analysed, the rest counted
    oom = "[rank0]: " + oom_message(2**20, 80 * GiB, 2**20, 79 * GiB, 70 * GiB, 75 * GiB)
    log = ARGS + report_memory(0, "(after 10 iterations)", GiB, 2 * GiB, 2 * GiB, 2 * GiB) + "\n" + \
        "\n".join([oom] * 20_000) + "\n"
    o = run_memguard(["report", "run.log"], {"run.log": log}, cpu_limit=4.0)
    assert not o.problems and o.code == 1, o.describe()
    assert "note: 20,000 out-of-memory messages: the first 64 are analysed" in o.out
    assert o.out.count("out of memory on rank 0 (pp0)") == 64 and len(o.out.splitlines()) < 600


def test_sixty_thousand_memory_lines_keep_their_peak():
    # 4 ranks x 15,000 iterations (--log-memory-interval 1); rank 2's peak at one iteration: 3.5 GiB
    lines = [report_memory(i % 4, f"(after {i // 4} iterations)", GiB, 2 * GiB, 2 * GiB, 2 * GiB) for i in range(60_000)]
    lines[30_002] = report_memory(2, "(after 7500 iterations)", GiB, 3.5 * GiB, 4 * GiB, 4 * GiB)
    o = run_memguard(["report", "--json", "run.log"], {"run.log": ARGS + "\n".join(lines) + "\n"}, cpu_limit=10.0)
    assert not o.problems and o.code == 1, o.describe()
    import json
    ranks = {r["rank"]: r for r in json.loads(o.out)["ranks"]}
    assert [ranks[r]["samples"] for r in range(4)] == [15_000] * 4
    assert ranks[2]["actual_max_allocated"] == int(3.5 * GiB) and ranks[1]["actual_max_allocated"] == 2 * GiB


@pytest.mark.parametrize("value", ["1e309", "NaN", "inf", str(2**80), "-" + str(2**80)])
def test_memory_numbers_no_gpu_prints_are_skipped(value):
    bad = f"[Rank 1] (after 10 iterations) memory (MB) | allocated: {value} | max allocated: {value} | reserved: 1.00 | max reserved: 1.00"
    good = report_memory(0, "(after 10 iterations)", GiB, 2 * GiB, 2 * GiB, 2 * GiB)
    o = run_memguard(["report", "run.log"], {"run.log": ARGS + bad + "\n" + good + "\n"}, cpu_limit=2.0)
    assert not o.problems and o.code == 1 and "1 rank(s)" in o.out, o.describe()


def test_negative_zero_is_zero():
    line = "[Rank 0] (after 10 iterations) memory (MB) | allocated: -0 | max allocated: -0.0 | reserved: 0 | max reserved: 0"
    o = run_memguard(["report", "--json", "run.log"], {"run.log": ARGS + line + "\n"}, cpu_limit=2.0)
    import json
    assert not o.problems and json.loads(o.out)["ranks"][0]["actual_max_allocated"] == 0, o.describe()


def test_runtime_jsonl_with_fifty_thousand_samples_and_a_restart():
    # memguard's own JSONL: a restarted job (two segments) of 25,000 samples each; the last segment is
    # reported, its planted peak (41 GiB at one iteration) exact, and the earlier segment is counted
    import json
    from fuzz_util import RUNLOG
    start, sample = RUNLOG[0], json.loads(json.dumps(RUNLOG[1]))
    lines = []
    for seg in range(2):
        lines.append(json.dumps(start))
        for i in range(25_000):
            sample["iteration"] = i
            sample["actual"]["max_allocated"] = 41 * GiB if (seg, i) == (1, 777) else 30 * GiB
            lines.append(json.dumps(sample))
    o = run_memguard(["report", "--json", "."], {"memguard-rank00000.jsonl": "\n".join(lines) + "\n"}, cpu_limit=10.0)
    assert not o.problems, o.describe()
    r = json.loads(o.out)["ranks"][0]
    assert (r["samples"], r["segments"], r["actual_max_allocated"]) == (25_000, 2, 41 * GiB)


def test_an_argument_table_without_its_end_line_stops_at_the_first_memory_line():
    # the 'end of arguments' line lost (a garbled or cut log): the memory lines after it were read as
    # part of the table, and the report said the log had none
    head = ARGS.replace("end of arguments", "end of argu", 1)
    log = head + report_memory(0, "(after 10 iterations)", GiB, 2 * GiB, 2 * GiB, 2 * GiB) + "\n"
    o = run_memguard(["report", "--json", "run.log"], {"run.log": log}, cpu_limit=2.0)
    import json
    assert not o.problems and o.code == 1, o.describe()
    doc = json.loads(o.out)
    assert doc["ranks"][0]["actual_max_allocated"] == 2 * GiB
    assert any("the argument table has no 'end of arguments' line before line" in n for n in doc["notes"])
