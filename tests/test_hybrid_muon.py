"""The emerging optimizers (Muon, Lion, SOAP) on a hybrid Mamba model: a Mamba mixer's in_proj and out_proj are
matrices the emerging optimizer updates; its 3-D causal conv1d weight, its conv bias, dt_bias, A_log, D and the gated
norm's weight fall back to Adam (megatron-core 0.19.2 optimizer/emerging_optimizers.py _is_nonlinear_or_embedding:
``len(param.shape) != 2``; 0.16.1 optimizer/muon.py the same test inline). Checked by hand and against megatron-core's
own model and predicate on CPU (tests/e2e/hybrid_muon_split.py)."""
from __future__ import annotations

import os
import sys

import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.estimator.muon import state_split
from megatron_memguard.estimator.params import chunk_params
from test_mamba import PY312, SMALL, run_e2e

# the SMALL model of tests/test_mamba.py: h 256, 4 heads of 64 in 2 query groups, FFN 512 (one fc1: no GLU), Mamba
# d_inner 512 in 16 heads of 32, 2 groups, state 16: in_proj [2 x 512 + 2 x 2 x 16 + 16, 256] = [1104, 256],
# out_proj [256, 512]
IN_PROJ, OUT_PROJ = 1104 * 256, 256 * 512
QKV, PROJ = (4 + 2 * 2) * 64 * 256, 256 * 256
FC1, FC2 = 512 * 256, 256 * 512
MATRICES = 2 * (IN_PROJ + OUT_PROJ) + QKV + PROJ + FC1 + FC2     # the pattern M*M-


def _layout(extra: str, version: str | None = None, world: int = 1):
    pat = "--hybrid-override-pattern M*M- --num-layers 4" if version == "0.16" else "--hybrid-layer-pattern M*M-"
    return layout_from_flags(SMALL + pat.split() + extra.split(), world_size=world, megatron_version=version)


@pytest.mark.parametrize("version", ["0.16", "0.18", "0.19"])
def test_the_conv1d_weight_and_the_mixers_vectors_fall_back_to_adam(version):
    # up to 0.18.2 the conv1d is an nn.Conv1d (mixer.conv1d.weight, 3-D), from 0.19 the mixer's conv1d_weight
    L = _layout("--optimizer muon", version)
    names = [p.name for p in chunk_params(L, L.chunks[0])]
    muon, scalar = state_split((p.name, p.numel) for p in chunk_params(L, L.chunks[0]))
    assert muon == MATRICES == 1_286_144
    assert muon + scalar == sum(p.numel for p in chunk_params(L, L.chunks[0]))
    assert any("conv1d" in n for n in names)
    terms = {t.name: t.bytes for t in estimate(L).critical.terms}
    assert terms["muon_momentum"] == 4 * MATRICES             # fp32 momentum of the fp32 main copy
    assert terms["adam_exp_avg"] == terms["adam_exp_avg_sq"] == 4 * scalar


def test_lion_and_soap_take_the_same_matrices():
    for opt, term in (("lion", "lion_exp_avg"), ("soap", "soap_exp_avg")):
        terms = {t.name: t.bytes for t in estimate(_layout(f"--optimizer {opt}")).critical.terms}
        assert terms[term] == 4 * MATRICES, opt
    # SOAP's Kronecker factors and eigenbases, 8 (m^2 + n^2) B per [m, n] matrix (emerging_optimizers 0.3.0
    # soap/soap.py): the Mamba projections' among them
    terms = {t.name: t.bytes for t in estimate(_layout("--optimizer soap")).critical.terms}
    shapes = [(1104, 256), (256, 512)] * 2 + [(512, 256), (256, 256), (512, 256), (256, 512)]
    assert terms["soap_preconditioners"] == sum(8 * (m * m + n * n) for m, n in shapes)


def test_newton_schulz_on_the_mamba_in_proj():
    # the largest matrix of the stage is in_proj [1104, 256]; blockwise, medium precision: the scaling keeps three
    # fp32 copies (12 B per element) above Newton-Schulz's own peak (estimator/muon.py orthogonalize_peak)
    terms = {t.name: t for t in estimate(_layout("--optimizer muon")).critical.terms}
    assert terms["muon_newton_schulz"].bytes == 12 * IN_PROJ
    assert "mixer.in_proj [1104, 256]" in terms["muon_newton_schulz"].detail


def test_in_proj_is_gathered_as_a_column_parallel_weight():
    # --muon-tp-mode duplicated all-gathers a TP-split matrix along its partition_dim (TE's column-parallel in_proj:
    # dim 0) and orthogonalises it whole: TP 2 gives in_proj shards [552, 256] gathered to [1104, 256]
    from megatron_memguard.estimator.muon import NsSpec, orthogonalize_peak, step_working_set
    L = _layout("--optimizer muon --muon-tp-mode duplicated --tensor-model-parallel-size 2", world=2)
    ws = step_working_set(L, 0)
    assert (ws.matrix, ws.shape) == ("mixer.in_proj", (552, 256))
    assert ws.bytes == orthogonalize_peak(552, 256, NsSpec(tp_mode="duplicated"), 2, 0)


def _real(python: str, port: int, vocab: int) -> dict:
    cfg = dict(pattern="M*M-", hidden_size=256, heads=4, groups=2, ffn=512, state=16, head_dim=32, mamba_groups=2,
               vocab=vocab, seq=128)
    return run_e2e(python, "hybrid_muon_split.py", cfg, port)


def _check(real: dict, L) -> None:
    muon, scalar = state_split((p.name, p.numel) for p in chunk_params(L, L.chunks[0]))
    assert muon == sum(n for n, managed in real.values() if managed) == MATRICES
    assert scalar == sum(n for n, managed in real.values() if not managed)
    assert not any(managed for name, (_, managed) in real.items() if "conv1d" in name)


def test_the_split_matches_megatron_cores_own_predicate():
    if not os.path.exists(PY312):
        pytest.skip("no megatron-core 0.19.2 venv (MEMGUARD_PY312)")
    L = _layout("--optimizer muon", "0.19")
    _check(_real(PY312, 29691, L.padded_vocab_size), L)


def test_the_split_matches_this_venvs_megatron_core():
    try:
        from megatron.core.package_info import __version__ as core
    except ImportError:
        pytest.skip("no megatron-core")
    L = _layout("--optimizer muon", ".".join(core.split(".")[:2]))
    _check(_real(sys.executable, 29692, L.padded_vocab_size), L)
