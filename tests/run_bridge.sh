#!/usr/bin/env bash
# The Megatron-Bridge tests against the real Megatron-Bridge 0.6.2 (tests/test_bridge_real.py).
#
# .venv312-bridge layers Bridge and its pure-Python dependencies over .venv312 (made by tests/run.sh: torch
# 2.14.1, megatron-core 0.19.2, memguard): a .pth file puts .venv312's site-packages on its path, so torch is
# neither downloaded nor replaced (pinned with a constraint) and .venv312 itself stays free of Bridge for the
# main suite. megatron-bridge is installed with --no-deps: its declared dependencies include CUDA-only
# packages (transformer-engine, flashinfer, nvidia-resiliency-ext, mamba-ssm); what its modules import on CPU
# is listed below, and transformer_engine is stood in (tests/bridge_real/te_standin) when the tests run.
# Arguments go to pytest. About 2 minutes the first time (pip cache warm: under one). MEMGUARD_LAYER_STEP=install
# only installs, =test only tests (tests/run.sh installs while the 3.12 suite runs).
set -euo pipefail
cd "$(dirname "$0")/.."
. tests/layer_venv.sh
layer_step_check
if layer_step install; then
    layer_over_venv312 .venv312-bridge
    PIP=(.venv312-bridge/bin/python -m pip install -q --disable-pip-version-check --no-compile)
    CONSTRAINTS=$(mktemp)
    trap 'rm -f "$CONSTRAINTS"' EXIT
    echo "torch==2.14.1" > "$CONSTRAINTS"
    "${PIP[@]}" --no-deps megatron-bridge==0.6.2
    # What megatron.bridge's modules import at module level on CPU (found by importing them), with their own deps.
    "${PIP[@]}" -c "$CONSTRAINTS" "transformers>=5.8,<=5.12.1" einops datasets matplotlib ipython megatron-energon \
        tensorboard diffusers nvidia-modelopt "hydra-core>=1.3.4,<1.4" "omegaconf>=2.3"
fi
if layer_step test; then
    CUDA_DEVICE_MAX_CONNECTIONS=1 .venv312-bridge/bin/python -m pytest -q -p no:cacheprovider tests/test_bridge_real.py "$@"
fi
