"""Which transformer layers each pipeline rank and virtual stage builds, as megatron-core decides it.

Follows ``get_num_layers_to_build`` (megatron/core/transformer/transformer_block.py): even split of
``num_layers`` (+1 for the embedding, +1 for the loss when they are accounted for in the split), or
``decoder_first/last_pipeline_num_layers`` with the rest spread evenly over the middle stages, or an
explicit ``--pipeline-model-parallel-layout`` ("Et*3|(tt|)*29,m|L"); each rank's share divided evenly
over its virtual stages. Interleaved chunks take layers in global stage order ``vpp_rank * PP + pp_rank``.

Every layer also has a kind (:class:`LayerKind`: its token mixer and its MLP), chosen in one place,
:func:`model_kind_runs`; a :class:`Chunk` carries the kinds of its layers, and the estimator builds each
layer from the recipes of its kind (``megatron_memguard.estimator.layers``).
"""
from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate, groupby
from typing import TYPE_CHECKING, NamedTuple

from .errors import ConfigError

if TYPE_CHECKING:
    from .layout import Layout

# Token mixers and MLPs a layer can be built from; each name has one recipe module in
# megatron_memguard/estimator/layers/ (MoE adds MLP "moe", Mamba adds mixer "mamba").
MIXER_ATTENTION = "attention"     # megatron-core SelfAttention (standard / grouped-query)
MIXER_MLA = "mla"                 # MLASelfAttention (multi-latent attention, DeepSeek-V2 style)
MIXER_DSA = "dsa"                 # AbsorbedMLASelfAttention with DSAttention (DeepSeek sparse attention, V3.2 style)
# a DSA layer that reuses an earlier layer's top-k (--dsa-indexer-topk-freq > 1): no indexer, no indexer loss
MIXER_DSA_SHARED = "dsa_shared"
DSA_MIXERS = frozenset({MIXER_DSA, MIXER_DSA_SHARED})
MLP_DENSE = "dense"               # megatron-core MLP (linear_fc1, activation, linear_fc2)
MLP_MOE = "moe"                   # megatron-core MoELayer (router, experts, shared experts)
# heterogeneous layer configs (resolve/heterogeneous.py): a no-op block (IdentityOp), and the dense MLP
# of another width, named "dense:FFN" (estimator.layers.kind_layout gives the recipe that width)
MIXER_NONE = "none"
MLP_NONE = "none"
MIXER_LINEAR = "linear"            # replace_with_linear: one [h, h] column-parallel linear (layers/linear_block.py)
MLP_LINEAR = "linear"
MIXER_MAMBA = "mamba"              # megatron-core MambaMixer (layers/mamba.py); a hybrid model's 'M' layer
# megatron-core GatedDeltaNet (layers/gdn.py): a GPT model's linear attention layers (--experimental-attention-variant
# gated_delta_net, --linear-attention-freq) and a hybrid model's 'G' layers
MIXER_GDN = "gdn"
# the mixers whose memory follows a layer's own --cp-comm-type (Transformer Engine's CP attention functions,
# estimator/activations.py); multi-latent and sparse attention keep one model under CP (a2a is refused for MLA,
# DSA runs all_gather only)
CP_MIXERS = frozenset({MIXER_ATTENTION})
# A hybrid model's layer symbols (--hybrid-layer-pattern; megatron-core 0.19.2 models/hybrid/
# hybrid_layer_allocation.py Symbols): each layer is one half of a transformer layer, the other half a no-op
# (MambaLayer; TransformerLayer with the MLP or the attention left IdentityOp, hybrid_layer_specs.py)
HYBRID_KINDS = {"M": (MIXER_MAMBA, MLP_NONE), "*": (MIXER_ATTENTION, MLP_NONE), "-": (MIXER_NONE, MLP_DENSE),
                "E": (MIXER_NONE, MLP_MOE), "+": (MIXER_MLA, MLP_NONE),   # ('+': 0.19's mla_layer, MLP IdentityOp)
                "D": (MIXER_DSA, MLP_NONE), "G": (MIXER_GDN, MLP_NONE)}


class LayerKind(NamedTuple):
    """What one transformer layer is built of: its token mixer and its MLP (one recipe each). An
    immutable value (a named tuple: hashed and compared in C, as every cache lookup of a chunk does)."""

    mixer: str
    mlp: str
    quantized: str | None = None   # the FP8 / FP4 recipe its GEMMs run in (estimator.fp8); None: BF16 / FP16
    # a heterogeneous block's own attention num_query_groups (get_config_for_layer); None: the model's
    query_groups: int | None = None
    # the layer's own context-parallel communication type when --cp-comm-type gives several (TransformerLayer reads
    # cp_comm_type[layer_number - 1]): a word of the layout's ``cp_comm_layers``; None: the model's one type
    cp_comm: str | None = None

    @property
    def label(self) -> str:
        return (f"{self.mixer}" + (f":g{self.query_groups}" if self.query_groups else "") + f"+{self.mlp}"
                + (f"+{self.quantized}" if self.quantized else "") + (f"@{self.cp_comm}" if self.cp_comm else ""))


@dataclass(frozen=True)
class Chunk:
    """One model chunk on one pipeline rank: a contiguous run of layers (a VPP stage when interleaved)."""

    pp_rank: int
    vpp_rank: int
    first_layer: int        # global index of its first transformer layer
    num_layers: int
    has_embedding: bool     # word (and position) embedding: first stage, first chunk
    has_output: bool        # final norm, output layer and loss: last stage, last chunk
    has_tied_output_copy: bool  # last stage holds a copy of the tied embedding (PP > 1, tied)
    vpp_size: int = 1
    # (kind, count) of each run of consecutive equal kinds, bottom to top: the kinds of its layers,
    # and what the caches key on (one entry for a uniform chunk: a lookup hashes one kind, not one
    # per layer)
    kind_runs: tuple[tuple[LayerKind, int], ...] = ()
    # builds the MTP block (mtp_on_this_rank): the last chunk, or the chunk a layout's 'm' names; None: with
    # the output (a chunk shape of the states' caches, whose has_output carries it)
    has_mtp: bool | None = None

    def __init__(self, pp_rank: int, vpp_rank: int, first_layer: int, num_layers: int, has_embedding: bool,
                 has_output: bool, has_tied_output_copy: bool, vpp_size: int = 1,
                 kind_runs: tuple[tuple[LayerKind, int], ...] = (), has_mtp: bool | None = None) -> None:
        # one per chunk of every layout (and per chunk shape of a cold estimate): stored directly (as Term's)
        d = self.__dict__
        d["pp_rank"] = pp_rank
        d["vpp_rank"] = vpp_rank
        d["first_layer"] = first_layer
        d["num_layers"] = num_layers
        d["has_embedding"] = has_embedding
        d["has_output"] = has_output
        d["has_tied_output_copy"] = has_tied_output_copy
        d["vpp_size"] = vpp_size
        d["kind_runs"] = kind_runs
        d["has_mtp"] = has_mtp

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """The kind of each of its layers, bottom to top."""
        kinds = self.__dict__.get("_layer_kinds")
        if kinds is None:
            kinds = self.__dict__["_layer_kinds"] = kinds_from_runs(self.kind_runs)
        return kinds

    @property
    def label(self) -> str:
        return f"pp{self.pp_rank}" + (f".v{self.vpp_rank}" if self.vpp_size > 1 else "")


def kind_runs(kinds: tuple[LayerKind, ...]) -> tuple[tuple[LayerKind, int], ...]:
    """``kinds`` as (kind, count) runs of consecutive equal kinds, in order."""
    if not kinds:
        return ()
    if kinds.count(kinds[0]) == len(kinds):   # a uniform run (the common case), compared in C
        return ((kinds[0], len(kinds)),)
    runs: list[list] = []
    for k in kinds:
        if runs and (runs[-1][0] is k or runs[-1][0] == k):
            runs[-1][1] += 1
        else:
            runs.append([k, 1])
    return tuple((k, n) for k, n in runs)


def kinds_from_runs(runs: tuple[tuple[LayerKind, int], ...]) -> tuple[LayerKind, ...]:
    out: tuple[LayerKind, ...] = ()
    for k, n in runs:
        out += (k,) * n
    return out


def layer_kinds(L: "Layout") -> tuple[LayerKind, ...]:
    """The kind of every transformer layer of the model, in global order."""
    return kinds_from_runs(model_kind_runs(L))


def _het_kind(word: str, quantized: str | None) -> LayerKind:
    """A heterogeneous layer's word "mixer[:GROUPS]/mlp[:FFN]" (resolve/heterogeneous.py) as its kind."""
    mixer, mlp = word.split("/")
    mixer, _, groups = mixer.partition(":")
    return LayerKind(mixer, mlp, quantized, int(groups) if groups else None)


def dsa_skips_topk(layer_number: int, offset: int, freq: int) -> bool:
    """Whether the 1-indexed DSA layer reuses an earlier layer's top-k (megatron-core 0.19.2 dsa.py
    is_dsa_skip_topk_layer: offset 0 counts as 1)."""
    return freq > 1 and max(layer_number - max(offset, 1), 0) % freq != 0


def dsa_topk_source(layer_number: int, offset: int, freq: int) -> int:
    """The computing layer whose top-k a layer reuses (dsa.py source_dsa_compute_layer, 0.19.2)."""
    first = max(offset, 1)
    return layer_number if layer_number <= first else layer_number - (layer_number - first) % freq


def _dsa_topk_sharing(L: "Layout", runs: tuple[tuple[LayerKind, int], ...]) -> tuple[tuple[LayerKind, int], ...]:
    """--dsa-indexer-topk-freq > 1: the DSA layers that reuse a top-k (DSAttention.skip_topk, by global layer number,
    as TransformerLayer and HybridStack number them) become ``dsa_shared``."""
    freq, offset = L.dsa_indexer_topk_freq, L.dsa_indexer_skip_topk_offset
    if freq <= 1 or not any(k.mixer == MIXER_DSA for k, _ in runs):
        return runs
    kinds = kinds_from_runs(runs)
    return kind_runs(tuple(k._replace(mixer=MIXER_DSA_SHARED) if k.mixer == MIXER_DSA and dsa_skips_topk(i + 1, offset, freq)
                           else k for i, k in enumerate(kinds)))


@lru_cache(maxsize=256)   # asked by the partition, the MTP and placeholder-gradient terms of one estimate
def model_kind_runs(L: "Layout") -> tuple[tuple[LayerKind, int], ...]:
    """The kinds of the model's layers in global order, as (kind, count) runs: the one place where a
    layer's recipes are chosen. Today every layer of a model is the same kind; --moe-layer-freq
    (dense and MoE layers), MTP layers, hybrid models, DSA top-k sharing and per-layer --cp-comm-type lists make
    them differ per layer."""
    runs = _model_kind_runs(L)
    if getattr(L, "dsa_indexer_topk_freq", 1) > 1:
        runs = _dsa_topk_sharing(L, runs)
    words = getattr(L, "cp_comm_layers", None)
    if not words:
        return runs
    # one context-parallel communication type per layer (resolve/shape.py cp_attention): the attention layers'
    # kinds carry theirs (TransformerLayer: cp_comm_type[layer_number - 1], the global index); other mixers have
    # no CP attention
    made: dict[tuple[LayerKind, str | None], LayerKind] = {}
    kinds = kinds_from_runs(runs)
    if len(kinds) != words.count(",") + 1:
        return runs                               # (resolve/shape.py checks the list against --num-layers)
    return kind_runs(tuple(
        made.setdefault((k, w), k._replace(cp_comm=w) if w else k) for k, w in zip(kinds, (
            word if k.mixer in CP_MIXERS else None for k, word in zip(kinds, words.split(","))))))


def _model_kind_runs(L: "Layout") -> tuple[tuple[LayerKind, int], ...]:
    """model_kind_runs before DSA top-k sharing and the per-layer context-parallel types."""
    mixer = _mixer(L)
    moe = L.moe
    het = L.heterogeneous_layers
    hybrid = L.hybrid_layer_pattern
    if hybrid:
        # one symbol per layer ('|' only splits the pipeline). FP8 / FP4 per global layer index: HybridStack
        # (0.19.2 hybrid_block.py) builds and runs layer i of its segment in get_fp8_context / get_fp4_context(config,
        # i + pp_layer_offset), as TransformerBlock does (megatron-core builds the hybrid stack from TE modules only)
        spec = L.fp8_spec
        syms = tuple(sym for sym in hybrid if sym != "|")
        if not spec.enabled:
            made_h = {sym: LayerKind(*HYBRID_KINDS[sym]) for sym in set(syms)}
            return kind_runs(tuple(made_h[sym] for sym in syms))
        n = len(syms)
        made_q: dict[tuple[str, str | None], LayerKind] = {}
        return kind_runs(tuple(
            made_q.setdefault((sym, q), LayerKind(*HYBRID_KINDS[sym], q)) for sym, q in zip(
                syms, (spec.recipe if spec.layer_quantized(i, n) else None for i in range(n)))))
    if het:
        # one "mixer/mlp" word per layer; FP8 / FP4 per global layer index as below (TransformerBlock builds
        # each layer in get_fp8_context(layer_config, global index), get_config_for_layer keeping the recipe)
        spec = L.fp8_spec
        te_quant = spec.enabled and L.transformer_impl == "transformer_engine"
        made: dict[tuple[str, str | None], LayerKind] = {}
        kinds = tuple(made.setdefault((w, q), _het_kind(w, q)) for w, q in zip(
            het.split(","), (spec.recipe if te_quant and spec.layer_quantized(i, L.num_layers) else None
                             for i in range(L.num_layers))))
        return kind_runs(kinds)
    la = getattr(L, "linear_attention_pattern", None)
    if la:
        # --linear-attention-freq: a GDN or a standard attention mixer per layer, with the MLP of --moe-layer-freq
        # (get_transformer_layer_with_experimental_attention_variant_spec, core 0.19.2); FP8 / FP4 per global layer
        # index, as TransformerBlock builds and runs every layer of the spec (the variant's spec is TE's only)
        mlps = (MLP_DENSE,) * L.num_layers if moe is None else tuple(
            MLP_MOE if is_moe else MLP_DENSE for is_moe in moe.moe_layer_pattern)
        spec = L.fp8_spec
        quant = tuple(spec.recipe if spec.enabled and spec.layer_quantized(i, L.num_layers) else None
                      for i in range(L.num_layers))
        made_g: dict[tuple[str, str, str | None], LayerKind] = {}
        return kind_runs(tuple(made_g.setdefault((m, p, q), LayerKind(MIXER_GDN if m == "1" else mixer, p, q))
                               for m, p, q in zip(la, mlps, quant)))
    # FP8 / FP4 per global layer index (--first-last-layers-bf16 keeps the end layers in BF16); only TE
    # modules quantize, so the local spec runs FP8 flags in BF16
    spec = L.fp8_spec
    if not (spec.enabled and L.transformer_impl == "transformer_engine"):
        # every layer in BF16 / FP16: one kind per MLP, in runs of the --moe-layer-freq pattern
        if moe is None:
            return ((LayerKind(mixer, MLP_DENSE, None), L.num_layers),) if L.num_layers else ()
        dense, sparse = LayerKind(mixer, MLP_DENSE, None), LayerKind(mixer, MLP_MOE, None)
        return tuple((sparse if is_moe else dense, len(list(g))) for is_moe, g in groupby(moe.moe_layer_pattern))
    if moe is None:
        mlps = (MLP_DENSE,) * L.num_layers
    else:                                         # --moe-layer-freq: the MoE layers of the global pattern
        mlps = tuple(MLP_MOE if is_moe else MLP_DENSE for is_moe in moe.moe_layer_pattern)
    if not mlps:
        return ()
    quant = tuple(spec.recipe if spec.layer_quantized(i, L.num_layers) else None for i in range(L.num_layers))
    pairs = tuple(zip(mlps, quant))
    if pairs.count(pairs[0]) == len(pairs):
        return ((LayerKind(mixer, mlps[0], quant[0]), len(pairs)),)
    made = {p: LayerKind(mixer, *p) for p in set(pairs)}
    # runs of equal (mlp, quantization) pairs are runs of equal kinds (made is one kind per pair)
    return tuple((made[p], sum(1 for _ in g)) for p, g in groupby(pairs))


def mixed_mixers(L: "Layout") -> bool:
    """Whether the model's layers have token mixers of more than one kind (a hybrid pattern, GDN layers among
    attention layers): the places that take one layer shape refuse it or show one table per kind."""
    return bool(L.hybrid_layer_pattern or getattr(L, "linear_attention_pattern", None))


def _mixer(L: "Layout") -> str:
    """The token mixer of the model's attention layers."""
    if L.experimental_attention_variant == "dsa" or "D" in (L.hybrid_layer_pattern or ""):
        return MIXER_DSA
    return MIXER_MLA if L.multi_latent_attention else MIXER_ATTENTION


def uniform_kind(L: "Layout") -> LayerKind:
    """The kind of the model's layers when they are all alike (the per-layer table of a report, the
    planner): its mixer with the dense MLP."""
    return LayerKind(_mixer(L), MLP_DENSE, L.fp8_spec.recipe if L.transformer_impl == "transformer_engine" else None)


def parse_pipeline_layout(text: str, pp: int, key: str = "--pipeline-model-parallel-layout") -> list[str]:
    """Megatron's layout syntax: stages split by '|', 'E' embedding, 't' layer, 'L' loss, 'm' MTP, ``(x)*n``.
    Returns each stage's entries as a string ("Et", "tt", ..., "L")."""
    if not _LAYOUT_CHARS.issuperset(text):
        # before the expansion: a hostile text must not reach its regular expressions
        bad = next(ch for ch in text if ch not in _LAYOUT_CHARS)
        raise ConfigError(key, f"unknown layer character {bad!r}; use E, t, L, m, | and (..)*n")
    s = _repeat(_repeat(text.replace(",", ""), _GROUP_REPEAT, key), _CHAR_REPEAT, key)
    if not _STAGE_CHARS.issuperset(s):       # a character left after the expansion ('(', ')', '*', a digit)
        ch = next(ch for ch in s if ch not in _STAGE_CHARS)
        raise ConfigError(key, f"unknown layer character {ch!r}; use E, t, L, m, | and (..)*n")
    stages = s.split("|")
    if len(stages) % pp:
        raise ConfigError(key, f"has {len(stages)} stages, which is not a multiple of --pipeline-model-parallel-size {pp}")
    flat = s.replace("|", "")
    if not flat or flat[0] != "E" or flat[-1] != "L" or flat.count("E") != 1 or flat.count("L") != 1:
        raise ConfigError(key, "must start with the embedding 'E' and end with the loss 'L', each exactly once")
    if "m" in flat:
        _check_mtp_placement(stages, pp, key)
    return stages


def _check_mtp_placement(stages: list[str], pp: int, key: str) -> None:
    """PipelineParallelLayerLayout.validate_layer_layout's MTP rules (megatron-core 0.16.1 to 0.19.2, the same
    code): no decoder layer after the first MTP layer, MTP layers only in a rank's last virtual stage, and all
    of them in one stage. An 'm' before the last stage is Megatron's mtp_standalone (estimated)."""
    flat = "".join(stages)
    if "t" in flat[flat.index("m"):]:
        raise ConfigError(key, "places a decoder layer 't' after an MTP layer 'm' (decoder layers must come first)")
    vpp = len(stages) // pp
    holding = [i for i, st in enumerate(stages) if "m" in st]
    if any(i // pp != vpp - 1 for i in holding):
        raise ConfigError(key, "places MTP layers 'm' outside a pipeline rank's last virtual stage (Megatron "
                               "restricts them to it)")
    if len(holding) > 1:
        raise ConfigError(key, "spreads the MTP layers 'm' over several stages (all must be in one)")


def mtp_stage_index(L: "Layout") -> int | None:
    """The global stage index (vpp_rank * PP + pp_rank) of the chunk that builds the MTP block: the layout's
    stage holding 'm', else the last one (mtp_on_this_rank, core 0.16.1 to 0.19.2); None without MTP."""
    if not getattr(L, "mtp_num_layers", 0):
        return None             # (before the cache: most layouts have no MTP, and hashing one costs more)
    return _mtp_stage_index(L)


@lru_cache(maxsize=256)
def _mtp_stage_index(L: "Layout") -> int:
    if L.pipeline_model_parallel_layout:
        stages = parse_pipeline_layout(L.pipeline_model_parallel_layout, L.pipeline_model_parallel_size)
        return next((i for i, st in enumerate(stages) if "m" in st), len(stages) - 1)
    return L.pipeline_model_parallel_size * L.vpp - 1


def mtp_standalone(L: "Layout") -> bool:
    """Megatron's mtp_standalone: the MTP block on a stage before the loss's (a layout's 'm' there)."""
    i = mtp_stage_index(L)
    return i is not None and i != L.pipeline_model_parallel_size * L.vpp - 1


def after_mtp(L: "Layout", pp_rank: int, vpp_rank: int) -> bool:
    """Whether the chunk (pp_rank, vpp_rank) comes after a standalone MTP chunk: it receives (and passes on) the
    (1 + D)-fold concatenated hidden states (MultiTokenPredictionBlock.forward's torch.cat)."""
    i = mtp_stage_index(L)
    if i is None:
        return False
    return vpp_rank * L.pipeline_model_parallel_size + pp_rank > i


# Longest layout memguard expands: 10 x its bound on --num-layers (numbers.py), with room for E, L and '|'.
MAX_LAYOUT = 100_000
_LAYOUT_CHARS = frozenset("ELtm|()*0123456789,")
_STAGE_CHARS = frozenset("ELtm|")
# a group holds no parenthesis: each match attempt stops at the next one (linear in the text's length)
_GROUP_REPEAT = re.compile(r"\(([^()]+)\)\*(\d+)")
_CHAR_REPEAT = re.compile(r"(.)\*(\d+)")


def _repeat(text: str, pattern: re.Pattern, key: str) -> str:
    """``text`` with every ``x*n`` of ``pattern`` written out, refusing a result longer than MAX_LAYOUT."""
    total = len(text)

    def rep(m: re.Match) -> str:
        nonlocal total
        n = int(m.group(2)) if len(m.group(2)) <= 6 else MAX_LAYOUT + 1
        total += len(m.group(1)) * n - len(m.group(0))
        if total > MAX_LAYOUT:
            raise ConfigError(key, f"expands to more than {MAX_LAYOUT:,} entries (memguard's bound on --num-layers is 10,000)")
        return m.group(1) * n

    return pattern.sub(rep, text)


def layers_per_rank(L: "Layout") -> list[int]:
    """Transformer layers on each pipeline rank (summed over its virtual stages)."""
    pp = L.pipeline_model_parallel_size
    first, last = L.decoder_first_pipeline_num_layers, L.decoder_last_pipeline_num_layers
    if first is not None or last is not None:
        rest, stages = L.num_layers, pp
        if first is not None:
            rest, stages = rest - first, stages - 1
        if last is not None:
            rest, stages = rest - last, stages - 1
        middle = rest // stages if stages > 0 else 0
        counts = [middle] * pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts
    n = L.num_layers + int(L.account_for_embedding_in_pipeline_split) + int(L.account_for_loss_in_pipeline_split)
    return [n // pp] * pp  # embedding/loss slots are taken off in partition_layers


def partition_layers(L: "Layout") -> tuple[Chunk, ...]:
    pp, vpp = L.pipeline_model_parallel_size, L.vpp
    tied_copy = (not L.untie_embeddings_and_output_weights) and pp > 1
    # layers of each (rank r, virtual stage v) at index v * pp + r: the global layer order (vpp-major: all
    # ranks' chunk 0, then all ranks' chunk 1, ...), as the layout lists its stages
    if L.pipeline_model_parallel_layout:
        stages = parse_pipeline_layout(L.pipeline_model_parallel_layout, pp)
        vpp = len(stages) // pp
        counts = [st.count("t") for st in stages]
    else:
        per_rank = layers_per_rank(L)
        counts = [per_rank[r] // vpp for v in range(vpp) for r in range(pp)]
        if L.account_for_embedding_in_pipeline_split:
            counts[0] -= 1
        if L.account_for_loss_in_pipeline_split:
            counts[-1] -= 1
    firsts = [0, *accumulate(counts)]       # each chunk's first layer
    runs = model_kind_runs(L)
    ends = list(accumulate(n for _, n in runs))     # the model runs' ends, for _runs_between
    # each chunk's (kind, count) runs, in the model's layer order; the chunks of one kind and size share one
    # tuple (the caches key on it)
    made: dict[tuple[int, int], tuple[tuple[LayerKind, int], ...]] = {}
    chunk_runs = []
    j = 0                                   # the model run holding the chunk's first layer
    for first, n in zip(firsts, counts):
        while j < len(ends) - 1 and ends[j] <= first:
            j += 1
        while j and ends[j - 1] > first:    # (chunks come in layer order: only after an empty chunk's slot)
            j -= 1
        if n <= 0:
            chunk_runs.append(())
        elif first + n <= ends[j]:          # inside one run (most chunks)
            kr = made.get((j, n))
            if kr is None:
                kr = made[j, n] = ((runs[j][0], n),)
            chunk_runs.append(kr)
        else:
            chunk_runs.append(_runs_between(runs, ends, first, n))
    if L.dsa_indexer_topk_freq > 1:
        mtp_at = mtp_stage_index(L)
        check_dsa_topk_sharing(L, runs, firsts, counts, [i in (0, pp * vpp - 1, mtp_at) for i in range(len(counts))])
    chunks = []
    add = chunks.append
    last_i = pp * vpp - 1
    mtp_i = mtp_stage_index(L)
    for r in range(pp):
        for i in range(r, pp * vpp, pp):
            last = i == last_i
            # (positional: one Chunk per chunk of every layout; its fields in order)
            add(Chunk(r, i // pp, firsts[i], counts[i], i == 0, last, tied_copy and last, vpp, chunk_runs[i],
                      i == mtp_i))
    return tuple(chunks)


def check_dsa_topk_sharing(L: "Layout", runs: tuple[tuple[LayerKind, int], ...], firsts: list[int],
                           counts: list[int], batch: list[bool]) -> None:
    """A layer reusing a top-k needs its source layer earlier in its own model chunk: the top-k is handed over in a
    dict of the chunk's forward, never sent between pipeline stages. megatron-core 0.19.2 checks it when it builds a
    GPT model's chunk (experimental_attention_variant_module_specs.py _validate_dsa_index_share_pipeline_split, on the
    chunk's layer ids: PP and VPP boundaries alike); a hybrid model's 'D' layer raises at its first forward when the
    source did not run before it (DSAttention.forward), which also holds when the source is no 'D' layer.
    ``batch``: whether each chunk reads the batch (get_batch_on_this_tp_rank: the first and last stages, the MTP
    stage), whose attention mask then carries the top-k: a checkpoint's replay gets that mask detached, a new tensor
    without them, so a reusing layer replayed without its source (``core_attn`` recompute; full recompute with the
    source outside its checkpointed group) raises DSAttention's error in the backward (measured on CPU with
    tensor_parallel.checkpoint; on the config, the other chunks' carrier, the replay finds them)."""
    kinds = kinds_from_runs(runs)
    freq, offset = L.dsa_indexer_topk_freq, L.dsa_indexer_skip_topk_offset
    flags = (f"--dsa-indexer-topk-freq {freq}, --dsa-indexer-skip-topk-offset {offset}, --pipeline-model-parallel-size "
             f"{L.pipeline_model_parallel_size}" + (f", --virtual-pipeline-model-parallel-size {L.vpp}" if L.vpp > 1 else "")
             + (", --pipeline-model-parallel-layout" if L.pipeline_model_parallel_layout else ""))
    for first, n in zip(firsts, counts):
        for i in range(first, first + max(n, 0)):
            if kinds[i].mixer != MIXER_DSA_SHARED:
                continue
            src = dsa_topk_source(i + 1, offset, freq)
            if src - 1 < first:
                raise ConfigError("--dsa-indexer-topk-freq", f"layer {i + 1} reuses the top-k of layer {src}, which is in "
                                  f"an earlier pipeline stage or virtual stage ({flags}): top-k sharing does not cross "
                                  "pipeline boundaries (_validate_dsa_index_share_pipeline_split, megatron-core 0.19.2)",
                                  "split the layers so that every stage starts on a layer that computes its top-k",
                                  fails_later="model build")
            if kinds[src - 1].mixer != MIXER_DSA:
                raise ConfigError("--dsa-indexer-topk-freq", f"'D' layer {i + 1} reuses the top-k of layer {src}, which is "
                                  f"not a DSA layer ({flags}): DSAttention raises at its first forward",
                                  "choose --dsa-indexer-topk-freq / --dsa-indexer-skip-topk-offset that land on 'D' layers",
                                  fails_later="first forward step")
    if getattr(L, "create_attention_mask_in_dataloader", True):
        for first, n, reads in zip(firsts, counts, batch):
            bad = reads and _replayed_without_source(L, kinds, first, max(n, 0))
            if bad:
                raise ConfigError("--dsa-indexer-topk-freq", f"layer {bad} reuses a top-k and is recomputed without "
                                  f"its source layer ({_recompute_flags(L)}) on a pipeline stage that reads the "
                                  "batch's attention mask: the replay gets the mask detached, without the top-k hung "
                                  "on it, and DSAttention raises in the backward",
                                  "add --no-create-attention-mask-in-dataloader (the top-k then hang on the config) "
                                  "or recompute the layers with their sources", fails_later="first backward step")


def _recompute_flags(L: "Layout") -> str:
    if L.recompute_granularity == "full":
        return f"--recompute-granularity full --recompute-method {L.recompute_method} --recompute-num-layers " \
               f"{L.recompute_num_layers}"
    return "--recompute-modules core_attn"


def _replayed_without_source(L: "Layout", kinds: tuple[LayerKind, ...], first: int, n: int) -> int:
    """The first reusing layer (1-indexed) of the chunk whose checkpoint replays it without its source layer, or 0:
    core_attn recompute checkpoints each core alone; full recompute 'uniform' checkpoints groups of k layers from the
    chunk's first, 'block' the chunk's first k layers one by one (TransformerBlock._checkpointed_forward, 0.19.2)."""
    freq, offset = L.dsa_indexer_topk_freq, L.dsa_indexer_skip_topk_offset
    k = L.recompute_num_layers if L.recompute_num_layers is not None else 1
    for i in range(first, first + n):
        if kinds[i].mixer != MIXER_DSA_SHARED:
            continue
        if L.recompute_granularity == "selective" and "core_attn" in L.recompute_modules:
            return i + 1
        if L.recompute_granularity == "full":
            src = dsa_topk_source(i + 1, offset, freq) - 1
            j = i - first
            if L.recompute_method == "uniform" and (src - first) // k != j // k:
                return i + 1
            if L.recompute_method == "block" and j < k:
                return i + 1
    return 0


def _runs_between(runs: tuple[tuple[LayerKind, int], ...], ends: list[int], first: int,
                  n: int) -> tuple[tuple[LayerKind, int], ...]:
    """The (kind, count) runs of the model's layers first .. first + n - 1, from the model's runs (``ends``:
    where each run ends) without listing the layers: the parts of the runs the interval overlaps, equal
    neighbours merged (as kind_runs makes them)."""
    if n <= 0:
        return ()
    stop = first + n
    i = bisect_right(ends, first)                 # the run holding layer ``first``
    if stop <= ends[i]:                           # inside one run (most chunks)
        return ((runs[i][0], n),)
    out: list[list] = []
    start = ends[i - 1] if i else 0
    for (kind, _), end in zip(runs[i:], ends[i:]):
        k = (end if end < stop else stop) - (start if start > first else first)
        if out and out[-1][0] == kind:
            out[-1][1] += k
        else:
            out.append([kind, k])
        if end >= stop:
            break
        start = end
    return tuple((k, c) for k, c in out)
