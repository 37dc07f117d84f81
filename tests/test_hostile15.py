"""Regressions of issue hostile15 (benchmarks/hostile_input.py's hostile15 group): MoE-only settings on a dense
model, launch-script forms that ended in imprecise errors, Bridge's bool overrides. Each is the smallest input of its
class, with what the real tool does and what memguard does now."""
from __future__ import annotations


import pytest

from fuzz_util import run_memguard

S = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
     "--micro-batch-size 1 --global-batch-size 16 --tokenizer-type NullTokenizer --vocab-size 1000 --bf16")
RUN = "torchrun --nproc-per-node 8 pretrain_gpt.py "


# -- MoE-only settings on a dense model ------------------------------------------------------------------------------
# (flags, the flag memguard names, the rule's words, TransformerConfig's fields, releases whose argparse has the flags)
DENSE_MOE = [
    ("--moe-paged-stash", "--moe-paged-stash", "needs --moe-expert-rank-capacity-factor",
     dict(moe_paged_stash=True), ("0.19.2",)),
    ("--moe-expert-rank-capacity-factor 1.5", "--moe-expert-rank-capacity-factor",
     "needs --moe-flex-dispatcher-backend hybridep or ncclep", dict(moe_expert_rank_capacity_factor=1.5), ("0.19.2",)),
    ("--moe-expert-rank-capacity-factor 1.5 --moe-flex-dispatcher-backend hybridep", "--moe-expert-rank-capacity-factor",
     "needs --use-transformer-engine-op-fuser",
     dict(moe_expert_rank_capacity_factor=1.5, moe_flex_dispatcher_backend="hybridep"), ("0.19.2",)),
    ("--moe-ffn-hidden-size 512", "--moe-ffn-hidden-size", "needs --num-experts", dict(moe_ffn_hidden_size=512),
     ("0.16.1", "0.19.2")),
    ("--moe-enable-deepep", "--moe-enable-deepep", "needs --moe-token-dispatcher-type flex", dict(moe_enable_deepep=True),
     ("0.16.1", "0.19.2")),
    ("--moe-shared-expert-intermediate-size 512 --moe-shared-expert-overlap", "--moe-shared-expert-overlap",
     "only works with the alltoall or flex token dispatcher",
     dict(moe_shared_expert_intermediate_size=512, moe_shared_expert_overlap=True), ("0.16.1", "0.19.2")),
    ("--moe-expert-capacity-factor 1.0 --moe-router-load-balancing-type sinkhorn", "--moe-expert-capacity-factor",
     "only works with aux_loss", dict(moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="sinkhorn"),
     ("0.16.1", "0.19.2")),
    ("--moe-pad-expert-input-to-capacity", "--moe-pad-expert-input-to-capacity", "needs --moe-expert-capacity-factor",
     dict(moe_pad_expert_input_to_capacity=True), ("0.16.1", "0.19.2")),
    ("--moe-router-enable-expert-bias", "--moe-router-enable-expert-bias", "needs --moe-router-score-function sigmoid",
     dict(moe_router_enable_expert_bias=True), ("0.16.1", "0.19.2")),
    ("--moe-router-padding-for-quantization", "--moe-router-padding-for-quantization", "needs --fp8-format or --fp4-format",
     dict(moe_router_padding_for_quantization=True), ("0.16.1", "0.19.2")),
    ("--moe-router-topk 1", "--moe-router-topk", "needs --moe-router-pre-softmax", dict(moe_router_topk=1),
     ("0.16.1", "0.19.2")),
    ("--moe-router-group-topk 2 --moe-router-num-groups 2", "--moe-router-group-topk", "needs --num-experts",
     dict(moe_router_group_topk=2, moe_router_num_groups=2), ("0.16.1", "0.19.2")),
]


def _megatron_version() -> str | None:
    try:
        from megatron.core.package_info import __version__
    except ImportError:
        return None
    return __version__


@pytest.mark.parametrize("flags, flag, rule, fields, releases", DENSE_MOE, ids=[c[0][:50] for c in DENSE_MOE])
def test_moe_only_settings_on_a_dense_model_break_megatrons_rule(flags, flag, rule, fields, releases):
    # TransformerConfig.__post_init__ checks these with no num_moe_experts guard (core 0.19.2 transformer_config.py
    # lines 1538-1710, 1904-1920, 2284-2360; 0.16.1 lines 1058-1135, 1593-1660), so megatron-core stops a dense
    # model that sets them; memguard accepted every one (its MoE rules ran only with --num-experts)
    for version in releases:
        o = run_memguard(["validate", "--world-size", "8", "--megatron-version", version, "--", *S.split(), *flags.split()])
        assert o.code == 1 and not o.problems, o.describe()
        assert any(line.strip().startswith(f"{flag}: ") and rule in line for line in o.out.splitlines()), o.out
    have = _megatron_version()
    if have is None or have not in releases:
        pytest.skip("the real megatron-core of this venv does not have these fields")
    from megatron.core.transformer.transformer_config import TransformerConfig
    # the real rule, on the same dense model (an error of any kind stops the run: group-limited routing divides
    # num_moe_experts None and raises TypeError)
    with pytest.raises((ValueError, AssertionError, TypeError)):
        TransformerConfig(num_layers=4, hidden_size=256, num_attention_heads=8, **fields)


def test_a_dense_model_with_satisfied_moe_settings_is_accepted():
    # the same settings that megatron-core lets through on a dense model change nothing: no error
    o = run_memguard(["validate", "--world-size", "8", "--megatron-version", "0.19.2", "--", *S.split(),
                      "--moe-router-topk", "1", "--moe-router-pre-softmax", "--moe-expert-capacity-factor", "1.0"])
    assert o.code == 0 and not o.problems, o.describe()
    # 0.19.2 lets --moe-ffn-hidden-size through when --moe-layer-freq leaves dense layers (transformer_config.py 1538)
    o = run_memguard(["validate", "--world-size", "8", "--megatron-version", "0.19.2", "--", *S.split(),
                      "--moe-ffn-hidden-size", "512", "--moe-layer-freq", "[0,1,0,1]"])
    assert o.code == 0 and not o.problems, o.describe()
