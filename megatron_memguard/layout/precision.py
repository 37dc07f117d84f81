"""Which dtype each kind of tensor is kept in.

One place answers "how many bytes per element" for every tensor kind the estimator counts, from
Megatron's precision flags (``--bf16``/``--fp16``, ``--accumulate-allreduce-grads-in-fp32``, the
precision-aware optimizer's ``--main-*-dtype``/``--exp-avg*-dtype``). FP8 will map some kinds
(GEMM inputs, cached weight copies) to 1 byte here, as new ``TensorKind`` members.
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

    def dtype_of(self, kind: TensorKind) -> str:
        return self._tables()[0][kind]

    def bytes_of(self, kind: TensorKind) -> int:
        return self._tables()[1][kind]

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
            }
            t = self.__dict__["_tables_"] = (dtypes, {k: DTYPE_BYTES[v] for k, v in dtypes.items()})
        return t
