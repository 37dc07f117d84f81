"""Shared set-up for the planner tests: a Planner for a published model on a GPU cluster."""
from megatron_memguard.gpus import lookup_gpu
from megatron_memguard.planner import Cluster, Planner
from megatron_memguard.readers.megatron_flags import parse_megatron_flags


def make_planner(model, gpus, seq, gbs, gpu="H100-80GB", gpus_per_node=None, gpu_memory=None, threshold=0.8):
    g = lookup_gpu(gpu)
    gpn = gpus_per_node or g.gpus_per_node
    domain = g.nvlink_domain if (g.nvlink_domain > g.gpus_per_node and not gpus_per_node) else gpn
    cluster = Cluster(gpus=gpus, gpus_per_node=min(gpn, gpus), gpu=g, nvlink_domain=min(domain, gpus),
                      gpu_memory_bytes=gpu_memory or g.memory_bytes)
    return Planner(parse_megatron_flags(model), cluster, seq_length=seq, global_batch_size=gbs, threshold=threshold)


def key_of(c, **changes):
    d = dict(tp=c.tp, pp=c.pp, cp=c.cp, vpp=c.vpp, first=c.first, last=c.last, sp=c.sp, mbs=c.mbs,
             recompute=c.recompute, dist_opt=c.dist_opt)
    d.update(changes)
    return tuple(sorted(d.items()))
