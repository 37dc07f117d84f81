#!/usr/bin/env bash
# Install what the tests need and run the suite twice:
#   .venv    Python 3.11: torch 2.13.0 CPU wheel, megatron-core 0.16.1 (megatron.core only). Runs everything;
#            the legacy-era hook tests use the stand-in megatron.training in tests/legacy_standin.
#   .venv312 Python 3.12: torch 2.14.1, megatron-core 0.19.2 with the real megatron.training of the
#            config-container era. Runs the suite again, which now includes the tests marked
#            megatron_training (they skip cleanly under 3.11).
# Used by CI (.ci/run) and by the README's quick start. Arguments go to both pytest runs.
#   .venv312-bridge  Megatron-Bridge 0.6.2 over .venv312 (tests/run_bridge.sh): tests/test_bridge_real.py.
#   .venv312-core017 / -core018  megatron-core 0.17.1 / 0.18.2 over .venv312 (tests/run_releases.sh): the
#            megatron_training tests against those releases' real megatron.training (0.17.1: the legacy era).
# MEMGUARD_SKIP_PY312=1 skips the 3.12 runs, MEMGUARD_SKIP_BRIDGE=1 the Bridge one, MEMGUARD_SKIP_RELEASES=1 the
# 0.17.1 / 0.18.2 ones; PYTHON312=/path/to/python3.12 picks the interpreter.
# The two main runs spread whole files over MEMGUARD_TEST_WORKERS pytest-xdist workers (default 2, one per core of
# the CI machine; 0 runs in one process), slowest files first (tests/conftest.py SLOW_FILES_FIRST; xdist keeps that
# order with --no-loadscope-reorder): each file's tests run in order in one process, and the tests share no
# port, fixed temporary path or state across files. pip installs with --no-compile: byte-compiling torch and
# transformers at install time is most of their install time, and a test run compiles only what it imports.
# docs/testing.md has the layout and the timings.
set -euo pipefail
cd "$(dirname "$0")/.."
WORKERS=${MEMGUARD_TEST_WORKERS:-2}
PARALLEL=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder --durations=15)
# each step's wall time, printed (stderr) when the script ends, so a suite that grows shows in every CI log
T0=$SECONDS LAST=$SECONDS STEPS=()
step() { STEPS+=("$1 $((SECONDS - LAST))s"); LAST=$SECONDS; }
trap 'echo "tests/run.sh: wall time by step: ${STEPS[*]:-}; total $((SECONDS - T0))s (CI budget: 30 min)" >&2' EXIT
# The venvs take about 7.8 GB on a first run (.venv 1.2 GB, .venv312 5.5 GB: torch's CUDA wheel and its
# libraries, .venv312-bridge 1.0 GB, .venv312-core017 and -core018 31 MB each). A full disk fails pip late and far from the cause: say so up front.
if [ ! -d .venv312-bridge ]; then
    free_kb=$(df -Pk . | awk 'NR==2 {print $4}')
    if [ -n "$free_kb" ] && [ "$free_kb" -lt $((9 * 1024 * 1024)) ]; then
        echo "tests/run.sh: warning: $((free_kb / 1024)) MiB free here; a first run installs about 7.8 GB of venvs" >&2
    fi
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# torch is pinned to the CPU wheel on the CI machines (a looser pin pulls a multi-GB CUDA build).
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile -e ".[test]"
step "py3.11-pip"
.venv/bin/python -m pytest -q "${PARALLEL[@]}" "$@"
step "py3.11-tests"

if [ "${MEMGUARD_SKIP_PY312:-0}" = "1" ]; then
    exit 0
fi
is_py312() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }
PY312=${PYTHON312:-}
if [ -z "$PY312" ]; then
    # a pyenv shim named python3.12 exists even when 3.12 is not the selected version: try each candidate
    for cand in python3.12 $(command -v pyenv >/dev/null 2>&1 && ls -d "$(pyenv root)"/versions/3.12*/bin/python3 2>/dev/null); do
        if is_py312 "$cand"; then PY312=$cand; break; fi
    done
fi
if [ -z "$PY312" ]; then
    echo "tests/run.sh: no Python 3.12 found; the config-container era tests did not run" >&2
    exit 1
fi
if [ ! -x .venv312/bin/python ]; then
    "$PY312" -m venv .venv312
fi
# megatron-core >= 0.17 ships megatron.training and needs Python >= 3.12 (about a minute, 5.5 GB with torch).
.venv312/bin/python -m pip install -q --disable-pip-version-check --no-compile torch==2.14.1 megatron-core==0.19.2 pytest \
    pytest-xdist==3.8.0 pyyaml packaging "hypothesis>=6.100"
.venv312/bin/python -m pip install -q --disable-pip-version-check --no-compile --no-deps -e .
.venv312/bin/python -m pip install -q --disable-pip-version-check --no-compile "omegaconf>=2.1"
step "py3.12-pip"
CUDA_DEVICE_MAX_CONNECTIONS=1 .venv312/bin/python -m pytest -q "${PARALLEL[@]}" "$@"
step "py3.12-tests"

# megatron-core 0.17.1 and 0.18.2, each layered over .venv312 (31-33 MB each, no torch; about 3.5 minutes).
if [ "${MEMGUARD_SKIP_RELEASES:-0}" != "1" ]; then
    bash tests/run_releases.sh "$@"
    step "core-0.17.1+0.18.2"
fi

# Megatron-Bridge 0.6.2 itself, layered over .venv312 (MEMGUARD_SKIP_BRIDGE=1 skips it).
if [ "${MEMGUARD_SKIP_BRIDGE:-0}" != "1" ]; then
    bash tests/run_bridge.sh "$@"
    step "bridge-0.6.2"
fi
