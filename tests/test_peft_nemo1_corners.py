"""NeMo 1 LoRA corners: the canonical variant (unfused q / k / v and gate / up adapters).

Source: nemo_toolkit 2.2.1 nemo/collections/nlp/parts/peft_config.py (LoraPEFTConfig: 'variant' == 'canonical' picks
LoraUnfusedKQVAdapterConfig for attention_qkv and LoraUnfusedHto4HAdapterConfig for mlp_fc1) and
nemo/collections/nlp/modules/common/megatron/adapters/parallel_adapters.py (LoraUnfusedKQVAdapter: q_adapter with
out_features = in_features, k_adapter and v_adapter with kv_channels x num_query_groups; LoraUnfusedHto4HAdapter:
gate_adapter and up_adapter with out_features // 2 each; every one a ParallelLinearAdapter with its own linear_in
ColumnParallelLinear(in, dim) and linear_out ColumnParallelLinear(dim, out)).
"""
import pytest

from megatron_memguard import estimate
from megatron_memguard.estimator.peft import adapter_param_count, layer_adapter_rows
from megatron_memguard.readers.detect import read_config_file
from megatron_memguard import resolve

from test_peft import NEMO1

pytest.importorskip("omegaconf")


def _layout(tmp_path, text):
    p = tmp_path / "megatron_gpt_peft.yaml"
    p.write_text(text)
    return resolve(read_config_file(str(p)))


CANONICAL = NEMO1.replace("adapter_dropout: 0.0}", "adapter_dropout: 0.0, variant: canonical}")


def test_canonical_adapter_parameters_by_hand(tmp_path):
    # NEMO1: h 512, 8 heads of 64 (8 query groups: k and v out 512 each), ffn 2048 (GELU: fc1 out 2048), rank 16,
    # targets attention (qkv + dense) and mlp_fc1, 4 layers, TP 2
    fused = _layout(tmp_path, NEMO1)
    canon = _layout(tmp_path, CANONICAL)
    assert (fused.peft.variant, canon.peft.variant) == ("fused", "canonical")
    # fused, per layer: qkv (512 + 1536) x 16 + dense (512 + 512) x 16 + fc1 (512 + 2048) x 16 = 90,112
    assert adapter_param_count(fused) == 4 * ((512 + 1536) * 16 + (512 + 512) * 16 + (512 + 2048) * 16) == 360_448
    # canonical, per layer: q (512 + 512) + k (512 + 512) + v (512 + 512), dense (512 + 512), gate (512 + 1024)
    # + up (512 + 1024), each x 16 = 114,688: two more linear_in [16, 512] on qkv, one more on fc1
    assert adapter_param_count(canon) == 4 * 16 * (3 * 1024 + 1024 + 2 * 1536) == 458_752
    # per TP rank: q / k / v linear_in [16/2, 512] and linear_out [512/2, 16]; dense linear_in [16, 512/2] and
    # linear_out [512/2, 16]; gate / up linear_in [8, 512] and linear_out [1024/2, 16]
    rows = layer_adapter_rows(canon)
    assert [n for n, _, _ in rows][:6] == [
        "linear_proj.adapter.linear_in.weight", "linear_proj.adapter.linear_out.weight",
        "linear_qkv.adapter.q_adapter.linear_in.weight", "linear_qkv.adapter.q_adapter.linear_out.weight",
        "linear_qkv.adapter.k_adapter.linear_in.weight", "linear_qkv.adapter.k_adapter.linear_out.weight"]
    assert sum(n for _, n, _ in rows) == 2 * 4096 + 3 * (4096 + 4096) + 2 * (4096 + 8192) == 57_344
    assert 4 * sum(n for _, n, _ in rows) * 2 == adapter_param_count(canon)     # TP 2: every row is split


def test_canonical_keeps_one_intermediate_per_adapter(tmp_path):
    # each unfused adapter keeps its own [s b, r] linear_out input: 3 on qkv, 2 on fc1 (vs 1 each fused)
    fused = estimate(_layout(tmp_path, NEMO1), device="cpu").stages[0]
    canon = estimate(_layout(tmp_path, CANONICAL), device="cpu").stages[0]
    assert canon.peak_allocated_bytes > fused.peak_allocated_bytes
    from megatron_memguard.estimator.activations import layer_activations
    f = layer_activations(_layout(tmp_path, NEMO1)).saved["lora_intermediates"]
    c = layer_activations(_layout(tmp_path, CANONICAL)).saved["lora_intermediates"]
    tokens = 2048 * 1          # s x b (no SP: the adapters see the whole sequence)
    assert f == 3 * tokens * 16 * 2 and c == (3 + 1 + 2) * tokens * 16 * 2


# ----- layer_selection: adapters on some layers only (nemo_toolkit 2.2.1 nlp_adapter_mixins.py
# _check_and_add_peft_cfg: 'layer.layer_number in (layer_selection or range(1, num_layers + 1))', 1-based global
# layer numbers)

def _selected(tmp_path, sel: str, pp: int = 1):
    text = NEMO1.replace("adapter_dropout: 0.0}", f"adapter_dropout: 0.0, layer_selection: {sel}}}")
    if pp > 1:
        text = text.replace("tensor_model_parallel_size: 2", f"tensor_model_parallel_size: 2\n  pipeline_model_parallel_size: {pp}")
    return _layout(tmp_path, text)


def test_layer_selection_counts_the_selected_layers_adapters(tmp_path):
    per_layer = (512 + 1536) * 16 + (512 + 512) * 16 + (512 + 2048) * 16     # 90,112 (fused, by hand above)
    L = _selected(tmp_path, "[1, 3]")
    assert L.peft.layers == (1, 3)
    assert adapter_param_count(L) == 2 * per_layer
    assert any("adapters on layers 1, 3 only" in n for n in L.notes)
    # an empty list selects every layer (NeMo: 'layer_selection or range(...)'); all four is the same as none
    assert _selected(tmp_path, "[]").peft.layers is None
    assert _selected(tmp_path, "[1, 2, 3, 4]").peft.layers is None
    with pytest.raises(Exception, match="layer_selection: selects none of the model's layers 1..4"):
        _selected(tmp_path, "[7]")


def test_layer_selection_per_pipeline_stage(tmp_path):
    # PP 2 (TP 2, 8 GPUs: DP 2): stage 0 holds layers 1-2, stage 1 layers 3-4. Selecting 3 and 4 leaves stage 0 without
    # adapters; stage 1's adapter state is the four-layer run's last stage's
    L = _selected(tmp_path, "[3, 4]", pp=2)
    full = _layout(tmp_path, NEMO1.replace("tensor_model_parallel_size: 2",
                                           "tensor_model_parallel_size: 2\n  pipeline_model_parallel_size: 2"))
    sel, every = estimate(L, device="cpu").stages, estimate(full, device="cpu").stages
    t = [{x.name: x.bytes for x in s.terms} for s in sel]
    f = [{x.name: x.bytes for x in s.terms} for s in every]
    assert t[0].get("peft_adapters", 0) == 0 and t[0].get("adam_exp_avg", 0) == 0
    for name in ("peft_adapters", "gradient_buffer", "adam_exp_avg", "adam_exp_avg_sq"):
        assert t[1][name] == f[1][name], name
    # per TP rank, per layer: qkv [8, 512] + [768, 16], dense [16, 256] + [256, 16], fc1 [8, 512] + [1024, 16]
    per_rank = 8 * 512 + 768 * 16 + 16 * 256 + 256 * 16 + 8 * 512 + 1024 * 16
    assert per_rank == 45_056 and t[1]["peft_adapters"] >= 2 * per_rank * 2      # bf16, 2 layers (+ padding)


# ----- Bridge / NeMo 2 exclude_modules with an empty target_modules: every linear not excluded gets an adapter
# (Megatron-Bridge 0.6.2 peft/module_matcher.py ModuleMatcher.match: 'name not in self.exclude_modules and not any(
# wildcard_match(pattern, full_name) ...)' over ColumnParallelLinear / RowParallelLinear / nn.Linear / TE linears)

def _bridge(tmp_path, peft: str):
    from test_peft import FLAT, layout
    return layout(tmp_path, FLAT + "peft:\n  _target_: megatron.bridge.peft.lora.LoRA\n  dim: 8\n" + peft)


def test_exclude_modules_wrap_the_complement(tmp_path):
    L = _bridge(tmp_path, "  target_modules: []\n  exclude_modules: [output_layer, linear_fc2]\n")
    assert L.peft.target_modules == ("linear_qkv", "linear_proj", "linear_fc1")
    # the same adapters as naming the three
    same = _bridge(tmp_path, "  target_modules: [linear_qkv, linear_proj, linear_fc1]\n")
    assert adapter_param_count(L) == adapter_param_count(same)
    # FLAT: h 512, qkv out 768, fc1 out 3072 (SwiGLU), 8 heads of 64, rank 8, 4 layers:
    # qkv (512 + 768) x 8 + proj (512 + 512) x 8 + fc1 (512 + 3072) x 8 = 39,040 a layer
    assert adapter_param_count(L) == 4 * 8 * ((512 + 768) + (512 + 512) + (512 + 3072)) == 188_416
    wild = _bridge(tmp_path, "  target_modules: []\n  exclude_modules: ['*output_layer', '*.mlp.*']\n")
    assert wild.peft.target_modules == ("linear_qkv", "linear_proj")


@pytest.mark.parametrize("exclude, match", [
    ("[linear_fc2]", "peft.exclude_modules: PEFT whose exclude_modules leave the output layer wrapped"),
    ("[output_layer, '*.layers.0.*']", "peft.exclude_modules: PEFT exclude_modules that keep linear_qkv out of some"),
])
def test_exclude_modules_memguard_does_not_model(tmp_path, exclude, match):
    from megatron_memguard.errors import NotModelledError
    with pytest.raises(NotModelledError, match=match.replace(".", r"\.")):
        _bridge(tmp_path, f"  target_modules: []\n  exclude_modules: {exclude}\n")


def test_exclude_modules_that_exclude_every_linear(tmp_path):
    from megatron_memguard.errors import ConfigError
    with pytest.raises(ConfigError, match="peft.exclude_modules: excludes every linear"):
        _bridge(tmp_path, "  target_modules: []\n  exclude_modules: [output_layer, linear_qkv, linear_proj, "
                          "linear_fc1, linear_fc2]\n")
