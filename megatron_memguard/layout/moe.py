"""The ``moe`` part of a Layout: the mixture-of-experts settings that decide memory (``MoeSpec``),
and which layers are MoE (``--moe-layer-freq``, read as Megatron reads it, without eval()).

Megatron's argument names; the values as ``resolve/moe.py`` resolves them (ETP = TP and
moe_ffn_hidden_size = ffn_hidden_size when unset, the per-layer pattern). A dense model's Layout has
``moe = None``. What an MoE layer holds is ``estimator/layers/moe.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

DISPATCHERS = ("allgather", "alltoall", "flex")
AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


# ----------------------------------------------------------------------------------------------
# which layers are MoE
# ----------------------------------------------------------------------------------------------


def parse_moe_layer_freq(value: Any, num_layers: int, key: str = "--moe-layer-freq") -> tuple[bool, ...]:
    """The MoE/dense pattern of all ``num_layers`` layers, as ``moe_freq_type`` (arguments.py) and
    ``get_gpt_decoder_layer_specs`` read it: an int N makes layer i (0-based) MoE iff i % N == 0; a
    list (or a string holding a list expression such as ``([0]*3+[1]*58)``, read without eval by
    ``readers/moe_freq.py``) gives one 0/1 per layer and must have ``num_layers`` entries."""
    from ..readers.moe_freq import moe_layers, parse_moe_layer_freq as read_freq
    freq = read_freq(value, key)
    if isinstance(freq, int):
        if freq < 1:
            raise ConfigError(key, f"must be a positive integer (every N-th layer is MoE), got {freq}")
    elif len(freq) != num_layers:
        raise ConfigError(key, f"has {len(freq)} entries but --num-layers is {num_layers}; give one 0/1 per layer")
    return tuple(moe_layers(freq, num_layers))


def moe_layers_in(pattern: tuple[bool, ...], first_layer: int, num_layers: int) -> int:
    """MoE layers among the global layers ``first_layer .. first_layer + num_layers - 1`` (a stage's
    or virtual chunk's slice, as get_gpt_decoder_block_spec slices the per-layer specs)."""
    return sum(pattern[first_layer:first_layer + num_layers])


# ----------------------------------------------------------------------------------------------
# the spec (the Layout's ``moe`` part)
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoeSpec:
    """The MoE settings that decide memory, under Megatron's argument names (resolved values)."""

    num_experts: int
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 0                       # resolved: ffn_hidden_size when unset
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_shared_expert_overlap: bool = False
    moe_grouped_gemm: bool = False
    moe_router_dtype: str | None = None                # None: the activation dtype; fp32; fp64
    moe_token_dispatcher_type: str = "allgather"
    moe_permute_fusion: bool = False
    moe_router_fusion: bool = False
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_layer_pattern: tuple[bool, ...] = ()           # resolved --moe-layer-freq, one entry per layer
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1               # resolved: TP when unset
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_pre_softmax: bool = False
    moe_router_score_function: str = "softmax"
    moe_router_enable_expert_bias: bool = False
    moe_recompute: tuple[str, ...] = field(default=())  # of moe, moe_act, shared_experts
    # the combined 1F1B schedule: a forward layer of the next micro-batch runs with each backward layer
    overlap_moe_expert_parallel_comm: bool = False
    # --delay-wgrad-compute (needs the overlap): TE keeps each linear's input and output gradient until
    # the schedule's backward_dw
    delay_wgrad_compute: bool = False
    # --overlap-dispatch-backward-with-experts-wgrad (0.19): the experts' weight gradients run beside the
    # dispatch's backward, their inputs and output gradients kept through it
    overlap_dispatch_backward_with_experts_wgrad: bool = False
    # which N the activations use: "balanced" (the estimate) or "worst" (the dispatcher's limit)
    routing: str = "balanced"
    # the flex dispatcher's SMs (DeepEP's communication buffer has one channel per two SMs)
    moe_flex_dispatcher_num_sms: int = 20
    # --use-fused-weighted-squared-relu: TEGroupedMLP's squared-ReLU x probs in one autograd function
    use_fused_weighted_squared_relu: bool = False
    # --use-grouped-gemm-for-shared-expert (core 0.19): FusedSharedExpertMLP, TE's fused grouped SwiGLU ops
    use_grouped_gemm_for_shared_expert: bool = False
    # --moe-input-jitter-eps: the router multiplies its input by uniform noise (kept for backward)
    moe_input_jitter_eps: float | None = None
    # --moe-router-force-biased: random logits plus a per-expert bias shared by every rank (benchmarking)
    moe_router_force_biased: float | None = None
    # --moe-router-padding-for-quantization (or -for-fp8): the multiple each expert's token count is padded
    # to by the dispatcher (get_align_size_for_quantization); 0 when off
    moe_router_padding_align: int = 0
    # --moe-apply-probs-on-input (top-1): the experts scale their input by the probs before fc1
    moe_apply_probs_on_input: bool = False
    # --moe-use-legacy-grouped-gemm (core < 0.17, with --moe-grouped-gemm): GroupedMLP, two weights for all
    # local experts and the grouped_gemm library's kernels
    moe_use_legacy_grouped_gemm: bool = False
    # --moe-latent-size: the routed experts (and the dispatch) work in this width; two duplicated TELinear
    # projections h -> latent before the dispatch and latent -> h after the combine
    moe_latent_size: int | None = None
    # --moe-use-upcycling (megatron/training 0.16; 0.17 to 0.19 fail at start-up): the run starts from a dense checkpoint, building a
    # dense model (FFN x --moe-upcycling-granularity, EP 1) beside the MoE one at start-up (estimator/upcycling.py)
    moe_use_upcycling: bool = False
    moe_upcycling_granularity: int = 1

    @classmethod
    def from_flat(cls, *, num_layers: int, ffn_hidden_size: int, tensor_model_parallel_size: int,
                  moe_layer_freq: Any = 1, recompute_modules: tuple[str, ...] = (), **kw: Any) -> "MoeSpec":
        """A spec from flat Megatron names with Megatron's defaults (ETP = TP, moe_ffn = ffn)."""
        etp = kw.pop("expert_tensor_parallel_size", None) or tensor_model_parallel_size
        ffn = kw.pop("moe_ffn_hidden_size", None) or ffn_hidden_size
        lbt = kw.pop("moe_router_load_balancing_type", None) or "aux_loss"
        if isinstance(lbt, (list, tuple)):
            lbt = ",".join(str(t) for t in lbt)
        coeff = kw.pop("moe_aux_loss_coeff", None) or 0.0
        if isinstance(coeff, (list, tuple)):
            coeff = sum(float(c) for c in coeff)
        rec = tuple(m for m in recompute_modules if m in ("moe", "moe_act", "shared_experts"))
        known = set(cls.__dataclass_fields__)
        clean = {k: v for k, v in kw.items() if k in known and v is not None}
        return cls(moe_ffn_hidden_size=ffn, expert_tensor_parallel_size=etp,
                   moe_layer_pattern=parse_moe_layer_freq(moe_layer_freq if moe_layer_freq is not None else 1, num_layers),
                   moe_router_load_balancing_type=str(lbt), moe_aux_loss_coeff=float(coeff),
                   moe_recompute=rec, **clean)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``layout.moe`` of ``memguard estimate --json``): the fields, lists for tuples."""
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["moe_layer_pattern"] = [int(v) for v in self.moe_layer_pattern]
        d["moe_recompute"] = list(self.moe_recompute)
        for name in ("delay_wgrad_compute", "overlap_dispatch_backward_with_experts_wgrad",
                     "use_fused_weighted_squared_relu", "use_grouped_gemm_for_shared_expert",
                     "moe_input_jitter_eps", "moe_router_force_biased", "moe_router_padding_align",
                     "moe_apply_probs_on_input", "moe_use_legacy_grouped_gemm", "moe_latent_size",
                     "moe_use_upcycling", "moe_upcycling_granularity"):
            if d[name] is None or d[name] is False or (name == "moe_router_padding_align" and not d[name]) or (
                    name == "moe_upcycling_granularity" and not self.moe_use_upcycling):
                del d[name]     # shown only when set (the JSON of every other run is unchanged)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MoeSpec":
        kw = dict(d)
        kw["moe_layer_pattern"] = tuple(bool(v) for v in kw.get("moe_layer_pattern", ()))
        kw["moe_recompute"] = tuple(kw.get("moe_recompute", ()))
        return cls(**kw)

    # ----- derived -----
    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.expert_model_parallel_size

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layer_pattern)

    @property
    def aux_loss(self) -> bool:
        """Router.is_aux_loss_enabled: a load-balancing type with a loss and a non-zero coefficient."""
        return self.moe_aux_loss_coeff > 0 and any(t in self.moe_router_load_balancing_type for t in AUX_LOSS_TYPES)
