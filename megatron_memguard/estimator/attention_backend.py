"""Which core-attention kernel Transformer Engine runs for ``--attention-backend auto`` on a given GPU.

Megatron's ``auto`` leaves the choice to TE (megatron-core 0.16.1 / 0.19.2 language_module.py
``_set_attention_backend`` sets NVTE_FLASH_ATTN, NVTE_FUSED_ATTN and NVTE_UNFUSED_ATTN to 1 and asserts
that no one set them otherwise). TE's ``get_attention_backend`` (TE 2.11 and 2.20.2,
``pytorch/attention/dot_product_attention/utils.py``) filters the three backends, then, when
FlashAttention and cuDNN FusedAttention can both run, drops flash on compute capability >= 9.0
("give FusedAttention preference on Hopper+"): an A100 (sm80) runs flash-attn 2, Hopper and Blackwell
run cuDNN where cuDNN has a kernel. This module models those filters for a self-attention GPT layer in training.

flash-attn 2 (``_flash_blocked``) needs bf16/fp16 q/k/v, a head dim that is a multiple of 8 and at most 256 (above 192
only on sm80 / sm90 / sm100 / sm120), the vanilla softmax and no FP8 attention. MLA (different q/k and v head dims):
TE 2.11 drops flash-attn 2; TE 2.20.2 pads the smaller head dim to the larger one (``dot_product_attention.py``
``_pad_qkv_head_dim``) and applies the head-dim rule to the padded one. flash-attn 3 runs only on sm90 and
flash-attn 4 (TE 2.20.2) not below sm90, where cuDNN is preferred anyway, so ``--flash-attention-version 3 / 4``
(core 0.19.2, which switches the other generations off through NVTE_FLASH_ATTN_V2/3/4=0) leaves an A100 with cuDNN.

cuDNN fused attention (``_cudnn_blocked``) has a training kernel for the head dims its C++ query
``nvte_get_fused_attn_backend`` accepts, read by calling the compiled query of the transformer_engine_cu12 wheels on a
CPU with a stubbed CUDA runtime and cuDNN (bf16, sbhd, causal, 32 heads / 8 groups, s 4096, training;
benchmarks/te_attention_query.py, table in benchmarks/results/te-attention-query.md):

* TE 2.11.0 (its own C++ table), cuDNN 9.11 to 9.23: F16_arbitrary_seqlen for head dims up to 128 (multiples of 8)
  on sm80, sm90, sm100 and sm103, up to 256 on sm90, and MLA 192/128 on sm90, sm100 and sm103; No_Backend for equal
  head dims 136 to 256 on sm80, sm100 and sm103, for 264 and 320 everywhere, for MLA 192/128 on sm80, and on sm90 for
  MLA whose head dims are both 128 or more, 192/128 aside (136/128, 160/128, 256/128, 192/160, 128/192: No_Backend from
  cuDNN 9.11, F16_arbitrary_seqlen under 9.10; 192/96, 160/96, 256/96: F16_arbitrary_seqlen);
* TE 2.20.2 (``nvte_get_fused_attn_backend_v2``, which builds the cuDNN-frontend graphs; the reject messages are
  cuDNN-frontend's ``scaled_dot_product_flash_attention.h`` backward checks), cuDNN 9.18.1 to 9.26: the same, except
  that sm90 takes every MLA pair up to 256, and that on sm100 / sm103 equal head dims in (256, 512] pass the checks
  ("unless both head dims are in (256, 512]") but no cuDNN plan serves them (only cuDNN-frontend's opt-in SM100
  engine, ``override_heuristics_query`` in the frontend's ``scaled_dot_product_flash_attention.h``: the heuristics
  return no configuration, so the query gets No_Backend; the stub cuDNN hands out one), and 256/256 gets past the
  check from cuDNN 9.23 ("Num hidden_dim should be less than or equal to 128 ... when d_qk != d_v" below 9.23).
  memguard takes cuDNN 9.18.1 (the deterministic rule below) to 9.22 here, so head dim 256 on Blackwell is modelled
  as flash-attn 2; with cuDNN 9.23+ TE 2.20.2 runs cuDNN there, an estimate a few tenths of a percent apart.

So on B200 / GB200 (sm100) equal head dims 136 to 256 run flash-attn 2 in both TE releases (cuDNN has no backward
kernel there), and MLA whose head dims cuDNN cannot train (not 192/128 nor both <= 128) runs flash-attn 2 with padded
tensors under TE 2.20.2 and TE's unfused attention under TE 2.11. MLA on an A100 under TE 2.20.2 (megatron-core >= 0.17)
runs flash-attn 2 with padded tensors for any head dims up to 256 (TE prefers flash below sm90); under TE 2.11 it runs
cuDNN for head dims up to 128 and TE's unfused attention above.

Deterministic training (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, as Megatron's CI runs, or --deterministic-mode) switches
cuDNN off below sm90 (F16_arbitrary_seqlen is non-deterministic there, TE 2.11 and 2.20.2) and on Blackwell in TE 2.11
("Disabling FusedAttention for determinism reasons on Blackwell"). TE 2.12+ passes ``deterministic`` to its C++ query,
which on sm100/sm103/sm110/sm120 returns No_Backend when attention dropout is on, and also, without dropout, under
cuDNN < 9.18.1 (TE 2.12.0 / 2.14.1 compiled query; TE 2.20.2's cuDNN-frontend check: "Deterministic algorithm is not
supported on blackwell architecture when dbias, rng/dropout, alibi is enabled" / "... with cudnn version below
9.18.0", also read from the 2.20.2 query). TE 2.20.2 also switches cuDNN off under determinism for a non-vanilla
softmax. Sliding windows, GQA, causal masks and context parallelism (p2p, causal) keep both kernels.

Where neither runs, TE falls back to ``UnfusedDotProductAttention`` (its s x s scores and probs, the terms of
``--attention-backend unfused``); CP then has no backend at all (TE disables the unfused one under context
parallelism, 2.11 and 2.20.2 utils.py), which memguard refuses. fp32 q/k/v (no --bf16 / --fp16) always land there:
"Filter: Data type" drops flash-attn 2/3/4 and FusedAttention for any dtype but bf16/fp16 (FP8 for cuDNN).

FP8 attention (``--fp8-dot-product-attention``) runs only in cuDNN; its head-dim and determinism rules are
resolve/fp8.py's. memguard assumes flash-attn 2 is installed, as in NVIDIA's NGC PyTorch containers (without it TE
would run cuDNN on an A100, or its unfused attention under determinism), and not flash-attn 4 (TE 2.20.2 would also
weigh it on sm100). Megatron-core 0.16 pins TE < 2.12 (its ``dev`` extra); later releases are read with TE 2.20.2,
unless the run names its TE (``MEMGUARD_TE_VERSION``, the hook: estimator/te_release.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..gpus import GpuSpec
from ..layout import Layout


@dataclass(frozen=True)
class AttentionBackend:
    """The backend asked for, the kernel whose tensors are modelled, and why."""
    requested: str          # --attention-backend (auto | flash | fused | unfused | local)
    selected: str           # flash | fused | unfused | local | flex: what the attention terms model
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
    """The run's TE (estimator/te_release.py: core 0.16 pins it below 2.12, later cores are read with 2.20.2)
    is read with TE 2.11's backend rules up to 2.11, with 2.20.2's from 2.12: the Python rules (determinism on
    Blackwell, a deterministic non-vanilla softmax) change at 2.12.0; the compiled cuDNN query was read in 2.11.0
    and 2.20.2 only."""
    from .te_release import BACKEND_RULES_2202_SINCE, te_at_least
    return not te_at_least(L.env_dict, L.megatron_version, BACKEND_RULES_2202_SINCE)


def _te_drops_flash_for_mla(L: Layout) -> bool:
    """TE up to 2.16.1 drops flash-attn 2 for different q/k and v head dims ("does not support MLA", utils.py);
    from 2.17.0 ``_pad_qkv_head_dim`` pads the smaller one (dot_product_attention.py)."""
    from .te_release import MLA_FLASH_PAD_SINCE, te_at_least
    return not te_at_least(L.env_dict, L.megatron_version, MLA_FLASH_PAD_SINCE)


def _deterministic(L: Layout) -> bool:
    """TE's DotProductAttention.deterministic: NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (Megatron's
    --deterministic-mode requires it; torch's deterministic algorithms are switched on by that flag too)."""
    env = dict(L.env)
    return L.deterministic_mode or str(env.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")).strip() == "0"


def _deterministic_by(L: Layout) -> str:
    """The setting that makes the run deterministic, as the user wrote it."""
    return "--deterministic-mode" if L.deterministic_mode else "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0"


def head_dims(L: Layout) -> tuple[int, int]:
    """The q/k and v head dims the core attention sees: MLA's (qk + rope dim, v), else kv_channels twice."""
    if L.multi_latent_attention:
        return L.qk_head_dim + L.qk_pos_emb_head_dim, L.v_head_dim
    return L.kv_channels, L.kv_channels


def flash_head_dim(L: Layout) -> int:
    """The head dim flash-attn 2 runs at: the larger of q/k's and v's (TE 2.20.2 pads MLA's smaller one to it,
    dot_product_attention.py ``_pad_qkv_head_dim``)."""
    return max(head_dims(L))


def _dims(L: Layout) -> str:
    qk, v = head_dims(L)
    return f"MLA {qk}/{v}" if L.multi_latent_attention else f"kv_channels {qk}"


# get_attention_backend (TE 2.11 / 2.20.2 utils.py): flash-attn 2 above head dim 192 only on these
_FLASH_ABOVE_192 = ((8, 0), (9, 0), (10, 0), (12, 0))


def _flash_blocked(L: Layout, cc: tuple[int, int] | None, explicit: bool = False) -> str | None:
    """Why flash-attn 2 cannot run this layer's attention (get_attention_backend's filters), or None.
    ``explicit``: for ``--attention-backend flash``, where ``--flash-attention-version 3 / 4`` asks for that
    generation (whose own head-dim rules are not modelled: only where it runs at all is checked)."""
    if L.act_bytes == 4:
        return "flash-attn takes only bf16/fp16 q/k/v, these are fp32"
    if L.fp8_spec.fp8_dot_product_attention:
        return "FP8 attention runs only in cuDNN"
    if explicit and L.flash_attention_version in (3, 4):
        # TE 2.20.2 get_attention_backend: flash-attn 3 runs only on sm90, flash-attn 4 not below sm90
        fa = L.flash_attention_version
        if cc is not None and ((fa == 3 and cc != (9, 0)) or (fa == 4 and cc < (9, 0))):
            return (f"flash-attn {fa} (--flash-attention-version {fa}) does not run on sm{cc[0]}{cc[1]}: "
                    + ("only on sm90" if fa == 3 else "not below sm90"))
        return None
    qk, v = head_dims(L)
    if qk != v and _te_drops_flash_for_mla(L):
        return f"flash-attn 2 needs equal q/k and v head dims in Transformer Engine before 2.17 ({_dims(L)})"
    if L.softmax_type != "vanilla":
        return f"flash-attn has no {L.softmax_type} softmax"
    d = max(qk, v)
    padded = " padded" if qk != v else ""
    if d % 8 or d > 256:
        return f"flash-attn 2 needs a{padded} head dim that is a multiple of 8 and <= 256 ({_dims(L)})"
    if d > 192 and cc is not None and cc not in _FLASH_ABOVE_192:
        return f"flash-attn 2 takes a{padded} head dim above 192 only on sm80/90/100/120 ({_dims(L)})"
    if L.flash_attention_version not in (None, 2):
        # TE 2.20.2: flash-attn 3 runs only on sm90, flash-attn 4 not below sm90
        return f"--flash-attention-version {L.flash_attention_version} leaves no flash-attn 2"
    return None


def _cudnn_trains(L: Layout, cc: tuple[int, int], qk: int, v: int) -> bool:
    """Whether the compiled query (module docstring) has a bf16/fp16 training backend for head dims qk / v."""
    if cc[0] == 9:
        if qk > 256 or v > 256:
            return False
        # TE 2.11's table, from cuDNN 9.11: no sm90 backward for MLA with both head dims >= 128 but 192/128
        return not (_te_211(L) and qk != v and qk >= 128 and v >= 128 and (qk, v) != (192, 128))
    if cc[0] == 10:
        return (qk <= 128 and v <= 128) or (qk, v) == (192, 128)
    return qk <= 128 and v <= 128


def _cudnn_blocked(L: Layout, cc: tuple[int, int] | None) -> str | None:
    """Why cuDNN fused attention has no training backend for this layer's attention, or None. ``cc``: compute
    capability (None: unknown GPU; the dtype and head-dim rules that hold on every NVIDIA GPU still apply)."""
    if L.act_bytes == 4:
        # "Filter: Data type" (TE 2.11 / 2.20.2 utils.py): FusedAttention takes bf16/fp16 (FP8) only
        return "flash-attn and cuDNN take only bf16/fp16 q/k/v, these are fp32"
    if L.fp8_spec.fp8_dot_product_attention:
        return None                                   # FP8 attention's rules: resolve/fp8.py
    qk, v = head_dims(L)
    if qk % 8 or v % 8:
        return f"cuDNN needs head dims that are multiples of 8 ({_dims(L)})"
    if cc is None:
        if qk == v and qk > 256:
            return f"cuDNN has no training kernel for head dims above 256 ({_dims(L)})"
        return None
    sm = f"sm{cc[0]}{cc[1]}"
    if not _cudnn_trains(L, cc, qk, v):
        return f"cuDNN has no {sm} training kernel for {_dims(L)}"
    if _deterministic(L):
        if cc < (9, 0):
            # TE 2.11 / 2.20.2 "Filter: Determinism": F16_arbitrary_seqlen is not deterministic below sm90
            return f"cuDNN's backward is not deterministic on {sm} ({_deterministic_by(L)})"
        if cc >= (10, 0) and _te_211(L):
            return ("Transformer Engine 2.11 switches cuDNN fused attention off for deterministic training on "
                    f"Blackwell: {_deterministic_by(L)}")
        if cc >= (10, 0) and L.attention_dropout > 0:
            return (f"cuDNN has no deterministic Blackwell backward with attention dropout {L.attention_dropout:g}: "
                    f"Transformer Engine 2.12+ gets no fused backend for {_deterministic_by(L)}")
        if L.softmax_type != "vanilla" and not _te_211(L):
            return (f"Transformer Engine 2.20 switches cuDNN off for a deterministic {L.softmax_type} softmax "
                    f"({_deterministic_by(L)})")
    return None


def explicit_blocked(L: Layout, gpu: GpuSpec | None) -> str | None:
    """Why the kernel an explicit ``--attention-backend flash`` / ``fused`` names cannot run this layer's attention,
    or None: the filters ``auto`` chooses by (_flash_blocked / _cudnn_blocked). Megatron's backend switches the
    other two kernels off (NVTE_FLASH_ATTN / NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN, language_module.py
    ``_set_attention_backend``, core 0.16.1 / 0.19.2), so TE's DotProductAttention raises "No dot product attention
    backend is available" at the first forward step. fp32 and flash for MLA under core 0.16 are refused earlier
    (resolve/kernels.py); FP8 attention's cuDNN rules are resolve/fp8.py's."""
    asked = L.attention_backend
    if L.transformer_impl != "transformer_engine" or asked not in ("flash", "fused") or _gemma2_flex(L):
        return None
    cc = gpu.compute_capability if gpu is not None else None
    return _flash_blocked(L, cc, explicit=True) if asked == "flash" else _cudnn_blocked(L, cc)


def _gemma2_flex(L: Layout) -> bool:
    """Gemma 2's layer spec brings its own core attention (Megatron-Bridge 0.6.2 gemma2_provider.py), which only
    ``--attention-backend local`` replaces (gpt_provider.py provide)."""
    return getattr(L, "gemma2_attention", False) and L.attention_backend != "local"


def select(L: Layout, gpu: GpuSpec | None) -> AttentionBackend:
    """The core-attention kernel modelled for ``L`` on ``gpu`` (None: unknown GPU)."""
    asked = L.attention_backend
    if L.transformer_impl == "local" or asked == "local":
        return AttentionBackend(asked, "local", "megatron-core's own DotProductAttention (local spec or "
                                "--attention-backend local)")
    if _gemma2_flex(L):
        return AttentionBackend(asked, "flex", "Gemma 2's Gemma2FlexDotProductAttention (PyTorch FlexAttention, "
                                "gemma2_layer_spec): Transformer Engine's attention does not run")
    if asked != "auto":
        return AttentionBackend(asked, asked, f"--attention-backend {asked}")
    cc = gpu.compute_capability if gpu is not None else None
    no_flash, no_cudnn = _flash_blocked(L, cc), _cudnn_blocked(L, cc)
    if no_flash and no_cudnn:
        why = no_cudnn if L.act_bytes == 4 or no_flash == no_cudnn else f"{no_flash}; {no_cudnn}"
        return AttentionBackend(asked, "unfused", f"auto: Transformer Engine's unfused attention ({why})")
    if cc is None:
        where = f"{gpu.name} is not a CUDA GPU memguard knows the compute capability of" if gpu is not None \
            else "the GPU is unknown"
        return AttentionBackend(asked, "fused", f"auto: {where}; modelled as cuDNN fused attention, what Transformer "
                                "Engine picks on Hopper and Blackwell (on an A100 it runs flash-attn: give --gpu)")
    sm = f"sm{cc[0]}{cc[1]}"
    padded = " with q/k/v padded to one head dim" if L.multi_latent_attention else ""
    if no_flash:
        return AttentionBackend(asked, "fused", f"auto on {sm}: cuDNN fused attention ({no_flash})")
    if cc < (9, 0):
        # flash-attn 2 wins below sm90 whether cuDNN runs or not
        return AttentionBackend(asked, "flash", f"auto on {sm}: flash-attn 2{padded} (Transformer Engine prefers "
                                "FlashAttention below sm90 when flash and cuDNN both run)")
    if no_cudnn:
        return AttentionBackend(asked, "flash", f"auto on {sm}: flash-attn 2{padded} ({no_cudnn})")
    return AttentionBackend(asked, "fused", f"auto on {sm}: cuDNN fused attention (Transformer Engine prefers it "
                            "over flash-attn on Hopper and later)")
