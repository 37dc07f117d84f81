"""Heterogeneous layer configs (--heterogeneous-layers-config-path): Megatron's rules as one-line errors
naming the flag, each layer's parameters as megatron-core builds them (counted by hand and checked against
megatron-core 0.19.2's HeterogeneousTransformerConfig + get_gpt_heterogeneous_layer_spec on CPU, and the
CPU referee's measurement of megatron-core 0.16.1 training steps)."""
import json
import os

import pytest

from build_util import run_script   # tests/e2e scripts through a fork server (torch and megatron imported once)

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.estimator.params import chunk_params, total_parameters
from megatron_memguard.partition import layer_kinds, partition_layers
from megatron_memguard.resolve.heterogeneous import ffn_mult_to_size

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCKS = os.path.join(HERE, "data", "heterogeneous", "small_blocks.json")
LINEAR = os.path.join(HERE, "data", "heterogeneous", "linear_blocks.json")   # replace_with_linear blocks
# The flags validate_model_config_args_from_heterogeneous_config (0.19.2) wants for small_blocks.json
FLAGS = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
         "--ffn-hidden-size 1024 --swiglu --normalization RMSNorm --position-embedding-type rope --use-rope-scaling "
         "--use-rotary-position-embeddings --rotary-base 500000 --untie-embeddings-and-output-weights "
         "--disable-bias-linear --seq-length 256 --max-position-embeddings 256 --micro-batch-size 2 --bf16 "
         "--hidden-dropout 0 --attention-dropout 0 --tokenizer-type NullTokenizer --vocab-size 1024 "
         "--transformer-impl local --global-batch-size 4").split()


def _layout(extra=(), path=BLOCKS, world=1, **kw):
    return layout_from_flags(FLAGS + ["--heterogeneous-layers-config-path", path] + list(extra), world_size=world, **kw)


def _err(flags, world=1):
    with pytest.raises((ConfigError, ConfigErrors, NotModelledError)) as e:
        layout_from_flags(flags, world_size=world)
    return str(e.value)


def _write(tmp_path, change):
    with open(BLOCKS) as fh:
        doc = json.load(fh)
    change(doc)
    p = tmp_path / "blocks.json"
    p.write_text(json.dumps(doc))
    return str(p)


def test_ffn_mult():
    # MLPConfig.ffn_mult_to_intermediate_size: int(2 x 2.625 x 512 / 3) = 896 -> next multiple of 256 = 1024;
    # 1.3125 -> 448 -> 512; Llama-3.3-Nemotron-Super-49B's hidden 8192 with ffn_mult 5.25 -> 28672
    assert ffn_mult_to_size(2.625, 512) == 1024
    assert ffn_mult_to_size(1.3125, 512) == 512
    assert ffn_mult_to_size(5.25, 8192) == 28672


def test_parameters_per_block():
    # block 0: attention (8 heads, n_heads_in_group 4 -> 2 query groups of head dim 64) + MLP 1024;
    # block 1: no-op attention + MLP 512; block 2: attention + no-op MLP; block 3: both no-op.
    # Hand count (local spec, RMSNorm, no biases, h 512): input norm 512, linear_qkv (512 + 2 x 2 x 64) x 512,
    # linear_proj 512 x 512, pre-MLP norm 512, fc1 2F x 512, fc2 512 x F.
    attn = 512 + 768 * 512 + 512 * 512
    mlp = lambda F: 512 + 2 * F * 512 + 512 * F  # noqa: E731
    L = _layout()
    assert [k.mixer + "/" + k.mlp for k in layer_kinds(L)] == ["attention/dense", "none/dense:512", "attention/none",
                                                               "none/none"]
    embedding = output = 1024 * 512     # NullTokenizer 1024 (core 0.19: no extra token), divisible by 128
    expected = attn + mlp(1024) + mlp(512) + attn + embedding + output + 512
    assert total_parameters(L) == expected == 4_721_152
    # the names and sizes megatron-core 0.19.2 builds for this config on CPU (HeterogeneousTransformerConfig,
    # get_gpt_heterogeneous_layer_spec(use_te=False), GPTModel.named_parameters())
    names = [(p.name, p.numel) for p in chunk_params(L, partition_layers(L)[0])]
    assert names[1:8] == [("decoder.layers.0.input_layernorm.weight", 512),
                          ("decoder.layers.0.self_attention.linear_proj.weight", 262144),
                          ("decoder.layers.0.self_attention.linear_qkv.weight", 393216),
                          ("decoder.layers.0.pre_mlp_layernorm.weight", 512),
                          ("decoder.layers.0.mlp.linear_fc1.weight", 1048576),
                          ("decoder.layers.0.mlp.linear_fc2.weight", 524288),
                          ("decoder.layers.1.pre_mlp_layernorm.weight", 512)]
    assert not any(n.startswith("decoder.layers.3.") for n, _ in names)
    assert estimate(L).stages[0].parameters == expected


def test_linear_replacements():
    # replace_with_linear (linear_replacements.py): the layer's norm and one column-parallel [h, h] weight,
    # no bias (--disable-bias-linear). Blocks: attention + MLP 1024, linear + MLP 512, attention + linear,
    # linear + linear.
    attn, lin = 512 + 768 * 512 + 512 * 512, 512 + 512 * 512
    mlp = lambda F: 512 + 2 * F * 512 + 512 * F  # noqa: E731
    L = _layout(path=LINEAR)
    assert [k.mixer + "/" + k.mlp for k in layer_kinds(L)] == ["attention/dense", "linear/dense:512",
                                                               "attention/linear", "linear/linear"]
    expected = attn + mlp(1024) + lin + mlp(512) + attn + lin + 2 * lin + 2 * 1024 * 512 + 512
    assert total_parameters(L) == expected == 5_771_776
    names = {p.name: p.numel for p in chunk_params(L, partition_layers(L)[0])}
    assert names["decoder.layers.1.self_attention.weight"] == names["decoder.layers.2.mlp.weight"] == 512 * 512
    # TP 2: the weight's output rows split (ColumnParallelLinear), the norm replicated
    L2 = _layout(path=LINEAR, extra=["--tensor-model-parallel-size", "2"], world=2)
    names2 = {p.name: p.numel for p in chunk_params(L2, partition_layers(L2)[0])}
    assert names2["decoder.layers.1.self_attention.weight"] == 256 * 512
    # the linear keeps its input only: the norm output [s b, h] bf16 (and the norm its input and rstd)
    saved = layer_activations(L, True, layer_kinds(L)[3]).saved
    assert saved["qkv_input"] == saved["fc1_input"] == 512 * 512 * 2


def test_noop_halves_keep_nothing():
    L = _layout()
    kinds = layer_kinds(L)
    full = layer_activations(L, True, kinds[0]).saved
    # no-op attention: no input norm tensors, no q/k/v; the pre-MLP norm keeps the layer input itself
    no_attn = layer_activations(L, True, kinds[1]).saved
    assert "layer_input" not in no_attn and "qkv_input" not in no_attn and no_attn["mlp_norm_input"] == 512 * 512 * 2
    # its MLP is 512 wide: fc1's output [s b, 2 x 512] bf16
    assert no_attn["fc1_output"] == 512 * 1024 * 2
    # no-op MLP: the attention's tensors only
    no_mlp = layer_activations(L, True, kinds[2]).saved
    assert set(no_mlp) == {k for k in full if k not in ("mlp_norm_input", "norm2_stats", "fc1_input", "fc1_output",
                                                        "activation_gate", "activation_linear", "fc2_input")}
    assert layer_activations(L, True, kinds[3]).total == 0


def test_rules(tmp_path):
    key = "--heterogeneous-layers-config-path"
    # validate_model_config_args_from_heterogeneous_config: the flags must agree with the JSON
    assert "num_query_groups: 4 (provided) != 2 (expected)" in _err(
        [f if f != "2" else "4" for f in FLAGS] + [key, BLOCKS])
    assert "should be silu" in _err(FLAGS + [key, _write(tmp_path, lambda d: d.update(hidden_act="gelu"))])
    bad = _write(tmp_path, lambda d: d["block_configs"][0]["attention"].update(n_heads_in_group=3))
    assert "n_heads_in_group" in _err(FLAGS + [key, bad])
    # validate_model_config_args_from_heterogeneous_config indexes every block's n_heads_in_group (0.19.2), even where
    # num_query_groups sets the block's groups (which AttentionConfig reads then)
    missing = _write(tmp_path, lambda d: d["block_configs"][0].update(attention={"num_query_groups": 2}))
    assert "every block's attention needs n_heads_in_group" in _err(FLAGS + [key, missing])
    fewer = _write(tmp_path, lambda d: d.update(block_configs=d["block_configs"][:3]))
    assert "3 block_configs for 4 layers" in _err(FLAGS + [key, fewer])
    # a linear replacement under sequence parallelism: megatron-core's gather pads the wrong dimension and
    # the residual add fails (the CPU referee reproduces it)
    assert "replace_with_linear fails with --sequence-parallel" in _err(
        FLAGS + [key, LINEAR, "--tensor-model-parallel-size", "2", "--sequence-parallel"], world=2)
    # the encoded JSON alone is checked but builds uniform layers (argument_utils picks the heterogeneous
    # config class on the path only)
    with open(BLOCKS) as fh:
        text = fh.read()
    L = layout_from_flags(FLAGS + ["--heterogeneous-layers-config-encoded-json", text], world_size=1)
    assert L.heterogeneous_layers is None and total_parameters(L) > 4_721_152
    assert any("builds uniform layers" in n for n in L.notes)
    # from a config object (Bridge / NeMo key) the class is not known: refused by name
    from megatron_memguard.config import RawConfig
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    from megatron_memguard.resolve import resolve
    raw = parse_megatron_flags(FLAGS)
    raw = RawConfig(args={**raw.args, "heterogeneous_layers_config_encoded_json": text},
                    origin={**raw.origin, "heterogeneous_layers_config_encoded_json":
                            "model.heterogeneous_layers_config_encoded_json"}, source="Megatron-Bridge test")
    with pytest.raises(NotModelledError, match="model.heterogeneous_layers_config_encoded_json"):
        resolve(raw, world_size=1)


@pytest.mark.parametrize("blocks, world, peak_bound", [(BLOCKS, 1, 0.03), (LINEAR, 2, 0.03)], ids=["noop", "linear-tp2"])
def test_referee_measures_the_heterogeneous_model(blocks, world, peak_bound):
    pytest.importorskip("megatron.core")
    from benchmarks.referee.compare import compare_entry
    from benchmarks.referee.grids.dense import COMMON, resolve_config
    from benchmarks.referee.run import run_referee, unsupported_reason
    if unsupported_reason():
        pytest.skip(unsupported_reason())
    flags = COMMON + [f for f in FLAGS if f not in ("--tokenizer-type", "NullTokenizer", "--transformer-impl", "local")] \
        + ["--heterogeneous-layers-config-path", blocks] + (["--tensor-model-parallel-size", "2"] if world == 2 else [])
    _, settings = resolve_config(flags, world)
    settings["heterogeneous_layers_config_path"] = blocks
    settings["no_persist_layer_norm"] = True
    rows = compare_entry({"name": "het", "flags": flags, "world_size": world,
                          "ranks": run_referee(settings, world_size=world, timeout=600)})
    # parameters and the state after the step exact; the peak within the referee's 3%, and never more than
    # 0.001% low: since each layer of a mixed chunk is composed over what the layers above keep, and unfused
    # attention's softmax step no longer holds the context's gradient, the no-op model is a few hundred bytes
    # low (-2e-6 of its peak on megatron-core 0.16.1; it was +0.45% with the chunk's largest working set)
    for row in rows:
        assert row.params_measured == row.params_predicted
        assert abs(row.after_err) < 0.001
        assert -1e-5 <= row.peak_err < peak_bound


@pytest.mark.parametrize("blocks", [BLOCKS, LINEAR], ids=["noop", "linear"])
def test_parameters_match_megatron_core_on_cpu(blocks):
    # megatron-core's own model of small_blocks.json, built on CPU (0.19.2 in the Python 3.12 venv, 0.16.1 in 3.11)
    real = _real_params(blocks)
    L = _layout(path=blocks)
    mine = {p.name: p.numel for p in chunk_params(L, partition_layers(L)[0])}
    assert mine == real


# A mixture of experts with small_blocks.json: 4 experts of 256, a shared expert of 384, MoE layers 0 and 2
MOE = ("--num-experts 4 --moe-ffn-hidden-size 256 --moe-router-topk 2 --moe-layer-freq [1,0,1,0] "
       "--moe-shared-expert-intermediate-size 384 --moe-token-dispatcher-type alltoall").split()
MOE_CFG = dict(experts=4, moe_ffn=256, topk=2, freq=[1, 0, 1, 0], shared_ffn=384)


def test_moe_layers_are_whole_layers():
    # megatron/training 0.19.2 models/gpt.py default_layer_spec takes get_gpt_decoder_block_spec before the
    # heterogeneous spec: every layer has attention and an MoE or dense MLP (--moe-layer-freq); each layer's
    # get_config_for_layer sets only ffn_hidden_size (num_query_groups: the same here), which a dense layer's MLP
    # takes and the experts do not (moe_ffn_hidden_size is set once in the model's config). Block 1 (no-op
    # attention, ffn 512) is a full attention + dense 512 layer; block 3 (both no-op) attention + dense 1024.
    attn = 512 + 768 * 512 + 512 * 512                     # input norm, linear_qkv, linear_proj
    dense = lambda F: 512 + 3 * F * 512                     # noqa: E731  pre-MLP norm, fc1 [2F, h], fc2 [h, F]
    moe = lambda ep: 512 + 4 * 512 + 4 // ep * 3 * 256 * 512 + 3 * 384 * 512   # noqa: E731  norm, router, experts, shared
    L = _layout(MOE)
    assert [k.mixer + "/" + k.mlp for k in layer_kinds(L)] == ["attention/moe", "attention/dense:512",
                                                               "attention/moe", "attention/dense"]
    expected = 4 * attn + 2 * moe(1) + dense(512) + dense(1024) + 2 * 1024 * 512 + 512
    assert total_parameters(L) == estimate(L).stages[0].parameters == expected == 10_363_392
    assert any("no-op and replace_with_linear blocks are built as full" in n for n in L.notes)
    # PP 2 x EP 2: stage 0 holds the embedding, layer 0 (2 of the 4 experts) and layer 1 (dense 512)
    L2 = _layout(MOE + ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"], world=4)
    assert estimate(L2).stages[0].parameters == 1024 * 512 + 2 * attn + moe(2) + dense(512) == 4_001_792


def test_moe_rules(tmp_path):
    key = "--heterogeneous-layers-config-path"
    # the 0.16 to 0.18 builders (Megatron-LM's gpt_builders.py) are not in the wheels read: refused there
    with pytest.raises(NotModelledError, match="mixture-of-experts layers in megatron-core 0.16.1"):
        _layout(MOE, megatron_version="0.16.1")
    # a dense layer's MLP splits its own width over TP: block 1's 512 at TP 3 (the flags' 1024 too)
    msg = _err(FLAGS + MOE + [key, BLOCKS, "--tensor-model-parallel-size", "3", "--sequence-parallel"], world=3)
    assert "block 1: the dense layer's ffn size 512 must be divisible by tensor-model-parallel size 3" in msg
    # a block's own num_query_groups follows the model's rules (TransformerConfig, the attention's head split)
    three = _write(tmp_path, lambda d: d["block_configs"][0]["attention"].update(num_query_groups=3))
    assert "block 0: num_query_groups 3 must divide num_attention_heads 8" in _err(FLAGS + MOE + [key, three])


def _own_groups(tmp_path, groups=(1, 8)):
    """small_blocks.json with block 0's attention of ``groups[0]`` query groups and block 2's of ``groups[1]``
    (AttentionConfig takes num_query_groups over n_heads_in_group, which the flags' check still reads)."""
    def change(d):
        d["block_configs"][0]["attention"]["num_query_groups"] = groups[0]
        d["block_configs"][2]["attention"]["num_query_groups"] = groups[1]
    return _write(tmp_path, change)


def test_own_query_groups_under_all_to_all_cp(tmp_path):
    # TE's all-to-all CP splits each layer's key / value heads over the a2a ranks (flash_attn_a2a_communicate,
    # TE 2.11 and 2.20.2: "The number of attention heads needs to be divisible by CP size!"): block 0's own single
    # query group (1 key head) cannot split over CP 2 while the flags' 2 groups can
    te = "--transformer-impl transformer_engine --attention-backend fused --context-parallel-size 2".split()
    path = _own_groups(tmp_path, groups=(1, 8))
    assert _layout(te, path=path, world=2).heterogeneous_layers is not None      # p2p: no head split
    msg = _err(FLAGS + te + ["--cp-comm-type", "a2a", "--heterogeneous-layers-config-path", path], world=2)
    assert "block 0: num_query_groups 1 gives 1 key/value head(s) per tensor-parallel rank" in msg
    assert "block 2" not in msg          # 8 groups split over 2 ranks
    assert _layout(te + ["--cp-comm-type", "a2a"], path=_own_groups(tmp_path, groups=(4, 8)), world=2)


def test_own_query_groups_per_layer(tmp_path):
    # get_config_for_layer gives a block's layer its own num_query_groups: linear_qkv [(heads + 2 g) x 64, 512]
    # (heads 8, head dim 64): block 0 with 1 group (640 x 512), block 2 with 8 (1536 x 512), against the flags' 2
    # (768 x 512)
    path = _own_groups(tmp_path)
    L = _layout(path=path)
    assert [k.label for k in layer_kinds(L)] == ["attention:g1+dense", "none+dense:512", "attention:g8+none",
                                                 "none+none"]
    base = _layout()
    assert total_parameters(L) - total_parameters(base) == (640 - 768) * 512 + (1536 - 768) * 512 == 327_680
    names = {p.name: p.numel for p in chunk_params(L, partition_layers(L)[0])}
    assert names["decoder.layers.0.self_attention.linear_qkv.weight"] == 640 * 512
    assert names["decoder.layers.2.self_attention.linear_qkv.weight"] == 1536 * 512
    # the activations under TE's fused attention (seq 256 x MBS 2 = 512 tokens, bf16): linear_qkv's output
    # [tokens, (8 + 2 g) x 64] that the fused kernel reads, and the rotated key copy [tokens, g x 64]
    # (apply_rotary_pos_emb, unfused rope): block 0 keeps (2 - 1) x (2 + 1) x 64 x 512 x 2 = 196,608 bytes less than
    # with the flags' 2 groups, block 2 (8 - 2) x (2 + 1) x 64 x 512 x 2 = 1,179,648 more
    te = ["--transformer-impl", "transformer_engine", "--attention-backend", "fused"]
    L, base = _layout(te, path=path), _layout(te)
    acts = lambda X, i: layer_activations(X, True, layer_kinds(X)[i])   # noqa: E731
    assert acts(base, 0).total - acts(L, 0).total == 196_608
    assert acts(L, 2).total - acts(base, 2).total == 1_179_648
    assert acts(L, 2).saved["qkv_output"] == 512 * (8 + 2 * 8) * 64 * 2 == 1_572_864
    assert estimate(L).stages[0].parameters == total_parameters(L)


def test_referee_measures_own_query_groups(tmp_path):
    # the CPU referee (megatron-core's own training step) on small_blocks.json with block 0's attention of 1 query
    # group and block 2's of 8: parameters and the state after the step exact, the peak (block 2's unfused softmax
    # backward) within 256 B (before +1.7%: linear_qkv's output and the context's gradient counted there, both freed
    # by the bmm's backward; stored on both cores: tests/test_referee_replay.py, het_own_query_groups)
    pytest.importorskip("megatron.core")
    from benchmarks.referee.compare import compare_entry
    from benchmarks.referee.grids.dense import COMMON, resolve_config
    from benchmarks.referee.run import run_referee, unsupported_reason
    if unsupported_reason():
        pytest.skip(unsupported_reason())
    path = _own_groups(tmp_path)
    flags = COMMON + [f for f in FLAGS if f not in ("--tokenizer-type", "NullTokenizer", "--transformer-impl", "local")] \
        + ["--heterogeneous-layers-config-path", path]
    _, settings = resolve_config(flags, 1)
    settings["heterogeneous_layers_config_path"] = path
    settings["no_persist_layer_norm"] = True
    rows = compare_entry({"name": "het-groups", "flags": flags, "world_size": 1,
                          "ranks": run_referee(settings, world_size=1, timeout=600)})
    for row in rows:
        assert row.params_measured == row.params_predicted
        assert abs(row.after_err) < 0.001
        assert abs(row.peak_measured - row.peak_predicted) < 256, (row.peak_measured, row.peak_predicted)


def test_own_query_groups_match_megatron_core_on_cpu(tmp_path):
    # megatron-core's own model (get_config_for_layer per layer) of the same config, dense and with MoE layers
    path = _own_groups(tmp_path)
    L = _layout(path=path)
    assert {p.name: p.numel for p in chunk_params(L, partition_layers(L)[0])} == _real_params(path)
    M = _layout(MOE, path=path)
    assert {p.name: p.numel for p in chunk_params(M, partition_layers(M)[0])} == _real_params(path, **MOE_CFG)


def _megatron_core_at_least(version: str) -> bool:
    from importlib import metadata
    from packaging.version import Version
    return Version(metadata.version("megatron-core")) >= Version(version)


def _free_port() -> int:
    import socket
    with socket.socket() as sock:     # a port no other run on this machine holds now
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _real_params(blocks, **cfg):
    """{name: numel} of megatron-core's own model (tests/e2e/heterogeneous_param_count.py), built on CPU."""
    import sys
    pytest.importorskip("megatron.core.transformer.heterogeneous.heterogeneous_config")
    cfg = dict(num_layers=4, hidden_size=512, heads=8, groups=2, ffn=1024, vocab=1024, seq=256, **cfg)
    out = run_script([sys.executable, os.path.join(HERE, "e2e", "heterogeneous_param_count.py"), blocks,
                      json.dumps(cfg)], timeout=300, cwd=os.path.dirname(HERE),
                     env={**os.environ, "MASTER_PORT": str(_free_port())})
    assert out.returncode == 0, out.stderr[-2000:]
    # the MTP depth's transformer layer: "transformer_layer" up to core 0.16, "mtp_model_layer" from 0.17 (one name
    # in memguard)
    return {k.replace(".mtp_model_layer.", ".transformer_layer."): v
            for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def test_moe_parameters_match_megatron_core_on_cpu():
    # megatron-core's own MoE model of small_blocks.json (get_gpt_decoder_block_spec with the
    # HeterogeneousTransformerConfig, as megatron/training 0.19.2 builds it), on CPU
    real = _real_params(BLOCKS, **MOE_CFG)
    L = _layout(MOE)
    assert {p.name: p.numel for p in chunk_params(L, partition_layers(L)[0])} == real


def test_mtp_layer_is_the_flags_layer():
    # megatron/training 0.19.2 models/gpt.py mtp_block_spec: get_gpt_decoder_layer_specs(config)[-1] (the MoE / dense
    # spec, not the heterogeneous one), built with the model's config: block 3 (both halves no-op) does not make the
    # MTP layer empty. One depth: enorm, hnorm, eh_proj [h, 2h], attention (input norm, qkv, proj), pre-MLP norm,
    # the flags' dense MLP (1024) or, with the last layer MoE, the MoE MLP, and its final norm
    attn = 512 + 768 * 512 + 512 * 512
    head = 3 * 512 + 512 * 1024
    L = _layout(["--mtp-num-layers", "1"])
    mtp = {p.name: p.numel for p in chunk_params(L, partition_layers(L)[0]) if p.name.startswith("mtp.")}
    assert sum(mtp.values()) == head + attn + 512 + 3 * 1024 * 512 == 2_755_072
    assert total_parameters(L) == 4_721_152 + 2_755_072
    freq = ["--moe-layer-freq", "[0,1,0,1]"]
    M = _layout(MOE[:6] + freq + MOE[8:] + ["--mtp-num-layers", "1"])
    mtp = {p.name: p.numel for p in chunk_params(M, partition_layers(M)[0]) if p.name.startswith("mtp.")}
    moe = 512 + 4 * 512 + 4 * 3 * 256 * 512 + 3 * 384 * 512
    assert sum(mtp.values()) == head + attn + moe
    # before 0.19 the builders (Megatron-LM's gpt_builders.py) were not read: refused by name
    with pytest.raises(NotModelledError, match="multi-token prediction in megatron-core 0.18.2"):
        _layout(["--mtp-num-layers", "1"], megatron_version="0.18.2")


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_mtp_parameters_match_megatron_core_on_cpu(moe):
    cfg = dict(MOE_CFG, freq=[0, 1, 0, 1]) if moe else {}
    real = _real_params(BLOCKS, mtp=1, **cfg)
    flags = (MOE[:6] + ["--moe-layer-freq", "[0,1,0,1]"] + MOE[8:] if moe else []) + ["--mtp-num-layers", "1"]
    L = _layout(flags)
    assert {p.name: p.numel for p in chunk_params(L, partition_layers(L)[0])} == real


def _terms(L, gpu):
    from megatron_memguard.gpus import lookup_gpu
    return {t.name: t for t in estimate(L, gpu=lookup_gpu(gpu)).stages[0].terms}


def test_fp8_per_layer(tmp_path):
    # TransformerBlock builds each layer in get_fp8_context(layer_config, global index) (0.16.1 and 0.19.2): the TE
    # GEMMs of small_blocks.json are its blocks' own. Weight elements by hand: layer 0 qkv 768 x 512 + proj 512 x 512
    # + fc1 2048 x 512 + fc2 512 x 1024 = 2,228,224; layer 1 (no-op attention, MLP 512) fc1 1024 x 512 + fc2 512 x 512
    # = 786,432; layer 2 (no-op MLP) 655,360; layer 3 none
    te = [f if f != "local" else "transformer_engine" for f in FLAGS]
    L = layout_from_flags(te + ["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8", "--heterogeneous-layers-config-path",
                                BLOCKS], world_size=1)
    assert [k.quantized for k in layer_kinds(L)] == ["mxfp8"] * 4
    cache = _terms(L, "B200")["fp8_weight_cache"]
    # MXFP8 (TE 2.11 MXFP8Quantizer): row-wise and column-wise data, 1 byte each, and one E8M0 scale per 32 elements
    # each way
    n = 2_228_224 + 786_432 + 655_360
    assert "3,670,016 GEMM weight elements of 3 FP8 layers" in cache.detail
    assert cache.bytes == 2 * n + 2 * n // 32 == 7_569_408
    # get_gpt_heterogeneous_layer_spec builds plain TE linears whatever --use-transformer-engine-op-fuser says (no
    # TEFusedMLP, whose ops would cache no workspace): the same cache, and a note
    L = layout_from_flags(te + ["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8", "--use-transformer-engine-op-fuser",
                                "--heterogeneous-layers-config-path", BLOCKS], world_size=1)
    assert _terms(L, "B200")["fp8_weight_cache"].bytes == 7_569_408
    assert any("no effect on a heterogeneous layer config" in note for note in L.notes)
    # --first-last-layers-bf16 with 1 layer at the start: layers 1 and 2 only
    L = layout_from_flags(te + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16",
                                "--num-layers-at-start-in-bf16", "1", "--num-layers-at-end-in-bf16", "0",
                                "--heterogeneous-layers-config-path", BLOCKS], world_size=1)
    assert [k.quantized for k in layer_kinds(L)] == [None, "tensorwise", "tensorwise", "tensorwise"]
    assert "1,441,792 GEMM weight elements of 2 FP8 layers" in _terms(L, "H100")["fp8_weight_cache"].detail
    # a block's own width TE cannot quantize names the config: MXFP8 needs every dimension divisible by 32, and a
    # block MLP of 520 gives linear_fc1 [1040, 512]
    odd = _write(tmp_path, lambda d: d["block_configs"][1].update(ffn={"ffn_hidden_size": 520, "no_op": False,
                                                                       "replace_with_linear": False}))
    msg = _err(te + ["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8", "--heterogeneous-layers-config-path", odd])
    assert msg.startswith("--heterogeneous-layers-config-path: with --fp8-recipe mxfp8: linear_fc1's weight is [1040, 512]")
    # a linear replacement is TELayerNormColumnParallelLinearGathered (a TE LayerNormLinear): one more [512, 512] GEMM
    # per linear block of linear_blocks.json: layer 0 2,228,224, layer 1 (linear + MLP 512) 262,144 + 786,432,
    # layer 2 (attention + linear) 655,360 + 262,144, layer 3 (two linears) 2 x 262,144
    L = layout_from_flags(te + ["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8", "--heterogeneous-layers-config-path",
                                LINEAR], world_size=1)
    n = 2_228_224 + 1_048_576 + 917_504 + 524_288
    assert _terms(L, "B200")["fp8_weight_cache"].bytes == 2 * n + 2 * n // 32 == 9_732_096
    # each linear keeps its norm output quantized: [512, 512] MXFP8, 1 byte an element and a scale per 32
    saved = layer_activations(L, True, layer_kinds(L)[3]).saved
    assert saved["qkv_input"] == saved["fc1_input"] == 512 * 512 + 512 * 512 // 32 == 270_336
    # and its backward quantizes the [512, 512] output gradient both ways (TE grad_output_preprocess) next to the BF16
    bf16 = layout_from_flags(te + ["--heterogeneous-layers-config-path", LINEAR], world_size=1)
    assert (layer_activations(L, True, layer_kinds(L)[3]).bwd_transient
            - layer_activations(bf16, True, layer_kinds(bf16)[3]).bwd_transient) == 2 * 270_336
    # the local spec runs FP8 flags in BF16
    L = _layout(["--fp8-format", "hybrid"], path=LINEAR)
    assert not any(k.quantized for k in layer_kinds(L))


def test_offloading_and_full_iteration_graphs():
    te = [f if f != "local" else "transformer_engine" for f in FLAGS]
    from megatron_memguard.gpus import lookup_gpu
    off = ["--fine-grained-activation-offloading", "--offload-modules", "attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm",
           "--min-offloaded-tensor-size", "1"]
    L = layout_from_flags(te + off + ["--heterogeneous-layers-config-path", BLOCKS], world_size=1)
    st = estimate(L, gpu=lookup_gpu("H100")).stages[0]
    # the groups hook SelfAttention and the layer's norms (TransformerLayer._set_offload_modules, 0.19.2; TE fuses the
    # norms, so attn_norm / mlp_norm offload nothing): the attention layers 0 and 2 each offload qkv_linear (layer
    # input + norm output, [256 x 2, 512] bf16 each: 2 x 524,288), core_attn (q/k/v [512, 768] bf16 786,432, roped
    # query 524,288 and key 131,072, softmax statistics [2, 8, 256] fp32 16,384) and attn_proj (524,288); the no-op
    # halves nothing. On the last stage the chunk's last group (layer 2's attn_proj: layer 3 offloads nothing) stays
    per_layer = 2 * 524_288 + (786_432 + 524_288 + 131_072 + 16_384) + 524_288
    assert st.host_bytes == 2 * per_layer - 524_288 == 5_537_792
    # the full-iteration graph's static batches do not depend on the layers (StaticBufferLoader): 2 micro-batches of
    # tokens, labels, position ids (int64), loss mask (fp32) [2, 256] and the bool mask [2, 1, 256, 256]
    L = layout_from_flags(te + ["--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad",
                                "--heterogeneous-layers-config-path", BLOCKS], world_size=1)
    io = _terms(L, "H100")["cuda_graph_static_io"]
    assert io.bytes == 2 * (2 * 256 * 28 + 2 * 256 * 256) == 290_816
    # per-layer graphs with no-op / linear layers: test_per_layer_graphs_of_noop_and_linear_layers
    # linear replacements: TransformerLayer calls TELayerNormColumnParallelLinearGathered outside any offload group and
    # its input_layernorm / pre_mlp_layernorm is IdentityOp (_set_offload_modules skips it; transformer_layer.py 0.16.1
    # to 0.19.2), so linear_blocks.json's linear layers 1 and 3 (their linear input and norm output, 2 x 524,288 each)
    # offload nothing: the attention layers 0 and 2 offload as above, layer 2's attn_proj kept as the last group
    L = layout_from_flags(te + off + ["--heterogeneous-layers-config-path", LINEAR], world_size=1)
    assert estimate(L, gpu=lookup_gpu("H100")).stages[0].host_bytes == 2 * per_layer - 524_288 == 5_537_792


def test_moe_parameters_per_rank_match_megatron_core():
    # TP 2 (sequence parallel), PP 2, EP 2, ETP 1, one MTP depth: each pipeline rank's parameters as megatron-core
    # builds that rank (tests/e2e/moe_rank_params.py: HeterogeneousTransformerConfig, the MoE block spec, the MTP
    # spec of megatron/training 0.19.2's builder where installed, else the last decoder layer's; model-parallel
    # ranks set in parallel_state)
    import sys
    pytest.importorskip("megatron.core.transformer.heterogeneous.heterogeneous_config")
    job = dict(num_layers=4, hidden_size=512, heads=8, kv_channels=None, groups=2, ffn=1024, bias=False, glu=True,
               norm="RMSNorm", tp=2, pp=2, vpp=None, ep=2, etp=1, experts=4, moe_ffn=256, topk=2, freq=[1, 0, 1, 0],
               shared_ffn=384, shared_gate=False, expert_bias=False, untied=True, seq=256, mtp=1, mla=None,
               first=None, last=None, acc_emb=False, acc_loss=False, layout=None, vocab=1024, het=BLOCKS,
               ranks=[[0, None, 0, 0, 0], [1, None, 1, 1, 0]])
    # and the MTP depth alone on the last stage (layout Etttt|mL): megatron/training 0.19.2's builder gives it the MoE
    # layer spec there (mtp_block_spec's _te_or_local_layer_spec for a chunk without decoder layers)
    alone = dict(job, tp=1, ep=1, layout="Etttt|mL", ranks=[[0, None, 0, 0, 0], [1, None, 0, 0, 0]])
    port = str(_free_port())
    out = run_script([sys.executable, os.path.join(HERE, "e2e", "moe_rank_params.py"), json.dumps([job, alone])],
                     timeout=600, cwd=os.path.dirname(HERE),
                     env={**os.environ, "PYTHONPATH": os.path.dirname(HERE), "MEMGUARD_E2E_PORT": port,
                          "MASTER_PORT": port})
    assert out.returncode == 0, out.stderr[-2000:]
    real, real_alone = json.loads(out.stdout.strip().splitlines()[-1])
    L = _layout(MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size",
                       "2", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                       "--mtp-num-layers", "1"], world=8)
    est = estimate(L)
    for r in real:
        pp = r["rank"][0]
        mine = chunk_params(L, L.stage_chunks(pp)[0])
        assert r["params"] == est.stages[pp].parameters == sum(p.numel for p in mine)
        assert r["tags"]["expert"] == sum(p.numel for p in mine if p.expert)
        assert [is_moe for _, is_moe in r["layers"]] == [k.mlp == "moe" for k in L.stage_chunks(pp)[0].layer_kinds]
    if _megatron_core_at_least("0.19"):    # (the builder's MoE rule; older cores take the last decoder layer's spec)
        A = _layout(MOE + ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Etttt|mL",
                           "--mtp-num-layers", "1"], world=2)
        for r in real_alone:
            mine = chunk_params(A, A.stage_chunks(r["rank"][0])[0])
            assert r["params"] == sum(p.numel for p in mine)
            assert r["tags"]["expert"] == sum(p.numel for p in mine if p.expert)
    # by hand, rank 0: embedding [1024 / 2, 512]; layer 0: norm, qkv 768 / 2 x 512, proj 512 x 256, pre-MLP norm,
    # router 4 x 512, 2 local experts x 3 x 256 x 512, shared expert 3 x 384 / 2 x 512; layer 1: norm, qkv, proj,
    # pre-MLP norm, dense MLP 512 (fc1 1024 / 2 x 512, fc2 512 x 256)
    attn = 512 + 384 * 512 + 512 * 256
    assert est.stages[0].parameters == (512 * 512 + attn + 512 + 2048 + 2 * 3 * 256 * 512 + 3 * 192 * 512
                                        + attn + 512 + 512 * 512 + 512 * 256) == 2_396_160


def test_muon_step_takes_the_widest_layer(tmp_path):
    # Muon's step working set is the largest 2-D weight of the stage: with block 3 an MLP of 512 after block 0's 1024,
    # layer 0's linear_fc1 [2 x 1024, 512] sets it (not the last layer's [2 x 512, 512] of the same name)
    from megatron_memguard.estimator.muon import step_working_set
    top = _write(tmp_path, lambda d: d["block_configs"][3].update(ffn={"ffn_mult": 1.3125, "no_op": False,
                                                                       "replace_with_linear": False}))
    L = layout_from_flags(FLAGS + ["--optimizer", "muon", "--heterogeneous-layers-config-path", top], world_size=1)
    ws = step_working_set(L, 0)
    assert (ws.matrix, ws.shape) == ("linear_fc1", (2048, 512))


def test_per_layer_graphs_of_whole_layers(tmp_path):
    # every block attention and a dense MLP (ffn_mult 2.625, 5.25, 2.625, 1.3125 -> 1024, 1792, 1024, 512): TE graphs
    # every layer (_layer_is_graphable), each with its static input and grad-output [256 x 2, 512] bf16 and the causal
    # mask [2, 1, 256, 256] bool (TransformerLayer.get_layer_static_inputs)
    te = [f if f != "local" else "transformer_engine" for f in FLAGS]

    def whole(d):
        for b, mult in zip(d["block_configs"], (2.625, 5.25, 2.625, 1.3125)):
            b.update(attention={"n_heads_in_group": 4, "no_op": False, "replace_with_linear": False},
                     ffn={"ffn_mult": mult, "no_op": False, "replace_with_linear": False})
    L = layout_from_flags(te + ["--cuda-graph-impl", "transformer_engine", "--heterogeneous-layers-config-path",
                                _write(tmp_path, whole)], world_size=1)
    assert [k.mlp for k in layer_kinds(L)] == ["dense", "dense:1792", "dense", "dense:512"]
    t = _terms(L, "H100")
    assert t["cuda_graph_static_io"].bytes == 4 * (2 * 512 * 512 * 2 + 2 * 256 * 256) == 4_718_592
    # the pool keeps the widest graphed layer's working memory: layer 1's (MLP 1792), above the flags' 1024 layer's
    widest = layer_activations(L, True, layer_kinds(L)[1])
    flags = layer_activations(L, True, layer_kinds(L)[0])
    assert t["cuda_graph_pool"].bytes == max(widest.fwd_transient, widest.bwd_transient) > max(
        flags.fwd_transient, flags.bwd_transient)
    # with MoE every layer is whole (the MoE block spec): graphed as the same model without the heterogeneous config,
    # whose dense layers (512 and the flags' 1024) are no wider
    graphs = ["--cuda-graph-impl", "transformer_engine"]
    het = _terms(layout_from_flags(te + MOE + graphs + ["--heterogeneous-layers-config-path", BLOCKS], world_size=1),
                 "H100")
    plain = _terms(layout_from_flags(te + MOE + graphs, world_size=1), "H100")
    for name in ("cuda_graph_static_io", "cuda_graph_pool"):
        assert het[name].bytes == plain[name].bytes


@pytest.mark.parametrize("impl,mods,path,version,layers,masked", [
    # Transformer Engine's helper (_layer_is_graphable, cuda_graphs.py 0.16.1 and 0.19.2: isinstance checks of the
    # built modules): every TransformerLayer without modules; attn: a self_attention that is not an IdentityOp
    # (small_blocks.json's layers 0 and 2; every layer of linear_blocks.json, whose no-attention blocks are linear
    # replacements); mlp: an MLP instance (the dense layers 0 and 1; a linear replacement is none)
    ("transformer_engine", "", BLOCKS, "0.19.2", 4, 2),
    ("transformer_engine", "attn", BLOCKS, "0.19.2", 2, 2),
    ("transformer_engine", "mlp", BLOCKS, "0.19.2", 2, 0),
    ("transformer_engine", "attn,mlp", BLOCKS, "0.19.2", 3, 2),
    ("transformer_engine", "attn", LINEAR, "0.19.2", 4, 4),
    ("transformer_engine", "mlp", LINEAR, "0.19.2", 2, 0),
    # the local manager (TransformerLayer.create_mcore_cudagraph_manager) compares the submodule spec with the
    # IdentityOp class: a no-op attention's ModuleSpec(IdentityOp) is not it (attn: every layer); a no-op MLP is
    # IdentityOp itself from 0.18 (heterogeneous_layer_specs.py), ModuleSpec(IdentityOp) in 0.16.1 / 0.17.1
    ("local", "attn", BLOCKS, "0.19.2", 4, 0),
    ("local", "mlp", BLOCKS, "0.19.2", 2, 0),
    ("local", "mlp", LINEAR, "0.19.2", 4, 0),
    ("local", "mlp", BLOCKS, "0.17.1", 4, 0),
])
def test_per_layer_graphs_of_noop_and_linear_layers(impl, mods, path, version, layers, masked):
    te = [f if f != "local" else "transformer_engine" for f in FLAGS]
    from megatron_memguard.gpus import lookup_gpu
    spelled = (["--cuda-graph-modules", *mods.split(",")] if version >= "0.18" else ["--cuda-graph-scope", mods]) \
        if mods else []
    L = layout_from_flags(te + ["--cuda-graph-impl", impl, *spelled, "--heterogeneous-layers-config-path", path],
                          world_size=1, megatron_version=version)
    io = {t.name: t.bytes for t in estimate(L, gpu=lookup_gpu("H100")).stages[0].terms}["cuda_graph_static_io"]
    # per graphed layer (PP 1: one sample set) its static input and grad-output [seq 256 x MBS 2, 512] bf16
    # (1,048,576 bytes), and under TE a graphed attention's bool causal mask [2, 1, 256, 256] (131,072)
    assert io == layers * 2 * 512 * 512 * 2 + masked * 2 * 256 * 256


def test_per_layer_graphs_with_mtp_depths():
    # the 2 MTP depths are full layers of the flags (models/gpt.py mtp_block_spec, 0.19.2), graphed by both
    # implementations under attn: TE the attention layers 0 and 2 and the 2 depths (each with its causal mask), the
    # local managers every decoder layer (a no-op attention's ModuleSpec(IdentityOp)) and the 2 depths
    te = [f if f != "local" else "transformer_engine" for f in FLAGS]
    from megatron_memguard.gpus import lookup_gpu
    got = {}
    for impl in ("transformer_engine", "local"):
        L = layout_from_flags(te + ["--mtp-num-layers", "2", "--cuda-graph-impl", impl, "--cuda-graph-modules", "attn",
                                    "--heterogeneous-layers-config-path", BLOCKS], world_size=1)
        got[impl] = {t.name: t.bytes for t in estimate(L, gpu=lookup_gpu("H100")).stages[-1].terms}["cuda_graph_static_io"]
    assert got == {"transformer_engine": 4 * 1_048_576 + 4 * 131_072, "local": 6 * 1_048_576}


def test_the_json_file_is_read_once_per_version_and_its_error_kept(tmp_path, monkeypatch):
    # memguard plan resolves the config for every candidate layout (files.read_once): the 4-layer model of these tests
    # on 64 GPUs read the JSON 12 times; one read per file version, its error (and a BOM's refusal) kept, and a
    # changed file read again
    from megatron_memguard import files
    reads = []
    real = files.read_bytes
    monkeypatch.setattr(files, "read_bytes", lambda p, *a, **k: reads.append(p) or real(p, *a, **k))
    old = 10**18    # (a modification time long before the read: not racy)
    good = _write(tmp_path, lambda d: None)
    os.utime(good, ns=(old, old))
    assert _layout(path=good).heterogeneous_layers == _layout().heterogeneous_layers
    _layout(path=good)
    assert reads.count(good) == 1
    key = "--heterogeneous-layers-config-path"
    for text, rule in (("[" * 100 + "]" * 100, "nested deeper than 64 levels"), ("\ufeff{}", "UTF-8 byte-order mark")):
        with open(good, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.utime(good, ns=(old + len(text), old + len(text)))
        n = len(reads)
        assert rule in _err(FLAGS + [key, good]) and rule in _err(FLAGS + [key, good])
        assert len(reads) == n + 1


def test_the_encoded_json_is_parsed_once_per_text_and_its_error_kept(monkeypatch):
    # memguard plan resolves --heterogeneous-layers-config-encoded-json for every candidate layout: one parse per text
    from megatron_memguard import files
    parses = []
    real = files.load_json
    monkeypatch.setattr(files, "load_json", lambda t, *a, **k: parses.append(t) or real(t, *a, **k))
    with open(BLOCKS) as fh:
        text = json.dumps(json.load(fh)) + " " * 7      # (a text no other test gives: not parsed before)
    key = "--heterogeneous-layers-config-encoded-json"
    for _ in range(2):
        layout_from_flags(FLAGS + [key, text], world_size=1)
    assert parses == [text]
    bad = "[" * 70 + "]" * 70
    for _ in range(2):
        assert "nested deeper than 64 levels" in _err(FLAGS + [key, bad])
    assert parses == [text, bad]
