"""Which transformer layers each pipeline rank and virtual stage builds, as megatron-core decides it.

Follows ``get_num_layers_to_build`` (megatron/core/transformer/transformer_block.py): even split of
``num_layers`` (+1 for the embedding, +1 for the loss when they are accounted for in the split), or
``decoder_first/last_pipeline_num_layers`` with the rest spread evenly over the middle stages, or an
explicit ``--pipeline-model-parallel-layout`` ("Et*3|(tt|)*29,m|L"); each rank's share divided evenly
over its virtual stages. Interleaved chunks take layers in global stage order ``vpp_rank * PP + pp_rank``.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    from .layout import Chunk, Layout


def parse_pipeline_layout(text: str, pp: int, key: str = "--pipeline-model-parallel-layout") -> list[list[str]]:
    """Megatron's layout syntax: stages split by '|', 'E' embedding, 't' layer, 'L' loss, 'm' MTP, ``(x)*n``."""
    s = _repeat(_repeat(text.replace(",", ""), r"\(([^)]+)\)\*(\d+)", key), r"(.)\*(\d+)", key)
    stages = [list(stage) for stage in s.split("|")]
    for stage in stages:
        for ch in stage:
            if ch not in "ELtm":
                raise ConfigError(key, f"unknown layer character {ch!r}; use E, t, L, m, | and (..)*n")
    if len(stages) % pp:
        raise ConfigError(key, f"has {len(stages)} stages, which is not a multiple of --pipeline-model-parallel-size {pp}")
    flat = [c for st in stages for c in st]
    if not flat or flat[0] != "E" or flat[-1] != "L" or flat.count("E") != 1 or flat.count("L") != 1:
        raise ConfigError(key, "must start with the embedding 'E' and end with the loss 'L', each exactly once")
    if "m" in flat:
        from .errors import NotModelledError
        raise NotModelledError(key, "multi-token prediction ('m') layers")
    return stages


# Longest layout memguard expands: 10 x its bound on --num-layers (numbers.py), with room for E, L and '|'.
MAX_LAYOUT = 100_000


def _repeat(text: str, pattern: str, key: str) -> str:
    """``text`` with every ``x*n`` of ``pattern`` written out, refusing a result longer than MAX_LAYOUT."""
    total = len(text)

    def rep(m: re.Match) -> str:
        nonlocal total
        n = int(m.group(2)) if len(m.group(2)) <= 6 else MAX_LAYOUT + 1
        total += len(m.group(1)) * n - len(m.group(0))
        if total > MAX_LAYOUT:
            raise ConfigError(key, f"expands to more than {MAX_LAYOUT:,} entries (memguard's bound on --num-layers is 10,000)")
        return m.group(1) * n

    return re.sub(pattern, rep, text)


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


def partition_layers(L: "Layout") -> tuple["Chunk", ...]:
    from .layout import Chunk

    pp, vpp = L.pipeline_model_parallel_size, L.vpp
    tied_copy = (not L.untie_embeddings_and_output_weights) and pp > 1
    counts: dict[tuple[int, int], int] = {}
    if L.pipeline_model_parallel_layout:
        stages = parse_pipeline_layout(L.pipeline_model_parallel_layout, pp)
        vpp = len(stages) // pp
        for idx, st in enumerate(stages):
            counts[(idx % pp, idx // pp)] = st.count("t")
    else:
        per_rank = layers_per_rank(L)
        for r in range(pp):
            for v in range(vpp):
                n = per_rank[r] // vpp
                if L.account_for_embedding_in_pipeline_split and r == 0 and v == 0:
                    n -= 1
                if L.account_for_loss_in_pipeline_split and r == pp - 1 and v == vpp - 1:
                    n -= 1
                counts[(r, v)] = n
    # Global layer order: vpp-major (all ranks' chunk 0, then all ranks' chunk 1, ...).
    first_layer: dict[tuple[int, int], int] = {}
    offset = 0
    for v in range(vpp):
        for r in range(pp):
            first_layer[(r, v)] = offset
            offset += counts[(r, v)]
    chunks = []
    for r in range(pp):
        for v in range(vpp):
            chunks.append(Chunk(
                pp_rank=r, vpp_rank=v, first_layer=first_layer[(r, v)], num_layers=counts[(r, v)],
                has_embedding=(r == 0 and v == 0), has_output=(r == pp - 1 and v == vpp - 1),
                has_tied_output_copy=tied_copy and r == pp - 1 and v == vpp - 1, vpp_size=vpp,
            ))
    return tuple(chunks)
