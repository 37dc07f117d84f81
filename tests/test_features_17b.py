"""CUDA graphs, activation offloading, MTP and Muon through resolve and the estimate: Megatron's rules as
one-line errors naming the flag, and the named terms with hand-computed bytes."""
import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError

# A small dense GPT on 8 GPUs: h 512, 8 heads, seq 1024, mbs 4, GPT-2 vocab padded to 50304.
BASE = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
        "--micro-batch-size 4 --global-batch-size 32 --bf16 --position-embedding-type rope "
        "--hidden-dropout 0 --attention-dropout 0").split()


def _err(flags, world=8, version=None):
    with pytest.raises((ConfigError, ConfigErrors, NotModelledError)) as e:
        layout_from_flags(BASE + flags, world_size=world, megatron_version=version)
    return str(e.value)


def _terms(flags, world=8, stage=-1, **kw):
    est = estimate(layout_from_flags(BASE + flags, world_size=world, **kw))
    return {t.name: t.bytes for t in est.stages[stage].terms}, est


# ----- CUDA graphs ---------------------------------------------------------------------------------------

def test_cuda_graph_rules():
    assert "--enable-cuda-graph" in _err(["--enable-cuda-graph", "--cuda-graph-impl", "local"])
    assert "--cuda-graph-modules" in _err(["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "moe"])
    assert "--recompute-granularity" in _err(["--cuda-graph-impl", "local", "--recompute-granularity", "full",
                                              "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    assert "full_iteration" in _err(["--cuda-graph-impl", "full_iteration"])   # needs --no-check-for-nan-in-loss-and-grad


def test_cuda_graph_static_io_te_attn():
    # TE graphs of the attention part, PP 1: one sample set; per layer static input + grad-output [4096, 512]
    # bf16 and the bool causal mask [4, 1, 1024, 1024]
    terms, _ = _terms(["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn"])
    assert terms["cuda_graph_static_io"] == 4 * (2 * 4096 * 512 * 2 + 4 * 1024 * 1024)
    assert "cuda_graph_pool" in terms
    plain, _ = _terms([])
    assert "cuda_graph_static_io" not in plain


def test_full_iteration_static_batches():
    # StaticBufferLoader: 8 micro-batches (GBS 32 / MBS 4 / DP 1) of tokens, labels, position ids (int64), loss
    # mask (fp32) and the bool [4, 1, 1024, 1024] mask
    terms, _ = _terms(["--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad"], world=1)
    assert terms["cuda_graph_static_io"] == 8 * (4 * 1024 * 28 + 4 * 1024 * 1024)


# ----- offloading -----------------------------------------------------------------------------------------

def test_offload_rules():
    assert "--cpu-offloading-num-layers" in _err(["--cpu-offloading-num-layers", "4"])             # < num_layers
    assert "--cpu-offloading-num-layers" in _err(["--cpu-offloading-num-layers", "1", "--pipeline-model-parallel-size", "2"])
    assert "--offload-modules" in _err(["--fine-grained-activation-offloading", "--offload-modules", "attn_proj"])


def test_layer_offload_keeps_l_minus_n_layers():
    on, _ = _terms(["--cpu-offloading-num-layers", "3"], world=1)
    off, _ = _terms([], world=1)
    # TE's bound: (L - N) layers' saved activations on the GPU
    assert on["layer_activations"] * 4 == off["layer_activations"] * 1


# ----- MTP -----------------------------------------------------------------------------------------------

def test_mtp_rules():
    assert "--mtp-num-layers" in _err(["--mtp-num-layers", "1", "--position-embedding-type", "learned_absolute"])


def test_mtp_terms_on_the_last_stage():
    terms, est = _terms(["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2"], world=2)
    first = {t.name for t in est.stages[0].terms}
    assert "mtp_block_activations" in terms and "mtp_loss_buffers" in terms
    assert not any(n.startswith("mtp_") for n in first)


# ----- Muon ----------------------------------------------------------------------------------------------

def test_muon_state():
    terms, est = _terms(["--optimizer", "muon"], world=1)
    adam, est_adam = _terms([], world=1)
    assert "muon_momentum" in terms
    # Muon keeps 4 B where Adam keeps 8 B for the matrices it takes: the difference is 4 B per such element
    assert est.stages[0].parameters == est_adam.stages[0].parameters


def test_layout_document_names_the_features_only_when_set():
    from megatron_memguard.layout import Layout
    plain = layout_from_flags(BASE, world_size=8)
    assert "cuda_graph_impl" not in plain.to_dict() and "mtp_num_layers" not in plain.to_dict()
    L = layout_from_flags(BASE + ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn",
                                  "--optimizer", "muon"], world_size=8)
    d = L.to_dict()
    assert d["cuda_graph_impl"] == "transformer_engine" and d["cuda_graph_modules"] == ["attn"]
    assert Layout.from_dict(d) == L


@pytest.mark.parametrize("extra", [["--optimizer", "muon"], ["--cuda-graph-impl", "transformer_engine"],
                                   ["--mtp-num-layers", "1"], ["--cpu-offloading-num-layers", "1"]])
def test_fujii2024_refuses_what_its_closed_form_lacks(extra):
    with pytest.raises(NotModelledError):
        estimate(layout_from_flags(BASE + extra, world_size=8), profile="fujii2024")


def test_offloaded_activations_are_host_memory():
    # layer-level offloading of 3 of 4 layers (PP 1, one micro-batch in flight): 3 layers' saved bytes on the host
    on, est = _terms(["--cpu-offloading-num-layers", "3"], world=1)
    off, _ = _terms([], world=1)
    host = {t.name: t.bytes for t in est.stages[0].host_terms}
    assert host["host_offloaded_activations"] == off["layer_activations"] * 3 // 4
    assert est.host_bytes_per_rank == host["host_offloaded_activations"]
