"""Stand-in for megatron/training/arguments.py of core_v0.16.1 (the parts the hook meets).

Names, signatures and the order of operations follow core_v0.16.1; the option list is the subset of
Megatron's flags that decide memory or that the test driver needs, with 0.16.1's defaults.
"""
import argparse
import os
import re

import torch


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    """Parse all arguments."""
    parser = argparse.ArgumentParser(description='Megatron-LM Arguments', allow_abbrev=False)

    # Standard arguments.
    parser = add_megatron_arguments(parser)

    # Custom arguments.
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)

    # Parse.
    if ignore_unknown_args:
        args, _ = parser.parse_known_args()
    else:
        args = parser.parse_args()

    # Experimental yaml
    if args.yaml_cfg is not None:
        from .yaml_arguments import load_yaml
        assert args.yaml_cfg and not args.use_legacy_models, "Yaml config is not supported with legacy models."
        args = load_yaml(args.yaml_cfg)

    # Args from environment
    args.rank = int(os.getenv('RANK', '0'))
    args.world_size = int(os.getenv("WORLD_SIZE", '1'))

    return args


def add_megatron_arguments(parser: argparse.ArgumentParser):
    """Add Megatron-LM arguments to the given parser."""
    parser = _add_network_size_args(parser)
    parser = _add_regularization_args(parser)
    parser = _add_training_args(parser)
    parser = _add_initialization_args(parser)
    parser = _add_learning_rate_args(parser)
    parser = _add_checkpointing_args(parser)
    parser = _add_mixed_precision_args(parser)
    parser = _add_distributed_args(parser)
    parser = _add_data_args(parser)
    parser = _add_tokenizer_args(parser)
    parser = _add_logging_args(parser)
    parser = _add_transformer_engine_args(parser)
    parser = _add_experimental_args(parser)
    parser = _add_moe_args(parser)
    return parser


def _add_network_size_args(parser):
    group = parser.add_argument_group(title='network size')
    group.add_argument('--num-layers', type=int, default=None)
    group.add_argument('--hidden-size', type=int, default=None)
    group.add_argument('--ffn-hidden-size', type=int, default=None)
    group.add_argument('--num-attention-heads', type=int, default=None)
    group.add_argument('--group-query-attention', action='store_true')
    group.add_argument('--num-query-groups', type=int, default=1)
    group.add_argument('--kv-channels', type=int, default=None)
    group.add_argument('--max-position-embeddings', type=int, default=None)
    group.add_argument('--position-embedding-type', type=str, default='learned_absolute',
                       choices=['learned_absolute', 'rope', 'mrope', 'relative', 'none'])
    group.add_argument('--rotary-percent', type=float, default=1.0)
    group.add_argument('--make-vocab-size-divisible-by', type=int, default=128)
    group.add_argument('--normalization', default='LayerNorm', choices=['LayerNorm', 'RMSNorm'])
    group.add_argument('--norm-epsilon', type=float, default=1e-5)
    group.add_argument('--swiglu', action='store_true')
    group.add_argument('--untie-embeddings-and-output-weights', action='store_true')
    group.add_argument('--disable-bias-linear', action='store_false', dest='add_bias_linear')
    group.add_argument('--add-qkv-bias', action='store_true')
    group.add_argument('--pipeline-model-parallel-layout', type=str, default=None)
    return parser


def _eval_pattern(pattern):
    """core_v0.16.1 arguments.py: validate and evaluate a string holding a Python list expression."""
    if bool(re.compile(r'[^,\d\[\]\(\)\+\*]').search(pattern)):
        raise ValueError(f"Invalid pattern: {pattern}")
    return eval(pattern)


def moe_freq_type(x):
    """core_v0.16.1: an int, the same int as text, or a list expression."""
    if isinstance(x, int):
        return x
    assert isinstance(x, str)
    if '[' in x:
        return _eval_pattern(x)
    return int(x)


def _add_moe_args(parser):
    """The MoE arguments of core_v0.16.1 that change memory (one value each for the load-balancing type
    and the aux-loss coefficient; 0.19 takes several)."""
    group = parser.add_argument_group(title="moe")
    group.add_argument('--expert-model-parallel-size', type=int, default=1)
    group.add_argument('--expert-tensor-parallel-size', type=int, default=None)
    group.add_argument('--num-experts', type=int, default=None)
    group.add_argument('--moe-layer-freq', type=moe_freq_type, default=1)
    group.add_argument('--moe-ffn-hidden-size', type=int, default=None)
    group.add_argument('--moe-shared-expert-intermediate-size', type=int, default=None)
    group.add_argument('--moe-shared-expert-overlap', action='store_true')
    group.add_argument('--moe-grouped-gemm', action='store_true')
    group.add_argument('--moe-use-legacy-grouped-gemm', action='store_true')
    group.add_argument('--moe-router-load-balancing-type', type=str, default='aux_loss',
                       choices=['aux_loss', 'seq_aux_loss', 'global_aux_loss', 'sinkhorn', 'none'])
    group.add_argument('--moe-router-topk', type=int, default=2)
    group.add_argument('--moe-router-dtype', type=str, choices=['fp32', 'fp64'], default=None)
    group.add_argument('--moe-aux-loss-coeff', type=float, default=0.0)
    group.add_argument('--moe-z-loss-coeff', type=float, default=None)
    group.add_argument('--moe-token-dispatcher-type', type=str, choices=['allgather', 'alltoall', 'flex'],
                       default='allgather')
    group.add_argument('--moe-expert-capacity-factor', type=float, default=None)
    group.add_argument('--moe-pad-expert-input-to-capacity', action='store_true')
    group.add_argument('--moe-permute-fusion', action='store_true')
    group.add_argument('--moe-layer-recompute', action='store_true')
    group.add_argument('--overlap-moe-expert-parallel-comm', action='store_true')
    return parser


def _add_regularization_args(parser):
    group = parser.add_argument_group(title='regularization')
    group.add_argument('--attention-dropout', type=float, default=0.1)
    group.add_argument('--hidden-dropout', type=float, default=0.1)
    group.add_argument('--weight-decay', type=float, default=0.01)
    group.add_argument('--clip-grad', type=float, default=1.0)
    group.add_argument('--adam-beta1', type=float, default=0.9)
    group.add_argument('--adam-beta2', type=float, default=0.999)
    group.add_argument('--adam-eps', type=float, default=1e-08)
    return parser


def _add_training_args(parser):
    group = parser.add_argument_group(title='training')
    group.add_argument('--micro-batch-size', type=int, default=None)
    group.add_argument('--batch-size', type=int, default=None, help='Old batch size parameter, do not use.')
    group.add_argument('--global-batch-size', type=int, default=None)
    group.add_argument('--rampup-batch-size', nargs='*', default=None)
    group.add_argument('--decrease-batch-size-if-needed', action='store_true', default=False)
    group.add_argument('--recompute-activations', action='store_true')
    group.add_argument('--recompute-granularity', type=str, default=None, choices=['full', 'selective'])
    group.add_argument('--recompute-method', type=str, default=None, choices=['uniform', 'block'])
    group.add_argument('--recompute-num-layers', type=int, default=None)
    group.add_argument('--checkpoint-activations', action='store_true')
    group.add_argument('--train-iters', type=int, default=None)
    # core_v0.16.1 choices (../shared/reference/megatron.md: lion, soap, adaptive_muon came later)
    group.add_argument('--optimizer', type=str, default='adam', choices=['adam', 'sgd', 'muon', 'dist_muon'])
    group.add_argument('--no-gradient-accumulation-fusion', action='store_false', dest='gradient_accumulation_fusion')
    group.add_argument('--no-masked-softmax-fusion', action='store_false', dest='masked_softmax_fusion')
    group.add_argument('--no-bias-gelu-fusion', action='store_false', dest='bias_gelu_fusion')
    group.add_argument('--no-bias-swiglu-fusion', action='store_false', dest='bias_swiglu_fusion')
    group.add_argument('--no-bias-dropout-fusion', action='store_false', dest='bias_dropout_fusion')
    group.add_argument('--no-rope-fusion', action='store_false', dest='apply_rope_fusion')
    group.add_argument('--use-cpu-initialization', action='store_true', default=None)
    group.add_argument('--use-legacy-models', action='store_true')
    group.add_argument('--transformer-impl', default='transformer_engine', choices=['local', 'transformer_engine'])
    # core_v0.16.1 _add_training_args: the enum's member by name
    from megatron.core.transformer.enums import AttnBackend
    group.add_argument('--attention-backend', type=lambda name: AttnBackend[name], default=AttnBackend.auto,
                       choices=list(AttnBackend))
    group.add_argument('--empty-unused-memory-level', type=int, default=0, choices=[0, 1, 2])
    group.add_argument('--exit-interval', type=int, default=None)
    return parser


def _add_initialization_args(parser):
    group = parser.add_argument_group(title='initialization')
    group.add_argument('--seed', type=int, default=1234)
    group.add_argument('--init-method-std', type=float, default=0.02)
    return parser


def _add_learning_rate_args(parser):
    group = parser.add_argument_group(title='learning rate')
    group.add_argument('--lr', type=float, default=None)
    group.add_argument('--warmup', type=int, default=None, help='Old lr warmup argument, do not use.')
    group.add_argument('--min-lr', type=float, default=0.0)
    return parser


def _add_checkpointing_args(parser):
    group = parser.add_argument_group(title='checkpointing')
    group.add_argument('--save', type=str, default=None)
    group.add_argument('--load', type=str, default=None)
    group.add_argument('--use-checkpoint-args', action='store_true')
    group.add_argument('--ckpt-format', default='torch_dist', choices=['torch', 'torch_dist', 'zarr', 'torch_dcp'])
    group.add_argument('--non-persistent-ckpt-type', type=str, default=None, choices=['global', 'local', 'in_memory', None])
    return parser


def _add_mixed_precision_args(parser):
    group = parser.add_argument_group(title='mixed precision')
    group.add_argument('--fp16', action='store_true')
    group.add_argument('--bf16', action='store_true')
    group.add_argument('--accumulate-allreduce-grads-in-fp32', action='store_true')
    group.add_argument('--attention-softmax-in-fp32', action='store_true')
    return parser


def _add_distributed_args(parser):
    group = parser.add_argument_group(title='distributed')
    group.add_argument('--tensor-model-parallel-size', type=int, default=1)
    group.add_argument('--pipeline-model-parallel-size', type=int, default=1)
    group.add_argument('--decoder-first-pipeline-num-layers', type=int, default=None)
    group.add_argument('--decoder-last-pipeline-num-layers', type=int, default=None)
    group.add_argument('--model-parallel-size', type=int, default=None, help='Old model parallel argument, do not use.')
    group.add_argument('--num-layers-per-virtual-pipeline-stage', type=int, default=None)
    group.add_argument('--num-virtual-stages-per-pipeline-rank', type=int, default=None)
    group.add_argument('--microbatch-group-size-per-virtual-pipeline-stage', type=int, default=None,
                       dest='microbatch_group_size_per_vp_stage')
    group.add_argument('--no-overlap-p2p-communication', action='store_false', dest='overlap_p2p_comm')
    group.add_argument('--distributed-backend', default='nccl', choices=['nccl', 'gloo'])
    group.add_argument('--distributed-timeout-minutes', type=int, default=10)
    group.add_argument('--context-parallel-size', type=int, default=1)
    group.add_argument('--sequence-parallel', action='store_true')
    group.add_argument('--use-distributed-optimizer', action='store_true')
    group.add_argument('--overlap-grad-reduce', action='store_true', default=False)
    group.add_argument('--overlap-param-gather', action='store_true', default=False)
    group.add_argument('--local-rank', type=int, default=int(os.getenv('LOCAL_RANK', '0')))
    return parser


def _add_data_args(parser):
    group = parser.add_argument_group(title='data and dataloader')
    group.add_argument('--seq-length', type=int, default=None)
    group.add_argument('--mock-data', action='store_true')
    group.add_argument('--vocab-size', type=int, default=None)
    return parser


def _add_tokenizer_args(parser):
    group = parser.add_argument_group(title='tokenizer')
    group.add_argument('--tokenizer-type', type=str, default=None,
                       choices=['GPT2BPETokenizer', 'HuggingFaceTokenizer', 'NullTokenizer'])
    group.add_argument('--tokenizer-model', type=str, default=None)
    return parser


def _add_logging_args(parser):
    group = parser.add_argument_group(title='logging')
    group.add_argument('--log-interval', type=int, default=100)
    group.add_argument('--tensorboard-dir', type=str, default=None)
    group.add_argument('--log-memory-to-tensorboard', action='store_true')
    group.add_argument('--yaml-cfg', type=str, default=None)
    return parser


def _add_transformer_engine_args(parser):
    group = parser.add_argument_group(title='Transformer-Engine')
    group.add_argument('--fp8-format', default=None, choices=['e4m3', 'hybrid'], dest='fp8')
    group.add_argument('--tp-comm-overlap', action='store_true')
    return parser


def _add_experimental_args(parser):
    group = parser.add_argument_group(title='experimental')
    group.add_argument('--spec', type=str, default=None, nargs='*')
    # core_v0.16.1 _add_multi_token_prediction_args (a group of its own there)
    group.add_argument('--mtp-num-layers', type=int, default=None)
    return parser


def validate_args(args, defaults={}):
    # Load saved args from Retro (if applicable) / checkpoint args happen in initialize.
    assert args.world_size % (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                              * args.context_parallel_size) == 0, \
        'world size ({}) is not divisible by tensor model parallel size ({}) times pipeline model parallel size ' \
        '({}) times context parallel size ({})'.format(
            args.world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.context_parallel_size)
    args.data_parallel_size = args.world_size // (
        args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size)
    args.transformer_pipeline_model_parallel_size = args.pipeline_model_parallel_size
    if args.rank == 0:
        print('using world size: {}, data-parallel size: {}, context-parallel size: {}, '
              'tensor-model-parallel size: {}, pipeline-model-parallel size: {} '.format(
                  args.world_size, args.data_parallel_size, args.context_parallel_size,
                  args.tensor_model_parallel_size, args.pipeline_model_parallel_size), flush=True)

    # core_v0.16.1 validate_args: MTP needs the mcore models and rope / no position embedding (nothing on recompute)
    if args.mtp_num_layers:
        assert not args.use_legacy_models, "The legacy Megatron models does not support Multi-Token Prediction (MTP)."
        assert args.position_embedding_type in ("rope", "none"), \
            f"Multi-Token Prediction (MTP) is not supported with {args.position_embedding_type} position embedding type."

    # Deprecated arguments (the deletions make validate_args non-idempotent).
    assert args.batch_size is None, '--batch-size argument is no longer valid, use --micro-batch-size instead'
    del args.batch_size
    assert args.warmup is None, '--warmup argument is no longer valid, use --lr-warmup-fraction instead'
    del args.warmup
    assert args.model_parallel_size is None, '--model-parallel-size is no longer valid, use ' \
        '--tensor-model-parallel-size instead'
    del args.model_parallel_size
    if args.checkpoint_activations:
        if args.rank == 0:
            print('--checkpoint-activations is no longer valid, use --recompute-activations, '
                  'or, for more control, --recompute-granularity and --recompute-method.')
        exit()
    del args.checkpoint_activations
    if args.recompute_activations:
        args.recompute_granularity = 'selective'
    del args.recompute_activations

    # Set input defaults.
    for key in defaults:
        if getattr(args, key, None) is not None:
            if args.rank == 0:
                print('WARNING: overriding default arguments for {key}:{v} with {key}:{v2}'.format(
                    key=key, v=defaults[key], v2=getattr(args, key)), flush=True)
        else:
            setattr(args, key, defaults[key])

    # Batch size.
    assert args.micro_batch_size is not None
    assert args.micro_batch_size > 0
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
        if args.rank == 0:
            print('setting global batch size to {}'.format(args.global_batch_size), flush=True)
    assert args.global_batch_size > 0

    # Uneven virtual pipeline / layer split.
    if args.num_layers_per_virtual_pipeline_stage is not None or args.num_virtual_stages_per_pipeline_rank is not None:
        if args.num_virtual_stages_per_pipeline_rank is None:
            assert args.decoder_first_pipeline_num_layers is None and args.decoder_last_pipeline_num_layers is None, \
                'please use --num-virtual-stages-per-pipeline-rank to specify virtual pipeline parallel ' \
                'degree when enable uneven pipeline parallelism'
            num_layers = args.num_layers
            assert num_layers % args.transformer_pipeline_model_parallel_size == 0, \
                'number of layers of the model must be divisible pipeline model parallel size'
            num_layers_per_pipeline_stage = num_layers // args.transformer_pipeline_model_parallel_size
            assert num_layers_per_pipeline_stage % args.num_layers_per_virtual_pipeline_stage == 0, \
                'number of layers per pipeline stage must be divisible number of layers per virtual pipeline stage'
            args.virtual_pipeline_model_parallel_size = (num_layers_per_pipeline_stage
                                                         // args.num_layers_per_virtual_pipeline_stage)
        else:
            args.virtual_pipeline_model_parallel_size = args.num_virtual_stages_per_pipeline_rank
        if args.virtual_pipeline_model_parallel_size == 1:
            args.virtual_pipeline_model_parallel_size = None
    else:
        args.virtual_pipeline_model_parallel_size = None
        if args.decoder_first_pipeline_num_layers is None and args.decoder_last_pipeline_num_layers is None \
                and args.pipeline_model_parallel_layout is None:
            assert args.num_layers % args.transformer_pipeline_model_parallel_size == 0, \
                'Number of layers should be divisible by the pipeline-model-parallel size'
    if args.virtual_pipeline_model_parallel_size is not None:
        if args.overlap_p2p_comm:
            assert args.pipeline_model_parallel_size > 1, \
                'when interleaved schedule is used, pipeline-model-parallel size should be greater than 1'
        else:
            assert args.pipeline_model_parallel_size > 2, \
                'when interleaved schedule is used and p2p communication overlap is disabled, ' \
                'pipeline-model-parallel size should be greater than 2'
    else:
        args.overlap_p2p_comm = False

    if args.overlap_param_gather:
        assert args.use_distributed_optimizer, '--overlap-param-gather only supported with distributed optimizer'
        assert args.overlap_grad_reduce, 'Must use --overlap-param-gather with --overlap-grad-reduce'

    # Parameters dtype.
    args.params_dtype = torch.float
    if args.fp16:
        assert not args.bf16
        args.params_dtype = torch.half
    if args.bf16:
        assert not args.fp16
        args.params_dtype = torch.bfloat16
        if not args.accumulate_allreduce_grads_in_fp32:
            args.accumulate_allreduce_grads_in_fp32 = True
            if args.rank == 0:
                print('accumulate and all-reduce gradients in fp32 for bfloat16 data type.', flush=True)

    # Required arguments.
    for req in ('num_layers', 'hidden_size', 'num_attention_heads', 'max_position_embeddings', 'seq_length'):
        assert getattr(args, req) is not None, f'{req} argument is None'
    assert args.max_position_embeddings >= args.seq_length
    if args.ffn_hidden_size is None:
        if args.swiglu:
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.kv_channels is None:
        assert args.hidden_size % args.num_attention_heads == 0
        args.kv_channels = args.hidden_size // args.num_attention_heads

    if args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    # MoE Spec check (core_v0.16.1)
    if args.num_experts == 0:
        args.num_experts = None
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.expert_model_parallel_size > 1:
        assert args.num_experts is not None, "num_experts must be non None to use expert model parallelism"
        assert args.num_experts % args.expert_model_parallel_size == 0, \
            "Number of experts should be a multiple of expert model parallel_size."
    if args.recompute_granularity == 'selective':
        assert args.recompute_method is None, 'recompute method is not yet supported for selective recomputing granularity'
    if args.use_cpu_initialization is None:
        args.use_cpu_initialization = False

    _print_args("arguments", args)
    return args


def _print_args(title, args):
    """Print arguments."""
    if args.rank == 0:
        print(f'------------------------ {title} ------------------------', flush=True)
        str_list = []
        for arg in vars(args):
            dots = '.' * (48 - len(arg))
            str_list.append('  {} {} {}'.format(arg, dots, getattr(args, arg)))
        for arg in sorted(str_list, key=lambda x: x.lower()):
            print(arg, flush=True)
        print(f'-------------------- end of {title} ---------------------', flush=True)


def core_transformer_config_from_args(args, config_class=None):
    """The TransformerConfig the model provider builds from args (lazily, in get_model)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    config_class = config_class or TransformerConfig
    return config_class(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size, sequence_parallel=args.sequence_parallel,
        params_dtype=args.params_dtype, bf16=args.bf16, fp16=args.fp16, pipeline_dtype=args.params_dtype,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        add_bias_linear=args.add_bias_linear, gated_linear_unit=args.swiglu,
        activation_func=(torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu),
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        init_method_std=args.init_method_std, use_cpu_initialization=args.use_cpu_initialization,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        masked_softmax_fusion=args.masked_softmax_fusion, bias_activation_fusion=False,
        bias_dropout_fusion=args.bias_dropout_fusion, apply_rope_fusion=args.apply_rope_fusion,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
    )
