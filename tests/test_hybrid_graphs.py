"""CUDA graphs over a hybrid Mamba model (--cuda-graph-impl with --hybrid-layer-pattern): which layers are graphed,
the static buffers each keeps, the pool. Numbers by hand from megatron-core 0.19.2's transformer/cuda_graphs.py
(_layer_is_graphable, TECudaGraphHelper._discover_layers), transformer/module.py
(GraphableMegatronModule.get_layer_static_inputs: the hidden states [s/CP(/TP), b, h] in bf16) and
transformer/transformer_layer.py (TransformerLayer.get_layer_static_inputs: the bool causal mask [b, 1, s/CP, s] when
its self-attention is no IdentityOp), the same in 0.16.1, 0.17.1 and 0.18.2; and against megatron-core's own
HybridModel built on CPU (tests/e2e/hybrid_graph_inputs.py)."""
from __future__ import annotations

import os
import sys

import pytest

from megatron_memguard import estimate
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.partition import LayerKind
from test_mamba import MOE, PY312, _layout, run_e2e

S, B, H = 128, 2, 256
HIDDEN = S * B * H * 2          # one layer's static hidden states (bf16), and as many for its grad-output buffer
MASK = B * S * S                # the bool causal mask of an attention layer


def _graph_terms(pattern: str, extra: str, world: int = 1, stage: int = -1, version: str | None = None) -> dict:
    est = estimate(_layout(pattern, f"--micro-batch-size {B} " + extra, world=world, version=version))
    return {t.name: t.bytes for t in est.stages[stage].terms if t.name.startswith("cuda_graph")}


@pytest.mark.parametrize("modules, graphed, masked", [
    ("", 4, 1),             # every layer is one graphed callable; only the attention layer '*' gets the mask
    ("mamba", 2, 0),        # the two MambaLayers (CudaGraphModule.mamba)
    ("attn", 1, 1),         # the TransformerLayer whose attention is not an IdentityOp
    ("mlp", 1, 0),          # the MLPLayer (its mlp is an MLP)
    ("attn mamba", 3, 1),
])
def test_static_buffers_of_the_graphed_layers(modules, graphed, masked):
    mods = f"--cuda-graph-modules {modules}" if modules else ""
    terms = _graph_terms("M*M-", "--cuda-graph-impl transformer_engine " + mods)
    # PP = 1: one sample set (graphs reused across micro-batches); input + grad-output per graphed layer
    assert terms["cuda_graph_static_io"] == graphed * 2 * HIDDEN + masked * MASK


def test_nemotron_3_graph_modules_on_an_moe_hybrid_pattern():
    # Megatron-Bridge 0.6.2 recipes/nemotronh/gb200/nemotron_3_super.py and nemotron_3_nano.py: TE graphs of
    # attn, mamba, moe_router and moe_preprocess. Of M E M * E M - E, all but the MLP layer '-' are graphed (7), the
    # attention layer with the mask
    terms = _graph_terms("MEM*EM-E", "--cuda-graph-impl transformer_engine --cuda-graph-modules attn mamba moe_router "
                         "moe_preprocess " + MOE)
    assert terms["cuda_graph_static_io"] == 7 * 2 * HIDDEN + MASK


def test_the_pool_keeps_the_largest_graphed_layers_working_memory():
    # mamba graphs only: the pool is the Mamba layer's larger working set (test_mamba.py works both out by hand:
    # 923,648 forward, 1,415,168 backward at MBS 2), not the attention layer's
    la = layer_activations(_layout("M*M-", f"--micro-batch-size {B}"), True, LayerKind("mamba", "none"))
    assert max(la.fwd_transient, la.bwd_transient) == 1_415_168
    assert _graph_terms("M*M-", "--cuda-graph-impl transformer_engine --cuda-graph-modules mamba")[
        "cuda_graph_pool"] == 1_415_168
    att = layer_activations(_layout("M*M-", f"--micro-batch-size {B}"), True, LayerKind("attention", "none"))
    assert _graph_terms("M*M-", "--cuda-graph-impl transformer_engine --cuda-graph-modules attn")[
        "cuda_graph_pool"] == max(att.fwd_transient, att.bwd_transient) < 1_415_168
    # nothing graphed on this model (moe graphs need experts; mlp with only Mamba layers): no pool, no buffers
    assert _graph_terms("MM*M", "--cuda-graph-impl transformer_engine --cuda-graph-modules mlp") == {}


def test_sequence_parallel_shards_the_static_hidden_states():
    # slen_per_cptp = s / TP under sequence parallelism (GraphableMegatronModule.get_layer_static_inputs); the mask
    # is [b, 1, s/CP, s] whatever TP
    terms = _graph_terms("M*M-", "--cuda-graph-impl transformer_engine --tensor-model-parallel-size 2 "
                         "--sequence-parallel", world=2)
    assert terms["cuda_graph_static_io"] == 4 * 2 * HIDDEN // 2 + MASK


def test_hybrid_mtp_layers_are_graphed_by_the_local_graphs_only():
    # TE's helper takes mtp.layers[i].mtp_model_layer: a HybridStack, no GraphableMegatronModule (not graphed); the
    # local implementation gives every GraphableMegatronModule its CudaGraphManager, the MTP stack's layers too
    te = _graph_terms("M*M-/*-", "--cuda-graph-impl transformer_engine")
    assert te["cuda_graph_static_io"] == 4 * 2 * HIDDEN + MASK
    local = _graph_terms("M*M-/*-", "--cuda-graph-impl local")
    assert local["cuda_graph_static_io"] == (4 + 2) * 2 * HIDDEN     # (the local graphs build no static mask)


def test_pipeline_stages_graph_their_own_layers():
    # PP 2, segments 'M*' and 'M-': 8 micro-batches; the TE helper keeps one sample set per micro-batch in flight
    # (rank 0 holds 2 in 1F1B, rank 1 one), each set the stage's graphed layers' buffers
    first = _graph_terms("M*|M-", "--cuda-graph-impl transformer_engine --pipeline-model-parallel-size 2", world=2,
                         stage=0)
    last = _graph_terms("M*|M-", "--cuda-graph-impl transformer_engine --pipeline-model-parallel-size 2", world=2,
                        stage=1)
    assert first["cuda_graph_static_io"] == 2 * (2 * 2 * HIDDEN + MASK)
    assert last["cuda_graph_static_io"] == 1 * (2 * 2 * HIDDEN)


def test_the_full_iteration_graph_of_a_hybrid_model():
    # StaticBufferLoader: every micro-batch (global batch 8 / MBS 2 = 4) of tokens, labels, position ids (int64) and
    # the fp32 loss mask, and the [b, 1, s, s] bool mask the dataloader makes by default; whatever the layers are
    terms = _graph_terms("M*M-", "--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad")
    assert terms["cuda_graph_static_io"] == 4 * (B * S * (8 + 8 + 8 + 4) + B * S * S)


def _real(pattern: str, modules: list[str], python: str, port: int) -> list:
    cfg = dict(pattern=pattern, hidden_size=H, heads=4, groups=2, ffn=512, state=16, head_dim=32, mamba_groups=2,
               vocab=1024, seq=S, mbs=B, modules=modules, **(dict(experts=4, topk=2, moe_ffn=128) if "E" in pattern
                                                             else {}))
    return run_e2e(python, "hybrid_graph_inputs.py", cfg, port)


@pytest.mark.parametrize("pattern, modules", [("M*M-", []), ("M*M-", ["mamba"]), ("M*M-", ["attn"]),
                                              ("M*M-", ["mlp"]), ("M*M-/*-", []),
                                              # Megatron-Bridge 0.6.2's Nemotron 3 recipes (nemotronh/gb200/)
                                              ("MEM*EM-E", ["attn", "mamba", "moe_router", "moe_preprocess"])])
def test_graphed_layers_and_static_inputs_match_megatron_core(pattern, modules):
    """megatron-core 0.19.2's own HybridModel on CPU: _layer_is_graphable over its decoder and MTP layers, and the
    bytes of each graphable layer's get_layer_static_inputs; memguard adds the grad-output buffer (TE keeps one of
    the output's shape, the hidden states', per static input set)."""
    if not os.path.exists(PY312):
        pytest.skip("no megatron-core 0.19.2 venv (MEMGUARD_PY312)")
    real = _real(pattern, modules, PY312, 29681)
    want = sum(b + HIDDEN for ok, b in real if ok)
    mods = ("--cuda-graph-modules " + " ".join(modules)) if modules else ""
    moe = MOE if "E" in pattern else ""
    assert _graph_terms(pattern, f"--cuda-graph-impl transformer_engine {mods} {moe}")["cuda_graph_static_io"] == want


def test_graphed_layers_match_this_venvs_megatron_core():
    # the interpreter running the tests (megatron-core 0.16.1's MambaModel, cuda_graph_scope, or 0.19.2)
    try:
        from megatron.core.package_info import __version__ as core
    except ImportError:
        pytest.skip("no megatron-core")
    version = ".".join(core.split(".")[:2])
    real = _real("M*M-", ["mamba"], sys.executable, 29682)
    assert [ok for ok, _ in real] == [True, False, True, False]
    flag = "--hybrid-override-pattern M*M- --num-layers 4" if version == "0.16" else "--hybrid-layer-pattern M*M-"
    from megatron_memguard import layout_from_flags
    from test_mamba import SMALL
    L = layout_from_flags(SMALL + flag.split() + f"--micro-batch-size {B} --cuda-graph-impl transformer_engine "
                          f"--cuda-graph-scope mamba".split(), world_size=1, megatron_version=version)
    terms = {t.name: t.bytes for t in estimate(L).critical.terms}
    assert terms["cuda_graph_static_io"] == sum(b + HIDDEN for ok, b in real if ok) == 2 * 2 * HIDDEN


# ----- property: any pattern, any modules ---------------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings      # noqa: E402
from hypothesis import strategies as st                  # noqa: E402

EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))


@settings(derandomize=True, database=None, deadline=None, max_examples=max(1, EXAMPLES // 4),
          suppress_health_check=[HealthCheck.too_slow])
@given(pattern=st.text(alphabet="M*-", min_size=1, max_size=12),
       modules=st.sets(st.sampled_from(["attn", "mamba", "mlp"])),
       impl=st.sampled_from(["transformer_engine", "local"]))
def test_any_pattern_graphs_its_layers_by_symbol(pattern, modules, impl):
    """PP = 1, one sample set: per symbol, graphed as _layer_is_graphable decides (all without modules; 'M' with
    mamba, '*' with attn, '-' with mlp), each graphed layer its input and grad-output buffer, each graphed '*' under
    TE the causal mask."""
    graphed = {"M": not modules or "mamba" in modules, "*": not modules or "attn" in modules,
               "-": not modules or "mlp" in modules}
    n = sum(graphed[sym] for sym in pattern)
    masks = pattern.count("*") * graphed["*"] * (impl == "transformer_engine")
    mods = ("--cuda-graph-modules " + " ".join(sorted(modules))) if modules else ""
    from megatron_memguard import layout_from_flags
    from test_mamba import SMALL
    # (the '=' form: a pattern may start with '-')
    L = layout_from_flags(SMALL + [f"--hybrid-layer-pattern={pattern}"] + f"--micro-batch-size {B} --cuda-graph-impl "
                          f"{impl} {mods}".split(), world_size=1)
    terms = {t.name: t.bytes for t in estimate(L).critical.terms if t.name.startswith("cuda_graph")}
    assert terms.get("cuda_graph_static_io", 0) == n * 2 * HIDDEN + masks * MASK
    assert ("cuda_graph_pool" in terms) == (n > 0)
