"""The model's shape: what megatron-core's TransformerConfig and the tokenizer's padding decide."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int           # resolved: heads unless --group-query-attention
    group_query_attention: bool
    kv_channels: int
    seq_length: int
    max_position_embeddings: int
    vocab_size: int | None          # before padding, where known
    padded_vocab_size: int
    make_vocab_size_divisible_by: int
    swiglu: bool
    squared_relu: bool
    gated_linear_unit: bool
    normalization: str              # LayerNorm | RMSNorm
    add_bias_linear: bool
    add_qkv_bias: bool
    qk_layernorm: bool
    position_embedding_type: str
    rotary_percent: float
    untie_embeddings_and_output_weights: bool
    hidden_dropout: float
    attention_dropout: float
    # multi-latent attention (DeepSeek-V2 style; megatron's MLASelfAttention), off by default
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # None: queries projected directly (linear_q_proj)
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rope_type: str = "yarn"         # MLA's own rotary embedding (rope | yarn)
    mtp_num_layers: int = 0         # multi-token prediction depths, on the last stage (0: none)
    attention_output_gate: bool = False   # a sigmoid gate per query head on the attention output (linear_qkv makes it)
    # an RMSNorm / LayerNorm (TENorm) on linear_proj's and linear_fc2's outputs: Megatron-Bridge's
    # TERowParallelLinearLayerNorm in Gemma 3's layer spec (models/common/te_layers.py, gemma3_provider.py)
    post_proj_norms: bool = False
    # [s/CP, 1, 1, d] fp32 rotary tables the rotary embedding keeps cached: 1 (megatron-core's); Gemma 3's local and
    # global ones: 2 (NeMo 2), 4 with their cached torch.stack (Megatron-Bridge)
    rotary_tables: int = 1
    # Gemma 2's core attention (Megatron-Bridge 0.6.2 gemma2_provider.py gemma2_layer_spec): Gemma2FlexDotProductAttention,
    # PyTorch FlexAttention with the attention-logit softcap as its score_mod, in place of TE's DotProductAttention
    gemma2_attention: bool = False
    # Gemma2OutputLayer (gemma2_provider.py): logits -> cap * tanh(logits / cap) on the output layer; 0: none
    final_logit_softcapping: float = 0.0
    # --heterogeneous-layers-config-path: each layer's blocks as "mixer/mlp" words joined by commas
    # (resolve/heterogeneous.py: attention | attention:GROUPS | none | linear, dense | dense:FFN | none | linear | moe);
    # None: every layer alike
    heterogeneous_layers: str | None = None
    # --mtp-use-repeated-layer (core 0.17+): one MTP layer built and applied at every depth
    mtp_use_repeated_layer: bool = False
    # megatron-core 0.19's GPT builder (megatron/training/models/gpt.py mtp_block_spec, what pretrain_gpt.py builds
    # through): an MoE model's MTP layer takes the full MoE layer spec when its chunk holds no decoder layer
    # (a layout ending '|mL'), whatever the last decoder layer is (params.mtp_layer_kind)
    mtp_moe_on_empty_chunk: bool = False
    # --hybrid-layer-pattern (core 0.17+; --hybrid-override-pattern before): one symbol per layer, M (Mamba),
    # * (attention), - (MLP), E (MoE), '|' between pipeline segments (resolve/hybrid.py); None: not hybrid
    hybrid_layer_pattern: str | None = None
    # the Mamba mixer (TransformerConfig 0.19.2 defaults; mamba_num_heads resolved: hidden * 2 // head dim unset)
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: int = 0
    mamba_chunk_size: int = 128     # the SSD kernel's chunk (MambaMixer's chunk_size; Bridge's mamba_chunk_size)
    # the layers of one MTP depth of a hybrid model (the pattern after '/' in --hybrid-layer-pattern, core 0.17+):
    # MultiTokenPredictionLayer builds a HybridStack of them; None: an MTP depth is one layer of the last decoder
    # layer's kind (params.mtp_stack_runs)
    hybrid_mtp_pattern: str | None = None
    # --experimental-attention-variant dsa (DeepSeek sparse attention, megatron-core 0.19.2 DSAttention on
    # AbsorbedMLASelfAttention, layers/dsa.py): the lightning indexer's heads, head dim and top-k, and the indexer
    # KL loss coefficient (0: no loss, the indexer runs without autograd); None: no variant
    experimental_attention_variant: str | None = None
    dsa_indexer_n_heads: int = 0
    dsa_indexer_head_dim: int = 0
    dsa_indexer_topk: int = 0
    dsa_indexer_loss_coeff: float = 0.0
    dsa_indexer_use_sparse_loss: bool = False
    dsa_indexer_k_norm_fp32: bool = False     # the indexer's key LayerNorm on an fp32 copy of its input
    # top-k sharing (--dsa-indexer-topk-freq > 1, dsa.py is_dsa_skip_topk_layer): the layers that reuse an earlier
    # layer's top-k build no indexer (partition.py gives them the mixer 'dsa_shared'); dsa_skip_topk marks the layout
    # such a layer's recipe reads (estimator.layers.kind_layout)
    dsa_indexer_topk_freq: int = 1
    dsa_indexer_skip_topk_offset: int = 0
    dsa_skip_topk: bool = False
    # --dsa-kernel-backend as it acts (none with --attention-backend unfused): 'none' the PyTorch path, 'tilelang' the
    # TileLang indexer top-k and SparseMLA kernels (layers/dsa.py tilelang_sparse)
    dsa_kernel_backend: str = "none"
    # --experimental-attention-variant gated_delta_net (GPT) with --linear-attention-freq: one character per layer,
    # '1' a gated delta net layer, '0' a standard attention layer (experimental_attention_variant_module_specs.py
    # get_linear_attention_pattern, core 0.16.1 and 0.19.2); None: no GDN layers in a GPT model
    linear_attention_pattern: str | None = None
    # the GatedDeltaNet mixer of those layers and of a hybrid model's 'G' layers (TransformerConfig 0.19.2 defaults)
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
