"""Stand-in for megatron/training/training.py (core_v0.16.1): pretrain -> initialize_megatron ->
setup_model_and_optimizer -> train -> train_step / training_log, each called through its module
global, with real megatron-core models, DDP, optimizer and pipeline schedules."""
import time

import torch

from megatron.core import mpu, tensor_parallel
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.enums import ModelType
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config
from megatron.training.global_vars import get_args
from megatron.training.initialize import initialize_megatron


def print_rank_0(message):
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


def pretrain(
    train_valid_test_dataset_provider,
    model_provider,
    model_type,
    forward_step_func,
    process_non_loss_data_func=None,
    extra_args_provider=None,
    args_defaults={},
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    non_loss_data_func=None,
    store=None,
    inprocess_call_wrapper=None,
):
    """Main training program."""
    # Initalize and get arguments, timers, and Tensorboard writer.
    initialize_megatron(
        extra_args_provider=extra_args_provider,
        args_defaults=args_defaults,
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
        store=store,
    )
    args = get_args()

    # Model, optimizer, and learning rate.
    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(
        model_provider, model_type, checkpointing_context={})
    config = get_model_config(model[0])

    # Data stuff.
    train_data_iterator = build_train_valid_test_data_iterators(train_valid_test_dataset_provider)

    iteration = 0
    if args.train_iters:
        iteration, _ = train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, None,
                             process_non_loss_data_func, config, {}, non_loss_data_func)
    print_rank_0(f"training done after {iteration} iterations")


def build_train_valid_test_data_iterators(build_train_valid_test_datasets_provider):
    args = get_args()
    train_ds, _, _ = build_train_valid_test_datasets_provider([args.train_iters * args.global_batch_size, 0, 0])
    return iter(train_ds) if train_ds is not None else None


def get_model(model_provider_func, model_type=ModelType.encoder_or_decoder, wrap_with_ddp=True):
    """Build the model."""
    args = get_args()
    args.model_type = model_type
    if mpu.get_pipeline_model_parallel_world_size() > 1 and args.virtual_pipeline_model_parallel_size is not None:
        model = []
        for i in range(args.virtual_pipeline_model_parallel_size):
            pre_process = mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i)
            post_process = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i)
            model.append(model_provider_func(pre_process=pre_process, post_process=post_process, vp_stage=i))
    else:
        pre_process = mpu.is_pipeline_first_stage()
        post_process = mpu.is_pipeline_last_stage()
        model = [model_provider_func(pre_process=pre_process, post_process=post_process)]
    for model_module in model:
        model_module.model_type = model_type
        for param in model_module.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    for model_module in model:
        model_module.cuda(torch.cuda.current_device())
    config = get_model_config(model[0])
    if args.fp16 or args.bf16:
        model = [Float16Module(config, model_module) for model_module in model]
    if wrap_with_ddp:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
            overlap_grad_reduce=args.overlap_grad_reduce,
            overlap_param_gather=args.overlap_param_gather,
            use_distributed_optimizer=args.use_distributed_optimizer,
        )
        model = [DDP(config=config, ddp_config=ddp_config, module=model_chunk,
                     disable_bucketing=(model_chunk_idx > 0) or args.overlap_param_gather)
                 for (model_chunk_idx, model_chunk) in enumerate(model)]
        for model_module in model:
            model_module.broadcast_params()
    return model


def setup_model_and_optimizer(model_provider_func, model_type, no_wd_decay_cond=None, scale_lr_cond=None, lr_mult=1.0,
                              checkpointing_context=None):
    """Setup model and optimizer."""
    args = get_args()
    model = get_model(model_provider_func, model_type)
    config = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        fp16=args.fp16, bf16=args.bf16, params_dtype=args.params_dtype,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, model)
    opt_param_scheduler = None
    return model, optimizer, opt_param_scheduler


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config):
    """Single training step."""
    args = get_args()
    for model_chunk in model:
        model_chunk.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward_func = get_forward_backward_func()
    losses_reduced = forward_backward_func(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=get_num_microbatches(), seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        decoder_seq_length=None, forward_only=False)
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    skipped_iter = 0 if update_successful else 1
    loss_reduced = {}
    if mpu.is_pipeline_last_stage(ignore_virtual=True) and losses_reduced:
        for key in losses_reduced[0].keys():
            vals = [x[key] for x in losses_reduced]
            loss_reduced[key] = sum(float(v) for v in vals) / len(vals)
    return loss_reduced, skipped_iter, grad_norm, num_zeros_in_grad


def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag, skipped_iter,
                 grad_norm, params_norm, num_zeros_in_grad):
    """Log training information such as losses, timing, ...."""
    args = get_args()
    if iteration % args.log_interval == 0:
        loss = " | ".join(f"{k}: {v:.4E}" for k, v in loss_dict.items())
        msg = f" iteration {iteration:8d}/{args.train_iters:8d} | learning rate: {learning_rate:.3E} | {loss}"
        if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            print(msg, flush=True)
        if report_memory_flag:
            # Report memory after optimizer state has been initialized (until the second iteration).
            from megatron.training.utils import report_memory
            report_memory(f'(after {iteration} iterations)')
            if iteration > 1:
                report_memory_flag = False
    return report_memory_flag


def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, valid_data_iterator,
          process_non_loss_data_func, config, checkpointing_context, non_loss_data_func):
    """Training function."""
    args = get_args()
    for model_module in model:
        model_module.train()
    total_loss_dict = {}
    iteration = 0
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    report_memory_flag = True
    start = time.time()
    while iteration < args.train_iters:
        loss_dict, skipped_iter, grad_norm, num_zeros_in_grad = train_step(
            forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler, config)
        iteration += 1
        learning_rate = optimizer.param_groups[0]['lr'] if optimizer.param_groups else args.lr
        loss_scale = optimizer.get_loss_scale().item()
        report_memory_flag = training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                                          report_memory_flag, skipped_iter, grad_norm, None, num_zeros_in_grad)
    print_rank_0(f"train: {iteration} iterations in {time.time() - start:.1f} s")
    return iteration, 0
