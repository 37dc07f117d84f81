"""The resolved training layout: every setting that decides memory, under Megatron's argument names.

A Layout is what ``resolve`` makes of a RawConfig after applying Megatron's defaults and derivations
(``validate_args``, the tokenizer's vocabulary padding, TransformerConfig's ``__post_init__``) and
checking its rules. Field names are Megatron's ``args`` names so that ``memguard estimate --json``
shows the layout in the vocabulary users already know.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from typing import Any

from .partition import Chunk  # noqa: F401  (re-exported: Chunk lives next to the partitioning)

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclass(frozen=True)
class Layout:
    # world and parallelism
    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int | None
    context_parallel_size: int
    data_parallel_size: int
    sequence_parallel: bool
    num_distributed_optimizer_instances: int
    # model shape
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int           # resolved: heads unless --group-query-attention
    group_query_attention: bool
    kv_channels: int
    seq_length: int
    max_position_embeddings: int
    vocab_size: int | None          # before padding, where known
    padded_vocab_size: int
    make_vocab_size_divisible_by: int
    swiglu: bool
    squared_relu: bool
    gated_linear_unit: bool
    normalization: str              # LayerNorm | RMSNorm
    add_bias_linear: bool
    add_qkv_bias: bool
    qk_layernorm: bool
    position_embedding_type: str
    rotary_percent: float
    untie_embeddings_and_output_weights: bool
    hidden_dropout: float
    attention_dropout: float
    # batch
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    # pipeline split
    decoder_first_pipeline_num_layers: int | None
    decoder_last_pipeline_num_layers: int | None
    account_for_embedding_in_pipeline_split: bool
    account_for_loss_in_pipeline_split: bool
    pipeline_model_parallel_layout: str | None
    microbatch_group_size_per_vp_stage: int | None
    overlap_p2p_comm: bool
    # precision
    params_dtype: str               # bf16 | fp16 | fp32
    autocast_dtype: str | None      # activations' dtype when it differs from the params' (NeMo O1 autocast)
    bf16: bool
    fp16: bool
    accumulate_allreduce_grads_in_fp32: bool
    grad_reduce_in_bf16: bool
    fp32_residual_connection: bool
    attention_softmax_in_fp32: bool
    apply_query_key_layer_scaling: bool
    fp16_lm_cross_entropy: bool
    # optimizer and DDP
    optimizer: str                  # adam | sgd
    use_distributed_optimizer: bool
    use_precision_aware_optimizer: bool
    main_grads_dtype: str
    main_params_dtype: str
    exp_avg_dtype: str
    exp_avg_sq_dtype: str
    store_param_remainders: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    ddp_bucket_size: int | None
    ddp_pad_buckets_for_high_nccl_busbw: bool
    gradient_accumulation_fusion: bool
    # recompute
    recompute_granularity: str | None
    recompute_method: str | None
    recompute_num_layers: int | None
    recompute_modules: tuple[str, ...]
    distribute_saved_activations: bool
    # kernels and fusions
    transformer_impl: str           # transformer_engine | local
    attention_backend: str          # auto | flash | fused | unfused | local
    masked_softmax_fusion: bool
    bias_activation_fusion: bool
    bias_dropout_fusion: bool
    apply_rope_fusion: bool
    cross_entropy_loss_fusion: bool
    cross_entropy_fusion_impl: str
    create_attention_mask_in_dataloader: bool
    deterministic_mode: bool
    calculate_per_token_loss: bool
    empty_unused_memory_level: int
    defer_embedding_wgrad_compute: bool
    wgrad_deferral_limit: int
    tp_comm_overlap: bool
    # provenance
    megatron_version: str
    tokenizer_type: str | None = None
    # multi-latent attention (DeepSeek-V2 style; megatron's MLASelfAttention), off by default
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # None: queries projected directly (linear_q_proj)
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rope_type: str = "yarn"         # MLA's own rotary embedding (rope | yarn)
    env: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __hash__(self) -> int:
        # Layouts key the estimator's caches; hashing ~90 fields on every lookup is the cost, so the
        # hash is computed once (frozen: it cannot change).
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare))
            self.__dict__["_hash"] = h
        return h

    # ----- derived quantities used across the estimator -----
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

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.params_dtype]

    @property
    def act_bytes(self) -> int:
        """Bytes per activation element: the autocast dtype when set, else the params' dtype."""
        return DTYPE_BYTES[self.autocast_dtype or self.params_dtype]

    @property
    def grad_bytes(self) -> int:
        """Bytes per element of the DDP gradient buffer."""
        return 4 if self.accumulate_allreduce_grads_in_fp32 else DTYPE_BYTES[self.params_dtype]

    @property
    def dp_shard_size(self) -> int:
        """Ranks the distributed optimizer shards over: DP x CP / optimizer instances."""
        return max(1, self.data_parallel_size * self.context_parallel_size // self.num_distributed_optimizer_instances)

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    @cached_property
    def chunks(self) -> tuple[Chunk, ...]:
        from .partition import partition_layers
        return partition_layers(self)

    @cached_property
    def _chunks_by_stage(self) -> dict[int, tuple[Chunk, ...]]:
        by: dict[int, list[Chunk]] = {}
        for c in self.chunks:
            by.setdefault(c.pp_rank, []).append(c)
        return {k: tuple(v) for k, v in by.items()}

    def stage_chunks(self, pp_rank: int) -> tuple[Chunk, ...]:
        return self._chunks_by_stage.get(pp_rank, ())

    @classmethod
    def from_megatron_args(cls, namespace: Any, world_size: int | None = None,
                           megatron_version: str | None = None) -> "Layout":
        """A Layout from an ``argparse.Namespace`` as Megatron's parse_args/validate_args produce it."""
        from .readers.megatron_namespace import raw_from_namespace
        from .resolve import resolve
        return resolve(raw_from_namespace(namespace), world_size=world_size, megatron_version=megatron_version)

    @classmethod
    def from_flags(cls, argv: list[str], world_size: int | None = None, megatron_version: str | None = None) -> "Layout":
        """A Layout from Megatron command-line flags."""
        from .readers.megatron_flags import parse_megatron_flags
        from .resolve import resolve
        return resolve(parse_megatron_flags(argv), world_size=world_size, megatron_version=megatron_version)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["recompute_modules"] = list(self.recompute_modules)
        d["env"] = dict(self.env)
        d["notes"] = list(self.notes)
        return d
