"""Section: heterogeneous layer configs (--heterogeneous-layers-config-path / -encoded-json).

Mirrors megatron-core 0.19.2: ``validate_model_config_args_from_heterogeneous_config`` (megatron/training/
arguments.py: the Hugging Face-style JSON must agree with the flags), ``HeterogeneousTransformerConfig``
(transformer/heterogeneous/heterogeneous_config.py: each entry of ``block_configs`` gives the layer's
attention as a no-op, a linear replacement or attention with ``n_heads_in_group``, and its MLP as a
no-op, a linear replacement or an MLP of ``ffn_mult``) and ``get_gpt_heterogeneous_layer_spec``
(models/gpt/heterogeneous/heterogeneous_layer_specs.py). The model is heterogeneous only with the path
(training/argument_utils.py picks HeterogeneousTransformerConfig on it); the encoded JSON alone is
checked and builds uniform layers.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

from packaging.version import Version

from ..errors import ConfigError, NotModelledError, ReaderError
from .args import Args, Context

PATH, ENCODED = "heterogeneous_layers_config_path", "heterogeneous_layers_config_encoded_json"


def ffn_mult_to_size(ffn_mult: float, hidden_size: int) -> int:
    """MLPConfig.ffn_mult_to_intermediate_size: int(2 ffn_mult h / 3) rounded up to a multiple of 256."""
    n = int(2 * ffn_mult * hidden_size / 3)
    return n if n % 256 == 0 else n + 256 - n % 256


def _load_json(text: str, where: str) -> Any:
    from ..files import load_json
    return load_json(text, where)


@functools.lru_cache(maxsize=4)
def _load_encoded(text: str, where: str) -> tuple[bool, Any]:
    """--heterogeneous-layers-config-encoded-json parsed once per text (plan resolves it for every candidate)."""
    try:
        return True, _load_json(text, where)
    except ReaderError as e:
        return False, e


def _load_file(path: str, where: str) -> tuple[bool, Any]:
    """(whether the file starts with a UTF-8 BOM, its JSON; None with a BOM, which is refused unparsed)."""
    from ..files import decode, read_bytes
    data = read_bytes(path)
    text = decode(data, path)          # (drops a BOM, which Megatron's Path.read_text() keeps)
    if data.startswith(b"\xef\xbb\xbf"):
        return True, None
    return False, _load_json(text, where)


def heterogeneous(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    path, encoded = a.get(PATH), a.get(ENCODED)
    if not path and not encoded:
        return dict(heterogeneous_layers=None)
    dest = ENCODED if encoded else PATH
    try:
        if encoded:
            text = str(encoded)
            bom = text.startswith("\ufeff")
            ok, doc = (True, None) if bom else _load_encoded(text, a.key(dest))
            if not ok:
                raise doc.with_traceback(None)
        else:
            # once per file version (files.read_once): memguard plan resolves the config for every candidate layout
            from ..files import read_once
            bom, doc = read_once(_load_file, str(path), a.key(dest))
        if bom:
            # validate_model_config_args_from_heterogeneous_config (megatron-core 0.19.2 training/arguments.py):
            # json.loads(Path(path).read_text()) raises 'Unexpected UTF-8 BOM (decode using utf-8-sig)'
            a.fail(dest, "starts with a UTF-8 byte-order mark, which Megatron's json.loads refuses; save it as UTF-8 "
                         "without a BOM")
            return dict(heterogeneous_layers=None)
    except ReaderError as e:
        a.fail(dest, f"cannot be read ({e})")
        return dict(heterogeneous_layers=None)
    if not isinstance(doc, dict) or not isinstance(doc.get("block_configs"), list) or not doc["block_configs"]:
        a.fail(dest, "must be a JSON object with a non-empty block_configs list (HeterogeneousTransformerConfig)")
        return dict(heterogeneous_layers=None)
    try:
        blocks = [_block(b, kw["num_attention_heads"], kw["hidden_size"]) for b in doc["block_configs"]]
    except ConfigError as e:
        a.fail(dest, e.rule)
        return dict(heterogeneous_layers=None)
    _check_flags(a, dest, doc, blocks, kw)
    if not path:
        if not a.key(ENCODED).startswith("--"):
            # a config object (Bridge, NeMo) may be a heterogeneous class whatever the path says
            raise NotModelledError(a.key(ENCODED), "a heterogeneous layer config given as encoded JSON only, outside "
                                   "Megatron-LM's flags (whether the layers are built heterogeneous is not known)")
        a.notes.append(f"{a.key(ENCODED)}: checked against the flags; without --heterogeneous-layers-config-path "
                       "Megatron-LM builds uniform layers (argument_utils picks the heterogeneous config on the path)")
        return dict(heterogeneous_layers=None)
    if kw.get("multi_latent_attention"):
        a.fail(PATH, "cannot be used with --multi-latent-attention (argument_utils asserts it)")
    L = kw["num_layers"]
    if len(blocks) < L:
        a.fail(PATH, f"has {len(blocks)} block_configs for {L} layers (get_config_for_layer needs one per layer)")
        return dict(heterogeneous_layers=None)
    tp = kw["tensor_model_parallel_size"]
    own = _own_groups(a, kw, blocks[:L])
    # FP8 / FP4: each layer in get_fp8_context of its global index (TransformerBlock, 0.16.1 and 0.19.2), its TE GEMMs
    # those of its blocks (partition.model_kind_runs; a linear replacement is TELayerNormColumnParallelLinearGathered,
    # a TE LayerNormLinear: estimator/fp8_layers.py linear_attn / linear_mlp)
    # (a linear replacement under fine-grained activation offloading: in no offload group, estimator/core.py)
    impl, graphs = kw.get("cuda_graph_impl", "none") or "none", tuple(kw.get("cuda_graph_modules") or ())
    # the full-iteration graph's static batches and pool do not depend on the layers (estimator/cuda_graphs.py);
    # per-layer graphs of whole layers (attention and a dense MLP of any width; every layer with MoE, whose block
    # spec ignores no-op / linear blocks) are graphed as in a uniform model (the widest sets the pool); with no-op /
    # linear blocks each layer by what the implementation graphs (estimator/cuda_graphs.py heterogeneous_kind_graphed:
    # TE's _layer_is_graphable checks the built modules, the local CudaGraphManager the submodule spec)
    halves = kw.get("moe") is None and any((attn, mlp) != ("attention", "dense") for attn, mlp, _, _ in blocks[:L])
    if impl == "local" and halves and "full_iteration" not in graphs and set(graphs) & {"attn", "mlp"}:
        a.notes.append(f"{a.key(PATH)}: the local CUDA graphs compare a layer's submodule spec with IdentityOp, and a "
                       "no-op block's is ModuleSpec(IdentityOp) (a no-op MLP's IdentityOp itself from megatron-core "
                       "0.18): " + ("every layer is graphed whole under attn"
                       if "attn" in graphs else "the no-op MLP layers are graphed too" if ctx.version < Version("0.18")
                       else "the no-op MLP layers are not graphed"))
    if kw.get("mtp_num_layers") and ctx.version < Version("0.19"):
        raise NotModelledError(a.key(PATH), f"heterogeneous layer configs with multi-token prediction in megatron-core "
                               f"{ctx.version} (the 0.16 to 0.18 builders' MTP layer spec, in Megatron-LM's "
                               "gpt_builders.py, is not in the wheels read)")
    if kw.get("moe") is not None:
        return _moe_layers(a, kw, ctx, blocks[:L], own)
    words = []
    for i, (attn, mlp, ffn, _) in enumerate(blocks[:L]):
        if "linear" in (attn, mlp) and tp > 1 and kw["sequence_parallel"]:
            # linear_replacements._gather_from_tensor_parallel_region (0.16.1 and 0.19.2) pads dim 0 (F.pad's
            # pairs run from the last dimension) before the sequence-parallel reduce-scatter: the residual add
            # then fails on the shapes (the CPU referee reproduces it)
            a.fail(PATH, f"block {i}: replace_with_linear fails with --sequence-parallel and tensor-model-parallel "
                         "size > 1 in megatron-core (its output gather pads the sequence dimension)")
        size = kw["ffn_hidden_size"] if ffn is None else ffn
        if mlp == "dense" and size % tp:
            # (a dense block without its own width takes the flags': MLP linear_fc2 splits it, megatron-core divide)
            a.fail(PATH, f"block {i}: ffn size {size} must be divisible by tensor-model-parallel size {tp}")
        words.append(f"{attn}{own.get(i, '')}/" + (mlp if mlp in ("none", "linear") else "dense"
                                                    if size == kw["ffn_hidden_size"] else f"dense:{size}"))
    out: dict[str, Any] = dict(heterogeneous_layers=",".join(words))
    if kw.get("use_transformer_engine_op_fuser"):
        # get_gpt_heterogeneous_layer_spec (0.19.2) builds each MLP from TELayerNormColumnParallelLinear and
        # TERowParallelLinear whatever the flag says (no TEFusedMLP)
        a.notes.append(f"{a.key('use_transformer_engine_op_fuser')}: no effect on a heterogeneous layer config's "
                       "layers (their spec builds plain Transformer Engine linears)")
        out["use_transformer_engine_op_fuser"] = False
    return out


def _own_groups(a: Args, kw: Mapping[str, Any], blocks: list) -> dict[int, str]:
    """The attention blocks whose own ``num_query_groups`` differs from --num-query-groups: {layer index: ":G"}.
    AttentionConfig.build_config_from_dict takes a block's num_query_groups over n_heads_in_group, and
    get_config_for_layer (transformer/heterogeneous/heterogeneous_config.py, megatron-core 0.16.1 and 0.19.2) builds
    that layer's TransformerConfig with it: its SelfAttention's linear_qkv has kv_channels x (heads + 2 x groups)
    columns and its core attention that many key / value heads (the layer kind's query_groups, estimator/layers
    kind_layout). Its rules are the model's: TransformerConfig.__post_init__ (groups a multiple or a divisor of TP),
    the attention's head split (groups dividing the heads), the QKV projection's divide by TP and, under all-to-all
    CP, TE's split of the key / value heads over the a2a ranks."""
    heads, tp, kv = kw["num_attention_heads"], kw["tensor_model_parallel_size"], kw["kv_channels"]
    gate = 2 if kw.get("attention_output_gate") else 1
    a2a = kw.get("cp_a2a_size") or 1
    own: dict[int, str] = {}
    for i, (attn, _, _, groups) in enumerate(blocks):
        if groups is None or attn != "attention" or groups == kw["num_query_groups"]:
            continue
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
            a.fail(PATH, f"block {i}: num_query_groups must be a positive integer, got {str(groups)[:60]!r}")
        elif heads % groups:
            a.fail(PATH, f"block {i}: num_query_groups {groups} must divide num_attention_heads {heads}")
        elif groups % tp and tp % groups:
            a.fail(PATH, f"block {i}: num_query_groups {groups} must be a multiple or a divisor of "
                         f"tensor-model-parallel size {tp} (TransformerConfig)")
        elif kv * (heads * gate + 2 * groups) % tp:
            a.fail(PATH, f"block {i}: the QKV projection's {kv * (heads * gate + 2 * groups)} columns must be "
                         f"divisible by tensor-model-parallel size {tp} (megatron-core divide)")
        elif a2a > 1 and max(1, groups // tp) % a2a:
            # the all-to-all CP splits this layer's key / value heads too (resolve/shape.py cp_attention: TE's
            # flash_attn_a2a_communicate, "The number of attention heads needs to be divisible by CP size!")
            a.fail(PATH, f"block {i}: num_query_groups {groups} gives {max(1, groups // tp)} key/value head(s) per "
                         f"tensor-parallel rank, not a multiple of the {a2a} all-to-all context-parallel ranks "
                         "(--cp-comm-type a2a / a2a+p2p)")
        else:
            own[i] = f":{groups}"
    return own


def _moe_layers(a: Args, kw: Mapping[str, Any], ctx: Context, blocks: list, own: dict[int, str]) -> dict[str, Any]:
    """The layers of a mixture-of-experts model with a heterogeneous config. megatron/training 0.19.2
    (models/gpt.py default_layer_spec) takes the MoE decoder block spec
    (get_gpt_decoder_block_spec: a TransformerLayer with attention and an MoE or dense MLP by --moe-layer-freq)
    before the heterogeneous one, so no-op and linear blocks are built as whole layers; TransformerBlock still
    builds each layer from get_config_for_layer, which overrides only num_query_groups and ffn_hidden_size. The
    experts keep moe_ffn_hidden_size and the shared expert its size (set once in the model's config); a dense
    layer's MLP takes its block's ffn size (the model's for a no-op / linear block). Checked against
    megatron-core 0.19.2 built on CPU (tests/e2e/heterogeneous_param_count.py)."""
    if ctx.version < Version("0.19"):
        # the layer spec is chosen by Megatron-LM's gpt_builders.py, not in the 0.16 to 0.18 wheels read
        # (checked: the megatron-core 0.17.1 and 0.18.2 wheels' megatron/training has no GPT builder, 0.18.2's
        # models/ holds hybrid.py only; Megatron-LM's gpt_builders.py is not in any wheel)
        raise NotModelledError(a.key(PATH), f"heterogeneous layer configs with mixture-of-experts layers in megatron-core "
                               f"{ctx.version} (the 0.16 to 0.18 model builders, Megatron-LM's gpt_builders.py, are not "
                               "in the wheels read)")
    tp, pattern, main = kw["tensor_model_parallel_size"], kw["moe"].moe_layer_pattern, kw["ffn_hidden_size"]
    words = []
    for i, ((attn, mlp, ffn, _), is_moe) in enumerate(zip(blocks, pattern)):
        if is_moe:
            words.append(f"attention{own.get(i, '')}/moe")
            continue
        size = main if ffn is None else ffn
        if size % tp:
            a.fail(PATH, f"block {i}: the dense layer's ffn size {size} must be divisible by tensor-model-parallel "
                         f"size {tp} (MLP linear_fc2, megatron-core divide)")
        words.append(f"attention{own.get(i, '')}/" + ("dense" if size == main else f"dense:{size}"))
    if any(attn != "attention" or mlp not in ("dense",) for attn, mlp, _, _ in blocks):
        a.notes.append(f"{a.key(PATH)}: with mixture-of-experts layers Megatron 0.19 builds the MoE block spec, so "
                       "no-op and replace_with_linear blocks are built as full attention and MLP layers")
    return dict(heterogeneous_layers=",".join(words))


def _block(b: Any, heads: int, hidden: int) -> tuple[str, str, int | None, int | None]:
    """(attention: attention | none | linear, mlp: dense | none | linear, the MLP's ffn size or None,
    the attention's num_query_groups when the block sets it by that key, else None)."""
    if not isinstance(b, dict) or not isinstance(b.get("attention"), dict):
        raise ConfigError("", "each block_configs entry needs an attention object")
    att = b["attention"]
    if "num_query_groups" in att:
        groups = att["num_query_groups"]
    else:   # AttentionConfig.build_config_from_dict (Nemotron-51B style n_heads_in_group)
        if "n_heads_in_group" not in att:
            raise ConfigError("", "an attention block needs n_heads_in_group or num_query_groups")
        n = att["n_heads_in_group"]
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1 or heads % n):
            raise ConfigError("", f"num_attention_heads ({heads}) must be a multiple of n_heads_in_group ({n})")
        groups = None if n is None else heads // n
    mlp = b.get("ffn") or b.get("mlp")
    if not isinstance(mlp, dict):
        raise ConfigError("", "each block_configs entry needs an ffn (or mlp) object")
    if "ffn_hidden_size" in mlp:
        ffn = mlp["ffn_hidden_size"]
    else:
        if "ffn_mult" not in mlp:
            raise ConfigError("", "an ffn block needs ffn_mult or ffn_hidden_size")
        mult = mlp["ffn_mult"]
        if mult is not None and (not isinstance(mult, (int, float)) or isinstance(mult, bool) or not 0 < mult <= 1e4):
            raise ConfigError("", f"ffn_mult must be a positive number, got {str(mult)[:60]!r}")
        ffn = None if mult is None else ffn_mult_to_size(mult, hidden)
    if ffn is not None and (not isinstance(ffn, int) or isinstance(ffn, bool) or ffn < 1):
        raise ConfigError("", f"ffn_hidden_size must be a positive integer, got {str(ffn)[:60]!r}")
    a_kind = "none" if att.get("no_op") else "linear" if att.get("replace_with_linear") else "attention"
    m_kind = "none" if mlp.get("no_op") else "linear" if mlp.get("replace_with_linear") else "dense"
    # get_config_for_layer asserts that a no-op or linear block sets neither
    if groups is not None and a_kind != "attention":
        raise ConfigError("", "a no_op / replace_with_linear attention block cannot set its query groups")
    if ffn is not None and m_kind != "dense":
        raise ConfigError("", "a no_op / replace_with_linear ffn block cannot set its size")
    return a_kind, m_kind, ffn, (groups if "num_query_groups" in att else None)


def _check_flags(a: Args, dest: str, doc: dict, blocks: list, kw: Mapping[str, Any]) -> None:
    """validate_model_config_args_from_heterogeneous_config (0.19.2): SiLU, one n_heads_in_group, and the
    flags equal to what the JSON says."""
    if doc.get("hidden_act") != "silu":
        a.fail(dest, f"hidden_act in the heterogeneous config is {str(doc.get('hidden_act'))[:60]!r}, should be silu")
    if any("n_heads_in_group" not in b["attention"] for b in doc["block_configs"]):
        # (it indexes config["attention"]["n_heads_in_group"] of every block: a KeyError at start-up otherwise)
        a.fail(dest, "every block's attention needs n_heads_in_group, null for no-op / linear blocks "
                     "(validate_model_config_args_from_heterogeneous_config reads it)")
    ns = [b["attention"].get("n_heads_in_group") for b in doc["block_configs"]
          if isinstance(b.get("attention"), dict) and b["attention"].get("n_heads_in_group") is not None]
    if len(set(ns)) > 1:
        a.fail(dest, "num query head must be consistent across all layers (one n_heads_in_group)")
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "tie_word_embeddings",
                           "rope_theta", "rope_scaling") if k not in doc]
    if missing or not ns or not isinstance(doc.get("rope_scaling"), dict) or "factor" not in doc["rope_scaling"]:
        a.fail(dest, "needs " + ", ".join(missing or ["rope_scaling.factor and an n_heads_in_group"])
               + " (validate_model_config_args_from_heterogeneous_config reads them)")
        return
    want = {
        "swiglu": True, "normalization": "RMSNorm", "group_query_attention": True, "position_embedding_type": "rope",
        "rotary_percent": 1.0, "use_rope_scaling": True, "use_rotary_position_embeddings": True,
        "num_layers": doc["num_hidden_layers"], "hidden_size": doc["hidden_size"],
        "num_attention_heads": doc["num_attention_heads"],
        "untie_embeddings_and_output_weights": not doc["tie_word_embeddings"], "rotary_base": doc["rope_theta"],
        "rope_scaling_factor": doc["rope_scaling"].get("factor"),
        "num_query_groups": doc["num_attention_heads"] // ns[0] if isinstance(doc["num_attention_heads"], int) else None,
    }
    defaults = {"swiglu": False, "normalization": "LayerNorm", "group_query_attention": False,
                "rotary_percent": 1.0, "use_rope_scaling": False, "use_rotary_position_embeddings": False,
                "untie_embeddings_and_output_weights": False, "rotary_base": 10000, "rope_scaling_factor": 8.0}
    given = {k: kw[k] if k in ("position_embedding_type", "num_layers", "hidden_size", "num_attention_heads")
             else a.get(k, defaults.get(k)) for k in want}
    bad = [f"{k}: {given[k]} (provided) != {v} (expected)" for k, v in want.items() if given[k] != v]
    if bad:
        a.fail(dest, "arguments differ from the heterogeneous config: " + ", ".join(bad)[:400])
