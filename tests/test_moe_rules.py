"""Megatron's MoE rules (megatron_memguard/moe_rules.py): each broken rule is one error naming the flag.

Sources of the rules: megatron/training/arguments.py validate_args, megatron/core/parallel_state.py
initialize_model_parallel, TransformerConfig.__post_init__ and MoELayer.forward (megatron-core 0.16.1 and
0.19.2 agree on these)."""
from __future__ import annotations

from typing import Any

import pytest

from megatron_memguard.errors import ConfigError, NotModelledError
from megatron_memguard.resolve.moe import read_moe


class _Reader:
    def __init__(self, **args: Any):
        self.a = args
        self.errors: list[ConfigError] = []

    def get(self, dest, default=None):
        v = self.a.get(dest)
        return default if v is None else v

    def key(self, dest):
        return "--" + dest.replace("_", "-")

    def fail(self, dest, rule, fix=None, *, fails_later=None):
        self.errors.append(ConfigError(self.key(dest), rule, fix, fails_later=fails_later))

    def int_arg(self, dest, default=None, required=False, minimum=1):
        v = self.a.get(dest)
        return default if v is None else int(v)

    def bool_arg(self, dest, default):
        v = self.a.get(dest)
        return default if v is None else bool(v)

    def float_arg(self, dest, default):
        v = self.a.get(dest)
        return default if v is None else float(v)


DENSE = dict(num_layers=4, ffn_hidden_size=2048, tp=1, pp=1, world_size=8, sequence_parallel=False,
             add_bias_linear=False, recompute_modules=(), recompute_granularity=None)


def _read(dense=None, **args):
    r = _Reader(**args)
    spec = read_moe(r, **{**DENSE, **(dense or {})})
    return spec, [str(e) for e in r.errors]


def test_defaults_follow_validate_args():
    spec, errors = _read(num_experts=8, expert_model_parallel_size=4, moe_router_topk=2, dense={"tp": 2, "sequence_parallel": True})
    assert not errors
    assert spec.moe_ffn_hidden_size == 2048          # moe_ffn_hidden_size = ffn_hidden_size
    assert spec.etp == 2                             # expert_tensor_parallel_size = TP
    assert spec.moe_token_dispatcher_type == "allgather" and spec.moe_layer_pattern == (True,) * 4


def test_dense_when_no_experts():
    assert _read(num_experts=0) == (None, [])       # --num-experts 0 is a dense model
    spec, errors = _read(expert_model_parallel_size=2)
    assert spec is None and errors == ["--expert-model-parallel-size: needs --num-experts (expert parallelism splits the experts)"]


@pytest.mark.parametrize("args,dense,flag", [
    (dict(num_experts=6, expert_model_parallel_size=4), {}, "--expert-model-parallel-size"),     # EP divides E
    (dict(num_experts=8, expert_model_parallel_size=4, expert_tensor_parallel_size=4), {}, "--expert-model-parallel-size"),  # 8 % 16
    (dict(num_experts=4, moe_router_topk=8), {}, "--moe-router-topk"),
    (dict(num_experts=4, moe_router_topk=1), {}, "--moe-router-topk"),                            # top-1 needs pre-softmax
    (dict(num_experts=4), {"tp": 2}, "--sequence-parallel"),                                        # TP > 1 needs SP
    (dict(num_experts=4, moe_token_dispatcher_type="a2a"), {}, "--moe-token-dispatcher-type"),
    (dict(num_experts=4, moe_pad_expert_input_to_capacity=True), {}, "--moe-pad-expert-input-to-capacity"),
    (dict(num_experts=4, moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="sinkhorn"), {},
     "--moe-expert-capacity-factor"),
    (dict(num_experts=4, moe_shared_expert_intermediate_size=512, moe_shared_expert_overlap=True), {},
     "--moe-shared-expert-overlap"),                                                                # only alltoall/flex
    (dict(num_experts=4, moe_shared_expert_intermediate_size=512), {"add_bias_linear": True},
     "--moe-shared-expert-intermediate-size"),
    (dict(num_experts=4), {"recompute_modules": ("moe_act",), "recompute_granularity": "selective"}, "--recompute-modules"),
    (dict(num_experts=4, moe_layer_freq="([0]*1+[1]*2)"), {}, "--moe-layer-freq"),                 # 3 entries, 4 layers
    (dict(num_experts=8, moe_router_group_topk=2, moe_router_num_groups=3), {}, "--moe-router-num-groups"),
])
def test_each_rule_is_one_error_naming_the_flag(args, dense, flag):
    spec, errors = _read(dense, **args)
    assert spec is None and len(errors) == 1 and errors[0].startswith(flag + ":"), errors


def test_top1_is_fine_with_pre_softmax_or_sinkhorn():
    assert _read(num_experts=4, moe_router_topk=1, moe_router_pre_softmax=True)[1] == []
    assert _read(num_experts=4, moe_router_topk=1, moe_router_load_balancing_type="sinkhorn")[1] == []


@pytest.mark.parametrize("dest", ["moe_paged_stash", "moe_expert_rank_capacity_factor"])   # upcycling: test_moe_upcycling.py
def test_unmodelled_moe_settings_are_refused_by_name(dest):
    with pytest.raises(NotModelledError) as e:
        # (the paged stash needs the rank capacity factor: TransformerConfig.__post_init__, core 0.19.2)
        _read(num_experts=4, moe_expert_rank_capacity_factor=1.0, **({dest: True} if dest == "moe_paged_stash" else {}))
    assert str(e.value).startswith("--" + dest.replace("_", "-") + ":")


@pytest.mark.parametrize("args, flag, rule", [
    # TransformerConfig.__post_init__ (core 0.19.2 transformer_config.py 1904-1921): three ValueErrors
    ({}, "--moe-paged-stash", "needs --moe-expert-rank-capacity-factor"),
    ({"moe_expert_rank_capacity_factor": 1.0, "cpu_offloading_num_layers": 1}, "--moe-paged-stash",
     "cannot be used with --cpu-offloading-num-layers"),
    ({"moe_expert_rank_capacity_factor": 1.0, "offload_modules": ["expert_fc1", "core_attn"]}, "--offload-modules",
     "must not include expert_fc1"),
])
def test_paged_stash_rules_are_errors_not_refusals(args, flag, rule):
    spec, errors = _read(num_experts=4, moe_paged_stash=True, **args)
    assert len(errors) == 1 and errors[0].startswith(f"{flag}: {rule}"), errors


def test_flex_dispatcher_deepep_group_sizes():
    spec, errors = _read(num_experts=8, expert_model_parallel_size=8, moe_token_dispatcher_type="flex")
    assert errors == [] and spec.moe_token_dispatcher_type == "flex" and spec.moe_flex_dispatcher_num_sms == 20
    spec, _ = _read(num_experts=8, moe_enable_deepep=True)                    # the deprecated switch
    assert spec.moe_token_dispatcher_type == "flex"
    with pytest.raises(NotModelledError, match="--moe-flex-dispatcher-backend") as e:
        _read(num_experts=4, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep")
    # the workaround README gives, in the input's own spelling, on the same line
    assert "(--moe-flex-dispatcher-backend deepep estimates the run with DeepEP)" in str(e.value)
    assert "\n" not in str(e.value)
    # across nodes: DeepEP's tuned group sizes (deep-ep 1.0.0 Buffer.get_dispatch_config) are modelled, others refused
    spec, errors = _read({"world_size": 16}, num_experts=16, expert_model_parallel_size=16, moe_token_dispatcher_type="flex")
    assert errors == [] and spec.ep == 16
    with pytest.raises(NotModelledError, match="DeepEP over 48 ranks"):
        _read({"world_size": 48}, num_experts=48, expert_model_parallel_size=48, moe_token_dispatcher_type="flex")
    spec, errors = _read(num_experts=4, moe_token_dispatcher_type="flex", moe_expert_capacity_factor=1.0,
                         moe_pad_expert_input_to_capacity=True)
    assert errors == ["--moe-pad-expert-input-to-capacity: is not supported by the flex dispatcher with DeepEP"]


def test_expert_parallel_overlap_rules():
    ok = dict(num_experts=8, expert_model_parallel_size=4, moe_token_dispatcher_type="alltoall",
              overlap_moe_expert_parallel_comm=True)
    spec, errors = _read(**ok)
    assert errors == [] and spec.overlap_moe_expert_parallel_comm
    spec, errors = _read(**{**ok, "moe_token_dispatcher_type": "allgather"})
    assert errors == ["--overlap-moe-expert-parallel-comm: needs the alltoall or flex token dispatcher"]
    # PP > 1 needs virtual stages (TransformerConfig.__post_init__); with them the combined 1F1B is modelled
    spec, errors = _read({"pp": 2}, **ok)
    assert errors == ["--overlap-moe-expert-parallel-comm: needs virtual pipeline stages when "
                      "--pipeline-model-parallel-size > 1 (--num-layers-per-virtual-pipeline-stage or a pipeline layout)"]
    spec, errors = _read({"pp": 2, "vpp": 2}, **ok)
    assert errors == [] and spec.overlap_moe_expert_parallel_comm
    spec, errors = _read({"half": False}, **ok)
    assert errors == ["--overlap-moe-expert-parallel-comm: needs --bf16 or --fp16"]


def test_capacity_factor_is_bounded():
    spec, errors = _read(num_experts=4, moe_expert_capacity_factor=1e300)
    assert spec is None and errors[0].startswith("--moe-expert-capacity-factor: must be <= 1,000")
    spec, errors = _read(num_experts=4, moe_expert_capacity_factor=-1.0)     # negative: dropless
    assert errors == [] and spec.moe_expert_capacity_factor is None
