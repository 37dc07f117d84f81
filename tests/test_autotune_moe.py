"""Autotune and the Megatron hook with mixture-of-experts runs: Megatron's expert rules are kept (the world
divides into ETP x EP x PP, checked by megatron-core only after validate_args; no full recomputation with
--moe-layer-recompute), and autotune never proposes a layout Megatron rejects. Mixtral-8x7B's shape
(its config.json: the mixtral-8x7b preset) trained with EP 8 on H100s."""
from megatron_memguard import lookup_gpu
from megatron_memguard.autotune import autotune
from megatron_memguard.readers.megatron_flags import parse_megatron_flags
from megatron_memguard.readers.models import read_model


H100 = lookup_gpu("H100-80GB")
TRAIN = ("--micro-batch-size 4 --global-batch-size 64 --seq-length 4096 --bf16 --use-distributed-optimizer "
         "--expert-model-parallel-size 8 --moe-grouped-gemm --moe-token-dispatcher-type alltoall "
         "--tokenizer-type NullTokenizer --vocab-size 32000")


def mixtral(extra: str = ""):
    return read_model("mixtral-8x7b").merged(parse_megatron_flags((TRAIN + " " + extra).split()))


def test_new_pipeline_sizes_keep_the_expert_grid():
    # 16 GPUs, EP 8: PP 4, 8, 16 would leave no whole expert grid (16 % (1 x 8 x PP)); initialize_model_parallel
    # raises for them after validate_args, so autotune must not offer them
    r = autotune(mixtral(), world_size=16, gpu=H100, allow_recompute=True)
    assert r.status == "changed"
    L = r.chosen.layout
    assert 16 % (L.expert_tensor_parallel_size * L.expert_model_parallel_size * L.pp) == 0
    assert L.pp in (1, 2) and L.expert_model_parallel_size == 8
    assert r.chosen.estimate.verdict == "fits"
    assert any("pipeline sizes 4, 8, 16 not tried" in line for line in r.reasons)
    assert any("expert DP 2 -> 1" in line for line in r.reasons)
    # every candidate it estimated is a layout Megatron builds
    for c in (r.chosen, *r.nearest):
        assert 16 % (c.layout.expert_model_parallel_size * c.layout.pp) == 0


def test_no_full_recompute_with_moe_layer_recompute():
    # TransformerConfig.__post_init__: "Do not set --moe-layer-recompute with full recompute granularity"
    r = autotune(mixtral("--moe-layer-recompute"), world_size=16, gpu=H100, allow_recompute=True)
    assert any("full recomputation not tried: --moe-layer-recompute" in line for line in r.reasons)
    if r.chosen is not None:
        assert r.chosen.layout.recompute_granularity != "full"


def test_fitting_moe_run_is_left_alone():
    r = autotune(mixtral().with_args(micro_batch_size=1, pipeline_model_parallel_size=2,
                                     recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
                 world_size=16, gpu=H100)
    assert r.status == "fits" and r.chosen is None
