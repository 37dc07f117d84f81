#!/bin/bash
# torchrun with memguard's pre-flight: takes torchrun's own arguments, checks the job with
# `memguard check` and starts torchrun only when it fits.
#
#   examples/torchrun_preflight.sh --nnodes 2 --nproc-per-node 8 pretrain_gpt.py <Megatron flags>
#
# Exit codes: memguard's when it refuses (1: tight / will not fit, 2: cannot understand the command),
# otherwise torchrun's.
#   MEMGUARD_FORCE=1        launch even when the check fails (the verdict is still printed)
#   MEMGUARD_CHECK_ARGS     extra `memguard check` options, e.g. "--gpu A100-80GB --threshold 0.85"
#   MEMGUARD_CMD            how to run memguard (default: memguard)
#   MEMGUARD_LAUNCH_STUB    a command put in front of torchrun (e.g. echo: print instead of launching)
set -uo pipefail

MEMGUARD_CMD=${MEMGUARD_CMD:-memguard}
read -r -a CHECK_ARGS <<< "${MEMGUARD_CHECK_ARGS:-}"

$MEMGUARD_CMD check "${CHECK_ARGS[@]}" -- torchrun "$@"
rc=$?
if [ "$rc" -ne 0 ]; then
    if [ "${MEMGUARD_FORCE:-0}" = "1" ]; then
        echo "torchrun_preflight: memguard check exited $rc; MEMGUARD_FORCE=1, launching anyway" >&2
    else
        echo "torchrun_preflight: memguard check exited $rc; not launching (MEMGUARD_FORCE=1 overrides)" >&2
        exit "$rc"
    fi
fi
exec ${MEMGUARD_LAUNCH_STUB:-} torchrun "$@"
