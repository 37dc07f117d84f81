"""Gated delta net layers (Qwen3-Next style linear attention): a GPT model's --experimental-attention-variant
gated_delta_net with --linear-attention-freq, and a hybrid model's 'G' layers. Parameters by hand (the Qwen3-Next
layer shape) and against megatron-core's GatedDeltaNet built on CPU; saved bytes from flash-linear-attention 0.4.2's
saved tensors (files named per case); Megatron's rules as one-line errors naming the flag."""
import os
import sys

import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.estimator.layers import gdn
from megatron_memguard.estimator.params import chunk_params, total_parameters
from megatron_memguard.partition import LayerKind, layer_kinds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
GPT = ("--num-layers 8 --hidden-size 256 --num-attention-heads 4 --seq-length 512 --max-position-embeddings 512 "
       "--micro-batch-size 2 --global-batch-size 16 --bf16 --normalization RMSNorm --swiglu --disable-bias-linear "
       "--ffn-hidden-size 512 --position-embedding-type rope --vocab-size 1024 "
       "--experimental-attention-variant gated_delta_net --linear-attention-freq 4 --linear-num-key-heads 2 "
       "--linear-num-value-heads 4 --linear-key-head-dim 32 --linear-value-head-dim 48").split()
# Qwen3-Next-80B-A3B's linear attention layer (its Hugging Face config.json: hidden_size 2048, linear_num_key_heads 16,
# linear_num_value_heads 32, linear_key_head_dim 128, linear_value_head_dim 128, linear_conv_kernel_dim 4)
QWEN3_NEXT = ("--hidden-size 2048 --num-attention-heads 16 --group-query-attention --num-query-groups 2 "
              "--kv-channels 256 --linear-num-key-heads 16 --linear-num-value-heads 32 --linear-key-head-dim 128 "
              "--linear-value-head-dim 128 --linear-conv-kernel-dim 4").split()


def _layout(extra=(), version="0.19", world_size=8, base=GPT):
    return layout_from_flags(list(base) + list(extra), world_size=world_size, megatron_version=version)


def _err(extra, version="0.19", world_size=8, base=GPT) -> str:
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        _layout(extra, version, world_size, base)
    return str(e.value)


GDN = LayerKind("gdn", "dense")
ATTN = LayerKind("attention", "dense")


def test_linear_attention_freq_places_the_layers():
    # get_linear_attention_pattern (experimental_attention_variant_module_specs.py, 0.19.2): with N = 4, layer i
    # (0-based) is standard attention iff (i + 1) % 4 == 0
    assert layer_kinds(_layout()) == (GDN,) * 3 + (ATTN,) + (GDN,) * 3 + (ATTN,)
    # a list expression, one 0/1 per layer (la_freq_type, arguments.py): 1 a linear attention layer
    L = _layout(["--linear-attention-freq", "([0]+[1]*3)*2"])
    assert L.linear_attention_pattern == "01110111"
    assert layer_kinds(L) == (ATTN,) + (GDN,) * 3 + (ATTN,) + (GDN,) * 3
    # with --moe-layer-freq the MLP follows its own pattern
    L = _layout(["--num-experts", "4", "--moe-layer-freq", "([0]+[1]*7)", "--moe-ffn-hidden-size", "128"])
    assert layer_kinds(L)[:2] == (GDN, LayerKind("gdn", "moe")) and layer_kinds(L)[3] == LayerKind("attention", "moe")


def test_qwen3_next_layer_parameters_by_hand():
    L = _layout(QWEN3_NEXT, world_size=8)
    # Hugging Face Qwen3NextGatedDeltaNet: in_proj_qkvz 2048 x (2*16*128 + 2*32*128), in_proj_ba 2048 x 64,
    # conv1d (2*16*128 + 32*128) x 4, dt_bias 32, A_log 32, norm 128, out_proj (32*128) x 2048; plus the layer's
    # input norm (2048), which megatron-core fuses into in_proj
    by_hand = 2048 * 12288 + 2048 * 64 + 8192 * 4 + 32 + 32 + 128 + 4096 * 2048 + 2048
    assert by_hand == 33_720_512
    assert gdn.param_count(L) == by_hand
    assert sum(r[1] for r in gdn.param_rows(L)) == by_hand     # TP = 1: the rows are the whole layer


def test_tensor_parallel_shards_all_but_the_norms():
    L1, L4 = _layout(QWEN3_NEXT), _layout(QWEN3_NEXT + ["--tensor-model-parallel-size", "4"])
    rows1, rows4 = {r[0]: r for r in gdn.param_rows(L1)}, {r[0]: r for r in gdn.param_rows(L4)}
    for name, row in rows1.items():
        # the fused input norm and out_norm (over value_head_dim) are whole on each rank; the rest splits by heads
        # (_GDNBase.__init__: in_proj_dim / TP rows, conv_dim / TP channels, value heads / TP for dt_bias and A_log)
        assert rows4[name][1] == (row[1] if row[2] else row[1] // 4), name
        assert row[2] == ("layer_norm" in name or "out_norm" in name)


def _real(python: str, port: int) -> dict:
    if not os.path.exists(python):
        pytest.skip(f"no {python}")
    from test_mamba import run_e2e
    return run_e2e(python, "gdn_param_count.py",
                   dict(hidden_size=256, key_heads=2, value_heads=4, key_dim=32, value_dim=48, conv=4), port)


@pytest.mark.parametrize("version", ["0.16", "0.19"])
def test_parameters_match_megatron_cores_gated_delta_net(version):
    # GatedDeltaNet as megatron-core builds it on CPU (tests/e2e/gdn_param_count.py): names, sizes and order
    python = os.environ.get("MEMGUARD_PY311" if version == "0.16" else "MEMGUARD_PY312",
                            "/work/venv311/bin/python" if version == "0.16" else "/work/venv312/bin/python")
    real = _real(python, 29671 if version == "0.16" else 29672)
    L = _layout(version=version)
    mine = [(n.split("self_attention.", 1)[1], v) for n, v, *_ in gdn.param_rows(L) if "layer_norm" not in n]
    assert mine == list(real.items())
    # the whole GPT model: 6 GDN layers and 2 attention layers between embedding and output layer
    chunk = L.chunks[0]
    assert sum(p.numel for p in chunk_params(L, chunk)) == total_parameters(L)


def test_gdn_saved_tensors_by_hand():
    # one GDN mixer, TP 1, b 2, s 512: Tf = 1024 tokens; Hk 2 x dk 32, Hv 4 x dv 48; bf16
    L = _layout()
    saved = gdn.saved_items(L, set())
    Tf, e = 1024, 2
    in_proj = 2 * 64 + 2 * 192 + 2 * 4          # [q, k, v, z, beta, alpha] (gdn.py in_proj_split_sections)
    assert saved == {
        "norm1_stats": Tf * 4,                   # TE's fused RMSNorm: fp32 rstd per token
        "gdn_in_proj_input": Tf * 256 * e,
        # fla 0.4.2 CausalConv1dFunction saves x un-copied (no_guard_contiguous): the view keeps in_proj's output
        "gdn_in_proj_output": Tf * in_proj * e,
        # L2NormFunction.save_for_backward(y, rstd): [q, k] normed, fp32 rstd per key head of q and k
        "gdn_qk_l2norm": Tf * 128 * e + Tf * 4 * 4,
        # ChunkGatedDeltaRuleFunction.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, A, ...): q and k
        # repeated to the 4 value heads, v, the fp32 cumsum g, beta, A [T, H, 64] in k's dtype
        "gdn_q_k": 2 * Tf * 4 * 32 * e,
        "gdn_v": Tf * 192 * e,
        "gdn_gate": Tf * 192 * e,
        "gdn_beta": Tf * 4 * e,
        "gdn_decay_input": Tf * 4 * e,
        "gdn_kernel_g": Tf * 4 * 4,
        "gdn_kernel_A": Tf * 4 * 64 * e,
        "gdn_core_output": Tf * 192 * e,
        "gdn_out_norm_stats": Tf * 4 * 4,        # out_norm over value_head_dim: one rstd per token and head
        "gdn_out_norm_output": Tf * 192 * e,
        "gdn_out_proj_input": Tf * 192 * e,
    }
    # the layer adds its residual stream and the MLP half to the mixer
    la = layer_activations(L, True, GDN)
    assert {k: v for k, v in la.saved.items() if k in saved} == saved
    assert la.saved["layer_input"] == Tf * 256 * e


def test_megatron_016_gdn_keeps_the_conv_copy_and_eager_decay():
    # 0.16.1 ssm/gated_delta_net.py: causal_conv1d_fn gets qkv.transpose(1, 2).contiguous() (kept as its x), the
    # decay runs eagerly (softplus keeps its fp32 input, the product its fp32 output)
    saved = gdn.saved_items(_layout(version="0.16"), set())
    Tf = 1024
    assert "gdn_in_proj_output" not in saved and saved["gdn_conv_input"] == Tf * (64 + 64 + 192) * 2
    assert saved["gdn_decay_input"] == Tf * 4 * 8
    # Hv = Hk: the l2 norm outputs are the kernel's q and k (contiguous already): no second copy
    same = gdn.saved_items(_layout(["--linear-num-value-heads", "2"], version="0.16"), set())
    assert same["gdn_q_k"] == 0
    assert gdn.saved_items(_layout(["--linear-num-value-heads", "2"]), set())["gdn_q_k"] == 2 * Tf * 2 * 32 * 2


def test_gdn_norm_out_recompute_drops_the_norm_outputs():
    # TransformerConfig 0.19.2: "gdn_norm_out" checkpoints the gated norm (CheckpointWithoutOutput): its inputs o and
    # z stay, its internals and its output (out_proj's input) are made again in the backward
    plain = layer_activations(_layout(), True, GDN).saved
    L = _layout(["--recompute-granularity", "selective", "--recompute-modules", "gdn_norm_out"])
    rec = layer_activations(L, True, GDN).saved
    gone = {"gdn_out_norm_stats", "gdn_out_norm_output", "gdn_out_proj_input"}
    assert set(plain) - set(rec) == gone
    assert sum(plain.values()) - sum(rec.values()) == 1024 * 4 * 4 + 2 * 1024 * 192 * 2
    # the standard attention layers are untouched by it
    assert layer_activations(L, True, ATTN).saved == layer_activations(_layout(), True, ATTN).saved


def test_chunk_states_are_a_working_set_not_saved():
    # chunk_gated_delta_rule_fwd makes h [b, ceil(s/64), Hv, dk, dv] and does not save it (the backward recomputes)
    L = _layout()
    assert gdn._chunk_states(L) == 2 * 8 * 4 * 32 * 48 * 2
    la = layer_activations(L, True, GDN)
    assert la.fwd_transient >= gdn._chunk_states(L)


def test_tensor_and_context_parallel_divide_the_heads():
    L = _layout(["--tensor-model-parallel-size", "2", "--sequence-parallel"])
    saved = gdn.saved_items(L, set())
    assert saved["gdn_q_k"] == 2 * 1024 * 2 * 32 * 2          # 2 value heads per TP rank
    assert saved["gdn_in_proj_input"] == 512 * 256 * 2        # the sequence-parallel shard
    # CP 2 (0.19.2: an all-to-all of heads): per rank the same elements as half the tokens of all heads
    Lc = _layout(["--context-parallel-size", "2"])
    assert gdn.saved_items(Lc, set())["gdn_v"] == 512 * 192 * 2
    assert gdn._chunk_states(Lc) == 2 * 8 * 2 * 32 * 48 * 2   # the whole sequence, half the heads


def test_estimate_runs_and_names_gdn_terms():
    from megatron_memguard.gpus import lookup_gpu
    est = estimate(_layout(), gpu=lookup_gpu("H100"))
    L = est.layout
    # one micro-batch in flight (1F1B, PP 1): the held layers are 6 GDN layers and 2 attention layers
    held = 6 * layer_activations(L, True, GDN).total + 2 * layer_activations(L, True, ATTN).total
    assert est.stages[0].breakdown["layer_activations"] == held
    from megatron_memguard.report.text import layer_table
    table = layer_table(est)
    assert "one gdn layer" in table and "gdn_kernel_A" in table and "one attention layer" in table


@pytest.mark.parametrize("extra, key, rule", [
    (["--linear-num-value-heads", "3"], "--linear-num-value-heads", "multiple of --linear-num-key-heads"),
    (["--tensor-model-parallel-size", "4"], "--linear-num-key-heads", "tensor-model-parallel x context-parallel"),
    (["--linear-attention-freq", "0"], "--linear-attention-freq", "positive integer"),
    (["--linear-attention-freq", "([1]*3+[0])"], "--linear-attention-freq", "has 4 entries but --num-layers is 8"),
    (["--transformer-impl", "local"], "--transformer-impl", "must be transformer_engine"),
    (["--experimental-attention-variant", "linear"], "--experimental-attention-variant", "must be one of"),
])
def test_megatron_rules_name_the_flag(extra, key, rule):
    msg = _err(extra)
    assert msg.startswith(key + ":") and rule in msg and "\n" not in msg.strip()


def test_freq_is_required_and_gdn_norm_out_needs_the_variant():
    i = GPT.index("--linear-attention-freq")
    assert _err([], base=GPT[:i] + GPT[i + 2:]).startswith("--linear-attention-freq: must be set")
    assert "gdn_norm_out needs --experimental-attention-variant gated_delta_net" in _err(
        ["--recompute-granularity", "selective", "--recompute-modules", "gdn_norm_out"], base=GPT[:GPT.index(
            "--experimental-attention-variant")])


def test_megatron_016_rules():
    # 0.16.1 TransformerConfig: "Gated delta net does not support context parallel for now"; no gdn_norm_out
    assert "--context-parallel-size: must be 1 with gated delta net" in _err(["--context-parallel-size", "2"], "0.16")
    assert "gdn_norm_out is not a module of megatron-core 0.16" in _err(
        ["--recompute-granularity", "selective", "--recompute-modules", "gdn_norm_out"], "0.16")
    # and heads split over TP alone there
    assert "the tensor-model-parallel size (4)" in _err(["--tensor-model-parallel-size", "4"], "0.16")
    # 0.17.1 still refuses CP; 0.18.2 splits the heads over TP x CP (transformer_config.py of each release)
    assert "--context-parallel-size: must be 1" in _err(["--context-parallel-size", "2"], "0.17")
    assert _layout(["--context-parallel-size", "2"], "0.18").cp == 2
    assert "gdn_norm_out is not a module of megatron-core 0.18" in _err(
        ["--recompute-granularity", "selective", "--recompute-modules", "gdn_norm_out"], "0.18")
    # 0.18.2 runs fla's conv on a view of in_proj's output, as 0.19.2; 0.17.1 causal_conv1d on a copy, as 0.16.1
    assert "gdn_in_proj_output" in gdn.saved_items(_layout(version="0.18"), set())
    assert "gdn_conv_input" in gdn.saved_items(_layout(version="0.17"), set())


@pytest.mark.parametrize("extra, key", [
    (["--deterministic-mode"], "--deterministic-mode"),
])
def test_unmodelled_settings_are_refused_by_name(extra, key):
    with pytest.raises(NotModelledError) as e:
        _layout(extra)
    assert str(e.value).startswith(key) and "gated delta net" in str(e.value)


HYBRID = ("--hidden-size 256 --num-attention-heads 4 --seq-length 512 --max-position-embeddings 512 "
          "--micro-batch-size 2 --global-batch-size 16 --bf16 --disable-bias-linear --ffn-hidden-size 512 "
          "--position-embedding-type none --vocab-size 1024 --linear-num-key-heads 2 --linear-num-value-heads 4 "
          "--linear-key-head-dim 32 --linear-value-head-dim 48 --normalization RMSNorm").split()


def test_hybrid_g_layers_are_the_same_mixer():
    # hybrid_layer_specs.py (0.19.2): 'G' is a TransformerLayer with GatedDeltaNet and no MLP
    L = _layout(["--hybrid-layer-pattern", "G*G-"], base=HYBRID)
    assert layer_kinds(L)[0] == LayerKind("gdn", "none")
    g = layer_activations(L, True, LayerKind("gdn", "none")).saved
    assert {k: v for k, v in g.items() if k.startswith("gdn_")} == {
        k: v for k, v in gdn.saved_items(_layout(), set()).items() if k.startswith("gdn_")}
    assert "fc1_input" not in g
    names = [p.name for p in chunk_params(L, L.chunks[0])]
    assert "decoder.layers.0.self_attention.A_log" in names or any(n.endswith("self_attention.A_log") for n in names)
    # 0.16.1's Symbols.VALID has no 'G'
    assert "'G' is not a layer symbol in megatron-core 0.16" in _err(
        ["--hybrid-override-pattern", "G*G-", "--num-layers", "4"], "0.16", base=HYBRID)
    # context parallelism in a hybrid model (0.18+): the GDN heads split over TP x CP, as in a GPT model
    assert _layout(["--hybrid-layer-pattern", "G*G-", "--context-parallel-size", "2"], base=HYBRID).cp == 2
    # FP8: GatedDeltaNet's in_proj width rule (520 here), then every 'G' layer in the global FP8 context (HybridStack)
    assert _err(["--hybrid-layer-pattern", "G*G-", "--fp8-format", "hybrid"], base=HYBRID).startswith(
        "--linear-num-value-heads: with --fp8-format the gated delta net in_proj output width 520")
    q = _layout(["--hybrid-layer-pattern", "G*G-", "--fp8-format", "hybrid"] + FP8_HEADS, base=HYBRID)
    assert layer_kinds(q)[0] == LayerKind("gdn", "none", "delayed")
    # the heads split over TP there too (GatedDeltaNet divides them)
    assert _err(["--hybrid-layer-pattern", "G*G-", "--tensor-model-parallel-size", "4"], base=HYBRID).startswith(
        "--linear-num-key-heads")


def test_megatrons_own_parser_and_validate_args_resolve_like_the_flags(monkeypatch, capsys):
    # megatron-core 0.19.2's real parse_and_validate_args (Python 3.12 venv): la_freq_type turns the list expression
    # into a list, validate_args keeps the variant; memguard's hook resolves that namespace as it resolves the flags
    from conftest import container_era, validated_by_megatron
    if not container_era():
        pytest.skip("needs Python 3.12 with megatron-core >= 0.18 (megatron.training)")
    flags = [f for f in GPT if f != "--vocab-size" and f != "1024"] + [
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--lr", "1e-4", "--train-iters", "10",
        "--mock-data", "--linear-attention-freq", "([1]*3+[0]*1)*2"]
    hook, args = validated_by_megatron(monkeypatch, "pretrain_gpt.py", flags)
    capsys.readouterr()
    assert args.experimental_attention_variant == "gated_delta_net" and args.linear_attention_freq == [1, 1, 1, 0] * 2
    L = hook.STATE.decision.layout
    assert L.linear_attention_pattern == "11101110" == layout_from_flags(flags, world_size=8).linear_attention_pattern
    assert (L.linear_num_key_heads, L.linear_num_value_heads, L.linear_key_head_dim, L.linear_value_head_dim) == (
        2, 4, 32, 48)


def test_mtp_layer_is_the_standard_gpt_layer_on_019():
    # megatron/training 0.19.2 models/gpt.py mtp_block_spec: get_gpt_decoder_layer_specs(...)[-1], attention with the
    # last layer's MLP, even when the last decoder layer is a GDN layer
    from megatron_memguard.estimator.params import mtp_layer_kind
    L = _layout(["--mtp-num-layers", "1", "--linear-attention-freq", "([0]*1+[1]*7)"])
    assert layer_kinds(L)[-1] == GDN and mtp_layer_kind(L) == ATTN
    # the builders before 0.19 pass the block spec (its last layer): not read, refused by name
    with pytest.raises(NotModelledError) as e:
        _layout(["--mtp-num-layers", "1"], version="0.18")
    assert str(e.value).startswith("--mtp-num-layers") and "gated delta net" in str(e.value)


def test_freq_one_is_the_gpt_model_without_gdn_layers():
    # --linear-attention-freq 1: (i + 1) % 1 == 0 for every layer, all standard attention (get_linear_attention_pattern):
    # every number equals the model without the variant
    from megatron_memguard.gpus import lookup_gpu
    i = GPT.index("--experimental-attention-variant")
    plain = [f for f in GPT[:i]] + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                    "--pipeline-model-parallel-size", "2"]
    L = _layout(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
                 "--linear-attention-freq", "1"])
    assert L.linear_attention_pattern == "0" * 8 and set(layer_kinds(L)) == {ATTN}
    a, b = estimate(L, gpu=lookup_gpu("H100")), estimate(_layout(base=plain), gpu=lookup_gpu("H100"))
    assert [s.breakdown for s in a.stages] == [s.breakdown for s in b.stages]


def test_layout_document_round_trips_and_omits_the_defaults():
    from megatron_memguard.layout import Layout
    L = _layout(["--linear-num-key-heads", "4", "--linear-num-value-heads", "8"])
    d = L.to_dict()
    assert d["linear_attention_pattern"] == "11101110" and "linear_conv_kernel_dim" not in d   # (4: the default)
    assert Layout.from_dict(d) == L
    # a model without GDN layers writes none of the fields (its document reads as before)
    i = GPT.index("--experimental-attention-variant")
    assert not any(k.startswith("linear_") for k in _layout(base=GPT[:i]).to_dict())


# ----- CUDA graphs, activation offloading and LoRA / DoRA of GDN layers -------------------------------------------

def _terms(extra):
    from megatron_memguard.gpus import lookup_gpu
    return estimate(_layout(extra), gpu=lookup_gpu("H100")).stages[0].breakdown


def test_cuda_graphs_take_gdn_layers_as_attention_layers():
    # _layer_is_graphable (transformer/cuda_graphs.py, core 0.16.1 and 0.19.2): a GDN layer is a TransformerLayer
    # whose self_attention (GatedDeltaNet) is no IdentityOp, so 'attn' (or no modules) graphs it, 'mlp' its dense MLP;
    # TransformerLayer.get_layer_static_inputs gives it the bool causal mask [b, 1, s/CP, s] when attention is graphed.
    # GPT: 8 layers (6 GDN, 2 attention), b 2, s 512, h 256, PP 1 (one sample set): static input + grad-output
    # [s b, h] bf16 = 2 x 1024 x 256 x 2 B each
    io = 2 * 1024 * 256 * 2
    mask = 2 * 512 * 512
    assert _terms(["--cuda-graph-impl", "transformer_engine"])["cuda_graph_static_io"] == 8 * (io + mask)
    assert _terms(["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "mlp"])["cuda_graph_static_io"] \
        == 8 * io
    # the local implementation's runners keep no mask (CudaGraphManager records the layer's own inputs)
    local = _terms(["--cuda-graph-impl", "local"])
    assert local["cuda_graph_static_io"] == 8 * io
    # the pool keeps the working memory of the largest graphed layer, a GDN or an attention layer's
    L = _layout()
    region = max(max(la.fwd_transient, la.bwd_transient) for la in
                 (layer_activations(L, True, GDN), layer_activations(L, True, ATTN)))
    assert local["cuda_graph_pool"] == region


def test_layer_level_offloading_moves_the_bottom_gdn_layers():
    # TE's cpu_offload context (TransformerBlock, PP 1) offloads every tensor saved inside layers 0..N-1 through
    # saved_tensors_hooks, flash-linear-attention's autograd functions included: layers 0-2 are GDN layers
    L = _layout()
    base = _terms([])["layer_activations"]
    assert _terms(["--cpu-offloading-num-layers", "3"])["layer_activations"] == \
        base - 3 * layer_activations(L, True, GDN).total
    # layer 3 is the first attention layer: the fourth layer offloaded is one of its kind
    assert _terms(["--cpu-offloading-num-layers", "4"])["layer_activations"] == \
        base - 3 * layer_activations(L, True, GDN).total - layer_activations(L, True, ATTN).total


def test_fine_grained_offloading_leaves_the_gdn_mixer_on_the_gpu():
    # core 0.19.2: a GDN layer's input_layernorm is IdentityOp (the norm fused into in_proj), which
    # _set_offload_modules skips for attn_norm, and GatedDeltaNet opens no offload group (qkv_linear, core_attn and
    # attn_proj wrap SelfAttention's calls): only the two attention layers offload; the top layer's (an attention
    # layer's) last group, core_attn, stays on the last stage
    L = _layout()
    a = layer_activations(L, True, ATTN).saved
    qkv = a["layer_input"] + a["qkv_input"]                      # saved inside linear_qkv's call (norm fused)
    core = a["query_rope"] + a["key_rope"] + a["qkv_output"] + a["softmax_stats"] + a["proj_input"]
    on = ["--fine-grained-activation-offloading", "--offload-modules", "qkv_linear", "core_attn",
          "--min-offloaded-tensor-size", "0"]
    assert _terms([])["layer_activations"] - _terms(on)["layer_activations"] == 2 * (qkv + core) - core


def _peft_args(**extra):
    args = dict(num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=512, max_position_embeddings=512,
                micro_batch_size=2, global_batch_size=16, bf16=True, normalization="RMSNorm", swiglu=True,
                add_bias_linear=False, ffn_hidden_size=512, position_embedding_type="rope", vocab_size=1024,
                tokenizer_type="NullTokenizer", experimental_attention_variant="gated_delta_net",
                linear_attention_freq=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                linear_value_head_dim=48, peft_scheme="lora")
    return dict(args, **extra)


def _peft(**extra):
    from megatron_memguard.config import RawConfig
    from megatron_memguard.resolve import resolve
    return resolve(RawConfig(args=_peft_args(**extra), world_size=1))


def test_lora_wraps_the_attention_layers_and_every_mlp_not_the_gdn_mixer():
    # Megatron-Bridge 0.6.2 matches target_modules by the module's own name (peft/module_matcher.py): a GDN layer's
    # in_proj / out_proj are none of linear_qkv, linear_proj, linear_fc1, linear_fc2; its MLP's fc1 / fc2 are
    from megatron_memguard.estimator.peft import adapter_param_count
    L = _peft()
    # LoRA rank 32 (Bridge's default), (in + out) x r per target: attention layer qkv (256 + 768), proj (256 + 256),
    # fc1 (256 + 1024: SwiGLU), fc2 (512 + 256); a GDN layer fc1 and fc2 only. 2 attention and 6 GDN layers
    assert adapter_param_count(L) == 2 * 32 * (1024 + 512 + 1280 + 768) + 6 * 32 * (1280 + 768) == 622_592
    # the frozen mixer: in_proj (TE LayerNormLinear, weight.requires_grad False) keeps no norm output and out_proj no
    # input; the conv's input (in_proj's whole output in 0.19.2), the kernel's and the gated norm's tensors stay
    frozen = layer_activations(L, True, GDN).saved
    full = layer_activations(_layout(), True, GDN).saved
    assert "gdn_in_proj_input" not in frozen and "gdn_out_proj_input" not in frozen
    assert frozen["gdn_in_proj_output"] == full["gdn_in_proj_output"] and frozen["gdn_kernel_A"] == full["gdn_kernel_A"]


def test_lora_rules_on_gdn_models_name_the_key():
    # every layer GDN and only attention targets: nothing to train
    with pytest.raises((ConfigError, ConfigErrors), match="wraps no linear: every layer is a gated delta net layer"):
        _peft(linear_attention_freq="([1]*8)", peft_target_modules=["linear_qkv", "linear_proj"])
    # '*' patterns and exclude_modules match full names, where Bridge would wrap in_proj / out_proj (TE linears)
    with pytest.raises(NotModelledError, match="'\\*' target patterns on a model with gated delta net"):
        _peft(peft_target_modules=["*.linear_qkv"])
    with pytest.raises(NotModelledError, match="in_proj / out_proj wrapped"):
        _peft(peft_target_modules=[], peft_exclude_modules=["output_layer"])
    L = _peft(peft_target_modules=[], peft_exclude_modules=["output_layer", "in_proj", "out_proj"])
    assert L.peft.target_modules == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


# ----- FP8 / FP4 -------------------------------------------------------------------------------------------------

# in_proj width 2 Hk dk + 2 Hv dv + 2 Hv = 2 x 2 x 32 + 2 x 16 x 32 + 2 x 16 = 1184 (= 37 x 32), out_proj's input 512
FP8_HEADS = ["--linear-num-value-heads", "16", "--linear-value-head-dim", "32"]
TENSORWISE = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"] + FP8_HEADS


def test_fp8_quantizes_in_proj_and_out_proj_only():
    # get_gated_delta_net_module_spec: in_proj TELayerNormColumnParallelLinear, out_proj TERowParallelLinear run under
    # the layer's fp8_autocast; conv1d (nn.Conv1d), the l2 norms, the chunked delta rule (fla Triton) and the gated
    # norm's multiply are outside TE and stay BF16. GatedDeltaNet sets no save_original_input: both keep quantized
    # inputs. Tensorwise on Hopper, TP 1, Tf = 1024 tokens: 1-byte data + the fp32 scale's 512-byte block
    from megatron_memguard.partition import LayerKind
    bf16 = layer_activations(_layout(FP8_HEADS), True, GDN)
    fp8 = layer_activations(_layout(TENSORWISE), True, LayerKind("gdn", "dense", "tensorwise"))
    assert fp8.saved["gdn_in_proj_input"] == 1024 * 256 + 512
    assert fp8.saved["gdn_out_proj_input"] == 1024 * 512 + 512
    changed = {k for k in bf16.saved if bf16.saved[k] != fp8.saved.get(k)}
    assert changed == {"gdn_in_proj_input", "gdn_out_proj_input", "fc1_input", "fc2_input"}
    # backward: out_proj and in_proj quantize their output gradients (row-wise and the Hopper transpose) next to the
    # BF16 ones: [Tf, h] at out_proj's step, [Tf, 1184] at in_proj's
    extra = [f - b for (_, f), (_, b) in zip(fp8.bwd_steps, bf16.bwd_steps)]
    assert 1024 * 256 * 2 + 512 in extra and 1024 * 1184 * 2 + 512 in extra


def test_fp8_weight_cache_counts_the_gdn_gemms():
    # TE caches each BF16 weight's FP8 copy, data + transpose on Hopper (2 B / element) + one fp32 scale (a 512-byte
    # block). GDN layer: in_proj [1184, 256], out_proj [256, 512], fc1 [1024, 256] (SwiGLU), fc2 [256, 512];
    # attention layer: qkv [768, 256], proj [256, 256], fc1, fc2. 6 GDN and 2 attention layers, 32 GEMMs
    gdn_w = 1184 * 256 + 256 * 512 + 1024 * 256 + 256 * 512
    attn_w = 768 * 256 + 256 * 256 + 1024 * 256 + 256 * 512
    assert _terms(TENSORWISE)["fp8_weight_cache"] == 2 * (6 * gdn_w + 2 * attn_w) + 32 * 512


@pytest.mark.parametrize("recipe, align", [("tensorwise", 16), ("mxfp8", 32)])
def test_fp8_in_proj_width_rule_names_the_flag(recipe, align):
    # _GDNBase.__init__ (core 0.19.2; 0.16.1 the same): in_proj_dim % get_fp8_align_size(recipe) == 0 under FP8;
    # the base shape's width is 2 x 2 x 32 + 2 x 4 x 48 + 2 x 4 = 520
    msg = _err(["--fp8-format", "hybrid", "--fp8-recipe", recipe])
    assert msg.startswith("--linear-num-value-heads:") and "width 520" in msg and f"multiple of {align}" in msg


def test_fp8_end_layers_in_bf16_stay_bf16():
    # --first-last-layers-bf16: TransformerBlock builds the first and last layers outside the FP8 context, GDN or not
    from megatron_memguard.partition import model_kind_runs
    L = _layout(TENSORWISE + ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "1",
                              "--num-layers-at-end-in-bf16", "1"])
    q = [(k.mixer, k.quantized) for k, n in model_kind_runs(L) for _ in range(n)]
    assert q[0] == ("gdn", None) and q[-1] == ("attention", None)
    assert all(r == "tensorwise" for _, r in q[1:-1])


def test_heterogeneous_blocks_are_whole_gdn_and_attention_layers():
    # megatron/training 0.19.2 models/gpt.py default_layer_spec takes the experimental variant's block spec before the
    # heterogeneous one: layers 0 and 2 are GDN layers, 1 and 3 attention layers (--linear-attention-freq 2), each
    # with a dense MLP; get_config_for_layer still sets each layer's ffn_hidden_size (block 1: 512; the no-op MLP of
    # block 2 and block 3: the model's 1024) and num_query_groups (2 here, the model's)
    from test_heterogeneous import BLOCKS, FLAGS
    gdn_flags = ("--transformer-impl transformer_engine --experimental-attention-variant gated_delta_net "
                 "--linear-attention-freq 2 --linear-num-key-heads 2 --linear-num-value-heads 4 "
                 "--linear-key-head-dim 32 --linear-value-head-dim 48").split()
    flags = FLAGS + ["--heterogeneous-layers-config-path", BLOCKS] + gdn_flags
    L = layout_from_flags(flags, world_size=1)
    assert [k.mixer + "/" + k.mlp for k in layer_kinds(L)] == ["gdn/dense", "attention/dense:512", "gdn/dense",
                                                               "attention/dense"]
    assert any("built as full GDN / attention and MLP layers" in n for n in L.notes)
    # by hand (h 512, RMSNorm, no biases): attention = fused input norm + linear_qkv (8 + 2 x 2 heads of 64) +
    # linear_proj; dense(F) = fused pre-MLP norm + fc1 [2F, h] + fc2 [h, F]; GDN = dt_bias, A_log (4 each) + fused
    # norm + in_proj [2 x 64 + 2 x 192 + 8, 512] + conv [320, 1, 4] + out_norm 48 + out_proj [512, 192]
    attn = 512 + 768 * 512 + 512 * 512
    dense = lambda F: 512 + 3 * F * 512                     # noqa: E731
    g = 8 + 512 + 520 * 512 + 320 * 4 + 48 + 512 * 192
    expected = 2 * g + 2 * attn + 3 * dense(1024) + dense(512) + 2 * 1024 * 512 + 512   # + untied embedding, output, norm
    assert total_parameters(L) == estimate(L).stages[0].parameters == expected == 8_600_688
    # the builders before 0.19 (Megatron-LM's gpt_builders.py) are in no wheel: refused by name
    with pytest.raises(NotModelledError, match="--heterogeneous-layers-config-path: a heterogeneous config with gated"):
        layout_from_flags(flags, world_size=1, megatron_version="0.18")
