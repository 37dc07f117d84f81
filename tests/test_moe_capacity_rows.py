"""The rows the alltoall dispatcher permutes with a capacity factor (found by
tests/test_properties_directions.py: padding to capacity kept fewer bytes than dropping at the same capacity).

apply_router_token_dropping (megatron/core/transformer/moe/moe_utils.py, core 0.16.1 and 0.19.2) keeps at most
C = ceil(T k / E x factor) tokens of each expert's column of the routing map, so the dispatcher permutes
``num_out_tokens = routing_map.sum()`` rows, not T x k; with --moe-pad-expert-input-to-capacity it permutes
``capacity x num_experts`` (MoEAlltoAllTokenDispatcher.preprocess, drop_and_pad). The permutation's int64 index
maps and the permuted tokens have that many rows.
"""
from __future__ import annotations

import pytest

from megatron_memguard import layout_from_flags
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.estimator.layers.moe import sent_rows, tokens_per_rank
from megatron_memguard.partition import layer_kinds

# one MoE layer, 8 tokens per micro-batch (seq 8, MBS 1), 2 experts, top-1
FLAGS = ("--num-layers 1 --hidden-size 16 --num-attention-heads 1 --kv-channels 16 --ffn-hidden-size 8 --seq-length 8 "
         "--max-position-embeddings 8 --micro-batch-size 1 --global-batch-size 1 --vocab-size 1000 "
         "--tokenizer-type NullTokenizer --bf16 --transformer-impl transformer_engine --disable-bias-linear "
         "--position-embedding-type rope --num-experts 2 --moe-router-topk 1 --moe-router-pre-softmax "
         "--moe-ffn-hidden-size 8 --moe-token-dispatcher-type alltoall").split()


def _layout(factor: float | None, pad: bool, era: str = "0.19"):
    extra = [] if factor is None else ["--moe-expert-capacity-factor", str(factor)]
    return layout_from_flags(FLAGS + extra + (["--moe-pad-expert-input-to-capacity"] if pad else []), world_size=1,
                             megatron_version=era)


@pytest.mark.parametrize("factor, pad, rows", [
    (None, False, 8),     # dropless: T x k = 8
    (0.5, False, 4),      # C = ceil(8 / 2 x 0.5) = 2 per expert: 2 x 2 = 4 kept of the 8 choices
    (1.0, False, 8),      # C = 4: the balanced 4 per expert all kept
    (2.0, False, 8),      # C = 8: nothing to drop, still the 8 choices
    (0.5, True, 4),       # padded to capacity: 2 experts x C 2
    (2.0, True, 16),      # padded to capacity: 2 experts x C 8, more rows than choices
])
def test_permuted_rows_with_a_capacity_factor_by_hand(factor, pad, rows):
    L = _layout(factor, pad)
    assert sent_rows(L.moe, tokens_per_rank(L)) == rows
    if not pad:
        # core 0.19.2 unfused permute: int64 flat_sorted and sorted_indices [rows] (16 B per row); sorted_indices is
        # the dispatcher's reversed_local_input_permutation_mapping, held until the next forward (moe_dispatcher_state)
        (kind,) = [k for k in layer_kinds(L) if k.mlp == "moe"]
        assert layer_activations(L, True, kind).saved["moe_permute_maps"] == 16 * rows
        from megatron_memguard.estimator.layers.moe import moe_activations
        T, E = tokens_per_rank(L), 2
        assert moe_activations(L, L.moe).held == 3 * T * E + 8 * rows      # bf16 probs and bool map [T, E], mapping


@pytest.mark.parametrize("factor, pad", [(0.5, False), (1.0, False), (2.0, False), (0.5, True), (2.0, True),
                                         (0.25, False), (1.5, True)])
def test_permuted_rows_are_megatron_cores(factor, pad):
    """The same balanced routing (token t to expert t mod 2) through megatron-core's own token dropping and
    permute on CPU: the permutation's index map has memguard's row count."""
    torch = pytest.importorskip("torch")
    mu = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    L = _layout(factor, pad)
    T, E, k = tokens_per_rank(L), 2, 1
    routing = torch.zeros(T, E, dtype=torch.bool)
    routing[torch.arange(T), torch.arange(T) % E] = True
    probs = routing.float() * torch.linspace(0.5, 1.0, T).unsqueeze(1)
    probs, routing = mu.apply_router_token_dropping(probs, routing, router_topk=k, capacity_factor=factor,
                                                    pad_to_capacity=pad)
    if pad:
        capacity = mu.get_capacity(num_tokens=T * k, num_experts=E, capacity_factor=factor)
        num_out = capacity * E
    else:
        num_out = int(routing.sum())
    tokens = torch.randn(T, 16)
    # (0.16.1 returns permuted tokens, probs and indices; 0.19.2 two more: the indices stay third)
    out = mu.permute(tokens, routing, num_out_tokens=num_out, drop_and_pad=pad)
    assert out[0].shape[0] == out[2].numel() == sent_rows(L.moe, T)


@pytest.mark.parametrize("factor, pad, worst", [
    (2.0, False, 8),      # C = 8 per expert, but the 8 tokens make 8 top-1 choices: at most 8 rows, not C x E = 16
    (0.5, False, 4),      # C = 2: 2 experts x 2 kept
    (2.0, True, 16),      # padded to capacity: exactly C x E = 16
])
def test_the_worst_case_rows_are_bounded_by_the_choices_too(factor, pad, worst):
    """Dropping only removes rows (apply_router_token_dropping, moe_utils.py, core 0.16.1 and 0.19.2): a rank's experts
    get at most C per expert and source rank and at most the source's T x min(k, E_l) choices (found by
    tests/test_properties_newest.py: the worst case with a capacity was above the dropless worst case)."""
    from megatron_memguard.estimator.layers.moe import expert_rows
    L = _layout(factor, pad)
    assert expert_rows(L.moe, tokens_per_rank(L)).worst == worst
