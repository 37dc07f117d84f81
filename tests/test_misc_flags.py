"""--freeze-all-layers, --attention-output-gate, --use-fused-weighted-squared-relu, --moe-router-force-biased,
by hand.

Sources: megatron-core 0.19.2 megatron/training/training.py get_model (``--freeze-all-layers``:
``requires_grad_(False)`` on every parameter), arguments.py validate_args (it turns
--use-distributed-optimizer and --overlap-param-gather off), core/distributed/distributed_data_parallel.py
(DDP skips parameters without requires_grad: no buffer), core/transformer/attention.py SelfAttention
(``linear_qkv_out_dim += kv_channels * num_attention_heads`` with the output gate; the gate is split off
linear_qkv's output and applied by ``_apply_output_gate``, core 0.16.1 the same), core/transformer/moe/experts.py
TEGroupedMLP.forward (``--use-fused-weighted-squared-relu``: ``weighted_squared_relu_impl``, whose autograd function
fusions/fused_weighted_squared_relu.py saves its input and the probs) and moe/router.py (``--moe-router-force-biased``
only adds a random bias to the router logits).
"""
import pytest

from build_util import run_script   # tests/e2e scripts through a fork server (torch and megatron imported once)

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError

# 4 layers, h 512, 8 heads of 64, GELU MLP 2048, biases, learned positions over 1024, vocab 50257 -> 50304, tied:
# 38,890,496 parameters (tests/test_muon.py)
GPT4 = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
        "--micro-batch-size 4 --global-batch-size 32 --bf16 --tokenizer-type NullTokenizer --vocab-size 50257").split()
PARAMS = 38_890_496


def _stage(extra, world=1):
    L = layout_from_flags(GPT4 + extra, world_size=world)
    return L, estimate(L).stages[0]


def test_frozen_layers_keep_only_their_weights():
    L, st = _stage(["--freeze-all-layers"])
    terms = {t.name: t.bytes for t in st.terms}
    assert st.parameters == PARAMS
    assert terms["parameters"] == 2 * PARAMS                     # bf16 weights, no DDP buffer
    for name in ("gradient_buffer", "main_parameters", "adam_exp_avg", "adam_exp_avg_sq", "main_grad_copies",
                 "dummy_wgrads", "replicated_grad_allreduce"):
        assert name not in terms
    # the trained run's model state is 2 + 4 + 4 + 4 + 4 = 18 B per parameter (bf16 weight, fp32 grad, main, moments)
    _, trained = _stage([])
    assert trained.persistent_bytes - st.persistent_bytes >= 16 * PARAMS
    assert any("--freeze-all-layers" in n and "errs high" in n for n in L.notes)
    # nothing saved between micro-batches on the first stage (PP 1: the only one), no backward working sets
    assert "layer_activations" not in st.breakdown and st.peak_phase.startswith("forward")
    assert st.peak_allocated_bytes < trained.peak_allocated_bytes - 16 * PARAMS


def test_frozen_layers_turn_the_distributed_optimizer_off():
    L, st = _stage(["--freeze-all-layers", "--use-distributed-optimizer", "--overlap-grad-reduce",
                    "--overlap-param-gather"], world=8)
    assert not L.use_distributed_optimizer and not L.overlap_param_gather
    assert sum("turned off" in n for n in L.notes) == 2
    assert {t.name: t.bytes for t in st.terms}["parameters"] == 2 * PARAMS


def test_frozen_layers_with_an_emerging_optimizer_are_refused():
    with pytest.raises(NotModelledError) as e:
        layout_from_flags(GPT4 + ["--freeze-all-layers", "--optimizer", "muon"], world_size=1)
    assert "--freeze-all-layers" in str(e.value)


def test_output_gate_parameters():
    # linear_qkv gains a*d = 512 output rows of 512 inputs and 512 bias entries per layer
    L, st = _stage(["--attention-output-gate"])
    assert st.parameters == PARAMS + 4 * (512 * 512 + 512)
    from megatron_memguard.estimator.params import total_parameters
    assert total_parameters(L) == st.parameters


def test_output_gate_activations():
    # per layer and micro-batch, Tf = 4 x 1024 tokens: the gate part of linear_qkv's output [Tf, 512] bf16 and the
    # attention output the gate keeps [Tf, 512] bf16 (linear_proj keeps the gated product in its place)
    _, gated = _stage(["--attention-output-gate"])
    _, plain = _stage([])
    per_layer = 2 * 4096 * 512 * 2
    assert gated.breakdown["layer_activations"] - plain.breakdown["layer_activations"] == 4 * per_layer


def test_output_gate_with_mla_is_an_error():
    flags = GPT4 + ["--attention-output-gate", "--multi-latent-attention", "--position-embedding-type", "rope"]
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(flags, world_size=1)
    assert "--attention-output-gate" in str(e.value)


MOE = ("--num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --squared-relu --disable-bias-linear "
       "--moe-token-dispatcher-type alltoall").split()


def test_fused_weighted_squared_relu_keeps_one_tensor_less():
    # unfused: fc1's output, the squared ReLU's output (kept by * probs) and fc2's input, [N, F] each; fused: the
    # function's input and fc2's input. N = s b k = 1024 x 4 x 2 = 8192 rows, F = 2048, bf16: 33,554,432 B per layer
    _, plain = _stage(MOE)
    _, fused = _stage(MOE + ["--use-fused-weighted-squared-relu"])
    assert plain.moe["expert_rows_balanced"] == 8192
    assert plain.breakdown["moe_layer_activations"] - fused.breakdown["moe_layer_activations"] == 4 * 8192 * 2048 * 2


def test_fused_weighted_squared_relu_needs_no_bias():
    flags = [f for f in MOE if f != "--disable-bias-linear"] + ["--use-fused-weighted-squared-relu"]
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(GPT4 + flags, world_size=1)
    assert "--use-fused-weighted-squared-relu" in str(e.value)


def test_force_biased_routing_is_estimated_with_a_note():
    # over EP 2 a biased router can send a rank more than its balanced half of the token copies
    ep = MOE + ["--expert-model-parallel-size", "2"]
    L, st = _stage(ep + ["--moe-router-force-biased", "0.5"], world=2)
    _, plain = _stage(ep, world=2)
    assert st.peak_allocated_bytes == plain.peak_allocated_bytes     # the balanced estimate, plus the worst case
    assert any("--moe-router-force-biased" in n and "worst-case" in n for n in L.notes)
    assert st.moe["worst_case"]["peak_allocated_bytes"] > st.peak_allocated_bytes


# Fine-grained offloading's core 0.19 tuning (pipeline_parallel/fine_grained_activation_offload.py
# post_warmup_callback; transformer_layer.py _te_cuda_graph_replay). Per layer, core_attn offloads linear_qkv's
# output [4096, 3072] and the rope'd query and key [4096, 1024] (bf16): 41,943,040 B; attn_proj its input
# [4096, 1024]: 8,388,608 B (the fp32 softmax statistics, 65,536 elements, stay: under 1,048,576).
OFF = ("--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
       "--micro-batch-size 2 --global-batch-size 64 --bf16 --tokenizer-type NullTokenizer --vocab-size 50257 "
       "--position-embedding-type rope --pipeline-model-parallel-size 2 --fine-grained-activation-offloading "
       "--offload-modules core_attn attn_proj").split()
CORE, PROJ = 41_943_040, 8_388_608


def _off(extra):
    return estimate(layout_from_flags(OFF + extra, world_size=2)).stages


def test_activation_offload_fraction():
    base, half = _off([]), _off(["--activation-offload-fraction", "0.5"])
    # stage 0: 4 layers, 8 groups per micro-batch, int(8 x 0.5) = 4 of them, the last, stay; 2 micro-batches in flight
    assert half[0].in_flight == 2
    assert (half[0].breakdown["layer_activations"] - base[0].breakdown["layer_activations"]) == 2 * 2 * (CORE + PROJ)
    # last stage: its last group stays anyway; of the 7 others int(3.5) = 3 stay: core, proj, core
    assert (half[1].breakdown["layer_activations"] - base[1].breakdown["layer_activations"]) == 2 * CORE + PROJ


def test_delta_offload_bytes_across_pp_ranks():
    st = _off(["--delta-offload-bytes-across-pp-ranks", "100000000"])
    # pp rank 0 keeps 0 x delta; rank 1 keeps whole groups from the first while the 100,000,000 B budget is
    # positive: core, proj, core (7.7 MB left), proj
    assert "offload_pp_balance_kept" not in st[0].breakdown
    assert st[1].breakdown["offload_pp_balance_kept"] == 2 * (CORE + PROJ)


def test_delay_offload_until_cuda_graph():
    st = _off(["--delay-offload-until-cuda-graph", "--cuda-graph-impl", "transformer_engine"])
    # a graphed layer's two groups wait for the replay's end, and one group is reloaded ahead
    assert st[0].breakdown["offload_staging"] == CORE + PROJ + CORE
    assert _off([])[0].breakdown["offload_staging"] == 2 * CORE


def test_max_inflight_offloads_bounds_the_pending_copies():
    # ChunkOffloadHandler._drain_offload_pending (core 0.19.2): the main stream waits on a name's older D2H
    # events only once more than the cap are queued (one handler per chunk and micro-batch), so with cap 3 up to
    # 3 core_attn and 3 attn_proj copies are pending at once, plus one group (the largest) reloaded ahead
    st = _off(["--fine-grained-offloading-max-inflight-offloads", "3"])
    assert st[0].breakdown["offload_staging"] == 3 * (CORE + PROJ) + CORE
    # the last stage keeps its last attn_proj group (3 of 4 leave): still 3 of each name pending
    assert st[1].breakdown["offload_staging"] == 3 * (CORE + PROJ) + CORE
    # never more than left: a cap of 8 over 4 layers bounds the staging by the offloaded groups
    big = _off(["--fine-grained-offloading-max-inflight-offloads", "8"])
    assert big[0].breakdown["offload_staging"] == 4 * (CORE + PROJ)
    assert big[1].breakdown["offload_staging"] == 4 * CORE + 3 * PROJ
    # a cap of 0 or 1 leaves the default: one copy pending, one reloaded ahead
    assert _off(["--fine-grained-offloading-max-inflight-offloads", "1"])[0].breakdown["offload_staging"] == 2 * CORE
    assert _off(["--fine-grained-offloading-max-inflight-offloads", "0"])[0].breakdown["offload_staging"] == 2 * CORE


def test_max_inflight_offloads_release_gate():
    # the cap is a TransformerConfig field from core 0.18.2 on (read in the 0.17.1 and 0.18.2 wheels), so also a flag
    cap = OFF + ["--fine-grained-offloading-max-inflight-offloads", "3"]
    st = estimate(layout_from_flags(cap, world_size=2, megatron_version="0.18.2")).stages
    assert st[0].breakdown["offload_staging"] == 3 * (CORE + PROJ) + CORE
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(cap, world_size=2, megatron_version="0.17.1")
    assert "--fine-grained-offloading-max-inflight-offloads" in str(e.value) and "0.18" in str(e.value)


def test_full_iteration_graph_needs_the_in_flight_cap():
    # TransformerConfig.__post_init__ (core 0.19.2 transformer_config.py, also 0.18.2): fine-grained offloading under
    # the full-iteration graph needs fine_grained_offloading_max_inflight_offloads >= 0
    graph = ["--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad"]
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(OFF + graph, world_size=2)
    assert "--fine-grained-offloading-max-inflight-offloads" in str(e.value)
    L = layout_from_flags(OFF + graph + ["--fine-grained-offloading-max-inflight-offloads", "0"], world_size=2)
    assert L.fine_grained_offloading_max_inflight_offloads == 0


def test_offload_fraction_out_of_range():
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(OFF + ["--activation-offload-fraction", "1.5"], world_size=2)
    assert "--activation-offload-fraction" in str(e.value)


def test_optimizer_cuda_graph_keeps_the_step_temporaries_reserved():
    # OptimizerCudaGraphWrapper (core 0.19.2 optimizer/optimizer_cuda_graph.py) captures optimizer.step() into a
    # private pool: with bf16 gradients the step's fp32 copies (main_grad.float(), 4 B per parameter) stay
    # reserved by it while the next forward and backward run
    _, eager = _stage(["--grad-reduce-in-bf16"])
    L, graphed = _stage(["--grad-reduce-in-bf16", "--optimizer-cuda-graph"])
    pool = {t.name: t for t in graphed.terms}["optimizer_graph_pool"]
    assert pool.bytes == 4 * PARAMS and pool.level == "reserved"
    assert graphed.peak_allocated_bytes == eager.peak_allocated_bytes
    # fp32 gradients are viewed, not copied: nothing to keep
    _, fp32 = _stage(["--optimizer-cuda-graph"])
    assert "optimizer_graph_pool" not in {t.name for t in fp32.terms}


OFFLOADED = ["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16",
             "--optimizer-cpu-offload"]


def test_optimizer_cuda_graph_with_the_cpu_offloaded_step():
    # HybridDeviceOptimizer.step (core 0.19.2 optimizer/cpu_offloading/hybrid_optimizer.py, the same in 0.17.1 and
    # 0.18.2) waits on its D2H event and steps on the host: a CUDA graph cannot capture it
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(GPT4 + OFFLOADED + ["--optimizer-cuda-graph"], world_size=1)
    assert "--optimizer-cuda-graph" in str(e.value) and "--optimizer-offload-fraction 0" in str(e.value)
    # with --optimizer-offload-fraction 0 every parameter stays on the GPU: the step is the GPU Adam's, whose fp32
    # gradient copies (grad.to(fp32), 4 B per element of the bf16 main_grad) stay in the graph's pool; DP 1: the
    # shard is every parameter
    zero = OFFLOADED + ["--optimizer-offload-fraction", "0"]
    L, graphed = _stage(zero + ["--optimizer-cuda-graph"])
    _, eager = _stage(zero)
    pool = {t.name: t for t in graphed.terms}["optimizer_graph_pool"]
    assert pool.bytes == 4 * PARAMS and pool.level == "reserved"
    assert graphed.peak_allocated_bytes == eager.peak_allocated_bytes
    assert any("--optimizer-cuda-graph" in n and "fraction 0" in n for n in L.notes)


def test_optimizer_cuda_graph_needs_core_0_19():
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(GPT4 + ["--optimizer-cuda-graph"], world_size=1, megatron_version="0.16")
    assert "--optimizer-cuda-graph" in str(e.value)


SHAPE_CONFIGS = [
    # the output gate with grouped-query attention and biases
    dict(num_layers=2, hidden_size=256, heads=8, groups=2, ffn=1024, bias=True, glu=False, gate=True, vocab=50257,
         seq=128, pos="learned_absolute"),
    # no gate, SwiGLU, no biases, rope
    dict(num_layers=2, hidden_size=256, heads=4, groups=None, ffn=704, bias=False, glu=True, gate=False, vocab=50257,
         seq=128, pos="rope"),
]


@pytest.mark.parametrize("cfg", SHAPE_CONFIGS, ids=["gate-gqa-bias", "swiglu-rope"])
def test_parameter_shapes_match_megatron_core(cfg):
    # megatron-core's own GPTModel (local spec, CPU): every parameter's size, and every matrix's input dimension
    # (``Param.cols``, which SOAP's Kronecker factors depend on)
    import json
    import os
    import sys
    pytest.importorskip("megatron.core")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    from benchmarks.referee.run import unsupported_reason
    if unsupported_reason() is not None:
        pytest.skip(unsupported_reason())
    out = run_script([sys.executable, os.path.join(root, "tests", "e2e", "gpt_param_shapes.py"), json.dumps(cfg)],
                     timeout=300, cwd=root,
                     env={**os.environ, "MASTER_PORT": str(29610 + SHAPE_CONFIGS.index(cfg))})
    assert out.returncode == 0, out.stderr[-2000:]
    real = json.loads(out.stdout.strip().splitlines()[-1])
    flags = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", str(cfg["heads"]),
             "--ffn-hidden-size", str(cfg["ffn"]), "--seq-length", "128", "--max-position-embeddings", "128",
             "--position-embedding-type", cfg["pos"], "--micro-batch-size", "1", "--global-batch-size", "8",
             "--transformer-impl", "local", "--make-vocab-size-divisible-by", "1", "--tokenizer-type",
             "GPT2BPETokenizer", "--bf16"]
    if cfg["groups"]:
        flags += ["--group-query-attention", "--num-query-groups", str(cfg["groups"])]
    flags += [] if cfg["bias"] else ["--disable-bias-linear"]
    flags += ["--swiglu"] if cfg["glu"] else []
    flags += ["--attention-output-gate"] if cfg["gate"] else []
    from megatron_memguard.estimator.params import chunk_params
    L = layout_from_flags(flags, world_size=1)
    mine = {p.name: p for p in chunk_params(L, L.chunks[0])}
    assert {n: p.numel for n, p in mine.items()} == {n: _numel(s) for n, s in real.items()}
    for name, shape in real.items():
        assert mine[name].cols == (shape[1] if len(shape) == 2 else 0), name


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_offload_tuning_needs_core_0_19():
    # core 0.16.1's TransformerConfig has none of the fine-grained offloading tuning fields
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(OFF + ["--activation-offload-fraction", "0.5"], world_size=2, megatron_version="0.16")
    assert "--activation-offload-fraction" in str(e.value)


@pytest.mark.parametrize("spelling", [["--softmax-type", "weird"], ["--softmax-type=softmax"]])
def test_softmax_type_takes_megatrons_choices(spelling):
    # TransformerConfig.softmax_type: Literal['vanilla', 'off-by-one', 'learnable'] (core 0.19.2), which Megatron's
    # argparse turns into choices (argument_utils.py); it decides Transformer Engine's attention kernel (flash-attn has
    # only the vanilla softmax), so another word is an error naming the flag, not an estimate
    with pytest.raises((ConfigError, ConfigErrors), match="--softmax-type: must be one of vanilla, off-by-one, learnable"):
        layout_from_flags(GPT4 + spelling, world_size=1)
    assert layout_from_flags(GPT4 + ["--softmax-type", "learnable"], world_size=1).softmax_type == "learnable"
