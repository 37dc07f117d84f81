"""Every real config in shared/configs loads (read from there, not copied);
the layout read from it matches the values written in the file; and its estimate equals the one from
the equivalent Megatron flags, written out by hand from the file's values."""
import os

import pytest

from megatron_memguard import estimate, resolve
from megatron_memguard.cli.main import build_parser, load_raw, resolve_world
from megatron_memguard.layout import ShardGroup
from megatron_memguard.readers.megatron_flags import flags_from_mapping, parse_megatron_flags

from benchmarks.shared_data import CONFIGS

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = CONFIGS

pytest.importorskip("omegaconf")


def load(rel, *opts, flags=()):
    ns = build_parser().parse_args(["estimate", "--config", os.path.join(DATA, rel), *opts])
    raw = load_raw(ns, list(flags))
    return raw, resolve(raw, world_size=resolve_world(ns), vocab_size=ns.vocab_size)


def flags_layout(flags, world, vocab=None):
    return resolve(parse_megatron_flags(flags.split()), world_size=world, vocab_size=vocab)


def check(layout, **expected):
    got = {k: getattr(layout, k) for k in expected}
    assert got == expected


def same_estimate(a, b):
    a, b = a.replace(env=()), b.replace(env=())  # flags after -- are read with the caller's environment
    assert a == b  # Layout equality (notes excluded)
    ea, eb = estimate(a), estimate(b)
    assert ea.to_dict()["stages"] == eb.to_dict()["stages"]
    assert ea.verdict == eb.verdict


LLAMA_LIKE = ("--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
              "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --bf16 ")


def test_nemo1_megatron_gpt_config():
    raw, L = load("nemo1/megatron_gpt_config.yaml")
    assert raw.world_size == 1 and raw.source.startswith("NeMo 1 config")
    check(L, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
          context_parallel_size=1, sequence_parallel=False, micro_batch_size=4, global_batch_size=8, seq_length=512,
          max_position_embeddings=512, num_layers=12, hidden_size=768, num_attention_heads=12, num_query_groups=12,
          ffn_hidden_size=3072, vocab_size=50257, padded_vocab_size=50304, use_distributed_optimizer=False,
          recompute_granularity=None, params_dtype="bf16", transformer_impl="local", gated_linear_unit=False,
          untie_embeddings_and_output_weights=False, position_embedding_type="learned_absolute", normalization="LayerNorm")
    same_estimate(L, flags_layout(
        "--num-layers 12 --hidden-size 768 --ffn-hidden-size 3072 --num-attention-heads 12 --seq-length 512 "
        "--max-position-embeddings 512 --micro-batch-size 4 --global-batch-size 8 --bf16 --tokenizer-type GPT2BPETokenizer "
        "--transformer-impl local --no-gradient-accumulation-fusion --no-create-attention-mask-in-dataloader", 1))


def test_nemo1_megatron_llama_config_needs_vocab_and_is_fp32():
    raw, L = load("nemo1/megatron_llama_config.yaml", "--vocab-size", "32000")
    check(L, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, sequence_parallel=False, micro_batch_size=4,
          global_batch_size=8, seq_length=4096, num_layers=32, hidden_size=4096, num_attention_heads=32,
          num_query_groups=32, ffn_hidden_size=11008, vocab_size=32000, padded_vocab_size=32000,
          use_distributed_optimizer=False, recompute_granularity=None, params_dtype="fp32", swiglu=True,
          apply_query_key_layer_scaling=False, transformer_impl="transformer_engine")
    same_estimate(L, flags_layout(
        "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 --group-query-attention "
        "--num-query-groups 32 --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope "
        "--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0 "
        "--attention-dropout 0 --micro-batch-size 4 --global-batch-size 8 --no-bias-swiglu-fusion --no-bias-dropout-fusion "
        "--no-rope-fusion --no-gradient-accumulation-fusion --no-create-attention-mask-in-dataloader "
        "--tokenizer-type SentencePieceTokenizer", 1, vocab=32000))


GPT3_5B = ("--num-layers 24 --hidden-size 4096 --ffn-hidden-size 16384 --num-attention-heads 32 --bf16 "
           "--tokenizer-type GPT2BPETokenizer --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
           "--no-create-attention-mask-in-dataloader ")


def test_launcher_gpt3_5b():
    raw, L = load("nemo-launcher/gpt3_5b.yaml")
    assert (raw.world_size, raw.nodes, raw.gpus_per_node) == (128, 16, 8)
    check(L, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
          context_parallel_size=1, sequence_parallel=False, micro_batch_size=4, global_batch_size=2048, seq_length=2048,
          num_layers=24, hidden_size=4096, num_attention_heads=32, num_query_groups=32, ffn_hidden_size=16384,
          vocab_size=50257, use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
          recompute_granularity=None, data_parallel_size=128)
    same_estimate(L, flags_layout(GPT3_5B + "--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 "
                                            "--global-batch-size 2048", 128))


def test_launcher_gpt3_5b_32k_resolves_training_interpolations():
    raw, L = load("nemo-launcher/gpt3_5b_32k.yaml")
    check(L, world_size=16, tensor_model_parallel_size=8, data_parallel_size=2, micro_batch_size=1, global_batch_size=32,
          seq_length=32768, max_position_embeddings=32768, ffn_hidden_size=16384, num_microbatches=16)
    assert not raw.problems  # data.seq_length: ${training.model.encoder_seq_length} agrees
    same_estimate(L, flags_layout(GPT3_5B + "--tensor-model-parallel-size 8 --seq-length 32768 "
                                            "--max-position-embeddings 32768 --micro-batch-size 1 --global-batch-size 32", 16))


def test_launcher_llama2_7b():
    raw, L = load("nemo-launcher/llama_llama2_7b.yaml", "--vocab-size", "32000")
    check(L, world_size=128, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, micro_batch_size=1,
          global_batch_size=2048, seq_length=4096, num_layers=32, hidden_size=4096, num_attention_heads=32,
          num_query_groups=32, ffn_hidden_size=11008, vocab_size=32000, use_distributed_optimizer=True,
          recompute_granularity=None, recompute_method=None, cross_entropy_loss_fusion=True, apply_rope_fusion=True)
    same_estimate(L, flags_layout(
        LLAMA_LIKE + "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 "
        "--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 2048 "
        "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --cross-entropy-loss-fusion "
        "--no-create-attention-mask-in-dataloader --tokenizer-type SentencePieceTokenizer "
        "--tokenizer-model /llama/llama_tokenizer.model", 128, vocab=32000))


def test_launcher_llama3_1_8b():
    raw, L = load("nemo-launcher/llama_llama3_1_8b.yaml")
    check(L, world_size=128, tensor_model_parallel_size=1, context_parallel_size=2, data_parallel_size=64,
          micro_batch_size=1, global_batch_size=2048, seq_length=8192, num_layers=32, hidden_size=4096,
          num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336, vocab_size=128256, padded_vocab_size=128256,
          use_distributed_optimizer=True, sequence_parallel=False)
    same_estimate(L, flags_layout(
        LLAMA_LIKE + "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
        "--group-query-attention --num-query-groups 8 --context-parallel-size 2 --seq-length 8192 "
        "--max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 2048 --use-distributed-optimizer "
        "--overlap-grad-reduce --overlap-param-gather --cross-entropy-loss-fusion --no-create-attention-mask-in-dataloader "
        "--tokenizer-type HuggingFaceTokenizer --tokenizer-model meta-llama/Meta-Llama-3.1-8B", 128))


def test_launcher_llama3_1_70b():
    raw, L = load("nemo-launcher/llama_llama3_1_70b.yaml")
    check(L, world_size=1024, tensor_model_parallel_size=4, pipeline_model_parallel_size=4,
          virtual_pipeline_model_parallel_size=10, context_parallel_size=2, sequence_parallel=True, data_parallel_size=32,
          micro_batch_size=1, global_batch_size=2048, seq_length=8192, num_layers=80, hidden_size=8192,
          num_attention_heads=64, num_query_groups=8, ffn_hidden_size=28672, vocab_size=128256,
          use_distributed_optimizer=True, tp_comm_overlap=True, recompute_granularity=None)
    same_estimate(L, flags_layout(
        LLAMA_LIKE + "--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 "
        "--group-query-attention --num-query-groups 8 --tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 "
        "--num-virtual-stages-per-pipeline-rank 10 --context-parallel-size 2 --sequence-parallel --tp-comm-overlap "
        "--defer-embedding-wgrad-compute --wgrad-deferral-limit 22 --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 "
        "--global-batch-size 2048 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
        "--cross-entropy-loss-fusion --no-create-attention-mask-in-dataloader "
        "--tokenizer-type HuggingFaceTokenizer --tokenizer-model meta-llama/Meta-Llama-3.1-70B", 1024))


def test_launcher_mixtral_loads_and_resolves_like_the_flags():
    from megatron_memguard.readers.detect import read_config_file

    raw = read_config_file(os.path.join(DATA, "nemo-launcher/mixtral_mixtral_8x7b.yaml"))
    a = raw.args
    assert raw.world_size == 64
    assert (a["tensor_model_parallel_size"], a["pipeline_model_parallel_size"], a["virtual_pipeline_model_parallel_size"],
            a["expert_model_parallel_size"], a["num_experts"]) == (1, 4, 8, 8, 8)
    assert (a["micro_batch_size"], a["global_batch_size"], a["seq_length"], a["num_layers"], a["hidden_size"],
            a["num_attention_heads"], a["num_query_groups"], a["ffn_hidden_size"]) == (1, 256, 4096, 32, 4096, 32, 8, 14336)
    assert a["sequence_parallel"] is False and any("switches sequence parallelism off" in w for w in raw.warnings)
    assert a["use_distributed_optimizer"] and a["grad_reduce_in_bf16"]
    # mixture of experts is modelled: 8 experts over EP 8 (one per rank), ETP = TP = 1, expert DP = 64 / (8 x PP 4) = 2
    L = resolve(raw)
    assert (L.moe.num_experts, L.moe.ep, L.moe.etp, L.moe.local_experts, L.moe.moe_router_topk) == (8, 8, 1, 1, 2)
    assert L.parallel.shard_size(ShardGroup.EXPERT_DP) == 2
    flags = flags_layout("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-experts 8 --seq-length 4096 "
                         "--micro-batch-size 1", 64)
    assert flags.moe.num_experts == 8


def test_nemo2_checkpoint_model_yaml():
    raw, L = load("nemo2/context_model.yaml", "--gpus", "8", flags=["--micro-batch-size", "2"])
    assert raw.best_effort
    check(L, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1, sequence_parallel=False,
          micro_batch_size=2, global_batch_size=16, seq_length=1024, num_layers=2, hidden_size=1024, num_attention_heads=8,
          num_query_groups=8, ffn_hidden_size=4096, vocab_size=50257, padded_vocab_size=50304,
          use_distributed_optimizer=True, recompute_granularity=None, params_dtype="fp32", gated_linear_unit=False)
    same_estimate(L, flags_layout(
        "--num-layers 2 --hidden-size 1024 --num-attention-heads 8 --ffn-hidden-size 4096 --seq-length 1024 "
        "--max-position-embeddings 1024 --micro-batch-size 2 --use-distributed-optimizer --tokenizer-type "
        "HuggingFaceTokenizer --tokenizer-model gpt2 --cross-entropy-loss-fusion --no-bias-gelu-fusion "
        "--no-bias-dropout-fusion --no-create-attention-mask-in-dataloader", 8))


BRIDGE_LLAMA = ("--normalization RMSNorm --swiglu --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 "
                "--position-embedding-type rope --bf16 --tokenizer-type NullTokenizer --vocab-size 32000 "
                "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --cross-entropy-loss-fusion "
                "--no-create-attention-mask-in-dataloader --group-query-attention --num-query-groups 8 ")


def test_bridge_llama32_1b_override_on_its_recipe():
    raw, L = load("megatron-bridge/llama32_1b_pretrain_override.yaml", "--model", "llama32_1b", "--gpus", "8")
    check(L, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
          context_parallel_size=1, sequence_parallel=False, micro_batch_size=1, global_batch_size=8, seq_length=4096,
          num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8, kv_channels=64,
          ffn_hidden_size=8192, vocab_size=32000, padded_vocab_size=32000, use_distributed_optimizer=True,
          recompute_granularity=None, untie_embeddings_and_output_weights=False)
    assert raw.origin["global_batch_size"] == "train.global_batch_size"
    assert raw.origin["num_layers"] == "model.num_layers (recipe llama32_1b)"
    same_estimate(L, flags_layout(BRIDGE_LLAMA + "--num-layers 16 --hidden-size 2048 --num-attention-heads 32 "
                                                 "--kv-channels 64 --ffn-hidden-size 8192 --seq-length 4096 "
                                                 "--micro-batch-size 1 --global-batch-size 8", 8))


def test_bridge_quantized_llama3_8b_override_on_its_recipe():
    raw, L = load("megatron-bridge/quantized_llama3_8b_pretrain_override.yaml", "--model", "llama3_8b", "--gpus", "8")
    # the file sets TP=1, CP=1 (the recipe's CP=2 is overridden), GBS 8 and gradient_accumulation_fusion off;
    # MBS and the sequence length come from the recipe.
    check(L, tensor_model_parallel_size=1, context_parallel_size=1, pipeline_model_parallel_size=1, micro_batch_size=1,
          global_batch_size=8, seq_length=8192, num_layers=32, hidden_size=4096, num_attention_heads=32,
          num_query_groups=8, ffn_hidden_size=14336, vocab_size=32000, use_distributed_optimizer=True,
          gradient_accumulation_fusion=False, untie_embeddings_and_output_weights=True, sequence_parallel=False)
    same_estimate(L, flags_layout(BRIDGE_LLAMA + "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 "
                                                 "--ffn-hidden-size 14336 --untie-embeddings-and-output-weights "
                                                 "--seq-length 8192 --micro-batch-size 1 --global-batch-size 8 "
                                                 "--no-gradient-accumulation-fusion", 8))


def test_bridge_distillation_override_estimates_the_student_and_says_so():
    raw, L = load("megatron-bridge/llama32_3b-1b_distill_override.yaml", "--model", "llama32_1b", "--gpus", "8")
    check(L, tensor_model_parallel_size=2, pipeline_model_parallel_size=1, context_parallel_size=1, sequence_parallel=True,
          micro_batch_size=1, global_batch_size=8, seq_length=4096, num_layers=16, hidden_size=2048,
          accumulate_allreduce_grads_in_fp32=True, use_distributed_optimizer=True)
    assert any("model.teacher" in w and "not counted" in w for w in raw.warnings)
    same_estimate(L, flags_layout(BRIDGE_LLAMA + "--num-layers 16 --hidden-size 2048 --num-attention-heads 32 "
                                                 "--kv-channels 64 --ffn-hidden-size 8192 --seq-length 4096 "
                                                 "--micro-batch-size 1 --global-batch-size 8 "
                                                 "--tensor-model-parallel-size 2 --sequence-parallel", 8))


FUNCTIONAL = sorted(os.listdir(os.path.join(DATA, "megatron-functional")))


@pytest.mark.parametrize("name", FUNCTIONAL)
def test_megatron_functional_configs(name):
    import yaml

    path = os.path.join(DATA, "megatron-functional", name)
    with open(path) as fh:
        doc = yaml.safe_load(fh)
    env = {"TENSORBOARD_PATH": "/tb", "CHECKPOINT_SAVE_PATH": "/ck", "CHECKPOINT_LOAD_PATH": "/ck", "DATA_PATH": "/d",
           "DATA_CACHE_PATH": "/c"}
    raw, L = load(os.path.join("megatron-functional", name), "--world-size", "8")
    ma = doc["MODEL_ARGS"]
    check(L, tensor_model_parallel_size=ma.get("--tensor-model-parallel-size", 1),
          pipeline_model_parallel_size=ma.get("--pipeline-model-parallel-size", 1),
          context_parallel_size=ma.get("--context-parallel-size", 1), micro_batch_size=ma["--micro-batch-size"],
          global_batch_size=ma["--global-batch-size"], seq_length=ma["--seq-length"], num_layers=ma["--num-layers"],
          hidden_size=ma["--hidden-size"], num_attention_heads=ma["--num-attention-heads"],
          use_distributed_optimizer=bool(ma.get("--use-distributed-optimizer", False)),
          recompute_granularity=ma.get("--recompute-granularity"))
    same_estimate(L, resolve(parse_megatron_flags(flags_from_mapping(ma), env=env), world_size=8))


def test_list_flag_written_as_one_yaml_string():
    # Megatron's functional tests write list-valued flags as one string:
    # gpt3_mcore_te_tp1_pp2_resume_torch_dist_cp4_a2a_p2p_nondeterministic/model_config.yaml
    argv = flags_from_mapping({"--context-parallel-size": 4, "--cp-comm-type": "a2a+p2p",
                               "--hierarchical-context-parallel-sizes": "[2 2]", "--bf16": True})
    assert argv == ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                    "--hierarchical-context-parallel-sizes", "2", "2", "--bf16"]
    # only flags that take several values are split; a single value that is a Python list stays whole
    assert flags_from_mapping({"--cp-comm-type": "['p2p', 'a2a']", "--moe-layer-freq": "[1,0,1]"}) == [
        "--cp-comm-type", "p2p", "a2a", "--moe-layer-freq", "[1,0,1]"]


def test_list_flag_written_as_plain_words():
    """``--recompute-modules: core_attn mlp`` (no brackets): the CI launcher joins MODEL_ARGS into one
    command line that the shell splits into words, and --recompute-modules takes several values (core
    0.19.2 megatron/training/arguments.py, data/megatron_flags.json: a list flag), so it is the list [core_attn, mlp], as "[core_attn mlp]" is.
    (Checked: core 0.19.2 parse_args on ["--recompute-modules", "core_attn", "mlp"] gives that list.)
    A one-value flag with a space keeps its value whole (only list flags are split)."""
    plain = flags_from_mapping({"--recompute-modules": "core_attn mlp"})
    assert plain == ["--recompute-modules", "core_attn", "mlp"] == flags_from_mapping({"--recompute-modules": "[core_attn mlp]"})
    assert parse_megatron_flags(plain).args["recompute_modules"] == ["core_attn", "mlp"]
    assert flags_from_mapping({"--recompute-modules": "moe_act"}) == ["--recompute-modules", "moe_act"]
    assert flags_from_mapping({"--wandb-exp-name": "my run"}) == ["--wandb-exp-name", "my run"]
