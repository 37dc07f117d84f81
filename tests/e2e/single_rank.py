"""One CPU rank of real megatron-core (gloo, TP = PP = 1) with the referee's shims: what the e2e scripts
that build a model to count its parameters share."""
import os


def start(port: int) -> None:
    """Install the shims, start a one-rank gloo process group on ``port`` and megatron's model-parallel
    state with its RNG."""
    from benchmarks.referee import shims
    shims.install()
    import torch
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    torch.distributed.init_process_group(backend="gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    mpu.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
