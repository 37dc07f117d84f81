"""How the ranks are split, and over how many ranks each kind of state is sharded.

Mirrors megatron-core's ``ModelParallelConfig`` (plus the world and DP sizes ``validate_args``
derives). ``ShardGroup`` names the process groups model state is sharded over; a new kind of
sharded state (experts' optimizer state over the expert-data-parallel group, world / (ETP x EP x PP);
Megatron-FSDP's sharded parameters) is one more member and one more case in ``shard_size``.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ShardGroup(str, Enum):
    """A group of ranks that shards (splits rather than replicates) some model state."""

    # The distributed optimizer's group for dense parameters: DP x CP ranks, split into
    # --num-distributed-optimizer-instances replicas (megatron/core/parallel_state.py,
    # get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)).
    DENSE_DP = "dense_dp"
    # The distributed optimizer's group for routed-expert parameters: the expert-data-parallel ranks,
    # world / (ETP x EP x PP) (initialize_model_parallel's expert rank generator has no CP axis), split
    # into the optimizer instances (intra_partial_expert_data_parallel).
    EXPERT_DP = "expert_dp"

    __str__ = str.__str__
    __format__ = str.__format__


@dataclass(frozen=True)
class Parallelism:
    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int | None
    context_parallel_size: int
    data_parallel_size: int
    sequence_parallel: bool
    num_distributed_optimizer_instances: int
    # mixture of experts (--expert-model-parallel-size, --expert-tensor-parallel-size; ETP None: no experts)
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    # the ranks of Transformer Engine's all-to-all in the attention under context parallelism (resolve/shape.py
    # cp_attention, from --cp-comm-type and --hierarchical-context-parallel-sizes): 1, the p2p ring over all CP
    # ranks (or all_gather); CP, a2a (AttnFuncWithCPAndQKVOA2A); between, a2a+p2p over two levels
    cp_a2a_size: int = 1
    # --cp-comm-type all_gather with FP8 attention asked for (resolve/shape.py cp_attention): Transformer Engine's
    # AttnFuncWithCPAndKVAllGather, FP8 from TE 2.15 (estimator/layers/fp8_attention.py fp8_all_gather_attention)
    cp_kv_all_gather: bool = False
    # one context-parallel communication type per layer when --cp-comm-type lists several (resolve/shape.py
    # cp_attention): comma-separated per global layer, "p2p", "all_gather", "a2a" or "a2a+p2p:N" (N all-to-all
    # ranks); the attention layers' kinds carry theirs (partition.py model_kind_runs, estimator/layers kind_layout);
    # cp_a2a_size and cp_kv_all_gather above are then the first layer's. None: one type for the model
    cp_comm_layers: str | None = None

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def dp(self) -> int:
        return self.data_parallel_size

    @property
    def vpp(self) -> int:
        return self.virtual_pipeline_model_parallel_size or 1

    def expert_dp_rank(self, dense_rank: int, tp_rank: int = 0) -> int:
        """The expert-data-parallel optimizer rank of the rank at index ``dense_rank`` of the dense DP x CP
        optimizer group (TP rank 0, the first optimizer instance). megatron-core numbers a stage's ranks
        tp-cp-dp for the dense grid and etp-ep-dp for the expert grid (parallel_state.initialize_model_parallel,
        RankGenerator order "tp-cp-ep-dp-pp", core 0.16.1 and 0.19.2), and each optimizer instance takes a run
        of consecutive members of its group (intra_partial_(expert_)data_parallel): dense index r is the stage's
        rank TP x r, whose expert-DP position is that rank // (ETP x EP). (Not min(r, EDP - 1): with TP 1, EP 2,
        DP 8 the dense ranks 0..7 hold the expert shards 0, 0, 1, 1, 2, 2, 3, 3.) ``tp_rank``: the process's TP
        rank: the stage's rank TP x r + tp_rank, an expert position further than TP rank 0's when TP > ETP x EP."""
        etp = self.expert_tensor_parallel_size or self.tensor_model_parallel_size
        return (self.tensor_model_parallel_size * dense_rank + tp_rank) // (etp * self.expert_model_parallel_size) % \
            self.shard_size(ShardGroup.EXPERT_DP)

    def shard_size(self, group: ShardGroup) -> int:
        """Ranks ``group`` shards its state over (1: every rank holds all of it)."""
        sizes = self.__dict__.get("_shard_sizes")
        if sizes is None:
            # worked out once per (frozen) Parallelism: the estimator asks per chunk and stage
            sizes = self.__dict__["_shard_sizes"] = {
                ShardGroup.DENSE_DP: max(1, self.data_parallel_size * self.context_parallel_size
                                         // self.num_distributed_optimizer_instances),
                ShardGroup.EXPERT_DP: max(1, self.world_size // (
                    (self.expert_tensor_parallel_size or self.tensor_model_parallel_size)
                    * self.expert_model_parallel_size * self.pipeline_model_parallel_size)
                    // self.num_distributed_optimizer_instances),
            }
        return sizes[group]
