"""Multi-latent attention (megatron-core's MLASelfAttention, TE spec).

Parameters are checked against megatron-core's own model built on CPU; memory against the GPU
memory Megatron-LM's CI measured for gpt3_mcore_te_tp2_pp2_mla (shared/groundtruth/).
"""
import json
import os
import sys

import pytest

from build_util import run_script   # tests/e2e scripts through a fork server (torch and megatron imported once)

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, MemguardError, NotModelledError
from megatron_memguard.estimator.params import chunk_params, total_parameters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from accuracy_megatron_ci import evaluate, load_records  # noqa: E402

# gpt3_mcore_te_tp2_pp2_mla's model (Megatron-LM tests/functional_tests/test_cases/gpt/)
CI_MLA = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--multi-latent-attention",
          "--q-lora-rank", "192", "--kv-lora-rank", "64", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
          "--v-head-dim", "16", "--seq-length", "1024", "--max-position-embeddings", "1024",
          "--micro-batch-size", "4", "--global-batch-size", "32", "--bf16", "--vocab-size", "50257"]


def _flags_for(cfg: dict) -> list[str]:
    f = ["--num-layers", str(cfg["num_layers"]), "--hidden-size", str(cfg["hidden_size"]),
         "--num-attention-heads", str(cfg["heads"]), "--ffn-hidden-size", str(cfg["ffn"]),
         "--multi-latent-attention", "--kv-lora-rank", str(cfg["kv_lora"]), "--qk-head-dim", str(cfg["qk"]),
         "--qk-pos-emb-head-dim", str(cfg["pe"]), "--v-head-dim", str(cfg["v"]), "--normalization", cfg["norm"],
         "--seq-length", str(cfg["seq"]), "--max-position-embeddings", str(cfg["seq"]),
         "--position-embedding-type", cfg["pos"], "--micro-batch-size", "1", "--global-batch-size", "8",
         "--make-vocab-size-divisible-by", "1", "--tokenizer-type", "GPT2BPETokenizer"]  # GPT-2 BPE: 50,257 tokens
    if cfg["q_lora"]:
        f += ["--q-lora-rank", str(cfg["q_lora"])]
    if not cfg["bias"]:
        f.append("--disable-bias-linear")
    if cfg["qk_ln"]:
        f.append("--qk-layernorm")
    if cfg["glu"]:
        f.append("--swiglu")
    return f


def test_attention_parameters_of_the_ci_model_by_hand():
    # per layer: linear_proj 512 x 8*16 + bias 512, q_down 192 x 512, q_up 8*(16+8) x 192,
    # kv_down (64+8) x 512, kv_up 8*(16+16) x 64 = 65,536 + 512 + 98,304 + 36,864 + 36,864 + 16,384
    L = layout_from_flags(CI_MLA, world_size=1)
    attn = [p for p in chunk_params(L, L.chunks[0]) if ".self_attention." in p.name and ".layers.0." in p.name]
    assert sum(p.numel for p in attn) == 254_464


CONFIGS = [
    # the CI model's attention: q and kv latents, LayerNorm, biases, learned positions
    dict(num_layers=2, hidden_size=512, heads=8, ffn=2048, q_lora=192, kv_lora=64, qk=16, pe=8, v=16,
         norm="LayerNorm", bias=True, qk_ln=False, glu=False, vocab=50257, seq=1024, pos="learned_absolute"),
    # DeepSeek-V2-Lite-like: queries projected directly, latent norms, RMSNorm, SwiGLU, no biases, rope
    dict(num_layers=2, hidden_size=1024, heads=16, ffn=2816, q_lora=None, kv_lora=128, qk=64, pe=32, v=64,
         norm="RMSNorm", bias=False, qk_ln=True, glu=True, vocab=50257, seq=512, pos="rope"),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["ci-mla", "no-q-lora"])
def test_parameters_match_megatron_core(cfg):
    pytest.importorskip("megatron.core")
    from benchmarks.referee.run import unsupported_reason
    if unsupported_reason() is not None:
        pytest.skip(unsupported_reason())
    out = run_script([sys.executable, os.path.join(ROOT, "tests", "e2e", "mla_param_count.py"), json.dumps(cfg)],
                     timeout=300, cwd=ROOT,
                     env={**os.environ, "MASTER_PORT": str(29600 + CONFIGS.index(cfg))})
    assert out.returncode == 0, out.stderr[-2000:]
    real = json.loads(out.stdout.strip().splitlines()[-1])
    L = layout_from_flags(_flags_for(cfg), world_size=1)
    mine = {p.name: p.numel for p in chunk_params(L, L.chunks[0])}
    assert sum(mine.values()) == sum(real.values()) == total_parameters(L)
    # the attention projections by name (norms sit in other modules in the TE spec)
    for name, n in real.items():
        if ".self_attention." in name and "layernorm" not in name:
            assert mine[name] == n, name


def test_megatron_ci_mla_records():
    # Megatron-LM CI, gpt3_mcore_te_tp2_pp2_mla on H100, A100 and GB200 (clean and flagged goldens):
    # steady after the step within 3%, peak within 5% (measured: +1.0% / -0.5% at worst)
    rows = [evaluate(r) for r in load_records(include_flagged=True) if r["model_args"].get("--multi-latent-attention")]
    assert len(rows) >= 6
    for r in rows:
        assert r.error is None, r.error
        assert abs(r.steady_err) <= 0.03, (r.id, r.steady_err)
        assert abs(r.peak_err) <= 0.05, (r.id, r.peak_err)


def test_terms_and_rules():
    est = estimate(layout_from_flags(CI_MLA + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], world_size=2))
    names = {t.name for t in est.stages[0].terms}
    assert {"parameters", "layer_activations", "dummy_wgrads"} <= names
    from megatron_memguard.report.text import describe_layout
    assert "8 heads (MLA, q rank 192, kv rank 64)" in describe_layout(est)
    with pytest.raises(ConfigError, match="--group-query-attention"):
        layout_from_flags(CI_MLA + ["--group-query-attention", "--num-query-groups", "2"], world_size=1)
    with pytest.raises(NotModelledError, match="--transformer-impl"):
        layout_from_flags(CI_MLA + ["--transformer-impl", "local"], world_size=1)
    with pytest.raises(ConfigError, match="--rope-type"):
        layout_from_flags(CI_MLA + ["--position-embedding-type", "rope", "--rope-type", "rope"], world_size=1)
    with pytest.raises(MemguardError, match="fujii2024"):
        estimate(layout_from_flags(CI_MLA, world_size=1), profile="fujii2024")


def test_up_projection_recompute_drops_query_key_value():
    from megatron_memguard.estimator.activations import layer_activations
    base = layout_from_flags(CI_MLA, world_size=1)
    rec = layout_from_flags(CI_MLA + ["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"],
                            world_size=1)
    # s*b = 4096 tokens, 8 heads: query and key 4096 x 8 x (16 + 8) x 2 B, value 4096 x 8 x 16 x 2 B are
    # dropped; the checkpoint keeps the whole kv down-projection output (its rope part, 4096 x 8 x 2 B,
    # included) where TE otherwise keeps a contiguous copy of the latent alone
    dropped = 2 * 4096 * 8 * 24 * 2 + 4096 * 8 * 16 * 2 - 4096 * 8 * 2
    assert layer_activations(base).total - layer_activations(rec).total == dropped


def test_input_norm_recompute_drops_its_output():
    # MLA's TE spec keeps input_layernorm as its own module: 'layernorm' recompute drops its output
    # [s*b, h] bf16 and its fp32 statistics (LayerNorm: mean and rstd per token)
    from megatron_memguard.estimator.activations import layer_activations
    base = layout_from_flags(CI_MLA, world_size=1)
    rec = layout_from_flags(CI_MLA + ["--recompute-granularity", "selective", "--recompute-modules", "layernorm"],
                            world_size=1)
    assert layer_activations(base).total - layer_activations(rec).total == 4096 * 512 * 2 + 4096 * 8


def test_rotary_tables_of_every_mla_layer():
    # CI model, last of 2 stages: 2 MLA layers, each with its own yarn rotary embedding. Unfused rope
    # (learned positions turn rope fusion off): the forward's lru-cached fp32 table [1024, 1, 1, 8] per
    # layer, plus the cos/sin buffers made at init for 4096 positions, in bf16 with the model.
    est = estimate(layout_from_flags(CI_MLA + ["--pipeline-model-parallel-size", "2"], world_size=2), device="cpu")
    rot = [t.bytes for t in est.stages[1].terms if t.name == "rotary_cache"]
    assert rot == [2 * 1024 * 8 * 4 + 2 * 2 * 4096 * 8 * 2]
