"""FP8 and FP4 training: the bytes Transformer Engine's quantization recipes add and save, per tensor.

Megatron runs the GEMMs of a transformer layer (QKV / fc1 ``TELayerNormColumnParallelLinear``, proj /
fc2 ``TERowParallelLinear``, MLA and expert linears) inside TE's ``fp8_autocast`` when ``--fp8-format``
(or ``--fp4-format``) is set; norms, core attention, the router, embeddings, the LM head and the loss
stay in the activation dtype. What that changes in memory, read in TE 2.11 (``transformer_engine/
pytorch``; megatron-core 0.16.1 pins TE >= 2.9, < 2.12) and megatron-core 0.16.1 / 0.19.2:

* Weight workspaces (``module/base.py`` ``get_weight_workspace``): with BF16 parameters each GEMM
  weight is quantized into a workspace cached in ``_fp8_workspaces`` under ``cache_name="weight"``
  (``"weight{i}"`` per expert of a grouped linear) for the life of the module. Megatron's TE wrappers
  pass ``is_first_microbatch`` (``extensions/transformer_engine.py``: ``None`` only when
  ``disable_parameter_transpose_cache``), and ``MegatronModule.set_is_first_microbatch`` resets it at
  the first micro-batch of every step (``pipeline_parallel/schedules.py``), so the workspace is
  allocated once, refreshed in place at each step's first micro-batch and reused by every later one;
  what backward saves is a reference to it. In training the weight quantizer asks for row-wise and
  column-wise usage (``module/linear.py``: ``columnwise_usage = is_grad_enabled and
  inp.requires_grad``).
* Recipe state (``module/base.py`` ``set_meta_tensor``): ``3 * num_gemms`` forward and
  ``2 * num_gemms`` backward quantizers per TE module; delayed scaling keeps an fp32 scale vector and
  an fp32 ``[amax_history_len, n]`` history per direction (``quantization.py``
  ``DelayedScalingRecipeState``), current scaling a one-element fp32 scale and amax per quantizer
  (``tensor/float8_tensor.py`` ``Float8CurrentScalingQuantizer.__init__``); block recipes keep none.
* Primary FP8/FP4 weights (``--fp8-param-gather`` / ``--fp4-param-gather``, ``fp8_model_init``): the
  weight *is* a quantized tensor; with the distributed optimizer its row-wise payload lives in a uint8
  DDP buffer (``distributed/param_and_grad_buffer.py``, ``modify_underlying_storage``), the
  column-wise copy and the scales stay in TE storage; no BF16 copy exists.
* Saved GEMM inputs (``module/linear.py``, ``module/layernorm_linear.py``): the input is quantized for
  the forward GEMM and only what the weight-gradient GEMM needs is kept: the column-wise data, except
  with sequence parallelism on a column-parallel layer under a recipe that cannot all-gather
  column-wise data (delayed / tensorwise: ``supports_only_rowwise_all_gather``), where the local
  row-wise shard is kept and gathered again in backward.

Storage layouts and scale shapes follow TE's ``make_empty`` / ``get_scale_shape`` in
``tensor/float8_tensor.py``, ``float8_blockwise_tensor.py``, ``mxfp8_tensor.py`` and
``nvfp4_tensor.py``. ``non_tn`` says whether the GPU runs FP8 GEMMs in non-TN layouts
(``utils.is_non_tn_fp8_gemm_supported``: compute capability 10.x-11.x and >= 13.0, i.e. Blackwell):
there a Float8 tensor serves both usages from one copy and keeps no transpose.

Pure functions over a frozen ``Fp8Spec`` built from Megatron's flat argument names; no torch. A
layer's GEMMs and a stage's terms are ``estimator/fp8_layers.py``'s; Megatron's FP8 rules are the
resolve section's (``resolve/fp8.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

# what ``Fp8Spec.recipe`` can be: the storage families below
RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4")

ALLOC_BLOCK = 512   # the CUDA caching allocator rounds every block up to 512 bytes (c10 CUDACachingAllocator kMinBlockSize)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _alloc(nbytes: int) -> int:
    """Bytes the caching allocator hands out for one tensor of ``nbytes``."""
    return _round_up(nbytes, ALLOC_BLOCK) if nbytes > 0 else 0


@dataclass(frozen=True)
class Fp8Spec:
    """The FP8 / FP4 settings that decide memory, under Megatron's ``args`` names and defaults
    (``megatron/training/arguments.py`` ``_add_mixed_precision_args``, core 0.16.1 and 0.19.2)."""

    fp8: str | None = None                    # --fp8-format: e4m3 | hybrid
    fp8_recipe: str = "delayed"               # --fp8-recipe
    fp4: str | None = None                    # --fp4-format: e2m1
    fp4_recipe: str = "nvfp4"                 # --fp4-recipe
    fp8_param_gather: bool = False            # --fp8-param-gather (TransformerConfig.fp8_param)
    fp4_param_gather: bool = False            # --fp4-param-gather (core 0.16.1: fp4_param)
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    fp8_amax_history_len: int = 1             # Megatron's default (TE's own DelayedScaling default is 1024)
    fp8_amax_compute_algo: str = "most_recent"
    fp8_margin: int = 0
    fp8_wgrad: bool = True
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    fp8_output_proj: bool = False             # core 0.19: the LM head in MXFP8
    # TransformerConfig fields without a command-line flag (Bridge / NeMo configs can set them)
    disable_parameter_transpose_cache: bool = False
    activation_func_fp8_input_store: bool = False
    fp8_dot_product_attention: bool = False

    # names Megatron (or its configs) also use for the same setting
    _ALIASES = {"fp8_param": "fp8_param_gather", "fp4_param": "fp4_param_gather", "fp8_format": "fp8",
                "fp4_format": "fp4"}

    @classmethod
    def from_flat(cls, args: Mapping[str, Any] | None = None, **kw: Any) -> "Fp8Spec":
        """A spec from flat Megatron argument names (a namespace dict, a Layout's fields, ...).
        Names that are not FP8 settings are ignored; ``None`` keeps the default."""
        merged = dict(args or {})
        merged.update(kw)
        names = {f.name for f in fields(cls)}
        out: dict[str, Any] = {}
        for key, value in merged.items():
            name = cls._ALIASES.get(key, key)
            if name in names and value is not None:
                out[name] = value
        for fmt in ("fp8", "fp4"):
            if out.get(fmt) in (False, "", "none", "None"):
                out[fmt] = None
        return cls(**out)

    @property
    def enabled(self) -> bool:
        return bool(self.fp8 or self.fp4)

    @property
    def recipe(self) -> str | None:
        """The storage family the GEMMs use: delayed | tensorwise | blockwise | mxfp8 | nvfp4, or None."""
        if self.fp4:
            return "nvfp4" if self.fp4_recipe == "nvfp4" else self.fp4_recipe
        if self.fp8:
            return self.fp8_recipe
        return None

    @property
    def primary_weights_quantized(self) -> bool:
        """Whether GEMM weights are created as quantized tensors (fp8_model_init)."""
        return bool((self.fp8 and self.fp8_param_gather) or (self.fp4 and self.fp4_param_gather))

    def layer_quantized(self, layer_no: int, num_layers: int) -> bool:
        """Whether global layer ``layer_no`` (0-based) runs its GEMMs quantized: ``fp8_utils.
        is_first_last_bf16_layer`` keeps the first ``num_layers_at_start_in_bf16`` and the last
        ``num_layers_at_end_in_bf16`` layers in BF16 with ``--first-last-layers-bf16``. The index is
        global, so only the first and last pipeline stages are affected. (FP4 uses the same check,
        ``fp4_utils.get_fp4_context``.)"""
        if not self.enabled:
            return False
        if not self.first_last_layers_bf16 or layer_no < 0:
            return True
        return not (layer_no < self.num_layers_at_start_in_bf16
                    or layer_no >= num_layers - self.num_layers_at_end_in_bf16)

    def quantized_layers(self, first_layer: int, count: int, num_layers: int) -> int:
        """How many of the ``count`` layers from global index ``first_layer`` run quantized."""
        return sum(self.layer_quantized(i, num_layers) for i in range(first_layer, first_layer + count))


# ----- storage of one quantized tensor -------------------------------------------------------------

@dataclass(frozen=True)
class Quantized:
    """The tensors TE allocates for one quantized [rows, cols] tensor (each its own allocation)."""

    data: tuple[int, ...]     # FP8 / FP4 payloads (row-wise, column-wise / transpose)
    scales: tuple[int, ...]   # scale-inverse tensors and per-tensor amaxes

    @property
    def total(self) -> int:
        return sum(self.data) + sum(self.scales)

    @property
    def allocated(self) -> int:
        """With the caching allocator's 512-byte rounding of each tensor."""
        return sum(_alloc(n) for n in self.data + self.scales)

    @property
    def scale_bytes(self) -> int:
        return sum(_alloc(n) for n in self.scales)

    @property
    def data_bytes(self) -> int:
        return sum(_alloc(n) for n in self.data)


def quantized_tensor(recipe: str, rows: int, cols: int, *, rowwise: bool, columnwise: bool,
                     non_tn: bool = False, block_2d: bool = False, compact: bool = False) -> Quantized:
    """Bytes of a [rows, cols] tensor quantized by ``recipe`` with the given usages.

    * delayed / tensorwise (``Float8Tensor``): 1-byte data [rows, cols]; the column-wise usage is an
      explicit transpose [cols, rows] unless ``non_tn`` (Blackwell), where the one copy serves both
      (``float8_tensor_storage.update_usage``); one fp32 scale-inverse.
    * blockwise (``Float8BlockwiseQTensor``): 1-byte data per usage; fp32 scales per 128x128 block
      (``block_2d``, weights: ``Float8BlockScaling.w_block_scaling_dim = 2``) or per 1x128 block
      (inputs, ``x_block_scaling_dim = 1``), padded as ``Float8BlockQuantizer.get_scale_shape``
      (GEMM-ready: inner dimension to a multiple of 4; ``compact``: the all-gather format, unpadded).
    * mxfp8 (``MXFP8Tensor``): 1-byte data per usage; one E8M0 byte per 32 elements per usage, padded to
      [round128(rows), round4(cols/32)] row-wise and [round4(rows/32), round128(cols)] column-wise.
    * nvfp4 (``NVFP4Tensor``): half-byte data per usage; one E4M3 byte per 16 elements, padded to
      [round128(rows), round4(cols/16)] row-wise and [round128(cols), round4(rows/16)] column-wise;
      one fp32 amax per usage.
    """
    data: list[int] = []
    scales: list[int] = []
    n = rows * cols
    if recipe in ("delayed", "tensorwise"):
        if non_tn:
            if rowwise or columnwise:
                data.append(n)
        else:
            if rowwise:
                data.append(n)
            if columnwise:
                data.append(n)
        if data:
            scales.append(4)
    elif recipe == "blockwise":
        def shape(columnwise_: bool) -> int:
            if block_2d:
                outer = math.ceil((cols if columnwise_ else rows) / 128)
                inner = _round_up(math.ceil((rows if columnwise_ else cols) / 128), 4)
            elif columnwise_:
                outer, inner = math.ceil(rows / 128), (cols if compact else _round_up(cols, 4))
            else:
                outer, inner = math.ceil(cols / 128), (rows if compact else _round_up(rows, 4))
            return outer * inner * 4
        if rowwise:
            data.append(n)
            scales.append(shape(False))
        if columnwise:
            data.append(n)
            scales.append(shape(True))
    elif recipe == "mxfp8":
        if rowwise:
            data.append(n)
            scales.append(_round_up(rows, 128) * _round_up(cols // 32, 4))
        if columnwise:
            data.append(n)
            scales.append(_round_up(rows // 32, 4) * _round_up(cols, 128))
    elif recipe == "nvfp4":
        if rowwise:
            data.append(n // 2)
            scales += [_round_up(rows, 128) * _round_up(math.ceil(cols / 16), 4), 4]
        if columnwise:
            data.append(n // 2)
            scales += [_round_up(cols, 128) * _round_up(math.ceil(rows / 16), 4), 4]
    else:
        raise ValueError(f"unknown quantization recipe {recipe!r}")
    return Quantized(data=tuple(data), scales=tuple(scales))


def element_bytes(recipe: str) -> float:
    """Nominal bytes per quantized element of one usage, scales included (for display and
    back-of-envelope sums): delayed / tensorwise 1, blockwise 1 + 4/128, mxfp8 1 + 1/32, nvfp4 1/2 + 1/16."""
    return {"delayed": 1.0, "tensorwise": 1.0, "blockwise": 1 + 4 / 128, "mxfp8": 1 + 1 / 32,
            "nvfp4": 0.5 + 1 / 16}[recipe]


# ----- weights ------------------------------------------------------------------------------------

def weight_workspace(spec: Fp8Spec, rows: int, cols: int, *, non_tn: bool = False) -> Quantized:
    """The cached quantized copy TE keeps of one BF16 GEMM weight [rows, cols] (training: row-wise and
    column-wise usage). Empty when the weights are already quantized (primary FP8/FP4 weights: the
    parameter is used as it is, ``get_weight_workspace`` returns it) or when nothing is cached
    (``disable_parameter_transpose_cache``: a fresh copy per micro-batch, see
    ``uncached_weight_copies``)."""
    r = spec.recipe
    if r is None or spec.primary_weights_quantized or spec.disable_parameter_transpose_cache:
        return Quantized((), ())
    return quantized_tensor(r, rows, cols, rowwise=True, columnwise=True, non_tn=non_tn,
                            block_2d=r == "blockwise")


def uncached_weight_copies(spec: Fp8Spec, rows: int, cols: int, *, non_tn: bool = False) -> Quantized:
    """With ``disable_parameter_transpose_cache`` (TransformerConfig only) every forward quantizes the
    weight anew (``cache_name=None``) and saves that copy for backward: one per layer per micro-batch
    in flight. (Row-wise and column-wise usage as the cached workspace.)"""
    r = spec.recipe
    if r is None or spec.primary_weights_quantized or not spec.disable_parameter_transpose_cache:
        return Quantized((), ())
    return quantized_tensor(r, rows, cols, rowwise=True, columnwise=True, non_tn=non_tn,
                            block_2d=r == "blockwise")


@dataclass(frozen=True)
class PrimaryWeight:
    """Bytes of one GEMM weight created quantized (``--fp8-param-gather`` / ``--fp4-param-gather``)."""

    buffer: int      # in the DDP parameter buffer (uint8; the payload TE's row-wise data points at)
    te_storage: int  # kept by TE outside the buffer: column-wise data / transpose and the scales

    @property
    def total(self) -> int:
        return self.buffer + self.te_storage


def primary_weight(spec: Fp8Spec, rows: int, cols: int, *, non_tn: bool = False,
                   distributed_optimizer: bool = True) -> PrimaryWeight:
    """Primary quantized weight [rows, cols].

    ``fp8_model_init`` makes the weight a quantized tensor with row-wise and column-wise usage in
    training (TE ``module/base.py`` ``reset_parameters``). With the distributed optimizer,
    ``_ParamAndGradBuffer`` gives it a uint8 parameter buffer and ``modify_underlying_storage`` points
    the row-wise data at it (1 byte / element for FP8, the packed half byte for NVFP4), so the buffer
    holds the row-wise payload; the transpose (Hopper Float8), column-wise copy (blockwise, mxfp8,
    nvfp4) and scales stay TE storage. MXFP8 params get no parameter buffer of their own: the DDP grad
    buffer is shared as their all-gather buffer (``shared_buffer``; core 0.16.1 and 0.19), so their
    whole TE storage counts here and ``buffer`` is 0. Without the distributed optimizer (FSDP, or
    inference) the whole TE storage is reported as ``te_storage``."""
    r = spec.recipe
    if r is None or not spec.primary_weights_quantized:
        return PrimaryWeight(0, 0)
    q = quantized_tensor(r, rows, cols, rowwise=True, columnwise=True, non_tn=non_tn,
                         block_2d=r == "blockwise")
    if not distributed_optimizer or r == "mxfp8":
        return PrimaryWeight(0, q.allocated)
    rowwise_payload = rows * cols // (2 if r == "nvfp4" else 1)
    return PrimaryWeight(rowwise_payload, q.allocated - _alloc(rowwise_payload))


def param_buffer_bytes_per_element(spec: Fp8Spec) -> float:
    """Bytes per element of the DDP parameter buffer (distributed optimizer) for quantized GEMM
    weights: uint8 for FP8 (1), packed for NVFP4 (1/2), none for MXFP8 (shared with the grad buffer)."""
    r = spec.recipe
    if r is None or not spec.primary_weights_quantized:
        raise ValueError("parameters are not quantized")
    return {"mxfp8": 0.0, "nvfp4": 0.5}.get(r, 1.0)


def recipe_state_bytes(spec: Fp8Spec, num_gemms: int = 1, *, forward: int = 3, backward: int = 2) -> int:
    """Scales and amax histories one TE module keeps (``set_meta_tensor``, forward and backward), with
    the allocator's rounding of each tensor.

    delayed: per direction an fp32 scale vector [n] and an fp32 amax history [len, n], n = 3 * num_gemms
    forward, 2 * num_gemms backward (``DelayedScalingRecipeState``); tensorwise: one fp32 scale and one
    fp32 amax per quantizer (``Float8CurrentScalingQuantizer``), 5 * num_gemms quantizers; blockwise,
    mxfp8 and nvfp4 quantizers hold no tensors (``Float8BlockQuantizer``, ``MXFP8Quantizer``,
    ``NVFP4Quantizer``; the NVFP4 Hadamard matrix is one shared 16x16 tensor). ``forward`` / ``backward``:
    quantizers per GEMM (a TE module's 3 and 2; the op fuser's ``BasicLinear`` has 2 and 1)."""
    r = spec.recipe
    if r == "delayed":
        total = 0
        for n in (forward * num_gemms, backward * num_gemms):
            total += _alloc(4 * n) + _alloc(4 * n * spec.fp8_amax_history_len)
        return total
    if r == "tensorwise":
        return (forward + backward) * num_gemms * 2 * _alloc(4)
    return 0


# ----- activations ----------------------------------------------------------------------------------

def saved_input(spec: Fp8Spec, tokens: int, width: int, *, sp_gathered: bool = False,
                non_tn: bool = False) -> Quantized:
    """What a quantized GEMM keeps of its [tokens, width] input for the weight-gradient GEMM.

    ``sp_gathered``: the layer all-gathers its input over TP first (column-parallel with sequence
    parallelism; ``tokens`` is then the local shard). The kept tensor is the local shard's
    column-wise data, except for delayed / tensorwise with ``sp_gathered``, which keep the row-wise
    data (FP8 column-wise data cannot be all-gathered: ``supports_only_rowwise_all_gather``) and
    gather it again in backward (``layernorm_linear.py`` / ``linear.py``, "Cache state for backward
    pass"). Blockwise inputs use 1x128 scales, in the compact all-gather format when gathered
    (``_customize_quantizers_float8_blockwise_scaling``)."""
    r = spec.recipe
    if r is None:
        raise ValueError("FP8 / FP4 is off")
    if r in ("delayed", "tensorwise") and sp_gathered:
        return quantized_tensor(r, tokens, width, rowwise=True, columnwise=False, non_tn=non_tn)
    return quantized_tensor(r, tokens, width, rowwise=False, columnwise=True, non_tn=non_tn,
                            compact=r == "blockwise" and sp_gathered)


def activation_input_bytes(spec: Fp8Spec, tokens: int, width: int, act_bytes: int) -> int:
    """The activation function's saved input (fc1's output, [tokens, width]):
    ``activation_func_fp8_input_store`` keeps it as one byte per element (SwiGLU only, megatron
    ``fused_bias_swiglu``'s fp8 input store); otherwise in the activation dtype."""
    if spec.enabled and spec.activation_func_fp8_input_store:
        return tokens * width
    return tokens * width * act_bytes


def moe_align_size(spec: Fp8Spec) -> int:
    """Tokens per expert are padded to this multiple for quantized grouped GEMMs
    (``moe_utils.get_align_size_for_quantization``): 16 for FP8, 32 for mxfp8
    (``fp8_utils.get_fp8_align_size``), 128 for NVFP4 (``fp4_utils.get_fp4_align_size``)."""
    r = spec.recipe
    if r is None:
        return 0
    if r == "nvfp4":
        return 128
    return 32 if r == "mxfp8" else 16


def grouped_saved_input(spec: Fp8Spec, tokens: int, width: int, experts: int, *, non_tn: bool = False) -> int:
    """What a grouped linear (``TEGroupedLinear``, ``module/grouped_linear.py``) keeps of its input for
    ``tokens`` routed tokens spread evenly over ``experts`` local experts: ``tex.split_quantize`` makes
    one quantized tensor per expert, each padded to ``moe_align_size`` tokens, and keeps its
    column-wise data (``update_usage(rowwise_usage=False, columnwise_usage=True)``)."""
    if experts <= 0 or tokens <= 0:
        return 0
    align = moe_align_size(spec) or 1
    per = -(-tokens // experts)
    per = _round_up(per, align)
    return experts * saved_input(spec, per, width, non_tn=non_tn).allocated


def non_tn_gpu(name: str) -> bool:
    """Whether a GPU of the table runs FP8 GEMMs in non-TN layouts (Blackwell: compute capability
    10.x; TE ``is_non_tn_fp8_gemm_supported``), so Float8 tensors keep no transpose."""
    n = name.upper()
    return n.startswith(("B200", "GB200", "B300", "GB300", "B100"))


# compute capability of the GPUs in memguard's table (NVIDIA datasheets)
_CAPABILITY = {"A100": (8, 0), "H100": (9, 0), "H200": (9, 0), "B200": (10, 0), "GB200": (10, 0)}


def gpu_violation(spec: Fp8Spec, gpu_name: str) -> str | None:
    """Transformer Engine's hardware checks (``quantization.py`` ``check_fp8_support``,
    ``check_mxfp8_support``, ``check_nvfp4_support``): FP8 needs compute capability 8.9 or higher,
    MXFP8 and NVFP4 need 10.x (Blackwell). GPUs outside the table are not checked."""
    r = spec.recipe
    if r is None:
        return None
    cc = next((v for k, v in _CAPABILITY.items() if gpu_name.upper().startswith(k)), None)
    if cc is None:
        return None
    if cc < (8, 9):
        return f"{gpu_name} cannot run FP8 / FP4 (Transformer Engine needs compute capability 8.9 or higher)"
    if r in ("mxfp8", "nvfp4") and not (10, 0) <= cc < (12, 0):
        return f"{gpu_name} cannot run the {r} recipe (Transformer Engine needs compute capability 10.x, Blackwell)"
    return None
