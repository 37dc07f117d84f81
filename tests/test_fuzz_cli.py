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

Derandomized (the same cases on every run): 2,790 cases, 2,700 of them memguard runs (600 estimate, 200
validate, 240 plan, 600 config files, 300 check, 500 report, 200 Megatron logs, 60 gpus / no command),
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
    """``n`` cases, the same on every run. Each case gets a Random seeded by hypothesis (``st.randoms``)
    and makes every choice from it uniformly: hypothesis' own draws favour small, simple values, and a
    fuzz with a fixed budget must try every class of hostile input about as often as the others."""
    def wrap(test):
        return settings(max_examples=n, derandomize=True, deadline=None, database=None, print_blob=False,
                        suppress_health_check=list(HealthCheck))(given(rnd=st.randoms(use_true_random=True))(test))
    return wrap


class Draw:
    """Uniform choices from a case's Random; the notable ones are noted for the report of a failure."""

    def __init__(self, rnd):
        self.rnd = rnd
        self.notes: list[str] = []

    def pick(self, items, note: str = ""):
        x = self.rnd.choice(list(items))
        if note:
            self.notes.append(f"{note} {x!r}")
        return x

    def int(self, lo: int, hi: int) -> int:
        return self.rnd.randint(lo, hi)

    def coin(self) -> bool:
        return self.rnd.random() < 0.5

    def some(self, items, most: int) -> list:
        return [self.rnd.choice(list(items)) for _ in range(self.int(0, most))]

    def hostile(self, classes: dict, note: str = "") -> str:
        """A class of hostile values, then a value of it (every class as often as the others)."""
        cls = self.pick(classes)
        return V(self.pick(classes[cls], note and f"{note} ({cls})"))

    def any_value(self, note: str = "") -> str:
        """A number two times in three (counts and sizes are what memguard computes with), else any text."""
        return self.hostile(NUMBER_CLASSES if self.int(0, 2) else TEXT_CLASSES, note)

    def one_of(self, preferred: list, others: list, note: str = ""):
        """An element of ``preferred`` two times in three, else of ``others``."""
        return self.pick(preferred if self.int(0, 2) else others, note)


def run(d: Draw, argv, files=None, env=None) -> None:
    o = run_memguard(argv, files, env, cpu_limit=CPU_LIMIT, wall_limit=WALL)
    o.note = "; ".join(d.notes)
    keep_promise(o)


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
# Text damage
# --------------------------------------------------------------------------------------------------
def corrupt(text: str, d: Draw) -> str:
    """Text-level damage: cut the text, insert a character, drop or repeat a line."""
    kind = d.pick(["cut", "insert", "drop", "repeat"], "damage")
    i = d.int(0, max(0, len(text) - 1))
    if kind == "cut":
        return text[:i]
    if kind == "insert":
        return text[:i] + d.pick(":{}[]&*!|>'\"%@`#\t\n\\$\x00\ufeff") + text[i:]
    lines = text.splitlines(keepends=True)
    j = i % max(1, len(lines))
    if kind == "drop":
        return "".join(lines[:j] + lines[j + 1:])
    return "".join(lines[:j] + [lines[j] if lines else ""] * 50 + lines[j:])


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


def flag_case(d: Draw, command: str) -> list[str]:
    from megatron_memguard.readers.megatron_flags import flag_table

    flags = list(SMALL)
    for _ in range(d.int(1, 3)):
        how = d.pick(["layers", "flag", "flag", "any-flag", "drop", "stray"])
        if how == "layers":  # the setting memguard's work grows with
            flags += ["--num-layers", d.hostile(NUMBER_CLASSES)]
        elif how == "flag":
            flag, value = d.pick(NUMERIC_FLAGS), d.any_value()
            flags += [flag, value] if d.coin() else [f"{flag}={value}"]
        elif how == "any-flag":  # any of Megatron's ~840 options with any value
            flags += [d.pick(sorted(flag_table())), d.any_value()]
        elif how == "drop" and flags:
            del flags[d.int(0, len(flags) - 1)]
        else:
            flags += [d.any_value()]
    own = ["--world-size", "4"] if command != "plan" else ["--gpus", "4"]
    if command == "plan":
        own += ["--seq-length", "512", "--global-batch-size", "16"]
    numeric, other = OWN_OPTIONS[command]
    for _ in range(d.int(0 if command != "plan" else 1, 2)):
        opt = d.one_of(numeric, other)
        if opt == "--set":
            value = d.pick(["model.num_layers", "a..b", "", "x" * 1000]) + "=" + d.any_value()
        else:
            value = d.hostile(NUMBER_CLASSES) if opt in numeric else d.any_value()
        if opt in own:
            own[own.index(opt) + 1] = value
        else:
            own += [opt, value]
    return [command, *own, "--", *flags]


@fuzz(600)
def test_estimate_with_hostile_flags_and_options(rnd):
    d = Draw(rnd)
    run(d, flag_case(d, "estimate"))


@fuzz(200)
def test_validate_with_hostile_flags_and_options(rnd):
    d = Draw(rnd)
    run(d, flag_case(d, "validate"))


@fuzz(240)
def test_plan_with_hostile_flags_and_options(rnd):
    d = Draw(rnd)
    run(d, flag_case(d, "plan"))


# --------------------------------------------------------------------------------------------------
# Config files: Megatron functional-test, NeMo 1, NeMo launcher, Bridge, NeMo 2, Hugging Face
# --------------------------------------------------------------------------------------------------
def config_case(d: Draw) -> tuple[list[str], dict[str, str]]:
    name, text, opts = d.pick(YAML_SEEDS)
    d.notes.append(name)
    overrides: list[str] = []
    values: list[tuple[tuple, str]] = []
    sections: list[str] = []
    damage = 0
    for _ in range(d.int(1, 3)):
        how = d.pick(["value", "value", "corrupt", "section", "override"])
        if how == "value":
            path = d.one_of(NUMBER_LEAVES[name], LEAVES[name], "at")
            values.append((path, d.hostile(JSON_CLASSES if name.endswith(".json") else YAML_CLASSES, "value")))
        elif how == "corrupt":
            damage += 1
        elif how == "section":  # a whole section (model:, trainer:, train: ...) replaced by a scalar or a list
            top = [k for k in LEAVES[name] if len(k) == 1]
            key = d.pick(top or [("model",)])[0]
            value = d.pick(["3", "[1]", "null", "x", "???"])
            if d.coin() and not name.endswith(".json"):
                overrides.append(f"{key}={value}")
            else:
                sections.append(f"\n{key}: {value}\n")
                d.notes.append(f"section {key}: {value}")
        elif not name.endswith(".json"):
            key = ".".join(str(p) for p in d.one_of(NUMBER_LEAVES[name], LEAVES[name]))
            overrides.append(key + "=" + d.hostile(YAML_CLASSES if d.coin() else NUMBER_CLASSES))
    text = with_values(text, name, values) + "".join(sections)  # (a repeated top-level key: the last wins)
    for _ in range(damage):
        text = corrupt(text, d)
    command = d.pick(["validate", "estimate", "estimate", "plan"])
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


@fuzz(600)
def test_config_files_with_hostile_values_and_damage(rnd):
    d = Draw(rnd)
    argv, files = config_case(d)
    run(d, argv, files)


# --------------------------------------------------------------------------------------------------
# check: launch scripts and launch commands
# --------------------------------------------------------------------------------------------------
@fuzz(300)
def test_check_with_hostile_launch_scripts_and_commands(rnd):
    d = Draw(rnd)
    script = LAUNCH
    env: dict[str, str] = {}
    for _ in range(d.int(1, 3)):
        how = d.pick(["line", "value", "corrupt", "env"])
        if how == "line":
            lines = script.splitlines(keepends=True)
            at = d.int(0, len(lines))
            extra = d.hostile(SHELL_CLASSES, "line")
            if extra.startswith("A='$A$A'"):
                script = script.replace('--save "/ckpt/run 1"', '--save "$A" $OPTS')
            script = "".join(lines[:at] + [extra] + lines[at:])
        elif how == "value":
            flag = d.pick(["--num-layers", "--hidden-size", "--nproc-per-node", "--nnodes", "--micro-batch-size",
                           "--tensor-model-parallel-size", "--save"], "flag")
            value = d.any_value("value")
            script = script.replace(flag + " ", f"{flag} {shlex.quote(value) if d.coin() else value} _x ", 1)
        elif how == "corrupt":
            script = corrupt(script, d)
        else:
            env[d.pick(["WORLD_SIZE", "SLURM_NTASKS", "SLURM_NNODES", "PET_NNODES", "NNODES", "SLURM_GPUS_PER_NODE"],
                       "variable")] = d.hostile(NUMBER_CLASSES, "=")
    form = d.pick(["file", "file", "command", "estimate"])
    opts = []
    if d.coin():
        opts = [d.pick(["--world-size", "--gpu-memory", "--threshold", "--cwd", "--model", "--set", "--gpu"]), d.any_value()]
    if form == "file":
        argv, files = ["check", *opts, "--file", "run.sh"], {"run.sh": script}
    elif form == "estimate":
        argv, files = ["estimate", *opts, "--config", "run.sh"], {"run.sh": script}
    else:
        last = [line for line in script.splitlines() if "torchrun" in line] or [script]
        try:
            toks = shlex.split(last[-1].rstrip("\\"))
        except ValueError:
            toks = last[-1].split()
        argv, files = ["check", *opts, "--", *toks], {}
    run(d, argv, files, env)


# --------------------------------------------------------------------------------------------------
# report: memguard's run logs; report and calibrate: Megatron's logs
# --------------------------------------------------------------------------------------------------
@fuzz(500)
def test_report_with_hostile_run_logs(rnd):
    d = Draw(rnd)
    records = json.loads(json.dumps(RUNLOG))
    raws: list[str] = []
    inserts: list[tuple[int, str]] = []
    damage = 0
    for _ in range(d.int(1, 3)):
        how = d.pick(["field", "field", "line", "corrupt"])
        if how == "field":   # a record (those whose numbers the report prints twice as often), then a field
            i = d.pick([0, 1, 2, 2, 3, 4, 4, 5])
            key = d.one_of(*RUNLOG_RECORD_FIELDS[i], f"record {i} field")
            node, leaf = (records[i][key[0]], key[1]) if isinstance(key, tuple) else (records[i], key)
            if isinstance(node, dict):
                node[leaf] = f"{SENTINEL}{len(raws)}x"
                raws.append(d.hostile(JSON_CLASSES, "="))
        elif how == "line":
            inserts.append((d.int(0, len(RUNLOG)), d.hostile(JSON_CLASSES, "line")))
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
        text = corrupt(text, d)
    opts = d.some(["--skip-bad-lines", "--json", "--all-ranks", "--run=all", "--run=x"], 2)
    target = d.pick([".", ".", "memguard-rank00000.jsonl", "nowhere"])
    run(d, ["report", target, *opts], {"memguard-rank00000.jsonl": text + "\n"})


@fuzz(200)
def test_report_and_calibrate_with_hostile_megatron_logs(rnd):
    import re

    d = Draw(rnd)
    text = MEGATRON_LOG
    for _ in range(d.int(1, 3)):
        how = d.pick(["number", "number", "argument", "line", "corrupt"])
        if how == "number":   # a number of a memory, iteration or OOM line (they end the log)
            ours = list(re.finditer(r"\d+(?:\.\d+)?", text[-3000:]))
            if ours:
                m = d.pick(ours)
                at = len(text) - 3000 + m.start()
                text = text[:at] + d.hostile(NUMBER_CLASSES, "number") + text[at + len(m.group(0)):]
        elif how == "argument":
            name = d.pick(["num_layers", "hidden_size", "seq_length", "micro_batch_size", "global_batch_size",
                           "world_size", "tensor_model_parallel_size", "padded_vocab_size", "params_dtype"], "argument")
            value = d.any_value("=")
            text = re.sub(rf"(\n  {name} \.+ )[^\n]*", lambda m: m.group(1) + value, text, count=1)
        elif how == "line":
            at = d.pick([0, len(text) // 2, len(text)])
            text = text[:at] + d.hostile(MEGATRON_LOG_LINES, "line") + text[at:]
        else:
            text = corrupt(text, d)
    files = {"rank0.log": text}
    if d.int(0, 2) == 0:
        files["run2.log"] = files["run3.log"] = text   # (calibrate needs three runs)
        argv = ["calibrate", "rank0.log", "run2.log", "run3.log"]
    else:
        argv = ["report", "rank0.log", *d.some(["--json", "--gpu", "A100-80GB", "--all-ranks"], 2)]
    run(d, argv, files)


@fuzz(30)
def test_gpus_and_no_command(rnd):
    d = Draw(rnd)
    extra = d.some(["--json", "--help", "-x", "x" * 1000, "--json=1", "é"], 2)
    run(d, ["gpus", *extra])
    run(d, extra)


# --------------------------------------------------------------------------------------------------
# The Megatron hook's flags and MEMGUARD_* variables; the Megatron-Bridge pre-flight
# --------------------------------------------------------------------------------------------------
@fuzz(60)
def test_hook_flags_and_variables(rnd, capsys):
    import argparse

    from megatron_memguard.errors import ConfigError
    from megatron_memguard.megatron.flags import FLAGS, add_arguments, settings_from_args

    d = Draw(rnd)
    spec = d.pick(FLAGS)
    value = d.any_value()
    env = {spec.env: value} if d.coin() else {}
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


@fuzz(60)
def test_bridge_preflight_with_hostile_arguments(rnd):
    from megatron_memguard.bridge import preflight
    from megatron_memguard.errors import ConfigError

    d = Draw(rnd)
    cfg = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128, "seq_length": 128},
           "train": {"micro_batch_size": 1, "global_batch_size": 8}}
    where = d.pick(["model", "train", "gpu_memory", "threshold", "mode", "env"])
    value = d.pick([float("inf"), float("nan"), 10**400, -1, [1], {}]) if d.coin() else d.any_value()
    kw = {"world_size": 8, "gpu": "H100-80GB", "emit": lambda s: None, "environ": {}}
    if where in ("model", "train"):
        cfg[where][d.pick(sorted(cfg[where]))] = value
    elif where == "env":
        kw["environ"] = {d.pick(["MEMGUARD", "MEMGUARD_THRESHOLD", "MEMGUARD_GPU_MEMORY", "WORLD_SIZE"]): str(value)[:1000]}
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
    keep_promise_of(f"bridge preflight {where} = {str(value)[:100]!r}", problem)
