"""The flat Megatron names of a layout, in the order ``Layout.to_dict()`` writes them, and the part
each one lives in.

This table is the one place that knows the mapping: ``Layout`` reads its flat properties from it,
``to_dict``/``from_dict``/``from_flat``/``replace`` route through it, and the JSON document keeps
Megatron's ``args`` names in the order users and stored records know (``memguard.estimate/1``).
A new field is one word here and one field in its part.
"""
from __future__ import annotations

# (part attribute of Layout, flat names in JSON order); runs may repeat a part to keep the order.
_RUNS: tuple[tuple[str, str], ...] = (
    ("parallel", "world_size tensor_model_parallel_size pipeline_model_parallel_size "
                 "virtual_pipeline_model_parallel_size context_parallel_size data_parallel_size sequence_parallel "
                 "num_distributed_optimizer_instances expert_model_parallel_size expert_tensor_parallel_size"),
    ("shape", "num_layers hidden_size ffn_hidden_size num_attention_heads num_query_groups group_query_attention "
              "kv_channels seq_length max_position_embeddings vocab_size padded_vocab_size "
              "make_vocab_size_divisible_by swiglu squared_relu gated_linear_unit normalization add_bias_linear "
              "add_qkv_bias qk_layernorm position_embedding_type rotary_percent "
              "untie_embeddings_and_output_weights hidden_dropout attention_dropout"),
    ("batch", "micro_batch_size global_batch_size num_microbatches"),
    ("split", "decoder_first_pipeline_num_layers decoder_last_pipeline_num_layers "
              "account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split "
              "pipeline_model_parallel_layout microbatch_group_size_per_vp_stage overlap_p2p_comm"),
    ("precision", "params_dtype autocast_dtype bf16 fp16 accumulate_allreduce_grads_in_fp32 grad_reduce_in_bf16 "
                  "fp32_residual_connection attention_softmax_in_fp32 apply_query_key_layer_scaling "
                  "fp16_lm_cross_entropy"),
    ("optim", "optimizer use_distributed_optimizer"),
    ("precision", "use_precision_aware_optimizer main_grads_dtype main_params_dtype exp_avg_dtype exp_avg_sq_dtype"),
    ("optim", "store_param_remainders overlap_grad_reduce overlap_param_gather ddp_bucket_size "
              "ddp_pad_buckets_for_high_nccl_busbw"),
    ("kernels", "gradient_accumulation_fusion"),
    ("recompute", "recompute_granularity recompute_method recompute_num_layers recompute_modules "
                  "distribute_saved_activations"),
    ("kernels", "transformer_impl attention_backend masked_softmax_fusion bias_activation_fusion bias_dropout_fusion "
                "apply_rope_fusion cross_entropy_loss_fusion cross_entropy_fusion_impl "
                "create_attention_mask_in_dataloader deterministic_mode calculate_per_token_loss "
                "empty_unused_memory_level defer_embedding_wgrad_compute wgrad_deferral_limit tp_comm_overlap"),
    ("provenance", "megatron_version tokenizer_type"),
    ("shape", "multi_latent_attention q_lora_rank kv_lora_rank qk_head_dim qk_pos_emb_head_dim v_head_dim rope_type"),
    ("", "moe"),     # Layout's own field: the MoE part (layout/moe.py MoeSpec), None for dense models
    ("shape", "mtp_num_layers heterogeneous_layers"),
    ("kernels", "cuda_graph_impl cuda_graph_modules tp_comm_overlap_cfg symmetric_ar_type use_transformer_engine_op_fuser "
                "grouped_dense_mlp softmax_type flash_attention_version"),
    ("recompute", "cpu_offloading_num_layers fine_grained_activation_offloading offload_modules min_offloaded_tensor_size"),
    ("optim", "muon_scalar_optimizer muon_split_qkv muon_tp_mode muon_fp32_matmul_prec muon_nesterov"),
    ("optim", "use_megatron_fsdp use_torch_fsdp2 data_parallel_sharding_strategy fsdp_double_buffer "
              "suggested_communication_unit_size megatron_fsdp_main_params_dtype megatron_fsdp_main_grads_dtype "
              "torch_fsdp2_reshard_after_forward optimizer_cpu_offload optimizer_offload_fraction "
              "overlap_cpu_optimizer_d2h_h2d pin_cpu_grads outer_dp_sharding_strategy keep_fp8_transpose_cache "
              "log_params_norm"),
    ("provenance", "env"),
    ("optim", "megatron_fsdp_cuda_graph_mode megatron_fsdp_grad_comm_dtype fsdp_all_gather_in_start_param_sync "
              "fsdp_optimizer_states_at_start nccl_ub ddp_reduce_scatter_with_fp32_accumulation "
              "ddp_param_name_patterns_for_fp32_local_accumulation"),
    ("optim", "freeze_all_layers optimizer_cuda_graph"),
    ("shape", "attention_output_gate"),
    ("shape", "post_proj_norms rotary_tables"),
    ("shape", "gemma2_attention final_logit_softcapping"),
    ("shape", "mtp_use_repeated_layer"),
    ("recompute", "activation_offload_fraction delta_offload_bytes_across_pp_ranks delay_offload_until_cuda_graph"),
    ("recompute", "fine_grained_offloading_max_inflight_offloads"),
    ("shape", "mtp_moe_on_empty_chunk"),
    ("shape", "hybrid_layer_pattern mamba_state_dim mamba_head_dim mamba_num_groups mamba_num_heads "
              "mamba_chunk_size"),
    ("shape", "hybrid_mtp_pattern"),
    ("shape", "experimental_attention_variant dsa_indexer_n_heads dsa_indexer_head_dim dsa_indexer_topk "
              "dsa_indexer_loss_coeff dsa_indexer_use_sparse_loss dsa_indexer_k_norm_fp32"),
    ("shape", "dsa_indexer_topk_freq dsa_indexer_skip_topk_offset dsa_skip_topk dsa_kernel_backend"),
    ("shape", "linear_attention_pattern linear_conv_kernel_dim linear_key_head_dim linear_value_head_dim "
              "linear_num_key_heads linear_num_value_heads"),
    ("parallel", "cp_a2a_size cp_kv_all_gather"),
    ("parallel", "cp_comm_layers"),
    ("batch", "eval_micro_batch_size eval_num_microbatches"),
    # FP8 / FP4 (megatron_memguard/estimator/fp8.py); to_dict writes them only when FP8 or FP4 is on
    ("precision", "fp8 fp8_recipe fp4 fp4_recipe fp8_param_gather fp4_param_gather first_last_layers_bf16 "
                  "num_layers_at_start_in_bf16 num_layers_at_end_in_bf16 fp8_amax_history_len fp8_amax_compute_algo "
                  "reuse_grad_buf_for_mxfp8_param_ag disable_parameter_transpose_cache activation_func_fp8_input_store "
                  "fp8_output_proj fp8_dot_product_attention fp8_gpu"),
    ("", "peft"),    # Layout's own field: LoRA / DoRA adapters (layout/peft.py PeftSpec), None without PEFT
    ("", "notes"),   # Layout's own field: not compared, not part of any part
)
# flat names the JSON document leaves out for a dense model (its layout reads as before MoE existed)
MOE_ONLY = ("expert_model_parallel_size", "expert_tensor_parallel_size", "moe")

# flat name -> part attribute ("" for Layout's own ``notes``), in JSON order
FLAT: dict[str, str] = {name: part for part, names in _RUNS for name in names.split()}
FLAT_NAMES: tuple[str, ...] = tuple(FLAT)
# the FP8 / FP4 settings (absent from the JSON document of a layout without FP8 or FP4)
FP8_NAMES: frozenset[str] = frozenset(next(names for _, names in _RUNS if names.startswith("fp8 ")).split())
# the flat fields the JSON document writes as lists/objects and ``from_dict`` turns back into tuples
TUPLE_FIELDS = ("recompute_modules", "env", "notes", "cuda_graph_modules", "offload_modules", "tp_comm_overlap_cfg",
                "ddp_param_name_patterns_for_fp32_local_accumulation")
# Feature settings the JSON document writes only when set: a layout without the feature keeps the
# document of the releases before it (CUDA graphs, activation offloading, MTP, Muon).
OMITTED_AT_DEFAULT: dict[str, object] = {
    "mtp_num_layers": 0, "cuda_graph_impl": "none", "cuda_graph_modules": (), "tp_comm_overlap_cfg": (),
    "fp8_output_proj": False, "fp8_dot_product_attention": False, "fp8_gpu": None,
    "cp_a2a_size": 1, "cp_kv_all_gather": False, "cp_comm_layers": None,
    "symmetric_ar_type": None,
    "cpu_offloading_num_layers": 0,
    "fine_grained_activation_offloading": False, "offload_modules": (), "min_offloaded_tensor_size": 1024 * 1024,
    "muon_scalar_optimizer": "adam", "use_transformer_engine_op_fuser": False, "heterogeneous_layers": None,
    "grouped_dense_mlp": False,
    "muon_split_qkv": True, "muon_tp_mode": "blockwise", "muon_fp32_matmul_prec": "medium", "muon_nesterov": False,
    # Megatron-FSDP, torch FSDP2, optimizer CPU offload (``from_dict`` takes these back when a key is absent)
    "use_megatron_fsdp": False, "use_torch_fsdp2": False, "data_parallel_sharding_strategy": None,
    "fsdp_double_buffer": False, "suggested_communication_unit_size": None,
    "megatron_fsdp_main_params_dtype": "fp32", "megatron_fsdp_main_grads_dtype": "auto",
    "torch_fsdp2_reshard_after_forward": True, "optimizer_cpu_offload": False, "optimizer_offload_fraction": 1.0,
    "overlap_cpu_optimizer_d2h_h2d": False, "pin_cpu_grads": True, "outer_dp_sharding_strategy": "no_shard",
    "keep_fp8_transpose_cache": False, "log_params_norm": False,
    "megatron_fsdp_cuda_graph_mode": False, "megatron_fsdp_grad_comm_dtype": "auto", "nccl_ub": False,
    "fsdp_all_gather_in_start_param_sync": True, "fsdp_optimizer_states_at_start": False,
    "ddp_reduce_scatter_with_fp32_accumulation": False,
    "ddp_param_name_patterns_for_fp32_local_accumulation": (),
    "freeze_all_layers": False, "optimizer_cuda_graph": False, "attention_output_gate": False,
    "post_proj_norms": False, "rotary_tables": 1,
    "gemma2_attention": False, "final_logit_softcapping": 0.0,
    "activation_offload_fraction": 1.0, "delta_offload_bytes_across_pp_ranks": 0, "delay_offload_until_cuda_graph": False,
    "fine_grained_offloading_max_inflight_offloads": None,
    "softmax_type": "vanilla", "flash_attention_version": None,   # they pick TE's attention kernel (attention_backend)
    "mtp_use_repeated_layer": False, "mtp_moe_on_empty_chunk": False,
    "hybrid_layer_pattern": None, "mamba_state_dim": 128, "mamba_head_dim": 64, "mamba_num_groups": 8,
    "mamba_num_heads": 0, "mamba_chunk_size": 128, "hybrid_mtp_pattern": None,
    "experimental_attention_variant": None, "dsa_indexer_n_heads": 0, "dsa_indexer_head_dim": 0, "dsa_indexer_topk": 0,
    "dsa_indexer_loss_coeff": 0.0, "dsa_indexer_use_sparse_loss": False, "dsa_indexer_k_norm_fp32": False,
    "dsa_indexer_topk_freq": 1, "dsa_indexer_skip_topk_offset": 0, "dsa_skip_topk": False, "dsa_kernel_backend": "none",
    "linear_attention_pattern": None, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "eval_micro_batch_size": None,   # the evaluation step's micro-batch (estimator/eval_step.py)
    "eval_num_microbatches": None,   # and its number of micro-batches
    "peft": None,   # LoRA / DoRA (layout/peft.py): written as its object when set
}
