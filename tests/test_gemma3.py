"""Gemma 3 as Megatron-Bridge 0.6.2 builds it (models/gemma/gemma3_provider.py): a GPT whose linear_proj and linear_fc2 are
TERowParallelLinearLayerNorm (models/common/te_layers.py, a TENorm on each projection's output) and whose rotary
embedding caches a local and a global table. Parameter counts against the Gemma 3 technical report, the
post-projection norms' bytes by hand."""
from __future__ import annotations

import pytest

from megatron_memguard import layout_from_flags
from megatron_memguard.estimator.activations import layer_activations, post_proj_norm_items
from megatron_memguard.estimator.layers import attention
from megatron_memguard.estimator.params import total_parameters

# the text models' config.json (Hugging Face google/gemma-3-{1b,4b,12b,27b}-pt; 4B-27B: text_config):
# layers, hidden, intermediate, heads, key/value heads, head_dim, vocab
GEMMA3 = {
    "1b": (26, 1152, 6912, 4, 1, 256, 262_144),
    "4b": (34, 2560, 10240, 8, 4, 256, 262_208),
    "12b": (48, 3840, 15360, 16, 8, 256, 262_208),
    "27b": (62, 5376, 21504, 32, 16, 128, 262_208),
}


def _layout(name: str, *extra: str, post: bool = True, seq: int = 4096, world: int = 1):
    n, h, f, a, g, d, v = GEMMA3[name]
    L = layout_from_flags(["--num-layers", str(n), "--hidden-size", str(h), "--ffn-hidden-size", str(f),
                           "--num-attention-heads", str(a), "--group-query-attention", "--num-query-groups", str(g),
                           "--kv-channels", str(d), "--normalization", "RMSNorm", "--qk-layernorm", "--swiglu",
                           "--disable-bias-linear", "--position-embedding-type", "rope", "--seq-length", str(seq),
                           "--max-position-embeddings", str(seq), "--micro-batch-size", "1",
                           "--global-batch-size", "8", "--bf16", "--vocab-size", str(v),
                           "--make-vocab-size-divisible-by", "64", "--transformer-impl", "transformer_engine",
                           *extra], world_size=world)
    # the published vocabulary as is (a multiple of 64: no padding)
    return L.replace(post_proj_norms=post, rotary_tables=4 if post else 1, vocab_size=v, padded_vocab_size=v)


# Gemma 3 Technical Report (arXiv 2503.19786), Table 1: non-embedding parameters in millions
NON_EMBEDDING_M = {"1b": 698, "4b": 3_209, "12b": 10_759, "27b": 25_600}


@pytest.mark.parametrize("name", list(GEMMA3))
def test_non_embedding_parameters_match_the_technical_report(name):
    L = _layout(name)
    n, h, f, a, g, d, v = GEMMA3[name]
    non_embedding = total_parameters(L) - L.padded_vocab_size * h   # (tied embedding: one copy)
    assert round(non_embedding / 1e6) == NON_EMBEDDING_M[name]
    # the four [h] norms of a layer (input, post-attention, pre-MLP, post-MLP) and the two [d] q/k norms, by hand
    by_hand = n * (h * a * d + 2 * h * g * d + a * d * h + 3 * h * f + 4 * h + 2 * d) + h
    assert non_embedding == by_hand
    # without the post-projection norms: two [h] weights fewer per layer
    assert total_parameters(_layout(name, post=False)) == total_parameters(L) - 2 * n * h


def test_gemma3_1b_total_matches_its_published_count():
    # google/gemma-3-1b-pt model.safetensors: 999,885,952 parameters (tied embedding, 262,144 tokens)
    assert total_parameters(_layout("1b")) == 999_885_952


def test_the_post_norm_parameters_are_named_as_bridge_registers_them():
    # TERowParallelLinearLayerNorm.__init__: super().__init__ (the linear's weight), then self.post_layernorm
    from megatron_memguard.estimator.layers import mlp
    L = _layout("1b")
    names = [r[0] for r in attention.param_rows(L)]
    assert names.index("self_attention.linear_proj.post_layernorm.weight") == \
        names.index("self_attention.linear_proj.weight") + 1
    rows = {r[0]: r for r in mlp.param_rows(L)}
    assert rows["mlp.linear_fc2.post_layernorm.weight"][1:3] == (1152, True)   # [h], the same on every TP rank


def test_the_post_norms_bytes_by_hand():
    # 27B, s 4096, MBS 1, TP 1: each norm keeps its bf16 input [4096, 1, 5376] (44,040,192 B) and the fp32 rstd per
    # token (16,384 B); two norms: 2 x 44,056,576 = 88,113,152 B per layer per micro-batch
    L = _layout("27b")
    assert sum(post_proj_norm_items(L).values()) == 88_113_152
    with_norms, without = layer_activations(L), layer_activations(_layout("27b", post=False))
    assert with_norms.total - without.total == 88_113_152
    # under sequence parallelism (TP 4) each runs on the reduce-scattered output [s/4, b, h]: a quarter
    Lsp = _layout("27b", "--tensor-model-parallel-size", "4", "--sequence-parallel", world=4)
    assert sum(post_proj_norm_items(Lsp).values()) == 88_113_152 // 4
    # without it, on the all-reduced [s, b, h] output, whole on every TP rank
    Ltp = _layout("27b", "--tensor-model-parallel-size", "4", world=4)
    assert sum(post_proj_norm_items(Ltp).values()) == 88_113_152


def test_mlp_recompute_drops_the_post_mlp_norm_and_full_recompute_both():
    # 'mlp' recompute checkpoints the whole MLP, linear_fc2's norm inside it: only the post-attention norm's
    # 44,056,576 B stay
    sel = _layout("27b", "--recompute-granularity", "selective", "--recompute-modules", "mlp")
    sel_off = _layout("27b", "--recompute-granularity", "selective", "--recompute-modules", "mlp", post=False)
    assert layer_activations(sel).total - layer_activations(sel_off).total == 44_056_576
    # the backward of the re-run MLP has the norm's input and rstd back: its peak grows by at least that much
    assert layer_activations(sel).bwd_transient >= layer_activations(sel_off).bwd_transient
    # core_attn recompute does not reach linear_proj: both norms stay
    core = _layout("27b", "--recompute-granularity", "selective", "--recompute-modules", "core_attn")
    core_off = _layout("27b", "--recompute-granularity", "selective", "--recompute-modules", "core_attn", post=False)
    assert layer_activations(core).total - layer_activations(core_off).total == 88_113_152


def test_the_backward_holds_the_norms_input_gradient():
    # the post-MLP norm's backward: its [s b, h] input gradient beside the layer's output gradient, then kept until
    # linear_fc2's backward consumes it (bf16: 44,040,192 B)
    L, off = _layout("27b"), _layout("27b", post=False)
    assert layer_activations(L).bwd_steps[1][1] - layer_activations(off).bwd_steps[0][1] == 4096 * 5376 * 2


def test_two_rotary_tables_and_their_stack():
    # Bridge's Gemma3RotaryEmbedding: the global table, the local one (each RotaryEmbedding.forward, lru_cache,
    # megatron-core 0.19.2) and their torch.stack (_forward_cached): 4 x [4096, 1, 1, 128] fp32 = 8 MiB for the 27B
    assert attention.rotary_cache(_layout("27b"), 62)[0] == 4 * 4096 * 128 * 4
    assert attention.rotary_cache(_layout("27b", post=False), 62)[0] == 4096 * 128 * 4


@pytest.mark.parametrize("flags, message", [
    # (megatron's default --transformer-impl is transformer_engine, its default linear bias on)
    (["--transformer-impl", "local", "--disable-bias-linear"], "--transformer-impl: must be transformer_engine"),
    ([], "--add-bias-linear: must be off with Gemma 3's layer spec"),
])
def test_the_layer_specs_rules(flags, message):
    from megatron_memguard.errors import ConfigError
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    from megatron_memguard.resolve import resolve

    n, h, f, a, g, d, v = GEMMA3["1b"]
    argv = ["--num-layers", "2", "--hidden-size", str(h), "--ffn-hidden-size", str(f), "--num-attention-heads",
            str(a), "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size", "1",
            "--global-batch-size", "8", "--bf16", "--vocab-size", "1024", *flags]
    raw = parse_megatron_flags(argv)
    raw.args["post_proj_norms"] = True
    with pytest.raises(ConfigError, match=message):
        resolve(raw, world_size=1)


def test_attn_proj_offloading_takes_the_post_attention_norm_input():
    # megatron-core 0.19.2 attention.py: the 'attn_proj' group wraps the linear_proj call, inside which
    # TERowParallelLinearLayerNorm runs its norm: the norm's bf16 input [4096, 5376] (44,040,192 B) leaves with it;
    # its fp32 rstd (4,096 elements) is below the 1,048,576-element minimum and stays
    from megatron_memguard.estimator.offload_activations import layer_groups
    on, off = (layer_groups(layer_activations(x).saved, ("attn_proj",), 2) for x in (_layout("27b"),
                                                                                    _layout("27b", post=False)))
    assert on["attn_proj"] - off["attn_proj"] == 4096 * 5376 * 2


def test_the_fujii2024_profile_refuses_the_post_norms_by_name():
    # the paper's closed form (Fujii et al. 2024) has no term for them
    from megatron_memguard.errors import NotModelledError
    from megatron_memguard.estimator.fujii2024 import estimate_fujii2024
    with pytest.raises(NotModelledError, match="Gemma 3's post-projection norms"):
        estimate_fujii2024(_layout("1b"))


# --- NeMo 2.5.0's Gemma3Config (llm/gpt/model/gemma3.py): an export naming only the class is read with its defaults
NEMO2_EXPORT = """\
_target_: nemo.collections.llm.api.pretrain
model:
  _target_: nemo.collections.llm.gpt.model.gemma3.Gemma3Model
  config:
    _target_: nemo.collections.llm.gpt.model.gemma3.{cls}
trainer:
  _target_: nemo.lightning.pytorch.trainer.Trainer
  devices: 8
  num_nodes: 1
  strategy:
    _target_: nemo.lightning.pytorch.strategies.megatron_strategy.MegatronStrategy
    tensor_model_parallel_size: 1
    pipeline_model_parallel_size: 1
    context_parallel_size: {cp}
  plugins:
    _target_: nemo.lightning.pytorch.plugins.mixed_precision.MegatronMixedPrecision
    precision: bf16-mixed
data:
  _target_: nemo.collections.llm.gpt.data.mock.MockDataModule
  seq_length: 4096
  global_batch_size: 32
  micro_batch_size: 1
optim:
  _target_: nemo.lightning.pytorch.optim.megatron.MegatronOptimizerModule
  config:
    _target_: megatron.core.optimizer.optimizer_config.OptimizerConfig
    optimizer: adam
    use_distributed_optimizer: true
"""


def _nemo2(tmp_path, cls, *overrides, cp=1):
    from megatron_memguard.readers.detect import read_config_file
    p = tmp_path / "nemo2.yaml"
    p.write_text(NEMO2_EXPORT.format(cls=cls, cp=cp))
    return read_config_file(str(p), overrides=list(overrides))


def test_nemo2_gemma3_1b_by_its_class_is_the_published_model(tmp_path):
    from megatron_memguard.resolve import resolve
    raw = _nemo2(tmp_path, "Gemma3Config1B")
    L = resolve(raw)
    # google/gemma-3-1b-pt model.safetensors: 999,885,952 parameters (Gemma3Config1B: vocab 262,144, tied embedding)
    assert total_parameters(L) == 999_885_952
    assert (L.num_layers, L.hidden_size, L.num_attention_heads, L.kv_channels, L.padded_vocab_size) == (26, 1152, 4, 256, 262_144)
    # NeMo's Gemma3RotaryEmbedding returns (local, global), each cached by RotaryEmbedding.forward: two tables, no
    # stack (Bridge's three-plus-one is 4): 2 x [4096, 1, 1, 256] fp32 = 8 MiB
    assert L.rotary_tables == 2 and attention.rotary_cache(L, 26)[0] == 2 * 4096 * 256 * 4
    # Gemma3TEDotProductAttention: a local layer's TE window is (window_size, 0) = (512, 0) (Bridge's: 511)
    assert L.post_proj_norms and L.qk_layernorm and raw.args["window_size"] == [512, 0]
    # its spec builds the q / k norms whatever qk_layernorm says (a checkpoint's model.yaml writes GPTConfig's False)
    assert total_parameters(resolve(_nemo2(tmp_path, "Gemma3Config1B", "model.config.qk_layernorm=false"))) == 999_885_952


@pytest.mark.parametrize("name, cls", [("4b", "Gemma3Config4B"), ("12b", "Gemma3Config12B"), ("27b", "Gemma3Config27B")])
def test_nemo2_gemma3_text_classes_match_the_technical_report(tmp_path, name, cls):
    from megatron_memguard.errors import NotModelledError
    from megatron_memguard.resolve import resolve
    # these classes default to is_vision_language: true (the VL model's language config: an arbitrary attention mask)
    with pytest.raises(NotModelledError, match=rf"^model\.config\._target_ \({cls}\): NeMo 2's Gemma 3 with is_vision_language"):
        _nemo2(tmp_path, cls)
    raw = _nemo2(tmp_path, cls, "model.config.is_vision_language=false")
    L = resolve(raw)
    n, h, f, a, g, d, v = GEMMA3[name]
    assert (L.num_layers, L.hidden_size, L.ffn_hidden_size, L.num_attention_heads, L.num_query_groups, L.kv_channels,
            L.padded_vocab_size) == (n, h, f, a, g, d, v)
    # Gemma 3 Technical Report (arXiv 2503.19786), Table 1: non-embedding parameters in millions
    assert round((total_parameters(L) - v * h) / 1e6) == NON_EMBEDDING_M[name]
    assert raw.args["window_size"] == [1024, 0] and L.qk_layernorm and L.post_proj_norms


def test_nemo2_gemma3_context_parallelism_is_a_problem(tmp_path):
    # Gemma3Config.configure_model: ValueError("Context Parallel is not supported for Gemma3 model.")
    assert [str(p) for p in _nemo2(tmp_path, "Gemma3Config1B", cp=2).problems] == [
        "trainer.strategy.context_parallel_size: must be 1 with Gemma3Config1B (Gemma3Config.configure_model raises "
        "ValueError: Context Parallel is not supported for Gemma3 model) (trainer.strategy.context_parallel_size=1)"]
    assert not _nemo2(tmp_path, "Gemma3Config1B").problems
