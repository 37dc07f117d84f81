"""Layer kinds as recipes: each kind's parameters, chunks carrying their kinds, caches keyed on them."""
import pytest

from megatron_memguard import layout_from_flags
from megatron_memguard.estimator import core
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.estimator.layers import attention, mla, mlp
from megatron_memguard.estimator.params import total_parameters
from megatron_memguard.partition import MIXER_ATTENTION, MIXER_MLA, MLP_DENSE, Chunk, LayerKind, kind_runs, layer_kinds

from conftest import LLAMA31_8B
from test_mla import CI_MLA

ATTN = LayerKind(MIXER_ATTENTION, MLP_DENSE)
MLA = LayerKind(MIXER_MLA, MLP_DENSE)


def _8b(*extra, world=1):
    return layout_from_flags(LLAMA31_8B + ["--micro-batch-size", "1", *extra], world_size=world)


def test_llama31_8b_per_kind_parameters_by_hand():
    # Llama-3.1-8B (Meta's config.json: hidden 4096, 32 heads, 8 KV heads of 128, FFN 14336, RMSNorm,
    # no biases, vocab 128256, untied): attention q 4096x4096 + k, v 2 x 1024x4096 + o 4096x4096 + the
    # input norm 4096; SwiGLU MLP 3 x 4096x14336 + the pre-MLP norm 4096.
    L = _8b()
    assert attention.param_count(L) == 4096 * 4096 + 2 * 1024 * 4096 + 4096 * 4096 + 4096 == 41_947_136
    assert mlp.param_count(L) == 3 * 4096 * 14336 + 4096 == 176_164_864
    # 32 such layers + the final norm + embedding and output layer: the published 8,030,261,248
    assert 32 * (41_947_136 + 176_164_864) + 4096 + 2 * 128256 * 4096 == total_parameters(L) == 8_030_261_248


@pytest.mark.parametrize("flags", [LLAMA31_8B + ["--micro-batch-size", "1"], CI_MLA], ids=["llama-8b", "ci-mla"])
def test_recipe_param_lists_match_their_counts(flags):
    """At TP = 1 a recipe's parameter list (shapes per rank) sums to its whole-model count."""
    L = layout_from_flags(flags, world_size=1)
    mixer = mla if L.multi_latent_attention else attention
    assert sum(p.numel for p in mixer.params(L)) == mixer.param_count(L)
    assert sum(p.numel for p in mlp.params(L)) == mlp.param_count(L)


def test_ci_mla_attention_kind_by_hand():
    # the CI model's attention (tests/test_mla.py): 254,464 weights + the input LayerNorm (2 x 512)
    L = layout_from_flags(CI_MLA, world_size=1)
    assert layer_kinds(L) == (MLA,) * 4
    assert mla.param_count(L) == 254_464 + 2 * 512


@pytest.mark.parametrize("pp, vpp", [(1, 1), (4, 1), (4, 2)])
def test_uniform_chunks_carry_n_times_the_same_kind(pp, vpp):
    extra = ["--pipeline-model-parallel-size", str(pp)]
    if vpp > 1:
        extra += ["--num-layers-per-virtual-pipeline-stage", str(32 // pp // vpp)]
    L = _8b(*extra, "--global-batch-size", "8", world=pp)
    assert len(L.chunks) == pp * vpp
    for c in L.chunks:
        assert c.layer_kinds == (ATTN,) * c.num_layers == (ATTN,) * (32 // pp // vpp)
        assert c.kind_runs == ((ATTN, c.num_layers),)
    assert sum(len(c.layer_kinds) for c in L.chunks) == 32


def test_chunk_kinds_from_runs():
    c = Chunk(0, 0, 0, 3, True, True, False, kind_runs=((ATTN, 2), (MLA, 1)))
    assert c.layer_kinds == (ATTN, ATTN, MLA)
    assert kind_runs(c.layer_kinds) == c.kind_runs


def test_layouts_differing_in_a_layer_kind_do_not_share_a_cache_entry():
    L = _8b()
    core._chunk_activations.cache_clear()
    a = core._chunk_activations(L, ((ATTN, 4),), False, False)
    b = core._chunk_activations(L, ((MLA, 4),), False, False)
    assert core._chunk_activations.cache_info().misses == 2
    assert a.layers == 4 * layer_activations(L, False, ATTN).total
    assert b.layers == 4 * layer_activations(L, False, MLA).total
    assert a.layers != b.layers
    # a mixed chunk keeps each layer's own saved bytes (bottom to top: 2 + 1)
    mixed = core._chunk_activations(L, ((ATTN, 2), (MLA, 1)), False, False)
    assert mixed.layers == 2 * layer_activations(L, False, ATTN).total + layer_activations(L, False, MLA).total
    core._chunk_activations.cache_clear()


def test_only_megatrons_unfused_local_attention_reads_the_batch_mask():
    """megatron's DotProductAttention with torch's softmax builds an [s, s] bool causal mask (1 byte per
    element, kept by masked_fill_) when the batch brings none: a chunk without the batch (no embedding,
    no output layer) keeps it. Every other mixer makes the same tensors either way, and the two chunk
    kinds share one cache entry."""
    L = _8b("--transformer-impl", "local", "--no-masked-softmax-fusion", "--seq-length", "2048")
    assert attention.reads_batch_mask(L)
    with_batch, without = layer_activations(L, True, ATTN), layer_activations(L, False, ATTN)
    assert without.saved["causal_mask"] == 2048 * 2048 and "causal_mask" not in with_batch.saved
    assert without.total - with_batch.total == 2048 * 2048
    te = _8b()
    assert not attention.reads_batch_mask(te)
    assert layer_activations(te, False, ATTN) is layer_activations(te, True, ATTN)
    m = layout_from_flags(CI_MLA, world_size=1)
    assert not mla.reads_batch_mask(m)
    assert layer_activations(m, False, MLA) is layer_activations(m, True, MLA)


def test_attention_backend_local_runs_megatrons_own_attention():
    """--attention-backend local: the GPT provider swaps the TE spec's core attention for megatron-core's
    DotProductAttention (core 0.19.2 megatron/training/models/gpt.py; language_module.py sets every
    NVTE_*_ATTN to 0), so the layer keeps what the local attention keeps: with torch's softmax the
    [s, s] bool causal mask (2048 x 2048 bytes) that TE's unfused attention never makes. core 0.16.1
    (no validate_args rule read here) is the era whose flags reach the estimate."""
    flags = ("--no-masked-softmax-fusion", "--seq-length", "2048")
    local = layout_from_flags(LLAMA31_8B + ["--micro-batch-size", "1", "--global-batch-size", "1",
                                            "--attention-backend", "local", *flags], world_size=1,
                              megatron_version="0.16.1")
    assert attention.attention_kind(local) == "local_unfused"
    assert layer_activations(local, False, ATTN).saved["causal_mask"] == 2048 * 2048
    unfused = _8b("--attention-backend", "unfused", *flags)
    assert attention.attention_kind(unfused) == "te_unfused"
    assert "causal_mask" not in layer_activations(unfused, False, ATTN).saved


def test_attention_backend_local_needs_spec_local_in_core_0_19():
    """core 0.19.2 megatron/training/arguments.py validate_args: ``assert args.spec[0] == 'local'``
    under --attention-backend local (and --spec local itself is a custom spec memguard refuses)."""
    from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
    base = LLAMA31_8B + ["--micro-batch-size", "1", "--global-batch-size", "1", "--attention-backend", "local"]
    with pytest.raises((ConfigError, ConfigErrors), match="--attention-backend: local is only supported with --spec local"):
        layout_from_flags(base, world_size=1, megatron_version="0.19.2")
    with pytest.raises(NotModelledError, match="--spec"):
        layout_from_flags(base + ["--spec", "local"], world_size=1, megatron_version="0.19.2")


def test_bridge_attention_backend_local_is_megatrons_attention_in_core_0_19(tmp_path):
    """Megatron-Bridge's GPT provider swaps the core attention for megatron-core's DotProductAttention under
    ``attention_backend: local`` (as core 0.19.2 megatron/training/models/gpt.py does) and no validate_args
    runs: the config is estimated with core 0.19, as the local attention (the [s, s] bool causal mask,
    1024 x 1024 bytes, with torch's softmax), not refused for a missing --spec."""
    from megatron_memguard import resolve
    from megatron_memguard.readers.detect import read_config_file
    from test_readers_bridge import FLAT
    text = FLAT.replace("  bf16: true\n", "  bf16: true\n  attention_backend: local\n  masked_softmax_fusion: false\n", 1)
    p = tmp_path / "run_config.yaml"
    p.write_text(text)
    L = resolve(read_config_file(str(p)), world_size=8, megatron_version="0.19.2")
    assert L.attention_backend == "local" and attention.attention_kind(L) == "local_unfused"
    assert layer_activations(L, False, ATTN).saved["causal_mask"] == 1024 * 1024
