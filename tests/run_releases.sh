#!/usr/bin/env bash
# The hook and the megatron_training tests against the real megatron.training of two more releases:
#   .venv312-core017  megatron-core 0.17.1, the last legacy-era release (pretrain() parses and validates inside
#                     initialize_megatron): tests/test_hook_legacy.py runs against it instead of the stand-in.
#   .venv312-core018  megatron-core 0.18.2, the first config-container release.
# Each is layered over .venv312 (made by tests/run.sh: torch 2.14.1, megatron-core 0.19.2, memguard): a .pth file
# appends .venv312's site-packages after the venv's own, so the megatron-core installed here (--no-deps: its
# dependencies are .venv312's) shadows 0.19.2 and torch is neither downloaded nor copied. About 31-33 MB per venv;
# the tests take about 3.5 minutes on 2 cores (0.17.1: 1.5 with the end-to-end CPU run, 0.18.2: 1.5; pip ~20 s).
# Arguments go to pytest. MEMGUARD_SKIP_RELEASES=1 in tests/run.sh skips this. MEMGUARD_LAYER_STEP=install only
# installs, =test only tests (what is installed is still checked); tests/run.sh installs while the 3.12 suite runs.
set -euo pipefail
cd "$(dirname "$0")/.."
. tests/layer_venv.sh
layer_step_check
# the files with megatron_training tests (the marker selects them; the rest of each file is pure Python)
FILES=$(grep -l "megatron_training\|CONTAINER_ERA\|container_era" tests/test_*.py)
for release in 0.17.1 0.18.2; do
    tag=$(echo "$release" | awk -F. '{printf "%d%02d", $1, $2}')   # 0.17.1 -> 017
    venv=.venv312-core$tag
    if layer_step install; then
        layer_over_venv312 "$venv"
        "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-compile --no-deps "megatron-core==$release"
    fi
    got=$("$venv/bin/python" -c 'from importlib import metadata; print(metadata.version("megatron-core"))')
    if [ "$got" != "$release" ]; then
        echo "tests/run_releases.sh: $venv has megatron-core $got, not $release" >&2
        exit 1
    fi
    layer_step test || continue
    # shellcheck disable=SC2086
    # (one process: two workers each paid their own imports and took longer, 72 s against 49 s for 0.17.1's 57 tests)
    CUDA_DEVICE_MAX_CONNECTIONS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider -m megatron_training $FILES "$@"
done
