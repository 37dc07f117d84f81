#!/usr/bin/env bash
# Install what the tests need into .venv (Python 3.11: torch 2.13.0 CPU wheel, megatron-core 0.16.1)
# and run the whole suite. Used by CI (.ci/run) and by the README's quick start.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# torch is pinned to the CPU wheel on the CI machines (a looser pin pulls a multi-GB CUDA build).
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
.venv/bin/python -m pytest -q "$@"
