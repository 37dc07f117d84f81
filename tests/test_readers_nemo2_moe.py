"""NeMo 2 YAML of mixture-of-experts models: the MoE keys of the model config, the strategy's expert
parallel sizes, and the MoE defaults of NeMo 2's config classes (data/presets.yaml nemo2_classes).

The files are written in the format NeMo-Run's YAML serializer gives (``_target_`` paths, dtypes as
``{_target_: torch.bfloat16, _call_: false}``): a ``--to-yaml`` export of NeMo 2.5.0's
``nemo/collections/llm/recipes/qwen3_30b_a3b.py`` pretrain_recipe (its defaults: TP 4, PP 2, EP 4, ETP 1,
SP, 1 node of 8 GPUs, MockDataModule seq 4096 / GBS 32 / MBS 2, full uniform recompute of 1 layer), and a
checkpoint's ``context/model.yaml`` (IOMixin.io_dump: every config field written)."""
import textwrap

import pytest

from megatron_memguard.estimator.params import total_parameters
from megatron_memguard.readers.detect import read_config_file
from megatron_memguard.resolve import resolve

QWEN3_30B_A3B_EXPORT = """
_target_: nemo.collections.llm.api.pretrain
_partial_: true
model:
  _target_: nemo.collections.llm.gpt.model.qwen3.Qwen3Model
  config:
    _target_: nemo.collections.llm.gpt.model.qwen3.Qwen3Config30B_A3B
    recompute_granularity: full
    recompute_method: uniform
    recompute_num_layers: 1
trainer:
  _target_: nemo.lightning.pytorch.trainer.Trainer
  devices: 8
  num_nodes: 1
  accumulate_grad_batches: 1
  strategy:
    _target_: nemo.lightning.pytorch.strategies.megatron_strategy.MegatronStrategy
    tensor_model_parallel_size: 4
    pipeline_model_parallel_size: 2
    virtual_pipeline_model_parallel_size: null
    context_parallel_size: 1
    sequence_parallel: true
    expert_model_parallel_size: 4
    expert_tensor_parallel_size: 1
    ddp:
      _target_: megatron.core.distributed.distributed_data_parallel_config.DistributedDataParallelConfig
      check_for_nan_in_grad: true
      grad_reduce_in_fp32: true
      overlap_grad_reduce: true
      overlap_param_gather: true
  plugins:
    _target_: nemo.lightning.pytorch.plugins.mixed_precision.MegatronMixedPrecision
    precision: bf16-mixed
    params_dtype:
      _target_: torch.bfloat16
      _call_: false
    pipeline_dtype:
      _target_: torch.bfloat16
      _call_: false
data:
  _target_: nemo.collections.llm.gpt.data.mock.MockDataModule
  seq_length: 4096
  global_batch_size: 32
  micro_batch_size: 2
  tokenizer:
    _target_: nemo.collections.common.tokenizers.huggingface.auto_tokenizer.AutoTokenizer
    pretrained_model_name: Qwen/Qwen3-30B-A3B
optim:
  _target_: nemo.lightning.pytorch.optim.megatron.MegatronOptimizerModule
  config:
    _target_: megatron.core.optimizer.optimizer_config.OptimizerConfig
    optimizer: adam
    bf16: true
    use_distributed_optimizer: true
"""


def read(tmp_path, text, *overrides):
    p = tmp_path / "nemo2.yaml"
    p.write_text(textwrap.dedent(text))
    return read_config_file(str(p), overrides=list(overrides))


def test_qwen3_moe_export_takes_the_class_moe_defaults(tmp_path):
    raw = read(tmp_path, QWEN3_30B_A3B_EXPORT)
    L = resolve(raw)
    m = L.moe
    # shape: the published config.json (Qwen/Qwen3-30B-A3B) the class repeats (qwen3.py Qwen3Config30B_A3B)
    assert (L.num_layers, L.hidden_size, m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size) == (48, 2048, 128, 8, 768)
    # Qwen3MoEConfig (NeMo 2.5.0 qwen3.py): alltoall (Megatron's own default is allgather), grouped GEMM,
    # permute fusion, aux loss 1e-3, top-k softmax after selection
    assert (m.moe_token_dispatcher_type, m.moe_grouped_gemm, m.moe_permute_fusion, m.moe_aux_loss_coeff,
            m.moe_router_pre_softmax) == ("alltoall", True, True, 0.001, False)
    assert raw.origin["moe_token_dispatcher_type"] == "model.config._target_ (Qwen3Config30B_A3B)"
    # the recipe's trainer: 8 GPUs, TP 4 PP 2 EP 4 ETP 1 with SP -> DP 1, expert DP 8 / (4 x 2) = 1
    assert (L.world_size, L.tensor_model_parallel_size, L.pipeline_model_parallel_size, m.expert_model_parallel_size,
            m.expert_tensor_parallel_size, L.sequence_parallel) == (8, 4, 2, 4, 1, True)
    assert raw.origin["expert_model_parallel_size"] == "trainer.strategy.expert_model_parallel_size"
    assert (L.recompute_granularity, L.recompute_method, L.recompute_num_layers) == ("full", "uniform", 1)
    assert (L.micro_batch_size, L.global_batch_size, L.seq_length) == (2, 32, 4096)


def test_export_keys_win_over_the_class_and_overrides_over_both(tmp_path):
    raw = read(tmp_path, QWEN3_30B_A3B_EXPORT, "model.config.moe_token_dispatcher_type=allgather",
               "trainer.strategy.expert_model_parallel_size=2", "model.config.moe_router_dtype=fp32")
    L = resolve(raw)
    assert (L.moe.moe_token_dispatcher_type, L.moe.expert_model_parallel_size, L.moe.moe_router_dtype) == \
        ("allgather", 2, "fp32")
    assert raw.origin["moe_token_dispatcher_type"] == "model.config.moe_token_dispatcher_type"


# DeepSeek-V2-Lite as a checkpoint's context/model.yaml writes it (DeepSeekModel with the full
# DeepSeekV2LiteConfig: deepseek.py values; the strategy has copied the parallel sizes into the config)
DEEPSEEK_V2_LITE_CONTEXT = """
_target_: nemo.collections.llm.gpt.model.deepseek.DeepSeekModel
config:
  _target_: nemo.collections.llm.gpt.model.deepseek.DeepSeekV2LiteConfig
  num_layers: 27
  hidden_size: 2048
  ffn_hidden_size: 10944
  num_attention_heads: 16
  kv_channels: 16
  multi_latent_attention: true
  q_lora_rank: null
  kv_lora_rank: 512
  qk_head_dim: 128
  qk_pos_emb_head_dim: 64
  v_head_dim: 128
  qk_layernorm: true
  normalization: RMSNorm
  gated_linear_unit: true
  add_bias_linear: false
  position_embedding_type: rope
  share_embeddings_and_output_weights: false
  make_vocab_size_divisible_by: 3200
  vocab_size: 102400
  seq_length: 4096
  num_moe_experts: 64
  moe_ffn_hidden_size: 1408
  moe_shared_expert_intermediate_size: 2816
  moe_layer_freq: [0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
  moe_router_topk: 6
  moe_router_num_groups: 1
  moe_router_group_topk: 1
  moe_router_topk_scaling_factor: 1.0
  moe_aux_loss_coeff: 0.001
  moe_grouped_gemm: true
  moe_router_pre_softmax: true
  moe_token_dispatcher_type: alltoall
  moe_router_load_balancing_type: seq_aux_loss
  moe_shared_expert_overlap: true
  moe_router_dtype: fp32
  moe_permute_fusion: true
  tensor_model_parallel_size: 1
  pipeline_model_parallel_size: 2
  expert_model_parallel_size: 8
  expert_tensor_parallel_size: 1
  pipeline_model_parallel_layout: [[embedding, decoder, decoder, decoder, decoder, decoder, decoder, decoder, decoder,
                                    decoder, decoder, decoder, decoder, decoder],
                                   [decoder, decoder, decoder, decoder, decoder, decoder, decoder, decoder, decoder,
                                    decoder, decoder, decoder, decoder, decoder, loss]]
  params_dtype:
    _target_: torch.bfloat16
    _call_: false
  bf16: true
tokenizer:
  _target_: nemo.collections.common.tokenizers.huggingface.auto_tokenizer.AutoTokenizer
  pretrained_model_name: deepseek-ai/DeepSeek-V2-Lite
"""


def test_deepseek_context_model_yaml_moe_keys(tmp_path):
    raw = read(tmp_path, DEEPSEEK_V2_LITE_CONTEXT)
    L = resolve(raw.with_args(micro_batch_size=1, global_batch_size=64), world_size=16)
    m = L.moe
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size) == \
        (64, 6, 1408, 2816)
    assert m.moe_layer_pattern == (False,) + (True,) * 26
    assert (m.expert_model_parallel_size, m.moe_router_dtype, m.moe_shared_expert_overlap) == (8, "fp32", True)
    # the list-form layout (megatron-core LayerType names): 13 + 14 layers, E first, L last
    assert L.pipeline_model_parallel_layout == "E" + "t" * 13 + "|" + "t" * 14 + "L"
    # multi-latent attention: the config's kv_channels / num_query_groups are not grouped-query attention
    assert L.multi_latent_attention and not L.group_query_attention
    # 15,706,484,224: transformers' count of deepseek-ai/DeepSeek-V2-Lite (tests/data/moe_reference_counts.json);
    # 102400 is a multiple of 3200 x TP 1, so no padding
    assert L.padded_vocab_size == 102400 and total_parameters(L) == 15_706_484_224


def test_deepseek_v3_class_only_export_pads_as_the_class_says(tmp_path):
    text = """
    _target_: nemo.collections.llm.api.pretrain
    model:
      _target_: nemo.collections.llm.gpt.model.deepseek.DeepSeekModel
      config:
        _target_: nemo.collections.llm.gpt.model.deepseek.DeepSeekV3Config
    trainer:
      devices: 8
      num_nodes: 128
      strategy:
        _target_: nemo.lightning.pytorch.strategies.megatron_strategy.MegatronStrategy
        tensor_model_parallel_size: 2
        pipeline_model_parallel_size: 16
        expert_model_parallel_size: 64
        expert_tensor_parallel_size: 1
        sequence_parallel: true
        pipeline_model_parallel_layout: "Etttt|(tttt|)*14tL"
      plugins:
        _target_: nemo.lightning.pytorch.plugins.mixed_precision.MegatronMixedPrecision
        precision: bf16-mixed
    data:
      _target_: nemo.collections.llm.gpt.data.mock.MockDataModule
      seq_length: 4096
      global_batch_size: 4096
      micro_batch_size: 1
    """
    raw = read(tmp_path, text)
    L = resolve(raw)
    # DeepSeekV3Config: make_vocab_size_divisible_by 1280; config.json's 129280 padded to 1280 x TP 2 = 2560
    assert L.padded_vocab_size == 130560
    assert (L.moe.moe_aux_loss_coeff, L.moe.moe_router_score_function, L.moe.moe_router_enable_expert_bias,
            L.moe.moe_token_dispatcher_type) == (0.0001, "sigmoid", True, "alltoall")
    assert L.mtp_num_layers in (0, None)      # the class's default: no MTP unless the export sets it
    assert raw.best_effort and L.world_size == 1024


@pytest.mark.parametrize("cls, dispatcher, grouped", [("MixtralConfig8x7B", "alltoall", False),
                                                      ("Qwen3Config235B_A22B", "alltoall", True)])
def test_other_moe_classes(tmp_path, cls, dispatcher, grouped):
    text = QWEN3_30B_A3B_EXPORT.replace("nemo.collections.llm.gpt.model.qwen3.Qwen3Config30B_A3B", f"x.{cls}")
    L = resolve(read(tmp_path, text, "trainer.strategy.pipeline_model_parallel_size=1"))
    assert (L.moe.moe_token_dispatcher_type, L.moe.moe_grouped_gemm) == (dispatcher, grouped)


def test_fp16_job_reducing_in_its_own_dtype_is_not_a_bf16_reduction(tmp_path):
    """DDP and plugin ``grad_reduce_in_fp32: false`` on a 16-mixed (fp16) job: megatron-core's gradient
    buffer takes the parameter dtype (distributed_data_parallel.py ``torch.float if grad_reduce_in_fp32
    else param.dtype``, 0.16.1 and 0.19.2), fp16 here: no fp32 accumulation, and no bf16 reduction in the
    layout either (the reader once wrote grad_reduce_in_bf16 from the DDP key)."""
    text = (QWEN3_30B_A3B_EXPORT.replace("grad_reduce_in_fp32: true", "grad_reduce_in_fp32: false")
            .replace("precision: bf16-mixed", "precision: 16-mixed\n    grad_reduce_in_fp32: false")
            .replace("_target_: torch.bfloat16", "_target_: torch.float16").replace("bf16: true", "fp16: true"))
    raw = read(tmp_path, text)
    assert "grad_reduce_in_bf16" not in raw.args
    assert raw.args["accumulate_allreduce_grads_in_fp32"] is False
    assert raw.key("accumulate_allreduce_grads_in_fp32") == "trainer.strategy.ddp.grad_reduce_in_fp32"
    L = resolve(raw)
    assert (L.params_dtype, L.grad_reduce_in_bf16, L.accumulate_allreduce_grads_in_fp32) == ("fp16", False, False)
    # the bf16 job with the same keys does reduce in bf16 (--grad-reduce-in-bf16)
    bf = read(tmp_path, QWEN3_30B_A3B_EXPORT.replace("grad_reduce_in_fp32: true", "grad_reduce_in_fp32: false")
              .replace("precision: bf16-mixed", "precision: bf16-mixed\n    grad_reduce_in_fp32: false"))
    assert bf.args["grad_reduce_in_bf16"] is True and resolve(bf).grad_reduce_in_bf16


def test_nemo2_attention_backend_local_with_the_te_spec_is_a_problem(tmp_path):
    """NeMo 2.5.0's GPTConfig.configure_model keeps the TE spec's TEDotProductAttention, and megatron-core's
    LanguageModule sets NVTE_FLASH_ATTN, NVTE_FUSED_ATTN and NVTE_UNFUSED_ATTN to 0 for the local backend
    (language_module.py, 0.16.1 and 0.19.2): TE 2.11's DotProductAttention raises "No dot product attention
    backend is available" at the first forward. The reader reports it, naming the key."""
    text = QWEN3_30B_A3B_EXPORT.replace("    recompute_num_layers: 1\n",
                                        "    recompute_num_layers: 1\n    attention_backend: local\n")
    raw = read(tmp_path, text)
    assert [str(p).split(":")[0] for p in raw.problems] == ["model.config.attention_backend"]
    ok = read(tmp_path, text.replace("attention_backend: local", "attention_backend: unfused"))
    assert not ok.problems


@pytest.mark.parametrize("target, extra, key", [
    # NeMo 2's Gemma2Config builds Gemma 2's softcapping attention and output layer (as Bridge's Gemma2ModelProvider,
    # models/gemma/gemma2_provider.py, which it was ported from): refused by its class, and the softcap by its key
    ("nemo.collections.llm.gpt.model.gemma2.Gemma2Config2B", "", "model.config._target_"),
    ("nemo.collections.llm.gpt.model.qwen3.Qwen3Config30B_A3B", "    attn_logit_softcapping: 50.0\n",
     "model.config.attn_logit_softcapping"),
    ("nemo.collections.llm.gpt.model.qwen3.Qwen3Config30B_A3B", "    final_logit_softcapping: 30.0\n",
     "model.config.final_logit_softcapping"),
])
def test_nemo2_gemma2_softcapping_is_refused_by_name(tmp_path, target, extra, key):
    from megatron_memguard.errors import NotModelledError

    text = QWEN3_30B_A3B_EXPORT.replace("nemo.collections.llm.gpt.model.qwen3.Qwen3Config30B_A3B", target, 1).replace(
        "    recompute_num_layers: 1\n", "    recompute_num_layers: 1\n" + extra, 1)
    with pytest.raises(NotModelledError, match=rf"^{key}: Gemma 2's attention logit softcapping"):
        read(tmp_path, text)
    # a softcap of 0 is off (Bridge's `if softcap`): the Qwen3 export still reads
    if extra:
        assert read(tmp_path, text.replace(": 50.0", ": 0.0").replace(": 30.0", ": 0")).args["num_layers"] == 48


@pytest.mark.parametrize("target, key, message", [
    # NeMo 2.5.0's Gemma3Config27B defaults to is_vision_language: true (gemma3.py: an arbitrary attention mask)
    ("nemo.collections.llm.gpt.model.gemma3.Gemma3Config27B", r"model\.config\._target_ \(Gemma3Config27B\)",
     "NeMo 2's Gemma 3 with is_vision_language"),
    # a Gemma 3 class NeMo 2.5.0 does not have: its defaults are unknown
    ("nemo.collections.llm.gpt.model.gemma3.Gemma3Config270M", r"model\.config\._target_",
     "a NeMo 2 Gemma 3 config class memguard has not bundled"),
])
def test_nemo2_gemma3_refusals_by_its_class(tmp_path, target, key, message):
    # (Gemma3Config1B and the text 4B / 12B / 27B are read: tests/test_gemma3.py)
    from megatron_memguard.errors import NotModelledError

    text = QWEN3_30B_A3B_EXPORT.replace("nemo.collections.llm.gpt.model.qwen3.Qwen3Config30B_A3B", target, 1)
    with pytest.raises(NotModelledError, match=rf"^{key}: {message}"):
        read(tmp_path, text)
