#!/bin/bash
# Launch examples/megatron/pretrain_gpt.py (Megatron-LM's pretrain_gpt.py with memguard's one line) with
# memguard's flags. Each flag can also come from its MEMGUARD_* variable (a flag wins over its variable).
#
#   --memguard abort                 every rank exits with code 3, before allocating, when it does not fit
#                                    (report: print every stage; warn: the default; autotune: lower the
#                                    micro-batch / raise the pipeline size until it fits; off)
#   --memguard-threshold 0.85        the fraction of GPU memory the critical stage may use
#   --memguard-log-dir DIR           one memguard-rankNNNNN.jsonl per rank (predicted vs actual)
#   --memguard-log-interval 10       compare every 10 iterations (default: --log-interval)
#
#   MEMGUARD_MODE=warn               this script's --memguard value (default abort; being a flag, it wins over MEMGUARD)
#   MEMGUARD_LAUNCH_STUB=echo        print the torchrun command instead of running it
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)

MEMGUARD_ARGS=(
    --memguard "${MEMGUARD_MODE:-abort}"
    --memguard-threshold 0.85
    --memguard-log-dir "${MEMGUARD_LOG_DIR:-memguard-logs}"
    --memguard-log-interval 10
)
GPT_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights --tokenizer-type NullTokenizer --vocab-size 128256
    --micro-batch-size 1 --global-batch-size 128 --bf16 --lr 3e-4 --train-iters 1000 --log-interval 10
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer
)
exec ${MEMGUARD_LAUNCH_STUB:-} torchrun --nnodes "${NNODES:-2}" --nproc-per-node 8 "$HERE/pretrain_gpt.py" \
    "${GPT_ARGS[@]}" "${MEMGUARD_ARGS[@]}"
