"""Section: the world and the model-parallel sizes (validate_args, start), and sequence parallelism."""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import ConfigError, NotModelledError
from ..numbers import MAX_WORLD_SIZE, WORLD_SIZE_WHY, to_int
from .args import Args, Context


def parallel(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """TP, PP, CP, the world size (flag, launcher or nodes x GPUs) and DP = world / (TP*PP*CP)."""
    tp = a.int_arg("tensor_model_parallel_size", 1)
    pp = a.int_arg("pipeline_model_parallel_size", 1)
    cp = a.int_arg("context_parallel_size", 1)
    raw, world_override = a.raw, ctx.world_size
    world = world_override or raw.world_size
    if world is None and raw.nodes and raw.gpus_per_node:
        world = raw.nodes * raw.gpus_per_node
    world_key = "--world-size" if world_override else raw.origin.get("world_size", "--world-size")
    if world is None:
        recipe = raw.origin.get("recipe_gpus")
        raise ConfigError("--world-size", "the number of GPUs is unknown",
                          (f"give --gpus {recipe}, or another number" if recipe else
                           "give --world-size N, or --nnodes and --nproc-per-node, or set WORLD_SIZE"))
    world = to_int(world, world_key, 1, MAX_WORLD_SIZE, WORLD_SIZE_WHY)
    model_parallel = tp * pp * cp
    if world % model_parallel:
        # Recorded, not raised, so that the checks below still run (memguard validate lists them all).
        a.errors.append(ConfigError(world_key, f"{world} GPUs is not divisible by TP*PP*CP = {tp}*{pp}*{cp} = {model_parallel}",
                                    "change the world size or the parallel sizes"))
    dp = max(1, world // model_parallel)
    weight_shards(a, "tensor_parallel_num_weight_shards", "gtp_weight_remat_size", tp, "TP")
    return dict(world_size=world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                context_parallel_size=cp, data_parallel_size=dp)


def sequence_parallel(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """Sequence parallelism is switched off at TP=1 (validate_args); TP comm overlap needs it."""
    sp = a.bool_arg("sequence_parallel", False)
    if sp and kw["tensor_model_parallel_size"] == 1:
        sp = False
        a.notes.append("--sequence-parallel ignored: tensor-model-parallel size is 1 (Megatron switches it off)")
    tp_comm_overlap = a.bool_arg("tp_comm_overlap", False)
    if tp_comm_overlap and not sp:
        a.fail("tp_comm_overlap", "needs --sequence-parallel")
    return dict(sequence_parallel=sp, tp_comm_overlap=tp_comm_overlap)


def weight_shards(a: Args, shards_dest: str, remat_dest: str, tp: int, tp_name: str) -> None:
    """GTP weight rematerialisation (core 0.19, resolve_tensor_parallel_weight_shards): the weight shards
    are TP x remat size. validate_args fills the shards in as TP when unset, so shards == TP (remat 1) is
    the no-GTP default and is accepted; more shards rematerialise weights, which is not modelled."""
    shards = a.int_arg(shards_dest, None, minimum=1)
    remat = a.int_arg(remat_dest, None, minimum=1)
    if shards is not None and (shards < tp or shards % tp):
        a.fail(shards_dest, f"must be a multiple of the {tp_name} size ({tp}), got {shards}")
    elif (shards is not None and shards != tp) or (remat is not None and remat != 1):
        key = shards_dest if shards is not None and shards != tp else remat_dest
        raise NotModelledError(a.key(key), "GTP weight rematerialisation (weight shards beyond the TP size)")
