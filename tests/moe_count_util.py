"""Whole-model parameter counts from flat Megatron arguments, written out by hand from megatron-core's
module shapes (GPTModel with TE layers, gated MLPs, RMSNorm), for checking what the readers make of a
Hugging Face config.json against the counts transformers builds (tests/data/moe_reference_counts.json).

Deliberately independent of memguard's estimator: it checks the readers' translation, not the
estimator's arithmetic (the estimator's per-rank counts are checked against real megatron-core
elsewhere)."""
from __future__ import annotations

from typing import Any, Mapping

from megatron_memguard.readers.moe_freq import moe_layers


def megatron_param_counts(a: Mapping[str, Any]) -> dict[str, int]:
    """Parameters by role (the roles of scripts/hf_moe_param_counts.py) of the model ``a`` describes
    (TP = PP = EP = 1, so nothing is split)."""
    h, L, V = a["hidden_size"], a["num_layers"], a["padded_vocab_size"] if "padded_vocab_size" in a else a["vocab_size"]
    heads = a["num_attention_heads"]
    gated = bool(a.get("swiglu") or a.get("gated_linear_unit"))
    mlp = lambda f: (3 if gated else 2) * h * f  # noqa: E731  fc1 [g*f, h] + fc2 [h, f]
    E = a.get("num_experts") or 0
    pattern = moe_layers(a.get("moe_layer_freq", 1), L) if E else [False] * L
    n_moe = sum(pattern)
    out: dict[str, int] = {"embedding": V * h, "final_norm": h, "norms": 2 * h * L}
    if a.get("untie_embeddings_and_output_weights", True):
        out["output_layer"] = V * h
    if a.get("multi_latent_attention"):
        qk, rope, v, kv = a["qk_head_dim"], a["qk_pos_emb_head_dim"], a["v_head_dim"], a["kv_lora_rank"]
        q_rank = a.get("q_lora_rank")
        norms = a.get("qk_layernorm", False)
        q = h * heads * (qk + rope) if q_rank is None else h * q_rank + q_rank * heads * (qk + rope) + (q_rank if norms else 0)
        attn = q + h * (kv + rope) + (kv if norms else 0) + kv * heads * (qk + v) + heads * v * h
    else:
        d = a.get("kv_channels") or h // heads
        groups = a.get("num_query_groups") or heads
        qkv = heads * d + 2 * groups * d
        attn = h * qkv + heads * d * h + (qkv if a.get("add_qkv_bias") else 0) + (2 * d if a.get("qk_layernorm") else 0)
    out["attention"] = attn * L
    if L - n_moe:
        out["dense_mlp"] = mlp(a["ffn_hidden_size"]) * (L - n_moe)
    if n_moe:
        F = a.get("moe_ffn_hidden_size") or a["ffn_hidden_size"]
        out["routed_experts"] = E * mlp(F) * n_moe
        out["router"] = E * h * n_moe
        if a.get("moe_shared_expert_intermediate_size"):
            out["shared_experts"] = mlp(a["moe_shared_expert_intermediate_size"]) * n_moe
        if a.get("moe_shared_expert_gate"):
            out["shared_expert_gate"] = h * n_moe
    return out
