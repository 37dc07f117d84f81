"""Stand-in for megatron.training of core_v0.16.1 (see tests/legacy_standin/README.md)."""
import torch  # noqa: F401

from .global_vars import get_args, get_tensorboard_writer, get_wandb_writer  # noqa: F401
from .initialize import initialize_megatron  # noqa: F401
from .training import get_model, pretrain  # noqa: F401


def print_rank_0(message):
    if torch.distributed.is_initialized():
        if torch.distributed.get_rank() == 0:
            print(message, flush=True)
    else:
        print(message, flush=True)
