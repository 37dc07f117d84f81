"""Hugging Face ``config.json``: the model shape (parallelism, batch and sequence length come from
flags or another config).

The translation follows Megatron-Bridge's (0.6.2) ``MegatronModelBridge.CONFIG_MAPPING`` and its
per-family bridges (``LlamaBridge``, ``Qwen2Bridge``, ``Qwen3Bridge``, ``MistralBridge``): HF field ->
megatron-core / GPTModelProvider field, which ``map_mcore_fields`` then turns into Megatron args.
Supported families: llama, mistral, qwen2, qwen3, gpt2, and the mixture-of-experts families mixtral,
qwen2_moe (Qwen1.5-MoE, Qwen2-MoE), qwen3_moe, deepseek_v2, deepseek_v3 and deepseek_v32 (multi-latent attention,
dense first layers, shared experts; V3.2's lightning indexer as DSA, ``index_n_heads`` / ``index_head_dim`` /
``index_topk``). For those the MoE fields follow the semantics of the Hugging Face
modelling code (which layers are sparse, what the router computes), written as megatron-core config
names (``moe_ffn_hidden_size``, ``moe_layer_freq``, ...). The vocabulary is config.json's ``vocab_size`` (the embedding rows the checkpoint
has), padded like Megatron pads a tokenizer's vocabulary unless a Bridge/NeMo 2 recipe says otherwise.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from ..config import RawConfig
from ..errors import ConfigError, ReaderError
from ..numbers import shown
from ._common import ArgsBuilder, map_mcore_fields, set_vocab

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3", "gpt2", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3",
             "deepseek_v32"}
DEEPSEEK = ("deepseek_v2", "deepseek_v3", "deepseek_v32")


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
             num_attention_heads=heads, vocab_size=hf.get("vocab_size"), seq_length=hf.get("max_position_embeddings"),
             share_embeddings_and_output_weights=_flag(hf, "tie_word_embeddings", False),
             normalization="RMSNorm", gated_linear_unit=True, activation_func=hf.get("hidden_act", "silu"),
             position_embedding_type="rope", rotary_base=hf.get("rope_theta", 10000),
             attention_dropout=hf.get("attention_dropout", 0.0), hidden_dropout=0.0)
    if mt in DEEPSEEK:
        p.update(_deepseek_attention(hf))
    else:
        p["num_query_groups"] = hf.get("num_key_value_heads") or heads
    if hf.get("head_dim"):
        p["kv_channels"] = hf["head_dim"]
    # Biases: Llama's attention_bias / mlp_bias (False by default), Qwen2's fixed q/k/v bias, Qwen3's
    # attention_bias (False) plus RMSNorm on q and k per head.
    if mt == "qwen2" or mt == "qwen2_moe":
        p.update(add_qkv_bias=True, add_bias_linear=False)
    else:
        p.update(add_qkv_bias=_flag(hf, "attention_bias", False), add_bias_linear=_flag(hf, "mlp_bias", False))
    if mt in ("qwen3", "qwen3_moe"):
        p["qk_layernorm"] = True
    p.update(_moe_fields(hf, mt))
    # LlamaBridge.provider_bridge (and the Qwen/Mistral bridges that copy it): Megatron-side fusions.
    p.update(bias_activation_fusion=True, masked_softmax_fusion=True, bias_dropout_fusion=True,
             apply_rope_fusion=True, persist_layer_norm=True)
    if mt == "deepseek_v32":
        # DeepSeek-V3.2's lightning indexer (DeepSeek-V3.2-Exp inference/model.py ModelArgs index_n_heads,
        # index_head_dim, index_topk): megatron-core's DSA, which forbids RoPE fusion (TransformerConfig)
        p.update(experimental_attention_variant="dsa", dsa_indexer_n_heads=hf["index_n_heads"],
                 dsa_indexer_head_dim=hf["index_head_dim"], dsa_indexer_topk=hf["index_topk"], apply_rope_fusion=False)
    return p


def _deepseek_attention(hf: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2/V3 multi-latent attention (``DeepseekV2Attention``): q_a_proj + q_a_layernorm +
    q_b_proj (or q_proj when q_lora_rank is null), kv_a_proj_with_mqa + kv_a_layernorm + kv_b_proj,
    o_proj. In megatron-core that is MLASelfAttention with the latent norms of --qk-layernorm;
    qk_head_dim is the no-position part of a query/key head, qk_pos_emb_head_dim the rotary part."""
    return dict(multi_latent_attention=True, qk_layernorm=True, q_lora_rank=hf.get("q_lora_rank"),
                kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
                qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"])


def _layer_freq(pattern: list[int]) -> Any:
    """megatron-core's moe_layer_freq for a per-layer 0/1 list: 1 when every layer is MoE."""
    return 1 if all(pattern) else pattern


def _count(hf: Mapping[str, Any], key: str, default: int) -> int:
    """A layer count or step of config.json that a per-layer pattern is built from."""
    from .moe_freq import MAX_PATTERN_LENGTH

    v = hf.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_PATTERN_LENGTH:
        raise ConfigError(key, f"expects a whole number from 0 to {MAX_PATTERN_LENGTH:,}, got {shown(v)}")
    return v


def _step(hf: Mapping[str, Any], key: str) -> int:
    """Every how many layers a sparse block comes: transformers' modelling code takes the layer index modulo
    it (``Qwen2MoeDecoderLayer``, ``DeepseekV2DecoderLayer``), so 0 builds no model there (ZeroDivisionError)."""
    step = _count(hf, key, 1)
    if step < 1:
        raise ConfigError(key, f"must be >= 1 (transformers takes the layer index modulo it), got {shown(step)}")
    return step


def _flag(hf: Mapping[str, Any], key: str, default: bool) -> bool:
    """A true/false field of config.json (JSON's true / false; null or absent: transformers' default).
    Anything else is refused: ``bool("false")`` is True, and these flags change the parameter count."""
    v = hf.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(key, f"expects true or false, got {shown(v)}")
    return v


def _moe_fields(hf: Mapping[str, Any], mt: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral / Qwen-MoE / DeepSeek config.json."""
    p: dict[str, Any] = {}
    if mt == "mixtral":
        # MixtralSparseMoeBlock: every layer, num_local_experts experts of width intermediate_size, softmax
        # over the top-k logits (megatron-core's default order), no shared expert.
        experts = hf.get("num_local_experts")
        if not experts:
            return p
        p.update(num_moe_experts=experts, moe_ffn_hidden_size=hf["intermediate_size"], moe_layer_freq=1)
    elif mt in ("qwen2_moe", "qwen3_moe"):
        experts = hf.get("num_experts")
        if not experts:
            return p
        # Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer: a sparse block where (i + 1) % decoder_sparse_step == 0
        # and i is not in mlp_only_layers, else a dense MLP of width intermediate_size.
        n, step = _count(hf, "num_hidden_layers", 0), _step(hf, "decoder_sparse_step")
        only = hf.get("mlp_only_layers") or ()
        if not isinstance(only, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
            raise ConfigError("mlp_only_layers", f"expects a list of layer numbers, got {shown(only)}")
        only_mlp = set(only)
        p.update(num_moe_experts=experts, moe_ffn_hidden_size=hf["moe_intermediate_size"],
                 moe_layer_freq=_layer_freq([int(i not in only_mlp and (i + 1) % step == 0) for i in range(n)]))
        if mt == "qwen2_moe" and hf.get("shared_expert_intermediate_size"):
            # one shared expert with a sigmoid gate (shared_expert_gate: Linear(hidden, 1, bias=False))
            p.update(moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"], moe_shared_expert_gate=True)
    else:  # deepseek_v2 / deepseek_v3
        experts = hf.get("n_routed_experts")
        if not experts:
            return p
        # DeepseekV2DecoderLayer: MoE where i >= first_k_dense_replace and i % moe_layer_freq == 0; the
        # n_shared_experts shared experts are one MLP of width moe_intermediate_size x n_shared_experts.
        n = _count(hf, "num_hidden_layers", 0)
        first, freq = _count(hf, "first_k_dense_replace", 0), _step(hf, "moe_layer_freq")
        p.update(num_moe_experts=experts, moe_ffn_hidden_size=hf["moe_intermediate_size"],
                 moe_layer_freq=_layer_freq([int(i >= first and i % freq == 0) for i in range(n)]))
        shared = _count(hf, "n_shared_experts", 0)
        if shared:
            width = hf["moe_intermediate_size"]
            if isinstance(width, bool) or not isinstance(width, int):
                raise ConfigError("moe_intermediate_size", f"expects a whole number, got {shown(width)}")
            p["moe_shared_expert_intermediate_size"] = width * shared
        if hf.get("scoring_func") == "sigmoid":
            p["moe_router_score_function"] = "sigmoid"
        if hf.get("topk_method") == "noaux_tc":  # aux-loss-free balancing: a per-expert score bias
            p["moe_router_enable_expert_bias"] = True
        if _count(hf, "n_group", 1) > 1 and hf.get("topk_method") != "greedy":
            p.update(moe_router_num_groups=hf["n_group"], moe_router_group_topk=hf.get("topk_group"))
        if hf.get("routed_scaling_factor") not in (None, 1, 1.0):
            p["moe_router_topk_scaling_factor"] = hf["routed_scaling_factor"]
        if hf.get("aux_loss_alpha"):
            p.update(moe_router_load_balancing_type="seq_aux_loss" if hf.get("seq_aux") else "aux_loss",
                     moe_aux_loss_coeff=hf["aux_loss_alpha"])
    p["moe_router_topk"] = hf.get("num_experts_per_tok")
    # norm_topk_prob false (Qwen1.5/2-MoE, DeepSeek-V2): softmax over all experts, then top-k, i.e.
    # megatron-core's --moe-router-pre-softmax; true (and Mixtral): softmax over the top-k scores.
    # Absent, transformers' config classes default to false, except DeepseekV3Config (true).
    norm = _flag(hf, "norm_topk_prob", mt in ("deepseek_v3", "deepseek_v32"))
    if mt != "mixtral" and not norm and hf.get("scoring_func", "softmax") == "softmax":
        p["moe_router_pre_softmax"] = True
    if hf.get("router_aux_loss_coef"):
        p.update(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=hf["router_aux_loss_coef"])
    return p


# Provider field -> the config.json key it came from (for messages that name what the user wrote).
HF_KEYS = {"num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size", "num_query_groups": "num_key_value_heads",
           "kv_channels": "head_dim", "share_embeddings_and_output_weights": "tie_word_embeddings",
           "add_qkv_bias": "attention_bias", "add_bias_linear": "mlp_bias", "activation_func": "hidden_act",
           "rotary_base": "rope_theta", "seq_length": "max_position_embeddings", "num_moe_experts": "num_local_experts",
           "gated_linear_unit": "model_type", "normalization": "model_type", "position_embedding_type": "model_type",
           "qk_layernorm": "model_type", "moe_router_topk": "num_experts_per_tok",
           "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size", "moe_layer_freq": "decoder_sparse_step",
           "moe_ffn_hidden_size": "moe_intermediate_size", "moe_aux_loss_coeff": "router_aux_loss_coef",
           "moe_router_pre_softmax": "norm_topk_prob", "multi_latent_attention": "model_type",
           "qk_head_dim": "qk_nope_head_dim", "qk_pos_emb_head_dim": "qk_rope_head_dim",
           "moe_router_score_function": "scoring_func", "moe_router_enable_expert_bias": "topk_method",
           "moe_router_num_groups": "n_group", "moe_router_group_topk": "topk_group",
           "moe_router_topk_scaling_factor": "routed_scaling_factor"}
def hf_key_names(model_type: Any) -> dict[str, str]:
    """Provider field -> config.json key, for messages, per family."""
    mt = str(model_type).lower()
    return (GPT2_KEYS if mt == "gpt2" else DEEPSEEK_KEYS if mt in DEEPSEEK else QWEN_MOE_KEYS if mt in QWEN_MOE
            else HF_KEYS)


# The keys that differ in DeepSeek's config.json.
DEEPSEEK_KEYS = {**HF_KEYS, "num_moe_experts": "n_routed_experts", "moe_layer_freq": "first_k_dense_replace",
                 "moe_shared_expert_intermediate_size": "n_shared_experts", "moe_aux_loss_coeff": "aux_loss_alpha",
                 "moe_router_load_balancing_type": "seq_aux", "dsa_indexer_n_heads": "index_n_heads",
                 "dsa_indexer_head_dim": "index_head_dim", "dsa_indexer_topk": "index_topk"}
# Qwen-MoE's expert count is num_experts (Mixtral's num_local_experts)
QWEN_MOE = ("qwen2_moe", "qwen3_moe")
QWEN_MOE_KEYS = {**HF_KEYS, "num_moe_experts": "num_experts"}
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


def hf_notes(hf: Mapping[str, Any], where: str) -> tuple[str, ...]:
    """What a config.json describes that the model shape read from it leaves out."""
    mtp = hf.get("num_nextn_predict_layers")
    if isinstance(mtp, int) and not isinstance(mtp, bool) and mtp > 0:
        # transformers does not build DeepSeek-V3's MTP module either; Megatron builds it with --mtp-num-layers
        return (f"{where}num_nextn_predict_layers is {mtp}: the multi-token-prediction module is not part of "
                f"the model read (add --mtp-num-layers {mtp} to train with it)",)
    return ()


class _Reads(dict):
    """config.json that records the keys the translation reads (``[key]`` and ``.get``)."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        super().__init__(doc)
        self.read: list[str] = []

    def __getitem__(self, key: str) -> Any:
        self.read.append(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.append(key)
        return super().get(key, default)


def _numbers_as_text(doc: _Reads) -> None:
    """Refuse a number written as a JSON string ("64") at a key the model shape is read from: transformers'
    PretrainedConfig keeps the string as given (LlamaConfig's ``self.hidden_size = hidden_size``), and the model
    build then fails on it (``nn.Embedding(vocab_size, hidden_size)`` takes no str; Megatron-Bridge's provider
    divides it in TransformerConfig.__post_init__). memguard read it as the number."""
    for key in dict.fromkeys(doc.read):
        v = dict.get(doc, key)
        if isinstance(v, str):
            try:
                float(v)
            except ValueError:
                continue
            raise ConfigError(key, f"expects a JSON number, got the string {v!r} (transformers keeps it as text and "
                                   "building the model fails on it); write it without quotes")


def read_hf_config(doc: Mapping[str, Any], path: str) -> RawConfig:
    """A Hugging Face config.json as a RawConfig holding the model shape."""
    seen = _Reads(doc)
    try:
        p = hf_to_provider(seen)
    except KeyError as e:
        _numbers_as_text(seen)
        raise ReaderError(f"{path}: Hugging Face config without {e.args[0]!r}") from None
    except ReaderError as e:
        raise ReaderError(f"{path}: {e}") from None
    _numbers_as_text(seen)
    names = hf_key_names(doc.get("model_type"))
    for field, value in p.items():
        # every field taken from config.json is a number, a string, true/false or a layer list; the readers
        # skip a mapping (a NeMo / Bridge object spec), so a JSON object here would silently become the default
        if isinstance(value, Mapping):
            raise ConfigError(names.get(field, field), f"expects a number, got a JSON object {shown(value)}")
    raw = provider_to_raw(p, f"Hugging Face config {path}", pad_vocab=True, hf_names=names)
    notes = hf_notes(doc, f"{path}: ")
    return replace(raw, warnings=raw.warnings + notes) if notes else raw
