"""pretrain_gpt.py of the legacy era (core_v0.16.1 shape) for a CPU run with the stand-in megatron.training.

Launched once per rank by tests/test_hook_runtime_cpu.py (RANK / WORLD_SIZE / MASTER_* set); the memguard
line is the one a user adds. The CPU live-bytes source replaces CUDA's allocator statistics; its readings
are also written to <log dir>/readings-rankN.json so that the test can compare them with the JSONL.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "legacy_standin"))
sys.path.insert(0, HERE)
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

import cpu_shims  # noqa: E402
import torch  # noqa: E402

cpu_shims.install()
torch.cuda.is_available = lambda: True  # initialize_megatron asserts it; nothing else reads it here

from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.training import get_args, pretrain  # noqa: E402
from megatron.training.arguments import core_transformer_config_from_args  # noqa: E402

import megatron_memguard.megatron  # noqa: E402,F401  <- the one line
from megatron_memguard.megatron import set_memory_source  # noqa: E402
from megatron_memguard.runtime import LiveBytesSource, Reading  # noqa: E402


class RecordingSource(LiveBytesSource):
    """The CPU source, remembering every reading it handed out (the test compares them with the file)."""

    def __init__(self):
        super().__init__()
        self.log = []

    def read(self) -> Reading:
        r = super().read()
        self.log.append(r.to_dict())
        return r


SOURCE = RecordingSource()
set_memory_source(SOURCE)
PARAMS = {}


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    args = get_args()
    config = core_transformer_config_from_args(args)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                     pre_process=pre_process, post_process=post_process, parallel_output=True,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type)
    PARAMS["count"] = PARAMS.get("count", 0) + sum(p.numel() for p in model.parameters())
    return model


def train_valid_test_datasets_provider(num_samples):
    args = get_args()

    def batches():
        g = torch.Generator().manual_seed(1)
        while True:
            tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=g)
            yield {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                   "loss_mask": torch.ones(args.micro_batch_size, args.seq_length),
                   "position_ids": torch.arange(args.seq_length).unsqueeze(0).expand(args.micro_batch_size, -1)}
    return batches(), None, None


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output_tensor):
        losses = output_tensor.float()
        loss = torch.sum(losses.view(-1) * batch["loss_mask"].view(-1)) / batch["loss_mask"].sum()
        return loss, {"lm loss": loss.detach()}
    return output, loss_func


if __name__ == "__main__":
    try:
        pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                 args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    finally:
        out = os.environ.get("MEMGUARD_TEST_OUT")
        if out:
            rank = int(os.environ.get("RANK", "0"))
            with open(os.path.join(out, f"readings-rank{rank}.json"), "w") as f:
                json.dump({"readings": SOURCE.log, "parameters": PARAMS.get("count")}, f)
