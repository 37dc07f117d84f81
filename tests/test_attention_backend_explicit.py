"""An explicit ``--attention-backend flash`` / ``fused`` where Transformer Engine has no such kernel is refused.

Megatron's backend switches the other two kernels off (language_module.py ``_set_attention_backend``, core 0.16.1 /
0.19.2: NVTE_FLASH_ATTN / NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN), so where TE's ``get_attention_backend`` (TE 2.11 /
2.20.2 ``pytorch/attention/dot_product_attention/utils.py``) filters the asked kernel out, DotProductAttention raises
"No dot product attention backend is available" at the first forward step. The kernel tables are corners7's compiled
query (benchmarks/results/te-attention-query.md); these cases are the rules named in the brief.
"""
from __future__ import annotations

import itertools

import pytest

from megatron_memguard import estimate, layout_from_flags, lookup_gpu
from megatron_memguard.decision import megatron_failure
from megatron_memguard.errors import ConfigError
from megatron_memguard.estimator.attention_backend import explicit_blocked, select

# Llama-3.1-8B shape (head dim 128, GQA 32/8), TP 2, seq 4096, BF16; MLA 192/128 (qk 128 + rope 64, v 128)
from test_attention_backend_auto import DET, LLAMA, MLA  # noqa: E402


def lay(*extra, version=None, env=None, mla=False):
    flags = LLAMA
    if mla:
        i = LLAMA.index("--group-query-attention")
        flags = LLAMA[:i] + LLAMA[i + 3:] + MLA
    return layout_from_flags(flags + list(extra), world_size=8, megatron_version=version, env=env)


def refused(L, gpu: str | None) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        estimate(L, gpu=lookup_gpu(gpu) if gpu else None)
    err = e.value
    assert err.key == "--attention-backend" and "\n" not in str(err)
    # the hook says where the run stops: TE's DotProductAttention at the first forward step
    assert "first forward step" in megatron_failure(err)
    return err


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
def test_fused_on_a100_under_determinism(version):
    # "Filter: Determinism" (TE 2.11 / 2.20.2 utils.py): F16_arbitrary_seqlen is not deterministic below sm90
    err = refused(lay("--attention-backend", "fused", version=version, env=DET), "A100")
    assert "sm80" in str(err) and "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0" in str(err)
    err = refused(lay("--attention-backend", "fused", "--deterministic-mode", version=version), "A100")
    assert "--deterministic-mode" in str(err)
    # sm90 keeps a deterministic cuDNN backward; the A100 without determinism has cuDNN for head dim 128
    assert estimate(lay("--attention-backend", "fused", version=version, env=DET), gpu=lookup_gpu("H100")).stages
    assert estimate(lay("--attention-backend", "fused", version=version), gpu=lookup_gpu("A100")).stages


def test_fused_mla_192_128_on_a100_under_te_2_11():
    # compiled query, TE 2.11.0: No_Backend for MLA 192/128 on sm80; F16_arbitrary_seqlen on sm90
    err = refused(lay("--attention-backend", "fused", version="0.16.1", mla=True), "A100")
    assert "MLA 192/128" in str(err) and "sm80" in str(err)
    assert estimate(lay("--attention-backend", "fused", version="0.16.1", mla=True), gpu=lookup_gpu("H100")).stages


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
@pytest.mark.parametrize("gpu", ["B200", "GB200"])
@pytest.mark.parametrize("d", [136, 192, 256])
def test_fused_head_dims_136_to_256_on_blackwell(version, gpu, d):
    # compiled query (TE 2.11.0 and 2.20.2): No_Backend for equal head dims 136..256 on sm100, 128 trains
    err = refused(lay("--attention-backend", "fused", "--kv-channels", str(d), version=version), gpu)
    assert f"kv_channels {d}" in str(err) and "sm100" in str(err)
    assert estimate(lay("--attention-backend", "fused", "--kv-channels", "128", version=version),
                    gpu=lookup_gpu(gpu)).stages
    # Hopper trains them up to 256
    assert estimate(lay("--attention-backend", "fused", "--kv-channels", str(d), version=version),
                    gpu=lookup_gpu("H100")).stages


@pytest.mark.parametrize("d", [264, 100])
def test_flash_head_dim_above_256_or_not_a_multiple_of_8(d):
    # get_attention_backend: flash-attn 2 needs head_dim % 8 == 0 and head_dim <= 256 (TE 2.11 / 2.20.2), on every GPU
    for gpu in ("A100", "H100", None):
        err = refused(lay("--attention-backend", "flash", "--kv-channels", str(d)), gpu)
        assert f"kv_channels {d}" in str(err) and "<= 256" in str(err)


@pytest.mark.parametrize("backend", ["flash", "unfused"])
def test_flash_with_fp8_attention(backend):
    # FP8 attention runs only in cuDNN (TE 2.11 get_attention_backend drops flash-attn and the unfused backend for
    # FP8 training); refused where the flags are read (resolve/fp8.py), with where Megatron stops
    from megatron_memguard.errors import MemguardError
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    from megatron_memguard.resolve import resolve
    raw = parse_megatron_flags(LLAMA + ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--attention-backend", backend])
    raw.args.update(fp8_dot_product_attention=True)     # a TransformerConfig key, no Megatron flag
    with pytest.raises(MemguardError) as e:
        resolve(raw, world_size=8)
    assert "needs --attention-backend fused or auto" in str(e.value) and f"not {backend}" in str(e.value)
    assert "first forward step" in megatron_failure(e.value)


@pytest.mark.parametrize("fa, gpu, runs", [(3, "H100", True), (3, "A100", False), (3, "B200", False),
                                           (4, "A100", False), (4, "H100", True), (4, "B200", True)])
def test_flash_attention_version_generation_runs_where_it_exists(fa, gpu, runs):
    # TE 2.20.2 (megatron-core 0.19.2 switches the other generations off): flash-attn 3 only on sm90, flash-attn 4
    # not below sm90
    L = lay("--attention-backend", "flash", "--flash-attention-version", str(fa), version="0.19.2")
    if runs:
        assert explicit_blocked(L, lookup_gpu(gpu)) is None
    else:
        assert f"flash-attn {fa}" in str(refused(L, gpu))


def test_auto_never_selects_a_kernel_an_explicit_backend_is_refused_for():
    # one predicate: where auto models flash or fused, the same kernel asked for explicitly is estimated
    for gpu, version, det, d in itertools.product(("A100", "H100", "B200"), ("0.16.1", "0.19.2"), (False, True),
                                                  (64, 128, 192, 256, 264)):
        g = lookup_gpu(gpu)
        L = lay("--kv-channels", str(d), version=version, env=DET if det else None)
        chosen = select(L, g).selected
        for backend in ("flash", "fused"):
            blocked = explicit_blocked(L.replace(attention_backend=backend), g)
            if chosen == backend:
                assert blocked is None, (gpu, version, det, d, backend)
        if chosen == "unfused":
            assert explicit_blocked(L.replace(attention_backend="flash"), g)
            assert explicit_blocked(L.replace(attention_backend="fused"), g)


def test_unfused_and_local_are_never_refused_here():
    for backend in ("unfused", "auto"):
        assert explicit_blocked(lay("--attention-backend", backend, "--kv-channels", "264", env=DET),
                                lookup_gpu("A100")) is None
