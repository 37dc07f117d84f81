"""Section: LoRA / DoRA fine-tuning (Megatron-Bridge ``peft:``, run_recipe.py ``--mode lora|dora``, NeMo 1
``model.peft``). Megatron-LM has no PEFT: its flags never set these dests; the Bridge and NeMo readers do
(``peft_scheme``, ``peft_dim``, ``peft_alpha``, ``peft_dropout``, ``peft_dropout_position``,
``peft_target_modules``). The rules are those Bridge 0.6.2 applies when it builds the adapters
(megatron/bridge/peft/lora.py, dora.py, utils.py ParallelLinearAdapter)."""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import ConfigError, NotModelledError
from ..layout.peft import COLUMN_TARGETS, DEFAULT_TARGETS, ROW_TARGETS, SCHEME_NAMES, PeftSpec
from ..numbers import shown
from .args import Args, Context

SCHEMES = ("lora", "dora")
# Bridge's defaults: LoRA dim 32, alpha 32; DoRA dim 32, alpha 64; dropout 0.0 before the adapter (lora.py, dora.py)
DEFAULT_ALPHA = {"lora": 32, "dora": 64}


def _refuse_with(a: Args, kw: Mapping[str, Any]) -> None:
    """The features whose PEFT memory is not modelled: refused by name (the key that turns them on)."""
    what = None
    if kw.get("transformer_impl") != "transformer_engine":
        what, dest = "PEFT with --transformer-impl local (Bridge builds Transformer Engine layers)", "transformer_impl"
    elif kw.get("moe") is not None:
        what, dest = "PEFT of a mixture-of-experts model (expert and router adapters)", "num_experts"
    elif kw.get("multi_latent_attention"):
        what, dest = "PEFT with multi-latent attention (its linears are not linear_qkv)", "multi_latent_attention"
    elif kw.get("fp8") or kw.get("fp4"):
        what, dest = "PEFT with FP8 / FP4 base weights", "fp8" if kw.get("fp8") else "fp4"
    elif kw.get("use_megatron_fsdp") or kw.get("use_torch_fsdp2"):
        what, dest = "PEFT under FSDP", "use_megatron_fsdp" if kw.get("use_megatron_fsdp") else "use_torch_fsdp2"
    elif kw.get("optimizer_cpu_offload"):
        what, dest = "PEFT with the optimizer offloaded to the CPU", "optimizer_cpu_offload"
    elif kw.get("optimizer") not in ("adam", "sgd"):
        what, dest = f"PEFT with the {kw.get('optimizer')} optimizer", "optimizer"
    elif kw.get("freeze_all_layers"):
        what, dest = "PEFT with --freeze-all-layers", "freeze_all_layers"
    elif kw.get("heterogeneous_layers"):
        what, dest = "PEFT of heterogeneous layers", "heterogeneous_layers_config_path"
    elif kw.get("mtp_num_layers"):
        what, dest = "PEFT with multi-token prediction layers", "mtp_num_layers"
    elif kw.get("cuda_graph_impl", "none") != "none":
        what, dest = "PEFT with CUDA graphs", "cuda_graph_impl"
    elif kw.get("use_transformer_engine_op_fuser"):
        # TP 1 takes TEFusedLoRALinear (lora_layers.py), another autograd path
        what, dest = "PEFT with Transformer Engine's operation fuser (TEFusedLoRALinear)", "use_transformer_engine_op_fuser"
    elif kw.get("ddp_reduce_scatter_with_fp32_accumulation"):
        what, dest = "PEFT with fp32 reduce-scatter accumulation", "ddp_reduce_scatter_with_fp32_accumulation"
    elif kw.get("ddp_param_name_patterns_for_fp32_local_accumulation"):
        what, dest = ("PEFT with fp32 local gradient accumulation patterns",
                      "ddp_param_name_patterns_for_fp32_local_accumulation")
    elif kw.get("cpu_offloading_num_layers") or kw.get("fine_grained_activation_offloading"):
        what, dest = "PEFT with activation offloading", "cpu_offloading_num_layers"
    if what:
        raise NotModelledError(a.key(dest), what)


# The module names of a GPT model's decoder layer and around it, as the PEFT walk sees them (megatron-core
# gpt_model.py / transformer_layer.py attribute names); '{i}' is the layer's index in its pipeline stage.
_LAYER_MODULES = ("decoder.layers.{i}", "decoder.layers.{i}.input_layernorm", "decoder.layers.{i}.self_attention",
                  "decoder.layers.{i}.self_attention.core_attention", "decoder.layers.{i}.self_attention.q_layernorm",
                  "decoder.layers.{i}.self_attention.k_layernorm", "decoder.layers.{i}.pre_mlp_layernorm",
                  "decoder.layers.{i}.mlp")
_TARGET_MODULES = {"linear_qkv": "decoder.layers.{i}.self_attention.linear_qkv",
                   "linear_proj": "decoder.layers.{i}.self_attention.linear_proj",
                   "linear_fc1": "decoder.layers.{i}.mlp.linear_fc1", "linear_fc2": "decoder.layers.{i}.mlp.linear_fc2"}
_OTHER_MODULES = ("", "embedding", "embedding.word_embeddings", "embedding.position_embeddings", "decoder",
                  "decoder.layers", "decoder.final_layernorm", "output_layer", "rotary_pos_emb")
# prefixes the wrappers may put before those names (DDP / Float16Module's 'module.', a chunk list's index)
_PREFIXES = ("", "module.", "module.module.", "0.module.", "0.module.module.")


_REGEX_SYNTAX = frozenset("\\^$+?{}[]()|")
_LONGEST_NAME = 256   # characters: the longest module name below ('0.module.module.decoder.layers.N.self_attention...')


def _wildcard_regex(key: str, pattern: str) -> Any:
    """The frameworks' regex for ``pattern``, matched without backtracking: with '*' -> '(.*)' Python's re takes time
    exponential in the stars on a name that does not match ('*.*.*.*.*.*.*.*Z' ran past 60 s), so the pattern is
    matched as the glob it is (fnmatch's translation, linear; '.' is any one character as in the regex). Other regex
    syntax (a leading '^' and a trailing '$' aside, which the frameworks' anchors make redundant) is refused by name."""
    import fnmatch
    import re
    body = pattern[1:] if pattern.startswith("^") else pattern
    body = body[:-1] if body.endswith("$") else body
    syntax = sorted(set(body) & _REGEX_SYNTAX)
    if syntax:
        try:
            re.compile("^" + pattern.replace("*", "(.*)") + "$")
        except re.error as exc:   # (Bridge's own re.compile raises the same)
            raise ConfigError(key, f"{shown(pattern)} is not a valid pattern ({exc})") from None
        raise NotModelledError(key, f"PEFT target {shown(pattern)}: regular-expression syntax ({' '.join(syntax)}) "
                               "beside '*' and '.'; memguard matches Bridge's '*' wildcards and '.' only")
    if len(body) - body.count("*") > _LONGEST_NAME:
        return None   # (more characters than any module name has: it matches none, without compiling 10**5 groups)
    return re.compile(fnmatch.translate(body.replace(".", "?")))


def wildcard_targets(a: Args, pattern: str, num_layers: int) -> list[str]:
    """The linears a ``*`` pattern of target_modules wraps, matched as Megatron-Bridge 0.6.2 and NeMo 2.5 match it
    (peft/utils.py wildcard_match: '^' + pattern with '*' -> '(.*)' + '$' on the module's full name, dots unescaped).
    memguard models a target wrapped in every layer: a pattern that matches a linear in some layers only, matches
    another module (the output layer, a norm, a whole layer), or depends on the wrappers' name prefix is refused."""
    key = a.key("peft_target_modules")
    rx = _wildcard_regex(key, pattern)
    if rx is None:
        raise NotModelledError(key, f"PEFT target {shown(pattern)}: it matches none of linear_qkv, linear_proj, "
                               "linear_fc1, linear_fc2")
    hit = lambda name: {bool(rx.match(p + name)) for p in _PREFIXES}   # noqa: E731
    found: list[str] = []
    layers = range(max(num_layers, 1))
    for name in _OTHER_MODULES + tuple(m.format(i=i) for i in layers for m in _LAYER_MODULES):
        if True in hit(name):
            raise NotModelledError(key, f"PEFT target {shown(pattern)}: it matches {name or 'the model'!r}, "
                                   "not a linear memguard wraps (linear_qkv, linear_proj, linear_fc1, linear_fc2)")
    for target, template in _TARGET_MODULES.items():
        seen = set().union(*(hit(template.format(i=i)) for i in layers))
        if seen == {True}:
            found.append(target)
        elif True in seen:
            raise NotModelledError(key, f"PEFT target {shown(pattern)}: it wraps {target} in some layers (or under "
                                   "some module prefixes) only; memguard models a target wrapped in every layer")
    if not found:
        raise NotModelledError(key, f"PEFT target {shown(pattern)}: it matches none of linear_qkv, linear_proj, "
                               "linear_fc1, linear_fc2")
    return found


def excluded_complement(a: Args, patterns: Any, num_layers: int) -> tuple[str, ...]:
    """The linears an empty target_modules wraps: every linear module not in ``exclude_modules`` (Megatron-Bridge
    0.6.2 / NeMo 2.5 peft/module_matcher.py: ``name not in exclude_modules`` and no pattern wildcard-matching the
    full name, for ColumnParallelLinear, RowParallelLinear, nn.Linear and the TE linears). In a dense GPT model those
    are each layer's linear_qkv, linear_proj, linear_fc1, linear_fc2 and the output layer (a ColumnParallelLinear,
    tied embeddings too). memguard models the four in every layer: the output layer must be excluded, and a pattern
    excluding a linear in some layers (or under some wrapper prefixes) only is refused."""
    import re
    key = a.key("peft_exclude_modules")
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(x, str) for x in patterns):
        a.fail("peft_exclude_modules", f"must be a list of module names, got {shown(patterns)}")
        return ()
    rxs = []
    for pat in patterns:
        try:
            rxs.append(re.compile("^" + pat.replace("*", "(.*)") + "$"))
        except re.error as exc:
            raise ConfigError(key, f"{shown(pat)} is not a valid pattern ({exc})") from None

    def excluded(local: str, full: str) -> set[bool]:
        return {local in patterns or any(rx.match(p + full) for rx in rxs) for p in _PREFIXES}

    if excluded("output_layer", "output_layer") != {True}:
        if not patterns:
            raise NotModelledError(a.key("peft_target_modules"), "PEFT with an empty target_modules (Bridge then "
                                   "wraps every linear not excluded)")
        raise NotModelledError(key, "PEFT whose exclude_modules leave the output layer wrapped (its adapter is not "
                               "modelled: add output_layer to exclude_modules)")
    kept: list[str] = []
    for target, template in _TARGET_MODULES.items():
        seen = set().union(*(excluded(target, template.format(i=i)) for i in range(max(num_layers, 1))))
        if seen == {False}:
            kept.append(target)
        elif seen != {True}:
            raise NotModelledError(key, f"PEFT exclude_modules that keep {target} out of some layers (or under some "
                                   "module prefixes) only; memguard models a target wrapped in every layer")
    if not kept:
        a.fail("peft_exclude_modules", "excludes every linear: no adapter, nothing to train",
               "leave at least one of linear_qkv, linear_proj, linear_fc1, linear_fc2 out of it")
    return tuple(kept)


def peft(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    scheme_v = a.get("peft_scheme")
    if scheme_v is None:
        return {"peft": None}
    scheme = str(scheme_v).strip().lower()
    if scheme not in SCHEMES:
        a.fail("peft_scheme", f"unknown PEFT scheme {shown(scheme_v)}", "lora or dora (other adapters are not modelled)")
        return {"peft": None}
    if a.bool_arg("peft_sp_input_regather", False):
        raise NotModelledError(a.key("peft_sp_input_regather"), "LoRA sequence_parallel_input_regather")
    dim = a.int_arg("peft_dim", 32)
    alpha = a.float_arg("peft_alpha", DEFAULT_ALPHA[scheme])
    dropout = a.float_arg("peft_dropout", 0.0)
    if not 0.0 <= dropout < 1.0:
        a.fail("peft_dropout", f"must be in [0, 1), got {shown(a.get('peft_dropout'))}")
        dropout = 0.0
    position = str(a.get("peft_dropout_position", "pre")).strip().lower()
    if position not in ("pre", "post"):
        a.fail("peft_dropout_position", f"must be pre or post, got {shown(a.get('peft_dropout_position'))}")
        position = "pre"
    if scheme == "dora" and position != "pre":
        # dora.py __post_init__ asserts it
        a.fail("peft_dropout_position", "DoRA supports dropout_position 'pre' only")
    targets_v = a.get("peft_target_modules")
    if targets_v is None:
        targets: tuple[str, ...] = DEFAULT_TARGETS
    else:
        items = [targets_v] if isinstance(targets_v, str) else list(targets_v) if isinstance(targets_v, (list, tuple)) else None
        if items is None or not all(isinstance(t, str) for t in items):
            a.fail("peft_target_modules", f"must be a list of module names, got {shown(targets_v)}")
            return {"peft": None}
        targets = tuple(dict.fromkeys(items))     # (no strip: Bridge matches " linear_qkv " to no module)
    if a.given("peft_exclude_modules") and (targets_v is None or targets):
        # ModuleMatcher.match (Bridge 0.6.2 / NeMo 2.5 peft/module_matcher.py): "exclude_modules should be empty when
        # using target_modules" (LoRA's default target_modules are the four linears)
        a.fail("peft_exclude_modules", "must be empty when target_modules is set (Bridge's ModuleMatcher asserts it; "
               "LoRA's default target_modules are linear_qkv, linear_proj, linear_fc1, linear_fc2)",
               "give target_modules: [] with exclude_modules")
        return {"peft": None}
    if targets_v is not None and not targets:
        # no target: every linear module not excluded gets an adapter
        targets = excluded_complement(a, a.get("peft_exclude_modules") or [], int(kw.get("num_layers") or 1))
    elif targets_v is not None:
        expanded: list[str] = []
        for t in targets:
            if t in COLUMN_TARGETS | ROW_TARGETS:
                expanded.append(t)
            elif "*" in t:
                expanded += wildcard_targets(a, t, int(kw.get("num_layers") or 1))
            else:
                raise NotModelledError(a.key("peft_target_modules"), f"PEFT of {shown(t)} (memguard models "
                                       "linear_qkv, linear_proj, linear_fc1, linear_fc2 in every layer)")
        targets = tuple(dict.fromkeys(expanded))
    _refuse_with(a, kw)
    tp = kw["tensor_model_parallel_size"]
    if dim is not None and tp > 1 and dim % tp and COLUMN_TARGETS & set(targets):
        # a column-parallel target's linear_in is a ColumnParallelLinear(in, dim): megatron-core splits dim over TP
        # (tensor_parallel/layers.py divide() asserts it)
        a.fail("peft_dim", f"{dim} must be divisible by the tensor-parallel size {tp} "
                           "(the adapters of linear_qkv / linear_fc1 split their rank over TP)")
    if scheme == "dora" and dropout > 0:
        raise NotModelledError(a.key("peft_dropout"), "DoRA with dropout > 0 (a second base forward)")
    a.notes.append(f"{SCHEME_NAMES[scheme]} rank {dim} on {', '.join(targets)}: base weights frozen (no gradients, no "
                   "optimizer state); the adapters are the only trained parameters")
    variant = str(a.get("peft_variant", "fused")).strip().lower()
    if variant not in ("fused", "canonical"):
        a.fail("peft_variant", f"must be fused or canonical, got {shown(a.get('peft_variant'))}")
        variant = "fused"
    if variant == "canonical" and scheme != "lora":
        a.fail("peft_variant", "the canonical (unfused) adapters are LoRA's (NeMo 1)")
    layers = _selected_layers(a, int(kw.get("num_layers") or 0))
    if layers is not None:
        a.notes.append(f"{a.key('peft_layers')}: adapters on layers {', '.join(map(str, layers))} only (their "
                       "parameters, gradients and optimizer states there); activations are counted as if every layer "
                       "had adapters (an upper bound: layers without them keep no adapter tensors, and those below "
                       "the first one on the first stage keep none)")
    return {"peft": PeftSpec(scheme, dim or 32, alpha, dropout, position, targets, variant, layers)}


def _selected_layers(a: Args, num_layers: int) -> tuple[int, ...] | None:
    """NeMo 1's ``layer_selection``: the layer numbers (1-based, global) that get adapters, None for every layer.
    NeMo 1 (nemo_toolkit 2.2.1 nlp_adapter_mixins.py _check_and_add_peft_cfg) adds them to a layer when
    ``layer.layer_number in (layer_selection or range(1, num_layers + 1))``: an empty list selects every layer, a
    number no layer has selects nothing."""
    v = a.get("peft_layers")
    if v is None:
        return None
    items = list(v) if isinstance(v, (list, tuple)) else None
    if items is None or not all(isinstance(n, int) and not isinstance(n, bool) for n in items):
        a.fail("peft_layers", f"must be a list of layer numbers, got {shown(v)}")
        return None
    if not items:
        return None
    chosen = tuple(sorted({n for n in items if 1 <= n <= num_layers}))
    if not chosen:
        a.fail("peft_layers", f"selects none of the model's layers 1..{num_layers}: no parameter would be trained",
               f"name layers between 1 and {num_layers}")
        return None
    return None if len(chosen) == num_layers else chosen
