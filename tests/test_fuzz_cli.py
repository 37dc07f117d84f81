"""Fuzz: no input makes memguard print a traceback or hang (issue 14).

Every command (estimate, validate, check, plan, report, calibrate, gpus) and every input kind (Megatron
flags and memguard's own options, Megatron functional-test YAML, NeMo 1 / NeMo-launcher / Megatron-Bridge /
NeMo 2 YAML, Hugging Face config.json, launch scripts and commands, memguard run logs, Megatron logs, the
environment) is run in-process from a valid seed with one to three hostile mutations drawn by
hypothesis: a class of hostile value first (non-finite, huge, 5000 digits, out of range, extreme but
valid, not a number; YAML nesting, alias bombs, interpolations, bad scalars; shell that re-expands
itself, unterminated or nested constructs; corrupted records), then a value of it, placed mostly where
memguard computes (shape settings, number fields); plus truncated or garbled text and values of
300,000 characters (every input stays under 1 MB).

Every case must keep the promise (tests/fuzz_util.py): exit code 0, 1 or 2; no traceback and no
internal error; every stderr line from memguard and at most 1,200 characters (values are cut); at most
CPU_LIMIT seconds of CPU (a case still running after WALL seconds is stopped and fails). The hook's
flags and MEMGUARD_* variables and the Megatron-Bridge pre-flight are fuzzed through their Python entry
points.

Derandomized (the same cases on every run): 895 cases, 880 of them memguard runs (200 estimate, 60
validate, 80 plan, 200 config files, 100 check, 150 report, 60 Megatron logs, 30 gpus / no command),
about 1.5 minutes on two cores. ``MEMGUARD_FUZZ_RECORD=FILE`` appends each broken case to FILE instead of
failing, ``MEMGUARD_FUZZ_WALL=S`` stops a case after S seconds: how an older memguard is audited.
"""
from __future__ import annotations

import json
import os
import shlex

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuzz_util import (  # noqa: E402
    JSON_CLASSES, LAUNCH, LEAVES, MEGATRON_LOG, MEGATRON_LOG_LINES, NUMBER_CLASSES, NUMBER_LEAVES, NUMERIC_FLAGS, RUNLOG,
    RUNLOG_RECORD_FIELDS, SENTINEL, SHELL_CLASSES, SMALL, TEXT_CLASSES, YAML_CLASSES, YAML_SEEDS, V, run_memguard,
    with_values,
)

# A hang guard, far above the 2 s target that benchmarks/hostile_input.py measures: on a shared machine under
# memory pressure a case's CPU time can be several times its usual (the largest cases take under 1 s).
CPU_LIMIT = 20.0
WALL = int(os.environ.get("MEMGUARD_FUZZ_WALL", "90"))   # seconds: a case still running is stopped
RECORD = os.environ.get("MEMGUARD_FUZZ_RECORD")


def fuzz(n: int):
    return settings(max_examples=n, derandomize=True, deadline=None, database=None, print_blob=False,
                    suppress_health_check=list(HealthCheck))


def keep_promise_of(case: str, problem: str | None) -> None:
    """keep_promise for the Python entry points (the hook's flags, the pre-flight)."""
    if RECORD:
        if problem:
            with open(RECORD, "a", encoding="utf-8") as f:
                f.write(json.dumps({"case": case, "problems": [problem]}) + "\n")
        return
    assert problem is None, f"{case}: {problem}"


def keep_promise(o) -> None:
    if RECORD:
        if o.problems:
            with open(RECORD, "a", encoding="utf-8") as f:
                f.write(json.dumps({"case": o.describe(), "problems": o.problems}) + "\n")
        return
    assert not o.problems, o.describe()


# --------------------------------------------------------------------------------------------------
# Seeds: valid inputs of every kind
# --------------------------------------------------------------------------------------------------
def corrupt(text: str, data) -> str:
    """Text-level damage: cut the text, insert a character, drop or repeat a line."""
    kind = data.draw(st.sampled_from(["cut", "insert", "drop", "repeat"]), label="corruption")
    i = data.draw(st.integers(0, max(0, len(text) - 1)), label="at")
    if kind == "cut":
        return text[:i]
    if kind == "insert":
        return text[:i] + data.draw(st.sampled_from(list(":{}[]&*!|>'\"%@`#\t\n\\$\x00\ufeff")), label="char") + text[i:]
    lines = text.splitlines(keepends=True)
    j = i % max(1, len(lines))
    if kind == "drop":
        return "".join(lines[:j] + lines[j + 1:])
    return "".join(lines[:j] + [lines[j] if lines else ""] * 50 + lines[j:])


def hostile(data, classes: dict, label: str) -> str:
    """A class of hostile values, then a value of it (every class is tried as often as the others)."""
    cls = data.draw(st.sampled_from(list(classes)), label=f"{label} class")
    return V(data.draw(st.sampled_from(classes[cls]), label=label))


def any_value(data, label="value") -> str:
    """A number two times in three (counts and sizes are what memguard computes with), else any text."""
    return hostile(data, NUMBER_CLASSES if data.draw(st.integers(0, 2), label=f"{label} kind") else TEXT_CLASSES, label)


def one_of(data, preferred: list, others: list, label: str):
    """An element of ``preferred`` two times in three, else of ``others``."""
    return data.draw(st.sampled_from(preferred if data.draw(st.integers(0, 2), label=f"{label} kind") else others),
                     label=label)


# --------------------------------------------------------------------------------------------------
# estimate / validate / plan with Megatron flags and memguard's own options
# --------------------------------------------------------------------------------------------------
OWN_OPTIONS = {   # (the options that take numbers first: tried two times in three)
    "estimate": (["--gpu-memory", "--world-size", "--threshold", "--vocab-size", "--gpus", "--nnodes", "--dp-rank"],
                 ["--nproc-per-node", "--gpu", "--megatron-version", "--profile", "--device", "--set", "--model"]),
    "validate": (["--gpu-memory", "--world-size", "--threshold", "--vocab-size"],
                 ["--gpus", "--gpu", "--megatron-version", "--set", "--model"]),
    "plan": (["--gpus", "--global-batch-size", "--seq-length", "--mbs", "--gpus-per-node", "--top"],
             ["--tp", "--pp", "--cp", "--vpp", "--max-tp", "--rule", "--explain", "--recompute", "--gpu-memory",
              "--threshold", "--gpu", "--model"]),
}


def flag_case(data, command: str) -> list[str]:
    flags = list(SMALL)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        how = data.draw(st.sampled_from(["layers", "flag", "flag", "any-flag", "drop", "stray"]), label="how")
        if how == "layers":  # the setting memguard's work grows with
            flags += ["--num-layers", hostile(data, NUMBER_CLASSES, "layers")]
        elif how == "flag":
            flag = data.draw(st.sampled_from(NUMERIC_FLAGS), label="flag")
            value = any_value(data)
            flags += [flag, value] if data.draw(st.booleans(), label="separate") else [f"{flag}={value}"]
        elif how == "any-flag":  # any of Megatron's ~840 options with any value
            from megatron_memguard.readers.megatron_flags import flag_table
            flags += [data.draw(st.sampled_from(sorted(flag_table())), label="megatron flag"), any_value(data)]
        elif how == "drop" and flags:
            del flags[data.draw(st.integers(0, len(flags) - 1), label="drop")]
        else:
            flags += [any_value(data, "stray")]
    own = ["--world-size", "4"] if command != "plan" else ["--gpus", "4"]
    if command == "plan":
        own += ["--seq-length", "512", "--global-batch-size", "16"]
    numeric, other = OWN_OPTIONS[command]
    for _ in range(data.draw(st.integers(0 if command != "plan" else 1, 2), label="own options")):
        opt = one_of(data, numeric, other, "option")
        if opt == "--set":
            value = data.draw(st.sampled_from(["model.num_layers", "a..b", "", "x" * 1000]), label="key") + "=" + \
                any_value(data)
        else:
            value = hostile(data, NUMBER_CLASSES, "option value") if opt in numeric else any_value(data, "option value")
        if opt in own:
            own[own.index(opt) + 1] = value
        else:
            own += [opt, value]
    return [command, *own, "--", *flags]


@fuzz(200)
@given(data=st.data())
def test_estimate_with_hostile_flags_and_options(data):
    keep_promise(run_memguard(flag_case(data, "estimate"), cpu_limit=CPU_LIMIT, wall_limit=WALL))


@fuzz(60)
@given(data=st.data())
def test_validate_with_hostile_flags_and_options(data):
    keep_promise(run_memguard(flag_case(data, "validate"), cpu_limit=CPU_LIMIT, wall_limit=WALL))


@fuzz(80)
@given(data=st.data())
def test_plan_with_hostile_flags_and_options(data):
    keep_promise(run_memguard(flag_case(data, "plan"), cpu_limit=CPU_LIMIT, wall_limit=WALL))


# --------------------------------------------------------------------------------------------------
# Config files: Megatron functional-test, NeMo 1, NeMo launcher, Bridge, NeMo 2, Hugging Face
# --------------------------------------------------------------------------------------------------
def config_case(data) -> tuple[list[str], dict[str, str]]:
    name, text, opts = data.draw(st.sampled_from(YAML_SEEDS), label="seed")
    overrides: list[str] = []
    values: list[tuple[tuple, str]] = []
    sections: list[str] = []
    damage = 0
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        how = data.draw(st.sampled_from(["value", "value", "corrupt", "section", "override"]), label="how")
        if how == "value":
            path = one_of(data, NUMBER_LEAVES[name], LEAVES[name], "path")
            values.append((path, hostile(data, JSON_CLASSES if name.endswith(".json") else YAML_CLASSES, "raw")))
        elif how == "corrupt":
            damage += 1
        elif how == "section":  # a whole section (model:, trainer:, train: ...) replaced by a scalar or a list
            top = [k for k in LEAVES[name] if len(k) == 1]
            key = data.draw(st.sampled_from(top or [("model",)]), label="section")[0]
            value = data.draw(st.sampled_from(['3', '[1]', 'null', 'x', '???']), label='as')
            if data.draw(st.booleans(), label="as an override") and not name.endswith(".json"):
                overrides.append(f"{key}={value}")
            else:
                sections.append(f"\n{key}: {value}\n")
        elif not name.endswith(".json"):
            path = one_of(data, NUMBER_LEAVES[name], LEAVES[name], "override path")
            key = ".".join(str(p) for p in path)
            value = hostile(data, YAML_CLASSES if data.draw(st.booleans(), label="yaml") else NUMBER_CLASSES, "override")
            overrides.append(key + "=" + value)
    text = with_values(text, name, values) + "".join(sections)  # (a repeated top-level key: the last wins)
    for _ in range(damage):
        text = corrupt(text, data)
    command = data.draw(st.sampled_from(["validate", "estimate", "estimate", "plan"]), label="command")
    flags = opts[opts.index("--"):] if "--" in opts else []
    own = opts[:opts.index("--")] if "--" in opts else list(opts)
    if command == "validate":
        argv = ["validate", name, *overrides, *own, *flags]
    elif command == "estimate":
        argv = ["estimate", "--config", name, *sum((["--set", o] for o in overrides), []), *own, *flags]
    else:
        argv = ["plan", "--config", name, "--seq-length", "512", "--global-batch-size", "64", "--max-tp", "8", *own,
                *flags, *overrides]
    return argv, {name: text}


@fuzz(200)
@given(data=st.data())
def test_config_files_with_hostile_values_and_damage(data):
    argv, files = config_case(data)
    keep_promise(run_memguard(argv, files, cpu_limit=CPU_LIMIT, wall_limit=WALL))


# --------------------------------------------------------------------------------------------------
# check: launch scripts and launch commands
# --------------------------------------------------------------------------------------------------
@fuzz(100)
@given(data=st.data())
def test_check_with_hostile_launch_scripts_and_commands(data):
    script = LAUNCH
    env: dict[str, str] = {}
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        how = data.draw(st.sampled_from(["line", "value", "corrupt", "env"]), label="how")
        if how == "line":
            lines = script.splitlines(keepends=True)
            at = data.draw(st.integers(0, len(lines)), label="at")
            extra = hostile(data, SHELL_CLASSES, "line")
            if extra.startswith("A='$A$A'"):
                script = script.replace('--save "/ckpt/run 1"', '--save "$A" $OPTS')
            script = "".join(lines[:at] + [extra] + lines[at:])
        elif how == "value":
            flag = data.draw(st.sampled_from(["--num-layers", "--hidden-size", "--nproc-per-node", "--nnodes",
                                              "--micro-batch-size", "--tensor-model-parallel-size", "--save"]), label="flag")
            value = any_value(data)
            quoted = data.draw(st.booleans(), label="quoted")
            script = script.replace(flag + " ", f"{flag} {shlex.quote(value) if quoted else value} _x ", 1)
        elif how == "corrupt":
            script = corrupt(script, data)
        else:
            var = data.draw(st.sampled_from(["WORLD_SIZE", "SLURM_NTASKS", "SLURM_NNODES", "PET_NNODES", "NNODES",
                                             "SLURM_GPUS_PER_NODE"]), label="variable")
            env[var] = hostile(data, NUMBER_CLASSES, "variable value")
    form = data.draw(st.sampled_from(["file", "file", "command", "estimate"]), label="form")
    opts = []
    if data.draw(st.booleans(), label="own option"):
        opts = [data.draw(st.sampled_from(["--world-size", "--gpu-memory", "--threshold", "--cwd", "--model", "--set",
                                           "--gpu"]), label="option"), any_value(data, "option value")]
    if form == "file":
        argv, files = ["check", *opts, "--file", "run.sh"], {"run.sh": script}
    elif form == "estimate":
        argv, files = ["estimate", *opts, "--config", "run.sh"], {"run.sh": script}
    else:
        last = [l for l in script.splitlines() if "torchrun" in l] or [script]
        try:
            toks = shlex.split(last[-1].rstrip("\\"))
        except ValueError:
            toks = last[-1].split()
        argv, files = ["check", *opts, "--", *toks], {}
    keep_promise(run_memguard(argv, files, env=env, cpu_limit=CPU_LIMIT, wall_limit=WALL))


# --------------------------------------------------------------------------------------------------
# report: run logs
# --------------------------------------------------------------------------------------------------
@fuzz(150)
@given(data=st.data())
def test_report_with_hostile_run_logs(data):
    records = json.loads(json.dumps(RUNLOG))
    raws: list[str] = []
    inserts: list[tuple[int, str]] = []
    damage = 0
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        how = data.draw(st.sampled_from(["field", "field", "line", "corrupt"]), label="how")
        if how == "field":
            i = data.draw(st.integers(0, len(RUNLOG) - 1), label="record")
            key = one_of(data, *RUNLOG_RECORD_FIELDS[i], "field")
            node, leaf = (records[i][key[0]], key[1]) if isinstance(key, tuple) else (records[i], key)
            if isinstance(node, dict):
                node[leaf] = f"{SENTINEL}{len(raws)}x"
                raws.append(hostile(data, JSON_CLASSES, "raw"))
        elif how == "line":
            inserts.append((data.draw(st.integers(0, len(RUNLOG)), label="at"), hostile(data, JSON_CLASSES, "line")))
        else:
            damage += 1
    text = "\n".join(json.dumps(r) for r in records)
    for k, raw in enumerate(raws):
        text = text.replace(f'"{SENTINEL}{k}x"', raw)
    lines = text.split("\n")
    for at, line in inserts:
        lines.insert(at, line)
    text = "\n".join(lines)
    for _ in range(damage):
        text = corrupt(text, data)
    opts = data.draw(st.lists(st.sampled_from(["--skip-bad-lines", "--json", "--all-ranks", "--run=all", "--run=x"]),
                              max_size=2), label="options")
    where = data.draw(st.sampled_from(["dir", "file", "missing"]), label="where")
    files = {"memguard-rank00000.jsonl": text + "\n"}
    target = {"dir": ".", "file": "memguard-rank00000.jsonl", "missing": "nowhere"}[where]
    keep_promise(run_memguard(["report", target, *opts], files, cpu_limit=CPU_LIMIT, wall_limit=WALL))


@fuzz(60)
@given(data=st.data())
def test_report_and_calibrate_with_hostile_megatron_logs(data):
    import re
    text = MEGATRON_LOG
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        how = data.draw(st.sampled_from(["number", "number", "argument", "line", "corrupt"]), label="how")
        if how == "number":   # a number of a memory, iteration or OOM line
            ours = [m for m in re.finditer(r"\d+(?:\.\d+)?", text[-3000:])]
            if not ours:
                continue
            m = data.draw(st.sampled_from(ours), label="number")
            at = len(text) - 3000 + m.start()
            text = text[:at] + hostile(data, NUMBER_CLASSES, "value") + text[at + len(m.group(0)):]
        elif how == "argument":
            name = data.draw(st.sampled_from(["num_layers", "hidden_size", "seq_length", "micro_batch_size",
                                              "global_batch_size", "world_size", "tensor_model_parallel_size",
                                              "padded_vocab_size", "params_dtype"]), label="argument")
            text = re.sub(rf"(\n  {name} \.+ )[^\n]*", lambda m: m.group(1) + any_value(data), text, count=1)
        elif how == "line":
            at = data.draw(st.sampled_from([0, len(text) // 2, len(text)]), label="at")
            text = text[:at] + hostile(data, MEGATRON_LOG_LINES, "line") + text[at:]
        else:
            text = corrupt(text, data)
    command = data.draw(st.sampled_from(["report", "report", "calibrate"]), label="command")
    files = {"rank0.log": text}
    if command == "calibrate":
        files["run2.log"] = files["run3.log"] = text   # (calibrate needs three runs)
        argv = ["calibrate", "rank0.log", "run2.log", "run3.log"]
    else:
        argv = ["report", "rank0.log", *data.draw(st.lists(st.sampled_from(["--json", "--gpu", "A100-80GB", "--all-ranks"]),
                                                            max_size=2), label="options")]
    keep_promise(run_memguard(argv, files, cpu_limit=CPU_LIMIT, wall_limit=WALL))


@fuzz(15)
@given(extra=st.lists(st.sampled_from(["--json", "--help", "-x", "x" * 1000, "--json=1", "é"]), max_size=2))
def test_gpus_and_no_command(extra):
    keep_promise(run_memguard(["gpus", *extra], cpu_limit=CPU_LIMIT, wall_limit=WALL))
    keep_promise(run_memguard(list(extra), cpu_limit=CPU_LIMIT, wall_limit=WALL))


# --------------------------------------------------------------------------------------------------
# The Megatron hook's flags and MEMGUARD_* variables; the Megatron-Bridge pre-flight
# --------------------------------------------------------------------------------------------------
@fuzz(15)
@given(data=st.data())
def test_hook_flags_and_variables(data, capsys):
    import argparse

    from megatron_memguard.errors import ConfigError
    from megatron_memguard.megatron.flags import FLAGS, add_arguments, settings_from_args

    spec = data.draw(st.sampled_from(FLAGS), label="flag")
    value = any_value(data)
    env = {spec.env: value} if data.draw(st.booleans(), label="from the environment") else {}
    p = add_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py"), environ=env)
    problem = None
    try:
        ns = p.parse_args([] if env else [spec.flag, value])
        settings_from_args(ns, environ=env)
    except SystemExit as e:
        last = (capsys.readouterr().err.strip().splitlines() or [""])[-1]
        if not (e.code == 2 and len(last) < 400 and last.startswith("pretrain_gpt.py: error: ")):
            problem = f"exit {e.code}, error of {len(last)} characters: {last[:200]}"
    except ConfigError as e:
        if len(str(e)) >= 400:
            problem = f"error of {len(str(e))} characters"
    except Exception as e:  # noqa: BLE001
        problem = f"exception escaped: {type(e).__name__}: {str(e)[:200]}"
    keep_promise_of(f"hook {spec.flag}{' (from ' + spec.env + ')' if env else ''} = {value!r}", problem)


@fuzz(15)
@given(data=st.data())
def test_bridge_preflight_with_hostile_arguments(data):
    from megatron_memguard.bridge import preflight
    from megatron_memguard.errors import ConfigError

    cfg = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128, "seq_length": 128},
           "train": {"micro_batch_size": 1, "global_batch_size": 8}}
    where = data.draw(st.sampled_from(["model", "train", "gpu_memory", "threshold", "mode", "env"]), label="where")
    value = data.draw(st.sampled_from([float("inf"), float("nan"), 10**400, -1, [1], {}]), label="value") \
        if data.draw(st.booleans(), label="python value") else any_value(data)
    kw = {"world_size": 8, "gpu": "H100-80GB", "emit": lambda s: None, "environ": {}}
    if where in ("model", "train"):
        cfg[where][data.draw(st.sampled_from(sorted(cfg[where])), label="key")] = value
    elif where == "env":
        kw["environ"] = {data.draw(st.sampled_from(["MEMGUARD", "MEMGUARD_THRESHOLD", "MEMGUARD_GPU_MEMORY", "WORLD_SIZE"]),
                                   label="variable"): str(value)[:1000]}
        kw.pop("gpu")
    else:
        kw[where] = value
    problem = None
    try:
        r = preflight(cfg, **kw)
        if r.action not in ("skipped", "unsupported", "unknown", "fits", "reported", "warned", "abort") \
                or "Traceback" in r.reason or len(r.reason) >= 1200:
            problem = f"action {r.action}: {r.reason[:200]}"
    except ConfigError as e:   # a bad argument of the call itself (mode, threshold, gpu, gpu_memory)
        if len(str(e)) >= 1200:
            problem = f"error of {len(str(e))} characters"
    except Exception as e:  # noqa: BLE001
        problem = f"exception escaped: {type(e).__name__}: {str(e)[:200]}"
    keep_promise_of(f"bridge preflight {where} = {value!r}"[:300], problem)
