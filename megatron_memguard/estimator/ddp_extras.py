"""DDP's fp32 gradient options: the fp32 main_grad copies of matching parameters, and the temporaries of the
reduce-scatter with fp32 accumulation (megatron/core/distributed/param_and_grad_buffer.py and
reduce_scatter_with_fp32_accumulation.py, megatron-core 0.19.2). Pure functions of a resolved layout.
"""
from __future__ import annotations

import fnmatch
import re
from functools import lru_cache

from ..errors import ConfigError
from ..layout import Layout, ShardGroup, TensorKind
from .fsdp import version_tuple
from .params import chunk_params, holds_final_norm, holds_mtp, layer_param_rows
from .states import _chunk_buffer, bucket_size_for


def matches(name: str, patterns: tuple[str, ...]) -> bool:
    """_ParamAndGradBuffer.__init__: ``fnmatch.fnmatch(param_name, pattern) or pattern == 'all'``."""
    return _matcher(patterns)(name)


@lru_cache(maxsize=32)
def _matcher(patterns: tuple[str, ...]):
    """One compiled test for all the patterns (fnmatch's own translation, so its semantics exactly; a name is
    tested once, not once per pattern). fnmatch.fnmatch normalises case with os.path.normcase: a no-op on
    POSIX, where Megatron runs."""
    if "all" in patterns:
        return lambda name: True
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns)).match


# Characters with which a pattern can tell a layer or expert index apart: without them the result of a name is
# the same for every index (a pattern's literals cannot match the digits of an index, so a '*' takes them,
# whatever they are), and one layer of each kind stands for all of its layers.
_INDEX_AWARE = frozenset("0123456789?[")
# memguard's bound on name tests for patterns that can tell indices apart (each tests every parameter's name):
# about 1 s of CPU; Megatron's own uses name a handful of modules, not layer numbers.
MAX_INDEXED_NAME_TESTS = 1_000_000


_FUSED_NORM = re.compile(r"\.layer_norm\.(weight|bias)$")
_LOCAL_NORMS = ((re.compile(r"self_attention\.linear_qkv\.layer_norm\.(weight|bias)$"), r"input_layernorm.\1"),
                (re.compile(r"mlp\.linear_fc1\.layer_norm\.(weight|bias)$"), r"pre_mlp_layernorm.\1"))


def ddp_param_name(L: Layout, name: str) -> str:
    """The name DDP gives a parameter: ``self.module.named_parameters()`` of the model chunk, which get_model
    wraps in Float16Module (attribute ``module``) under --bf16 / --fp16 (training.py, core 0.19.2). The layer
    recipes name a norm fused into the next linear ``<linear>.layer_norm.weight``: Transformer Engine's
    LayerNormLinear registers it as ``layer_norm_weight`` / ``layer_norm_bias``; the local spec keeps separate
    ``input_layernorm`` / ``pre_mlp_layernorm`` modules (gpt_layer_specs.py)."""
    if L.transformer_impl == "transformer_engine":
        name = _FUSED_NORM.sub(r".layer_norm_\1", name)
    else:
        for pattern, repl in _LOCAL_NORMS:
            name = pattern.sub(repl, name)
    return ("module." + name) if L.params_dtype != "fp32" else name


@lru_cache(maxsize=256)
def fp32_local_accumulation_numel(L: Layout, pp_rank: int) -> int:
    """Elements of this pipeline rank's parameters whose main_grad is promoted to its own fp32 tensor
    (--ddp-param-name-patterns-for-fp32-local-accumulation): ``torch.empty_like(param.main_grad,
    dtype=torch.float32)``, the whole parameter, kept in ``extra_main_grads`` for the run."""
    patterns = tuple(getattr(L, "ddp_param_name_patterns_for_fp32_local_accumulation", ()) or ())
    if not patterns:
        return 0
    test = _matcher(patterns)
    chunks = L.stage_chunks(pp_rank)
    indexed = any(ch in _INDEX_AWARE for p in patterns if p != "all" for ch in p)
    rows = {kind: layer_param_rows(L, kind) for c in chunks for kind, _ in c.kind_runs}
    if indexed:
        tests = sum(len(rows[kind]) * n for c in chunks for kind, n in c.kind_runs) * len(patterns)
        if tests > MAX_INDEXED_NAME_TESTS:
            raise ConfigError("--ddp-param-name-patterns-for-fp32-local-accumulation",
                              f"{len(patterns):,} patterns, with digits, '?' or '[' (which tell layers apart), tested against "
                              f"each parameter name of pipeline rank {pp_rank} make {tests:,} tests; memguard accepts at most "
                              f"{MAX_INDEXED_NAME_TESTS:,} (patterns without layer numbers are tested once per layer kind)")
    # each kind's names as DDP spells them, in layer 0 (a layer's own: its index in place of the 0)
    named = {kind: [(ddp_param_name(L, f"decoder.layers.0.{name}"), numel) for name, numel, *_ in r]
             for kind, r in rows.items()}
    matched = {} if indexed else {kind: sum(numel for name, numel in r if test(name)) for kind, r in named.items()}
    total = 0
    for c in chunks:
        total += sum(p.numel for p in chunk_params(L, c, layers=False) if test(ddp_param_name(L, p.name)))
        if not indexed:
            total += sum(n * matched[kind] for kind, n in c.kind_runs)
            continue
        for i, kind in enumerate(c.layer_kinds):
            at = f"decoder.layers.{i}."
            total += sum(numel for name, numel in named[kind] if test(name.replace("decoder.layers.0.", at, 1)))
    return total


# distributed_data_parallel.py links each bucket group to its predecessor (previous_grad_reduce_bucket_group) in the
# 0.18.2 and 0.19.2 wheels, not in 0.16.1's or 0.17.1's
DRAINS_PREDECESSOR_SINCE = (0, 18)


@lru_cache(maxsize=256)
def rs_fp32_accumulation_bytes(L: Layout, pp_rank: int) -> int:
    """The reduce-scatter temporaries of --ddp-reduce-scatter-with-fp32-accumulation alive at once after the
    backward, in finish_grad_sync (reduce_scatter_with_fp32_accumulation.py): per bucket the all-to-all output
    (``torch.empty_like(input_tensor)``: the bucket, in the gradient dtype), held by the work handle until its
    wait(), and at that wait() the fp32 sum of this rank's shard (``torch.sum(..., dtype=torch.float32)``:
    bucket / shard x 4 B). Dense buffers shard over DP x CP, expert buffers over expert DP.

    Without --overlap-grad-reduce the reductions are synchronous, one bucket at a time: the largest bucket's two
    temporaries. With it, every bucket is dispatched during the backward and waited for in finish_grad_sync: core
    0.18 and later drain a bucket group's predecessor when they dispatch it, so each chunk's (and expert buffer's)
    last bucket is still outstanding; 0.16.1 and 0.17 drain nothing, so all of them are; plus the largest fp32
    shard sum of the first wait()."""
    if not getattr(L, "ddp_reduce_scatter_with_fp32_accumulation", False) or not L.use_distributed_optimizer:
        return 0
    g = L.precision.byte_sizes()[TensorKind.MAIN_GRAD]
    groups = [ShardGroup.DENSE_DP] + ([ShardGroup.EXPERT_DP] if L.moe is not None else [])
    drains = version_tuple(L.megatron_version) >= DRAINS_PREDECESSOR_SINCE
    outstanding = shard_sum = one_at_a_time = 0
    for c in L.stage_chunks(pp_rank):
        for group in groups:
            expert = group is ShardGroup.EXPERT_DP
            buf, _ = _chunk_buffer(L, c.kind_runs, c.has_embedding and not expert, c.has_output,
                                   c.has_tied_output_copy and not expert, bucket_size_for(L, c), (), group,
                                   None if expert else holds_final_norm(L, c), holds_mtp(L, c))
            if not buf.buckets:
                continue
            shard = L.parallel.shard_size(group)
            # (buckets in dispatch order: the first holds the last parameters, whose gradients come first)
            sizes = [b.end - b.start for b in buf.buckets]
            shard_sum = max(shard_sum, max(n // shard * 4 for n in sizes))
            one_at_a_time = max(one_at_a_time, max(n * g + n // shard * 4 for n in sizes))
            outstanding += (sizes[-1] if drains else sum(sizes)) * g
    return outstanding + shard_sum if L.overlap_grad_reduce else one_at_a_time
