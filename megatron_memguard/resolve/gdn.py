"""Section: gated delta net layers (Qwen3-Next style linear attention).

Two ways to get them, one mixer (megatron-core's GatedDeltaNet, ssm/gated_delta_net/ in 0.19.2,
ssm/gated_delta_net.py in 0.16.1): a GPT model with ``--experimental-attention-variant gated_delta_net``, whose
``--linear-attention-freq`` makes each layer a GDN layer (1) or a standard attention layer (0)
(models/gpt/experimental_attention_variant_module_specs.py ``get_linear_attention_pattern``), and a hybrid model's
'G' layers (models/hybrid/hybrid_layer_specs.py: a TransformerLayer whose self-attention is GatedDeltaNet and whose
MLP is an IdentityOp). The mixer's shape is TransformerConfig's linear_* fields (0.19.2 defaults: conv kernel 4,
key / value head dim 128, 16 key heads, 32 value heads) and its rules are TransformerConfig.__post_init__'s.

What memguard has not read is refused by name: FP8 / FP4 GDN layers (their in_proj / out_proj GEMMs), the
deterministic path (a torch chunk loop in fp32), CUDA graphs, activation offloading, LoRA / DoRA and MTP of a GPT
model with GDN layers, heterogeneous configs.
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
    dims = {d: a.int_arg(d, default, minimum=1) for d, default in DIMS.items()}
    if None in dims.values():
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
            raise NotModelledError(a.key("heterogeneous_layers_config_path"), "a heterogeneous config with gated "
                                   "delta net layers")
        if kw.get("mtp_num_layers") and ctx.version < Version("0.19"):
            # megatron/training 0.19.2 models/gpt.py mtp_block_spec builds the MTP layer from the standard GPT layer
            # spec (estimator/params.py mtp_layer_kind); the builders before it pass the block spec, whose last layer
            # may be a GDN layer: not read
            raise NotModelledError(a.key("mtp_num_layers"), "multi-token prediction in a GPT model with gated delta "
                                   f"net layers under megatron-core {ctx.version.major}.{ctx.version.minor} (its "
                                   "builder's MTP layer spec was not read; 0.19 is modelled)")
    _refuse(a, kw)
    return out


def _refuse(a: Args, kw: Mapping[str, Any]) -> None:
    """Settings whose effect on a GDN layer memguard has not read."""
    checks = (
        (kw.get("fp8") or kw.get("fp4"), "fp8", "FP8 / FP4 gated delta net layers (their in_proj / out_proj GEMMs)"),
        (a.bool_arg("deterministic_mode", False), "deterministic_mode", "gated delta net layers in deterministic mode "
         "(torch_chunk_gated_delta_rule: an fp32 chunk loop instead of flash-linear-attention's kernel)"),
        (kw.get("cuda_graph_impl", "none") not in ("none", None), "cuda_graph_impl", "CUDA graphs of gated delta net "
         "layers"),
        (kw.get("cpu_offloading_num_layers"), "cpu_offloading_num_layers", "activation offloading of gated delta net "
         "layers"),
        (kw.get("fine_grained_activation_offloading"), "fine_grained_activation_offloading", "fine-grained activation "
         "offloading of gated delta net layers"),
    )
    for bad, dest, what in checks:
        if bad:
            raise NotModelledError(a.key(dest), what)


def with_peft(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """After the PEFT section: LoRA / DoRA with GDN layers is refused by name (the adapters' targets in a GDN layer,
    in_proj / out_proj, and its frozen tensors were not read)."""
    if kw.get("peft") is not None and (kw.get("linear_attention_pattern") or "G" in (kw.get("hybrid_layer_pattern") or "")):
        raise NotModelledError(a.key("peft_scheme"), "LoRA / DoRA on a model with gated delta net layers")
    return {}
