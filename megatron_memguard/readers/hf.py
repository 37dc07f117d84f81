"""Hugging Face ``config.json``: the model shape (parallelism, batch and sequence length come from
flags or another config).

The translation follows Megatron-Bridge's (0.6.2) ``MegatronModelBridge.CONFIG_MAPPING`` and its
per-family bridges (``LlamaBridge``, ``Qwen2Bridge``, ``Qwen3Bridge``, ``MistralBridge``): HF field ->
megatron-core / GPTModelProvider field, which ``map_mcore_fields`` then turns into Megatron args.
Supported families: llama, mistral, qwen2, qwen3, gpt2 (and their MoE cousins, which resolve() refuses
as not modelled). The vocabulary is config.json's ``vocab_size`` (the embedding rows the checkpoint
has), padded like Megatron pads a tokenizer's vocabulary unless a Bridge/NeMo 2 recipe says otherwise.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..config import RawConfig
from ..errors import ReaderError
from ._common import ArgsBuilder, map_mcore_fields, set_vocab

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3", "gpt2", "mixtral", "qwen2_moe", "qwen3_moe"}


def looks_like_hf(doc: Mapping) -> bool:
    return ("model_type" in doc or "architectures" in doc) and any(
        k in doc for k in ("num_hidden_layers", "n_layer", "hidden_size", "n_embd"))


def hf_to_provider(hf: Mapping[str, Any]) -> dict[str, Any]:
    """HF config fields -> megatron-core / GPTModelProvider fields (what ``to_megatron_provider`` builds)."""
    mt = str(hf.get("model_type", "")).lower()
    if mt not in SUPPORTED:
        raise ReaderError(f"Hugging Face model_type {hf.get('model_type')!r} is not supported "
                          f"(memguard reads {', '.join(sorted(SUPPORTED))}); give the shape as Megatron flags")
    p: dict[str, Any] = {}
    if mt == "gpt2":
        p.update(num_layers=hf["n_layer"], hidden_size=hf["n_embd"], num_attention_heads=hf["n_head"],
                 ffn_hidden_size=hf.get("n_inner") or 4 * hf["n_embd"], vocab_size=hf.get("vocab_size", 50257),
                 seq_length=hf.get("n_positions", 1024), max_position_embeddings=hf.get("n_positions", 1024),
                 position_embedding_type="learned_absolute", normalization="LayerNorm", add_bias_linear=True,
                 share_embeddings_and_output_weights=hf.get("tie_word_embeddings", True),
                 hidden_dropout=hf.get("resid_pdrop", 0.1), attention_dropout=hf.get("attn_pdrop", 0.1))
        return p
    heads = hf["num_attention_heads"]
    p.update(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"],
             num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads") or heads,
             vocab_size=hf.get("vocab_size"), seq_length=hf.get("max_position_embeddings"),
             share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
             normalization="RMSNorm", gated_linear_unit=True, activation_func=hf.get("hidden_act", "silu"),
             position_embedding_type="rope", rotary_base=hf.get("rope_theta", 10000),
             attention_dropout=hf.get("attention_dropout", 0.0), hidden_dropout=0.0)
    if hf.get("head_dim"):
        p["kv_channels"] = hf["head_dim"]
    # Biases: Llama's attention_bias / mlp_bias (False by default), Qwen2's fixed q/k/v bias, Qwen3's
    # attention_bias (False) plus RMSNorm on q and k per head.
    if mt == "qwen2" or mt == "qwen2_moe":
        p.update(add_qkv_bias=True, add_bias_linear=False)
    else:
        p.update(add_qkv_bias=bool(hf.get("attention_bias", False)), add_bias_linear=bool(hf.get("mlp_bias", False)))
    if mt in ("qwen3", "qwen3_moe"):
        p["qk_layernorm"] = True
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if experts:
        p["num_moe_experts"] = experts
        p["moe_router_topk"] = hf.get("num_experts_per_tok")
    # LlamaBridge.provider_bridge (and the Qwen/Mistral bridges that copy it): Megatron-side fusions.
    p.update(bias_activation_fusion=True, masked_softmax_fusion=True, bias_dropout_fusion=True,
             apply_rope_fusion=True, persist_layer_norm=True)
    return p


# Provider field -> the config.json key it came from (for messages that name what the user wrote).
HF_KEYS = {"num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size", "num_query_groups": "num_key_value_heads",
           "kv_channels": "head_dim", "share_embeddings_and_output_weights": "tie_word_embeddings",
           "add_qkv_bias": "attention_bias", "add_bias_linear": "mlp_bias", "activation_func": "hidden_act",
           "rotary_base": "rope_theta", "seq_length": "max_position_embeddings", "num_moe_experts": "num_local_experts",
           "gated_linear_unit": "model_type", "normalization": "model_type", "position_embedding_type": "model_type",
           "qk_layernorm": "model_type"}
GPT2_KEYS = {"num_layers": "n_layer", "hidden_size": "n_embd", "num_attention_heads": "n_head", "ffn_hidden_size": "n_inner",
             "max_position_embeddings": "n_positions", "seq_length": "n_positions"}


def provider_to_raw(p: Mapping[str, Any], source: str, key_prefix: str = "", pad_vocab: bool = True,
                    hf_names: Mapping[str, str] | None = None) -> RawConfig:
    """Megatron args for a provider dict: the model shape only (no sequence length, parallelism or batch)."""
    names = hf_names or {}

    def key(f: str) -> str:
        return key_prefix + names.get(f, f)

    b = ArgsBuilder(source)
    fields = {k: (v, key(k)) for k, v in p.items() if k not in ("vocab_size", "seq_length", "max_position_embeddings")}
    map_mcore_fields(b, fields)
    if p.get("num_query_groups") is not None:
        b.set("group_query_attention", True, key("num_query_groups"))
    if p.get("position_embedding_type") == "learned_absolute" and p.get("max_position_embeddings"):
        b.set("max_position_embeddings", p["max_position_embeddings"], key("max_position_embeddings"))
    set_vocab(b, p.get("vocab_size"), key("vocab_size"), pad=pad_vocab)
    return b.build()


def read_hf_config(doc: Mapping[str, Any], path: str) -> RawConfig:
    """A Hugging Face config.json as a RawConfig holding the model shape."""
    try:
        p = hf_to_provider(doc)
    except KeyError as e:
        raise ReaderError(f"{path}: Hugging Face config without {e.args[0]!r}") from None
    except ReaderError as e:
        raise ReaderError(f"{path}: {e}") from None
    names = GPT2_KEYS if str(doc.get("model_type")) == "gpt2" else HF_KEYS
    return provider_to_raw(p, f"Hugging Face config {path}", pad_vocab=True, hf_names=names)
