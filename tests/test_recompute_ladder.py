"""Autotune's recompute ladder (megatron_memguard/recompute_ladder.py, issue 16): selective --recompute-modules
sets, least extra forward work per byte freed first, before full recomputation; only sets Megatron accepts
for the job (TransformerConfig.__post_init__, megatron-core 0.16.1 and 0.19.2; the 3.12 suite takes the
tuned command line through the real validate_args and TransformerConfig: tests/test_hook_container.py).

The model: DeepSeek-V3's layer shape (its config.json: hidden 7168, 128 heads, MLA q rank 1536, kv rank 512,
qk 128 + rope 64, v 128, 2048-wide routed and shared experts, top-8, one dense layer of 18432 first), 16 layers
with 64 experts, at 16k tokens on 64 H100s (TP 2, EP 8, PP 4: PP 8 and 16 would break the expert grid
ETP 2 x EP 8 x PP <= 64, and MBS is 1 already, so recomputation is the only knob left)."""
import pytest

from megatron_memguard import estimate, lookup_gpu, resolve
from megatron_memguard.autotune import autotune
from megatron_memguard.cli.check import _spelled
from megatron_memguard.readers.megatron_flags import parse_megatron_flags
from megatron_memguard.readers.models import read_model
from megatron_memguard.recompute_ladder import _flops

H100 = lookup_gpu("H100-80GB")
DSV3_LIKE = ("--num-layers 16 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 "
             "--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 "
             "--v-head-dim 128 --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
             "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 "
             "--num-experts 64 --moe-router-topk 8 --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048 "
             "--moe-layer-freq ([0]*1+[1]*15) --moe-grouped-gemm --moe-token-dispatcher-type alltoall "
             "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.001 "
             "--tokenizer-type NullTokenizer --vocab-size 129280 --bf16 --use-distributed-optimizer "
             "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 8 "
             "--pipeline-model-parallel-size 4 --micro-batch-size 1 --global-batch-size 64").split()


def dsv3(seq: int = 16384, *extra: str):
    return parse_megatron_flags(DSV3_LIKE + ["--seq-length", str(seq), "--max-position-embeddings", str(seq), *extra])


def tuned(raw, world=64):
    return autotune(raw, world_size=world, gpu=H100, allow_recompute=True)


def peak(raw, world=64, **updates):
    return estimate(resolve(raw.with_args(**updates), world_size=world), gpu=H100)


def test_forward_flops_per_token_by_hand():
    L = resolve(dsv3(), world_size=64)
    h, n, moe_layers = 7168, 16, 15
    assert _flops(L, "layernorm") == 2 * h * n                                      # two norms, one FLOP per element
    assert _flops(L, "moe_act") == 8 * 2048 * 2 * moe_layers                        # SwiGLU input of 8 routed copies
    assert _flops(L, "mla_up_proj") == 2 * (1536 * 128 * 192 + 512 * 128 * 256) * n  # q and kv up-projections
    assert _flops(L, "shared_experts") == 2 * 3 * h * 2048 * moe_layers
    assert _flops(L, "moe") == 2 * (3 * h * (8 * 2048 + 2048) + h * 64) * moe_layers  # experts, shared, router
    assert _flops(L, "mlp") == 2 * 3 * h * 18432 * 1                                 # the one dense layer
    assert _flops(L, "core_attn") == 2 * 128 * (192 + 128) * 8192 * n                # causal half of 16k keys


def test_stops_at_the_first_rung_that_fits_and_the_estimate_is_memguard_estimates():
    raw = dsv3()
    r = tuned(raw)
    assert r.status == "changed" and r.original.verdict == "will not fit"
    L = r.chosen.layout
    assert L.recompute_granularity == "selective" and L.pp == 4 and L.micro_batch_size == 1
    mods = list(L.recompute_modules)
    # 'moe' replaces moe_act (its checkpoint wraps the whole MoE block)
    assert "moe" in mods and "moe_act" not in mods and "shared_experts" not in mods
    # every smaller set of the ladder (its rungs in order) stays over the threshold: the search stopped at the first
    rung_lines = next(x for x in r.reasons if x.startswith("recompute ladder"))
    added = [part.split()[0].lstrip("+") for part in rung_lines.split(": ", 1)[1].split("; ")[:-1]]
    assert added[:2] == ["layernorm", "moe_act"]              # element-wise: next to no forward work
    k = added.index("moe")
    below: list[str] = []
    for m in added[:k]:
        below = [x for x in below if not (m == "moe" and x in ("moe_act", "shared_experts"))] + [m]
        e = peak(raw, recompute_granularity="selective", recompute_modules=below)
        assert e.verdict != "fits", below
    # the suggestion's estimate is memguard estimate's with the suggested flags
    text = " ".join(_spelled(raw, dest, new) for dest, (_, new) in r.changes.items())
    assert text == "--recompute-granularity selective --recompute-modules " + " ".join(mods)
    again = estimate(resolve(dsv3(16384, *text.split()), world_size=64), gpu=H100)
    assert again.peak_device_bytes == r.chosen.estimate.peak_device_bytes and again.verdict == "fits"
    assert again.peak_device_bytes <= 0.8 * again.gpu_memory_bytes


def test_a_shorter_sequence_stops_at_a_lower_rung():
    r = tuned(dsv3(12288))
    mods = r.chosen.layout.recompute_modules
    assert r.chosen.layout.recompute_granularity == "selective" and "moe" not in mods and "layernorm" in mods
    assert r.chosen.estimate.verdict == "fits"


def _proposed(r):
    """Every recompute module set the search estimated (the chosen one and the nearest)."""
    return [set(c.layout.recompute_modules) for c in (r.chosen, *r.nearest)
            if c is not None and c.layout.recompute_granularity == "selective"]


def test_moe_act_only_with_grouped_gemm():
    # TransformerConfig: "moe_act in recompute_modules is only supported with moe_grouped_gemm"
    raw = parse_megatron_flags([a for a in DSV3_LIKE if a != "--moe-grouped-gemm"]
                               + ["--seq-length", "16384", "--max-position-embeddings", "16384"])
    r = tuned(raw)
    assert r.chosen is not None and "moe_act" not in r.chosen.layout.recompute_modules
    assert any("moe_act (moe_act is only supported with --moe-grouped-gemm)" in x for x in r.reasons)


def test_no_shared_experts_with_shared_expert_overlap():
    # TransformerConfig: "shared_experts recompute cannot work with --moe-shared-expert-overlap"
    r = tuned(dsv3(16384, "--moe-shared-expert-overlap"))
    assert _proposed(r) and all("shared_experts" not in s for s in _proposed(r))
    assert any("shared_experts (shared_experts recompute cannot work" in x for x in r.reasons)


def test_no_moe_and_no_full_with_the_expert_all_to_all_overlap():
    # TransformerConfig (0.19.2): the overlap refuses full recompute and 'moe' in --recompute-modules;
    # with PP > 1 it needs virtual stages (4 per rank here)
    r = tuned(dsv3(16384, "--overlap-moe-expert-parallel-comm", "--num-virtual-stages-per-pipeline-rank", "2"))
    assert _proposed(r) and all("moe" not in s for s in _proposed(r))
    assert r.chosen is None or r.chosen.layout.recompute_granularity != "full"
    assert any("recompute modules not tried: moe (cannot be used with 'moe' in --recompute-modules)" in x
               for x in r.reasons)
    assert any("full recomputation not tried" in x for x in r.reasons)


def test_no_moe_act_or_layernorm_with_delayed_fp8():
    # TransformerConfig: "Delayed scaling does not support moe_act and layernorm recompute for fp8"
    r = tuned(dsv3(16384, "--fp8-format", "hybrid", "--fp8-recipe", "delayed"))
    assert _proposed(r) and all(not s & {"moe_act", "layernorm"} for s in _proposed(r))
    assert any(x.startswith("recompute modules not tried: layernorm (") for x in r.reasons)


def test_moe_layer_recompute_keeps_moe_and_adds_no_inner_moe_checkpoint():
    # --moe-layer-recompute means selective with 'moe' added (TransformerConfig); full is refused with it
    r = tuned(dsv3(32768, "--moe-layer-recompute"))
    assert r.status == "changed" and _proposed(r)
    for s in _proposed(r):
        assert {"moe", "core_attn"} <= s and not s & {"moe_act", "shared_experts"}   # core_attn: Megatron's default set
    assert r.chosen.layout.recompute_granularity == "selective"
    assert any("full recomputation not tried: --moe-layer-recompute" in x for x in r.reasons)


def test_dense_models_get_no_moe_or_mla_modules():
    from conftest import LLAMA31_8B
    raw = parse_megatron_flags(LLAMA31_8B + ["--micro-batch-size", "1", "--tensor-model-parallel-size", "8",
                                             "--sequence-parallel", "--seq-length", "65536",
                                             "--max-position-embeddings", "65536"])
    r = autotune(raw, world_size=8, gpu=H100, allow_recompute=True)
    line = next(x for x in r.reasons if x.startswith("recompute ladder"))
    for m in ("moe", "moe_act", "shared_experts", "mla_up_proj"):
        assert f"+{m} " not in line


def test_bridge_deepseek_v3_recipe_takes_the_cheap_element_wise_rung():
    # Bridge's DeepSeek-V3 recipe on its 1,024 H100s (PP 16 fixed by its layout, MBS 1) is tight without
    # recomputation (85%); recomputing the norms and the expert activation is enough, where the old search
    # jumped to full recomputation of every layer
    raw = read_model("deepseek_v3").with_args(moe_flex_dispatcher_backend="deepep")
    r = autotune(raw, world_size=1024, gpu=H100, allow_recompute=True)
    assert r.original.verdict == "tight"
    assert r.changes == {"recompute_granularity": (None, "selective"),
                         "recompute_modules": (None, ["layernorm", "moe_act"])}
    assert [_spelled(raw, d, new) for d, (_, new) in r.changes.items()] == [
        "model.recompute_granularity=selective", "model.recompute_modules=[layernorm,moe_act]"]
    again = estimate(resolve(raw.with_args(recompute_granularity="selective", recompute_modules=["moe_act", "layernorm"]),
                             world_size=1024), gpu=H100)
    assert again.peak_device_bytes == r.chosen.estimate.peak_device_bytes and again.verdict == "fits"
    # each of the two alone is not enough: the rung below stays tight
    assert peak(raw, 1024, recompute_granularity="selective", recompute_modules=["moe_act"]).verdict == "tight"


@pytest.mark.parametrize("extra, grouped", [((), True), (("--moe-shared-expert-overlap",), True), ((), False)],
                         ids=["dsv3-like", "shared-expert-overlap", "no-grouped-gemm"])
def test_every_proposed_set_is_one_megatron_core_accepts(extra, grouped):
    # the installed megatron-core's own TransformerConfig.__post_init__ (0.16.1 under Python 3.11, 0.19.2 under
    # 3.12) takes every selective set the search estimated; it does refuse the combinations the ladder leaves out
    torch = pytest.importorskip("torch")
    tc = pytest.importorskip("megatron.core.transformer.transformer_config")
    flags = [a for a in DSV3_LIKE if grouped or a != "--moe-grouped-gemm"]
    r = tuned(parse_megatron_flags(flags + ["--seq-length", "16384", "--max-position-embeddings", "16384", *extra]))
    kw = dict(num_layers=16, hidden_size=7168, num_attention_heads=128, ffn_hidden_size=18432, multi_latent_attention=True,
              q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
              num_moe_experts=64, moe_router_topk=8, moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
              moe_shared_expert_overlap=bool(extra), moe_grouped_gemm=grouped, moe_token_dispatcher_type="alltoall",
              tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=8,
              pipeline_model_parallel_size=4, bf16=True, pipeline_dtype=torch.bfloat16, add_bias_linear=False,
              gated_linear_unit=True, recompute_granularity="selective")
    sets = _proposed(r)
    assert sets
    for s in sets:
        cfg = tc.MLATransformerConfig(**kw, recompute_modules=sorted(s))
        assert set(cfg.recompute_modules) == s
    left_out = "shared_experts" if extra else None if grouped else "moe_act"
    if left_out:
        with pytest.raises(ValueError, match=left_out):
            tc.MLATransformerConfig(**kw, recompute_modules=[left_out])


@pytest.mark.parametrize("extra, left_out", [
    (("--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn", "moe_router"), {"moe"}),
    (("--cuda-graph-impl", "transformer_engine", "--hidden-dropout", "0.1"), {"mlp", "moe"}),
], ids=["te-graphed-router", "graphed-layers-with-dropout"])
def test_cuda_graph_rules_leave_modules_out(extra, left_out):
    # TransformerConfig.__post_init__ (0.19.2 transformer_config.py, "recompute module should be inside or outside
    # of the graph scope"): no 'moe' recompute around the TE implementation's moe_router graph; no recompute of a
    # graphed MLP / MoE with hidden dropout (an empty module list graphs the whole layer)
    r = tuned(dsv3(16384, *extra))
    assert _proposed(r) and all(not s & left_out for s in _proposed(r))
    note = next(x for x in r.reasons if x.startswith("recompute modules not tried: "))
    assert all(f"{m} (" in note for m in left_out)
