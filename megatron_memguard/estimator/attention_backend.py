"""Which core-attention kernel Transformer Engine runs for ``--attention-backend auto`` on a given GPU.

Megatron's ``auto`` leaves the choice to TE (megatron-core 0.16.1 / 0.19.2 language_module.py
``_set_attention_backend`` sets NVTE_FLASH_ATTN, NVTE_FUSED_ATTN and NVTE_UNFUSED_ATTN to 1 and asserts
that no one set them otherwise). TE's ``get_attention_backend`` (TE 2.11 and 2.20.2,
``pytorch/attention/dot_product_attention/utils.py``) filters the three backends, then, when
FlashAttention and cuDNN FusedAttention can both run, drops flash on compute capability >= 9.0
("give FusedAttention preference on Hopper+"): an A100 (sm80) runs flash-attn 2, Hopper and Blackwell
run cuDNN. The filters that leave only one of them for a self-attention GPT layer in training:

* flash-attn 2 needs bf16/fp16 q/k/v, a head dim that is a multiple of 8 and at most 256, equal q/k
  and v head dims (not MLA), the vanilla softmax (not ``--softmax-type off-by-one / learnable``) and
  no FP8 attention; flash-attn 3 runs only on sm90 and flash-attn 4 (TE 2.20.2) not below sm90, where
  cuDNN is preferred anyway, so ``--flash-attention-version 3 / 4`` (core 0.19.2, which switches the
  other generations off through NVTE_FLASH_ATTN_V2/3/4=0) leaves an A100 with cuDNN;
* TE 2.11 switches cuDNN off for deterministic training (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, as Megatron's
  CI runs, or --deterministic-mode) on compute capability >= 10.0, which leaves flash-attn 2 on Blackwell;
  below 9.0 it does so too, but flash is chosen there anyway. TE 2.12+ passes ``deterministic`` to its C++
  query ``nvte_get_fused_attn_backend`` (common/fused_attn/fused_attn.cpp), which on sm100/sm103/sm110/sm120
  in deterministic training returns No_Backend when attention dropout is on, and also, without dropout,
  under cuDNN < 9.18.1 (the compiled query of TE 2.12.0 and 2.14.1 run on a CPU with stubbed CUDA; TE 2.20.2
  asks cuDNN-frontend, whose check reads "Deterministic algorithm is not supported on blackwell
  architecture when dbias, rng/dropout, alibi is enabled" / "... with cudnn version below 9.18.0"). So
  with attention dropout, Blackwell deterministic training runs flash-attn 2 in every TE; without it
  memguard assumes a cuDNN >= 9.18.1 (cuDNN fused).
Sliding windows, attention dropout, GQA, causal masks and context parallelism (p2p, causal) keep both.

Where neither runs, TE falls back to ``UnfusedDotProductAttention`` (its s x s scores and probs, the terms of
``--attention-backend unfused``); CP then has no backend at all (TE disables the unfused one under context
parallelism, 2.11 and 2.20.2 utils.py), which memguard refuses. That happens, in training, for:

* fp32 q/k/v (no --bf16 / --fp16): "Filter: Data type" drops flash-attn 2/3/4 and FusedAttention for any dtype
  but bf16/fp16 (FP8 for cuDNN), TE 2.11 and 2.20.2 ``utils.py``, on every GPU;
* a head dim that is not a multiple of 8 or above 256 (not MLA): flash-attn 2 by the python filter, cuDNN by the
  compiled query (``nvte_get_fused_attn_backend`` of the transformer_engine_cu12 2.11.0 wheel, called on a CPU
  with a stubbed CUDA runtime: No_Backend for head dims 100, 264, 320 on sm80, sm90 and sm100, cuDNN 9.8 to 9.14;
  TE 2.20.2 asks cuDNN's frontend, assumed to keep the same limits);
* MLA on an A100 under TE 2.11 (megatron-core 0.16): flash-attn 2 needs equal q/k and v head dims there, and the
  same compiled query has no sm80 training backend once either head dim exceeds 128 (192/128 and 136/128:
  No_Backend; 96/64: F16_arbitrary_seqlen). TE 2.20.2 lets flash-attn 2 take MLA (it pads to the larger head
  dim), which memguard does not model: 0.19 keeps the cuDNN estimate there.

memguard assumes flash-attn 2 is installed, as in NVIDIA's NGC PyTorch containers (without it TE would
run cuDNN on an A100, or its unfused attention under determinism). Megatron-core 0.16 pins TE < 2.12
(its ``dev`` extra); later releases are read with TE 2.20.2.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..gpus import GpuSpec
from ..layout import Layout


@dataclass(frozen=True)
class AttentionBackend:
    """The backend asked for, the kernel whose tensors are modelled, and why."""
    requested: str          # --attention-backend (auto | flash | fused | unfused | local)
    selected: str           # flash | fused | unfused | local: what the attention terms model
    why: str

    def to_dict(self) -> dict[str, str]:
        return {"requested": self.requested, "selected": self.selected, "why": self.why}

    def modelled_layout(self, L: Layout) -> Layout:
        """``L`` with ``--attention-backend auto`` replaced by the kernel TE runs for it when that is flash-attn or
        its unfused attention, whose terms differ (layers/attention.py); otherwise ``L`` itself (auto's terms are
        cuDNN fused attention's)."""
        if self.selected in ("flash", "unfused") and L.attention_backend == "auto":
            return L.replace(attention_backend=self.selected)
        return L


def _te_211(L: Layout) -> bool:
    """megatron-core before 0.17 runs TE up to 2.11 (its pin); later releases TE 2.20.2."""
    from packaging.version import Version
    return Version(L.megatron_version) < Version("0.17")


def _deterministic(L: Layout) -> bool:
    """TE's DotProductAttention.deterministic: NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (Megatron's
    --deterministic-mode requires it; torch's deterministic algorithms are switched on by that flag too)."""
    env = dict(L.env)
    return L.deterministic_mode or str(env.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")).strip() == "0"


def _no_flash(L: Layout) -> str | None:
    """Why flash-attn 2 cannot run this layer's attention (TE 2.11 get_attention_backend's filters), or None."""
    d = L.kv_channels
    if L.fp8_spec.fp8_dot_product_attention:
        return "FP8 attention runs only in cuDNN"
    if L.multi_latent_attention:
        return "flash-attn 2 needs equal q/k and v head dims (MLA)"
    if L.softmax_type != "vanilla":
        return f"flash-attn has no {L.softmax_type} softmax"
    if d % 8 or d > 256:
        return f"flash-attn 2 needs a head dim that is a multiple of 8 and <= 256 (kv_channels {d})"
    if L.flash_attention_version not in (None, 2):
        # TE 2.20.2: flash-attn 3 runs only on sm90, flash-attn 4 not below sm90
        return f"--flash-attention-version {L.flash_attention_version} leaves no flash-attn for sm8x"
    return None


def _no_kernel(L: Layout, cc: tuple[int, int] | None) -> str | None:
    """Why neither flash-attn nor cuDNN fused attention can run this layer's attention in training, so that
    Transformer Engine runs UnfusedDotProductAttention (module docstring), or None. ``cc``: compute capability
    (None: unknown GPU; the dtype and head-dim rules hold on every NVIDIA GPU)."""
    if L.act_bytes == 4:
        # "Filter: Data type" (TE 2.11 / 2.20.2 utils.py): flash-attn and FusedAttention take bf16/fp16 only
        return "flash-attn and cuDNN take only bf16/fp16 q/k/v, these are fp32"
    if L.multi_latent_attention:
        qk, v = L.qk_head_dim + L.qk_pos_emb_head_dim, L.v_head_dim
        if cc is not None and cc[0] == 8 and _te_211(L) and (qk > 128 or v > 128):
            # TE 2.11: flash-attn 2 only for equal head dims; compiled cuDNN query: no sm80 backend above 128
            return (f"on sm8x flash-attn 2 needs equal q/k and v head dims and cuDNN has no training kernel for "
                    f"head dims above 128 (MLA {qk}/{v}, Transformer Engine 2.11)")
        return None
    d = L.kv_channels
    if d % 8 or d > 256:
        # flash-attn 2: python filter; cuDNN: the compiled query returns No_Backend on sm80, sm90 and sm100
        return f"flash-attn 2 and cuDNN need a head dim that is a multiple of 8 and <= 256 (kv_channels {d})"
    return None


def select(L: Layout, gpu: GpuSpec | None) -> AttentionBackend:
    """The core-attention kernel modelled for ``L`` on ``gpu`` (None: unknown GPU)."""
    asked = L.attention_backend
    if L.transformer_impl == "local" or asked == "local":
        return AttentionBackend(asked, "local", "megatron-core's own DotProductAttention (local spec or "
                                "--attention-backend local)")
    if asked != "auto":
        return AttentionBackend(asked, asked, f"--attention-backend {asked}")
    cc = gpu.compute_capability if gpu is not None else None
    neither = _no_kernel(L, cc)
    if neither:
        return AttentionBackend(asked, "unfused", f"auto: Transformer Engine's unfused attention ({neither})")
    if cc is None:
        where = f"{gpu.name} is not a CUDA GPU memguard knows the compute capability of" if gpu is not None \
            else "the GPU is unknown"
        return AttentionBackend(asked, "fused", f"auto: {where}; modelled as cuDNN fused attention, what Transformer "
                                "Engine picks on Hopper and Blackwell (on an A100 it runs flash-attn: give --gpu)")
    sm = f"sm{cc[0]}{cc[1]}"
    blocked = _no_flash(L)
    if blocked:
        return AttentionBackend(asked, "fused", f"auto on {sm}: cuDNN fused attention ({blocked})")
    if cc < (9, 0):
        return AttentionBackend(asked, "flash", f"auto on {sm}: flash-attn 2 (Transformer Engine prefers "
                                "FlashAttention below sm90 when flash and cuDNN both run)")
    if cc >= (10, 0) and _deterministic(L) and _te_211(L):
        return AttentionBackend(asked, "flash", f"auto on {sm}: flash-attn 2 (Transformer Engine 2.11 switches cuDNN "
                                "fused attention off for deterministic training on Blackwell: "
                                "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0)")
    if cc >= (10, 0) and _deterministic(L) and L.attention_dropout > 0:
        return AttentionBackend(asked, "flash", f"auto on {sm}: flash-attn 2 (cuDNN has no deterministic Blackwell "
                                f"backward with attention dropout {L.attention_dropout:g}: Transformer Engine 2.12+ "
                                "gets no fused backend for NVTE_ALLOW_NONDETERMINISTIC_ALGO=0)")
    return AttentionBackend(asked, "fused", f"auto on {sm}: cuDNN fused attention (Transformer Engine prefers it "
                            "over flash-attn on Hopper and later)")
