#!/bin/bash
# NeMo 1 (Hydra YAML): validate the config with the overrides the job is launched with, then pre-flight
# the launch command itself, then launch NeMo's megatron_gpt_pretraining.py.
#
#   bash examples/nemo1/validate_and_launch.sh [more Hydra overrides]
#
# `memguard validate` lists every rule the config breaks (divisibility, GBS vs MBS x DP, ...) with the key
# and a fix; `memguard check` reads the launch as it will run (--config-path / --config-name and the
# overrides; trainer.devices x trainer.num_nodes is the world size). The tokenizer is a SentencePiece
# model, so the vocabulary is given (--vocab-size 32000, Llama 2's).
#   MEMGUARD_FORCE=1        launch even when a check fails
#   NEMO_DIR                the NeMo checkout (default /opt/NeMo, as in NeMo containers)
#   MEMGUARD_CMD            how to run memguard (default: memguard)
#   MEMGUARD_LAUNCH_STUB    a command put in front of the launch (e.g. echo: print instead of launching)
set -uo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
MEMGUARD_CMD=${MEMGUARD_CMD:-memguard}
NEMO_DIR=${NEMO_DIR:-/opt/NeMo}
# NeMo's megatron_llama_config.yaml ships with precision: 32; in fp32 Transformer Engine has no fused attention
# kernel (its unfused attention keeps s x s probabilities per head): the job trains in bf16 mixed precision.
OVERRIDES=(
    trainer.devices=8 trainer.num_nodes=2 trainer.precision=bf16-mixed
    model.tensor_model_parallel_size=2 model.pipeline_model_parallel_size=2 model.sequence_parallel=true
    model.micro_batch_size=1 model.global_batch_size=128
    model.tokenizer.model=/data/tokenizer.model
    "model.data.data_prefix=[1.0,/data/my-corpus_text_document]"
    "$@"
)
LAUNCH=(python "$NEMO_DIR/examples/nlp/language_modeling/megatron_gpt_pretraining.py"
        --config-path "$HERE/conf" --config-name megatron_llama_config "${OVERRIDES[@]}")

refuse() {
    if [ "${MEMGUARD_FORCE:-0}" = "1" ]; then
        echo "nemo1: memguard $1 exited $2; MEMGUARD_FORCE=1, launching anyway" >&2
    else
        echo "nemo1: memguard $1 exited $2; not launching (MEMGUARD_FORCE=1 overrides)" >&2
        exit "$2"
    fi
}

$MEMGUARD_CMD validate "$HERE/conf/megatron_llama_config.yaml" "${OVERRIDES[@]}" --vocab-size 32000
rc=$?; [ "$rc" -eq 0 ] || refuse validate "$rc"
$MEMGUARD_CMD check --vocab-size 32000 -- "${LAUNCH[@]}"
rc=$?; [ "$rc" -eq 0 ] || refuse check "$rc"

exec ${MEMGUARD_LAUNCH_STUB:-} "${LAUNCH[@]}"
