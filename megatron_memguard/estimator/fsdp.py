"""Megatron-FSDP and torch FSDP2: what one rank keeps, and what is unsharded while a layer runs.

Megatron-FSDP (``--use-megatron-fsdp``) replaces DDP's contiguous buffer with one buffer set per
parameter group (``ParamAndGradBuffer._init_each_parameter_group_buffers`` in
megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py, core 0.16.1 and 0.19.2).
A group is one FSDP unit (a TransformerLayer under ``optim_grads_params``) x dtype x expert/dense, or
a run of parameters outside units. Per strategy a buffer is whole on every rank or sharded over the
group's FSDP ranks (DP x CP for dense parameters, the expert data-parallel group for experts):

    strategy             compute weights   main weights   main grads   optimizer state
    no_shard             model's own       whole          whole        whole
    optim                whole             sharded        whole        sharded
    optim_grads          whole             sharded        sharded      sharded
    optim_grads_params   sharded           sharded        sharded      sharded

A sharded buffer needs its full bucket while it is used: weights are all-gathered before a unit's
forward and backward (``AllGatherPipeline``), gradients are produced into a full bucket and
reduce-scattered (``GradReducePipeline``). How many such buckets live at once is set by the
prefetch limit and the reduce-scatter queue capacity, both derived from
``--suggested-communication-unit-size`` (``MegatronFSDP.__init__``), or by ``--fsdp-double-buffer``
(two unit-sized buffers each).

torch FSDP2 (``--use-torch-fsdp2``, ``TorchFullyShardedDataParallel``) shards every parameter over
DP x CP; Megatron's non-distributed mixed-precision optimizer keeps an fp32 clone of each shard.

Everything here is a pure function of a small spec built from flat Megatron argument names
(``FsdpSpec.from_flat``) and of the parameter groups of one rank (``FsdpGroup``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

# megatron_fsdp.py MegatronFSDP.__init__: when --suggested-communication-unit-size is not given,
# the derived size is raised to at least 1e9 elements ("Cap to 1B elements"); the all-gather
# prefetch stops past half of it, the reduce-scatter queue holds up to all of it. Both versions.
COMM_UNIT_FLOOR = 1_000_000_000
# FixedPoolAllocator / MaxPoolAllocator: UB_BUFFER_NUM = 2 unit-sized buffers per kind.
DOUBLE_BUFFER_UNITS = 2
# Release gates of Megatron-FSDP, each read in the megatron-core wheels 0.16.1, 0.17.1, 0.18.2 and 0.19.2:
# MixedPrecisionPolicy (megatron_fsdp/mixed_precision.py; mcore_fsdp_adapter.py builds it from
# --megatron-fsdp-main-params-dtype / --megatron-fsdp-main-grads-dtype) from 0.17.1; 0.16.1 has fp32 main weights
# (preserve_fp32_weights) and grads from grad_reduce_in_fp32. The 0.17.1 and 0.18.2 adapters still let the
# "grandfathered" grad_reduce_in_fp32 (--accumulate-allreduce-grads-in-fp32, on for bf16 by default) force fp32
# main grads; 0.19.2's adapter passes --megatron-fsdp-main-grads-dtype alone. 0.17.1's HSDP builds the expert mesh
# from the partial expert-DP group (intra_expt_dp) as 0.18.2 and 0.19.2 do (0.16.1: none), and its
# calc_params_l2_norm (training/utils.py) calls stop_communication() as 0.19.2's does.
MIXED_PRECISION_POLICY_SINCE = (0, 17)
GRAD_REDUCE_FP32_MAIN_GRADS_UNTIL = (0, 19)   # grandfathered grad_reduce_in_fp32 -> fp32 main grads (0.17, 0.18)
# ParamAndGradBuffer.update_main_grads reads ddp_config.megatron_fsdp_use_decoupled_grad (= --use-precision-aware-
# optimizer) from 0.18.2; 0.16.1 and 0.17.1 test getattr(self, "use_precision_aware_optimizer", False), which nothing
# sets: the gradient is always cast to the main weights' dtype.
DECOUPLED_GRAD_SINCE = (0, 18)
# Which modules a root pre-backward marks PRE_BACKWARD (MegatronFSDP._register_fsdp_hooks, _root_pre_backward): every
# sub-module of the root from 0.18.2 (0.19.2 the same), the FSDP units alone in 0.16.1 and 0.17.1; a unit's post-backward
# hook sets only its own sub-modules back to IDLE. A module in PRE_BACKWARD runs its pre-forward unshard without forward
# prefetch, so from 0.18.2 on, after the first backward, the modules outside units (embedding, final norm, output layer)
# gather only their own bucket. Before, the final norm's pre-forward hook prefetches the buckets that follow its own
# (the group outside units is bucket 0: the embedding's parameters come first, _get_parameter_groups step 1), i.e.
# every unit up to the prefetch limit, each released by its _post_forward just before: they are whole again through
# the loss and the top of the backward. From 0.18.2 they are gathered by the last unit's pre-backward hook, once the
# output layer's and the final norm's backward are done (CPU referee on 0.19.2, fsdp_grid: the measured peaks at the
# loss hold no unit bucket; on 0.16.1 they hold every one).
UNITS_REGATHERED_BEFORE_LOSS_UNTIL = (0, 18)
# validate_args switches --use-distributed-optimizer on under Megatron-FSDP and --data-parallel-sharding-strategy
# defaults to optim_grads_params from 0.18.2 (0.17.1: no switch, default no_shard, as 0.16.1).
FSDP_DEFAULTS_SINCE = (0, 18)
# --megatron-fsdp-max-pool-double-buffer (MaxPoolAllocator): in the 0.19.2 wheel, not in 0.18.2's
MAX_POOL_DOUBLE_BUFFER_SINCE = (0, 19)
# A group whose FSDP group is one rank (EP filling the world; from core 0.17 also HSDP experts with expert DP = the
# instances) keeps its model-weight buffer whole: ParamAndGradBuffer builds it with is_data_distributed = sharding
# and model_wbuf_dp_group.size() > 1 (megatron_fsdp/param_and_grad_buffer.py, 0.16.1 l.1974, 0.17.1 l.2240, 0.19.2
# l.2649), so fetch_bucket hands out the buffer itself and nothing is all-gathered (the CPU referee on 0.16.1, EP 4 on
# 4 ranks: within 0.05% after the step; tests/test_fsdp.py). The main-gradient buffer tests the size likewise: its
# bucket is the buffer (unless a different --megatron-fsdp-grad-comm-dtype asks for a copy). 0.16.1's HSDP experts
# are not a one-rank group: they shard over the hybrid DP group (fsdp_layout._expert_shard).


def version_tuple(text: str) -> tuple[int, int]:
    """(major, minor) of a Megatron version string such as "0.16.1", "0.19" or "core_v0.19.2"."""
    digits = str(text).lstrip("v").replace("core_v", "").replace("core_r", "").split(".")
    try:
        return int(digits[0]), int(digits[1]) if len(digits) > 1 else 0
    except ValueError:
        return (0, 0)


def default_sharding_strategy(megatron_version: str) -> str:
    """``--data-parallel-sharding-strategy`` when not given: ``optim_grads_params`` in
    megatron/training/arguments.py of core 0.18.2 and 0.19.2, ``no_shard`` in 0.16.1 and 0.17.1."""
    return "optim_grads_params" if version_tuple(megatron_version) >= FSDP_DEFAULTS_SINCE else "no_shard"


@dataclass(frozen=True)
class FsdpGroup:
    """One parameter group of a rank as Megatron-FSDP forms it.

    ``numel``: elements on this rank before FSDP sharding (after tensor / expert parallel splits);
    ``shard``: ranks the group is sharded over (DP x CP for dense parameters, expert-DP for experts);
    ``unit``: the group belongs to an FSDP unit module (a transformer layer, ``optim_grads_params``);
    ``chunk``: the group's chunk_size_factor, the lcm of its parameters' row widths
    (``shape[1:].numel()``, ``_get_parameter_groups`` step 3); buckets are padded to ``shard * chunk``.
    """

    numel: int
    shard: int = 1
    unit: bool = False
    chunk: int = 1
    name: str = ""
    fp8: bool = False   # FP8 primary weights (--fp8-param-gather): Megatron-FSDP's "float8" dtype group
    # HFSDP (HSDP with --outer-dp-sharding-strategy optim): the replicas the main weights and optimizer
    # state are further sharded over; ``shard`` stays one replica's group (the helper buffers of weights
    # and gradients), the bucket is padded for shard x outer ranks (ParamAndGradBuffer, 0.16.1 and 0.19.2)
    outer: int = 1


@dataclass(frozen=True)
class FsdpSpec:
    """What decides Megatron-FSDP / torch FSDP2 memory, resolved from Megatron's flat arguments."""

    impl: str                        # "megatron_fsdp" | "torch_fsdp2"
    strategy: str                    # one of STRATEGIES (torch FSDP2: "optim_grads_params")
    param_bytes: int                 # compute weights per element of 16/32-bit groups
    grad_bytes: int                  # main gradient buffer per element of those groups
    main_param_bytes: int            # main weights per element; 0 = no main-weight buffer
    state_bytes: tuple[int, ...]     # optimizer states per element (Adam: exp_avg, exp_avg_sq)
    decoupled_grad: bool             # precision-aware optimizer reads the grad buffer directly
    double_buffer: bool              # --fsdp-double-buffer (or --use-nccl-ub)
    comm_unit: int | None            # --suggested-communication-unit-size; None = Megatron derives it
    bucket_size: int | None          # DDP bucket size, the derived comm unit without units
    reshard_after_forward: bool = True   # torch FSDP2; False with --torch-fsdp2-no-reshard-after-forward
    keep_non_units_unsharded: bool = False  # optim_grads_params: groups outside units stay gathered
    overlap_param_gather: bool = False   # on under optim_grads_params: start_param_sync gathers with prefetch only
    fp8_params: bool = False         # --fp8-param-gather: FP8 groups keep 1-byte (uint8) compute weights
    fp8_grad_bytes: int = 2          # main gradient bytes of FP8 groups (bf16 unless fp32 is asked)
    # megatron_fsdp_cuda_graph_mode (core 0.18+, DECOUPLED_GRAD_SINCE's DistributedDataParallelConfig): zero_grad keeps the optimizer's gradient references, so the
    # cast copy of the gradient shard (step_grad_copy) stays through forward and backward
    cuda_graph_mode: bool = False
    # --megatron-fsdp-grad-comm-dtype (MixedPrecisionPolicy, core 0.17+): bytes of the full gradient buckets a sharded gradient buffer
    # fetches for the backward and reduce-scatters (GradReducePipeline, fetch_bucket(dtype=grad_comm_dtype));
    # None = the main gradients' dtype
    comm_grad_bytes: int | None = None
    # the final norm's pre-forward prefetch re-gathers the units before the loss (core < 0.18,
    # UNITS_REGATHERED_BEFORE_LOSS_UNTIL); False: they are gathered after the output layer's backward
    units_gathered_at_loss: bool = True
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def bucket_grad_bytes(self) -> int:
        """Bytes per element of a full gradient bucket in the backward windows (16/32-bit groups)."""
        return self.comm_grad_bytes if (self.comm_grad_bytes and self.shards_grads) else self.grad_bytes

    @property
    def shards_weights(self) -> bool:
        return self.strategy == "optim_grads_params"

    @property
    def shards_grads(self) -> bool:
        return self.strategy in ("optim_grads", "optim_grads_params")

    @property
    def shards_optimizer(self) -> bool:
        return self.strategy != "no_shard"

    @classmethod
    def from_flat(cls, *, megatron_version: str = "0.19", use_megatron_fsdp: bool = False,
                  use_custom_fsdp: bool = False, use_torch_fsdp2: bool = False,
                  data_parallel_sharding_strategy: str | None = None, params_dtype: str = "bf16",
                  accumulate_allreduce_grads_in_fp32: bool = True,
                  megatron_fsdp_main_params_dtype: str = "fp32", megatron_fsdp_main_grads_dtype: str = "auto",
                  use_precision_aware_optimizer: bool = False, optimizer: str = "adam",
                  exp_avg_dtype: str = "fp32", exp_avg_sq_dtype: str = "fp32", fp8_param_gather: bool = False,
                  fsdp_double_buffer: bool = False, nccl_ub: bool = False,
                  megatron_fsdp_max_pool_double_buffer: bool = False,
                  suggested_communication_unit_size: int | None = None, ddp_bucket_size: int | None = None,
                  overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
                  data_parallel_size: int = 1, context_parallel_size: int = 1,
                  torch_fsdp2_reshard_after_forward: bool = True,
                  megatron_fsdp_cuda_graph_mode: bool = False,
                  megatron_fsdp_grad_comm_dtype: str = "auto") -> "FsdpSpec":
        """The spec Megatron would run with. Names are Megatron's ``args`` names; values as
        ``validate_args`` leaves them (strings for dtypes)."""
        v = version_tuple(megatron_version)
        new = v >= MIXED_PRECISION_POLICY_SINCE
        pbytes = DTYPE_BYTES[params_dtype]
        if optimizer == "adam":
            states = (DTYPE_BYTES[exp_avg_dtype], DTYPE_BYTES[exp_avg_sq_dtype])
        else:  # SGD: one fp32 momentum buffer
            states = (4,)
        if use_torch_fsdp2:
            # No MixedPrecisionPolicy is passed: parameters and reduced gradients stay in the module
            # dtype (bf16 after Float16Module); Float16OptimizerWithFloat16Params keeps fp32 clones.
            return cls(impl="torch_fsdp2", strategy="optim_grads_params", param_bytes=pbytes, grad_bytes=pbytes,
                       main_param_bytes=0 if params_dtype == "fp32" else 4, state_bytes=states,
                       decoupled_grad=False, double_buffer=False, comm_unit=None, bucket_size=None,
                       reshard_after_forward=torch_fsdp2_reshard_after_forward)
        strategy = data_parallel_sharding_strategy or default_sharding_strategy(megatron_version)
        if strategy not in STRATEGIES:
            raise ValueError(f"data_parallel_sharding_strategy must be one of {', '.join(STRATEGIES)}")
        # FP8 primary weights live in uint8 buffers (fp8_param_gather); their grads are bf16
        # (_resolve_group_grad_dtype / 0.16.1 "grad_dtype = torch.bfloat16" for FP8 groups).
        notes = []
        if new:
            # MixedPrecisionPolicy (core 0.17.1+ mixed_precision.py): main grads "auto" = the parameter dtype (bf16
            # for FP8 parameters); 0.17.1 and 0.18.2 force fp32 under --accumulate-allreduce-grads-in-fp32
            # (mcore_fsdp_adapter.py, "Grandfathered Argument: grad_reduce_in_fp32"), 0.19.2 does not.
            gdt = megatron_fsdp_main_grads_dtype
            if accumulate_allreduce_grads_in_fp32 and v < GRAD_REDUCE_FP32_MAIN_GRADS_UNTIL:
                gdt = "fp32"
            gbytes = pbytes if gdt in (None, "auto") else DTYPE_BYTES[gdt]
            fp8_g = 2 if gdt in (None, "auto") else DTYPE_BYTES[gdt]
            mdt = megatron_fsdp_main_params_dtype
            mbytes = 0 if mdt in (None, "auto") else DTYPE_BYTES[mdt]
            # update_main_grads casts to the main weights' dtype unless the optimizer is precision-aware
            # (ddp_config.megatron_fsdp_use_decoupled_grad = --use-precision-aware-optimizer, 0.18.2 and later).
            decoupled = use_precision_aware_optimizer and v >= DECOUPLED_GRAD_SINCE
        else:
            # core 0.16.1: fp32 main weights (preserve_fp32_weights, default True) and fp32 grads when
            # grad_reduce_in_fp32, else the parameter dtype (bf16 for FP8 parameters).
            gbytes = 4 if accumulate_allreduce_grads_in_fp32 else pbytes
            fp8_g = 4 if accumulate_allreduce_grads_in_fp32 else 2
            mbytes = 4
            # update_main_grads tests getattr(self, "use_precision_aware_optimizer", False), an
            # attribute nothing sets in 0.16.1: the cast is always made when the dtypes differ.
            decoupled = False
            notes.append("Megatron-FSDP dtypes of core 0.16.1 (grads follow --accumulate-allreduce-grads-in-fp32)")
        # the gradient communication dtype: fp32 under grad_reduce_in_fp32 in 0.17.1 / 0.18.2 (the same adapter line)
        cdt = "fp32" if new and accumulate_allreduce_grads_in_fp32 and v < GRAD_REDUCE_FP32_MAIN_GRADS_UNTIL \
            else megatron_fsdp_grad_comm_dtype
        double = fsdp_double_buffer or nccl_ub or (v >= MAX_POOL_DOUBLE_BUFFER_SINCE and megatron_fsdp_max_pool_double_buffer)
        # training.py get_model: resolve_ddp_bucket_size, as for DDP (1M x DP x CP, at least 40M,
        # with --overlap-grad-reduce; None otherwise).
        bucket = ddp_bucket_size
        if bucket is None and overlap_grad_reduce:
            bucket = max(40_000_000, 1_000_000 * data_parallel_size * context_parallel_size)
        # Groups outside FSDP units (embedding, output layer, final norm) are all-gathered by their
        # modules' pre-forward hooks and never released by a post-forward hook; start_param_sync
        # after every optimizer step gathers them again (0.16.1 releases them in reset() just before,
        # 0.19 marks them PRESERVED): a whole copy lives through training in both versions.
        return cls(impl="megatron_fsdp", strategy=strategy, param_bytes=pbytes, grad_bytes=gbytes,
                   main_param_bytes=mbytes, state_bytes=states, decoupled_grad=decoupled, double_buffer=double,
                   comm_unit=suggested_communication_unit_size, bucket_size=bucket,
                   keep_non_units_unsharded=strategy == "optim_grads_params",
                   # MegatronFSDP.__init__ (0.16.1 and 0.19.2) sets ddp_config.overlap_param_gather = True
                   # under optim_grads_params, whatever --overlap-param-gather says
                   overlap_param_gather=overlap_param_gather or strategy == "optim_grads_params",
                   fp8_params=fp8_param_gather, fp8_grad_bytes=fp8_g,
                   # (DistributedDataParallelConfig.megatron_fsdp_cuda_graph_mode: in the 0.18.2 and 0.19.2 wheels only)
                   cuda_graph_mode=v >= DECOUPLED_GRAD_SINCE and megatron_fsdp_cuda_graph_mode,
                   comm_grad_bytes=(DTYPE_BYTES[cdt] if new and cdt not in (None, "auto") else None),
                   units_gathered_at_loss=v < UNITS_REGATHERED_BEFORE_LOSS_UNTIL,
                   notes=tuple(notes))


def padded_numel(spec: FsdpSpec, g: FsdpGroup) -> int:
    """Elements of the group's full bucket: ``build_data_parallel_buffer_index`` pads it to a
    multiple of ``shard * chunk`` for every strategy but ``no_shard``; torch FSDP2 pads each
    parameter's first dimension to a multiple of the shard count (counted here on the group)."""
    if spec.impl == "torch_fsdp2":
        return -(-g.numel // g.shard) * g.shard
    if spec.strategy == "no_shard":
        return g.numel
    div = g.shard * max(1, g.outer) * max(1, g.chunk)
    return -(-g.numel // div) * div


def weight_bytes(spec: FsdpSpec, g: FsdpGroup) -> int:
    """Compute-weight bytes per element of a group (uint8 for FP8 primary weights)."""
    return 1 if (g.fp8 and spec.fp8_params) else spec.param_bytes


def grad_bytes(spec: FsdpSpec, g: FsdpGroup) -> int:
    return spec.fp8_grad_bytes if (g.fp8 and spec.fp8_params) else spec.grad_bytes


def bucket_grad_bytes(spec: FsdpSpec, g: FsdpGroup) -> int:
    """Bytes per element of the group's full gradient bucket: the communication dtype when one is set and the
    gradients are sharded (every group's bucket, FP8 groups' too), else the main gradients'."""
    return spec.comm_grad_bytes if (spec.comm_grad_bytes and spec.shards_grads) else grad_bytes(spec, g)


def gathers_weights(spec: FsdpSpec, g: FsdpGroup) -> bool:
    """The group's compute weights are all-gathered into a bucket of their own (optim_grads_params), i.e. not
    when its FSDP group is one rank (its buffer is not distributed, every release; HFSDP's helper buffers aside)."""
    return not (spec.impl == "megatron_fsdp" and g.shard == 1 and g.outer <= 1)


def fetches_grad_bucket(spec: FsdpSpec, g: FsdpGroup) -> bool:
    """The backward fetches a full gradient bucket besides the group's buffer: not when the group's FSDP group is
    one rank (its buffer is not distributed, every release) unless the communication dtype differs."""
    if spec.impl != "megatron_fsdp" or g.shard != 1 or g.outer > 1:
        return True
    return bool(spec.comm_grad_bytes) and spec.comm_grad_bytes != grad_bytes(spec, g)


def shard_numel(spec: FsdpSpec, g: FsdpGroup) -> int:
    """Elements of the rank's shard of the group (``bucket size // shard``)."""
    return padded_numel(spec, g) // g.shard


@dataclass(frozen=True)
class FsdpStates:
    """Persistent bytes of model state on one rank (and the step's extra), by named term."""

    weights: int = 0             # fsdp_weights: compute weights kept between uses (shards or whole)
    non_unit_weights: int = 0    # fsdp_non_unit_weights: whole weights of groups outside units kept unsharded
    grads: int = 0               # fsdp_grads: main-gradient buffer (shards or whole)
    main_params: int = 0         # fsdp_main_params: main (fp32) weights
    states: tuple[int, ...] = ()  # optimizer states (Adam: exp_avg, exp_avg_sq; SGD: momentum)
    step_grad_copy: int = 0      # fsdp_grad_copies: gradients cast to the main dtype at the step
    optimizer_numel: int = 0     # elements the optimizer updates on this rank

    def __add__(self, o: "FsdpStates") -> "FsdpStates":
        n = max(len(self.states), len(o.states))
        a = self.states + (0,) * (n - len(self.states))
        b = o.states + (0,) * (n - len(o.states))
        return FsdpStates(self.weights + o.weights, self.non_unit_weights + o.non_unit_weights,
                          self.grads + o.grads, self.main_params + o.main_params,
                          tuple(x + y for x, y in zip(a, b)), self.step_grad_copy + o.step_grad_copy,
                          self.optimizer_numel + o.optimizer_numel)

    @property
    def persistent(self) -> int:
        return self.weights + self.non_unit_weights + self.grads + self.main_params + sum(self.states)


def group_states(spec: FsdpSpec, g: FsdpGroup) -> FsdpStates:
    """Persistent bytes of one parameter group on one rank."""
    full, part = padded_numel(spec, g), shard_numel(spec, g)
    if spec.impl == "torch_fsdp2":
        # fully_shard keeps only the DTensor shard of each parameter and of its reduced gradient
        # (param dtype); the optimizer holds an fp32 clone of the shard and, at the step,
        # main_param.grad = param.grad.float() (megatron/core/optimizer/optimizer.py).
        copy = 4 * part if spec.main_param_bytes and spec.grad_bytes != 4 else 0
        return FsdpStates(weights=spec.param_bytes * part, grads=spec.grad_bytes * part,
                          main_params=spec.main_param_bytes * part,
                          states=tuple(b * part for b in spec.state_bytes), step_grad_copy=copy,
                          optimizer_numel=part)
    s = spec.strategy
    wb, gb = weight_bytes(spec, g), grad_bytes(spec, g)
    opt = part // max(1, g.outer) if spec.shards_optimizer else g.numel
    if s == "no_shard":
        weights = wb * g.numel        # the module's own parameters, no FSDP buffer
    elif spec.shards_weights:
        weights = wb * part
    else:
        weights = wb * full
    non_unit = 0
    if spec.shards_weights and not g.unit and spec.keep_non_units_unsharded and gathers_weights(spec, g):
        # The all-gathered bucket of a group outside FSDP units stays (see FsdpSpec.from_flat).
        non_unit = wb * full
    grads = gb * (part if spec.shards_grads else full if s != "no_shard" else g.numel)
    main = spec.main_param_bytes * opt
    # The optimizer works on the main weights, or on the compute weights without a main buffer.
    copy = 0
    if spec.main_param_bytes and not spec.decoupled_grad and gb != spec.main_param_bytes:
        # update_main_grads: optimizer_grad.to(param.dtype), referenced by dist_main_grad until
        # zero_grad at the start of the next iteration.
        copy = spec.main_param_bytes * opt
    return FsdpStates(weights=weights, non_unit_weights=non_unit, grads=grads, main_params=main,
                      states=tuple(b * opt for b in spec.state_bytes), step_grad_copy=copy, optimizer_numel=opt)


def stage_states(spec: FsdpSpec, groups: list[FsdpGroup] | tuple[FsdpGroup, ...]) -> FsdpStates:
    total = FsdpStates(states=tuple(0 for _ in spec.state_bytes))
    for g in groups:
        total = total + group_states(spec, g)
    return total


# ----- transient windows: what is unsharded while the layers run -----

def comm_unit_size(spec: FsdpSpec, unit_numels: list[int] | tuple[int, ...]) -> int:
    """``suggested_communication_unit_size`` as MegatronFSDP.__init__ settles it: the flag when
    given; else twice the average unit size (optim_grads_params), the DDP bucket size, or 1e9,
    raised to at least 1e9 elements."""
    if spec.comm_unit is not None:
        return spec.comm_unit
    if spec.strategy == "optim_grads_params" and unit_numels:
        derived = sum(unit_numels) // len(unit_numels) * 2
    elif spec.bucket_size is not None:
        derived = spec.bucket_size
    else:
        derived = COMM_UNIT_FLOOR
    return max(COMM_UNIT_FLOOR, derived)


def prefetch_units(limit: int, unit_numel: int, remaining: int) -> int:
    """Units all-gathered ahead of the one needed now: ``AllGatherPipeline.all_gather_params`` keeps
    appending the next bucket group while the prefetched size is below ``limit`` elements."""
    if remaining <= 0 or limit <= 0 or unit_numel <= 0:
        return 0
    return min(remaining, -(-limit // unit_numel))


def rs_queue_units(capacity: int, unit_numel: int) -> int:
    """Full gradient buckets alive at once: ``wait_for_previous_grad_reduce`` frees queued buckets
    only while the queue holds more than ``capacity`` elements, then the new one is added."""
    if unit_numel <= 0:
        return 1
    return capacity // unit_numel + 1


@dataclass(frozen=True)
class FsdpWindow:
    """Unsharded buckets alive at one moment of a stage's forward or backward."""

    weights: int = 0     # fsdp_unsharded_weights: all-gathered unit weights (current + prefetched)
    grads: int = 0       # fsdp_unsharded_grads: full gradient buckets before/while reduce-scattered
    units_weights: int = 0
    units_grads: int = 0
    step: int = 0        # layers of the backward already done at that moment
    detail: str = ""

    @property
    def total(self) -> int:
        return self.weights + self.grads


def _worst(candidates: list[tuple[int, FsdpWindow]]) -> FsdpWindow:
    """The window with the largest extra (first one on ties: the earliest moment)."""
    best_extra, best = candidates[0]
    for extra, w in candidates[1:]:
        if extra > best_extra:
            best_extra, best = extra, w
    return best


Unit = tuple[int, int, int]   # (elements, weight bytes, gradient bytes) of one unit's full buckets


def _ahead(units: tuple[Unit, ...], idx: list[int], limit: int) -> int:
    """How many of the units listed by ``idx`` (next first) the prefetch appends: it keeps adding
    while the prefetched elements are below ``limit`` (AllGatherPipeline.all_gather_params)."""
    n = total = 0
    for j in idx:
        if total >= limit:
            break
        total += units[j][0]
        n += 1
    return n


def backward_window_units(spec: FsdpSpec, units: tuple[Unit, ...], released_per_unit: int = 0,
                          non_unit_grad_numel: int = 0, from_step: int = 0) -> FsdpWindow:
    """``backward_window`` over units of different sizes (given in forward order): the backward
    walks them from the last; the weights of the current unit and of those the prefetch reaches
    behind it, the gradient buckets the reduce-scatter queue keeps (it frees the oldest while it
    holds more than the capacity), and the buckets outside units all along. ``from_step``: the worst
    moment from that many units done on (an empty window when there are not that many units)."""
    if spec.impl != "megatron_fsdp" or not units or not (spec.shards_weights or spec.shards_grads):
        return FsdpWindow()
    cu = comm_unit_size(spec, tuple(u[0] for u in units))
    limit, capacity = cu // 2, cu
    n = len(units)
    queue: list[int] = []
    outside = non_unit_grad_numel * spec.bucket_grad_bytes if spec.shards_grads else 0
    # With --fsdp-double-buffer the units' buckets come out of the persistent pools
    # (fsdp_double_buffers): they add nothing at the moment; the groups outside units still do.
    pool = 0 if spec.double_buffer else 1
    cands: list[tuple[int, FsdpWindow]] = []
    for i in range(n):
        j = n - 1 - i
        w = nw = 0
        if spec.shards_weights:
            behind = list(range(j - 1, -1, -1))
            k = min(1, len(behind)) if spec.double_buffer else _ahead(units, behind, limit)
            held = [j] + behind[:k]
            w, nw = pool * sum(units[x][1] for x in held), len(held)
        g = ng = 0
        if spec.shards_grads:
            if spec.double_buffer:
                queue = queue[-(DOUBLE_BUFFER_UNITS - 1):] if DOUBLE_BUFFER_UNITS > 1 else []
            else:
                while queue and sum(units[x][0] for x in queue) > capacity:
                    queue.pop(0)
            queue.append(j)
            g, ng = pool * sum(units[x][2] for x in queue) + outside, len(queue)
        if i >= from_step:
            cands.append((w + g - i * released_per_unit,
                          FsdpWindow(weights=w, grads=g, units_weights=nw, units_grads=ng, step=i)))
    return _worst(cands) if cands else FsdpWindow()


def forward_window_units(spec: FsdpSpec, units: tuple[Unit, ...], added_per_unit: int = 0) -> FsdpWindow:
    """``forward_window`` over units of different sizes (forward order)."""
    if spec.impl != "megatron_fsdp" or not units or not spec.shards_weights:
        return FsdpWindow()
    limit = comm_unit_size(spec, tuple(u[0] for u in units)) // 2
    n = len(units)
    cands: list[tuple[int, FsdpWindow]] = []
    for i in range(n):
        rest = list(range(i + 1, n))
        k = min(1, len(rest)) if spec.double_buffer else _ahead(units, rest, limit)
        held = [i] + rest[:k]
        w, todo = (0 if spec.double_buffer else sum(units[x][1] for x in held)), n - 1 - i
        cands.append((w - todo * added_per_unit, FsdpWindow(weights=w, units_weights=len(held), step=todo)))
    return _worst(cands)


def backward_window(spec: FsdpSpec, units: int, unit_numel: int, released_per_unit: int = 0,
                    non_unit_grad_numel: int = 0, all_unit_numels: tuple[int, ...] = (),
                    unit_weight_bytes: int | None = None, unit_grad_bytes: int | None = None) -> FsdpWindow:
    """The worst moment of one backward through ``units`` FSDP units of ``unit_numel`` elements
    each (the unit's full bucket on this rank), relative to the moment the backward starts.

    At step i (i units done) the backward holds: the weights of the current unit and of those
    prefetched behind it (``PrefetchOrder.BACKWARD_PASS_ORDER``), the full gradient buckets of the
    units done that the reduce-scatter queue still keeps plus the current one, and
    ``released_per_unit`` fewer activation bytes per unit done. Returns the moment that maximises
    weights + grads - i * released_per_unit (the activations themselves are the caller's).
    ``non_unit_grad_numel``: gradients outside units produced before the layers' backward (the
    output layer's), queued first under optim_grads / optim_grads_params. ``unit_weight_bytes`` /
    ``unit_grad_bytes``: one unit's full buckets in bytes when its groups mix dtypes (FP8 weights)."""
    g_b = spec.bucket_grad_bytes
    uw = unit_numel * spec.param_bytes if unit_weight_bytes is None else unit_weight_bytes
    ug = unit_numel * g_b if unit_grad_bytes is None else unit_grad_bytes
    if units <= 0:
        # No units (optim_grads): a group's full gradient bucket is allocated with its first
        # gradient (DataParallelBuffer.fetch_bucket) and lives to the end of the backward.
        if spec.impl == "megatron_fsdp" and spec.shards_grads and non_unit_grad_numel:
            return FsdpWindow(grads=non_unit_grad_numel * g_b)
        return FsdpWindow()
    cands: list[tuple[int, FsdpWindow]] = []
    if spec.impl == "torch_fsdp2":
        # Current unit plus one prefetched (torch's default backward prefetch), and the current
        # unit's unsharded gradients before its reduce-scatter. With reshard_after_forward=False
        # every unit's weights stay unsharded from its forward to its backward.
        for i in range(units):
            nw = (units - i) if not spec.reshard_after_forward else min(2, units - i)
            w, g = nw * uw, ug
            cands.append((w + g - i * released_per_unit,
                          FsdpWindow(weights=w, grads=g, units_weights=nw, units_grads=1, step=i)))
        return _worst(cands)
    if not spec.shards_weights and not spec.shards_grads:
        return FsdpWindow()
    cu = comm_unit_size(spec, all_unit_numels or (unit_numel,))
    limit, capacity = cu // 2, cu
    for i in range(units):
        remaining = units - i
        nw = 0
        if spec.shards_weights:
            ahead = 1 if spec.double_buffer else prefetch_units(limit, unit_numel, remaining - 1)
            nw = 1 + min(ahead, remaining - 1)
        ng = queued = 0
        if spec.shards_grads:
            ng = min(i + 1, DOUBLE_BUFFER_UNITS if spec.double_buffer else rs_queue_units(capacity, unit_numel))
            # The output layer's full gradient bucket is queued first; it leaves once the queue
            # overflows (never, with the default capacity, on a stage whose units fit under it).
            if not spec.double_buffer and (i + 1) * unit_numel + non_unit_grad_numel <= capacity:
                queued = non_unit_grad_numel
        pool = 0 if spec.double_buffer else 1     # units' buckets live in the persistent pools
        w = pool * nw * uw
        g = pool * ng * ug + queued * g_b
        cands.append((w + g - i * released_per_unit,
                      FsdpWindow(weights=w, grads=g, units_weights=nw, units_grads=ng, step=i)))
    return _worst(cands)


def forward_window(spec: FsdpSpec, units: int, unit_numel: int, added_per_unit: int = 0,
                   all_unit_numels: tuple[int, ...] = (), unit_weight_bytes: int | None = None) -> FsdpWindow:
    """The worst moment of one forward relative to its end: at unit i the weights of unit i and of
    the units prefetched ahead are unsharded, while ``added_per_unit`` activation bytes for each
    unit still to run are not there yet (``step`` = units still to run); each unit is released by
    its ``_post_forward``."""
    if units <= 0:
        return FsdpWindow()
    uw = unit_numel * spec.param_bytes if unit_weight_bytes is None else unit_weight_bytes
    cands: list[tuple[int, FsdpWindow]] = []
    if spec.impl == "torch_fsdp2":
        for i in range(units):
            nw = (i + 1) if not spec.reshard_after_forward else min(2, units - i)
            w, todo = nw * uw, units - 1 - i
            cands.append((w - todo * added_per_unit, FsdpWindow(weights=w, units_weights=nw, step=todo)))
        return _worst(cands)
    if not spec.shards_weights:
        return FsdpWindow()
    limit = comm_unit_size(spec, all_unit_numels or (unit_numel,)) // 2
    for i in range(units):
        remaining = units - i
        ahead = 1 if spec.double_buffer else prefetch_units(limit, unit_numel, remaining - 1)
        nw = 1 + min(ahead, remaining - 1)
        w, todo = (0 if spec.double_buffer else nw * uw), units - 1 - i
        cands.append((w - todo * added_per_unit, FsdpWindow(weights=w, units_weights=nw, step=todo)))
    return _worst(cands)


def after_step_unsharded(spec: FsdpSpec, unit_numels: list[int] | tuple[int, ...],
                         unit_weight_bytes: list[int] | tuple[int, ...] = (), first_outside_units: bool = False) -> int:
    """Unit weights all-gathered by ``start_param_sync`` right after the optimizer step (and alive
    until each unit's first forward): the first one and those its prefetch reaches (Megatron-FSDP
    turns overlap_param_gather on under optim_grads_params, so start_param_sync gathers the first
    bucket with prefetch, never every bucket). ``unit_weight_bytes``: each unit's full buckets in
    bytes (default: elements x the spec's weight bytes). ``first_outside_units``: the chunk's first
    parameter (the embedding) is outside units, so its bucket is the base and the prefetch limit
    counts from the first unit (AllGatherPipeline.all_gather_params)."""
    if spec.impl != "megatron_fsdp" or not spec.shards_weights or not unit_numels:
        return 0
    wb = list(unit_weight_bytes) or [n * spec.param_bytes for n in unit_numels]
    if spec.double_buffer:
        return 0       # gathered into the persistent pools (fsdp_double_buffers)
    limit = comm_unit_size(spec, unit_numels) // 2
    start = 0 if first_outside_units else 1
    total, ahead = sum(wb[:start]), 0
    for n, b in zip(unit_numels[start:], wb[start:]):
        if ahead >= limit:
            break
        total += b
        ahead += n
    return total


def double_buffer_bytes(spec: FsdpSpec, max_unit_numel: int, unit_bytes: int | None = None) -> int:
    """``--fsdp-double-buffer``: FixedPoolAllocator allocates two buffers of the largest unit's
    bucket for weights and two for gradients up front and keeps them (persistent). ``unit_bytes``:
    the largest unit's weight + gradient buckets in bytes when its groups mix dtypes."""
    if spec.impl != "megatron_fsdp" or not spec.double_buffer or not spec.shards_weights:
        return 0
    # (main_grad_alloc sizes its pools in grad_comm_dtype when one is set: megatron_fsdp param_and_grad_buffer.py)
    per = max_unit_numel * (spec.param_bytes + spec.bucket_grad_bytes) if unit_bytes is None else unit_bytes
    return DOUBLE_BUFFER_UNITS * per


def chunk_size_factor(shapes: list[tuple[int, ...]] | tuple[tuple[int, ...], ...]) -> int:
    """The chunk_size_factor ``_get_parameter_groups`` step 3 gives a group of parameters of these
    shapes (per rank): walking them from the widest row (``shape[1:].numel()``) down, a parameter
    keeps the factor when its row width equals it, when its row width divides it and its size is a
    multiple of it, or when it is smaller than the factor; otherwise the factor becomes the lcm with
    its row width. 1-D parameters (row width 1) never change it."""
    items = []
    for shape in shapes:
        numel = math.prod(shape)
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        items.append((row, numel))
    if not items:
        return 1
    items.sort(key=lambda t: t[0], reverse=True)
    factor = items[0][0]
    for row, numel in items:
        if row == factor or (factor % row == 0 and numel % factor == 0) or numel < factor:
            continue
        factor = math.lcm(factor, row)
    return factor


def _split(shapes: list[tuple[int, ...]], bucket_size: int | None) -> list[list[tuple[int, ...]]]:
    """``_get_parameter_groups`` step 2: a group outside units is closed once it reaches the
    suggested bucket size (the DDP bucket size; no split without one)."""
    out: list[list[tuple[int, ...]]] = []
    cur: list[tuple[int, ...]] = []
    size = 0
    for sh in shapes:
        cur.append(sh)
        size += math.prod(sh)
        if bucket_size and size >= bucket_size:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def _group(shapes: list[tuple[int, ...]], shard: int, unit: bool, name: str, fp8: bool = False,
           outer: int = 1) -> FsdpGroup:
    return FsdpGroup(numel=sum(math.prod(s) for s in shapes), shard=shard, unit=unit,
                     chunk=chunk_size_factor(shapes), name=name, fp8=fp8, outer=outer)


def _unit_groups(spec: FsdpSpec, shapes: list[tuple[int, ...]], shard: int, name: str,
                 outer: int = 1) -> list[FsdpGroup]:
    """A unit's groups: with FP8 primary weights the 2-D weights (TE's FP8 linear weights) form a
    "float8" group apart from the 16-bit norms and biases (step 1 groups by dtype)."""
    if not spec.fp8_params:
        return [_group(shapes, shard, True, name, outer=outer)]
    fp8 = [s for s in shapes if len(s) > 1]
    rest = [s for s in shapes if len(s) <= 1]
    out = [_group(fp8, shard, True, name + ".fp8", fp8=True, outer=outer)] if fp8 else []
    if rest:
        out.append(_group(rest, shard, True, name, outer=outer))
    return out


Shapes = list[tuple[int, ...]]


def stage_groups(spec: FsdpSpec, *, layers: int = 0, layer_shapes: Shapes = (), before: Shapes = (),
                 after: Shapes = (), dense_shard: int = 1, expert_shapes: Shapes = (), expert_shard: int = 1,
                 per_layer: list[tuple[Shapes, Shapes]] | None = None, outer: int = 1,
                 expert_outer: int = 1) -> tuple[FsdpGroup, ...]:
    """The parameter groups of one model chunk on one rank, in Megatron-FSDP's order.

    ``layer_shapes``: per-rank shapes of one transformer layer's dense parameters, ``expert_shapes``
    of its local experts' (``.experts.`` in the name makes a separate group), repeated ``layers``
    times; or ``per_layer``: (dense, expert) shapes of each layer when the layers differ (MoE
    frequency, MTP). ``before`` / ``after``: parameters outside the layers (embedding; final norm
    and output layer). Under optim_grads_params every layer is an FSDP unit (one dense and one expert
    group each) and the rest forms groups outside units; under the other strategies there are no
    units and all dense (resp. expert) parameters form one group, split at the DDP bucket size. ``outer`` /
    ``expert_outer``: the HFSDP replicas the dense / expert groups' main weights and optimizer state are
    further sharded over (1: none)."""
    if per_layer is None:
        per_layer = [(list(layer_shapes), list(expert_shapes))] * layers
    bucket = spec.bucket_size
    groups: list[FsdpGroup] = []
    if spec.impl == "torch_fsdp2":
        # fully_shard on every TransformerLayer, the embedding and the output layer (each its own
        # unit, resharded after use) and the root (final norm): no groups kept whole.
        if before:
            groups.append(_group(list(before), dense_shard, False, "embedding"))
        for i, (dense, experts) in enumerate(per_layer):
            groups.append(_group(list(dense) + list(experts), dense_shard, True, f"layer{i}"))
        if after:
            groups.append(_group(list(after), dense_shard, False, "output"))
        return tuple(groups)
    if spec.impl == "megatron_fsdp" and spec.strategy == "optim_grads_params":
        for i, (dense, experts) in enumerate(per_layer):
            groups += _unit_groups(spec, list(dense), dense_shard, f"layer{i}", outer)
            if experts:
                groups += _unit_groups(spec, list(experts), expert_shard, f"layer{i}.experts", expert_outer)
        # Step 1 groups by (dtype, expert, requires_grad, unit id) whatever the position: the
        # embedding, final norm and output layer form one group outside units, then cut at the bucket size.
        for part in _split(list(before) + list(after), bucket):
            groups.append(_group(part, dense_shard, False, "outside units", outer=outer))
        return tuple(groups)
    dense_all = list(before) + [sh for d, _ in per_layer for sh in d] + list(after)
    for part in _split(dense_all, bucket if spec.impl == "megatron_fsdp" else None):
        groups.append(_group(part, dense_shard, False, "dense"))
    experts_all = [sh for _, e in per_layer for sh in e]
    if experts_all:
        for part in _split(experts_all, bucket if spec.impl == "megatron_fsdp" else None):
            groups.append(_group(part, expert_shard, False, "experts"))
    return tuple(groups)


@dataclass(frozen=True)
class StageFsdp:
    """Everything the breakdown needs for one pipeline rank under FSDP."""

    states: FsdpStates
    unit_numel: int              # full bucket of one unit on this rank (dense + experts), padded
    units: int
    non_unit_grad_numel: int     # full gradient buckets outside units (allocated during the backward)
    forward: FsdpWindow
    backward: FsdpWindow
    after_step: int              # unit weights gathered right after the optimizer step
    double_buffer: int           # persistent double buffers (--fsdp-double-buffer)
    backward_later: FsdpWindow = FsdpWindow()   # the backward's worst moment after its first unit


def stage_fsdp(spec: FsdpSpec, groups: tuple[FsdpGroup, ...], act_per_unit: int = 0,
               first_outside_units: bool = False) -> StageFsdp:
    """States, windows and step figure of one rank from its groups. ``act_per_unit``: bytes of
    activations one layer saves per micro-batch (what its backward releases); ``first_outside_units``:
    the chunk starts with the embedding (see ``after_step_unsharded``)."""
    st = stage_states(spec, groups)
    units: dict[str, list[int]] = {}
    for g in groups:
        if g.unit:
            u = units.setdefault(g.name.split(".")[0], [0, 0, 0])
            full = padded_numel(spec, g)
            u[0] += full
            u[1] += full * weight_bytes(spec, g) if gathers_weights(spec, g) else 0
            u[2] += full * bucket_grad_bytes(spec, g) if fetches_grad_bucket(spec, g) else 0
    unit_list = tuple(u[0] for u in units.values())
    n = len(unit_list)
    big = max(units.values(), key=lambda u: u[1]) if units else [0, 0, 0]
    unit = big[0]
    non_unit = sum(padded_numel(spec, g) for g in groups
                   if not g.unit and fetches_grad_bucket(spec, g)) if spec.shards_grads else 0
    if spec.impl == "torch_fsdp2":
        non_unit = 0
    per_unit = tuple((u[0], u[1], u[2]) for u in units.values())
    if spec.impl == "megatron_fsdp" and per_unit:
        bwd = backward_window_units(spec, per_unit, act_per_unit, non_unit)
        later = backward_window_units(spec, per_unit, act_per_unit, non_unit, from_step=1)
        fwd = forward_window_units(spec, per_unit, act_per_unit)
    else:
        later = FsdpWindow()
        bwd = backward_window(spec, n, unit, act_per_unit, non_unit, unit_list, big[1], big[2])
        fwd = forward_window(spec, n, unit, act_per_unit, unit_list, big[1])
    return StageFsdp(states=st, unit_numel=unit, units=n, non_unit_grad_numel=non_unit, forward=fwd, backward=bwd,
                     after_step=after_step_unsharded(spec, unit_list, tuple(u[1] for u in units.values()),
                                                     first_outside_units),
                     double_buffer=double_buffer_bytes(spec, unit, big[1] + big[2]), backward_later=later)
