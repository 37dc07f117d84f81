"""Section helper: the deprecated --hybrid-attention-ratio / --hybrid-mlp-ratio of a hybrid Mamba model, read as
megatron-core reads them (the pattern they derive, 0.16's count rule against an override pattern)."""
from __future__ import annotations

from packaging.version import Version

from .args import Args, Context, Stop

NAMES = {"M": "Mamba", "*": "attention", "-": "MLP", "E": "MoE"}

RATIOS = ("hybrid_attention_ratio", "hybrid_mlp_ratio")


def pattern_from_ratios(num_layers: int, attention_ratio: float, mlp_ratio: float) -> str:
    """The layer pattern megatron-core derives from the deprecated ratios: attention layers evenly spaced, starting
    and ending with Mamba layers, then MLP layers spread over the remaining Mamba ones. The algorithm of 0.19.2's
    ``pattern_from_ratios`` (models/hybrid/hybrid_layer_allocation.py; 0.17.1 and 0.18.2 the same) and 0.16.1's
    ``_allocate_auto`` (ssm/mamba_hybrid_layer_allocation.py), which are one algorithm; Python's round()."""
    attention = round(num_layers * attention_ratio)
    mamba = num_layers - attention
    section = mamba / (attention + 1)
    kinds = ["M"] * num_layers
    x = section
    for i in range(num_layers):
        if x < 0.5:
            kinds[i] = "*"
            x += section
        else:
            x -= 1
    mlp = round(num_layers * mlp_ratio)
    if mlp > 0:
        step = (mamba - mlp) / mlp
        x = step
        for i in range(num_layers):
            if kinds[i] == "M":
                if x < 0.5:
                    kinds[i] = "-"
                    x += step
                else:
                    x -= 1
    return "".join(kinds)


def from_ratios(a: Args, ctx: Context, text: str | None, legacy: str | None) -> str | None:
    """--hybrid-attention-ratio / --hybrid-mlp-ratio (deprecated): the pattern they derive when no pattern is given
    (0.16.1 MambaStack's allocate_layers; 0.17.1 to 0.19.2 HybridModel.__init__, pattern_from_ratios), or None.

    Both ratios in [0, 1] with a sum <= 1 (asserts). With 0.16's --hybrid-override-pattern, allocate_layers requires
    the pattern to hold as many layers of each kind as the ratios give ("must match the number in the overridden
    pattern"). From 0.17 on, no Megatron-LM parser has the flags and its model builder (and Megatron-Bridge 0.6.2's
    HybridModelProvider.provide) passes only the pattern to HybridModel: ratios beside a pattern are ignored (noted)."""
    if all(a.get(d) in (None, "") for d in RATIOS):
        return None
    seen = len(a.errors)
    attn, mlp = a.float_arg(RATIOS[0], 0.0), a.float_arg(RATIOS[1], 0.0)
    if len(a.errors) > seen:
        raise Stop
    for dest, v in zip(RATIOS, (attn, mlp)):
        if not 0.0 <= v <= 1.0:
            a.fail(dest, f"must be between 0 and 1, got {v} (allocate_layers / pattern_from_ratios assert it)")
            raise Stop
    if attn + mlp > 1.0:
        a.fail(RATIOS[1], f"{mlp} plus --hybrid-attention-ratio {attn} must be at most 1 (allocate_layers / "
               "pattern_from_ratios assert it)")
        raise Stop
    if not attn and not mlp:
        return None            # (0 derives no layer of that kind: megatron-core skips the ratios)
    named = RATIOS[0] if attn else RATIOS[1]
    if text is None and legacy is None:
        if a.key(named).startswith("model."):
            return None        # (a Bridge provider without a pattern: its reader refuses it by name)
        n = a.int_arg("num_layers", required=True)
        if n is None:
            raise Stop
        derived = pattern_from_ratios(n, attn, mlp)
        a.notes.append(f"{a.key(named)}: the layer pattern {derived} ({n} layers) derived as megatron-core does "
                       "(pattern_from_ratios)")
        return derived
    given = (text if text is not None else legacy or "").split("/")[0].replace("|", "")
    if ctx.version < Version("0.17") and legacy is not None and text is None:
        n = len(given)
        auto = pattern_from_ratios(n, attn, mlp)
        if any(auto.count(sym) != given.count(sym) for sym in "M*-E"):
            counts = ", ".join(f"{auto.count(sym)} {NAMES[sym]}" for sym in "M*-" if auto.count(sym))
            a.fail("hybrid_override_pattern", f"must hold as many layers of each kind as the ratios give ({counts}: "
                   f"{auto}; 0.16's allocate_layers raises on a pattern that does not match them)")
            raise Stop
        return None
    a.notes.append(f"{a.key(named)}: ignored beside the layer pattern (megatron-core 0.17+ builds the pattern given; "
                   "the ratios are deprecated)")
    return None
