"""Hybrid Mamba models (--hybrid-layer-pattern): the pattern read with megatron-core's rules (errors naming the
flag), each layer's parameters counted by hand and against megatron-core 0.19.2's HybridModel built on CPU, the
Nemotron-H 8B total, and the Mamba mixer's saved tensors per micro-batch from the sources
(megatron-core 0.19.2 ssm/mamba_mixer.py, mamba_ssm 2.2.6 ops/triton/ssd_combined.py and layernorm_gated.py)."""
import json
import os

import pytest

from build_util import run_script   # tests/e2e scripts through a fork server (torch and megatron imported once)

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.estimator.layers import mamba
from megatron_memguard.estimator.params import chunk_params, total_parameters
from megatron_memguard.partition import LayerKind, layer_kinds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY312 = os.environ.get("MEMGUARD_PY312", "/work/venv312/bin/python")   # megatron-core 0.19.2 (has triton)

SMALL = ("--hidden-size 256 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
         "--ffn-hidden-size 512 --seq-length 128 --max-position-embeddings 128 --micro-batch-size 1 "
         "--global-batch-size 8 --bf16 --vocab-size 1024 --tokenizer-type NullTokenizer --normalization RMSNorm "
         "--disable-bias-linear --untie-embeddings-and-output-weights --position-embedding-type none "
         "--mamba-state-dim 16 --mamba-head-dim 32 --mamba-num-groups 2 --hidden-dropout 0 --attention-dropout 0 "
         "--make-vocab-size-divisible-by 128").split()

# Nemotron-H 8B: Megatron-Bridge 0.6.2 recipes/nemotronh/h100/nemotronh.py nemotronh_8b_pretrain_2gpu_h100_bf16_config
# (the Nemotron-H paper's table, arXiv 2504.03624: 52 layers, d 4096, FFN 21504 squared ReLU, 32 query / 8 KV heads,
# Mamba-2 state 128, 8 groups, 128 heads of 64); vocabulary 131072, untied
NEMOTRON_H_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
NH8B = (f"--hybrid-layer-pattern {NEMOTRON_H_8B} --hidden-size 4096 --num-attention-heads 32 --group-query-attention "
        "--num-query-groups 8 --ffn-hidden-size 21504 --squared-relu --mamba-num-heads 128 --mamba-head-dim 64 "
        "--mamba-num-groups 8 --mamba-state-dim 128 --normalization RMSNorm --position-embedding-type none "
        "--untie-embeddings-and-output-weights --disable-bias-linear --seq-length 8192 --max-position-embeddings 8192 "
        "--micro-batch-size 1 --global-batch-size 768 --bf16 --use-distributed-optimizer --tokenizer-type "
        "NullTokenizer --vocab-size 131072 --hidden-dropout 0 --attention-dropout 0").split()


def _layout(pattern, extra="", world=1, version=None):
    return layout_from_flags(SMALL + ["--hybrid-layer-pattern", pattern] + extra.split(), world_size=world,
                             megatron_version=version)


def _err(flags, world=1, version=None):
    with pytest.raises((ConfigError, ConfigErrors, NotModelledError)) as e:
        layout_from_flags(SMALL + flags.split(), world_size=world, megatron_version=version)
    return str(e.value)


def test_nemotron_h_8b_parameters_by_hand():
    # Mamba layer (d_inner = 128 x 64 = 8192, in_proj out 2 x 8192 + 2 x 8 x 128 + 128 = 18560, conv width 4):
    #   fused norm 4096 + in_proj 18560 x 4096 + conv1d (8192 + 2048) x (4 + 1) + dt_bias, A_log, D 3 x 128
    #   + gated norm 8192 + out_proj 4096 x 8192                                   = 109,640,064
    # MLP layer: fused norm 4096 + fc1 21504 x 4096 + fc2 4096 x 21504           = 176,164,864
    # attention layer: fused norm 4096 + qkv (32 + 2 x 8) x 128 x 4096 + proj 4096 x 4096 = 41,947,136
    # 24 Mamba, 24 MLP, 4 attention layers; embedding and output 131072 x 4096 each; final norm 4096
    assert NEMOTRON_H_8B.count("M") == 24 and NEMOTRON_H_8B.count("-") == 24 and NEMOTRON_H_8B.count("*") == 4
    L = layout_from_flags(NH8B, world_size=8)
    mamba_layer = 4096 + 18560 * 4096 + 10240 * 5 + 3 * 128 + 8192 + 4096 * 8192
    assert mamba_layer == 109_640_064 == mamba.param_count(L)
    total = 24 * mamba_layer + 24 * 176_164_864 + 4 * 41_947_136 + 2 * 131072 * 4096 + 4096
    assert total_parameters(L) == total == 8_100_852_736      # the "8B" of the model's name
    assert L.num_layers == 52 and L.mamba_num_heads == 128


def test_tensor_parallel_shards_heads_and_groups():
    # TP 2: in_proj 18560 / 2 rows, conv1d (8192 + 2048) / 2 channels, 64 heads' dt_bias / A_log / D, the gated
    # norm 4096, out_proj 4096 x 4096; the fused norm replicated
    L = layout_from_flags(NH8B + ["--tensor-model-parallel-size", "2"], world_size=8)
    rows = {name: n for name, n, *_ in mamba.param_rows(L)}
    assert rows == {"mixer.conv1d_weight": 5120 * 4, "mixer.conv1d_bias": 5120, "mixer.dt_bias": 64, "mixer.A_log": 64,
                    "mixer.D": 64, "mixer.in_proj.layer_norm_weight": 4096, "mixer.in_proj.weight": 9280 * 4096,
                    "mixer.norm.weight": 4096, "mixer.out_proj.weight": 4096 * 4096}


MOE = "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 128 --moe-token-dispatcher-type alltoall"


def real_hybrid_params(pattern: str, moe: bool, port: int, **extra) -> dict:
    """{name: numel} of the SMALL hybrid model as megatron-core 0.19.2 builds it on CPU (tests/e2e/mamba_param_count.py,
    in the MEMGUARD_PY312 venv; skips without it)."""
    if not os.path.exists(PY312):
        pytest.skip("no megatron-core 0.19.2 venv (MEMGUARD_PY312)")
    cfg = dict(pattern=pattern, hidden_size=256, heads=4, groups=2, ffn=512, state=16, head_dim=32, mamba_groups=2,
               vocab=1024, seq=128, **extra, **(dict(experts=4, topk=2, moe_ffn=128) if moe else {}))
    return run_e2e(PY312, "mamba_param_count.py", cfg, port)


def run_e2e(python: str, script: str, cfg: dict, port: int):
    """The last stdout line (JSON) of tests/e2e/SCRIPT run on ``cfg`` by ``python``; skips when that venv lacks a
    module the script needs."""
    out = run_script([python, os.path.join(ROOT, "tests", "e2e", script), json.dumps(cfg)],
                     timeout=300, cwd=ROOT,
                     env={**os.environ, "PYTHONPATH": ROOT, "MASTER_PORT": str(port)})
    if out.returncode and "No module named" in out.stderr:
        pytest.skip(out.stderr.strip().splitlines()[-1])
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("pattern, extra", [("M*M-", ""), ("M*-E", MOE)], ids=["mamba", "with-moe"])
def test_parameters_match_megatron_core(pattern, extra):
    real = real_hybrid_params(pattern, bool(extra), 29651)
    L = _layout(pattern, extra)
    mine = {p.name: p.numel for p in chunk_params(L, L.chunks[0])}
    assert sum(mine.values()) == sum(real.values()) == total_parameters(L)
    # each layer's total (the MoE layer's experts are TE's grouped weights in memguard, local experts here)
    for i in range(len(pattern)):
        at = f"decoder.layers.{i}."
        assert sum(v for n, v in mine.items() if n.startswith(at)) == sum(v for n, v in real.items() if n.startswith(at))
    # the mixer's own parameters by name, in megatron-core's order (the local spec keeps the norm outside in_proj)
    real_mixer = [(n, v) for n, v in real.items() if ".mixer." in n]
    mine_mixer = [(n, v) for n, v in mine.items() if ".mixer." in n and "layer_norm" not in n]
    assert mine_mixer == real_mixer


def test_parameters_match_this_venvs_megatron_core():
    # the interpreter running the tests: megatron-core 0.16.1 (py3.11: MambaModel over MambaStack, whose mixer
    # registers dt_bias, A_log, D before in_proj and then an nn.Conv1d) or 0.19.2 (py3.12)
    import sys
    try:
        from megatron.core.package_info import __version__ as core
    except ImportError:
        pytest.skip("no megatron-core")
    L = layout_from_flags(SMALL + ["--hybrid-override-pattern", "M*M-", "--num-layers", "4"], world_size=1,
                          megatron_version=".".join(core.split(".")[:2]))
    # (the vocabulary as memguard pads it for that release: 0.16's NullTokenizer adds the end-of-document token)
    cfg = dict(pattern="M*M-", hidden_size=256, heads=4, groups=2, ffn=512, state=16, head_dim=32, mamba_groups=2,
               vocab=L.padded_vocab_size, seq=128)
    out = run_script([sys.executable, os.path.join(ROOT, "tests", "e2e", "mamba_param_count.py"), json.dumps(cfg)],
                     timeout=300, cwd=ROOT,
                     env={**os.environ, "PYTHONPATH": ROOT, "MASTER_PORT": "29652"})
    assert out.returncode == 0, out.stderr[-2000:]
    real = json.loads(out.stdout.strip().splitlines()[-1])
    mine = {p.name: p.numel for p in chunk_params(L, L.chunks[0])}
    assert sum(mine.values()) == sum(real.values()) == total_parameters(L)
    assert ([(n, v) for n, v in mine.items() if ".mixer." in n and "layer_norm" not in n]
            == [(n, v) for n, v in real.items() if ".mixer." in n])


def test_moe_layers_of_a_hybrid_pattern():
    # 'E': MoETransformerLayer = pre-MLP norm 256 + router 4 x 256 + 4 experts x (fc1 256 x 128 + fc2 128 x 256);
    # the pattern places the MoE layers (--moe-layer-freq does not apply) and the experts are TE's grouped ones
    L = _layout("M*-E", MOE)
    assert L.moe.moe_layer_pattern == (False, False, False, True) and L.moe.moe_grouped_gemm
    assert layer_kinds(L)[3] == LayerKind("none", "moe")
    assert total_parameters(L) - total_parameters(_layout("M*-")) == 256 + 4 * 256 + 4 * 2 * 256 * 128 == 263_424
    assert "--hybrid-layer-pattern: has MoE layers ('E') but --num-experts is not set" in _err(
        "--hybrid-layer-pattern M*-E")
    assert [s.num_layers for s in estimate(_layout("M*|-E", MOE + " --pipeline-model-parallel-size 2", world=2))
            .stages] == [2, 2]


def test_pattern_sets_layers_and_kinds():
    L = _layout("M*M-", "--num-layers 3")
    assert L.num_layers == 4
    assert any("--num-layers 3 ignored" in n for n in L.notes)
    assert layer_kinds(L) == (LayerKind("mamba", "none"), LayerKind("attention", "none"), LayerKind("mamba", "none"),
                              LayerKind("none", "dense"))
    # the legacy spelling reads the same
    assert layout_from_flags(SMALL + ["--hybrid-override-pattern", "M*M-"], world_size=1).num_layers == 4


def test_pipe_segments_are_the_pipeline_stages():
    # 4 segments over PP 2: segment i on (pp rank i % 2, virtual stage i // 2) (select_pipeline_segment)
    L = _layout("M*|M-|MMM|-", "--pipeline-model-parallel-size 2", world=2)
    assert L.vpp == 2
    got = {(c.pp_rank, c.vpp_rank): (c.first_layer, c.num_layers) for c in L.chunks}
    assert got == {(0, 0): (0, 2), (1, 0): (2, 2), (0, 1): (4, 3), (1, 1): (7, 1)}
    # chunks without the embedding or the loss (no batch mask): an MLP-only layer's no-op mixer there too
    L4 = _layout("M*|M-|MM|--", "--pipeline-model-parallel-size 4", world=4)
    assert [s.num_layers for s in estimate(L4).stages] == [2, 2, 2, 2]
    # without '|' the pattern is split evenly (the deprecated runtime split)
    L = _layout("M*M-", "--pipeline-model-parallel-size 2", world=2)
    assert [c.num_layers for c in L.chunks] == [2, 2]


def test_pattern_errors_name_the_flag():
    assert "--hybrid-layer-pattern: 'x' is not a layer symbol" in _err("--hybrid-layer-pattern MxM-")
    # memguard's bound on the layer count (numbers.BOUNDS) holds for a pattern too
    assert "has 10,001 layers" in _err("--hybrid-layer-pattern " + "M" * 10_001)
    assert "3 '|' segments" in _err("--hybrid-layer-pattern M|M|M --pipeline-model-parallel-size 2", world=2)
    assert "5 layers, which must be divisible" in _err("--hybrid-layer-pattern M*M-M --pipeline-model-parallel-size 2",
                                                       world=2)
    assert "--decoder-first-pipeline-num-layers: cannot be used with '|'" in _err(
        "--hybrid-layer-pattern M*|M- --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 2", world=2)
    assert "--hybrid-override-pattern: cannot be given with --hybrid-layer-pattern" in _err(
        "--hybrid-layer-pattern M*M- --hybrid-override-pattern M*M-")
    # MambaMixer's asserts: groups (2) over TP 4
    assert "--mamba-num-groups: 2 must be divisible by tensor-model-parallel size 4" in _err(
        "--hybrid-layer-pattern M*M- --tensor-model-parallel-size 4", world=4)
    # 2 x 256 / 48 is not whole
    assert "--mamba-head-dim: 48 must divide" in _err("--hybrid-layer-pattern M*M- --mamba-head-dim 48")


def test_megatron_016_rules():
    # 0.16.1 _allocate_override: the pattern's length is --num-layers; no '|'; the flag is --hybrid-override-pattern
    assert "has 4 layers but --num-layers is 3" in _err("--hybrid-override-pattern M*M- --num-layers 3", version="0.16")
    assert "'|' is not a layer symbol in megatron-core 0.16" in _err("--hybrid-override-pattern M*|M- --num-layers 4",
                                                                     version="0.16")
    assert "is not a flag of megatron-core 0.16" in _err("--hybrid-layer-pattern M*M- --num-layers 4", version="0.16")
    L = layout_from_flags(SMALL + "--hybrid-override-pattern M*M- --num-layers 4".split(), world_size=1,
                          megatron_version="0.16")
    # 0.16.1's conv1d is an nn.Conv1d after in_proj; its own dt_bias, A_log, D come first
    names = [r[0] for r in mamba.param_rows(L)]
    assert names[:3] == ["mixer.dt_bias", "mixer.A_log", "mixer.D"] and "mixer.conv1d.weight" in names


@pytest.mark.parametrize("flags, key", [
    ("--hybrid-layer-pattern M*M- " + MOE, "--num-experts"),
    ("--hybrid-layer-pattern M*M- --transformer-impl local", "--transformer-impl"),
    ("--hybrid-layer-pattern M*M- --disable-mamba-mem-eff-path", "--disable-mamba-mem-eff-path"),
    # torch FSDP2 does not wrap MambaLayer (torch_fully_sharded_data_parallel.py 0.19.2)
    ("--hybrid-layer-pattern M*M- --use-torch-fsdp2 --no-gradient-accumulation-fusion", "--use-torch-fsdp2"),
])
def test_unmodelled_settings_are_refused_by_name(flags, key):
    world = 2 if "context" in flags or "fsdp" in flags else 1
    with pytest.raises(NotModelledError) as e:
        layout_from_flags(SMALL + flags.split(), world_size=world)
    assert str(e.value).startswith(key)


def test_mamba_layer_saved_tensors_by_hand():
    # seq 128, MBS 2, h 256, bf16, TP 1: d_inner 2 x 256 = 512 (16 heads of 32), groups 2, state 16:
    # in_proj out 2 x 512 + 2 x 2 x 16 + 16 = 1104
    L = _layout("M*M-", "--micro-batch-size 2")
    la = layer_activations(L, True, LayerKind("mamba", "none"))
    T = 128 * 2
    assert la.saved == {
        "layer_input": T * 256 * 2,            # the residual, kept by in_proj's fused norm (TE LayerNormLinear)
        "norm1_stats": T * 4,                  # its fp32 rstd
        "mamba_in_proj_input": T * 256 * 2,    # the norm output
        "mamba_zxbcdt": T * 1104 * 2,          # MambaSplitConv1dScanCombinedFn saves zxbcdt
        "mamba_scan_output": T * 512 * 2,      # ... and out_x (the scan output before the z gate)
        "mamba_norm_input": T * 512 * 2,       # LayerNormFn saves x ...
        "mamba_norm_stats": T * 2 * 4,         # ... and rstd: fp32 per row and group
        "mamba_out_proj_input": T * 512 * 2,   # out_proj (row-parallel linear) keeps its input
    }
    # Working sets (mamba_ssm 2.2.6 ssd_combined.py, one chunk of 128 here): the forward's peak is the scan, with
    # in_proj's [l, b] output 256 x 1104 x 2 (MBS 2: the [b, l] copy is new), the conv output 256 x 576 x 2, fp32 dt
    # and dA_cumsum 2 x 256 x 16 x 4, the bf16 passed states 2 x 16 x 32 x 16 x 2, fp32 C^T B 2 x 2 x 128^2 x 4 and
    # the gated output 256 x 512 x 2, less the norm and out_proj tensors not made yet (2 x 262,144 + 2,048)
    assert la.fwd_transient == (565_248 + 294_912 + 32_768 + 32_768 + 262_144 + 262_144) - 526_336 == 923_648
    # the backward's peak is the scan's: the layer-output gradient 131,072, dy 262,144, dzxbcdt 565,248, the conv
    # output recomputed and its gradient 2 x 294,912, the states in fp32 and bf16 16,384 x 6, C^T B, dt's 32,768,
    # with out_proj's input and the norm's tensors released
    assert la.bwd_transient == (131_072 + 262_144 + 565_248 + 589_824 + 98_304 + 262_144 + 32_768) - 526_336
    # sequence parallelism (TP 2) shards only the residual-stream tensors; the mixer's are split by heads
    L2 = _layout("M*M-", "--micro-batch-size 2 --tensor-model-parallel-size 2 --sequence-parallel", world=2)
    la2 = layer_activations(L2, True, LayerKind("mamba", "none"))
    assert la2.saved["layer_input"] == T // 2 * 256 * 2
    assert la2.saved["mamba_zxbcdt"] == T * 552 * 2
    assert la2.saved["mamba_norm_stats"] == T * 1 * 4


def test_full_recompute_keeps_only_block_inputs():
    # 4 layers, uniform full recompute of 1 layer per block: 4 checkpointed inputs of [s b h] bf16 each
    L = _layout("M*M-", "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    est = estimate(L)
    term = next(t for t in est.critical.terms if t.name == "layer_activations")
    assert term.bytes == 4 * 128 * 256 * 2


def test_planner_plans_hybrid_models_and_their_mtp_depths(capsys):
    # memguard plan takes hybrid patterns (planner/hybrid.py; tests/test_planner_hybrid.py) and the MTP depths after
    # '/' (timed and bounded on the last stage: tests/test_planner_hybrid.py test_hybrid_mtp_depths_*); the depths are
    # not decoder layers, so the decoder's kinds stay the pattern's
    from megatron_memguard.cli.main import main
    from megatron_memguard.planner.space import model_shape
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    L = _layout("M*M-")
    shape = model_shape(L, parse_megatron_flags([]))
    assert shape.kinds_in(0, 4) == (2, 1, 1) and [k.mixer for k in shape.kind_set] == ["mamba", "attention", "none"]
    assert main(["plan", "--model", "nemotronh_8b", "--gpus", "8", "--gpu", "h100-80gb"]) == 0
    capsys.readouterr()
    L = _layout("M*M-/M-", "--mtp-num-layers 1")
    shape = model_shape(L, parse_megatron_flags([]))
    assert shape.kinds_in(0, 4) == (2, 1, 1)
    assert (shape.layout.mtp_num_layers, shape.layout.hybrid_mtp_pattern) == (1, "M-")


def test_nemotron_h_8b_bridge_recipe_preset():
    # Megatron-Bridge 0.6.2 nemotronh_8b_pretrain_2gpu_h100_bf16_config: TP 2 with SP, MBS 1, GBS 768, seq 8192,
    # NullTokenizer of 32000 tokens (recipes/utils/tokenizer_utils.py): the 8B count less 2 x (131072 - 32000) x 4096
    from megatron_memguard.readers.models import read_model
    from megatron_memguard.resolve import resolve
    L = resolve(read_model("nemotronh_8b"), world_size=2)
    assert L.hybrid_layer_pattern == NEMOTRON_H_8B and L.tp == 2 and L.sequence_parallel
    assert total_parameters(L) == 8_100_852_736 - 2 * (131072 - 32000) * 4096 == 7_289_254_912


def test_layout_document_round_trips():
    from megatron_memguard.layout import Layout
    L = _layout("M*|M-|MMM|-", "--pipeline-model-parallel-size 2 --mamba-num-heads 8", world=2)
    d = L.to_dict()
    assert d["hybrid_layer_pattern"] == "M*|M-|MMM|-" and d["mamba_num_heads"] == 8
    assert Layout.from_dict(d) == L
    # a model without a pattern writes none of the hybrid fields (its document is as before)
    dense = layout_from_flags(SMALL + ["--num-layers", "2"], world_size=1).to_dict()
    assert not any(k.startswith(("hybrid", "mamba")) for k in dense)


def test_validated_namespace_holds_both_spellings():
    # validate_args (0.19.2) copies --hybrid-override-pattern into hybrid_layer_pattern and keeps both: the hook's
    # namespace is read as the one pattern; on a command line both together are an error (test above)
    from argparse import Namespace
    from megatron_memguard import layout_from_megatron_args
    ns = Namespace(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128, max_position_embeddings=128,
                   micro_batch_size=1, global_batch_size=8, bf16=True, tokenizer_type="NullTokenizer", vocab_size=1024,
                   hybrid_layer_pattern="M*M-", hybrid_override_pattern="M*M-", mamba_head_dim=32, mamba_num_groups=2,
                   mamba_state_dim=16, position_embedding_type="none")
    assert layout_from_megatron_args(ns, world_size=1).hybrid_layer_pattern == "M*M-"
    ns.hybrid_override_pattern = "MM--"
    with pytest.raises(ConfigError, match="--hybrid-override-pattern: cannot be given"):
        layout_from_megatron_args(ns, world_size=1)


def test_megatron_lms_mamba_spec_flag_is_the_modelled_spec():
    # Megatron-LM's Mamba scripts pass --spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec
    # (0.19.2: a re-export of models/hybrid/hybrid_layer_specs.py's hybrid_stack_spec): the spec memguard models
    spec = "--spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec"
    assert _layout("M*M-", spec).num_layers == 4
    with pytest.raises(NotModelledError, match="--spec"):
        _layout("M*M-", "--spec my.module my_spec")
    with pytest.raises(NotModelledError, match="--spec: the hybrid stack spec without"):
        layout_from_flags(SMALL + ["--num-layers", "2"] + spec.split(), world_size=1)


def test_lora_on_a_hybrid_model_wraps_the_attention_and_mlp_layers():
    # Megatron-Bridge 0.6.2 matches target_modules by the module's own name: the default linear_qkv, linear_proj
    # (the '*' layer), linear_fc1, linear_fc2 (the '-' layer); the Mamba layers' in_proj / out_proj stay frozen
    from megatron_memguard.config import RawConfig
    from megatron_memguard.estimator.peft import adapter_param_count
    from megatron_memguard.resolve import resolve
    args = dict(hybrid_layer_pattern="M*M-", hidden_size=256, num_attention_heads=4, seq_length=128,
                max_position_embeddings=128, micro_batch_size=1, global_batch_size=8, bf16=True,
                tokenizer_type="NullTokenizer", vocab_size=1024, mamba_head_dim=32, mamba_num_groups=2,
                mamba_state_dim=16, position_embedding_type="none", peft_scheme="lora")
    L = resolve(RawConfig(args=args, world_size=1))
    # rank 32: qkv (256 + 768) x 32, proj (256 + 256) x 32, fc1 (256 + 1024) x 32, fc2 (1024 + 256) x 32
    assert adapter_param_count(L) == 32 * (1024 + 512 + 1280 + 1280) == 131_072
    # a frozen Mamba layer: in_proj keeps no norm output, out_proj no input (TE: backward_needs_input is
    # weight.requires_grad); the scan and the gated norm keep theirs
    la = layer_activations(L, True, LayerKind("mamba", "none"))
    assert "mamba_in_proj_input" not in la.saved and "mamba_out_proj_input" not in la.saved
    assert la.saved["mamba_zxbcdt"] == 128 * 1104 * 2
    # a pattern without '*' or '-' layers has nothing to wrap
    with pytest.raises((ConfigError, ConfigErrors), match="wraps no linear of the pattern"):
        resolve(RawConfig(args=dict(args, hybrid_layer_pattern="MMMM"), world_size=1))
    # exclude_modules: ModuleMatcher wraps every linear not excluded, the Mamba in_proj / out_proj (TE linears) too
    with pytest.raises(NotModelledError, match="Mamba layers' in_proj / out_proj wrapped"):
        resolve(RawConfig(args=dict(args, peft_target_modules=[], peft_exclude_modules=["output_layer"]), world_size=1))
    ok = resolve(RawConfig(args=dict(args, peft_target_modules=[],
                                     peft_exclude_modules=["output_layer", "in_proj", "out_proj"]), world_size=1))
    assert adapter_param_count(ok) == 131_072


@pytest.mark.parametrize("version, conv", [("0.17", "nn.Conv1d"), ("0.18", "nn.Conv1d"), ("0.19", "own")])
def test_conv1d_parameters_by_release(version, conv):
    # megatron-core 0.17.1 and 0.18.2 ssm/mamba_mixer.py still build self.conv1d = nn.Conv1d(...) after in_proj (its
    # own dt_bias, A_log, D come first in parameters()); 0.19.2 registers conv1d_weight / conv1d_bias on the mixer
    # before dt_bias (checked on the real 0.17.1 / 0.18.2 builds: test_parameters_match_this_venvs_megatron_core in
    # .venv312-core017 / -core018)
    L = layout_from_flags(SMALL + "--hybrid-layer-pattern M*M-".split(), world_size=1, megatron_version=version)
    names = [r[0] for r in mamba.param_rows(L)]
    if conv == "own":
        assert names[:3] == ["mixer.conv1d_weight", "mixer.conv1d_bias", "mixer.dt_bias"]
    else:
        assert names[:4] == ["mixer.dt_bias", "mixer.A_log", "mixer.D", "mixer.in_proj.layer_norm_weight"]
        assert names.index("mixer.conv1d.weight") == names.index("mixer.in_proj.weight") + 1
