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

Derandomized (the same cases on every run): 3,390 cases, 3,300 of them memguard runs (600 estimate, 200
validate, 240 plan, 600 config files, 300 check, 500 report, 200 Megatron logs, 60 gpus / no command, 600
of the newer features' inputs: MoE / FP8 / FSDP / offload / CUDA-graph / MTP flags, --moe-layer-freq
expressions, --tp-comm-overlap-cfg YAML, Megatron-Bridge MoE recipes with --set, NeMo 2 MoE exports),
about 1.5 minutes on two cores; 120 more for issue hostile4's surfaces (--megatron-version, fp32
accumulation patterns, config.json and Bridge model fields of the wrong kind); 150 for issue hostile5's (hybrid Mamba
patterns and sizes, the Nemotron-H recipe, LoRA / DoRA sections, MTP stages, latent MoE / capacity / upcycling sizes,
attention backends and GPU names, plan of hybrid models, logs of hybrid and MTP runs; about 20 s). ``MEMGUARD_FUZZ_RECORD=FILE`` appends each broken case to FILE instead of
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
    HYBRID, HYBRID_PATTERNS, JSON_CLASSES, LAUNCH, LEAVES, MEGATRON_LOG, MEGATRON_LOG_LINES, MTP_LAYOUTS, NUMBER_CLASSES,
    NUMBER_LEAVES, NUMERIC_FLAGS, RUNLOG, RUNLOG_RECORD_FIELDS, SENTINEL, SHELL_CLASSES, SMALL, TEXT_CLASSES, YAML_CLASSES,
    YAML_SEEDS, V, run_memguard, alias_bomb, with_values,
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


# --------------------------------------------------------------------------------------------------
# This round's inputs: MoE / FP8 / FSDP / offload / CUDA graph / MTP flags, --moe-layer-freq expressions,
# --tp-comm-overlap-cfg YAML, Megatron-Bridge MoE recipes with --set, NeMo 2 MoE exports
# --------------------------------------------------------------------------------------------------
MOE = SMALL + ["--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--sequence-parallel",
               "--position-embedding-type", "rope"]
# flags whose values Megatron types as int / float / one of its choices (arguments.py, core 0.19.2)
FEATURE_NUMBERS = ["--expert-model-parallel-size", "--expert-tensor-parallel-size", "--num-experts", "--moe-router-topk",
                   "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size", "--moe-expert-capacity-factor",
                   "--mtp-num-layers", "--moe-router-num-groups", "--moe-router-group-topk", "--cpu-offloading-num-layers",
                   "--optimizer-offload-fraction", "--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16",
                   "--fp8-amax-history-len", "--cuda-graph-warmup-steps", "--moe-flex-dispatcher-num-sms",
                   "--min-offloaded-tensor-size", "--ddp-bucket-size", "--suggested-communication-unit-size"]
FEATURE_WORDS = {
    "--moe-token-dispatcher-type": ["allgather", "alltoall", "flex", "alltoall_seq"],
    "--moe-flex-dispatcher-backend": ["deepep", "hybridep", "ncclep"],
    "--fp8-format": ["e4m3", "hybrid", "e5m2"], "--fp8-recipe": ["delayed", "tensorwise", "blockwise", "mxfp8", "custom"],
    "--fp4-format": ["e2m1"], "--fp4-recipe": ["nvfp4", "custom"],
    "--data-parallel-sharding-strategy": ["no_shard", "optim", "optim_grads", "optim_grads_params"],
    "--cuda-graph-impl": ["none", "local", "transformer_engine", "full_iteration"],
    "--cuda-graph-modules": ["attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "full_iteration"],
    "--recompute-modules": ["moe", "moe_act", "shared_experts", "core_attn", "mla_up_proj", "layernorm"],
    "--offload-modules": ["attn_norm", "core_attn", "expert_fc1", "moe_act", "attn_proj"],
    "--optimizer": ["muon", "dist_muon", "adaptive_muon", "lion", "soap"],
    "--moe-router-load-balancing-type": ["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing"],
    "--moe-router-score-function": ["softmax", "sigmoid", "sqrtsoftplus"],
    "--symmetric-ar-type": ["two_shot", "one_shot", "multimem_all_reduce"],
}
FEATURE_SWITCHES = ["--use-megatron-fsdp", "--use-torch-fsdp2", "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute",
                    "--moe-grouped-gemm", "--moe-layer-recompute", "--fine-grained-activation-offloading",
                    "--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--fp8-param-gather", "--fp8-output-proj",
                    "--first-last-layers-bf16", "--moe-pad-expert-input-to-capacity", "--moe-shared-expert-gate",
                    "--enable-cuda-graph", "--external-cuda-graph", "--tp-comm-overlap", "--moe-permute-fusion",
                    "--moe-router-enable-expert-bias", "--overlap-dispatch-backward-with-experts-wgrad"]
# --moe-layer-freq: Megatron evaluates a list expression (digits , [ ] ( ) + *)
FREQ_EXPRESSIONS = {
    "valid": ["1", "2", "4", "([0]*1+[1]*3)", "[1,0]*2", "([1]*2)*2", "[0]*4"],
    "malformed": ["[1]*", "(", "[[1]]*4", "[1]*4*4", "[]", "[,1]", "[1]*4+", ")(" * 1000, "[1]*-4", "[2]*4"],
    "huge": ["[1]*" + "9" * 400, "[1]*(2**40)", "+".join(["[1]*99999"] * 900), "[1]*999999999", "(" * 3000 + "[1]" + ")" * 3000,
             "[" * 5000 + "1" + "]" * 5000, "[1]" + "*2" * 60],
    "hostile": ["__import__('os')", "[1 for _ in range(4)]", "[1]*4;", "1e3", "0x4", "[True]*4", "'a'*4"],
}
UB_CFGS = {   # --tp-comm-overlap-cfg: TE's ub_cfgs as YAML
    "valid": ["qkv_fprop: {method: ring_exchange}\n", "fc2_fprop: {method: pipeline, num_sm: 24, fp8_buf: 1}\n", "{}\n"],
    "types": ["- a\n", "3\n", "null\n", "qkv_fprop: 7\n", "qkv_fprop: {method: [1, 2]}\n", "qkv_fprop: {num_splits: x}\n",
              "qkv_fprop: {method: bulk, num_sm: -1}\n", "qkv_fprop: {num_sm: 1e400}\n", "qkv_fprop: {fp8_buf: .nan}\n"],
    "deep": ["a: " * 60 + "1\n", "[" * 100_000 + "\n", "{" * 50_000 + "\n"],
    "aliases": [f"qkv_fprop: {alias_bomb(5)}\n", "a: &x [*x]\n", f"fc1_fprop: {alias_bomb(6, 6)}\n"],
    "huge": ["x: '" + "y" * 900_000 + "'\n", "".join(f"k{i}: {{method: ring_exchange}}\n" for i in range(30_000))],
    "damaged": ["qkv_fprop: {method: ring_exchange\n", "\x00\x01\x02", "\ufeffqkv_fprop: [\n", "%YAML 9.9\n---\na: 1\n"],
}
BRIDGE_RECIPES = ["qwen3_30b_a3b", "qwen3_30b_a3b_8gpu", "deepseek_v2_lite", "deepseek_v3", "olmoe_7b",
                  "qwen3_235b_a22b_pretrain_config", "kimi_k2_pretrain_config", "deepseek_v4_flash_pretrain_config",
                  "qwen3_next_80b_a3b_pretrain_config", "qwen3_30b_a3b_pretrain_8gpu_gb200_fp8mx_functional_config",
                  "qwen3_30b_a3b_x", "", "x" * 1000]
BRIDGE_KEYS = ["model.num_moe_experts", "model.moe_router_topk", "model.expert_model_parallel_size",
               "model.expert_tensor_parallel_size", "model.moe_layer_freq", "model.moe_token_dispatcher_type",
               "model.moe_ffn_hidden_size", "model.mtp_num_layers", "model.moe_shared_expert_intermediate_size",
               "model.num_layers", "train.micro_batch_size", "ddp.data_parallel_sharding_strategy",
               "mixed_precision", "comm_overlap.tp_comm_overlap_cfg", "model.moe_expert_capacity_factor", "model"]


def _nemo2_export() -> str:
    from test_readers_nemo2_moe import QWEN3_30B_A3B_EXPORT
    return QWEN3_30B_A3B_EXPORT


NEMO2_KEYS = [("model", "config", "num_moe_experts"), ("model", "config", "moe_router_topk"),
              ("model", "config", "moe_layer_freq"), ("model", "config", "_target_"), ("model", "config"),
              ("trainer", "strategy", "expert_model_parallel_size"), ("trainer", "strategy", "expert_tensor_parallel_size"),
              ("model", "config", "recompute_num_layers"), ("data", "micro_batch_size"), ("trainer", "devices"),
              ("model", "config", "moe_token_dispatcher_type"), ("model", "config", "mtp_num_layers")]


@fuzz(600)
def test_new_feature_inputs_with_hostile_values(rnd):
    d = Draw(rnd)
    kind = d.pick(["flags", "flags", "freq", "ubcfg", "bridge", "nemo2"], "kind")
    files: dict[str, str] = {}
    if kind in ("flags", "freq", "ubcfg"):
        flags = list(MOE)
        if kind == "freq":
            flags += ["--moe-layer-freq", d.hostile(FREQ_EXPRESSIONS, "freq")]
        elif kind == "ubcfg":
            files["ub.yaml"] = d.hostile(UB_CFGS, "ub")
            flags += ["--tp-comm-overlap", "--tp-comm-overlap-cfg", d.pick(["ub.yaml", "ub.yaml", "missing.yaml", "."])]
        for _ in range(d.int(1, 3)):
            how = d.pick(["number", "word", "switch"])
            if how == "number":
                flags += [d.pick(FEATURE_NUMBERS), d.hostile(NUMBER_CLASSES)]
            elif how == "word":
                flag = d.pick(sorted(FEATURE_WORDS))
                flags += [flag, d.pick(FEATURE_WORDS[flag]) if d.coin() else d.any_value()]
            else:
                flags.append(d.pick(FEATURE_SWITCHES))
        command = d.pick(["estimate", "estimate", "validate", "plan"])
        own = ["--gpus", "8", "--seq-length", "512", "--global-batch-size", "16"] if command == "plan" else ["--world-size", "8"]
        argv = [command, *own, "--gpu", d.pick(["H100-80GB", "B200", "A100-80GB"]), "--", *flags]
    elif kind == "bridge":
        overrides = []
        for _ in range(d.int(0, 2)):
            value = d.hostile(YAML_CLASSES if d.coin() else NUMBER_CLASSES)
            overrides += ["--set", f"{d.pick(BRIDGE_KEYS)}={value}"]
        argv = ["estimate", "--model", d.pick(BRIDGE_RECIPES), *overrides]
        if d.coin():
            argv += ["--gpus", d.pick(["8", "16", "1", "3", "inf"])]
    else:
        text = _nemo2_export()
        values = [(d.pick(NEMO2_KEYS), d.hostile(YAML_CLASSES, "value")) for _ in range(d.int(1, 2))]
        text = with_values(text, "nemo2.yaml", values)
        if d.int(0, 3) == 0:
            text = corrupt(text, d)
        files["nemo2.yaml"] = text
        argv = ["estimate", "--config", "nemo2.yaml"] + (["--gpus", "8"] if d.coin() else []) if d.coin() \
            else ["validate", "nemo2.yaml"]
    run(d, argv, files)


# --------------------------------------------------------------------------------------------------
# Issue hostile4: --megatron-version, DDP's fp32 accumulation patterns, MoE router / expert flags of the newer
# releases, config.json MoE fields and Bridge model fields of the wrong kind, the hook's odd types
# --------------------------------------------------------------------------------------------------
VERSIONS = {
    "releases": ["0.16", "0.17", "0.18.2", "0.19", "core_v0.17.1", "v0.18"],
    "builds": ["0.19.0rc0", "0.18.0.dev0+g1234", "0.16.1.post2", "0.17.0a1", "0.20", "0.15", "99"],
    "no release": ["", " ", "1!0.16", "0.18.", "٠.١٨", "9" * 41, "0x13", "latest"],
}
PATTERN_SETS = {
    "plain": [["*router*"], ["*layer_norm*", "*bias"], ["all"], ["*embedding*", "*output_layer*"], ["*experts*"]],
    "indexed": [["*layers.1.*"], ["*layers.1?.*"], ["*[02468].mlp*"], ["*linear_fc1*"], ["*weight1"]],
    "bombs": [["[" * 5000], ["*a" * 5000], ["?" * 5000], [f"*x{i}*" for i in range(2000)], ["\\"], ["[!]"], [""]],
}
NEWER_FLAGS = [["--moe-router-score-function", "sqrtsoftplus"], ["--moe-router-load-balancing-type", "quantile_balancing"],
               ["--moe-input-jitter-eps", "0.01"], ["--moe-router-force-biased", "0.5"], ["--moe-apply-probs-on-input"],
               ["--moe-latent-size", "128"], ["--use-grouped-gemm-for-shared-expert"], ["--use-nccl-ub"],
               ["--moe-router-padding-for-quantization"], ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"],
               ["--freeze-all-layers"], ["--cuda-graph-modules", "attn"]]
WRONG_KINDS = ["{a: 1}", "{}", "maybe", "[1, 2]", "{_target_: x.y}", ".nan", "1e400", "null", "''"]


@fuzz(120)
def test_release_surfaces_with_hostile_values(rnd):
    d = Draw(rnd)
    kind = d.pick(["version", "patterns", "hf", "bridge"], "kind")
    files: dict[str, str] = {}
    if kind == "version":
        flags = MOE + ["--disable-bias-linear"] + [x for _ in range(d.int(0, 3)) for x in d.pick(NEWER_FLAGS)]
        version = d.hostile(VERSIONS, "version") if d.int(0, 3) else d.any_value("version")
        argv = [d.pick(["estimate", "validate"]), "--world-size", "8", "--megatron-version", version, "--", *flags]
    elif kind == "patterns":
        flags = list(SMALL) + ["--grad-reduce-in-bf16"] + (["--num-layers", d.pick(["4", "100", "10000"]),
                                                              "--pipeline-model-parallel-size", "1"] if d.coin() else [])
        if d.coin():
            flags += ["--num-experts", "8", "--moe-router-topk", "2", "--sequence-parallel", "--disable-bias-linear"]
        patterns = [p for _ in range(d.int(1, 2)) for p in d.hostile(PATTERN_SETS, "patterns")]
        argv = ["estimate", "--world-size", "8", "--", *flags, "--ddp-param-name-patterns-for-fp32-local-accumulation",
                *patterns]
    elif kind == "hf":
        name = d.pick(["mixtral-8x7b.json", "qwen3-30b-a3b.json", "deepseek-v3.json", "qwen2-57b-a14b.json"], "config")
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf", name), encoding="utf-8") as f:
            doc = json.load(f)
        for _ in range(d.int(1, 3)):
            key = d.pick(sorted(doc), "key")
            doc[key] = d.pick([{"a": 1}, {}, [1], "8", "x", None, -8, 0.5, 10**9, True, float("nan")])
        files["config.json"] = json.dumps(doc)
        argv = ["estimate", "--model", "config.json", "--world-size", "64", "--", "--micro-batch-size", "1",
                "--seq-length", "4096", "--global-batch-size", "64"]
    else:
        from megatron_memguard.readers._common import GPT_LEVEL_FIELDS, LEGACY_MCORE_FIELDS, mcore_model_fields, megatron_dests
        fields = sorted(megatron_dests() & (mcore_model_fields() | LEGACY_MCORE_FIELDS | GPT_LEVEL_FIELDS))
        overrides = []
        for _ in range(d.int(1, 2)):
            key = d.pick(fields + ["num_layers.x", "", "num_layers"], "field")
            value = d.pick(WRONG_KINDS) if d.coin() else d.hostile(YAML_CLASSES)
            overrides += ["--set", f"model.{key}={value}" if key else f"model={value}"]
        argv = ["estimate", "--model", d.pick(["qwen3_30b_a3b", "llama32_1b", "deepseek_v2_lite"]), "--gpus", "64",
                "--set", "model.moe_flex_dispatcher_backend=deepep", *overrides]
    run(d, argv, files)


# --------------------------------------------------------------------------------------------------
# Issue hostile5: hybrid Mamba patterns and sizes (flags, the nemotronh_8b recipe, a HybridModelProvider YAML),
# LoRA / DoRA sections, MTP on its own stage, latent MoE, capacity factors, upcycling, attention backends and GPU
# names, plan of those models, report / calibrate on logs of hybrid and MTP runs
# --------------------------------------------------------------------------------------------------
HYBRID_MORE = [["--pipeline-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "4"], ["--num-layers", "3"],
               ["--num-layers-per-virtual-pipeline-stage", "1"], ["--pipeline-model-parallel-layout", "Et|tL"],
               ["--decoder-first-pipeline-num-layers", "1"], ["--tensor-model-parallel-size", "2"],
               ["--num-experts", "4", "--moe-router-topk", "2"], ["--mtp-num-layers", "1"], ["--context-parallel-size", "2"],
               ["--megatron-version", "0.16"], ["--spec", "megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]]
HYBRID_SIZES = ["--mamba-state-dim", "--mamba-head-dim", "--mamba-num-groups", "--mamba-num-heads", "--hidden-size",
                "--hybrid-attention-ratio", "--hybrid-mlp-ratio", "--num-layers"]
NEMOTRON_KEYS = ["model.hybrid_layer_pattern", "model.hybrid_override_pattern", "model.mamba_num_heads",
                 "model.mamba_head_dim", "model.mamba_num_groups", "model.mamba_state_dim", "model.mamba_chunk_size",
                 "model.num_layers", "model.virtual_pipeline_model_parallel_size", "model.pipeline_model_parallel_size",
                 "model.hybrid_attention_ratio", "model.mtp_num_layers", "model.mtp_hybrid_override_pattern", "peft"]
PEFT_FIELDS = {"dim": None, "alpha": None, "dropout": None, "dropout_position": ["pre", "post", "PRE", "mid"],
               "target_modules": ["[linear_qkv, linear_qkv]", "[foo]", "[]", "['']", "[' linear_qkv ']", "linear_qkv",
                                  "[" + ", ".join(["linear_fc1"] * 20_000) + "]", "[" + ", ".join(f"m{i}" for i in range(9_000)) + "]"],
               "exclude_modules": ["[]", "[linear_qkv]"], "lora_dtype": ["bf16", "null"], "bogus": ["1"],
               "canonical_mapping": ["{}", "{a: b}"], "_target_": ["megatron.bridge.peft.ia3.IA3", "''", "LoRA"]}
PEFT_WITH = ["", "ddp: {use_megatron_fsdp: true, use_distributed_optimizer: true}\n",
             "model: {num_moe_experts: 4, moe_router_topk: 2}\n", "mixed_precision: bf16_with_fp8_current_scaling_mixed\n"]
MOE_ODD = ["--moe-latent-size", "--moe-expert-capacity-factor", "--moe-upcycling-granularity"]
BACKENDS = ["auto", "flash", "fused", "unfused", "local", "cudnn", "FLASH", "", "flash attention", "\x00"]
GPU_NAMES = ["H100-80GB", "h100", "B200", "GB200", "A100-40GB", "MI300X", "", "h 100", "\uff48100", "t4", "x" * 1000]


def _hybrid_log(d: Draw) -> str:
    from megatron_logs import args_of, print_args, report_memory
    mtp = d.coin()
    flags = (SMALL[:SMALL.index("--tensor-model-parallel-size")] + ["--mtp-num-layers", "1", "--pipeline-model-parallel-size",
             "2", "--pipeline-model-parallel-layout", d.pick(["Ett|ttmL", "Etttt|mL"])]) if mtp else \
        HYBRID + ["--hybrid-layer-pattern", "M*M-"]
    args = args_of(flags, 8)
    for _ in range(d.int(1, 2)):
        key = d.pick(["mtp_num_layers", "pipeline_model_parallel_layout", "hybrid_layer_pattern", "hybrid_override_pattern",
                      "num_layers", "mamba_num_heads", "is_hybrid_model"], "field")
        args[key] = d.hostile(HYBRID_PATTERNS) if d.coin() else d.any_value()
    lines = print_args(args) + [report_memory(r, "(after 10 iterations)", 2**30, 3 * 2**30, 4 * 2**30, 4 * 2**30)
                                for r in range(2 if mtp else 1)]
    return "\n".join(lines) + "\n"


@fuzz(150)
def test_hybrid_peft_and_mtp_inputs_with_hostile_values(rnd):
    d = Draw(rnd)
    kind = d.pick(["hybrid", "hybrid", "nemotron", "peft", "mtp", "moe", "backend", "plan", "log"], "kind")
    files: dict[str, str] = {}
    if kind == "hybrid":
        flags = HYBRID + [d.pick(["--hybrid-layer-pattern", "--hybrid-override-pattern"]), d.hostile(HYBRID_PATTERNS, "pattern")]
        for _ in range(d.int(0, 2)):
            flags += d.pick(HYBRID_MORE) if d.coin() else [d.pick(HYBRID_SIZES), d.hostile(NUMBER_CLASSES)]
        version = ["--megatron-version", flags.pop(flags.index("--megatron-version") + 1)] if "--megatron-version" in flags else []
        flags = [f for f in flags if f != "--megatron-version"]
        argv = [d.pick(["estimate", "validate"]), "--world-size", "8", *version, "--", *flags]
    elif kind == "nemotron":
        overrides = []
        for _ in range(d.int(1, 2)):
            key = d.pick(NEMOTRON_KEYS, "key")
            value = d.hostile(HYBRID_PATTERNS) if "pattern" in key and d.coin() else d.hostile(YAML_CLASSES)
            overrides += ["--set", f"{key}={value}"]
        argv = ["estimate", "--model", "nemotronh_8b", "--gpus", d.pick(["8", "2", "64"]), *overrides]
    elif kind == "peft":
        from test_readers_bridge import FLAT
        lines = [f"  _target_: megatron.bridge.peft.{d.pick(['lora.LoRA', 'dora.DoRA'])}"]
        for _ in range(d.int(1, 3)):
            field = d.pick(sorted(PEFT_FIELDS), "field")
            choices = PEFT_FIELDS[field]
            value = d.pick(choices) if choices and d.coin() else d.hostile(YAML_CLASSES)
            lines.append(f"  {field}: {value}")
        files["c.yaml"] = FLAT + d.pick(PEFT_WITH) + "peft:\n" + "\n".join(lines) + "\n"
        argv = ["estimate", "--config", "c.yaml", "--gpus", "8"]
    elif kind == "mtp":
        flags = list(SMALL[:SMALL.index("--tensor-model-parallel-size")]) + [
            "--pipeline-model-parallel-size", d.pick(["1", "2", "3", "4"]), "--mtp-num-layers", d.pick(["0", "1", "2", "100"]),
            "--pipeline-model-parallel-layout", d.hostile(MTP_LAYOUTS, "layout")]
        if d.coin():
            flags += d.pick([["--num-experts", "4", "--moe-router-topk", "2"], ["--num-virtual-stages-per-pipeline-rank", "2"],
                             ["--account-for-loss-in-pipeline-split"], ["--mtp-num-layers", d.any_value()]])
        argv = [d.pick(["estimate", "validate"]), "--world-size", "8", "--", *flags]
    elif kind == "moe":
        flags = MOE + ["--moe-token-dispatcher-type", d.pick(["alltoall", "allgather", "flex"])]
        for _ in range(d.int(1, 2)):
            flags += [d.pick(MOE_ODD, "flag"), d.hostile(NUMBER_CLASSES)]
        if d.coin():
            flags += d.pick([["--moe-pad-expert-input-to-capacity"], ["--moe-use-upcycling", "--save", "/ckpt"],
                             ["--ffn-hidden-size", "1024", "--moe-ffn-hidden-size", "512"]])
        argv = ["estimate", "--world-size", "8", "--", *flags]
    elif kind == "backend":
        argv = [d.pick(["estimate", "plan"]), "--gpu", d.pick(GPU_NAMES, "gpu")]
        argv += ["--gpus", "8", "--seq-length", "512", "--global-batch-size", "16"] if argv[0] == "plan" else ["--world-size", "8"]
        argv += ["--", *SMALL, "--attention-backend", d.pick(BACKENDS, "backend") if d.coin() else d.any_value()]
    elif kind == "plan":
        gpus = d.pick(["8", "1024", str(2**20), "1000000"], "gpus")
        if d.coin():
            argv = ["plan", "--model", "nemotronh_8b", "--gpus", gpus, "--seq-length", "8192", "--global-batch-size", "1024"]
            argv += ["--set", f"model.hybrid_layer_pattern={d.hostile(HYBRID_PATTERNS)}"] if d.coin() else []
        else:
            pattern = d.pick(["M*" * 5_000, "|".join(["M*"] * 5_000), "M*M-", d.hostile(HYBRID_PATTERNS)], "pattern")
            argv = ["plan", "--gpus", gpus, "--seq-length", "128", "--global-batch-size", "1024", "--vpp",
                    d.pick(["1", "1,2,4,8"]), "--", *HYBRID, "--hybrid-layer-pattern", pattern]
    else:
        files["run.log"] = _hybrid_log(d)
        argv = d.pick([["report", "--json", "run.log"], ["calibrate", "run.log", "run.log", "--out", "s.yaml"],
                       ["report", "run.log", "--megatron-version", "0.16"]])
    run(d, argv, files)
