"""Fuzz by structure (issue hostile2): REAL inputs mutated one structural step at a time, so that the damage
passes the parsers and reaches the code that uses each value (tests/mutate_util.py).

* Files: every config in ../shared/configs (Megatron functional tests, NeMo 1, NeMo launcher, Megatron-Bridge
  overrides, NeMo 2), examples/ (NeMo 1 YAML, launch scripts), tests/data (Hugging Face config.json files,
  a --yaml-cfg file, heterogeneous block configs, launch scripts), Bridge run_config dumps and NeMo 2
  exports, a site profile, the runtime monitor's JSONL and a Megatron log. A key deleted, set to None / "" /
  -1 / 0 / 1e309 / NaN / True / [] / {} / "abc" / 2**80 / 200,000 characters / 100 nested lists, its type
  swapped (list <-> int <-> str), a key duplicated or unknown, layout numbers set to each other's (TP =
  layers), YAML anchors, aliases, merge keys, billion laughs and tags, the file cut at a random byte; launch
  scripts' flags with hostile values, no value, repeated, in the other form, with unicode dashes.
* Command lines (estimate, validate, check, plan, --model presets and recipes): a value dropped after a flag,
  a flag repeated with a conflicting value, --flag=value vs --flag value, unicode dashes, @file arguments,
  memguard's options moved after '--' and Megatron's before it.
* The Megatron hook: the namespace core_v0.16.1's parser (tests/legacy_standin) and core 0.19.2's (where
  installed) leave, and the --yaml-cfg namespace, each field mutated the same way, through the hook's
  validate_args / validate_yaml wrapper; the Megatron-Bridge pre-flight (bridge.preflight) on the Bridge
  documents as dicts, mutated the same way.

Each run of estimate / validate / check / plan / report / calibrate (in-process, through cli.main) must keep
the promise of tests/fuzz_util.py: exit code 0, 1 or 2, no traceback and no internal error, every stderr line
from memguard and at most 1,200 characters, at most CPU_LIMIT seconds of CPU. The hook must carry on (call
Megatron's validate_args) with no internal error, unless abort was asked or a --memguard* setting itself is
bad (pretrain_gpt.py's one-line error, exit 2, as argparse gives for a bad flag); so must the pre-flight.

Derandomized: the same 900 cases on every run (400 files, 150 command lines, 250 hook namespaces, 100 Bridge
containers), about 35 s of CPU. ``MEMGUARD_STRUCTURED_EXAMPLES=N`` multiplies the cases by N for a deeper search.
"""
from __future__ import annotations

import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuzz_util import run_memguard  # noqa: E402
from mutate_util import (  # noqa: E402
    COMMAND_LINES, bridge_seeds, command_mutant, hook_namespaces, mutant, mutate_namespace, run_bridge_preflight, run_hook,
    seeds,
)

CPU_LIMIT = 5.0    # seconds of CPU per case (the slowest mutant takes about 1.5 s: plan on a MoE export)
WALL = 60          # a case still running is stopped (a hang; wall time is shared with the other jobs)
SCALE = int(os.environ.get("MEMGUARD_STRUCTURED_EXAMPLES", "1"))
SEEDS = seeds()


def fuzz(n: int):
    """``n`` cases, the same on every run, each with a Random seeded by hypothesis (every choice uniform)."""
    def wrap(test):
        return settings(max_examples=n * SCALE, derandomize=True, deadline=None, database=None, print_blob=False,
                        suppress_health_check=list(HealthCheck))(given(rnd=st.randoms(use_true_random=True))(test))
    return wrap


@pytest.fixture(scope="module", autouse=True)
def _short_pipe_wait():
    import megatron_memguard.files as files
    old, files.PIPE_WAIT = files.PIPE_WAIT, 0.5
    yield
    files.PIPE_WAIT = old


def _keep_promise(m) -> None:
    o = run_memguard(m.argv, m.files, cpu_limit=CPU_LIMIT, wall_limit=WALL)
    o.note = "; ".join(m.notes)
    assert not o.problems, o.describe()


def test_every_real_input_is_a_seed():
    kinds = {s.kind for s in SEEDS}
    names = " ".join(s.name for s in SEEDS)
    assert kinds == {"doc", "script", "jsonl", "log", "nemo"}
    for part in ("megatron-functional/", "nemo1/", "nemo-launcher/", "megatron-bridge/", "nemo2/", "examples/nemo1",
                 "tests/data/hf/", ".nemo", "yaml_cfg", "heterogeneous", "run_config", "MLA MoE", "nemo2 qwen3", "site profile",
                 "examples/llama3_8b_h100.sh", "examples/slurm_preflight.sbatch", "tests/data/launch/"):
        assert part in names, part
    commands = {c[0] for s in SEEDS for c in s.commands} | {a[0] for _, a in COMMAND_LINES}
    assert commands == {"estimate", "validate", "check", "plan", "report", "calibrate"}


@fuzz(400)
def test_real_files_mutated_by_structure(rnd):
    _keep_promise(mutant(rnd.choice(SEEDS), rnd))


@fuzz(150)
def test_command_lines_mutated_by_structure(rnd):
    label, argv = rnd.choice(COMMAND_LINES)
    _keep_promise(command_mutant(label, argv, rnd))


NAMESPACES = hook_namespaces()


@fuzz(250)
def test_hook_namespaces_mutated_by_structure(rnd):
    label = rnd.choice(sorted(NAMESPACES))
    notes = [label]
    ns = mutate_namespace(NAMESPACES[label], rnd, notes)
    o = run_hook(ns, reject=rnd.random() < 0.05)
    problems = o.problems(mutated_settings=any("memguard" in n for n in notes))
    assert not problems, f"{'; '.join(notes)}: {problems}"


BRIDGE_SEEDS = bridge_seeds()


@fuzz(100)
def test_bridge_preflight_on_mutated_containers(rnd):
    notes, problems = run_bridge_preflight(rnd.choice(BRIDGE_SEEDS), rnd)
    assert not problems, f"{'; '.join(notes)}: {problems}"


def test_hook_namespaces_of_both_eras():
    """The legacy era's namespace everywhere; the config-container era's where megatron.training is installed."""
    assert "legacy 0.16" in NAMESPACES and "yaml-cfg" in NAMESPACES
    for ns in NAMESPACES.values():
        o = run_hook(ns)
        assert o.problems(False) == [] and o.action == "fits", o
