"""Which kernels run: the transformer implementation, attention backend, fusions and runtime switches."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kernels:
    gradient_accumulation_fusion: bool
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
    cuda_graph_impl: str = "none"   # none | local | transformer_engine | full_iteration
    cuda_graph_modules: tuple[str, ...] = ()   # empty: the whole layer
    # --tp-comm-overlap-cfg's size-deciding settings, "gemm.key=value" (resolve/tp_overlap.py); () = TE's defaults
    tp_comm_overlap_cfg: tuple[str, ...] = ()
    symmetric_ar_type: str | None = None   # --symmetric-ar-type: TE's symmetric-memory all-reduce
    # --use-transformer-engine-op-fuser with the TE spec: TEFusedMLP for a dense model's MLPs, TE's
    # fused grouped MLP for the experts (megatron-core 0.19.2); resolved False where the spec ignores it
    use_transformer_engine_op_fuser: bool = False
    # --use-grouped-gemm-for-dense-mlp with the op fuser at TP 1: a dense model's MLP is TEFusedMLPWithGroupedLinear,
    # GroupedLinear(1) ops under the CuTe-DSL fused grouped MLP kernel in MXFP8 (megatron-core 0.19.2, TE 2.20.2)
    grouped_dense_mlp: bool = False
    # --softmax-type (vanilla | off-by-one | learnable): flash-attn has only the vanilla softmax, so it
    # decides which kernel TE's auto backend runs (estimator/attention_backend.py)
    softmax_type: str = "vanilla"
    # --flash-attention-version (core 0.19.2): the one flash-attn generation TE may use (language_module.py
    # sets NVTE_FLASH_ATTN_V<other>=0); None: any
    flash_attention_version: int | None = None

    @property
    def fused_wgrad(self) -> bool:
        """Weight gradients accumulated straight into main_grad (gradient_accumulation_fusion); with
        --no-gradient-accumulation-fusion (as the CPU referee runs) each one is materialised first."""
        return self.gradient_accumulation_fusion
