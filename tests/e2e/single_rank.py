"""One CPU rank of real megatron-core (gloo, TP = PP = 1) with the referee's shims: what the e2e scripts
that build a model to count its parameters share."""
import atexit
import shutil
import tempfile


def start(port: int | None = None) -> None:
    """Install the shims, start a one-rank gloo process group and megatron's model-parallel state with its RNG.

    One rank needs no TCP rendezvous: the group meets in a file store in a private temporary directory (removed
    at exit), so scripts run at once by parallel test workers (pytest -n) cannot collide on a port. ``port``: taken
    and not used, for scripts written when the group met over TCP."""
    from benchmarks.referee import shims
    shims.install()
    import torch
    d = tempfile.mkdtemp(prefix="memguard-e2e-store-")
    atexit.register(shutil.rmtree, d, True)
    torch.distributed.init_process_group(backend="gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    mpu.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
