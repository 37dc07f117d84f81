"""What a reader produces: the settings as the user wrote them, under Megatron's argument names.

Every reader (Megatron flags, functional-test YAML, launch commands, NeMo, Megatron-Bridge, Hugging
Face) maps its input onto Megatron's argument ``dest`` names (``tensor_model_parallel_size``,
``recompute_granularity``, ...) plus megatron-core config field names where Megatron has no flag
(``store_param_remainders``). ``origin`` remembers how the user spelled each one, so that an error
about ``tensor_model_parallel_size`` can name ``--tensor-model-parallel-size`` or
``model.tensor_model_parallel_size``. Nothing here applies defaults: that is ``resolve``'s job.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

# Environment variables that change what a job allocates; only these are kept from a caller's
# environment (the rest is neither needed nor anyone's business).
MEMORY_ENV_VARS = (
    "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE", "NCCL_BUFFSIZE",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "NVTE_FUSED_ATTN", "NVTE_FLASH_ATTN", "NVTE_UNFUSED_ATTN",
    "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "TORCH_NCCL_AVOID_RECORD_STREAMS", "CUDA_DEVICE_MAX_CONNECTIONS",
    "NVTE_CUTEDSL_FUSED_GROUPED_MLP",   # whether the experts may take TE's fused grouped MLP (resolve/moe.py)
    "FP4_RECIPE",   # TEFusedMLPWithGroupedLinear's NVFP4 autocast (resolve/kernels.py grouped_dense_mlp)
    "NVTE_DPA_FP8_RECIPE",   # the recipe FP8 attention runs in (estimator/te_release.py attention_recipe)
    "MEMGUARD_TE_VERSION",   # the run's Transformer Engine release (estimator/te_release.py)
)


def memory_env(environ: Mapping[str, str] | None) -> dict[str, str]:
    """The memory-relevant subset of an environment."""
    return {k: str(environ[k]) for k in MEMORY_ENV_VARS if environ and k in environ}


@dataclass(frozen=True)
class RawConfig:
    args: Mapping[str, Any]
    origin: Mapping[str, str] = field(default_factory=dict)
    source: str = "megatron flags"
    world_size: int | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    best_effort: bool = False
    # ConfigErrors a reader found that are rules of its format rather than Megatron's (two keys that
    # must agree, a NeMo-only restriction): ``memguard validate`` reports them with the resolver's.
    problems: tuple[Any, ...] = ()
    # a Megatron-LM script's command line (or its argument namespace): its validate_args applies whole, e.g.
    # --max-position-embeddings is required; a model preset or a Bridge / NeMo config merged in lifts that
    megatron_command_line: bool = False
    # settings whose value is shell text memguard does not evaluate (a launch script's ``$(nproc)``): dest -> what it
    # is and where, for the error raised when a rule reads it (resolve/args.py); a flag nothing reads is no error
    unevaluated: Mapping[str, str] = field(default_factory=dict)

    def key(self, dest: str) -> str:
        """How the user wrote ``dest`` (flag or key path); the Megatron flag spelling otherwise."""
        if self.origin.get(dest):
            return self.origin[dest]
        from .knobs import flag_of       # Megatron's own flag where it is not the dest's spelling (fp8: --fp8-format)
        return flag_of(dest)

    def with_args(self, **updates: Any) -> "RawConfig":
        """A copy with some arguments replaced (origin marks them as set by memguard)."""
        from .knobs import flag_of
        args = dict(self.args)
        origin = dict(self.origin)
        for k, v in updates.items():
            args[k] = v
            origin.setdefault(k, flag_of(k))
        unevaluated = {k: v for k, v in self.unevaluated.items() if k not in updates}
        return replace(self, args=args, origin=origin, unevaluated=unevaluated)

    def merged(self, other: "RawConfig") -> "RawConfig":
        """``other`` on top of this one (later sources win), warnings concatenated."""
        args = {**self.args, **other.args}
        origin = {**self.origin, **other.origin}
        return RawConfig(
            args=args, origin=origin, source=f"{self.source} + {other.source}",
            world_size=other.world_size or self.world_size, nodes=other.nodes or self.nodes,
            gpus_per_node=other.gpus_per_node or self.gpus_per_node, env={**self.env, **other.env},
            warnings=self.warnings + other.warnings, best_effort=self.best_effort or other.best_effort,
            problems=self.problems + other.problems,
            megatron_command_line=self.megatron_command_line and other.megatron_command_line,
            unevaluated={**{k: v for k, v in self.unevaluated.items() if k not in other.args}, **other.unevaluated},
        )
