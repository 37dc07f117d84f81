#!/bin/bash
# Llama-3.1-8B pre-training on 2 nodes x 8 H100 (the shape of Meta's published model card),
# TP 2 with sequence parallelism, distributed optimizer, bf16, flash/fused attention (TE).
GPUS_PER_NODE=8
NNODES=2

MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --seq-length 8192
    --max-position-embeddings 8192
    --position-embedding-type rope
    --normalization RMSNorm
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --hidden-dropout 0.0
    --attention-dropout 0.0
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model meta-llama/Llama-3.1-8B
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 128
    --bf16
    --lr 3e-4
    --train-iters 1000
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2
    --sequence-parallel
)

torchrun --nproc-per-node $GPUS_PER_NODE --nnodes $NNODES \
    pretrain_gpt.py "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
    --data-path /data/my-corpus_text_document --save /checkpoints/llama3-8b --save-interval 500
