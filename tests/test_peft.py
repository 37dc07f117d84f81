"""LoRA / DoRA fine-tuning (estimator/peft.py, resolve/peft.py): adapter shapes per TP rank as Megatron-Bridge 0.6.2
builds them (megatron/bridge/peft/utils.py ParallelLinearAdapter; tests/test_bridge_real.py checks the same counts
against the real adapters), frozen base weights, the adapters' optimizer shard, and what the layers keep for
backward. Every number is worked out by hand from the shapes in the comments."""
import sys
import os
import textwrap

import pytest

from megatron_memguard import resolve
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator import estimate
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.estimator.head import output_items
from megatron_memguard.estimator.peft import adapter_param_count, layer_adapter_rows
from megatron_memguard.readers.detect import read_config_file

sys.path.insert(0, os.path.dirname(__file__))
from test_readers_bridge import FLAT  # noqa: E402

# FLAT: 4 layers, h 512, ffn 1536 (SwiGLU: fc1 out 3072), 8 heads of 64, 2 query groups (qkv out 768), TP 2 with SP,
# s 1024, micro-batch 2, bf16, distributed optimizer, fp32 gradients. World 8: DP 4.
LORA = "peft:\n  _target_: megatron.bridge.peft.lora.LoRA\n  dim: 8\n"
DORA = "peft:\n  _target_: megatron.bridge.peft.dora.DoRA\n  dim: 8\n"


def layout(tmp_path, text, overrides=(), world=8):
    p = tmp_path / "run_config.yaml"
    p.write_text(textwrap.dedent(text))
    return resolve(read_config_file(str(p), overrides=list(overrides)), world_size=world)


def terms(L, stage=0):
    return {t.name: t.bytes for t in estimate(L).stages[stage].terms}


def test_lora_adapter_parameters_per_rank(tmp_path):
    L = layout(tmp_path, FLAT + LORA)
    assert (L.peft.scheme, L.peft.dim, L.peft.alpha, L.peft.dropout) == ("lora", 8, 32, 0.0)   # LoRA's defaults
    # (in + out) x r per target, split over TP 2:
    # qkv (512 + 768) 8 + proj (512 + 512) 8 + fc1 (512 + 3072) 8 + fc2 (1536 + 512) 8 = 63,488 per layer
    assert adapter_param_count(L) == 4 * 63_488
    assert sum(n for _, n, _ in layer_adapter_rows(L)) == 63_488 // 2
    # column targets: linear_in [r/TP, in], linear_out [out/TP, r]; row targets: linear_in [r, in/TP], linear_out [out/TP, r]
    rows = {name: n for name, n, _ in layer_adapter_rows(L)}
    assert rows["linear_qkv.adapter.linear_in.weight"] == 4 * 512 and rows["linear_qkv.adapter.linear_out.weight"] == 384 * 8
    assert rows["linear_fc2.adapter.linear_in.weight"] == 8 * 768 and rows["linear_fc2.adapter.linear_out.weight"] == 256 * 8


def test_dora_adds_the_magnitude_vectors(tmp_path):
    L = layout(tmp_path, FLAT + DORA)
    assert (L.peft.scheme, L.peft.alpha) == ("dora", 64)     # DoRA's default alpha
    # magnitude: the wrapped weight's local rows: qkv 768/2, fc1 3072/2 (column), proj 512, fc2 512 (row)
    assert sum(n for _, n, _ in layer_adapter_rows(L)) == 63_488 // 2 + 384 + 1536 + 512 + 512


def test_frozen_base_and_the_adapters_states(tmp_path):
    full, lora = terms(layout(tmp_path, FLAT)), terms(layout(tmp_path, FLAT + LORA))
    adapters = 4 * 63_488 // 2                               # 126,976 on each TP rank
    # the base weights: every parameter of the rank, bf16, unpadded (not in DDP's buffers)
    base = full["parameters"] // 2                           # the full run's param buffer: 22,417,920, no padding here
    assert lora["parameters"] == base * 2
    # the adapters: bf16 weights in the param buffer, fp32 gradients, fp32 master + two Adam moments over DP 4
    # (126,976 elements pad to a multiple of lcm(4, 128) = 128: already one)
    assert lora["peft_adapters"] == adapters * 2
    assert lora["gradient_buffer"] == adapters * 4
    assert lora["main_parameters"] == lora["adam_exp_avg"] == lora["adam_exp_avg_sq"] == adapters * 4 // 4
    # no TE placeholder weight gradients for frozen weights, no output-layer input kept
    assert "dummy_wgrads" not in lora and "output_layer_input" not in lora and "output_layer_input" in full


def test_what_the_layers_keep_for_backward(tmp_path):
    full, lora = layout(tmp_path, FLAT), layout(tmp_path, FLAT + LORA)
    a, b = layer_activations(full).saved, layer_activations(lora).saved
    Tf, h, e = 1024 * 2, 512, 2
    # under SP the adapters of linear_qkv and linear_fc1 keep TE's gathered [s b, h] norm output;
    # every adapter keeps its [s b, r] intermediate; the base items stay (the adapters keep the row-parallel inputs)
    assert b["lora_qkv_input"] == b["lora_fc1_input"] == Tf * h * e
    assert b["lora_intermediates"] == 4 * Tf * 8 * e
    assert {k: v for k, v in b.items() if not k.startswith("lora_")} == a
    assert "output_layer_input" not in output_items(lora).saved


def test_unwrapped_frozen_linears_keep_no_input(tmp_path):
    L = layout(tmp_path, FLAT + LORA + "  target_modules: [linear_qkv]\n",
               overrides=["model.sequence_parallel=false"])
    full = layout(tmp_path, FLAT, overrides=["model.sequence_parallel=false"])
    a, b = layer_activations(full).saved, layer_activations(L).saved
    # fc1's norm output (TE LayerNormLinear, frozen, not returned) and fc2's input (TE Linear, frozen) go; linear_proj's
    # input is flash attention's saved output: it stays; without SP the qkv adapter shares TE's norm output
    assert "fc1_input" not in b and "fc2_input" not in b and b["proj_input"] == a["proj_input"]
    assert "lora_qkv_input" not in b and b["lora_intermediates"] == 2048 * 8 * 2
    assert sum(a.values()) - sum(b.values()) == a["fc1_input"] + a["fc2_input"] - 2048 * 8 * 2


@pytest.mark.parametrize("overrides, kept", [
    # TE 2.11 FlashAttention keeps its own [b, s, h, d] output (attention_output_bshd) and returns a .contiguous()
    # sbhd copy, which only linear_proj would keep: frozen, it keeps none (what --attention-backend auto runs on an A100)
    (["model.attention_backend=flash"], False),
    # cuDNN FusedAttention's p2p ring under CP saves out_f16 and returns it (TE 2.11 context_parallel.py
    # AttnFuncWithCPAndKVP2P.forward: f16_tensors = (q_f16, kv_f16, out_f16)): linear_proj reads that storage
    (["model.context_parallel_size=2"], True),
    ([], True),                          # FusedAttnFunc without CP: the same, it saves the output it returns
])
def test_a_frozen_linear_proj_keeps_its_input_only_where_the_core_attention_does(tmp_path, overrides, kept):
    over = ["model.sequence_parallel=false", *overrides]
    L = layout(tmp_path, FLAT + LORA + "  target_modules: [linear_qkv]\n", overrides=over)
    full = layout(tmp_path, FLAT, overrides=over)
    a, b = layer_activations(full).saved, layer_activations(L).saved
    assert a["proj_input"] == 2048 // L.cp * 256 * 2          # [s/CP b, a d / TP] bf16, in the model that trains it
    assert ("proj_input" in b) is kept
    # the rest: fc1's norm output and fc2's input go, the qkv adapter keeps its [s b / CP, r] intermediate
    assert sum(a.values()) - sum(b.values()) == (a["fc1_input"] + a["fc2_input"] - 2048 // L.cp * 8 * 2
                                                  + (0 if kept else a["proj_input"]))


def test_dropout_before_the_adapter_keeps_a_copy_and_a_mask(tmp_path):
    L = layout(tmp_path, FLAT + LORA + "  dropout: 0.1\n")
    b = layer_activations(L).saved
    Tf, e = 2048, 2
    # column targets: a dropped [s b, h] copy and its bool mask; row targets: the same of their [s b, in/TP] input,
    # which then replaces the base's (linear_fc2's input is no longer kept; linear_proj's still is, by the attention)
    assert b["lora_qkv_input"] == b["lora_fc1_input"] == Tf * 512 * (e + 1)
    assert b["lora_proj_input"] == Tf * 256 * (e + 1) and b["lora_fc2_input"] == Tf * 768 * (e + 1)
    assert "fc2_input" not in b and "proj_input" in b


def test_dora_keeps_the_scaled_sum(tmp_path):
    b = layer_activations(layout(tmp_path, FLAT + DORA)).saved
    # mag_norm_scale * (base + adapter) keeps the sum: [s b, out/TP] for column targets, [s b / TP, h] for row ones
    assert b["dora_scaled_outputs"] == (2048 * 384 + 2048 * 1536 + 2 * 1024 * 512) * 2


@pytest.mark.parametrize("extra,key,exc", [
    ("  dim: 7\n", "peft.dim", ConfigErrors),                                     # not divisible by TP 2
    ("  dropout: 1.5\n", "peft.dropout", ConfigErrors),
    ("  target_modules: [linear_q_proj]\n", "peft.target_modules", NotModelledError),
    ("  target_modules: ['*.layers.0.*.linear_qkv']\n", "peft.target_modules", NotModelledError),
    # exclude_modules with LoRA's default target_modules: ModuleMatcher asserts exclude_modules is empty
    ("  exclude_modules: [linear_fc2]\n", "peft.exclude_modules: must be empty when target_modules is set", ConfigError),
    ("  lora_dtype: float32\n", "peft.lora_dtype", NotModelledError),
    # Bridge 0.6.2 peft/module_matcher.py ModuleMatcher.match: 'assert len(self.exclude_modules) == 0' (with
    # target_modules) or 'name not in self.exclude_modules' (without) on every module: None is a TypeError
    ("  exclude_modules: null\n", "peft.exclude_modules: is null", ConfigError),
])
def test_bad_or_unmodelled_peft_settings_name_the_key(tmp_path, extra, key, exc):
    with pytest.raises((exc, ConfigError)) as e:
        layout(tmp_path, FLAT + LORA.replace("  dim: 8\n", "") + extra)
    assert key in str(e.value) and "Traceback" not in str(e.value)


def test_a_live_lora_objects_fields_are_read(tmp_path):
    # what the Bridge callback hands over for LoRA(): every dataclass field, empty lists and mappings included
    L = layout(tmp_path, FLAT + LORA + "  exclude_modules: []\n  canonical_mapping: {}\n  lora_dtype: null\n"
               "  a2a_experimental: false\n  sequence_parallel_input_regather: false\n  dropout_position: pre\n"
               "  lora_A_init_method: xavier\n  normalize_moe_lora: false\n")
    assert L.peft.target_modules == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def test_other_peft_classes_and_dora_after_dropout_are_refused(tmp_path):
    with pytest.raises(NotModelledError, match="peft._target_.*CanonicalLoRA"):
        layout(tmp_path, FLAT + "peft:\n  _target_: megatron.bridge.peft.canonical_lora.CanonicalLoRA\n")
    with pytest.raises((ConfigError, ConfigErrors), match="peft.dropout_position"):
        layout(tmp_path, FLAT + DORA + "  dropout_position: post\n")
    with pytest.raises(NotModelledError, match="transformer.impl|transformer_impl"):
        layout(tmp_path, FLAT + LORA, overrides=["model.transformer_impl=local"])
    with pytest.raises(NotModelledError, match="ddp.reduce_scatter_with_fp32_accumulation"):
        layout(tmp_path, FLAT + LORA, overrides=["ddp.reduce_scatter_with_fp32_accumulation=true"])
    with pytest.raises(NotModelledError, match="num_moe_experts|num_experts"):
        layout(tmp_path, FLAT + LORA, overrides=["model.num_moe_experts=4", "model.moe_router_topk=2"])


def test_megatron_flags_have_no_peft(capsys):
    # Megatron-LM has no PEFT: no flag reaches the peft dests (an unknown flag is ignored with a note, as before)
    from megatron_memguard.cli.main import main
    from megatron_memguard.readers.megatron_flags import flag_table
    assert not any(spec[0].startswith("peft") for spec in flag_table().values())
    assert main(["validate", "--world-size", "8", "--", "--num-layers", "2", "--hidden-size", "256",
                 "--num-attention-heads", "4", "--seq-length", "128", "--max-position-embeddings", "128",
                 "--micro-batch-size", "1", "--global-batch-size", "8", "--vocab-size", "1000", "--peft-dim", "8"]) == 0
    assert "ignored: --peft-dim" in capsys.readouterr().out


def test_layout_json_round_trip(tmp_path):
    from megatron_memguard.layout import Layout
    L = layout(tmp_path, FLAT + LORA + "  target_modules: [linear_qkv, linear_fc2]\n")
    d = L.to_dict()
    assert d["peft"]["target_modules"] == ["linear_qkv", "linear_fc2"]
    assert Layout.from_dict(d) == L
    assert "peft" not in layout(tmp_path, FLAT).to_dict()


def test_trainable_parameters_in_report_and_json(tmp_path):
    from megatron_memguard.report.text import render
    # FLAT's 4 layers, r 8, the four default targets (whole-model shapes): qkv (512 + 768) 8 = 10,240,
    # proj (512 + 512) 8 = 8,192, fc1 (512 + 3072) 8 = 28,672, fc2 (1536 + 512) 8 = 16,384: 63,488 a layer
    est = estimate(layout(tmp_path, FLAT + LORA))
    assert est.to_dict()["trainable_parameters"] == 4 * 63_488 == 253_952
    assert "adapters: LoRA rank 8 on linear_qkv, linear_proj, linear_fc1, linear_fc2; 253,952 trainable parameters" \
        in render(est)
    # DoRA adds each wrapped weight's output rows, whole: 768 + 512 + 3072 + 512 = 4,864 a layer
    est = estimate(layout(tmp_path, FLAT + DORA + "  target_modules: [linear_qkv, linear_fc2]\n"))
    assert est.to_dict()["trainable_parameters"] == 4 * ((512 + 768) * 8 + 768 + (1536 + 512) * 8 + 512) == 111_616
    assert "adapters: DoRA rank 8 on linear_qkv, linear_fc2; 111,616 trainable parameters" in render(est)
    # without PEFT: no line, no key
    est = estimate(layout(tmp_path, FLAT))
    assert "trainable_parameters" not in est.to_dict() and "adapters:" not in render(est)


NEMO1 = """
trainer: {devices: 8, num_nodes: 1, precision: bf16}
model:
  mcore_gpt: true
  transformer_engine: true
  micro_batch_size: 1
  global_batch_size: 32
  tensor_model_parallel_size: 2
  encoder_seq_length: 2048
  max_position_embeddings: 2048
  num_layers: 4
  hidden_size: 512
  ffn_hidden_size: 2048
  num_attention_heads: 8
  megatron_amp_O2: true
  tokenizer: {library: megatron, type: GPT2BPETokenizer}
  optim: {name: fused_adam, lr: 2e-4}
  peft:
    peft_scheme: lora
    lora_tuning: {target_modules: [attention, mlp_fc1], adapter_dim: 16, alpha: 16, adapter_dropout: 0.0}
"""


def test_nemo1_lora(tmp_path):
    pytest.importorskip("omegaconf")
    p = tmp_path / "megatron_gpt_peft.yaml"
    p.write_text(NEMO1)
    L = resolve(read_config_file(str(p)))
    assert (L.peft.scheme, L.peft.dim, L.peft.target_modules) == ("lora", 16, ("linear_qkv", "linear_proj", "linear_fc1"))
    p.write_text(NEMO1.replace("peft_scheme: lora", "peft_scheme: ia3"))
    with pytest.raises(NotModelledError, match="model.peft.peft_scheme"):
        read_config_file(str(p))


def test_nemo1_lora_weight_tying_is_an_error_naming_the_key(tmp_path):
    # nemo_toolkit 2.2.1 peft_config.py LoraPEFTConfig._create_lora_config: weight_tying adds num_position_embeddings /
    # dim_position_embeddings / position_embedding_strategy to LoraKQVAdapterConfig(**config_args), a dataclass without
    # those fields: TypeError at model setup (NeMo 1 cannot run it), so a rule error rather than a refusal
    pytest.importorskip("omegaconf")
    p = tmp_path / "megatron_gpt_peft.yaml"
    p.write_text(NEMO1.replace("adapter_dropout: 0.0}", "adapter_dropout: 0.0, weight_tying: true}"))
    with pytest.raises(ConfigError) as e:
        resolve(read_config_file(str(p)))
    assert not isinstance(e.value, NotModelledError)
    assert str(e.value).startswith("model.peft.lora_tuning.weight_tying:") and "TypeError at model setup" in str(e.value)
    # weight_tying: false builds the untied adapters
    p.write_text(NEMO1.replace("adapter_dropout: 0.0}", "adapter_dropout: 0.0, weight_tying: false}"))
    assert resolve(read_config_file(str(p))).peft.dim == 16


@pytest.mark.parametrize("targets", ["5", "{attention: 1}"])
def test_nemo1_lora_targets_of_the_wrong_kind_name_the_key(tmp_path, targets):
    # LoraPEFTConfig reads target_modules as a list of names: an int was an internal error (list(5)) and a
    # mapping's keys were taken as names
    pytest.importorskip("omegaconf")
    p = tmp_path / "megatron_gpt_peft.yaml"
    p.write_text(NEMO1.replace("target_modules: [attention, mlp_fc1]", f"target_modules: {targets}"))
    with pytest.raises(ConfigError, match="model.peft.lora_tuning.target_modules: must be a target name or a list"):
        read_config_file(str(p))


def test_run_recipe_lora_mode_names_the_recipe():
    from megatron_memguard.readers.run_recipe import parse_run_recipe, recipe_key
    # (Bridge 0.6.2 has qwen3_8b_peft_config; memguard has the Llama PEFT recipes only)
    with pytest.raises(NotModelledError, match="--mode lora.*qwen3_8b_peft_config.*llama32_1b_peft_config"):
        recipe_key(parse_run_recipe(["--model", "qwen3_8b", "--mode", "lora"]))


@pytest.mark.parametrize("argv, scheme, dim, alpha, tp, trainable", [
    # Bridge 0.6.2 recipes/llama/h100/llama3.py: the 1B / 3B recipes keep LoRA's / DoRA's defaults (dim 32, alpha 32 /
    # 64); the 8B ones set dim 8, alpha 16 and the 70B ones dim 16, alpha 32 on either scheme.
    # Llama-3.2-1B: 16 layers, h 2048, qkv out 2048 + 2 x 512, fc1 out 16384, fc2 in 8192:
    # (2048 + 3072) + (2048 + 2048) + (2048 + 16384) + (8192 + 2048) = 37,888 x 32 x 16 layers
    (["--recipe", "llama32_1b_peft_config"], "lora", 32, 32, 1, 37_888 * 32 * 16),
    # DoRA adds the wrapped weights' output rows: 3072 + 2048 + 16384 + 2048 = 23,552 a layer
    (["--model", "llama32_1b", "--mode", "dora"], "dora", 32, 64, 1, (37_888 * 32 + 23_552) * 16),
    # Llama-3-8B: 32 layers, (4096 + 6144) + (4096 + 4096) + (4096 + 28672) + (14336 + 4096) = 69,632 x 8 (HF's
    # separate q, k, v, gate, up adapters would count 20,971,520)
    (["--model", "llama3_8b", "--mode", "lora", "-tp", "2"], "lora", 8, 16, 2, 17_825_792),
    (["--recipe", "llama3_8b_peft_config", "--mode", "dora"], "dora", 8, 16, 1, 17_825_792 + 32 * 43_008),
    # Llama-3-70B: 80 layers, TP 8; (8192 + 10240) + (8192 + 8192) + (8192 + 57344) + (28672 + 8192) = 137,216 x 16
    (["--recipe", "llama3_70b_peft_config"], "lora", 16, 32, 8, 137_216 * 16 * 80),
])
def test_run_recipe_peft_recipes(argv, scheme, dim, alpha, tp, trainable):
    from megatron_memguard.readers.run_recipe import read_run_recipe
    rr, raw = read_run_recipe(argv)
    L = resolve(raw, world_size=8)
    assert (L.peft.scheme, L.peft.dim, L.peft.alpha, L.tp) == (scheme, dim, alpha, tp)
    assert L.peft.target_modules == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    assert adapter_param_count(L) == trainable
    # _peft_common / the recipe: seq 4096, MBS 1, GBS 8, no distributed optimizer, bf16
    assert (L.seq_length, L.micro_batch_size, L.global_batch_size, L.use_distributed_optimizer) == (4096, 1, 8, False)


def test_run_recipe_peft_datasets():
    from megatron_memguard.readers.run_recipe import read_run_recipe
    # a fine-tuning dataset preset: a new dataset of the recipe model's sequence length, then -sl
    _, raw = read_run_recipe(["--model", "llama32_1b", "--mode", "lora", "--dataset", "squad", "-sl", "2048"])
    assert resolve(raw, world_size=8).seq_length == 2048
    for ds, rule in (("mock", "incompatible with dataset 'mock'"), ("cord-v2", "DirectHFSFTDatasetConfig")):
        with pytest.raises(ConfigError, match=rule):
            read_run_recipe(["--model", "llama32_1b", "--mode", "lora", "--dataset", ds])


def test_the_adapters_backward_working_sets(tmp_path):
    full, lora = layer_activations(layout(tmp_path, FLAT)), layer_activations(layout(tmp_path, FLAT + LORA))
    Tf, e, r = 2048, 2, 8
    # at each wrapped linear's backward step: the adapter's input gradient [s b, in/TP] and two [s b, r] tensors
    # (steps: fc2, the unfused SwiGLU's mul, silu and chunk, fc1, pre-MLP norm, linear_proj, core attention,
    # linear_qkv, input norm)
    extra = [w2 - w1 for (_, w1), (_, w2) in zip(full.bwd_steps, lora.bwd_steps)]
    adapter = 2 * Tf * r * e
    assert extra == [Tf * 768 * e + adapter, 0, 0, 0, Tf * 512 * e + adapter, 0, Tf * 256 * e + adapter, 0,
                     Tf * 512 * e + adapter, 0]


def test_a_recipes_peft_object_takes_no_override():
    # Bridge 0.6.2 omegaconf_utils._is_omegaconf_problematic: the (callable) PEFT object is left out of the config the
    # overrides apply to: Hydra refuses 'peft.dim=16' (tests/test_bridge_real.py runs run_recipe.py on it) and a
    # '+peft.dim' key is dropped when the object is restored
    from megatron_memguard.readers.run_recipe import read_run_recipe
    with pytest.raises(ConfigError, match="peft.dim: Megatron-Bridge cannot override the recipe's PEFT object"):
        read_run_recipe(["--recipe", "llama32_1b_peft_config", "peft.dim=16"])
    # '+peft.dim' is added by Hydra, then set on the object itself: DoRA() of the 1B recipe (alpha 64) with rank 4
    _, raw = read_run_recipe(["--model", "llama32_1b", "--mode", "dora", "+peft.dim=4"])
    L = resolve(raw, world_size=8)
    assert (L.peft.scheme, L.peft.dim, L.peft.alpha) == ("dora", 4, 64)
    assert raw.origin["peft_scheme"] == "peft._target_ (--mode dora)"
    # ConfigContainer.validate asserts a pretrained checkpoint for PEFT: a warning until it is given
    assert any("PEFT requires a pretrained checkpoint path" in w for w in raw.warnings)
    _, raw = read_run_recipe(["--model", "llama32_1b", "--mode", "lora", "--pretrained_checkpoint", "/ckpt/llama"])
    assert not any("pretrained checkpoint" in w for w in raw.warnings)
