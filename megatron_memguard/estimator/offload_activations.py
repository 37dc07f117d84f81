"""Activation offloading to the host: what leaves the GPU, what stays, and the host bytes.

Two mechanisms (megatron-core 0.16.1 and 0.19.2):

* Layer-level, ``--cpu-offloading-num-layers N`` (``TransformerBlock`` runs each layer inside TE's
  ``get_cpu_offload_context``; TransformerConfig requires 0 <= N < num_layers, PP = 1 and no
  recompute). TE's default synchroniser (transformer_engine/pytorch/cpu_offload.py, TE >= 2.10)
  offloads every tensor saved inside layers 0..N-1 that is not a parameter; the offload of layer i
  must be done before layer L-N+i runs, and its reload starts at the backward of layer L-1-N+i, which
  TE documents as a saved-activation peak of ``(L - N) * T_layer``. The host keeps N layers' worth
  in pinned buffers.
* Fine-grained, ``--fine-grained-activation-offloading --offload-modules ...``
  (pipeline_parallel/fine_grained_activation_offload.py): the saved tensors of each listed module
  group (its input and what is saved inside it) go to a pinned host pool after the group's forward;
  before the group's backward they come back, one group ahead. Tensors smaller than
  ``--min-offloaded-tensor-size`` elements (default 1,048,576) stay, and so does the chunk's last
  group on the last pipeline stage (its backward follows at once: ``should_bulk_offload``). The
  warm-up iteration offloads too (``should_bulk_offload`` returns True while warming up) and records
  the groups' sizes.

Core 0.19's tuning (``PipelineOffloadManager.post_warmup_callback``, read in 0.19.2): after the warm-up
iteration, ``--delta-offload-bytes-across-pp-ranks D`` keeps ``pp_rank x D`` bytes of whole groups on the GPU,
walking the chunks in backward order (micro-batch 0 first) and each chunk's groups in forward order, a group
kept while the budget is still positive; then ``--activation-offload-fraction f`` keeps ``int(n (1 - f))`` of
each chunk's n remaining offloaded groups on the GPU, the last ones in forward order ("prefer keeping earlier
forward groups offloaded"). ``--delay-offload-until-cuda-graph`` queues the offloads committed during a TE
CUDA graph replay until the replay returns (``FineGrainedOffloadingGroupCommitFunction``,
``TransformerLayer._te_cuda_graph_replay``): a graphed layer's groups are all on the GPU at its end.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act",
           "fused_group_mlp")
# Forward order inside a layer: the last listed group of the last layer is the one kept on the GPU.
_ORDER = {m: i for i, m in enumerate(("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm",
                                      "expert_fc1", "moe_act", "fused_group_mlp"))}
DEFAULT_MIN_TENSOR_ELEMENTS = 1024 * 1024


# ----- layer-level ---------------------------------------------------------------------------------

def layer_offload_resident_layers(num_layers: int, offload_layers: int) -> int:
    """Layers whose saved activations are on the GPU at the peak: ``L - N`` (TE's documented bound)."""
    if not 0 <= offload_layers < num_layers:
        raise ValueError(f"cpu_offloading_num_layers must be in [0, {num_layers}), got {offload_layers}")
    return num_layers - offload_layers


def layer_offload_removed(num_layers: int, offload_layers: int, per_layer_saved: int) -> int:
    """Saved-activation bytes that are not on the GPU at the peak (one micro-batch: PP = 1)."""
    return (num_layers - layer_offload_resident_layers(num_layers, offload_layers)) * per_layer_saved


def layer_offload_host_bytes(offload_layers: int, per_layer_saved: int) -> int:
    """Pinned host memory for the offloaded layers of the micro-batch in flight."""
    return offload_layers * per_layer_saved


# ----- fine-grained ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class FineGrainedPlan:
    """What fine-grained offloading does to one chunk's layers for one micro-batch."""

    offloaded: int          # bytes moved to the host per micro-batch (all layers of the chunk)
    kept_last_group: int    # the chunk's last group, kept on the last stage
    staging: int            # ``offload_staging``: the groups in flight (one D2H pending, one prefetched)

    @property
    def host_bytes(self) -> int:
        return self.offloaded


def last_offload_group(groups: Mapping[str, int]) -> str | None:
    """The group of a layer that runs last in forward (the one kept on the last stage), or None."""
    names = [g for g, b in groups.items() if b > 0]
    return max(names, key=lambda g: _ORDER.get(g, 99)) if names else None


def group_bytes(tensors: Mapping[str, Sequence[tuple[int, int]]], modules: Sequence[str],
                min_elements: int = DEFAULT_MIN_TENSOR_ELEMENTS) -> dict[str, int]:
    """Offloadable bytes of each listed module group of one layer.

    ``tensors`` maps a module name to the ``(elements, bytes_per_element)`` of each tensor it saves
    (from the layer recipe); tensors below ``min_elements`` stay on the GPU.
    """
    return {m: sum(n * size for n, size in tensors.get(m, ()) if n >= min_elements) for m in modules}


def ordered_sizes(groups: Mapping[str, int]) -> list[int]:
    """One layer's offloaded group sizes in forward order (groups of no bytes are not offloaded)."""
    return [b for _, b in sorted(groups.items(), key=lambda kv: _ORDER.get(kv[0], 99)) if b > 0]


def fraction_kept(sizes: Sequence[int], fraction: float) -> int:
    """Bytes ``--activation-offload-fraction`` keeps on the GPU of one chunk's offloaded groups (``sizes``, in
    forward order): the last ``int(n (1 - fraction))`` of the n groups."""
    k = int(len(sizes) * (1 - fraction))
    return sum(sizes[len(sizes) - k:]) if k > 0 else 0


def pp_balance_kept(sizes: Sequence[int], budget: int, fraction: float, micro_batches: int) -> int:
    """Bytes ``--delta-offload-bytes-across-pp-ranks`` keeps on the GPU beyond the fraction's, over the first
    ``micro_batches`` chunks in backward order (those in flight at the stage's peak), each with the groups
    ``sizes``: whole groups from the first one while ``budget`` (pp_rank x delta) is positive, then the fraction
    applied to what is left of each chunk."""
    extra = 0
    base = fraction_kept(sizes, fraction)
    for _ in range(micro_batches):
        if budget <= 0:
            break
        i = 0
        while i < len(sizes) and budget > 0:
            budget -= sizes[i]
            i += 1
        extra += sum(sizes[:i]) + fraction_kept(sizes[i:], fraction) - base
    return extra


def fine_grained_plan(groups: Mapping[str, int], layers: int, last_stage: bool,
                      max_inflight: int | None = None) -> FineGrainedPlan:
    """Per micro-batch: every group of every layer leaves, except the chunk's last group on the last
    stage. At most one group's D2H copy is pending in forward and one group is reloaded ahead in
    backward (the staging).

    ``max_inflight`` (``--fine-grained-offloading-max-inflight-offloads``, core 0.19.2
    ChunkOffloadHandler._drain_offload_pending): the main stream waits on a name's older D2H events only
    once more than the cap are queued, in one chunk handler (one per chunk and micro-batch). A cap above
    one lets up to ``min(cap, groups of that name that left)`` copies of every name be pending at once
    (their tensors are held by ``record_stream`` until the copy ends): the upper bound, taken when the
    cap is above one. A D2H stream that keeps pace leaves one pending, the default figure."""
    sizes = [b for _, b in sorted(groups.items(), key=lambda kv: _ORDER.get(kv[0], 99)) if b > 0]
    if not sizes or layers <= 0:
        return FineGrainedPlan(0, 0, 0)
    per_layer = sum(sizes)
    kept = sizes[-1] if last_stage else 0
    offloaded = layers * per_layer - kept
    # the staged groups are groups that left: never more than left (one layer of one group on the last
    # stage offloads nothing, two layers of one group offload one)
    leaving = sizes if layers > 1 or not last_stage else sizes[:-1]
    staging = min(2 * max(leaving, default=0), offloaded)
    if max_inflight is not None and max_inflight > 1:
        # per name: the groups of that name that left (the last one stays on the last stage)
        pending = sum(min(max_inflight, layers - (1 if last_stage and i == len(sizes) - 1 else 0)) * b
                      for i, b in enumerate(sizes))
        staging = max(staging, min(pending + max(leaving, default=0), offloaded))
    return FineGrainedPlan(offloaded=offloaded, kept_last_group=kept, staging=staging)


# ----- which of a layer recipe's saved tensors each module group takes -------------------------------
# (transformer_layer.py / attention.py, core 0.19.2: each group wraps one call and offloads what is saved
# inside it.) ``attn_norm`` / ``mlp_norm`` only act when the norm is a module of its own: TE's spec fuses
# the input norm into the QKV projection (and the dense pre-MLP norm into fc1), where the layer input is
# saved inside ``qkv_linear``'s call instead.
_GROUP_OF = {
    "qkv_input": "qkv_linear", "q_latent": "qkv_linear", "kv_latent": "qkv_linear",   # (MLA's down projections)
    "query": "core_attn", "key": "core_attn", "value": "core_attn",                  # (MLA's attention inputs)
    "query_rope": "core_attn", "key_rope": "core_attn", "qkv_output": "core_attn", "softmax_stats": "core_attn",
    "flash_qkv": "core_attn", "attention_output_bshd": "core_attn",                   # (the flash backend's)
    "fp8_attention_qkv": "core_attn", "fp8_attention_output": "core_attn",            # (FP8 attention's)
    "cp_a2a_attention_output": "core_attn", "cp_a2a_qkv": "core_attn",               # (the CP all-to-all's)
    "proj_input": "attn_proj",
    # Gemma 3's post-attention norm runs inside linear_proj's call (TERowParallelLinearLayerNorm.forward)
    "post_attn_norm_input": "attn_proj",
    # unfused (local / 'unfused' backend) attention: the softmax output and dropout mask, saved inside
    # the core_attn call (attention.py, core 0.19.2: the whole core_attention call is in the group)
    "attention_probs": "core_attn",
    # TEGroupedMLP.forward (moe/experts.py, core 0.19.2): fc1 runs inside 'expert_fc1' (its input, the
    # dispatched tokens), the activation inside 'moe_act' (its input, fc1's output)
    "moe_expert_input": "expert_fc1", "moe_expert_activations": "moe_act",
}


def group_of(name: str, modules: Sequence[str], separate_input_norm: bool, separate_mlp_norm: bool,
             core_keeps_proj_input: bool = True) -> str | None:
    """The listed module group that offloads the saved tensor ``name`` of a layer recipe, or None.
    ``core_keeps_proj_input``: the core attention saves the output linear_proj reads (layers.attention.attention_keeps_proj_input)."""
    if name == "layer_input":
        g = "attn_norm" if separate_input_norm else "qkv_linear"
    elif name == "mlp_norm_input":
        g = "mlp_norm" if separate_mlp_norm else None
    elif name == "proj_input" and "attn_proj" not in modules:
        # cuDNN attention (and its CP ring) saves its output too, inside the core_attn call; TE 2.11's FlashAttention
        # returns a .contiguous() copy of flash-attn's output (backends.py) and unfused attention a new tensor, which
        # only linear_proj saves
        g = "core_attn" if core_keeps_proj_input else None
    elif name in ("moe_expert_input", "moe_expert_activations") and "fused_group_mlp" in modules:
        # TEGroupedMLP._fused_forward (core 0.19.2): one group around the op fuser's call, which saves fc1's
        # input, fc1's output and fc2's input (TransformerConfig forbids it next to expert_fc1 / moe_act)
        g = "fused_group_mlp"
    else:
        g = _GROUP_OF.get(name)
    return g if g in modules else None


def layer_groups(saved: Mapping[str, int], modules: Sequence[str], elem_bytes: int, separate_input_norm: bool = False,
                 separate_mlp_norm: bool = False, min_elements: int = DEFAULT_MIN_TENSOR_ELEMENTS,
                 outside: Mapping[str, int] | None = None) -> dict[str, int]:
    """Bytes each listed group takes off one layer's saved tensors (``saved``: name -> bytes, tensors in
    the activation dtype; statistics in fp32 are below any useful threshold and stay). ``outside``: the
    bytes of an entry that are saved outside its group's call (they stay)."""
    from .layers.attention import attention_keeps_proj_input
    keeps = attention_keeps_proj_input(saved)
    out: dict[str, int] = {}
    for name, nbytes in saved.items():
        g = group_of(name, modules, separate_input_norm, separate_mlp_norm, keeps)
        nbytes -= (outside or {}).get(name, 0)
        if g is not None and nbytes // elem_bytes >= min_elements:
            out[g] = out.get(g, 0) + nbytes
    return out


def effective_modules(modules: Sequence[str], graph_impl: str, graph_modules: Sequence[str],
                      moe_layer: bool) -> tuple[str, ...]:
    """The listed groups a layer really offloads next to per-layer CUDA graphs (TransformerLayer.__init__,
    core 0.19.2): no ``attn_norm`` with graphed attention; no ``mlp_norm`` on an MoE layer with graphed
    attention or router, nor on a dense layer where the norm is a graph boundary (attn or mlp graphed,
    not both)."""
    if graph_impl not in ("local", "transformer_engine"):
        return tuple(modules)
    g = set(graph_modules)
    drop = set()
    if "attn" in g:
        drop.add("attn_norm")
    if (moe_layer and g & {"attn", "moe_router"}) or (not moe_layer and ("attn" in g) != ("mlp" in g)):
        drop.add("mlp_norm")
    return tuple(m for m in modules if m not in drop)
