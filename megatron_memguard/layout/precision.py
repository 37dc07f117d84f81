"""Which dtype each kind of tensor is kept in.

One place answers "how many bytes per element" for every tensor kind the estimator counts, from
Megatron's precision flags (``--bf16``/``--fp16``, ``--accumulate-allreduce-grads-in-fp32``, the
precision-aware optimizer's ``--main-*-dtype``/``--exp-avg*-dtype``), and with ``--fp8-format`` /
``--fp4-format`` the GEMM inputs kept for backward and the GEMM weights (``GEMM_INPUT``,
``GEMM_WEIGHT``: fp8 or fp4). Their exact bytes, scales and padding included, are
``megatron_memguard.estimator.fp8``'s (``Precision.fp8_spec``).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


class TensorKind(str, Enum):
    PARAM = "param"              # model weights (and TE's placeholder weight gradients, same dtype)
    ACTIVATION = "activation"    # activations: the autocast dtype when set, else the params'
    GRAD_REDUCE = "grad_reduce"  # gradients as DDP accumulates and reduces them (--accumulate-allreduce-grads-in-fp32)
    MAIN_GRAD = "main_grad"      # DDP's gradient buffer (param.main_grad) as allocated
    MAIN_PARAM = "main_param"    # the optimizer's master weights
    EXP_AVG = "exp_avg"          # Adam's first moment
    EXP_AVG_SQ = "exp_avg_sq"    # Adam's second moment
    MOMENTUM = "momentum"        # SGD's momentum buffer (torch.optim.SGD on the fp32 master weights)
    GEMM_INPUT = "gemm_input"    # what an FP8 / FP4 layer's GEMM keeps of its input for backward
    GEMM_WEIGHT = "gemm_weight"  # a GEMM weight as the GEMM reads it (cached copy or primary FP8 / FP4 weight)

    __str__ = str.__str__
    __format__ = str.__format__


@dataclass(frozen=True)
class Precision:
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
    # The optimizer-state dtypes apply only with the precision-aware optimizer (TE FusedAdam), so the
    # switch lives with them (megatron-core keeps both in OptimizerConfig).
    use_precision_aware_optimizer: bool
    main_grads_dtype: str
    main_params_dtype: str
    exp_avg_dtype: str
    exp_avg_sq_dtype: str
    # FP8 / FP4 (Megatron's names and defaults; estimator/fp8.py sizes them)
    fp8: str | None = None                  # --fp8-format: e4m3 | hybrid
    fp8_recipe: str = "delayed"
    fp4: str | None = None                  # --fp4-format: e2m1
    fp4_recipe: str = "nvfp4"
    fp8_param_gather: bool = False
    fp4_param_gather: bool = False
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    disable_parameter_transpose_cache: bool = False   # TransformerConfig only
    activation_func_fp8_input_store: bool = False     # TransformerConfig only
    fp8_output_proj: bool = False                     # --fp8-output-proj (core 0.19): the LM head in MXFP8
    fp8_dot_product_attention: bool = False           # TransformerConfig only: FP8 fused attention (delayed/tensorwise/mxfp8)
    # set by estimate() from the GPU it is given, never read from a config: the GPU's name as data for what the layers
    # keep that depends on it (estimator/fp8_layers.py: Blackwell's one Float8 copy for both usages, the experts'
    # GroupedLinear path under the op fuser)
    fp8_gpu: str | None = None

    @property
    def fp8_spec(self):
        """The FP8 / FP4 settings as ``estimator.fp8.Fp8Spec`` (built once)."""
        spec = self.__dict__.get("_fp8_spec_")
        if spec is None:
            from ..estimator.fp8 import Fp8Spec
            spec = self.__dict__["_fp8_spec_"] = Fp8Spec.from_flat(
                {n: getattr(self, n) for n in Fp8Spec.__dataclass_fields__ if hasattr(self, n)})
        return spec

    def dtype_of(self, kind: TensorKind) -> str:
        return (self.__dict__.get("_tables_") or self._tables())[0][kind]

    def bytes_of(self, kind: TensorKind) -> int:
        # (the tables read straight from the instance once made: one call per lookup, the estimator asks often)
        return (self.__dict__.get("_tables_") or self._tables())[1][kind]

    def byte_sizes(self) -> dict[TensorKind, int]:
        """bytes_of of every kind with whole bytes per element, as one read-only table (callers that ask for
        several kinds look them up there)."""
        return (self.__dict__.get("_tables_") or self._tables())[1]

    def _tables(self) -> tuple[dict[TensorKind, str], dict[TensorKind, int]]:
        # Every kind's dtype, worked out once per (frozen) Precision: the estimator asks per stage.
        t = self.__dict__.get("_tables_")
        if t is None:
            grad_reduce = "fp32" if self.accumulate_allreduce_grads_in_fp32 else self.params_dtype
            dtypes = {
                TensorKind.PARAM: self.params_dtype,
                TensorKind.ACTIVATION: self.autocast_dtype or self.params_dtype,
                TensorKind.GRAD_REDUCE: grad_reduce,
                # --main-grads-dtype bf16 (precision-aware optimizer) allocates the buffer in bf16
                TensorKind.MAIN_GRAD: ("bf16" if self.use_precision_aware_optimizer and self.main_grads_dtype == "bf16"
                                       else grad_reduce),
                TensorKind.MAIN_PARAM: self.main_params_dtype if self.use_precision_aware_optimizer else "fp32",
                TensorKind.EXP_AVG: self.exp_avg_dtype,
                TensorKind.EXP_AVG_SQ: self.exp_avg_sq_dtype,
                TensorKind.MOMENTUM: "fp32",
                # FP4 has no whole byte per element: bytes_of refuses it (estimator.fp8 has the exact bytes)
                TensorKind.GEMM_INPUT: "fp4" if self.fp4 else "fp8" if self.fp8 else self.autocast_dtype or self.params_dtype,
                TensorKind.GEMM_WEIGHT: "fp4" if self.fp4 else "fp8" if self.fp8 else self.params_dtype,
            }
            t = self.__dict__["_tables_"] = (dtypes, {k: DTYPE_BYTES[v] for k, v in dtypes.items() if v in DTYPE_BYTES})
        return t
