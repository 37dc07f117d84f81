"""The chosen layout as something to paste: Megatron flags, NeMo 2 and Megatron-Bridge overrides.

The names come from the knob registry (megatron_memguard/knobs.py, which cites
shared/reference/nemo-bridge.md); this module only decides which knobs a layout writes and in
what order.
"""
from __future__ import annotations

import shlex

from ..config import RawConfig
from ..knobs import knob
from ..layout import Layout


def _flag(dest: str, value: object) -> list[str]:
    text = knob(dest).megatron(value)
    return [text] if text is not None else []


def segmented_pattern(L: Layout) -> str | None:
    """A hybrid layout's --hybrid-layer-pattern when its '|' segments set the split (and VPP): the pattern with
    them and its '/' MTP depths; None otherwise. validate_args (0.19.2) asserts no --pipeline-model-parallel-layout
    and no virtual-stage flag beside it (it derives VPP from the segments), so the pattern replaces both."""
    main = L.hybrid_layer_pattern or ""
    if "|" not in main:
        return None
    mtp = getattr(L, "hybrid_mtp_pattern", None)
    return main + (("/" + mtp) * L.mtp_num_layers if mtp else "")


def megatron_flags(L: Layout, experts: tuple[int, int] | None = None) -> list[str]:
    """``experts``: (EP, ETP) of a mixture-of-experts layout, written out whenever the model has experts."""
    f = _flag("tensor_model_parallel_size", L.tp) + _flag("pipeline_model_parallel_size", L.pp)
    if experts is not None:
        f += _flag("expert_model_parallel_size", experts[0]) + _flag("expert_tensor_parallel_size", experts[1])
    seg = segmented_pattern(L)
    if seg:
        f += [f"--hybrid-layer-pattern {shlex.quote(seg)}"]     # (the split and VPP follow from its '|')
    elif L.pipeline_model_parallel_layout:
        f += _flag("pipeline_model_parallel_layout", L.pipeline_model_parallel_layout)   # (VPP follows from it)
    elif L.vpp > 1:
        f += _flag("num_virtual_stages_per_pipeline_rank", L.vpp)
    f += _flag("decoder_first_pipeline_num_layers", L.decoder_first_pipeline_num_layers)
    f += _flag("decoder_last_pipeline_num_layers", L.decoder_last_pipeline_num_layers)
    f += _flag("account_for_embedding_in_pipeline_split", L.account_for_embedding_in_pipeline_split)
    f += _flag("account_for_loss_in_pipeline_split", L.account_for_loss_in_pipeline_split)
    f += _flag("context_parallel_size", L.cp)
    f += _flag("sequence_parallel", L.sequence_parallel)
    for dest in ("micro_batch_size", "global_batch_size", "seq_length", "use_distributed_optimizer",
                 "overlap_grad_reduce", "overlap_param_gather"):
        f += _flag(dest, getattr(L, dest))
    if L.recompute_granularity in ("selective", "full"):
        f += _flag("recompute_granularity", L.recompute_granularity)
    if L.recompute_granularity == "full":
        f += _flag("recompute_method", L.recompute_method) + _flag("recompute_num_layers", L.recompute_num_layers)
    if L.use_megatron_fsdp:
        # validate_args wants the fsdp_dtensor checkpoint format with Megatron-FSDP
        f += _flag("use_megatron_fsdp", True) + _flag("data_parallel_sharding_strategy",
                                                      L.data_parallel_sharding_strategy) + ["--ckpt-format fsdp_dtensor"]
    return f + [t for dest, value in _fp8(L) for t in _flag(dest, value)]


def flags_to_remove(raw: RawConfig, exported: list[str]) -> list[str]:
    """The Megatron flags of the user's command (as spelled there) that the exported flags do not override: a
    searched setting the chosen layout leaves off or unset (no recomputation, no sequence parallelism, even
    stages, ...). Megatron's store-true flags have no off switch and a value flag given once stays in force,
    so these must leave the command for it to run the planned layout (and for `memguard estimate` to give
    the planned bytes)."""
    from ..readers.megatron_flags import parse_megatron_flags
    from .space import SEARCHED_ARGS
    written = set(parse_megatron_flags(shlex.split(" ".join(exported))).args)
    out: list[str] = []
    if "hybrid_layer_pattern" in written and str(raw.origin.get("hybrid_override_pattern", "")).startswith("--"):
        # the legacy spelling beside --hybrid-layer-pattern: validate_args asserts only one is given
        out.append(raw.origin["hybrid_override_pattern"])
    for dest in SEARCHED_ARGS:
        if raw.args.get(dest) is None or raw.args.get(dest) is False or dest in written:
            continue
        spelled = raw.origin.get(dest, "")
        if spelled.startswith("--") and spelled not in out:   # a flag of the command, not a YAML / recipe key
            out.append(spelled)
    return out


def _fp8(L: Layout) -> list[tuple[str, object]]:
    """FP8 format and recipe, when the layout trains in FP8 (``memguard plan --fp8`` chose it)."""
    return [("fp8", L.fp8), ("fp8_recipe", L.fp8_recipe)] if L.fp8 else []


def _fsdp(L: Layout) -> list[tuple[str, object]]:
    if not L.use_megatron_fsdp:
        return []
    return [("use_megatron_fsdp", True), ("data_parallel_sharding_strategy", L.data_parallel_sharding_strategy)]


def _values(L: Layout, experts: tuple[int, int] | None = None, bridge: bool = True) -> list[tuple[str, object]]:
    """(dest, value) of every knob the NeMo 2 / Bridge overrides write, in their order."""
    seg = segmented_pattern(L)
    v: list[tuple[str, object]] = [
        ("tensor_model_parallel_size", L.tp), ("pipeline_model_parallel_size", L.pp),
        # (with a layout too: TransformerConfig asserts it equals the layout's, and NeMo 2 / Bridge size the
        # virtual-pipeline groups from it before the config derives it; for Bridge not beside a hybrid pattern's '|'
        # segments: its HybridModelProvider asserts the virtual size unset and derives it from them. NeMo 2 calls no
        # validate_args to derive it: the size is written beside the pattern there)
        ("num_virtual_stages_per_pipeline_rank", L.vpp if L.vpp > 1 and not (seg and bridge) else None),
        ("context_parallel_size", L.cp), ("sequence_parallel", L.sequence_parallel)]
    if L.pipeline_model_parallel_layout and not seg:
        v.append(("pipeline_model_parallel_layout", L.pipeline_model_parallel_layout))
    if experts is not None:
        v += [("expert_model_parallel_size", experts[0]), ("expert_tensor_parallel_size", experts[1])]
    for dest in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                 "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if getattr(L, dest) not in (None, False):
            v.append((dest, getattr(L, dest)))
    return v


def _recompute(L: Layout) -> list[tuple[str, object]]:
    v: list[tuple[str, object]] = [("recompute_granularity", L.recompute_granularity)]
    if L.recompute_granularity == "full":
        v += [("recompute_method", L.recompute_method), ("recompute_num_layers", L.recompute_num_layers)]
    return v


# settings a config may hold that a planned layout can leave unset, which an override must then clear: the
# searched keys the exporters write only when set
_CLEARABLE = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
              "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
              "pipeline_model_parallel_layout", "recompute_method", "recompute_num_layers")


def _cleared(L: Layout, raw: RawConfig | None, pairs: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """(dest, null / false) for each _CLEARABLE setting the model's config sets and the layout leaves unset
    (a NeMo 2 / Bridge override replaces a value; an absent override keeps the config's, e.g. its
    num_layers_in_first_pipeline_stage under a planned even split)."""
    if raw is None:
        return []
    written = {dest for dest, _ in pairs}
    out: list[tuple[str, object]] = []
    for dest in _CLEARABLE:
        given, planned = raw.args.get(dest), getattr(L, dest, None)
        if given is None or given is False or dest in written or not (planned is None or planned is False):
            continue
        out.append((dest, False if knob(dest).kind == "bool" else None))
    return out


def _pattern(L: Layout, key: str) -> list[str]:
    """The hybrid pattern with its '|' segments as an override (YAML-quoted: '|' and '*'), when they set the split."""
    seg = segmented_pattern(L)
    return [f"{key}='{seg}'"] if seg else []


def _nemo2(pairs: list[tuple[str, object]]) -> list[str]:
    return [o for dest, value in pairs for o in knob(dest).overrides(knob(dest).nemo2, value)]


def _bridge(pairs: list[tuple[str, object]]) -> list[str]:
    return [o for dest, value in pairs for o in knob(dest).overrides(knob(dest).bridge, value)]


def nemo2_overrides(L: Layout, gpus_per_node: int | None = None, experts: tuple[int, int] | None = None,
                    raw: RawConfig | None = None) -> list[str]:
    """``raw``: the model's config, whose settings the layout leaves unset are cleared (null / false)."""
    o = _nemo2(_values(L, experts, bridge=False))
    o += _nemo2([("micro_batch_size", L.micro_batch_size), ("global_batch_size", L.global_batch_size),
                 ("seq_length", L.seq_length), ("use_distributed_optimizer", L.use_distributed_optimizer),
                 ("overlap_grad_reduce", L.overlap_grad_reduce), ("overlap_param_gather", L.overlap_param_gather)])
    o += _nemo2(_recompute(L)) + _nemo2(_fsdp(L)) + _nemo2(_fp8(L))
    o += _pattern(L, "model.config.hybrid_override_pattern")
    o += _nemo2(_cleared(L, raw, _values(L, experts, bridge=False) + _recompute(L)))
    if gpus_per_node:
        nodes = -(-L.world_size // gpus_per_node)
        o += [f"trainer.devices={min(gpus_per_node, L.world_size)}", f"trainer.num_nodes={nodes}"]
    return o


def bridge_overrides(L: Layout, experts: tuple[int, int] | None = None, raw: RawConfig | None = None) -> list[str]:
    """``raw``: the model's config, whose settings the layout leaves unset are cleared (null / false)."""
    # Bridge writes seq_length to model and dataset, before the batch sizes (as the recipes list them).
    o = _bridge(_values(L, experts))
    o += _bridge([("seq_length", L.seq_length), ("micro_batch_size", L.micro_batch_size),
                  ("global_batch_size", L.global_batch_size), ("use_distributed_optimizer", L.use_distributed_optimizer),
                  ("overlap_grad_reduce", L.overlap_grad_reduce), ("overlap_param_gather", L.overlap_param_gather)])
    o += _bridge(_recompute(L)) + _bridge(_fsdp(L)) + _bridge(_fp8(L))
    o += _pattern(L, "model.hybrid_layer_pattern")
    if segmented_pattern(L) and raw is not None and raw.args.get("hybrid_override_pattern"):
        # (HybridModelProvider.finalize asserts the deprecated field unset beside hybrid_layer_pattern)
        o.append("model.hybrid_override_pattern=null")
    if L.use_megatron_fsdp:   # Bridge asserts the fsdp_dtensor checkpoint format with Megatron-FSDP when it saves
        o.append("checkpoint.ckpt_format=fsdp_dtensor")
    return o + _bridge(_cleared(L, raw, _values(L, experts) + _recompute(L)))
