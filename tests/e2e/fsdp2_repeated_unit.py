"""One torch FSDP2 unit called at D depths in one forward, as TorchFullyShardedDataParallel shards the one MTP layer
of --mtp-use-repeated-layer (megatron-core 0.19.2 fully_shards every TransformerLayer): on CPU with gloo, 2 ranks.

    python -m torch.distributed.run --nproc_per_node 2 tests/e2e/fsdp2_repeated_unit.py D

prints, on rank 0, one JSON line: the unit's all-gathers and reduce-scatters, its post-backward hooks (one per call)
and at which of them its gradient was reduce-scattered, and whether its sharded gradient equals the eager model's
(the sum of the D calls' gradients).
"""
import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group


class Model(nn.Module):
    """A shared layer applied at ``depths`` depths, each depth's output feeding a head (the MTP losses)."""

    def __init__(self, depths: int):
        super().__init__()
        self.depths = depths
        self.layer = nn.Linear(16, 16, bias=False)
        self.head = nn.Linear(16, 1, bias=False)

    def forward(self, x):
        loss = 0
        for _ in range(self.depths):
            x = self.layer(torch.tanh(x))
            loss = loss + self.head(x).sum()
        return loss


def main(depths: int) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    eager, model = Model(depths), Model(depths)
    model.load_state_dict(eager.state_dict())
    fully_shard(model.layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    unit = model.layer
    counts = {"all_gather": 0, "reduce_scatter": 0, "post_backward": 0, "reduced_at_post_backward": []}

    mine = {id(p) for p in unit._get_fsdp_state()._fsdp_param_group.fsdp_params}

    def watch(name, key):
        # the collectives _fsdp_param_group.py issues (a module-level name there): counted for the unit's parameters
        orig = getattr(param_group, name)

        def wrapped(fsdp_params, *args, **kwargs):
            if {id(p) for p in fsdp_params} & mine:
                counts[key] += 1
                if key == "reduce_scatter":
                    counts["reduced_at_post_backward"].append(counts["post_backward"])
            return orig(fsdp_params, *args, **kwargs)
        setattr(param_group, name, wrapped)
    watch("foreach_all_gather", "all_gather")
    watch("foreach_reduce", "reduce_scatter")
    post_backward = param_group.FSDPParamGroup.post_backward

    def counted(self, *args):
        if self._module_fqn == "layer" and self._training_state != param_group.TrainingState.POST_BACKWARD:
            counts["post_backward"] += 1      # (the root's final callback calls it again, once more: not counted)
        return post_backward(self, *args)
    param_group.FSDPParamGroup.post_backward = counted
    x = torch.randn(4, 16)
    model(x).backward()
    eager(x).backward()
    counts["gradient_is_the_sum"] = bool(torch.allclose(unit.weight.grad.full_tensor(), eager.layer.weight.grad,
                                                        atol=1e-6))
    if dist.get_rank() == 0:
        print(json.dumps(counts))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
