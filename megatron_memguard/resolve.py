"""From what the user wrote to a Layout: Megatron's defaults, derivations and rules.

This mirrors ``validate_args`` in ``megatron/training/arguments.py`` (core_v0.16 .. core_v0.19), the
vocabulary padding done when the tokenizer is built, and the checks of TransformerConfig and the
pipeline schedules, for the settings that decide memory. Every broken rule is reported with the flag
or key the user wrote; ``resolve`` raises all of them at once.
"""
from __future__ import annotations

import math

from typing import Any, Callable

from packaging.version import InvalidVersion, Version

from .config import RawConfig
from .errors import ConfigError, ConfigErrors, NotModelledError
from .layout import Layout
from .numbers import MAX_WORLD_SIZE, WORLD_SIZE_WHY, bound_reason, shown, to_float, to_int, upper_bound
from .partition import parse_pipeline_layout
from .tokenizers import GPT2_BPE, known_vocab_size, pad_vocab

DEFAULT_MEGATRON_VERSION = "0.19"

# Settings that change memory in ways memguard does not model yet: refuse rather than guess.
# (dest, predicate on the value, what it is)
_NOT_MODELLED: list[tuple[str, Callable[[Any], bool], str]] = [
    ("num_experts", lambda v: bool(v), "mixture of experts (--num-experts)"),
    ("mtp_num_layers", lambda v: bool(v), "multi-token prediction layers"),
    ("hybrid_layer_pattern", lambda v: bool(v), "hybrid (Mamba) layer patterns"),
    ("heterogeneous_layers_config_path", lambda v: bool(v), "heterogeneous layer configs"),
    ("fp8", lambda v: bool(v), "FP8 training (--fp8-format)"),
    ("fp4", lambda v: bool(v), "FP4 training (--fp4-format)"),
    ("cpu_offloading_num_layers", lambda v: bool(v), "activation CPU offloading"),
    ("fine_grained_activation_offloading", bool, "fine-grained activation offloading"),
    ("optimizer_cpu_offload", bool, "optimizer CPU offloading"),
    ("use_megatron_fsdp", bool, "Megatron-FSDP"),
    ("use_torch_fsdp2", bool, "torch FSDP2"),
    ("use_custom_fsdp", bool, "Megatron-FSDP"),
    ("cuda_graph_impl", lambda v: v not in (None, "none"), "CUDA graphs (their memory pools)"),
    ("enable_cuda_graph", bool, "CUDA graphs (their memory pools)"),
    ("external_cuda_graph", bool, "CUDA graphs (their memory pools)"),
    ("tensor_parallel_num_weight_shards", lambda v: v not in (None, 1), "GTP weight rematerialisation"),
    ("delay_wgrad_compute", bool, "delayed weight-gradient computation"),
    ("nccl_ub", bool, "NCCL user-buffer memory pools (--use-nccl-ub)"),
    ("perform_rl_step", bool, "RL training steps"),
    ("export_kd_teacher_load", lambda v: bool(v), "knowledge distillation (a second, teacher model)"),
    ("attention_output_gate", bool, "gated attention output"),
    ("experimental_attention_variant", lambda v: bool(v), "experimental attention variants (gated delta net, DSA)"),
]
_WARN_ONLY: list[tuple[str, Callable[[Any], bool], str]] = [
    ("tp_comm_overlap", bool, "TP communication overlap allocates userbuffers (a few hundred MiB) that memguard does not count"),
]
_RECOMPUTE_MODULES = {"core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts", "mla_up_proj", "mhc"}
_DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16", "bfloat16": "bf16",
                "fp16": "fp16", "float16": "fp16", "half": "fp16", "fp8": "fp8", "uint8": "fp8"}


def parse_version(text: str, key: str = "--megatron-version") -> Version:
    try:
        if len(str(text)) > 40:   # (packaging converts each part to an int: 5000 digits would not convert)
            raise InvalidVersion(text)
        return Version(str(text).lstrip("v").replace("core_v", "").replace("core_r", ""))
    except InvalidVersion:
        raise ConfigError(key, f"cannot read Megatron version {shown(text)}; write e.g. 0.16 or 0.19.2") from None


def resolve(
    raw: RawConfig,
    world_size: int | None = None,
    megatron_version: str | None = None,
    vocab_size: int | None = None,
) -> Layout:
    """Apply Megatron's defaults and rules to ``raw``; raise ConfigErrors listing every problem."""
    r = _Resolver(raw, world_size, megatron_version, vocab_size)
    layout = r.run()
    if r.errors:
        if len(r.errors) == 1:
            raise r.errors[0]
        raise ConfigErrors(r.errors)
    assert layout is not None
    return layout


def check(raw: RawConfig, world_size: int | None = None, megatron_version: str | None = None,
          vocab_size: int | None = None) -> tuple[Layout | None, list[ConfigError]]:
    """Like ``resolve`` but returns the problems instead of raising (for ``memguard validate``)."""
    r = _Resolver(raw, world_size, megatron_version, vocab_size)
    try:
        layout = r.run()
    except ConfigError as e:
        return None, r.errors + [e]
    return (layout if not r.errors else None), r.errors


class _Resolver:
    def __init__(self, raw: RawConfig, world_size: int | None, version: str | None, vocab_size: int | None):
        self.raw = raw
        self.a = dict(raw.args)
        self.world_override = world_size
        self.version_text = version or self.a.get("megatron_version") or DEFAULT_MEGATRON_VERSION
        self.vocab_override = vocab_size
        self.errors: list[ConfigError] = []
        self.notes: list[str] = list(raw.warnings)

    # --- helpers -------------------------------------------------------------------------------
    def get(self, dest: str, default: Any = None) -> Any:
        v = self.a.get(dest)
        return default if v is None else v

    def key(self, dest: str) -> str:
        return self.raw.key(dest)

    def fail(self, dest: str, rule: str, fix: str | None = None) -> None:
        self.errors.append(ConfigError(self.key(dest) if dest else "", rule, fix))

    def int_arg(self, dest: str, default: int | None = None, required: bool = False, minimum: int = 1) -> int | None:
        v = self.a.get(dest)
        if v is None:
            if required:
                self.fail(dest, "is required")
                return None
            return default
        try:
            return to_int(v, self.key(dest), minimum, upper_bound(dest), bound_reason(dest))
        except ConfigError as e:
            self.errors.append(e)
            return default

    def bool_arg(self, dest: str, default: bool) -> bool:
        v = self.a.get(dest)
        if v is None:
            return default
        if isinstance(v, str):
            word = v.strip().lower()
            if word in ("1", "true", "yes", "on"):
                return True
            if word in ("0", "false", "no", "off", ""):
                return False
            self.fail(dest, f"must be true or false, got {v!r}")
            return default
        return bool(v)

    def float_arg(self, dest: str, default: float) -> float:
        v = self.a.get(dest)
        if v is None:
            return default
        try:
            return to_float(v, self.key(dest))
        except ConfigError as e:
            self.errors.append(e)
            return default

    def dtype_arg(self, dest: str, default: str) -> str:
        v = self.a.get(dest)
        if v is None:
            return default
        name = str(v).replace("torch.", "").lower()
        if name not in _DTYPE_NAMES:
            self.fail(dest, f"unknown dtype {v!r}; use fp32, bf16, fp16 or fp8")
            return default
        return _DTYPE_NAMES[name]

    # --- rules of one feature ----------------------------------------------------------------------
    def _check_cp_comm(self, cp: int) -> None:
        """validate_args: hierarchical CP sizes multiply to CP; a2a+p2p needs them."""
        sizes = self.get("hierarchical_context_parallel_sizes")
        if sizes:
            key = self.key("hierarchical_context_parallel_sizes")
            try:
                sizes = [to_int(x, key) for x in (sizes if isinstance(sizes, (list, tuple)) else str(sizes).split())]
            except ConfigError as e:
                self.errors.append(e)
                return
            if math.prod(sizes) != cp:
                self.fail("hierarchical_context_parallel_sizes",
                          f"{sizes} multiply to {math.prod(sizes)}, not context-parallel-size {cp}")
        comm = self.get("cp_comm_type", ["p2p"])
        comm = comm if isinstance(comm, (list, tuple)) else [comm]
        if any("a2a+p2p" in str(c) for c in comm) and not sizes:
            self.fail("hierarchical_context_parallel_sizes", "must be set when --cp-comm-type is a2a+p2p")

    def _mla_shape(self, gqa: bool, impl: str, rope_fusion: bool, position: str) -> dict[str, Any]:
        """Multi-latent attention's projection ranks and head dims (Megatron's defaults and rules)."""
        if gqa:
            self.fail("group_query_attention", "is mutually exclusive with --multi-latent-attention")
        if position == "yarn":
            # GPTModel builds a yarn embedding and passes it on; MLASelfAttention asserts it gets none
            self.fail("position_embedding_type", "yarn cannot be combined with --multi-latent-attention "
                      "(MLA applies its own rotary embedding)", "use --rope-type yarn")
        if self.bool_arg("rotary_interleaved", False):
            self.fail("rotary_interleaved", "does not work with --multi-latent-attention (TransformerConfig)")
        if self.bool_arg("qk_l2_norm", False):
            self.fail("qk_l2_norm", "is not supported with --multi-latent-attention (gpt_layer_specs)")
        if impl != "transformer_engine":
            # the local MLA spec splits the down projections over TP and gathers their outputs: a
            # different set of tensors that memguard has not modelled
            raise NotModelledError(self.key("transformer_impl"), "multi-latent attention with the local implementation")
        for dest in ("mla_down_proj_fusion", "cache_mla_latents"):
            if self.bool_arg(dest, False):
                raise NotModelledError(self.key(dest), dest.replace("_", "-"))
        rope_type = str(self.get("rope_type", "yarn"))
        if rope_type not in ("rope", "yarn"):
            self.fail("rope_type", f"must be rope or yarn, got {rope_type!r}")
        elif rope_fusion and rope_type != "yarn":
            self.fail("rope_type", "rope fusion for multi-latent attention works only with yarn (TransformerConfig)",
                      "use --rope-type yarn or --no-rope-fusion")
        pe = self.int_arg("qk_pos_emb_head_dim", 64)
        if rope_fusion and pe % 4:
            self.fail("qk_pos_emb_head_dim", f"({pe}) must be a multiple of 4 for the fused MLA rope kernels")
        return dict(q_lora_rank=self.int_arg("q_lora_rank"), kv_lora_rank=self.int_arg("kv_lora_rank", 32),
                    qk_head_dim=self.int_arg("qk_head_dim", 128), qk_pos_emb_head_dim=pe,
                    v_head_dim=self.int_arg("v_head_dim", 128), rope_type=rope_type)

    # --- the resolution, in validate_args order ------------------------------------------------
    def run(self) -> Layout | None:
        a = self.a
        version = parse_version(self.version_text)
        legacy = version < Version("0.18")

        for dest, pred, what in _NOT_MODELLED:
            if dest in a and a[dest] is not None and pred(a[dest]):
                raise NotModelledError(self.key(dest), what)
        for dest, pred, what in _WARN_ONLY:
            if dest in a and a[dest] is not None and pred(a[dest]):
                self.notes.append(f"{self.key(dest)}: {what}")
        optimizer = str(self.get("optimizer", "adam")).lower()
        if optimizer not in ("adam", "sgd"):
            raise NotModelledError(self.key("optimizer"), f"the {optimizer!r} optimizer (layer-wise distributed optimizers)")

        # World and model parallel sizes.
        tp = self.int_arg("tensor_model_parallel_size", 1)
        pp = self.int_arg("pipeline_model_parallel_size", 1)
        cp = self.int_arg("context_parallel_size", 1)
        if self.get("expert_model_parallel_size", 1) not in (1, "1"):
            raise NotModelledError(self.key("expert_model_parallel_size"), "expert parallelism")
        world = self.world_override or self.raw.world_size
        if world is None and self.raw.nodes and self.raw.gpus_per_node:
            world = self.raw.nodes * self.raw.gpus_per_node
        world_key = "--world-size" if self.world_override else self.raw.origin.get("world_size", "--world-size")
        if world is None:
            raise ConfigError("--world-size", "the number of GPUs is unknown",
                              "give --world-size N, or --nnodes and --nproc-per-node, or set WORLD_SIZE")
        world = to_int(world, world_key, 1, MAX_WORLD_SIZE, WORLD_SIZE_WHY)
        model_parallel = tp * pp * cp
        if world % model_parallel:
            # Recorded, not raised, so that the checks below still run (memguard validate lists them all).
            self.errors.append(ConfigError(world_key, f"{world} GPUs is not divisible by TP*PP*CP = {tp}*{pp}*{cp} = {model_parallel}",
                                           "change the world size or the parallel sizes"))
        dp = max(1, world // model_parallel)

        # Model shape.
        num_layers = self.int_arg("num_layers", required=True)
        if num_layers is None and self.get("decoder_num_layers") is not None:
            num_layers = self.int_arg("decoder_num_layers", required=True)
        hidden = self.int_arg("hidden_size", required=True)
        heads = self.int_arg("num_attention_heads", required=True)
        if None in (num_layers, hidden, heads):
            return None

        # Deprecated alias (validate_args deletes it after use).
        recompute_granularity = self.get("recompute_granularity")
        if self.bool_arg("recompute_activations", False):
            recompute_granularity = "selective"

        # Batch.
        mbs = self.int_arg("micro_batch_size", required=True)
        gbs = self.int_arg("global_batch_size")
        if mbs is None:
            return None
        if gbs is None:
            gbs = mbs * dp
            self.notes.append(f"global batch size defaults to micro-batch size x DP = {gbs}")
        if gbs % (mbs * dp):
            if self.bool_arg("decrease_batch_size_if_needed", False):
                gbs = gbs // (mbs * dp) * (mbs * dp)
                if gbs == 0:
                    self.fail("global_batch_size", f"is smaller than micro-batch size x DP = {mbs}*{dp}")
                    return None
                self.notes.append(f"--decrease-batch-size-if-needed: global batch size rounded down to {gbs}")
            else:
                self.fail("global_batch_size", f"{gbs} is not divisible by micro-batch size x DP = {mbs}*{dp} = {mbs * dp}",
                          f"use a multiple of {mbs * dp}")
        num_microbatches = max(1, gbs // (mbs * dp))  # (a placeholder after the error above: checks go on)

        # Sequence length.
        seq = self.int_arg("seq_length")
        if seq is None:
            seq = self.int_arg("encoder_seq_length")
        if seq is None:
            self.fail("seq_length", "is required")
            return None
        position = str(self.get("position_embedding_type", "learned_absolute"))
        if self.bool_arg("use_rotary_position_embeddings", False):
            position = "rope"
        if position not in ("learned_absolute", "rope", "yarn", "none", "mrope", "relative"):
            self.fail("position_embedding_type", f"unknown type {position!r}")
        max_pos = self.int_arg("max_position_embeddings")
        if max_pos is None:
            max_pos = seq
            self.notes.append("--max-position-embeddings not given: taken as --seq-length")
        elif max_pos < seq:
            self.fail("max_position_embeddings", f"({max_pos}) must be >= seq_length ({seq})")
        if cp > 1 and seq % (2 * cp):
            self.fail("seq_length", f"{seq} must be a multiple of 2 * context-parallel-size = {2 * cp}")
        self._check_cp_comm(cp)

        # Shape defaults (validate_args).
        swiglu = self.bool_arg("swiglu", False)
        squared_relu = self.bool_arg("squared_relu", False)
        if swiglu and squared_relu:
            self.fail("squared_relu", "cannot be combined with --swiglu")
        gated = swiglu or self.bool_arg("quick_geglu", False) or self.bool_arg("gated_linear_unit", False)
        ffn = self.int_arg("ffn_hidden_size")
        if ffn is None:
            ffn = int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden
        kv = self.int_arg("kv_channels")
        if kv is None:
            if hidden % heads:
                self.fail("hidden_size", f"{hidden} is not divisible by num_attention_heads {heads} (or give --kv-channels)")
                return None
            kv = hidden // heads
        gqa = self.bool_arg("group_query_attention", False)
        groups = self.int_arg("num_query_groups", 1) if gqa else heads
        if gqa and groups is not None and heads % groups:
            self.fail("num_query_groups", f"{groups} must divide num_attention_heads {heads}")
        if heads % tp:
            self.fail("num_attention_heads", f"{heads} is not divisible by tensor-model-parallel size {tp}")
        if groups % tp and tp % groups:
            self.fail("num_query_groups", f"{groups} must be a multiple or a divisor of tensor-model-parallel size {tp}")

        # Precision (validate_args: params_dtype and gradient accumulation dtype).
        bf16, fp16 = self.bool_arg("bf16", False), self.bool_arg("fp16", False)
        if bf16 and fp16:
            self.fail("fp16", "cannot be combined with --bf16")
        params_dtype = "bf16" if bf16 else "fp16" if fp16 else "fp32"
        main_grads_dtype = self.dtype_arg("main_grads_dtype", "fp32")
        main_params_dtype = self.dtype_arg("main_params_dtype", "fp32")
        grad_reduce_in_bf16 = self.bool_arg("grad_reduce_in_bf16", False)
        accumulate_fp32 = self.bool_arg("accumulate_allreduce_grads_in_fp32", False)
        if bf16:
            if grad_reduce_in_bf16:
                accumulate_fp32 = False
            elif not accumulate_fp32 and main_grads_dtype == "fp32":
                accumulate_fp32 = True
        if params_dtype == "fp32":
            accumulate_fp32 = True  # the grad buffer takes the param dtype, fp32
        use_precision_aware = self.bool_arg("use_precision_aware_optimizer", False)
        exp_avg_dtype = self.dtype_arg("exp_avg_dtype", "fp32")
        exp_avg_sq_dtype = self.dtype_arg("exp_avg_sq_dtype", "fp32")
        if not use_precision_aware:
            for dest, val in (("main_grads_dtype", main_grads_dtype), ("main_params_dtype", main_params_dtype),
                              ("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
                if val != "fp32":
                    self.fail(dest, "a non-fp32 dtype needs --use-precision-aware-optimizer")
        if use_precision_aware:
            if optimizer != "adam":
                self.fail("use_precision_aware_optimizer", "works with Adam only")
            if main_grads_dtype == "bf16":
                accumulate_fp32 = False
        if fp16 and main_grads_dtype == "bf16":
            self.fail("main_grads_dtype", "bf16 main grads cannot be used with --fp16")
        # validate_args, "Mixed precision checks".
        fp16_lm_ce = self.bool_arg("fp16_lm_cross_entropy", False)
        if fp16_lm_ce and not fp16:
            self.fail("fp16_lm_cross_entropy", "needs --fp16")
        fp32_residual = self.bool_arg("fp32_residual_connection", False)
        if fp32_residual and not (fp16 or bf16):
            self.fail("fp32_residual_connection", "needs --fp16 or --bf16")

        # Sequence parallelism is switched off at TP=1 (validate_args).
        sp = self.bool_arg("sequence_parallel", False)
        if sp and tp == 1:
            sp = False
            self.notes.append("--sequence-parallel ignored: tensor-model-parallel size is 1 (Megatron switches it off)")
        tp_comm_overlap = self.bool_arg("tp_comm_overlap", False)
        if tp_comm_overlap and not sp:
            self.fail("tp_comm_overlap", "needs --sequence-parallel")

        # Pipeline split and virtual pipeline (validate_args + TransformerConfig.__post_init__).
        first = self.int_arg("decoder_first_pipeline_num_layers")
        last = self.int_arg("decoder_last_pipeline_num_layers")
        acc_emb = self.bool_arg("account_for_embedding_in_pipeline_split", False)
        acc_loss = self.bool_arg("account_for_loss_in_pipeline_split", False)
        pp_layout = self.get("pipeline_model_parallel_layout")
        lpv = self.int_arg("num_layers_per_virtual_pipeline_stage")
        vps = self.int_arg("num_virtual_stages_per_pipeline_rank")
        vpp_given = self.int_arg("virtual_pipeline_model_parallel_size")  # NeMo/Bridge readers set it directly
        if sum(x is not None for x in (lpv, vps, pp_layout)) > 1:
            self.fail("num_layers_per_virtual_pipeline_stage",
                      "at most one of --num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank "
                      "and --pipeline-model-parallel-layout may be given")
        if (first is not None or last is not None) and (acc_emb or acc_loss):
            self.fail("decoder_first_pipeline_num_layers",
                      "cannot be combined with --account-for-embedding/loss-in-pipeline-split")
        if pp_layout is not None and (first is not None or last is not None or acc_emb or acc_loss):
            self.fail("pipeline_model_parallel_layout", "cannot be combined with other pipeline split flags")
        vpp: int | None = None
        if pp_layout is not None:
            try:
                stages = parse_pipeline_layout(str(pp_layout), pp, self.key("pipeline_model_parallel_layout"))
            except ConfigError as e:
                self.errors.append(e)
                return None
            if sum(st.count("t") for st in stages) != num_layers:
                self.fail("pipeline_model_parallel_layout",
                          f"places {sum(st.count('t') for st in stages)} transformer layers but --num-layers is {num_layers}")
            vpp = len(stages) // pp
        elif lpv is not None or vps is not None or vpp_given is not None:
            if vps is not None or vpp_given is not None:
                vpp = vps if vps is not None else vpp_given
            else:
                if first is not None or last is not None:
                    self.fail("num_layers_per_virtual_pipeline_stage",
                              "use --num-virtual-stages-per-pipeline-rank with uneven first/last stages")
                n = num_layers + int(acc_emb) + int(acc_loss)
                if n % pp:
                    self.fail("num_layers", f"{n} layers (with embedding/loss slots) is not divisible by pipeline-model-parallel size {pp}")
                    return None
                if (n // pp) % lpv:
                    self.fail("num_layers_per_virtual_pipeline_stage",
                              f"{lpv} does not divide the {n // pp} layers per pipeline stage")
                    return None
                vpp = (n // pp) // lpv
        if vpp == 1:
            vpp = None
        if vpp is not None and pp == 1:
            vpp = None
            self.notes.append("virtual pipeline stages ignored: pipeline-model-parallel size is 1")
        overlap_p2p = self.bool_arg("overlap_p2p_comm", True)
        if vpp is not None:
            if not overlap_p2p and pp <= 2:
                self.fail("pipeline_model_parallel_size",
                          "must be > 2 for the interleaved schedule with --no-overlap-p2p-communication")
        else:
            overlap_p2p = False
        if pp_layout is None:
            if first is not None or last is not None:
                rest, stages_left = num_layers, pp
                for v in (first, last):
                    if v is not None:
                        rest -= v
                        stages_left -= 1
                if stages_left < 0 or rest < 0 or bool(rest) != bool(stages_left):
                    self.fail("decoder_first_pipeline_num_layers",
                              f"first/last stage layers leave {rest} layers for {max(stages_left, 0)} middle stages")
                    return None
                if stages_left and rest % stages_left:
                    self.fail("decoder_first_pipeline_num_layers",
                              f"the {rest} middle layers must divide evenly over {stages_left} middle stages")
                    return None
                if vpp:
                    for dest, v in (("decoder_first_pipeline_num_layers", first), ("decoder_last_pipeline_num_layers", last)):
                        if v is not None and v % vpp:
                            self.fail(dest, f"{v} must be divisible by the {vpp} virtual stages")
                    if stages_left and (rest // stages_left) % vpp:
                        self.fail("num_virtual_stages_per_pipeline_rank",
                                  f"the {rest // stages_left} layers per middle stage must divide into {vpp} virtual stages")
            else:
                n = num_layers + int(acc_emb) + int(acc_loss)
                if n % pp:
                    self.fail("num_layers", f"{n} layers{' (with embedding/loss slots)' if acc_emb or acc_loss else ''} "
                              f"is not divisible by pipeline-model-parallel size {pp}")
                    return None
                if vpp and (n // pp) % vpp:
                    self.fail("num_virtual_stages_per_pipeline_rank",
                              f"{vpp} virtual stages do not divide the {n // pp} layers per pipeline stage")
                    return None
        group_size = self.int_arg("microbatch_group_size_per_vp_stage")
        if vpp is not None:
            g = group_size or pp
            if g > num_microbatches or g < pp:
                self.fail("global_batch_size",
                          f"the interleaved schedule needs PP ({pp}) <= micro-batch group size ({g}) <= number of "
                          f"micro-batches ({num_microbatches} = GBS/(MBS*DP))", "raise the global batch size or lower MBS")
            elif 0 < num_microbatches % g < pp:
                self.fail("global_batch_size",
                          f"{num_microbatches} micro-batches leave a last group of {num_microbatches % g} < PP = {pp} "
                          "(Megatron's interleaved schedule refuses it)")

        # Recompute.
        method = self.get("recompute_method")
        # 0 is a value Megatron takes (TransformerConfig.__post_init__ only refuses None with full recompute).
        rnl = self.int_arg("recompute_num_layers", minimum=0)
        modules = self.get("recompute_modules")
        if isinstance(modules, str):
            modules = modules.replace(",", " ").split()
        elif modules is not None and not isinstance(modules, (list, tuple)):
            self.fail("recompute_modules", f"must be a list of module names, got {modules!r}")
            modules = None
        if recompute_granularity not in (None, "full", "selective"):
            self.fail("recompute_granularity", f"must be full or selective, got {recompute_granularity!r}")
        if recompute_granularity == "full":
            if method not in ("uniform", "block"):
                self.fail("recompute_method", "full recompute needs --recompute-method uniform or block")
            if rnl is None:
                if self.get("recompute_num_layers") is None:   # (a bad value is reported by int_arg)
                    self.fail("recompute_num_layers", "full recompute needs --recompute-num-layers")
            elif rnl == 0 and method == "uniform":
                # checkpointed_forward's uniform loop advances by recompute_num_layers: with 0 the
                # first forward never ends (TransformerBlock, megatron-core 0.14-0.16; core/recompute.py 0.19).
                self.fail("recompute_num_layers", "0 with --recompute-method uniform never finishes a forward "
                          "(Megatron's uniform loop advances by --recompute-num-layers)",
                          "give >= 1, or --recompute-method block with 0 to checkpoint no layer")
            elif rnl == 0:
                # Block: layers with index < recompute_num_layers are checkpointed, so none are; launch
                # scripts use this as an off switch.
                self.notes.append("--recompute-method block --recompute-num-layers 0 checkpoints no layer: "
                                  "estimated as no recomputation")
        elif recompute_granularity == "selective":
            if method is not None:
                self.fail("recompute_method", "is not supported with selective recompute")
            if rnl is not None:
                # TransformerConfig.__post_init__: "recompute_num_layers must be None" with selective.
                self.fail("recompute_num_layers", "must not be given with selective recompute")
            method, rnl = None, None
        else:
            if method is not None or rnl is not None:
                self.notes.append("--recompute-method/--recompute-num-layers ignored without --recompute-granularity")
            method, rnl = None, None
        if modules is None:
            modules = ["core_attn"]
        for m in modules:
            if m not in _RECOMPUTE_MODULES:
                self.fail("recompute_modules", f"unknown module {m!r}; known: {', '.join(sorted(_RECOMPUTE_MODULES))}")
            elif (m == "mla_up_proj" and recompute_granularity == "selective"
                  and not self.bool_arg("multi_latent_attention", False)):
                self.fail("recompute_modules", "mla_up_proj needs --multi-latent-attention (TransformerConfig)")
        distribute_saved = self.bool_arg("distribute_saved_activations", False)
        if distribute_saved and (tp == 1 or recompute_granularity != "full"):
            self.fail("distribute_saved_activations", "needs full recompute and tensor-model-parallel size > 1")
        elif distribute_saved and sp:
            # TransformerConfig.__post_init__ refuses the pair.
            self.fail("distribute_saved_activations", "cannot be combined with --sequence-parallel")

        # Optimizer and DDP.
        dist_opt = self.bool_arg("use_distributed_optimizer", False)
        instances = self.int_arg("num_distributed_optimizer_instances", 1)
        if instances > 1 and not dist_opt:
            self.fail("num_distributed_optimizer_instances", "needs --use-distributed-optimizer")
        if instances > 1 and (dp * cp) % instances:
            self.fail("num_distributed_optimizer_instances", f"{instances} must divide DP*CP = {dp * cp}")
        if use_precision_aware and not dist_opt:
            # OptimizerConfig.__post_init__ asserts it (megatron-core 0.16.1 and 0.19.2 alike).
            self.fail("use_precision_aware_optimizer", "needs --use-distributed-optimizer")
        overlap_grad = self.bool_arg("overlap_grad_reduce", False)
        overlap_param = self.bool_arg("overlap_param_gather", False)
        if overlap_param and not dist_opt:
            self.fail("overlap_param_gather", "needs --use-distributed-optimizer")
        if overlap_param and not overlap_grad:
            self.fail("overlap_param_gather", "needs --overlap-grad-reduce")
        bucket = self.int_arg("ddp_bucket_size")

        # Implementation and fusions (Megatron's defaults: TE, fusions on).
        impl = str(self.get("transformer_impl", "transformer_engine"))
        if impl not in ("transformer_engine", "local"):
            raise NotModelledError(self.key("transformer_impl"), f"transformer implementation {impl!r}")
        if impl == "local" and cp > 1:
            # megatron-core's DotProductAttention asserts context_parallel_size == 1 (only TE's
            # attention implements context parallelism).
            self.fail("context_parallel_size", "needs --transformer-impl transformer_engine (megatron's local "
                      "attention has no context parallelism)")
        if sp and seq and (seq // cp) % tp:
            # The sequence-parallel scatter splits each rank's s/CP tokens over TP
            # (tensor_parallel.mappings._split_along_first_dim asserts it divides).
            self.fail("sequence_parallel", f"needs seq_length / context-parallel size = {seq // cp} divisible by "
                      f"tensor-model-parallel size {tp}")
        backend = str(self.get("attention_backend", "auto")).replace("AttnBackend.", "")
        if backend not in ("auto", "flash", "fused", "unfused", "local"):
            self.fail("attention_backend", f"unknown backend {backend!r}")
        add_bias = self.bool_arg("add_bias_linear", True)
        add_qkv_bias = self.bool_arg("add_qkv_bias", False) or add_bias
        bias_gelu = self.bool_arg("bias_gelu_fusion", True) and add_bias
        bias_swiglu = self.bool_arg("bias_swiglu_fusion", True)
        bias_act_fusion = self.bool_arg("bias_activation_fusion", bias_swiglu if swiglu else bias_gelu)
        if squared_relu:
            bias_act_fusion = False
        apply_rope_fusion = self.bool_arg("apply_rope_fusion", True) and position == "rope"
        mla = self.bool_arg("multi_latent_attention", False)
        mla_shape = {}
        if mla:
            mla_shape = self._mla_shape(gqa, impl, apply_rope_fusion, position)
        normalization = str(self.get("normalization", "LayerNorm"))
        if normalization.lower() in ("layernorm", "layer_norm"):
            normalization = "LayerNorm"
        elif normalization.lower() in ("rmsnorm", "rms_norm"):
            normalization = "RMSNorm"
        else:
            self.fail("normalization", f"must be LayerNorm or RMSNorm, got {normalization!r}")
        ce_fusion = self.bool_arg("cross_entropy_loss_fusion", False)
        ce_impl = str(self.get("cross_entropy_fusion_impl", "native"))
        if ce_fusion and ce_impl == "te" and not legacy:
            self.fail("cross_entropy_fusion_impl", "te is rejected together with --cross-entropy-loss-fusion since core 0.18")
        softmax_fp32 = self.bool_arg("attention_softmax_in_fp32", False)
        qk_scaling = self.bool_arg("apply_query_key_layer_scaling", False)
        if qk_scaling and not softmax_fp32 and fp16:
            softmax_fp32 = True  # TransformerConfig: layer scaling needs the softmax in fp32 under fp16

        # Vocabulary (tokenizer build in set_global_variables).
        padded = self.int_arg("padded_vocab_size")
        tokenizer = self.get("tokenizer_type")
        vocab = None
        divisible = self.int_arg("make_vocab_size_divisible_by", 128)
        if padded is None:
            given = self.vocab_override or self.int_arg("vocab_size")
            if tokenizer == "NullTokenizer":
                if given is None:
                    self.fail("vocab_size", "is required with --tokenizer-type NullTokenizer")
                    return None
                # NullTokenizer counted one extra EOD token up to core 0.17 (Megatron commit c9dfe34798).
                vocab = given + 1 if legacy else given
            elif tokenizer in (None, "GPT2BPETokenizer") and self.get("tokenizer_model") is None:
                vocab = given if (tokenizer is None and self.vocab_override) else GPT2_BPE
                if tokenizer is None and not self.vocab_override:
                    self.notes.append("no --tokenizer-type: pretrain_gpt.py's default GPT2BPETokenizer (50257 tokens)")
            else:
                vocab = known_vocab_size(self.get("tokenizer_model")) or known_vocab_size(tokenizer) or given
                if vocab is None:
                    self.fail("vocab_size", f"unknown vocabulary for tokenizer {self.get('tokenizer_model') or tokenizer!r}",
                              "give --vocab-size N")
                    return None
            padded = pad_vocab(vocab, divisible, tp) if self.bool_arg("pad_vocab_size", True) else vocab

        # ModelParallelConfig.__post_init__ refuses deferral without a pipeline or without fused
        # weight-gradient accumulation.
        defer_wgrad = self.bool_arg("defer_embedding_wgrad_compute", False)
        grad_acc_fusion = self.bool_arg("gradient_accumulation_fusion", True)
        if defer_wgrad and pp == 1:
            self.fail("defer_embedding_wgrad_compute", "needs pipeline-model-parallel size > 1")
        if defer_wgrad and not grad_acc_fusion:
            self.fail("defer_embedding_wgrad_compute", "cannot be used with --no-gradient-accumulation-fusion")

        deterministic = self.bool_arg("deterministic_mode", False)
        cublas = self.raw.env.get("CUBLAS_WORKSPACE_CONFIG")
        if deterministic and cublas and cublas not in (":4096:8", ":16:8") and version >= Version("0.19"):
            # megatron/training/determinism.py (0.19): ACCEPTED_ENV_VAR_VALUES
            self.fail("deterministic_mode", f"needs CUBLAS_WORKSPACE_CONFIG :4096:8 or :16:8, got {cublas!r}")
        hidden_dropout = self.float_arg("hidden_dropout", 0.1)
        attention_dropout = self.float_arg("attention_dropout", 0.1)
        env = tuple(sorted((str(k), str(v)) for k, v in self.raw.env.items()))
        if self.errors:
            return None
        return Layout.from_flat(
            world_size=world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp, data_parallel_size=dp,
            sequence_parallel=sp, num_distributed_optimizer_instances=instances,
            num_layers=num_layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
            num_query_groups=groups, group_query_attention=gqa, kv_channels=kv, seq_length=seq,
            max_position_embeddings=max_pos, vocab_size=vocab, padded_vocab_size=padded,
            make_vocab_size_divisible_by=divisible, swiglu=swiglu, squared_relu=squared_relu, gated_linear_unit=gated,
            normalization=normalization, add_bias_linear=add_bias, add_qkv_bias=add_qkv_bias,
            qk_layernorm=self.bool_arg("qk_layernorm", False), position_embedding_type=position,
            rotary_percent=self.float_arg("rotary_percent", 1.0),
            untie_embeddings_and_output_weights=self.bool_arg("untie_embeddings_and_output_weights", False),
            hidden_dropout=hidden_dropout, attention_dropout=attention_dropout,
            micro_batch_size=mbs, global_batch_size=gbs, num_microbatches=num_microbatches,
            decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last,
            account_for_embedding_in_pipeline_split=acc_emb, account_for_loss_in_pipeline_split=acc_loss,
            pipeline_model_parallel_layout=str(pp_layout) if pp_layout is not None else None,
            microbatch_group_size_per_vp_stage=(group_size or pp) if vpp else group_size, overlap_p2p_comm=overlap_p2p,
            params_dtype=params_dtype, autocast_dtype=self.dtype_arg("autocast_dtype", params_dtype) if "autocast_dtype" in a else None,
            bf16=bf16, fp16=fp16, accumulate_allreduce_grads_in_fp32=accumulate_fp32,
            grad_reduce_in_bf16=grad_reduce_in_bf16, fp32_residual_connection=fp32_residual,
            attention_softmax_in_fp32=softmax_fp32, apply_query_key_layer_scaling=qk_scaling,
            fp16_lm_cross_entropy=fp16_lm_ce,
            optimizer=optimizer, use_distributed_optimizer=dist_opt, use_precision_aware_optimizer=use_precision_aware,
            main_grads_dtype=main_grads_dtype, main_params_dtype=main_params_dtype, exp_avg_dtype=exp_avg_dtype,
            exp_avg_sq_dtype=exp_avg_sq_dtype, store_param_remainders=self.bool_arg("store_param_remainders", True),
            overlap_grad_reduce=overlap_grad, overlap_param_gather=overlap_param, ddp_bucket_size=bucket,
            ddp_pad_buckets_for_high_nccl_busbw=self.bool_arg("ddp_pad_buckets_for_high_nccl_busbw", False),
            gradient_accumulation_fusion=grad_acc_fusion,
            recompute_granularity=recompute_granularity, recompute_method=method, recompute_num_layers=rnl,
            recompute_modules=tuple(modules), distribute_saved_activations=distribute_saved,
            transformer_impl=impl, attention_backend=backend,
            masked_softmax_fusion=self.bool_arg("masked_softmax_fusion", True), bias_activation_fusion=bias_act_fusion,
            bias_dropout_fusion=self.bool_arg("bias_dropout_fusion", True), apply_rope_fusion=apply_rope_fusion,
            cross_entropy_loss_fusion=ce_fusion, cross_entropy_fusion_impl=ce_impl,
            create_attention_mask_in_dataloader=self.bool_arg("create_attention_mask_in_dataloader", True),
            deterministic_mode=deterministic,
            calculate_per_token_loss=self.bool_arg("calculate_per_token_loss", False),
            empty_unused_memory_level=self.int_arg("empty_unused_memory_level", 0, minimum=0),
            defer_embedding_wgrad_compute=defer_wgrad,
            wgrad_deferral_limit=self.int_arg("wgrad_deferral_limit", 0, minimum=0),
            tp_comm_overlap=tp_comm_overlap, megatron_version=str(version), tokenizer_type=tokenizer,
            multi_latent_attention=mla, **mla_shape,
            env=env, notes=tuple(self.notes),
        )
