"""Stand-in for megatron/training/yaml_arguments.py (core_v0.16.1): the contract the hook meets.

``load_yaml(path)`` returns the file as nested SimpleNamespaces (sections ``model_parallel`` and
``language_model``) plus ``yaml_cfg``; ``validate_yaml(args, defaults)`` reads the parallel sizes from
``args.model_parallel`` and the batch sizes from the top level, derives the data-parallel size, the default
global batch size and the eval sizes, fills ``defaults``, and returns a NEW namespace with both sections
merged into the top level (a name in two places is a TypeError), which ``initialize_megatron`` keeps.
Only the rules the hook's tests meet are kept.
"""
import json
from types import SimpleNamespace


def load_yaml(yaml_path):
    import yaml
    with open(yaml_path) as f:
        config = yaml.safe_load(f)
    ns = json.loads(json.dumps(config), object_hook=lambda item: SimpleNamespace(**item))
    ns.yaml_cfg = yaml_path
    return ns


def validate_yaml(args, defaults={}):
    mp = args.model_parallel
    mp.tensor_model_parallel_size = min(mp.tensor_model_parallel_size, args.world_size)
    assert args.world_size % mp.tensor_model_parallel_size == 0, 'world size is not divisible by TP'
    mp.pipeline_model_parallel_size = min(mp.pipeline_model_parallel_size,
                                          args.world_size // mp.tensor_model_parallel_size)
    mp.transformer_pipeline_model_parallel_size = mp.pipeline_model_parallel_size
    model_parallel_size = mp.pipeline_model_parallel_size * mp.tensor_model_parallel_size
    assert args.world_size % (model_parallel_size * mp.context_parallel_size) == 0, \
        'world size is not divisible by TP x PP x CP'
    args.data_parallel_size = args.world_size // (model_parallel_size * mp.context_parallel_size)
    if args.rank == 0:
        print('using world size: {}, data-parallel size: {}, tensor-model-parallel size: {}, '
              'pipeline-model-parallel size: {}'.format(args.world_size, args.data_parallel_size,
                                                        mp.tensor_model_parallel_size,
                                                        mp.pipeline_model_parallel_size), flush=True)
    for key in defaults:
        if getattr(args, key, None) is None:
            setattr(args, key, defaults[key])
    assert args.micro_batch_size is not None and args.micro_batch_size > 0
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    assert args.global_batch_size > 0
    if getattr(args, 'eval_global_batch_size', None) is None:
        args.eval_global_batch_size = args.global_batch_size
    if getattr(args, 'eval_micro_batch_size', None) is None:
        args.eval_micro_batch_size = args.micro_batch_size
    assert args.eval_global_batch_size % (args.eval_micro_batch_size * args.data_parallel_size) == 0, \
        'eval_global_batch_size must be divisible by eval_micro_batch_size * data_parallel_size'
    if args.num_layers_per_virtual_pipeline_stage is None:
        mp.virtual_pipeline_model_parallel_size = None
    if mp.bf16:
        mp.params_dtype = 'bfloat16'
    args = SimpleNamespace(**args.__dict__, **args.model_parallel.__dict__)
    args = SimpleNamespace(**args.__dict__, **args.language_model.__dict__)
    return args
