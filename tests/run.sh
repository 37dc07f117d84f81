#!/usr/bin/env bash
# Install what the tests need and run the suite twice:
#   .venv    Python 3.11: torch 2.13.0 CPU wheel, megatron-core 0.16.1 (megatron.core only). Runs everything;
#            the legacy-era hook tests use the stand-in megatron.training in tests/legacy_standin.
#   .venv312 Python 3.12: torch 2.14.1, megatron-core 0.19.2 with the real megatron.training of the
#            config-container era. Runs the suite again, which now includes the tests marked
#            megatron_training (they skip cleanly under 3.11), without the framework-free files
#            (MEMGUARD_SKIP_FRAMEWORK_FREE=1: tests/framework_free.py reads that they import no torch, megatron or
#            other venv-dependent module, start no process and probe nothing installed, so the 3.11 run proved them).
# Used by CI (.ci/run) and by the README's quick start. Arguments go to both pytest runs.
#   .venv312-bridge  Megatron-Bridge 0.6.2 over .venv312 (tests/run_bridge.sh): tests/test_bridge_real.py.
#   .venv312-core017 / -core018  megatron-core 0.17.1 / 0.18.2 over .venv312 (tests/run_releases.sh): the
#            megatron_training tests against those releases' real megatron.training (0.17.1: the legacy era).
# MEMGUARD_SKIP_PY312=1 skips the 3.12 runs, MEMGUARD_SKIP_BRIDGE=1 the Bridge one, MEMGUARD_SKIP_RELEASES=1 the
# 0.17.1 / 0.18.2 ones; PYTHON312=/path/to/python3.12 picks the interpreter.
# pip runs in the background where it can (MEMGUARD_BACKGROUND_PIP=0: in the foreground): a first run's .venv312 while
# the 3.11 suite runs (installed as .venv312-installing, renamed after that suite), the release and Bridge venvs while
# the 3.12 suite runs; a failed background install fails the run with its output. The step list at the end gives each
# foreground step (a "-pip-wait" step is the wait for a background install) and each background install's own time.
# (Fresh clones of 2026-11-30 on the same machine: py3.11 tests 753 s with .venv312 installing beside them, 756 s
# without: the background install costs the tests nothing measurable and hides its ~100 s.)
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
# Installs that run in the background while a test step runs (pip is mostly network and disk): bg NAME CMD... starts
# one, with its own log and process group; wait_bg NAME waits for it and, when it failed, prints its log and exits 1
# (set -e does not see a background job). Each one's own time is printed with the steps; any still running when the
# script ends (a test step failed) is stopped.
BGDIR=$(mktemp -d) BG_TIMES=()
declare -A BG_PID=()
bg() {
    local name=$1
    shift
    set -m   # (its own process group: the EXIT trap stops pip's processes with it)
    ( s=$SECONDS; trap 'echo $((SECONDS - s)) > "$BGDIR/$name.time"' EXIT; "$@" ) > "$BGDIR/$name.log" 2>&1 &
    BG_PID[$name]=$!
    set +m
}
wait_bg() {
    local name=$1 rc=0
    wait "${BG_PID[$name]}" || rc=$?
    unset "BG_PID[$name]"
    BG_TIMES+=("$name $(cat "$BGDIR/$name.time" 2>/dev/null || echo '?')s")
    if [ "$rc" != 0 ]; then
        echo "tests/run.sh: the background step $name failed (exit $rc); its output:" >&2
        cat "$BGDIR/$name.log" >&2
        exit 1
    fi
    cat "$BGDIR/$name.log" >&2   # (pip -q: warnings only)
}
finish() {
    for pid in "${BG_PID[@]}"; do kill -- -"$pid" 2>/dev/null || true; done
    rm -rf "$BGDIR"
    local bgs=""
    [ "${#BG_TIMES[@]}" -gt 0 ] && bgs="; in the background: ${BG_TIMES[*]}"
    echo "tests/run.sh: wall time by step: ${STEPS[*]:-}; total $((SECONDS - T0))s (CI budget: 30 min)$bgs" >&2
}
trap finish EXIT
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
PIP=(-m pip install -q --disable-pip-version-check --no-compile)
PY312=""
if [ "${MEMGUARD_SKIP_PY312:-0}" != "1" ]; then
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
fi
# megatron-core >= 0.17 ships megatron.training and needs Python >= 3.12 (about a minute, 5.5 GB with torch).
install_py312() {
    local venv=$1
    if [ ! -x "$venv/bin/python" ]; then
        "$PY312" -m venv "$venv"
    fi
    "$venv/bin/python" "${PIP[@]}" torch==2.14.1 megatron-core==0.19.2 pytest pytest-xdist==3.8.0 pyyaml packaging \
        "hypothesis>=6.100"
    "$venv/bin/python" "${PIP[@]}" --no-deps -e .
    "$venv/bin/python" "${PIP[@]}" "omegaconf>=2.1"
}
# On a first run .venv312 is made in the background while the 3.11 suite runs, under another name, renamed when the
# suite is over: some 3.11 tests also run .venv312's Python when it exists (test_mtp_repeated, test_moe_latent, ...),
# and must not meet one half installed (every command runs its `bin/python -m`, which a renamed venv keeps). An
# existing .venv312 is brought up to date in the foreground as before.
PY312_BG=0
if [ "${MEMGUARD_BACKGROUND_PIP:-1}" = "1" ] && [ -n "$PY312" ] && [ ! -x .venv312/bin/python ]; then
    PY312_BG=1
    bg py3.12-pip install_py312 .venv312-installing
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# torch is pinned to the CPU wheel on the CI machines (a looser pin pulls a multi-GB CUDA build).
.venv/bin/python "${PIP[@]}" -e ".[test]"
step "py3.11-pip"
MEMGUARD_SKIP_FRAMEWORK_FREE=0 .venv/bin/python -m pytest -q "${PARALLEL[@]}" "$@"   # (every file, whatever the caller set)
step "py3.11-tests"

if [ -z "$PY312" ]; then
    exit 0
fi
if [ "$PY312_BG" = 1 ]; then
    wait_bg py3.12-pip
    rm -rf .venv312   # (a venv without its bin/python: not usable)
    mv .venv312-installing .venv312
    # the console scripts' first lines (bin/pip, bin/memguard, ...) name the interpreter by the venv's path
    { grep -lI "^#!$PWD/.venv312-installing/" .venv312/bin/* 2>/dev/null || true; } | while read -r f; do
        sed -i "1s|^#!$PWD/.venv312-installing/|#!$PWD/.venv312/|" "$f"
    done
    step "py3.12-pip-wait"
else
    install_py312 .venv312
    step "py3.12-pip"
fi
# The release and Bridge venvs, layered over .venv312, are installed in the background while the 3.12 suite runs (no
# test of it uses them).
LAYERS=()
[ "${MEMGUARD_SKIP_RELEASES:-0}" != "1" ] && LAYERS+=(tests/run_releases.sh)
[ "${MEMGUARD_SKIP_BRIDGE:-0}" != "1" ] && LAYERS+=(tests/run_bridge.sh)
install_layers() { for script in "$@"; do MEMGUARD_LAYER_STEP=install bash "$script"; done; }
LAYER_STEP=    # (unset: each layer script installs, then tests)
if [ "${MEMGUARD_BACKGROUND_PIP:-1}" = "1" ] && [ "${#LAYERS[@]}" -gt 0 ]; then
    bg layers-pip install_layers "${LAYERS[@]}"
    LAYER_STEP=test
fi
# The framework-free files (tests/framework_free.py: no torch, megatron or other venv-dependent import, process or
# probe) ran in the 3.11 suite and would run the same code again here: skipped.
MEMGUARD_SKIP_FRAMEWORK_FREE=1 CUDA_DEVICE_MAX_CONNECTIONS=1 .venv312/bin/python -m pytest -q "${PARALLEL[@]}" "$@"
step "py3.12-tests"
if [ "$LAYER_STEP" = test ]; then
    wait_bg layers-pip
    step "layers-pip-wait"
fi

# megatron-core 0.17.1 and 0.18.2, each layered over .venv312 (31-33 MB each, no torch; about 3.5 minutes).
if [ "${MEMGUARD_SKIP_RELEASES:-0}" != "1" ]; then
    MEMGUARD_LAYER_STEP=$LAYER_STEP bash tests/run_releases.sh "$@"
    step "core-0.17.1+0.18.2"
fi

# Megatron-Bridge 0.6.2 itself, layered over .venv312 (MEMGUARD_SKIP_BRIDGE=1 skips it).
if [ "${MEMGUARD_SKIP_BRIDGE:-0}" != "1" ]; then
    MEMGUARD_LAYER_STEP=$LAYER_STEP bash tests/run_bridge.sh "$@"
    step "bridge-0.6.2"
fi
