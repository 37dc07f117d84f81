"""Which Transformer Engine a run has (estimator/te_release.py) and what FP8 attention keeps under it, by hand.

Sources (the TE wheels 2.11.0, 2.12.0, 2.13.0, 2.14.0, 2.14.1, 2.15.0, 2.16.1, 2.17.1, 2.18.0, 2.19.0, 2.20.2, read
with ``pip download --no-deps --only-binary=:all: transformer-engine==X``):
* FP8 softmax statistics: up to 2.14.1 ``cpp_extensions/fused_attn.py`` fused_attn_bwd requires "aux_ctx_tensors ...
  [M, ZInv, rng_state] for FP8 fused attention" and context_parallel.py unpacks ``softmax_lse_per_step, _,
  rng_states = aux_ctx_tensors``; from 2.15.0 "ZInv: ... only allocated for T3HD path" and ``softmax_lse_per_step,
  rng_states = aux_ctx_tensors`` (megatron-core hands separate q, k, v: never t3hd).
* CP ring: ``out_part = out.to(fwd_nominal_dtype)`` first in 2.15.0; ``p2p_comm_buffers = [None, None]`` first in
  2.20.2 (2.19.0: ``[None for _ in range(cp_size)]``).
* NVTE_DPA_FP8_RECIPE: dot_product_attention.py ``init_fp8_metadata`` (2.11.0, 2.20.2; the MXFP8 branches from
  2.15.0); the attention's quantizers follow ``fp8_meta["local_recipes"][0]`` (backends.py).
* megatron-core 0.16.1 METADATA: ``transformer-engine[core_cu13,pytorch]<2.12.0,>=2.9.0a0; extra == "dev"``;
  0.19.2: ``transformer-engine[core_cu13,pytorch]; extra == "te"`` (no version)."""
from importlib import metadata

import pytest

from megatron_memguard._integration import with_installed_te
from megatron_memguard.config import RawConfig
from megatron_memguard.errors import ConfigError, ConfigErrors
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.estimator.te_release import (attention_recipe, default_te_version, fp8_softmax_stats,
                                                    te_env_problems)
from megatron_memguard.readers.megatron_flags import parse_megatron_flags
from megatron_memguard.resolve import resolve

from test_fp8_attention import A_T, BASE, CTX, G_T, QKV_W, TF, D

DS = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"]
STAT = 1 * A_T * 8192 * 4        # one fp32 statistic [b, a/TP, s, 1]


def lay(*extra, env=None, version=None, **config):
    raw = parse_megatron_flags(BASE + list(extra), env=env)
    raw.args.update(config)
    return resolve(raw, world_size=16, megatron_version=version)


def test_default_te_per_core_release():
    assert default_te_version("0.16.1") == "2.11"
    assert default_te_version("0.16") == "2.11"
    for core in ("0.17.1", "0.18.2", "0.19", "0.19.2"):
        assert default_te_version(core) == "2.20.2"
    # the installed megatron-core's own TE requirement (the venv's wheel METADATA): 0.16 pins TE below 2.12
    core = metadata.version("megatron-core")
    te_req = [r for r in metadata.requires("megatron-core") or () if r.startswith("transformer-engine")]
    if core.startswith("0.16."):
        assert any("<2.12.0" in r for r in te_req)
    else:
        assert te_req and not any("<" in r.split(";")[0] for r in te_req)


@pytest.mark.parametrize("te,n", [("2.11", 2), ("2.11.0", 2), ("2.14.1", 2), ("2.15.0", 1), ("2.19.0", 1),
                                  ("2.20.2", 1)])
def test_softmax_statistics_by_te_release(te, n):
    assert fp8_softmax_stats({"MEMGUARD_TE_VERSION": te}, "0.19.2") == n
    L = lay(*DS, env={"MEMGUARD_TE_VERSION": te}, fp8_dot_product_attention=True)
    assert layer_activations(L).saved["softmax_stats"] == n * STAT


def test_softmax_statistics_follow_the_core_release():
    # no MEMGUARD_TE_VERSION: core 0.16 runs TE 2.11 (M and ZInv), core 0.19 TE 2.20.2 (one)
    for version, n in (("0.16.1", 2), ("0.19.2", 1)):
        L = lay(*DS, version=version, fp8_dot_product_attention=True)
        assert layer_activations(L).saved["softmax_stats"] == n * STAT


def test_the_job_s_transformer_engine_wins():
    # inside a job the hook sets MEMGUARD_TE_VERSION from transformer_engine.__version__ (a local build's "+git..."
    # suffix dropped), over the variable the launch gave
    raw = RawConfig(args={}, env={"MEMGUARD_TE_VERSION": "2.20.2"})
    assert with_installed_te(raw, "2.14.1+abc123").env["MEMGUARD_TE_VERSION"] == "2.14.1"
    assert with_installed_te(raw, "not a version") is raw
    assert with_installed_te(RawConfig(args={}), "").env == {}


def test_ring_rules_follow_the_te_release():
    from megatron_memguard.estimator.layers.attention import _te_keeps_every_cp_step, _te_ring_out_part
    cp = ["--context-parallel-size", "2"]
    for te, every_step, out_part in (("2.11", True, False), ("2.14.1", True, False), ("2.15.0", True, True),
                                     ("2.19.0", True, True), ("2.20.2", False, True)):
        L = lay(*cp, env={"MEMGUARD_TE_VERSION": te})
        assert (_te_keeps_every_cp_step(L), _te_ring_out_part(L)) == (every_step, out_part)


@pytest.mark.parametrize("value,bad", [("2.x", True), ("latest", True), ("1.13.0", True), ("v2.14", True),
                                       ("2.14", False)])
def test_bad_te_version_is_an_error_naming_the_variable(value, bad):
    problems = te_env_problems({"MEMGUARD_TE_VERSION": value})
    assert bool(problems) == bad
    assert te_env_problems({"MEMGUARD_TE_VERSION": " "}) == []      # exported empty: unset
    if bad:
        with pytest.raises((ConfigError, ConfigErrors), match="MEMGUARD_TE_VERSION.*Transformer Engine"):
            lay(*DS, env={"MEMGUARD_TE_VERSION": value})


def test_bad_dpa_recipe_is_an_error_naming_the_variable():
    # TE compares the value with its four names and ignores anything else without a word: a typo is an error here
    with pytest.raises((ConfigError, ConfigErrors), match="NVTE_DPA_FP8_RECIPE.*must be one of F16, DelayedScaling"):
        lay(*DS, env={"NVTE_DPA_FP8_RECIPE": "delayed"}, fp8_dot_product_attention=True)


def test_dpa_recipe_table():
    # init_fp8_metadata's switches (TE 2.20.2 table "Linear / Attention / Configuration")
    new, old = {"MEMGUARD_TE_VERSION": "2.20.2"}, {"MEMGUARD_TE_VERSION": "2.11"}
    var = "NVTE_DPA_FP8_RECIPE"
    for linear in ("delayed", "tensorwise", "mxfp8"):
        assert attention_recipe(linear, new, "0.19.2") == linear                 # unset: the linear recipe
        assert attention_recipe(linear, {**new, var: "F16"}, "0.19.2") is None  # fp8_dpa cleared
    assert attention_recipe("delayed", {**new, var: "Float8CurrentScaling"}, "0.19.2") == "tensorwise"
    assert attention_recipe("tensorwise", {**new, var: "DelayedScaling"}, "0.19.2") == "delayed"
    assert attention_recipe("mxfp8", {**new, var: "DelayedScaling"}, "0.19.2") == "delayed"
    assert attention_recipe("nvfp4", {**new, var: "Float8CurrentScaling"}, "0.19.2") == "tensorwise"
    assert attention_recipe("delayed", {**new, var: "MXFP8BlockScaling"}, "0.19.2") == "mxfp8"
    assert attention_recipe("nvfp4", new, "0.19.2") == "nvfp4"                   # no switch: refused by resolve
    # TE 2.11 has no MXFP8 branch: the variable does nothing, nor DelayedScaling under an MXFP8 linear recipe
    assert attention_recipe("delayed", {**old, var: "MXFP8BlockScaling"}, "0.19.2") == "delayed"
    assert attention_recipe("mxfp8", {**old, var: "DelayedScaling"}, "0.19.2") == "mxfp8"


def test_f16_turns_fp8_attention_off():
    L = lay(*DS, env={"NVTE_DPA_FP8_RECIPE": "F16"}, fp8_dot_product_attention=True)
    assert not L.fp8_spec.fp8_dot_product_attention and any("NVTE_DPA_FP8_RECIPE=F16" in n for n in L.notes)
    assert layer_activations(L).saved == layer_activations(lay(*DS)).saved


def test_current_scaling_attention_under_delayed_linears():
    # FP8DS linears, NVTE_DPA_FP8_RECIPE=Float8CurrentScaling: the attention's QKV/O/dO/dQKV quantizers are current
    # scaling ones; its BF16 output is saved (NVTE_DPA_FP8CS_O_in_F16=1), linear_proj keeps its own FP8 copy
    # (delayed linears: fp8_proj_input); TE 2.20.2's one statistic
    L = lay(*DS, env={"NVTE_DPA_FP8_RECIPE": "Float8CurrentScaling"}, fp8_dot_product_attention=True)
    assert L.fp8_spec.fp8_dot_product_attention and any("runs in Float8CurrentScaling" in n for n in L.notes)
    got = layer_activations(L).saved
    delayed = layer_activations(lay(*DS, fp8_dot_product_attention=True)).saved
    assert got["proj_input"] == 2 * TF * CTX and delayed["proj_input"] == TF * CTX + 512
    assert got["fp8_proj_input"] == delayed["fp8_proj_input"]
    assert got["fp8_attention_qkv"] == TF * QKV_W + 512 and got["softmax_stats"] == STAT
    # the same variable naming the recipe already in use changes nothing
    same = lay(*DS, env={"NVTE_DPA_FP8_RECIPE": "DelayedScaling"}, fp8_dot_product_attention=True)
    assert layer_activations(same).saved == delayed


def test_nvfp4_needs_a_switch():
    fp4 = ["--fp4-format", "e2m1"]
    with pytest.raises(ConfigError, match="nvfp4 recipe.*no attention backend"):
        lay(*fp4, fp8_dot_product_attention=True, version="0.19.2")
    L = lay(*fp4, env={"NVTE_DPA_FP8_RECIPE": "DelayedScaling"}, fp8_dot_product_attention=True, version="0.19.2")
    assert L.fp8_spec.fp8_dot_product_attention
    got = layer_activations(L).saved
    # delayed-scaling FP8 attention: the FP8 q, k, v buffer and the FP8 output (1 B/elem + its 512-byte scale);
    # linear_proj under NVFP4 keeps the BF16 output it reads (set_save_original_input, attention.py 0.19.2)
    assert got["fp8_attention_qkv"] == TF * QKV_W + 512 and got["fp8_attention_output"] == TF * CTX + 512
    assert got["proj_input"] == 2 * TF * CTX


def test_delayed_attention_under_current_scaling_linears():
    # FP8CS linears, NVTE_DPA_FP8_RECIPE=DelayedScaling: FusedAttnFunc saves its FP8 output (fp8_tensors = (q_fp8,
    # k_fp8, v_fp8, out_fp8), backends.py) and returns the dequantized BF16 one, which linear_proj keeps
    # (set_save_original_input for every recipe but delayed): both stay, as under the output gate
    cs = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    L = lay(*cs, env={"NVTE_DPA_FP8_RECIPE": "DelayedScaling"}, fp8_dot_product_attention=True)
    got = layer_activations(L).saved
    plain = layer_activations(lay(*cs, fp8_dot_product_attention=True)).saved
    assert got["proj_input"] == plain["proj_input"] == 2 * TF * CTX
    assert got["fp8_attention_output"] == TF * CTX + 512 and "fp8_attention_output" not in plain
    assert "fp8_proj_input" not in got
    assert sum(got.values()) - sum(plain.values()) == TF * CTX + 512


def test_mxfp8_attention_by_switch_needs_te_2_15():
    from megatron_memguard.estimator.layers.fp8_attention import mxfp8_attention_tensors
    env = {"NVTE_DPA_FP8_RECIPE": "MXFP8BlockScaling"}
    L = lay(*DS, env=env, fp8_dot_product_attention=True, version="0.19.2")
    got = layer_activations(L).saved
    # MXFP8 q, k, v rowwise and columnwise with their scales; the output stays BF16 (test_fp8_attention mxfp8 tests)
    assert got["fp8_attention_qkv"] == mxfp8_attention_tensors(TF, ((A_T, D), (G_T, D), (G_T, D)))
    assert got["proj_input"] == 2 * TF * CTX
    # TE 2.14.1 has neither the switch nor MXFP8 attention: the variable does nothing (noted), delayed stays
    L = lay(*DS, env={**env, "MEMGUARD_TE_VERSION": "2.14.1"}, fp8_dot_product_attention=True, version="0.19.2")
    assert any("does not switch" in n for n in L.notes)
    assert layer_activations(L).saved["proj_input"] == TF * CTX + 512
    # an MXFP8 linear recipe with fp8_dpa on a TE before 2.15: no MXFP8 attention to run
    with pytest.raises(ConfigError, match="needs Transformer Engine 2.15 or later"):
        lay("--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", env={"MEMGUARD_TE_VERSION": "2.14.1"},
            fp8_dot_product_attention=True, version="0.19.2")


def test_installed_te_version_is_read_from_the_loaded_module(monkeypatch):
    import sys
    import types

    from megatron_memguard._integration import installed_te_version, run_preflight
    monkeypatch.setitem(sys.modules, "transformer_engine", types.SimpleNamespace(__version__="2.14.1+cu13"))
    assert installed_te_version() == "2.14.1"
    # the framework callbacks' preflight resolves with it: the FP8 kernel's M and ZInv of TE 2.14
    r = run_preflight(lambda: parse_megatron_flags(BASE + DS), world_size=16, mode="report", gpu="H100-80GB",
                      emit=lambda s: None, environ={})
    assert r.raw.env["MEMGUARD_TE_VERSION"] == "2.14.1"
    # a module without a version (a stub) and no distribution: nothing is set, nothing raises
    monkeypatch.setitem(sys.modules, "transformer_engine", types.SimpleNamespace())
    assert installed_te_version() is None


def test_mxfp8_linears_with_current_scaling_attention_under_cp():
    # NVTE_DPA_FP8_RECIPE=Float8CurrentScaling runs the CP attention in current scaling (TE >= 2.15 has the mxfp8 ->
    # CS branch): the all-to-all's exchanged q, k, v at 1 B/elem in one FP8 buffer (+ a 512 B scale), where MXFP8
    # keeps them both ways (2 B/elem + E8M0 scales: test_fp8_attention.py test_mxfp8_a2a_*); the FP8 ring's last K/V
    # buffer [2, s/CP, b, g/t, d] at 1 B/elem, where MXFP8's stays BF16
    mx = ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--context-parallel-size", "2"]
    cs = {"NVTE_DPA_FP8_RECIPE": "Float8CurrentScaling"}
    a2a = [layer_activations(lay(*mx, "--cp-comm-type", "a2a", env=env, fp8_dot_product_attention=True,
                                 version="0.19.2")).saved["fp8_attention_qkv"] for env in (None, cs)]
    assert a2a == [2 * 4096 * QKV_W + 8192 * 12 * 4 + 8192 // 32 * 12 * 128, 4096 * QKV_W + 512]
    assert layer_activations(lay(*mx, fp8_dot_product_attention=True, version="0.19.2")).saved["cp_kv_buffer"] == (
        2 * 2 * 4096 * G_T * D)
    L = lay(*mx, env={"NVTE_DPA_FP8_RECIPE": "Float8CurrentScaling"}, fp8_dot_product_attention=True,
            version="0.19.2")
    got = layer_activations(L).saved
    assert got["cp_kv_buffer"] == 2 * 4096 * G_T * D
    assert got["fp8_attention_qkv"] == 4096 * QKV_W + 512


def test_flash_on_mla_follows_the_te_release():
    # TE 2.16.1 utils.py: "Disabling FlashAttention 2 as it does not support MLA." (head_dim_qk != head_dim_v);
    # TE 2.17.0 dot_product_attention.py _pad_qkv_head_dim pads the smaller head dim (the same as 2.20.2)
    from megatron_memguard import layout_from_flags, lookup_gpu
    from megatron_memguard.estimator.attention_backend import select
    from test_attention_backend_auto import LLAMA, MLA
    i = LLAMA.index("--group-query-attention")
    flags = LLAMA[:i] + LLAMA[i + 3:] + MLA         # MLA 192/128, no GQA
    a100 = lookup_gpu("A100")
    for te, flash in (("2.16.1", False), ("2.17.0", True), (None, True)):
        env = {"MEMGUARD_TE_VERSION": te} if te else {}
        L = layout_from_flags(flags, world_size=8, megatron_version="0.19.2", env=env)
        assert (select(L, a100).selected == "flash") == flash
        if flash:
            assert layout_from_flags(flags + ["--attention-backend", "flash"], world_size=8,
                                     megatron_version="0.19.2", env=env).attention_backend == "flash"
        else:
            with pytest.raises((ConfigError, ConfigErrors), match="Transformer Engine 2.16.1.*before TE 2.17"):
                layout_from_flags(flags + ["--attention-backend", "flash"], world_size=8, megatron_version="0.19.2",
                                  env=env)
