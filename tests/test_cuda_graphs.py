"""CUDA-graph memory, hand-computed from megatron/core/transformer/cuda_graphs.py (TECudaGraphHelper,
CudaGraphManager) and megatron/core/full_cuda_graph.py (StaticBufferLoader), core 0.19.2."""
from megatron_memguard.estimator.cuda_graphs import (CudaGraphSpec, batch_bytes, full_iteration_static_inputs,
                                                     pool_bytes, regions_per_layer, sample_slots, static_io_bytes)

# The scoped-cudagraph MoE record's shape: h 512, seq 1024, mbs 4, TP 4 with SP, PP 2.
SCOPED = dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=("attn", "mlp", "moe_router", "moe_preprocess"),
              pipeline_model_parallel_size=2, num_microbatches=8, micro_batch_size=4, seq_length=1024,
              hidden_size=512, tensor_model_parallel_size=4, sequence_parallel=True)


def test_regions():
    spec = CudaGraphSpec(**SCOPED)
    # _layer_is_graphable: one callable per layer with graphed attention or a graphed MLP part
    assert regions_per_layer(spec, moe_layer=False) == 1
    assert regions_per_layer(spec, moe_layer=True) == 1
    assert regions_per_layer(CudaGraphSpec(cuda_graph_impl="transformer_engine")) == 1   # the whole layer
    router_only = CudaGraphSpec(cuda_graph_impl="transformer_engine", cuda_graph_modules=("moe_router",))
    assert regions_per_layer(router_only, moe_layer=False) == 0    # a dense layer has nothing graphed
    assert regions_per_layer(router_only, moe_layer=True) == 1
    assert regions_per_layer(CudaGraphSpec(cuda_graph_impl="none")) == 0


def test_slots():
    spec = CudaGraphSpec(**SCOPED)
    assert sample_slots(spec, in_flight=1) == 1          # the last stage: 1F1B runs each backward at once
    assert sample_slots(spec, in_flight=2) == 2
    # interleaved: 7 (micro-batch, chunk) forwards held over 4 chunks: 1.75 sets per chunk's layer
    assert sample_slots(spec, in_flight=7, chunks=4) == 1.75
    local = CudaGraphSpec(**{**SCOPED, "cuda_graph_impl": "local"})
    assert sample_slots(local, in_flight=1) == 8         # a runner per micro-batch when PP > 1
    assert sample_slots(CudaGraphSpec(cuda_graph_impl="local", num_microbatches=8), 1) == 1


def test_static_io_bytes():
    # rows = 1024/4 (SP) of 4 sequences = 1024; per graphed layer the bf16 input + grad-output
    # 2 * 1024 * 512 * 2 B = 2 MiB, and the bool causal mask [4, 1, 1024, 1024] = 4 MiB (attention graphed)
    spec = CudaGraphSpec(**SCOPED)
    assert static_io_bytes(spec, dense_layers=0, moe_layers=7, in_flight=1) == 7 * (2 * 1024 * 512 * 2 + 4 * 1024 * 1024)
    router_only = CudaGraphSpec(**{**SCOPED, "cuda_graph_modules": ("moe_router", "moe_preprocess")})
    assert static_io_bytes(router_only, dense_layers=1, moe_layers=7, in_flight=2) == 7 * 2 * 2 * 1024 * 512 * 2


def test_full_iteration_buffers():
    # 0.16.1 spells it local + scope full_iteration
    spec = CudaGraphSpec(cuda_graph_impl="local", cuda_graph_modules=("full_iteration",), num_microbatches=8,
                         micro_batch_size=4, seq_length=1024)
    assert spec.impl == "full_iteration"
    # tokens, labels, position ids int64 + loss mask fp32 + bool [b,1,s,s] mask
    assert batch_bytes(spec) == 4 * 1024 * 28 + 4 * 1024 * 1024 == 4_308_992
    assert full_iteration_static_inputs(spec) == 8 * 4_308_992
    assert full_iteration_static_inputs(spec, with_validation=True) == 16 * 4_308_992
    assert static_io_bytes(spec, dense_layers=12) == 0


def test_pool():
    assert pool_bytes(CudaGraphSpec(**SCOPED), region_transient=5, step_transient=7) == 5
    assert pool_bytes(CudaGraphSpec(cuda_graph_impl="full_iteration"), 5, 7) == 7
    assert pool_bytes(CudaGraphSpec(), 5, 7) == 0


def test_stage_terms_from_a_layout():
    from megatron_memguard import layout_from_flags
    from megatron_memguard.estimator.cuda_graphs import stage_terms
    flags = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --micro-batch-size 4 "
             "--global-batch-size 32 --tokenizer-type NullTokenizer --vocab-size 1000 --bf16").split()
    L = layout_from_flags(flags, world_size=8)
    assert stage_terms(L, 4, 0, 1, 1000) == []          # no graphs: nothing


def test_graph_options_of_each_release():
    # --cuda-graph-impl full_iteration: megatron-core 0.18.2's arguments.py has it (0.17.1's has local with
    # --cuda-graph-scope full_iteration only); --optimizer-cuda-graph: 0.17.1's has it (optimizer_cuda_graph.py)
    import pytest
    from megatron_memguard import layout_from_flags
    from megatron_memguard.errors import ConfigError, ConfigErrors
    base = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
            "--micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 1000 --bf16").split()
    full = base + ["--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad"]
    with pytest.raises((ConfigError, ConfigErrors), match="full_iteration needs megatron-core 0.18"):
        layout_from_flags(full, world_size=1, megatron_version="0.17.1")
    assert layout_from_flags(full, world_size=1, megatron_version="0.18.2").to_dict()["cuda_graph_impl"] == "full_iteration"
    opt = base + ["--optimizer-cuda-graph", "--use-distributed-optimizer"]
    with pytest.raises((ConfigError, ConfigErrors), match="needs megatron-core 0.17"):
        layout_from_flags(opt, world_size=1, megatron_version="0.16.1")
    assert layout_from_flags(opt, world_size=1, megatron_version="0.17.1").to_dict()["optimizer_cuda_graph"] is True
