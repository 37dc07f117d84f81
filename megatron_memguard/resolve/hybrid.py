"""Sections: hybrid Mamba models (--hybrid-layer-pattern, the legacy --hybrid-override-pattern, --mamba-*).

Mirrors megatron-core 0.19.2: validate_args's hybrid block (megatron/training/arguments.py: the deprecated
--hybrid-override-pattern forwarded to --hybrid-layer-pattern, the layer count taken from the pattern, '|'
segments as the pipeline split and the virtual pipeline size, the flags it forbids with '|'),
``parse_hybrid_pattern`` / ``select_pipeline_segment`` (models/hybrid/hybrid_layer_allocation.py: symbols,
'/' MTP patterns, the segment of each rank), and MambaMixer.__init__'s asserts (ssm/mamba_mixer.py: heads and
groups divisible by TP, heads by groups). megatron-core 0.16.1 (ssm/mamba_hybrid_layer_allocation.py
``_allocate_override``): the pattern must have --num-layers symbols of M * - E, no '|' (MambaStack refuses
virtual pipelines), and the flag is --hybrid-override-pattern.

The parts after '/' are the MTP depths' pattern (0.17+: one HybridStack per depth, on the last stage;
``hybrid_mtp_pattern`` and ``mtp_num_layers`` in the layout). What is not modelled is refused by name: FP8 / FP4
with a '/' MTP pattern, the non-fused Mamba path, fine-grained activation offloading before 0.18, another Mamba state
dtype. 'E' layers are the MoE layers (resolve/moe.py places them by the pattern), '+' the MLA layers of 0.19
(--multi-latent-attention inferred as validate_args does), 'D' the DSA layers (resolve/dsa.py), 'G' the gated delta
net layers (resolve/gdn.py). Context parallelism follows MambaContextParallel's asserts (heads and groups of a TP rank
against CP); FP8 / FP4 MambaMixer's (the in_proj width a multiple of 16 under FP8).
"""
from __future__ import annotations

from typing import Any, Mapping

from packaging.version import Version

from ..errors import NotModelledError
from ..numbers import BOUNDS, shown
from .args import Args, Context, Stop
from .hybrid_ratios import from_ratios
from .refusals import hybrid_stack_spec

PATTERN, LEGACY = "hybrid_layer_pattern", "hybrid_override_pattern"
# megatron-core 0.19.2 hybrid_layer_allocation.Symbols.VALID_LAYERS, and what each is
SYMBOLS = {"M": "Mamba", "G": "gated delta net", "*": "attention", "D": "DSA attention", "+": "MLA attention",
           "-": "MLP", "E": "MoE"}
MODELLED = frozenset("M*-E+DG")   # D: DSA layers (resolve/dsa.py); G: gated delta net layers (resolve/gdn.py)
# the release whose Symbols.VALID_LAYERS first holds a symbol (0.16.1 ssm/mamba_hybrid_layer_allocation.py: M * - E;
# 0.17.1 adds G, 0.18.2 D (models/hybrid/hybrid_layer_allocation.py), 0.19.2 + (MLA))
SINCE = {"G": Version("0.17"), "D": Version("0.18"), "+": Version("0.19")}
MAX_PATTERN = 100_000   # as partition.MAX_LAYOUT: 10 x memguard's bound on --num-layers


def _given(a: Args, dest: str) -> str | None:
    v = a.get(dest)
    return None if v is None or v is False or v == "" else str(v)     # (a YAML 0 is a value: 0 == False)


def pattern(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """The layer pattern: its layers (the model's --num-layers), and its '|' segments as the pipeline split
    (a --pipeline-model-parallel-layout of plain layers, which partition.py reads)."""
    old = ctx.version < Version("0.17")
    for dest in (PATTERN, LEGACY):
        if a.get(dest) == "":
            # an empty pattern is a pattern, not "no pattern": megatron-core 0.19.2 validate_args (training/
            # arguments.py: 'if args.hybrid_layer_pattern is not None') sets --num-layers to its 0 layers; 0.16.1's
            # _allocate_override (ssm/mamba_hybrid_layer_allocation.py) asserts it has --num-layers symbols
            a.fail(dest, "is empty: " + ("megatron-core 0.16 asserts the pattern has --num-layers symbols" if old else
                   "validate_args takes the layer count from the pattern (0 layers)"),
                   "give the layer symbols (e.g. M*M-), or drop the flag for a GPT model")
            raise Stop
    text, legacy = _given(a, PATTERN), _given(a, LEGACY)
    derived = from_ratios(a, ctx, text, legacy)
    if derived is not None:
        # (the pattern megatron-core builds: read as if given, 0.16's legacy flag or 0.17+'s)
        if old:
            legacy = a.a[LEGACY] = derived
        else:
            text = a.a[PATTERN] = derived
    if text is None and legacy is None:
        return {}
    if text is not None and legacy is not None:
        # validate_args copies the legacy flag into hybrid_layer_pattern without clearing it: a validated namespace
        # (the hook's, readers/megatron_namespace.py) holds both, equal; a command line with both stops at its assert
        if text != legacy or a.raw.source != "Megatron argument namespace":
            a.fail(LEGACY, "cannot be given with --hybrid-layer-pattern (validate_args asserts it; it is the "
                   "deprecated spelling of the same setting)")
            raise Stop
        legacy = None
    dest = PATTERN if text is not None else LEGACY
    key = a.key(dest)
    if old and dest == PATTERN and key.startswith("--") and a.raw.megatron_command_line:
        a.fail(PATTERN, "is not a flag of megatron-core 0.16 (added in 0.17; 0.16 reads --hybrid-override-pattern)",
               "write --hybrid-override-pattern, or give --megatron-version 0.17 or later")
        raise Stop
    s = text if text is not None else str(legacy)
    if len(s) > MAX_PATTERN:
        a.fail(dest, f"has more than {MAX_PATTERN:,} symbols (memguard's bound on --num-layers is 10,000)")
        raise Stop
    bad = next((ch for ch in s if ch not in SYMBOLS and ch not in "|/"), None)
    if bad is not None:
        a.fail(dest, f"{bad!r} is not a layer symbol (M Mamba, * attention, - MLP, E MoE, G, D, +; "
               "'|' between pipeline segments, '/' before MTP patterns)")
        raise Stop
    if old and "G" in s:
        # 0.16.1 Symbols.VALID is {M, *, -, E} (ssm/mamba_hybrid_layer_allocation.py; 0.17.1 adds GDN = 'G')
        a.fail(dest, "'G' is not a layer symbol in megatron-core 0.16 (gated delta net layers in a hybrid pattern "
               "came in 0.17)")
        raise Stop
    main, *mtp_parts = s.split("/")
    mtp, depths = _mtp_pattern(a, dest, key, mtp_parts, old, ctx.version)
    layers = main.replace("|", "")
    if not layers:
        a.fail(dest, "has no layers before any '/'")
        raise Stop
    _modelled_symbols(a, dest, key, layers, mtp=False, version=ctx.version)
    if set("+D") & set(layers + (mtp or "")):     # validate_args (0.19.2): MLA or DSA layers infer MLA
        _mla_layers(a, layers + (mtp or ""))
    n = len(layers)
    bound, why = BOUNDS["num_layers"]
    if n > bound:
        a.fail(dest, f"has {n:,} layers; memguard's bound on the layer count is {bound:,} ({why})")
        raise Stop
    given_layers = a.get("num_layers")
    if old:
        # 0.16.1 _allocate_override: "The hybrid override pattern is the wrong length"; no '|' symbol
        if "|" in main:
            a.fail(dest, "'|' is not a layer symbol in megatron-core 0.16 (pipeline segments came in 0.17)")
            raise Stop
        nl = a.int_arg("num_layers", required=True)
        if nl is not None and nl != n:
            a.fail(dest, f"has {n} layers but --num-layers is {nl} (megatron-core 0.16 needs them equal)")
            raise Stop
    elif given_layers is not None and str(given_layers) != str(n) and a.key("num_layers").startswith("model."):
        # Megatron-Bridge 0.6.2 HybridModelProvider.finalize asserts num_layers == the pattern's count when both are
        # set (validate_args instead ignores --num-layers): a recipe's num_layers stays when only the pattern changes
        a.fail("num_layers", f"is {shown(given_layers)} but {key} has {n} layers (Megatron-Bridge's "
               "HybridModelProvider asserts they match)", f"set {a.key('num_layers').split(' ')[0]}={n}, the pattern's count")
    elif given_layers is not None and str(given_layers) != str(n):
        a.notes.append(f"{key}: {n} layers; --num-layers {given_layers} ignored (validate_args takes the count "
                       "from the pattern)")
    out: dict[str, Any] = dict(hybrid_layer_pattern=main, num_layers=n)
    if depths:
        out.update(hybrid_mtp_pattern=mtp, mtp_num_layers=depths)
    for flag in ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                 "pipeline_model_parallel_layout"):
        if _given(a, flag) is not None:
            a.fail(flag, f"cannot be used with {key}: its '|' segments give the pipeline stages (validate_args)")
    for flag in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if a.bool_arg(flag, False):
            a.fail(flag, f"cannot be used with {key}: its '|' segments give the pipeline stages (validate_args)")
    pp = kw["pipeline_model_parallel_size"]
    vpp = a.get("virtual_pipeline_model_parallel_size")
    segments_n = main.count("|") + 1
    try:
        vpp_n = int(vpp) if vpp not in (None, "", "None") and not isinstance(vpp, bool) else None
    except (TypeError, ValueError, OverflowError):
        vpp_n = None        # (not a number: the pipeline section refuses it by name)
    if vpp_n is not None and vpp_n > 1 and vpp_n != (segments_n // pp if segments_n % pp == 0 else 1):
        # validate_args derives the virtual pipeline size from the '|' segments; Bridge's HybridModelProvider asserts
        # virtual_pipeline_model_parallel_size is None (a NeMo / Bridge value was taken as an interleaved schedule)
        a.fail("virtual_pipeline_model_parallel_size", f"cannot be used with {key}: its '|' segments give the "
               "virtual pipeline stages (validate_args; Megatron-Bridge's HybridModelProvider asserts it is unset)")
    first_last = [f for f in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
                  if _given(a, f) is not None]
    if "|" not in main and pp > 1 and not first_last and n % pp:
        # select_pipeline_segment (0.19.2) splits a pattern without '|' evenly at build time
        a.fail(dest, f"has {n} layers, which must be divisible by --pipeline-model-parallel-size {pp} when it has "
               "no '|' separators (select_pipeline_segment)", "add '|' between the pipeline segments")
        raise Stop
    if "|" in main:
        for flag in first_last:
            a.fail(flag, f"cannot be used with '|' in {key}: the segments give the stages (validate_args)")
        if first_last:
            return out
        segments = main.split("|")
        if len(segments) % pp:
            a.fail(dest, f"has {len(segments)} '|' segments, which must be divisible by --pipeline-model-parallel-"
                   f"size {pp} (validate_args)")
            return out
        # segment i is the stage of (pp rank i % pp, virtual stage i // pp), as the layout's stages are
        stages = ["t" * len(seg) for seg in segments]
        stages[0] = "E" + stages[0]
        stages[-1] += "L"
        out["pipeline_model_parallel_layout"] = "|".join(stages)
    return out


def _modelled_symbols(a: Args, dest: str, key: str, layers: str, mtp: bool, version: Version | None = None) -> None:
    """A symbol the release does not know (its Symbols.VALID_LAYERS), Megatron's rule on mixing attention with MLA /
    DSA layers (_validate_pattern), then memguard's refusal of the layer kinds it does not model, for the main pattern
    or (``mtp``) the MTP pattern after '/'."""
    young = next((sym for sym in layers if version is not None and sym in SINCE and version < SINCE[sym]), None)
    if young == "+":
        a.fail(dest, f"'+' (MLA) is not a layer symbol of megatron-core {version.major}.{version.minor} (its "
               "hybrid_layer_allocation.Symbols gained it in 0.19)", "give --megatron-version 0.19 or later")
        raise Stop
    if "*" in layers and ("D" in layers or "+" in layers):
        where = " in the MTP pattern" if mtp else ""
        a.fail(dest, f"cannot mix attention '*' with MLA '+' or DSA 'D' layers{where} (_validate_pattern)")
        raise Stop
    other = sorted(set(layers) - MODELLED)
    if other:
        names = ", ".join(f"{sym!r} ({SYMBOLS[sym]})" for sym in other)
        raise NotModelledError(key, f"{names} layers in a hybrid {'MTP ' if mtp else ''}pattern (memguard models "
                               "Mamba 'M', attention '*', MLA '+', MLP '-', MoE 'E', DSA 'D' and gated delta net 'G')")


def _mla_layers(a: Args, layers: str) -> None:
    """'+' and 'D' layers: validate_args (0.19.2) sets --multi-latent-attention for a pattern with MLA or DSA layers, so the
    MLA section reads their shape (--q-lora-rank, --kv-lora-rank, ...). Their spec (hybrid_layer_specs.py mla_layer)
    is GPT's TE MLA layer without latent norms: q_layernorm / kv_layernorm IdentityOp and plain TEColumnParallelLinear
    up-projections, whatever --qk-layernorm says (GPT's spec makes them TELayerNormColumnParallelLinear with it)."""
    a.a["multi_latent_attention"] = True
    if "*" not in layers and a.get("qk_layernorm") is not None and a.bool_arg("qk_layernorm", False):
        a.notes.append(f"{a.key('qk_layernorm')}: not applied to the hybrid MLA layers ('+': their spec has no latent "
                       "norms, hybrid_layer_specs.py)")
        a.a["qk_layernorm"] = False


def _mtp_pattern(a: Args, dest: str, key: str, parts: list[str], old: bool,
                 ctx_version: Version | None = None) -> tuple[str | None, int]:
    """The MTP layers of a hybrid model: (one depth's pattern, the number of depths), or (None, 0).

    parse_hybrid_pattern (megatron-core 0.17.1 ssm/mamba_hybrid_layer_allocation.py, 0.18.2 and 0.19.2
    models/hybrid/hybrid_layer_allocation.py, the same code): each part after '/' is one MTP depth's pattern, all
    identical, no '|'; only empty parts after '/' mean no MTP. The legacy --mtp-hybrid-override-pattern is one
    depth's pattern repeated --mtp-num-layers times when the main pattern has no '/' (validate_args, 0.17.1 to
    0.19.2; Megatron-Bridge 0.6.2 HybridModelProvider.finalize builds the same unified pattern, replacing any
    '/' parts)."""
    legacy = a.get("mtp_hybrid_override_pattern")
    legacy = None if legacy in (None, "", False) else str(legacy)
    seen = len(a.errors)
    depth_flag = a.int_arg("mtp_num_layers", 0, minimum=0) or 0
    del a.errors[seen:]     # (a bad --mtp-num-layers is reported once, by the multi-token prediction section)
    if legacy is not None and depth_flag > 0 and (not any(parts) or not a.raw.megatron_command_line):
        if old:
            a.fail("mtp_hybrid_override_pattern", "is not read by megatron-core 0.16 (hybrid MTP came in 0.17)")
            raise Stop
        dest, key = "mtp_hybrid_override_pattern", a.key("mtp_hybrid_override_pattern")
        bound, why = BOUNDS["mtp_num_layers"]
        if depth_flag > bound:   # (before the list of depths is built: 10**9 of them took the memory)
            a.fail("mtp_num_layers", f"is {depth_flag:,}; memguard's bound on --mtp-num-layers is {bound} ({why})")
            raise Stop
        parts = [legacy] * depth_flag
    if not any(parts):
        return None, 0
    if old:
        a.fail(dest, "'/' is not a layer symbol in megatron-core 0.16 (MTP patterns after '/' came in 0.17)")
        raise Stop
    if len(set(parts)) > 1:
        a.fail(dest, "all MTP patterns after '/' must be identical (parse_hybrid_pattern)")
        raise Stop
    bound, why = BOUNDS["mtp_num_layers"]
    if len(parts) > bound:
        a.fail(dest, f"has {len(parts):,} MTP depths after '/'; memguard's bound on --mtp-num-layers is {bound} ({why})")
        raise Stop
    mtp = parts[0]
    bad = next((ch for ch in mtp if ch not in SYMBOLS), None)
    if bad is not None:
        a.fail(dest, f"{bad!r} is not a layer symbol of an MTP pattern (M, *, -, E, G, D, +; no '|': "
               "parse_hybrid_pattern)")
        raise Stop
    _modelled_symbols(a, dest, key, mtp, mtp=True, version=ctx_version)
    bound, why = BOUNDS["num_layers"]
    if len(mtp) * len(parts) > bound:   # (100 depths of 100,000 symbols ran past 60 s in the MTP estimate)
        a.fail(dest, f"has {len(parts)} MTP depth(s) of {len(mtp):,} layers; memguard's bound on the layer count is "
               f"{bound:,} ({why})")
        raise Stop
    if not a.raw.megatron_command_line and legacy is None:
        # Megatron-Bridge 0.6.2 HybridModelProvider reconciles mtp_num_layers with the pattern only when it builds
        # the pattern from mtp_hybrid_override_pattern; HybridModel builds one MTP layer per '/' part (one with the
        # repeated layer) and its forward runs mtp_num_layers depths (asserting > 0), indexing those layers
        if a.bool_arg("mtp_use_repeated_layer", False) and depth_flag > 0:
            return mtp, depth_flag
        if depth_flag != len(parts):
            if a.given("mtp_num_layers"):
                a.fail("mtp_num_layers", f"is {depth_flag} but {key} has {len(parts)} MTP depth(s) after '/': "
                       "HybridModel builds the pattern's depths and runs mtp_num_layers of them (give them equal)")
            else:
                a.fail(dest, f"has {len(parts)} MTP depth(s) after '/' but mtp_num_layers is not set (0: "
                       "HybridModel's forward asserts mtp_num_layers > 0; set it to the depth count)")
            raise Stop
    if depth_flag and depth_flag != len(parts):
        a.notes.append(f"{a.key('mtp_num_layers')}: {depth_flag} ignored; the pattern has {len(parts)} MTP depth(s) "
                       "(validate_args takes the count from the pattern)")
    return mtp, len(parts)


def mamba(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """The Mamba mixer's shape (TransformerConfig's mamba_* fields) and MambaMixer's asserts; the settings
    a hybrid model is not estimated with."""
    main = kw.get("hybrid_layer_pattern")
    if not main:
        if a.get("spec") and hybrid_stack_spec(a.get("spec")):
            # refusals.py lets the hybrid stack spec through; without a pattern there is no hybrid model to build
            raise NotModelledError(a.key("spec"), "the hybrid stack spec without --hybrid-layer-pattern")
        return {}
    key = a.key(PATTERN if _given(a, PATTERN) is not None else LEGACY)
    state = a.int_arg("mamba_state_dim", 128)
    head_dim = a.int_arg("mamba_head_dim", 64)
    groups = a.int_arg("mamba_num_groups", 8)
    heads = a.int_arg("mamba_num_heads")
    # HybridModelProvider.mamba_chunk_size (Bridge 0.6.2: it sets the mixer's chunk_size; no Megatron-LM flag)
    chunk = a.int_arg("mamba_chunk_size", 128)
    if None in (state, head_dim, groups, chunk):
        return {}
    h, tp = kw["hidden_size"], kw["tensor_model_parallel_size"]
    if heads is None:
        # MambaMixer: d_inner = expand (2) x hidden size, nheads = d_inner // headdim
        if (2 * h) % head_dim:
            a.fail("mamba_head_dim", f"{head_dim} must divide 2 x --hidden-size = {2 * h} when --mamba-num-heads "
                   "is not given (MambaMixer asserts d_inner % headdim == 0)")
            return {}
        heads = 2 * h // head_dim
    if heads % tp:
        a.fail("mamba_num_heads", f"{heads} Mamba heads must be divisible by tensor-model-parallel size {tp} "
               "(MambaMixer asserts it)")
    if groups % tp:
        a.fail("mamba_num_groups", f"{groups} must be divisible by tensor-model-parallel size {tp} (MambaMixer "
               "asserts it)")
    if heads % groups:
        a.fail("mamba_num_heads", f"{heads} Mamba heads must be divisible by --mamba-num-groups {groups} "
               "(MambaMixer asserts it)")
    cp = kw.get("context_parallel_size", 1)
    if cp > 1 and "M" in main + (kw.get("hybrid_mtp_pattern") or "") and not heads % tp and not groups % tp:
        # MambaContextParallel.__init__ (0.16.1 and 0.19.2 ssm/mamba_context_parallel.py): the heads of a TP rank split
        # over CP; its groups too, or CP a multiple of them (each group repeated on CP / groups ranks)
        if (heads // tp) % cp:
            a.fail("context_parallel_size", f"{cp} must divide the {heads // tp} Mamba heads of a tensor-parallel rank "
                   f"(--mamba-num-heads {heads} / TP {tp}; MambaContextParallel asserts it)")
        g_t = groups // tp
        if (g_t < cp and cp % g_t) or (g_t >= cp and g_t % cp):
            a.fail("context_parallel_size", f"{cp} and the {g_t} Mamba groups of a tensor-parallel rank (--mamba-num-"
                   f"groups {groups} / TP {tp}) must divide one another (MambaContextParallel asserts it)")
    has_m = "M" in main + (kw.get("hybrid_mtp_pattern") or "")
    if kw.get("fp8") and has_m and (2 * heads * head_dim + 2 * groups * state + heads) % 16:
        # MambaMixer.__init__ (0.16.1 and 0.19.2) asserts it under FP8 (not FP4): the in_proj output's width (only
        # 'M' layers build a MambaMixer)
        width = 2 * heads * head_dim + 2 * groups * state + heads
        a.fail("mamba_num_heads", f"with --fp8-format the Mamba in_proj output width 2 x {heads * head_dim} (d_inner) "
               f"+ 2 x {groups} x {state} (groups x state) + {heads} (heads) = {width} must be a multiple of 16 "
               "(MambaMixer asserts it)")
    mtp = kw.get("hybrid_mtp_pattern") or ""
    if "E" in main + mtp and not a.get("num_experts"):
        a.fail(PATTERN if _given(a, PATTERN) is not None else LEGACY,
               "has MoE layers ('E') but --num-experts is not set (the MoE layer spec needs experts)")
        return {}
    _refuse(a, kw, ctx, key, main + mtp)
    out: dict[str, Any] = {}
    if kw.get("cpu_offloading_num_layers"):
        # TE's layer-level offload context is entered by TransformerBlock only: HybridStack (0.17.1 to 0.19.2,
        # hybrid_block.py) and 0.16.1's MambaStack run their layers without it, so nothing leaves the GPU
        a.notes.append(f"{a.key('cpu_offloading_num_layers')} {kw['cpu_offloading_num_layers']}: not applied to a "
                       "hybrid model (its HybridStack runs no layer in Transformer Engine's offload context); "
                       "estimated with every layer's activations on the GPU")
        out["cpu_offloading_num_layers"] = 0
    if a.bool_arg("use_mamba_mem_eff_path", True) is False:
        raise NotModelledError(a.key("use_mamba_mem_eff_path"), "the Mamba layers' non-fused path "
                               "(causal_conv1d and the chunk scan as separate autograd functions)")
    return dict(out, mamba_state_dim=state, mamba_head_dim=head_dim, mamba_num_groups=groups, mamba_num_heads=heads,
                mamba_chunk_size=chunk)


def _refuse(a: Args, kw: Mapping[str, Any], ctx: Context, key: str, main: str) -> None:
    """Settings whose effect on a hybrid model memguard has not read: refused by name."""
    if kw.get("transformer_impl", "transformer_engine") != "transformer_engine":
        # training/models/hybrid.py builds hybrid_stack_spec (TE modules) whatever --transformer-impl says
        raise NotModelledError(a.key("transformer_impl"), f"{kw.get('transformer_impl')} with a hybrid model "
                               "(megatron-core builds its TE layer spec whatever the flag says)")
    checks = (
        # MultiTokenPredictionLayer runs its depth in the global FP8 context and ignores FP4 (0.19.2
        # multi_token_prediction.py); its HybridStack opens per-layer contexts again: not read for a '/' pattern
        (kw.get("hybrid_mtp_pattern") and (kw.get("fp8") or kw.get("fp4")), "fp8" if kw.get("fp8") else "fp4",
         "FP8 / FP4 with the MTP depths of a hybrid '/' pattern"),
        # 0.16.1's MambaStack (ssm/mamba_block.py) builds and runs its layers in get_fp8_context only: no FP4 context
        (kw.get("fp4") and ctx.version < Version("0.17"), "fp4", "FP4 in a hybrid model under megatron-core 0.16 (its "
         "MambaStack opens no FP4 context)"),
        (kw.get("moe") is not None and "E" not in main, "num_experts", "mixture-of-experts settings with a hybrid "
         "pattern without MoE ('E') layers"),
        (kw.get("mtp_num_layers") and ctx.version < Version("0.17"), "mtp_num_layers",
         "multi-token prediction with a hybrid model under megatron-core 0.16 (its MambaModel has no MTP block)"),
        # (full recompute of hybrid MTP depths: MultiTokenPredictionLayer._checkpointed_forward (0.19.2) checkpoints
        # the depth under uniform around a HybridStack that checkpoints its own layers again, estimator/core.py
        # _checkpointed_hybrid_depth; under block the depth skips its recompute (a warning) while its HybridStack
        # checkpoints its first --recompute-num-layers layers, _hybrid_depth_block)
        (kw.get("heterogeneous_layers"), "heterogeneous_layers_config_path", "a heterogeneous config with a hybrid "
         "pattern"),
        # HybridModel.preprocess_for_fine_grained_offloading sets up the offload manager from 0.18.2 on (hybrid_model.py);
        # 0.16.1's MambaModel and 0.17.1's HybridModel do not, under TransformerLayers that open offload groups
        (kw.get("fine_grained_activation_offloading") and ctx.version < Version("0.18"),
         "fine_grained_activation_offloading", "fine-grained activation offloading in a hybrid model under "
         "megatron-core 0.16 / 0.17 (its model does not set up the offload manager its attention and MLP layers call)"),
        # MambaMixer.__init__ (0.19.2) raises unless mamba_ssm's fused scan takes state_dtype, which no mamba_ssm release
        # up to 2.3.2.post1 does (ops/triton/ssd_combined.py): a build of its own that was not read
        (kw.get("mamba_training_ssm_states_dtype") or a.get("mamba_training_ssm_states_dtype"),
         "mamba_training_ssm_states_dtype", "another dtype for the Mamba chunk states (MambaMixer needs a mamba_ssm "
         "whose scan takes state_dtype: none of its releases up to 2.3.2.post1)"),
        # FSDP units: torch FSDP2 wraps TransformerLayer (torch_fully_sharded_data_parallel.py 0.19.2), not MambaLayer;
        # Megatron-FSDP takes MambaLayer as a unit from 0.17 on (mcore_fsdp_adapter.py: 0.16.1 TransformerLayer only)
        (kw.get("use_torch_fsdp2") and "M" in main, "use_torch_fsdp2", "torch FSDP2 of Mamba layers (not an FSDP2 "
         "unit: their parameters are sharded with the root module)"),
        (ctx.version < Version("0.17") and kw.get("use_megatron_fsdp") and "M" in main, "use_megatron_fsdp",
         "Megatron-FSDP of Mamba layers under megatron-core 0.16 (its FSDP units are TransformerLayers only)"),
        # (0.17.1's MambaStack, ssm/mamba_block.py, has none either: HybridStack's checkpointed_forward came in 0.18.2)
        (ctx.version < Version("0.18") and kw.get("recompute_granularity") == "full", "recompute_granularity",
         f"full recomputation of a hybrid model under megatron-core {ctx.version.major}.{ctx.version.minor} (its "
         "MambaStack has no checkpointed forward: the flag is not applied)"),
    )
    for bad, dest, what in checks:
        if bad:
            raise NotModelledError(a.key(dest), what)


def with_peft(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """After the PEFT section: LoRA / DoRA on a hybrid model. Megatron-Bridge 0.6.2 matches target_modules against
    each module's own name (peft/module_matcher.py): linear_qkv / linear_proj exist in the '*' layers, linear_fc1 /
    linear_fc2 in the '-' layers; a Mamba layer's in_proj / out_proj are not among memguard's target names, so Mamba
    layers stay frozen and unwrapped (estimator/peft.py). MoE 'E' and MLA '+' layers are refused by the PEFT section.
    A '*' pattern is matched over GPT layers' module names there: refused by name for a hybrid model."""
    main = kw.get("hybrid_layer_pattern")
    spec = kw.get("peft")
    if not main or spec is None:
        return {}
    targets_v = a.get("peft_target_modules")
    if targets_v is not None and any("*" in str(t) for t in ([targets_v] if isinstance(targets_v, str) else targets_v)):
        raise NotModelledError(a.key("peft_target_modules"), "'*' target patterns on a hybrid model (matched over "
                               "GPT layers' module names)")
    excluded = a.get("peft_exclude_modules")
    if ("M" in main and a.given("peft_exclude_modules") and isinstance(excluded, (list, tuple))
            and not ("in_proj" in excluded and "out_proj" in excluded)):
        # ModuleMatcher (Bridge 0.6.2 / NeMo 2.5 peft/module_matcher.py) wraps every linear not excluded: a Mamba layer's
        # in_proj / out_proj (TE linears) too, whose adapters memguard does not size
        raise NotModelledError(a.key("peft_exclude_modules"), "PEFT exclude_modules that leave the Mamba layers' "
                               "in_proj / out_proj wrapped (their adapters are not modelled: add in_proj and out_proj "
                               "to exclude_modules)")
    wrapped = [t for t in spec.target_modules
               if ("*" in main if t in ("linear_qkv", "linear_proj") else "-" in main)]
    if not wrapped:
        a.fail("peft_target_modules", f"wraps no linear of the pattern {main} ({', '.join(spec.target_modules)}: "
               "linear_qkv / linear_proj are in '*' layers, linear_fc1 / linear_fc2 in '-' layers; Megatron-Bridge "
               "would train no parameter)")
    return {}
