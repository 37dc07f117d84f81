"""Section: gated delta net layers (Qwen3-Next style linear attention).

Two ways to get them, one mixer (megatron-core's GatedDeltaNet, ssm/gated_delta_net/ in 0.19.2,
ssm/gated_delta_net.py in 0.16.1): a GPT model with ``--experimental-attention-variant gated_delta_net``, whose
``--linear-attention-freq`` makes each layer a GDN layer (1) or a standard attention layer (0)
(models/gpt/experimental_attention_variant_module_specs.py ``get_linear_attention_pattern``), and a hybrid model's
'G' layers (models/hybrid/hybrid_layer_specs.py: a TransformerLayer whose self-attention is GatedDeltaNet and whose
MLP is an IdentityOp). The mixer's shape is TransformerConfig's linear_* fields (0.19.2 defaults: conv kernel 4,
key / value head dim 128, 16 key heads, 32 value heads) and its rules are TransformerConfig.__post_init__'s.

CUDA graphs, activation offloading and LoRA / DoRA take GDN layers as megatron-core builds them (a TransformerLayer
whose self_attention is GatedDeltaNet, input_layernorm IdentityOp): estimator/cuda_graphs.py, estimator/core.py and
estimator/peft.py say what each does to them; under FP8 / FP4 in_proj and out_proj are TE GEMMs (estimator/fp8_layers.py),
the conv1d and the kernel BF16. What memguard has not read is refused by name: the deterministic path (a torch chunk
loop in fp32), MTP of a GPT model with GDN layers before 0.19, heterogeneous configs before 0.19 (on 0.19 the
variant's spec builds whole layers: _heterogeneous_layers).
"""
from __future__ import annotations

from typing import Any, Mapping

from packaging.version import Version

from ..errors import ConfigError, NotModelledError
from .args import Args, Context

VARIANT = "gated_delta_net"
# TransformerConfig 0.19.2 (and 0.16.1) defaults of the mixer's shape
DIMS = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32}


def linear_attention_pattern(value: Any, num_layers: int, key: str = "--linear-attention-freq") -> str:
    """One character per layer, '1' GDN and '0' standard attention, as get_linear_attention_pattern reads
    --linear-attention-freq: an int N makes layer i (0-based) standard attention iff (i + 1) % N == 0; a list (or a
    list expression such as ``([1]*3+[0]*1)*12``, read without eval) gives one 0/1 per layer."""
    from ..readers.moe_freq import parse_moe_layer_freq as read_freq
    freq = read_freq(value, key)
    if isinstance(freq, int):
        if freq < 1:
            # (i + 1) % 0 raises ZeroDivisionError in the spec; a negative N is no frequency
            raise ConfigError(key, f"must be a positive integer (every N-th layer is standard attention), got {freq}")
        return "".join("0" if (i + 1) % freq == 0 else "1" for i in range(num_layers))
    if len(freq) != num_layers:
        # get_linear_attention_pattern asserts it ("Invalid length of linear_attention_pattern")
        raise ConfigError(key, f"has {len(freq)} entries but --num-layers is {num_layers}; give one 0/1 per layer")
    return "".join("1" if v else "0" for v in freq)


def gdn(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """The GDN layers' pattern and the mixer's shape, with TransformerConfig's rules."""
    variant = a.get("experimental_attention_variant")
    # (a value outside TransformerConfig's Literal is reported once, by the DSA section: resolve/dsa.py)
    variant = None if variant in (None, False, "None") else str(variant)
    hybrid = kw.get("hybrid_layer_pattern") or ""
    mtp_hybrid = kw.get("hybrid_mtp_pattern") or ""
    gpt = variant == VARIANT and not hybrid
    has_gdn = gpt or "G" in hybrid + mtp_hybrid
    # (a hybrid model with the variant flag: its builder ignores the flag, but TransformerConfig.__post_init__ checks
    # the GDN settings on it all the same, 'G' layers or not)
    if not has_gdn and variant != VARIANT:
        return {}
    before = len(a.errors)
    dims = {d: a.int_arg(d, default, minimum=1) for d, default in DIMS.items()}
    if None in dims.values() or len(a.errors) > before:
        # (int_arg gives the default back with its error: the head rules below would name a count nobody wrote)
        return {}
    kh, vh = dims["linear_num_key_heads"], dims["linear_num_value_heads"]
    tp, cp = kw["tensor_model_parallel_size"], kw.get("context_parallel_size", 1)
    old = ctx.version < Version("0.18")     # 0.16.1 / 0.17.1: no CP for GDN (TransformerConfig asserts CP 1)
    if vh % kh:
        # TransformerConfig.__post_init__ asserts it with the variant set; GatedDeltaNet's repeat_interleave needs it
        a.fail("linear_num_value_heads", f"({vh}) must be a multiple of --linear-num-key-heads ({kh}) "
               "(TransformerConfig)")
    # GatedDeltaNet splits the heads over TP (0.16.1, 0.17.1) and over TP x CP (0.18.2+: CP runs as an all-to-all
    # of heads)
    split, what = (tp, "tensor-model-parallel size") if old else (tp * cp, "tensor-model-parallel x context-parallel size")
    for dest, heads in (("linear_num_key_heads", kh), ("linear_num_value_heads", vh)):
        if heads % split:
            a.fail(dest, f"({heads}) must be a multiple of the {what} ({split}) (TransformerConfig)")
    if old and cp > 1:
        # TransformerConfig.__post_init__ (core 0.16.1, 0.17.1): "Gated delta net does not support context parallel"
        a.fail("context_parallel_size", f"must be 1 with gated delta net layers under megatron-core "
               f"{ctx.version.major}.{ctx.version.minor} (TransformerConfig; CP for GDN came in 0.18)")
    if variant == VARIANT and hybrid and a.get("linear_attention_freq") in (None, "", "None"):
        # TransformerConfig.__post_init__ asserts it whenever the variant is gated_delta_net; the hybrid builder then
        # takes its GDN layers from the pattern's 'G' and never reads the frequency
        a.fail("linear_attention_freq", "must be set with --experimental-attention-variant gated_delta_net, in a "
               "hybrid model too (TransformerConfig asserts it)", "drop --experimental-attention-variant: a hybrid "
               "model's 'G' layers need no variant flag")
    if not has_gdn:
        return {}
    out: dict[str, Any] = dict(dims)
    if gpt:
        freq = a.get("linear_attention_freq")
        if freq in (None, "", "None"):
            a.fail("linear_attention_freq", "must be set with --experimental-attention-variant gated_delta_net "
                   "(TransformerConfig asserts it)", "e.g. --linear-attention-freq 4 (three GDN layers, then one "
                   "attention layer)")
            return {}
        try:
            out["linear_attention_pattern"] = linear_attention_pattern(freq, kw["num_layers"], a.key("linear_attention_freq"))
        except ConfigError as e:
            a.fail("linear_attention_freq", e.rule)
            return {}
        if kw.get("transformer_impl", "transformer_engine") != "transformer_engine":
            # _get_backend_spec_provider asserts the TE implementation (experimental_attention_variant_module_specs.py)
            a.fail("transformer_impl", "must be transformer_engine with --experimental-attention-variant "
                   "(the experimental attention spec builds TE modules only)")
        if kw.get("heterogeneous_layers"):
            het = _heterogeneous_layers(a, kw, ctx, out["linear_attention_pattern"])
            if het is None:
                return {}
            out["heterogeneous_layers"] = het
        if kw.get("mtp_num_layers") and ctx.version < Version("0.19"):
            # megatron/training 0.19.2 models/gpt.py mtp_block_spec builds the MTP layer from the standard GPT layer
            # spec (estimator/params.py mtp_layer_kind); the builders before it pass the block spec, whose last layer
            # may be a GDN layer: not read
            raise NotModelledError(a.key("mtp_num_layers"), "multi-token prediction in a GPT model with gated delta "
                                   f"net layers under megatron-core {ctx.version.major}.{ctx.version.minor} (its "
                                   "builder's MTP layer spec was not read; 0.19 is modelled)")
    if kw.get("fp8"):
        # _GDNBase.__init__ (core 0.19.2 common.py; 0.16.1 gated_delta_net.py) asserts it under FP8 (not FP4): in_proj's
        # whole output width, 2 Hk dk + 2 Hv dv + 2 Hv, a multiple of get_fp8_align_size (32 for mxfp8, else 16)
        width = 2 * kh * dims["linear_key_head_dim"] + 2 * vh * dims["linear_value_head_dim"] + 2 * vh
        align = 32 if kw.get("fp8_recipe") == "mxfp8" else 16
        if width % align:
            a.fail("linear_num_value_heads", f"with --fp8-format the gated delta net in_proj output width {width} "
                   f"(2 x {kh} x {dims['linear_key_head_dim']} + 2 x {vh} x {dims['linear_value_head_dim']} + 2 x {vh}) "
                   f"must be a multiple of {align} (GatedDeltaNet asserts it)")
    _refuse(a, kw)
    return out


def _heterogeneous_layers(a: Args, kw: Mapping[str, Any], ctx: Context, pattern: str) -> str | None:
    """The layers of a heterogeneous config with --experimental-attention-variant gated_delta_net. megatron/training
    0.19.2 (models/gpt.py default_layer_spec) takes the experimental variant's block spec before the MoE and the
    heterogeneous ones, so every layer is a GDN or a standard attention layer by --linear-attention-freq, with a dense
    or MoE MLP by --moe-layer-freq: no-op and replace_with_linear blocks are built as whole layers. TransformerBlock
    still builds each layer from get_config_for_layer (heterogeneous_block_specs), which overrides num_query_groups
    (an attention layer's; GatedDeltaNet reads none) and ffn_hidden_size (a dense MLP's; the block's, or the model's
    for a no-op / linear block), as resolve/heterogeneous.py's MoE case. Rewrites its "mixer/mlp" words."""
    key = a.key("heterogeneous_layers_config_path")
    if ctx.version < Version("0.19"):
        # the 0.16 to 0.18 layer spec choice is Megatron-LM's gpt_builders.py, in no wheel read (as for MoE layers)
        raise NotModelledError(key, f"a heterogeneous config with gated delta net layers in megatron-core "
                               f"{ctx.version} (the model builders before 0.19, Megatron-LM's gpt_builders.py, are not "
                               "in the wheels read)")
    words = str(kw["heterogeneous_layers"]).split(",")
    if len(words) != len(pattern):
        return None      # (the heterogeneous section reported the block count)
    out = []
    for word, m in zip(words, pattern):
        mixer, mlp = word.split("/")
        mixer = "gdn" if m == "1" else (mixer if mixer.startswith("attention") else "attention")
        mlp = mlp if mlp.startswith(("dense", "moe")) else "dense"
        out.append(f"{mixer}/{mlp}")
    if any(not w.split("/")[0].startswith("attention") or w.split("/")[1] in ("none", "linear") for w in words):
        a.notes.append(f"{key}: with --experimental-attention-variant gated_delta_net Megatron 0.19 builds the variant's "
                       "block spec, so no-op and replace_with_linear blocks are built as full GDN / attention and MLP "
                       "layers")
    return ",".join(out)


def _refuse(a: Args, kw: Mapping[str, Any]) -> None:
    """Settings whose effect on a GDN layer memguard has not read."""
    checks = (
        (a.bool_arg("deterministic_mode", False), "deterministic_mode", "gated delta net layers in deterministic mode "
         "(torch_chunk_gated_delta_rule: an fp32 chunk loop instead of flash-linear-attention's kernel)"),
    )
    for bad, dest, what in checks:
        if bad:
            raise NotModelledError(a.key(dest), what)


def with_peft(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """After the PEFT section: LoRA / DoRA on a model with GDN layers. Megatron-Bridge 0.6.2 matches target_modules
    against each module's own name (peft/module_matcher.py): a GDN layer's in_proj / out_proj are none of linear_qkv,
    linear_proj, linear_fc1, linear_fc2, so its mixer stays frozen and unwrapped (estimator/peft.py); a GPT model's GDN
    layers have an MLP, whose linear_fc1 / linear_fc2 are wrapped as any layer's, and its attention layers' linear_qkv /
    linear_proj. (A hybrid model's 'G' layers: hybrid.with_peft.) '*' patterns and exclude_modules are matched over
    full module names, where Bridge would also wrap in_proj / out_proj (TE linears): refused unless both are excluded."""
    pattern = kw.get("linear_attention_pattern") or ""
    spec = kw.get("peft")
    if spec is None or not (pattern or "G" in (kw.get("hybrid_layer_pattern") or "")):
        return {}
    targets_v = a.get("peft_target_modules")
    targets_l = [targets_v] if isinstance(targets_v, str) else list(targets_v or [])
    if any("*" in str(t) for t in targets_l):
        raise NotModelledError(a.key("peft_target_modules"), "'*' target patterns on a model with gated delta net "
                               "layers (a pattern can match their in_proj / out_proj, which memguard does not wrap)")
    excluded = a.get("peft_exclude_modules")
    if a.given("peft_exclude_modules") and isinstance(excluded, (list, tuple)) and not (
            "in_proj" in excluded and "out_proj" in excluded):
        # ModuleMatcher wraps every linear not excluded: the GDN layers' in_proj and out_proj too
        raise NotModelledError(a.key("peft_exclude_modules"), "PEFT exclude_modules that leave the gated delta net "
                               "layers' in_proj / out_proj wrapped (their adapters are not modelled: add in_proj and "
                               "out_proj to exclude_modules)")
    if pattern and "0" not in pattern and not {"linear_fc1", "linear_fc2"} & set(spec.target_modules):
        a.fail("peft_target_modules", f"wraps no linear: every layer is a gated delta net layer, which has no "
               f"{' / '.join(spec.target_modules)} (Megatron-Bridge would train no parameter)",
               "target linear_fc1 / linear_fc2")
    return {}
