import collections
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Published model shapes, used across tests (Meta's model cards / Hugging Face config.json files).
LLAMA31_8B = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
              "--group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 "
              "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
              "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 "
              "--tokenizer-type NullTokenizer --vocab-size 128256 --bf16").split()
LLAMA31_70B = ("--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 "
               "--group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 "
               "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
               "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 "
               "--tokenizer-type NullTokenizer --vocab-size 128256 --bf16").split()
LLAMA2_7B = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 "
             "--seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope "
             "--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
             "--tokenizer-type NullTokenizer --vocab-size 32000 --bf16").split()


def pytest_configure(config):
    config.addinivalue_line("markers", "megatron_training: needs the real megatron.training of the config-container era "
                            "(Python 3.12, megatron-core >= 0.18); tests/run.sh runs these in .venv312")
    config.addinivalue_line("markers", "bridge: needs the real Megatron-Bridge 0.6.2 (tests/run_bridge.sh installs it into "
                            ".venv312-bridge and runs these)")


def container_era() -> bool:
    """Python 3.12 with megatron-core >= 0.18, whose wheel ships the real megatron.training. Looked up
    without importing megatron (test_planner_is_pure_python checks what a plan imports)."""
    if sys.version_info < (3, 12):
        return False
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return False
    return spec is not None and any(os.path.exists(os.path.join(d, "training", "arguments.py"))
                                    for d in (spec.submodule_search_locations or ()))


# the marks of a module that runs the real megatron.training (tests/run.sh runs them in .venv312)
CONTAINER_ERA = [
    pytest.mark.megatron_training,
    pytest.mark.skipif(not container_era(), reason="needs Python 3.12 with megatron-core >= 0.18 (megatron.training); "
                       "tests/run.sh runs these in .venv312"),
]

# torch.cuda.get_device_properties of an H100 SXM (what the hook reads for the GPU's memory)
Props = collections.namedtuple("Props", "name major minor total_memory multi_processor_count")
H100 = Props("NVIDIA H100 80GB HBM3", 9, 0, 85028896768, 132)
