"""The knobs memguard turns: one registry of the settings the planner, autotune and the exporters change.

Each knob is spelled once here: its Megatron flag and argument dest, the Layout field it becomes,
its NeMo 2 and Megatron-Bridge override keys, the planner's short name, and the values searched when
they are a fixed list. Key names follow shared/reference/nemo-bridge.md: NeMo 2 recipes take
parallelism under ``trainer.strategy`` (DDP settings under ``trainer.strategy.ddp``), batch and
sequence under ``data``, recomputation under ``model.config`` and the distributed optimizer under
``optim.config``; Bridge's ConfigContainer takes the TransformerConfig fields under ``model``, batch
sizes under ``train``, DDP settings under ``ddp`` and ``optimizer`` (it ORs the two
``use_distributed_optimizer`` keys, so both are written).

A new knob (say expert parallelism, ``--expert-model-parallel-size``) is one row; the exporters and
the round-trip test (tests/test_knobs.py) pick it up.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

# The planner's recomputation levels, weakest first ("none" is no --recompute-granularity).
RECOMPUTE_LEVELS = ("none", "selective", "full")
# Megatron-FSDP's --data-parallel-sharding-strategy values, most sharded first.
FSDP_STRATEGIES = ("optim_grads_params", "optim_grads", "optim", "no_shard")


@dataclass(frozen=True)
class Knob:
    dest: str                    # Megatron's argument dest (what the flag parser produces)
    flag: str                    # Megatron's flag
    kind: str                    # "int" | "bool" | "choice" | "list" (names, nargs="*") | "text" (quoted for a
                                 # shell: '|', '(' and '*')
    field: str                   # the Layout field it resolves to
    nemo2: tuple[str, ...]       # NeMo 2 override keys (all written)
    bridge: tuple[str, ...]      # Megatron-Bridge override keys (all written)
    short: str | None = None     # the planner's name (memguard plan --tp, --explain tp=...)
    candidates: tuple[Any, ...] | None = None   # values searched, when a fixed list (else derived from the model)

    def megatron(self, value: Any) -> str | None:
        """The flag text for ``value``: ``--flag V``; a store-true flag alone, or nothing when False/None."""
        if value is None or value is False:
            return None
        if self.kind == "list":
            return f"{self.flag} {' '.join(map(str, value))}"
        if self.kind == "text":
            return f"{self.flag} {shlex.quote(str(value))}"
        return self.flag if self.kind == "bool" else f"{self.flag} {value}"

    def overrides(self, keys: tuple[str, ...], value: Any) -> list[str]:
        """``KEY=VALUE`` for each of ``keys`` (YAML spelling: true/false, null)."""
        text = ("null" if value is None else ("true" if value else "false") if isinstance(value, bool) else
                f"[{','.join(map(str, value))}]" if isinstance(value, (list, tuple)) else str(value))
        if self.kind == "text" and value is not None:
            text = "'" + text + "'"     # a YAML string: '|' and '*' would otherwise start other YAML syntax
        return [f"{k}={text}" for k in keys]


_TS = "trainer.strategy."
KNOBS: tuple[Knob, ...] = (
    Knob("tensor_model_parallel_size", "--tensor-model-parallel-size", "int", "tensor_model_parallel_size",
         (_TS + "tensor_model_parallel_size",), ("model.tensor_model_parallel_size",), "tp"),
    Knob("pipeline_model_parallel_size", "--pipeline-model-parallel-size", "int", "pipeline_model_parallel_size",
         (_TS + "pipeline_model_parallel_size",), ("model.pipeline_model_parallel_size",), "pp"),
    # NeMo 2 and Bridge take the virtual stages per rank directly; Megatron's flag of the same meaning:
    Knob("num_virtual_stages_per_pipeline_rank", "--num-virtual-stages-per-pipeline-rank", "int",
         "virtual_pipeline_model_parallel_size", (_TS + "virtual_pipeline_model_parallel_size",),
         ("model.virtual_pipeline_model_parallel_size",), "vpp"),
    Knob("context_parallel_size", "--context-parallel-size", "int", "context_parallel_size",
         (_TS + "context_parallel_size",), ("model.context_parallel_size",), "cp"),
    # mixture of experts: the expert grid (ETP x EP x expert-DP x PP)
    Knob("expert_model_parallel_size", "--expert-model-parallel-size", "int", "expert_model_parallel_size",
         (_TS + "expert_model_parallel_size",), ("model.expert_model_parallel_size",), "ep"),
    Knob("expert_tensor_parallel_size", "--expert-tensor-parallel-size", "int", "expert_tensor_parallel_size",
         (_TS + "expert_tensor_parallel_size",), ("model.expert_tensor_parallel_size",), "etp"),
    Knob("sequence_parallel", "--sequence-parallel", "bool", "sequence_parallel",
         (_TS + "sequence_parallel",), ("model.sequence_parallel",), "sp", (True, False)),
    Knob("decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers", "int",
         "decoder_first_pipeline_num_layers", (_TS + "num_layers_in_first_pipeline_stage",),
         ("model.num_layers_in_first_pipeline_stage",), "first"),
    Knob("decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers", "int",
         "decoder_last_pipeline_num_layers", (_TS + "num_layers_in_last_pipeline_stage",),
         ("model.num_layers_in_last_pipeline_stage",), "last"),
    # the other spellings of an uneven split (memguard plan's uneven_vpp_splits writes them)
    Knob("account_for_embedding_in_pipeline_split", "--account-for-embedding-in-pipeline-split", "bool",
         "account_for_embedding_in_pipeline_split", (_TS + "account_for_embedding_in_pipeline_split",),
         ("model.account_for_embedding_in_pipeline_split",)),
    Knob("account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split", "bool",
         "account_for_loss_in_pipeline_split", (_TS + "account_for_loss_in_pipeline_split",),
         ("model.account_for_loss_in_pipeline_split",)),
    Knob("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout", "text",
         "pipeline_model_parallel_layout", (_TS + "pipeline_model_parallel_layout",),
         ("model.pipeline_model_parallel_layout",)),
    Knob("micro_batch_size", "--micro-batch-size", "int", "micro_batch_size",
         ("data.micro_batch_size",), ("train.micro_batch_size",), "mbs"),
    Knob("global_batch_size", "--global-batch-size", "int", "global_batch_size",
         ("data.global_batch_size",), ("train.global_batch_size",)),
    Knob("seq_length", "--seq-length", "int", "seq_length",
         ("data.seq_length",), ("model.seq_length", "dataset.seq_length")),
    Knob("use_distributed_optimizer", "--use-distributed-optimizer", "bool", "use_distributed_optimizer",
         ("optim.config.use_distributed_optimizer",),
         ("ddp.use_distributed_optimizer", "optimizer.use_distributed_optimizer"), "dist_opt", (True, False)),
    Knob("overlap_grad_reduce", "--overlap-grad-reduce", "bool", "overlap_grad_reduce",
         (_TS + "ddp.overlap_grad_reduce",), ("ddp.overlap_grad_reduce",)),
    Knob("overlap_param_gather", "--overlap-param-gather", "bool", "overlap_param_gather",
         (_TS + "ddp.overlap_param_gather",), ("ddp.overlap_param_gather",)),
    # Megatron-FSDP (the planner's --fsdp dimension): its switch and the sharding strategy.
    Knob("use_megatron_fsdp", "--use-megatron-fsdp", "bool", "use_megatron_fsdp",
         (_TS + "ddp.use_megatron_fsdp",), ("ddp.use_megatron_fsdp",)),
    Knob("data_parallel_sharding_strategy", "--data-parallel-sharding-strategy", "choice",
         "data_parallel_sharding_strategy", (_TS + "ddp.data_parallel_sharding_strategy",),
         ("ddp.data_parallel_sharding_strategy",), "fsdp", FSDP_STRATEGIES),
    Knob("recompute_granularity", "--recompute-granularity", "choice", "recompute_granularity",
         ("model.config.recompute_granularity",), ("model.recompute_granularity",), "recompute", RECOMPUTE_LEVELS),
    Knob("recompute_method", "--recompute-method", "choice", "recompute_method",
         ("model.config.recompute_method",), ("model.recompute_method",), None, ("uniform", "block")),
    Knob("recompute_num_layers", "--recompute-num-layers", "int", "recompute_num_layers",
         ("model.config.recompute_num_layers",), ("model.recompute_num_layers",)),
    # the selective set autotune's recompute ladder picks (recompute_ladder.py); a YAML list in overrides
    Knob("recompute_modules", "--recompute-modules", "list", "recompute_modules",
         ("model.config.recompute_modules",), ("model.recompute_modules",)),
    # FP8 (memguard plan --fp8): NeMo 2 takes it on the precision plugin (MegatronMixedPrecision copies its
    # fields over the model config's), Bridge on mixed_precision (a preset name is expanded first).
    Knob("fp8", "--fp8-format", "choice", "fp8", ("trainer.plugins.fp8",), ("mixed_precision.fp8",), None,
         ("e4m3", "hybrid")),
    Knob("fp8_recipe", "--fp8-recipe", "choice", "fp8_recipe", ("trainer.plugins.fp8_recipe",),
         ("mixed_precision.fp8_recipe",), "fp8", ("delayed", "tensorwise", "blockwise", "mxfp8")),
    # Autotune switches the deprecated alias off when it picks a recomputation level itself.
    Knob("recompute_activations", "--recompute-activations", "bool", "recompute_granularity",
         (), ()),
)
BY_DEST: dict[str, Knob] = {k.dest: k for k in KNOBS}
BY_FIELD: dict[str, Knob] = {k.field: k for k in KNOBS if k.nemo2}   # (the alias has no field of its own)


def knob(name: str) -> Knob:
    """The knob of a Megatron dest or Layout field (KeyError if it is not one)."""
    return BY_DEST.get(name) or BY_FIELD[name]


def flag_of(dest: str) -> str:
    """Megatron's flag for ``dest``: the registry's, else Megatron's rule (dashes for underscores)."""
    k = BY_DEST.get(dest)
    return k.flag if k is not None else "--" + dest.replace("_", "-")


def flag_text(dest: str, value: Any) -> str:
    """``--flag value`` for a change autotune makes (a list's names space-separated, as nargs='*' takes them)."""
    if isinstance(value, (list, tuple)):
        return f"{flag_of(dest)} {' '.join(map(str, value))}"
    return f"{flag_of(dest)} {value}"


def override_text(key: str, value: Any) -> str:
    """``KEY=VALUE`` for a config override (a list in YAML's flow style)."""
    if isinstance(value, (list, tuple)):
        return f"{key}=[{','.join(map(str, value))}]"
    return f"{key}={value}"
