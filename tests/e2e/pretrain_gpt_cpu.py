"""examples/megatron/pretrain_gpt.py (legacy-era shape) on CPU with the stand-in megatron.training.

Launched once per rank by tests/test_hook_runtime_cpu.py (RANK / WORLD_SIZE / MASTER_* set); the memguard
line is the example's. The CPU live-bytes source replaces CUDA's allocator statistics; its readings
are also written to <log dir>/readings-rankN.json so that the test can compare them with the JSONL.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.environ.get("MEMGUARD_E2E_TRAINING") != "real":   # core 0.17's own megatron.training (test_hook_runtime_cpu)
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "legacy_standin"))
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

import cpu_shims  # noqa: E402
import torch  # noqa: E402

cpu_shims.install()
torch.cuda.is_available = lambda: True  # initialize_megatron asserts it; nothing else reads it here
if os.environ.get("MEMGUARD_E2E_TRAINING") == "real":
    # core 0.17.1's _initialize_distributed builds the model-parallel groups only when it counts a GPU, and
    # selects it first
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
    # torch 2.14's optimizers ask the accelerator whether it is capturing a graph once CUDA reads as available
    torch.optim.Optimizer._accelerator_graph_capture_health_check = lambda self: None

# The bundled example (examples/megatron/pretrain_gpt.py) is the script under test: its import of
# megatron_memguard.megatron is the one line; here it runs against the stand-in megatron.training.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "megatron"))
import pretrain_gpt as example  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import pretrain  # noqa: E402

if os.environ.get("MEMGUARD_E2E_TRAINING") == "real":
    import megatron.training.initialize as _initialize
    # the wheel has no Makefile for the C++ dataset helpers; the example's mock data does not use them
    _initialize._compile_dependencies = lambda: None
    import megatron.training.training as _training
    # the JIT warm-up runs torch.compile'd fusions on CUDA tensors
    _training.set_jit_fusion_options = lambda *a, **k: None

from megatron_memguard.megatron import set_memory_source  # noqa: E402
from recording import RecordingSource  # noqa: E402

from benchmarks.referee.livebytes import Bf16MatmulsInFp32, fp32_matmul_default  # noqa: E402


SOURCE = RecordingSource()
set_memory_source(SOURCE)
# bf16 matrix products in fp32, rounded to bf16 (this CPU's bf16 GEMMs are ~40x slower; same storages, see
# benchmarks/referee/livebytes.py), entered now so that it sits under the source's mode; MEMGUARD_REFEREE_EXACT_BF16=1
# keeps the bf16 kernels
if fp32_matmul_default():
    Bf16MatmulsInFp32().__enter__()
# Megatron's report_memory reads torch.cuda's allocator statistics: here the CPU live bytes the source counts
# (reserved = allocated: no caching allocator on CPU)
torch.cuda.memory_allocated = torch.cuda.memory_reserved = lambda *a, **k: SOURCE.current
torch.cuda.max_memory_allocated = torch.cuda.max_memory_reserved = lambda *a, **k: SOURCE.peak
PARAMS = {}


def model_provider(pre_process=True, post_process=True, vp_stage=None, **kwargs):   # core 0.17: config=, pg_collection=
    model = example.model_provider(pre_process, post_process, vp_stage, **kwargs)
    PARAMS["count"] = PARAMS.get("count", 0) + sum(p.numel() for p in model.parameters())
    return model


if __name__ == "__main__":
    try:
        pretrain(example.train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
                 example.forward_step,
                 args_defaults={"tokenizer_type": "GPT2BPETokenizer", "dataloader_type": "external"})   # as the example
        # tear gloo down while both ranks are alive: left to interpreter exit, its threads' destructors
        # intermittently abort one rank ("terminate called without an active exception", SIGABRT)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
    finally:
        out = os.environ.get("MEMGUARD_TEST_OUT")
        if out:
            rank = int(os.environ.get("RANK", "0"))
            with open(os.path.join(out, f"readings-rank{rank}.json"), "w") as f:
                json.dump({"readings": SOURCE.readings, "parameters": PARAMS.get("count")}, f)
