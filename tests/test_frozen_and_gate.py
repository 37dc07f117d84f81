"""--freeze-all-layers and --attention-output-gate, by hand.

Sources: megatron-core 0.19.2 megatron/training/training.py get_model (``--freeze-all-layers``:
``requires_grad_(False)`` on every parameter), arguments.py validate_args (it turns
--use-distributed-optimizer and --overlap-param-gather off), core/distributed/distributed_data_parallel.py
(DDP skips parameters without requires_grad: no buffer), core/transformer/attention.py SelfAttention
(``linear_qkv_out_dim += kv_channels * num_attention_heads`` with the output gate; the gate is split off
linear_qkv's output and applied by ``_apply_output_gate``, core 0.16.1 the same).
"""
import pytest

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
