"""Megatron-LM's pretrain_gpt.py, shortened to its skeleton, with memguard's one line.

The line is ``import megatron_memguard.megatron`` anywhere before the ``__main__`` block (for the real
file, ``patches/pretrain_gpt.*.patch`` adds it). It adds the ``--memguard*`` flags to Megatron's parser
and checks the arguments against GPU memory inside ``validate_args``, before anything is allocated;
then each rank logs its peak memory against its own stage's prediction. See run_pretrain_gpt.sh for
the flags, docs/hook.md for the details.

This skeleton keeps the shape of the legacy-era file (core_v0.16 / core_v0.17: model_provider, the datasets
provider, forward_step, pretrain) with random tokens instead of Megatron's GPT datasets, so that it runs anywhere Megatron does:
the provider returns an iterator of batches, which Megatron takes as it is with ``--dataloader-type
external`` (the default set below), and each batch goes to the current GPU as in the real ``get_batch``.
"""
import torch

import megatron_memguard.megatron  # noqa: F401  <- the one line

from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training import get_args, pretrain
from megatron.training.arguments import core_transformer_config_from_args


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    # core_v0.17's get_model passes the TransformerConfig it built (and the process groups, left to GPTModel's
    # defaults here); core_v0.16's passes neither
    args = get_args()
    config = config if config is not None else core_transformer_config_from_args(args)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
                    parallel_output=True, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type)


def train_valid_test_datasets_provider(num_samples):
    args = get_args()

    def batches():
        g = torch.Generator().manual_seed(1234)
        while True:
            tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=g)
            yield {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                   "loss_mask": torch.ones(args.micro_batch_size, args.seq_length),
                   "position_ids": torch.arange(args.seq_length).unsqueeze(0).expand(args.micro_batch_size, -1)}
    return batches(), None, None


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    if torch.cuda.is_available():
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output_tensor):
        loss = torch.sum(output_tensor.float().view(-1) * batch["loss_mask"].view(-1)) / batch["loss_mask"].sum()
        return loss, {"lm loss": loss.detach()}
    return output, loss_func


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             args_defaults={"tokenizer_type": "GPT2BPETokenizer", "dataloader_type": "external"})
