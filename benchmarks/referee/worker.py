"""Per-rank body of the CPU referee: real megatron-core training steps, measured.

Input: a settings dict keyed by Megatron argument dest names with already-resolved values (what
`validate_args` + the tokenizer would leave in `args`), plus world_size / rank / port. The rank
initialises gloo + megatron.core.parallel_state as Megatron's `initialize_megatron` would, builds the
model as pretrain_gpt.py's model provider + training.get_model do for `--transformer-impl local`,
wraps it in megatron-core DDP, builds the optimizer with get_megatron_optimizer, and runs
`num_iterations` iterations of training.train_step with pretrain_gpt.py's forward_step/loss_func and
batches shaped as Megatron's GPT dataset + get_batch_on_this_tp_rank produce them.

A LiveBytesTracker is entered before anything is built (after process-group setup, whose
collectives allocate nothing on the GPU worth counting) and measures everything.

Run directly: python -m benchmarks.referee.worker --settings s.json --rank R --world-size N
--port P --out result.json   (normally started by run.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import sys
import time
import traceback
import warnings
from functools import partial
from types import SimpleNamespace
from typing import Any, Dict, List

warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from .livebytes import LiveBytesTracker  # noqa: E402
from . import moe_probe, shims  # noqa: E402

# --------------------------------------------------------------------------------------------
# Megatron argument defaults for everything the referee reads that is not a settings key.
# Values are megatron/training/arguments.py defaults (checked against the megatron-core 0.19.2
# parser; the flags concerned are unchanged since core_v0.16), after validate_args.
# --------------------------------------------------------------------------------------------
MEGATRON_ARG_DEFAULTS: Dict[str, Any] = dict(
    # model shape / features
    num_layers=None, hidden_size=None, ffn_hidden_size=None, num_attention_heads=None,
    group_query_attention=False, num_query_groups=1, kv_channels=None,
    seq_length=None, max_position_embeddings=None, padded_vocab_size=None, vocab_size=None,
    swiglu=False, squared_relu=False, normalization="LayerNorm", add_bias_linear=True,
    add_qkv_bias=False, qk_layernorm=False, position_embedding_type="learned_absolute",
    rotary_percent=1.0, rotary_base=10000, rotary_interleaved=False, use_rope_scaling=False,
    untie_embeddings_and_output_weights=False, hidden_dropout=0.1, attention_dropout=0.1,
    init_method_std=0.02, layernorm_epsilon=1e-5, apply_residual_connection_post_layernorm=False,
    fp32_residual_connection=False, apply_query_key_layer_scaling=False,
    attention_softmax_in_fp32=False,  # arg default False (TransformerConfig's own default is True)
    layernorm_zero_centered_gamma=False, no_persist_layer_norm=False,
    num_experts=None, moe_grouped_gemm=False, moe_use_legacy_grouped_gemm=False,
    expert_model_parallel_size=1, expert_tensor_parallel_size=None, moe_ffn_hidden_size=None,
    moe_layer_freq=1, moe_router_topk=2, multi_latent_attention=False,
    fp16_lm_cross_entropy=False, cross_entropy_loss_fusion=False, cross_entropy_fusion_impl="native",
    calculate_per_token_loss=False, transformer_impl="local",
    # fusions: off in the referee (the unfused PyTorch ops are what run on CPU and on GPU alike)
    masked_softmax_fusion=False, bias_activation_fusion=False, bias_gelu_fusion=False,
    bias_swiglu_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
    # parallelism
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
    virtual_pipeline_model_parallel_size=None, decoder_first_pipeline_num_layers=None,
    decoder_last_pipeline_num_layers=None, context_parallel_size=1, sequence_parallel=False,
    data_parallel_size=None, microbatch_group_size_per_vp_stage=None,
    account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False,
    overlap_p2p_comm=None,  # True by default, forced False by validate_args without VPP
    align_param_gather=None,  # same rule as overlap_p2p_comm
    align_grad_reduce=True, defer_embedding_wgrad_compute=False, wgrad_deferral_limit=0,
    # batch
    micro_batch_size=None, global_batch_size=None, create_attention_mask_in_dataloader=True,
    reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
    # recompute
    recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
    recompute_modules=None, distribute_saved_activations=False,
    # precision / DDP / optimizer
    bf16=False, fp16=False, accumulate_allreduce_grads_in_fp32=False,
    use_distributed_optimizer=False, num_distributed_optimizer_instances=1,
    overlap_grad_reduce=False, overlap_param_gather=False,
    overlap_param_gather_with_optimizer_step=False, ddp_bucket_size=None, ddp_num_buckets=None,
    ddp_pad_buckets_for_high_nccl_busbw=False, ddp_average_in_collective=False,
    check_for_nan_in_loss_and_grad=True, check_for_large_grads=False, check_for_spiky_loss=False,
    optimizer="adam", lr=3.0e-4, min_lr=0.0, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999,
    adam_eps=1e-8, sgd_momentum=0.9, clip_grad=1.0, loss_scale=None,
    initial_loss_scale=2 ** 32, min_loss_scale=1.0, loss_scale_window=1000, hysteresis=2,
    log_num_zeros_in_grad=False, use_precision_aware_optimizer=False,
    empty_unused_memory_level=0, seed=1234, data_parallel_random_init=False,
    use_cpu_initialization=True,
    # referee-only knobs (not Megatron args)
    num_iterations=2,
    referee_adam_kernel="fused",  # see shims.configure_torch_optimizer
    referee_dump_top=30,
    # path prefix: write every allocation record ([alloc seq, free seq, bytes, op, dtype, shape, phase])
    # to <prefix>.rank<R>.json, for replays such as benchmarks/referee/allocator_replay.py
    referee_allocation_log=None,
    # the evaluation step after the training iterations (megatron/training evaluate(), core 0.19.2: eval mode,
    # torch.no_grad, the schedule with forward_only=True at --eval-micro-batch-size): its micro-batch, None: none
    referee_eval_micro_batch_size=None,
    referee_eval_microbatches=2,
    # record the live bytes at every pass of the combined 1F1B schedule (--overlap-moe-expert-parallel-comm under
    # VPP): entry, exit and peak of each combined_1f1b_schedule_for_interleaved_pipelining call (install_pass_trace)
    referee_pass_trace=False,
)



def _settle(tracker, tries: int = 20, pause_s: float = 0.05) -> None:
    """Collect garbage until the tracker's live bytes stop moving (at most ``tries`` x ``pause_s``):
    temporaries in reference cycles and tensors a communication thread still holds are not state."""
    for _ in range(tries):
        gc.collect()
        before = tracker.current
        time.sleep(pause_s)
        gc.collect()
        if tracker.current == before:
            return

def build_args(settings: Dict[str, Any]) -> SimpleNamespace:
    """Megatron-style args namespace: defaults overlaid with the resolved settings."""
    d = dict(MEGATRON_ARG_DEFAULTS)
    d.update({k: v for k, v in settings.items() if k not in ("world_size", "rank", "port")})
    a = SimpleNamespace(**d)
    if a.transformer_impl != "local":
        raise ValueError("the referee supports --transformer-impl local only")
    if a.context_parallel_size != 1:
        raise ValueError("context_parallel_size must be 1 (the local attention cannot do CP)")
    # validate_args-equivalent derivations, for values a caller may have left unresolved.
    if a.kv_channels is None:
        a.kv_channels = a.hidden_size // a.num_attention_heads
    if a.ffn_hidden_size is None:
        a.ffn_hidden_size = (int((4 * a.hidden_size * 2 / 3) / 64) * 64) if a.swiglu else 4 * a.hidden_size
    if a.global_batch_size is None:
        a.global_batch_size = a.micro_batch_size * a.data_parallel_size
    if a.tensor_model_parallel_size == 1:
        a.sequence_parallel = False
    if "bias_activation_fusion" in settings:
        # the resolved switch decides (resolve() derives it from --no-bias-swiglu/gelu-fusion)
        a.bias_swiglu_fusion = a.bias_gelu_fusion = bool(settings["bias_activation_fusion"])
    if a.num_experts is not None:
        # validate_args: ETP defaults to TP, the expert FFN width to ffn_hidden_size.
        if a.expert_tensor_parallel_size is None:
            a.expert_tensor_parallel_size = a.tensor_model_parallel_size
        if a.moe_ffn_hidden_size is None:
            a.moe_ffn_hidden_size = a.ffn_hidden_size
    if a.virtual_pipeline_model_parallel_size is None:
        a.overlap_p2p_comm = False
        a.align_param_gather = False
    else:
        if a.overlap_p2p_comm is None:
            a.overlap_p2p_comm = True
        if a.align_param_gather is None:
            a.align_param_gather = True
    if a.bf16 and not a.accumulate_allreduce_grads_in_fp32 and settings.get(
        "accumulate_allreduce_grads_in_fp32") is None:
        a.accumulate_allreduce_grads_in_fp32 = True
    a.params_dtype = torch.bfloat16 if a.bf16 else (torch.float16 if a.fp16 else torch.float32)
    a.main_grads_dtype = torch.float32
    a.main_params_dtype = torch.float32
    a.exp_avg_dtype = torch.float32
    a.exp_avg_sq_dtype = torch.float32
    return a


def core_transformer_config_from_args(args):
    """megatron/training/arguments.py core_transformer_config_from_args (core_v0.16 era)."""
    import torch.nn.functional as F
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = {}
    for f in dataclasses.fields(TransformerConfig):
        if hasattr(args, f.name):
            kw[f.name] = getattr(args, f.name)
    kw["persist_layer_norm"] = not args.no_persist_layer_norm
    kw["layernorm_zero_centered_gamma"] = args.layernorm_zero_centered_gamma
    kw["deallocate_pipeline_outputs"] = True
    kw["pipeline_dtype"] = args.params_dtype
    kw["batch_p2p_comm"] = not args.overlap_p2p_comm
    kw["num_moe_experts"] = args.num_experts
    kw["rotary_interleaved"] = args.rotary_interleaved
    kw["num_layers_in_first_pipeline_stage"] = args.decoder_first_pipeline_num_layers
    kw["num_layers_in_last_pipeline_stage"] = args.decoder_last_pipeline_num_layers
    if args.swiglu:
        kw["activation_func"] = F.silu
        kw["gated_linear_unit"] = True
        kw["bias_activation_fusion"] = args.bias_swiglu_fusion
    else:
        kw["bias_activation_fusion"] = args.bias_gelu_fusion
    if args.squared_relu:
        assert not args.swiglu
        kw["activation_func"] = squared_relu
    kw["num_query_groups"] = args.num_query_groups if args.group_query_attention else None
    kw["cp_comm_type"] = "p2p"
    # The local ("non-TE") path: no fp8, no TE-only features.
    kw["transformer_impl"] = "local"
    if getattr(args, "heterogeneous_layers_config_path", None):
        # argument_utils (0.19.2) / arguments.py (0.16): the path selects HeterogeneousTransformerConfig
        from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig
        return HeterogeneousTransformerConfig(**kw, heterogeneous_layers_config_path=args.heterogeneous_layers_config_path)
    return TransformerConfig(**kw)


# --------------------------------------------------------------------------------------------
# Data: Megatron's GPTDataset sample + default collate, then get_batch_on_this_tp_rank.
# --------------------------------------------------------------------------------------------
class MockGPTData:
    """Host-side micro-batches as Megatron's GPTDataset + collate produce them (pinned host
    memory on a GPU machine, so they are created outside the tracker)."""

    def __init__(self, args, seed: int):
        self.args = args
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = args.vocab_size or args.padded_vocab_size

    def __iter__(self):
        return self

    def __next__(self):
        a = self.args
        b, s = a.micro_batch_size, a.seq_length
        with torch.utils._python_dispatch._disable_current_modes():
            text = torch.randint(0, self.vocab, (b, s + 1), generator=self.gen, dtype=torch.int64)
            tokens = text[:, :-1].contiguous()
            labels = text[:, 1:].contiguous()
            loss_mask = torch.ones((b, s), dtype=torch.float32)
            position_ids = torch.arange(s, dtype=torch.int64).unsqueeze(0).expand(b, s).contiguous()
            data = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
                    "position_ids": position_ids}
            if a.create_attention_mask_in_dataloader:
                m = torch.tril(torch.ones((s, s))).unsqueeze(0) < 0.5  # [1, s, s] bool per sample
                data["attention_mask"] = m.unsqueeze(0).expand(b, 1, s, s).contiguous()
        return data


def _to_device(t):
    # Stands for `.cuda(non_blocking=True)` in get_batch_on_this_tp_rank: a device copy of the
    # host tensor (Tensor.cuda is a no-op shim, so the copy is made explicitly and is tracked).
    return None if t is None else t.clone()


def get_batch_on_this_tp_rank(data_iterator, args, mtp_on_this_rank: bool = False):
    """megatron/training/utils.py get_batch_on_this_tp_rank (core_v0.16 era). A stage building the MTP block
    broadcasts the whole batch over TP as with PP = 1 (its block embeds the tokens; ``mtp_on_this_rank``, as the
    0.17.1 release's utils.py has it)."""
    from megatron.core import parallel_state as mpu

    def _broadcast(item):
        if item is not None:
            torch.distributed.broadcast(item, mpu.get_tensor_model_parallel_src_rank(),
                                        group=mpu.get_tensor_model_parallel_group())

    if mpu.get_tensor_model_parallel_rank() == 0:
        data = next(data_iterator) if data_iterator is not None else None
        batch = {
            "tokens": _to_device(data["tokens"]),
            "labels": _to_device(data["labels"]),
            "loss_mask": _to_device(data["loss_mask"]),
            "attention_mask": _to_device(data.get("attention_mask")),
            "position_ids": _to_device(data["position_ids"]),
        }
        del data
        if args.pipeline_model_parallel_size == 1 or mtp_on_this_rank:
            for k in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids"):
                _broadcast(batch[k])
        elif mpu.is_pipeline_first_stage():
            _broadcast(batch["tokens"])
            _broadcast(batch["attention_mask"])
            _broadcast(batch["position_ids"])
        elif mpu.is_pipeline_last_stage():
            _broadcast(batch["labels"])
            _broadcast(batch["loss_mask"])
            _broadcast(batch["attention_mask"])
    else:
        b, s = args.micro_batch_size, args.seq_length
        dev = torch.cuda.current_device()
        tokens = torch.empty((b, s), dtype=torch.int64, device=dev)
        labels = torch.empty((b, s), dtype=torch.int64, device=dev)
        loss_mask = torch.empty((b, s), dtype=torch.float32, device=dev)
        if args.create_attention_mask_in_dataloader:
            attention_mask = torch.empty((b, 1, s, s), dtype=torch.bool, device=dev)
        else:
            attention_mask = None
        position_ids = torch.empty((b, s), dtype=torch.int64, device=dev)
        if args.pipeline_model_parallel_size == 1 or mtp_on_this_rank:
            for t in (tokens, labels, loss_mask, attention_mask, position_ids):
                _broadcast(t)
        elif mpu.is_pipeline_first_stage():
            labels = None
            loss_mask = None
            _broadcast(tokens)
            _broadcast(attention_mask)
            _broadcast(position_ids)
        elif mpu.is_pipeline_last_stage():
            tokens = None
            position_ids = None
            _broadcast(labels)
            _broadcast(loss_mask)
            _broadcast(attention_mask)
        batch = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
                 "attention_mask": attention_mask, "position_ids": position_ids}
    return batch


def is_first_or_last_pipeline_stage(vp_stage):
    """pretrain_gpt.py helper."""
    from megatron.core import parallel_state

    ignore_virtual = vp_stage is None
    return parallel_state.is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage) or \
        parallel_state.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)


def _eval_step(args, model, forward_step, forward_backward_func, tracker, data_seed) -> dict:
    """One evaluation step as megatron/training evaluate() runs it (training.py, core 0.19.2): the model in eval
    mode, torch.no_grad, the training schedule with forward_only=True at the eval micro-batch. The batch readers
    take args.micro_batch_size (get_batch_on_this_tp_rank), which evaluate's callers set to the eval micro-batch
    for its duration here."""
    from megatron.core import parallel_state as mpu
    train_mbs = args.micro_batch_size
    args.micro_batch_size = args.referee_eval_micro_batch_size
    try:
        if len(model) > 1:
            data = [iter(MockGPTData(args, data_seed + 1)) for _ in model]
        else:
            data = iter(MockGPTData(args, data_seed + 1))
        if mpu.get_tensor_model_parallel_rank() != 0:
            data = [None] * len(model) if len(model) > 1 else None
        for m in model:
            m.eval()
        tracker.set_phase("eval")
        with tracker.region("eval"), torch.no_grad():
            out = forward_backward_func(
                forward_step_func=forward_step, data_iterator=data, model=model,
                num_microbatches=args.referee_eval_microbatches, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, decoder_seq_length=None, forward_only=True)
            del out
        for m in model:
            m.train()
    finally:
        args.micro_batch_size = train_mbs
    r = tracker.region_result("eval")
    start_seq = tracker._regions["eval"].start_seq
    # every storage the evaluation step made that is live at its peak (what the eval figure's own terms count)
    made = [rec for rec in tracker.live_at(r["peak_seq"]) if rec[0] > start_seq]
    return {"micro_batch_size": args.referee_eval_micro_batch_size, "start_bytes": r["start_bytes"],
            "peak_bytes": r["peak_bytes"], "peak_phase": r["peak_phase"], "end_bytes": r["end_bytes"],
            "peak_dump": tracker.dump(r["peak_seq"], top=15),
            "peak_dump_made": tracker.group(made, top=None)}


def make_forward_step(args, tracker, phase_state):
    """pretrain_gpt.py get_batch / loss_func / forward_step (core_v0.16 era)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.core.utils import get_attr_wrapped_model

    mtp_config = []     # the model's TransformerConfig, for mtp_on_this_rank (set by forward_step)

    def _mtp_here(vp_stage) -> bool:
        if not getattr(args, "mtp_num_layers", None) or not mtp_config:
            return False
        import inspect
        from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank
        cfg = mtp_config[0]
        if "layout" in inspect.signature(mtp_on_this_rank).parameters:      # core 0.19: (layout, mtp_num_layers, ...)
            return mtp_on_this_rank(cfg.pipeline_model_parallel_layout, cfg.mtp_num_layers,
                                    ignore_virtual=vp_stage is None, vp_stage=vp_stage)
        return mtp_on_this_rank(cfg, ignore_virtual=vp_stage is None, vp_stage=vp_stage)

    def get_batch(data_iterator, vp_stage=None):
        if not is_first_or_last_pipeline_stage(vp_stage) and not _mtp_here(vp_stage):
            # (pretrain_gpt.py get_batch: a middle stage that builds the MTP block, a layout's mtp_standalone,
            # reads the tokens and positions its block embeds)
            return None, None, None, None, None
        batch = get_batch_on_this_tp_rank(data_iterator, args, _mtp_here(vp_stage))
        # get_batch_on_this_cp_rank is the identity for CP=1.
        return batch.values()

    def loss_func(loss_mask, output_tensor, model=None):
        label = phase_state.get("fwd_label")
        if label:
            tracker.set_phase(label + " loss_func")
        losses = output_tensor.view(-1).float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * loss_mask)
        rsm = get_rerun_state_machine()
        if args.check_for_nan_in_loss_and_grad:
            rsm.validate_result(result=loss, rejection_func=torch.isnan,
                                message="found NaN in local forward loss calculation",
                                tolerance=0.0, fatal=True)
            rsm.validate_result(result=loss, rejection_func=torch.isinf,
                                message="found Inf in local forward loss calculation",
                                tolerance=0.0, fatal=True)
        num_tokens = loss_mask.sum().clone().detach().to(torch.int)
        reporting_loss = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
        return (loss, num_tokens, {"lm loss": reporting_loss})

    def forward_step(data_iterator, model, return_schedule_plan: bool = False):
        vp_stage = get_attr_wrapped_model(model, "vp_stage")
        if not mtp_config:
            mtp_config.append(get_attr_wrapped_model(model, "config"))
        tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
        if return_schedule_plan:
            # --overlap-moe-expert-parallel-comm: combined_1f1b asks for the model's schedule plan instead of
            # its output, as pretrain_gpt.py's forward_step does
            plan = model.build_schedule_plan(tokens, position_ids, attention_mask, labels=labels,
                                             loss_mask=loss_mask)
            return plan, partial(loss_func, loss_mask, model=model)
        output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
        return output_tensor, partial(loss_func, loss_mask, model=model)

    return forward_step


def install_phase_hooks(tracker, phase_state):
    """Label allocations with the schedule step that made them (forward/backward per micro-batch
    and model chunk) by wrapping schedules.forward_step / backward_step."""
    import megatron.core.pipeline_parallel.schedules as sched

    orig_fwd = sched.forward_step
    orig_bwd = sched.backward_step

    def fwd(*a, **k):
        vp = k.get("vp_stage")
        chunk = 0 if vp is None else vp
        n = phase_state["fwd_count"].get(chunk, 0)
        phase_state["fwd_count"][chunk] = n + 1
        label = f"it{phase_state['iter']} fwd" + (f" c{chunk}" if vp is not None else "") + f" mb{n}"
        phase_state["fwd_label"] = label
        tracker.set_phase(label)
        out = orig_fwd(*a, **k)
        ot = out[0]
        key = ot[0] if isinstance(ot, list) else ot
        if isinstance(key, torch.Tensor):
            phase_state["out2label"][id(key)] = label
        phase_state["fwd_label"] = None
        tracker.set_phase(f"it{phase_state['iter']} schedule")
        return out

    def bwd(input_tensor, output_tensor, output_tensor_grad, *rest):
        # (..., model_type, config) in core 0.16.1, (..., config) in 0.19.2
        ot = output_tensor[0] if isinstance(output_tensor, list) else output_tensor
        label = phase_state["out2label"].pop(id(ot), None)
        label = (label or f"it{phase_state['iter']} ?").replace(" fwd", " bwd")
        tracker.set_phase(label)
        out = orig_bwd(input_tensor, output_tensor, output_tensor_grad, *rest)
        tracker.set_phase(f"it{phase_state['iter']} schedule")
        return out

    sched.forward_step = fwd
    sched.backward_step = bwd


def install_pass_trace(tracker, phase_state, trace: list) -> None:
    """Record, per call of the combined 1F1B schedule's step (schedules.py forward_backward_helper_wrapper calls
    combined_1f1b.combined_1f1b_schedule_for_interleaved_pipelining for every warm-up forward, steady
    backward-and-forward and cool-down backward, megatron-core 0.16.1), its virtual micro-batches and the live bytes
    at entry, at exit and at its peak, and the bytes made under the bare "itN schedule" label live at entry and
    exit: the ones no layer's label claims (received inputs and their gradients, the chunks' input gradients, the
    layers' detached inputs' gradients, and on the combined path the output layer and the loss, which no phase
    hook labels there)."""
    import megatron.core.pipeline_parallel.schedules as sched

    orig = sched.combined_1f1b_schedule_for_interleaved_pipelining

    def own(label: str) -> list:
        recs = [r for r in tracker.live_now() if r[6] == label]
        return [sum(r[2] for r in recs), len(recs)]

    def step(*a, **k):
        it = phase_state["iter"]
        label = f"it{it} schedule"
        n = len(trace)
        entry = {"iter": it, "f": k.get("f_virtual_microbatch_id"), "b": k.get("b_virtual_microbatch_id"),
                 "own_start": own(label)}
        with tracker.region(f"pass{n}"):
            out = orig(*a, **k)
        res = tracker.region_result(f"pass{n}")
        entry.update(start=res["start_bytes"], end=res["end_bytes"], peak=res["peak_bytes"],
                     peak_phase=res["peak_phase"], own_end=own(label))
        del tracker._regions[f"pass{n}"]
        trace.append(entry)
        return out

    sched.combined_1f1b_schedule_for_interleaved_pipelining = step


def _set_random_seed(seed_, data_parallel_random_init=False):
    """megatron/training/initialize.py _set_random_seed."""
    from megatron.core import mpu, tensor_parallel

    seed = seed_ + (100 * mpu.get_pipeline_model_parallel_rank())
    if data_parallel_random_init:
        seed = seed + (10 * mpu.get_data_parallel_rank())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def get_embedding_ranks(pp_ranks, vp_size=None):
    """pretrain_gpt.py get_embedding_ranks (no MTP): first stage, plus last stage when tied."""
    ranks = [pp_ranks[0]]
    if len(pp_ranks) > 1 and not _ARGS.untie_embeddings_and_output_weights:
        ranks.append(pp_ranks[-1])
    return sorted(set(ranks))


_ARGS = None


def _num_params(model_chunks) -> int:
    return sum(p.nelement() for m in model_chunks for p in m.parameters())


def run_rank(settings: Dict[str, Any], rank: int, world_size: int, port: int) -> Dict[str, Any]:
    global _ARGS
    t_start = time.time()
    args = build_args(settings)
    _ARGS = args
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    assert world_size % (tp * pp * cp) == 0, "world size must be divisible by TP*PP*CP"
    dp = world_size // (tp * pp * cp)
    if args.data_parallel_size is None:
        args.data_parallel_size = dp
    assert args.data_parallel_size == dp, f"data_parallel_size {args.data_parallel_size} != {dp}"
    num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    assert num_microbatches * args.micro_batch_size * dp == args.global_batch_size

    shims.install()
    torch.set_num_threads(max(1, int(os.environ.get("REFEREE_THREADS", "1"))))

    from datetime import timedelta

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.distributed.init_process_group(backend="gloo", rank=rank, world_size=world_size,
                                         timeout=timedelta(minutes=5))

    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec, get_gpt_layer_local_spec,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer import get_standard_config_overrides
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.core.transformer.module import Float16Module
    from megatron.core.utils import get_model_config

    mpu.initialize_model_parallel(
        tp, pp, args.virtual_pipeline_model_parallel_size,
        context_parallel_size=cp,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        order="tp-cp-ep-dp-pp",
        get_embedding_ranks=get_embedding_ranks,
        create_gloo_process_groups=True,
    )
    _set_random_seed(args.seed, args.data_parallel_random_init)

    tracker = LiveBytesTracker()
    shims.set_tracker(tracker)
    phase_state = {"iter": 0, "fwd_count": {}, "out2label": {}, "fwd_label": None}
    result: Dict[str, Any] = {}
    timings: Dict[str, float] = {}

    with tracker:
        # ---------------------------------------------------------------- build (get_model)
        tracker.set_phase("build model")
        t0 = time.time()
        with tracker.region("build"):
            config = core_transformer_config_from_args(args)

            def model_provider(pre_process=True, post_process=True, vp_stage=None):
                if getattr(args, "heterogeneous_layers_config_path", None):
                    # gpt_builders.gpt_builder: heterogeneous configs take their per-block layer specs
                    from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import (
                        get_gpt_heterogeneous_layer_spec,
                    )
                    spec = get_gpt_heterogeneous_layer_spec(config, use_te=False, vp_stage=vp_stage)
                elif args.num_experts:
                    # gpt_builders.gpt_builder: MoE models take the per-layer block spec
                    # (dense and MoE layers from --moe-layer-freq), sliced for this stage/chunk.
                    spec = get_gpt_decoder_block_spec(
                        config, use_transformer_engine=False, normalization=args.normalization,
                        qk_l2_norm=False, vp_stage=vp_stage,
                    )
                else:
                    spec = get_gpt_layer_local_spec(
                        args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                        args.multi_latent_attention, normalization=args.normalization,
                    )
                mtp_spec = None
                if getattr(args, "mtp_num_layers", None):
                    # gpt_builders.gpt_builder: the MTP block spec (None on stages without MTP layers)
                    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
                    mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)
                return GPTModel(
                    config=config, transformer_layer_spec=spec,
                    vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process,
                    fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type,
                    rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
                    rope_scaling=args.use_rope_scaling, vp_stage=vp_stage, mtp_block_spec=mtp_spec,
                )

            vpp = args.virtual_pipeline_model_parallel_size
            if pp > 1 and vpp is not None:
                model = []
                for i in range(vpp):
                    m = model_provider(
                        pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i),
                        post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i),
                        vp_stage=i,
                    )
                    m.model_type = ModelType.encoder_or_decoder
                    m.vp_stage = i
                    model.append(m)
            else:
                m = model_provider(pre_process=mpu.is_pipeline_first_stage(),
                                   post_process=mpu.is_pipeline_last_stage())
                m.model_type = ModelType.encoder_or_decoder
                model = [m]
            if getattr(args, "freeze_all_layers", False):
                # training.py get_model (core 0.19.2): --freeze-all-layers
                for m in model:
                    m.requires_grad_(False)
            for m in model:
                for p in m.parameters():
                    tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
            num_params = _num_params(model)
            result["num_params_by_chunk"] = [_num_params([m]) for m in model]
            result["num_params"] = num_params
            routing = None
            if args.num_experts:
                # expert parameters: what DDP puts in the expert buffers (allreduce=False)
                result["num_params_expert"] = sum(p.nelement() for m in model for p in m.parameters()
                                                  if not getattr(p, "allreduce", True))
                routing = moe_probe.install(model, tracker)
            bytes_after_model_build = tracker.current

            if args.fp16 or args.bf16:
                model = [Float16Module(get_model_config(m), m) for m in model]
            bytes_after_float16 = tracker.current

            tracker.set_phase("build ddp")
            ddp_kwargs = {f.name: getattr(args, f.name) for f in
                          dataclasses.fields(DistributedDataParallelConfig) if hasattr(args, f.name)}
            ddp_kwargs["grad_reduce_in_fp32"] = args.accumulate_allreduce_grads_in_fp32
            ddp_kwargs["check_for_nan_in_grad"] = args.check_for_nan_in_loss_and_grad
            ddp_kwargs["check_for_large_grads"] = args.check_for_large_grads
            if args.ddp_num_buckets is not None:
                assert args.ddp_bucket_size is None
                ddp_kwargs["bucket_size"] = num_params // args.ddp_num_buckets
            else:
                ddp_kwargs["bucket_size"] = args.ddp_bucket_size
            ddp_kwargs["pad_buckets_for_high_nccl_busbw"] = args.ddp_pad_buckets_for_high_nccl_busbw
            ddp_kwargs["average_in_collective"] = args.ddp_average_in_collective
            # get_megatron_ddp_config: --ddp-reduce-scatter-with-fp32-accumulation (a field of 0.16.1's config)
            ddp_kwargs["reduce_scatter_with_fp32_accumulation"] = bool(
                getattr(args, "ddp_reduce_scatter_with_fp32_accumulation", False))
            ddp_config = DistributedDataParallelConfig(**ddp_kwargs)
            if getattr(args, "use_megatron_fsdp", False):
                # get_model (training.py, 0.16): Megatron-FSDP's adapter instead of DDP
                model = [shims.megatron_fsdp(get_model_config(m), ddp_config, m, disable_bucketing=(i > 0))
                         for i, m in enumerate(model)]
            else:
                model = [
                    DDP(config=get_model_config(m), ddp_config=ddp_config, module=m,
                        # get_model: no bucketing for model chunks after the first
                        disable_bucketing=(i > 0) or args.overlap_param_gather_with_optimizer_step)
                    for i, m in enumerate(model)
                ]
            bytes_after_ddp = tracker.current

            tracker.set_phase("build optimizer")
            opt_kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(OptimizerConfig)
                          if hasattr(args, f.name)}
            opt_config = OptimizerConfig(**opt_kwargs)
            optimizer = get_megatron_optimizer(
                opt_config, model, config_overrides=get_standard_config_overrides(opt_config),
                use_gloo_process_groups=True,
            )
            shims.configure_torch_optimizer(optimizer, args.referee_adam_kernel)
        timings["build_s"] = time.time() - t0
        # temporaries caught in reference cycles (e.g. the pickled byte tensors of an object collective)
        # are garbage, not state: collect them so that the reading does not depend on the GC's timing
        _settle(tracker)
        bytes_after_build = tracker.current
        result["live_bytes_after_build"] = bytes_after_build
        result["build_breakdown"] = {
            "model": bytes_after_model_build,
            "after_float16_module": bytes_after_float16,
            "after_ddp": bytes_after_ddp,
            "after_optimizer": bytes_after_build,
            "build_peak": tracker.region_result("build")["peak_bytes"],
        }
        result["ddp_buffers"] = [] if getattr(args, "use_megatron_fsdp", False) else _describe_buffers(model)

        # ---------------------------------------------------------------- train()
        mconfig = get_model_config(model[0])
        mconfig.grad_scale_func = optimizer.scale_loss
        mconfig.timers = None
        if args.overlap_grad_reduce:
            mconfig.no_sync_func = [m.no_sync for m in model]
            if len(model) == 1:
                mconfig.no_sync_func = mconfig.no_sync_func[0]
            if args.align_grad_reduce:
                mconfig.grad_sync_func = [m.start_grad_sync for m in model]
                if len(model) == 1:
                    mconfig.grad_sync_func = mconfig.grad_sync_func[0]
        if args.overlap_param_gather and args.align_param_gather:
            mconfig.param_sync_func = [m.start_param_sync for m in model]
            if len(model) == 1:
                mconfig.param_sync_func = mconfig.param_sync_func[0]
        mconfig.finalize_model_grads_func = finalize_model_grads
        for m in model:
            m.train()

        forward_step = make_forward_step(args, tracker, phase_state)
        install_phase_hooks(tracker, phase_state)
        pass_trace: list = []
        if args.referee_pass_trace:
            install_pass_trace(tracker, phase_state, pass_trace)
        forward_backward_func = get_forward_backward_func()
        data_seed = 4321 + mpu.get_data_parallel_rank()
        if len(model) > 1:
            data_iterator = [iter(MockGPTData(args, data_seed)) for _ in model]
        else:
            data_iterator = iter(MockGPTData(args, data_seed))
        if mpu.get_tensor_model_parallel_rank() != 0:
            data_iterator = [None] * len(model) if len(model) > 1 else None
        rsm = get_rerun_state_machine()

        iters = []
        with tracker.region("iterations"):
            for it in range(1, args.num_iterations + 1):
                phase_state["iter"] = it
                phase_state["fwd_count"] = {}
                t_it = time.time()
                with tracker.region(f"iter{it}"):
                    # ----- train_step
                    tracker.set_phase(f"it{it} zero_grad")
                    while rsm.should_run_forward_backward(data_iterator):
                        for m in model:
                            m.zero_grad_buffer()
                        optimizer.zero_grad()
                        tracker.set_phase(f"it{it} schedule")
                        with tracker.region(f"iter{it}/fwd_bwd"):
                            losses_reduced = forward_backward_func(
                                forward_step_func=forward_step, data_iterator=data_iterator,
                                model=model, num_microbatches=num_microbatches,
                                seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                                decoder_seq_length=None, forward_only=False,
                            )
                    rsm.should_checkpoint_and_exit()
                    tracker.set_phase(f"it{it} optimizer")
                    t_opt = time.time()
                    with tracker.region(f"iter{it}/optimizer"):
                        update_successful, grad_norm, _ = optimizer.step()
                    t_opt = time.time() - t_opt
                    tracker.set_phase(f"it{it} loss reduction")
                    loss = None
                    if mpu.is_pipeline_last_stage(ignore_virtual=True):
                        val = [x["lm loss"].view(-1) for x in losses_reduced]
                        val = torch.vstack(val).sum(dim=0)
                        torch.distributed.all_reduce(
                            val, group=mpu.get_data_parallel_group(with_context_parallel=True))
                        loss = float(val[0] / val[1])
                        del val
                    del losses_reduced
                    if args.num_experts:
                        tracker.set_phase(f"it{it} moe metrics")
                        _track_moe_metrics(args, num_microbatches, it)
                r_it = tracker.region_result(f"iter{it}")
                r_fb = tracker.region_result(f"iter{it}/fwd_bwd")
                r_opt = tracker.region_result(f"iter{it}/optimizer")
                iters.append({
                    "iteration": it,
                    "time_s": time.time() - t_it,
                    "optimizer_time_s": t_opt,
                    "loss": loss,
                    "grad_norm": float(grad_norm) if grad_norm is not None else None,
                    "update_successful": bool(update_successful),
                    "start_bytes": r_it["start_bytes"],
                    "peak_bytes": r_it["peak_bytes"],
                    "peak_phase": r_it["peak_phase"],
                    "fwd_bwd_peak_bytes": r_fb["peak_bytes"],
                    "fwd_bwd_peak_phase": r_fb["peak_phase"],
                    "optimizer_start_bytes": r_opt["start_bytes"],
                    "optimizer_peak_bytes": r_opt["peak_bytes"],
                    "optimizer_end_bytes": r_opt["end_bytes"],
                    "end_bytes": r_it["end_bytes"],
                })
        tracker.set_phase("done")
        # Reference cycles (autograd / gloo work objects) holding a scalar are freed whenever Python's
        # collector happens to run; collect now so that the after-step bytes do not depend on it
        # (an 8-byte scalar was seen alive in about 1 run in 8 without this). A gloo work object can also hold
        # one until its worker thread finishes with it: wait for the collectives, then for the reading to settle.
        torch.distributed.barrier()
        _settle(tracker)
        if args.referee_allocation_log:
            with open(f"{args.referee_allocation_log}.rank{rank}.json", "w") as fh:
                json.dump(tracker.records, fh)
        bytes_after_step = tracker.current
        bytes_after_step_r512 = tracker.current_r512
        r_all = tracker.region_result("iterations")
        top = args.referee_dump_top
        peak_seq = r_all["peak_seq"]
        result["peak_dump"] = tracker.dump(peak_seq, top=top)
        result["peak_dump_by_phase"] = _sum_by(tracker.live_at(peak_seq), lambda r: _phase_class(r[6]))
        if args.num_experts:
            # every live storage at the peak grouped with its full label (schedule step + module), so
            # that each saved tensor of a layer can be checked against a formula
            result["peak_dump_all"] = tracker.group(tracker.live_at(peak_seq), top=None)
        last = iters[-1]
        opt_region = tracker._regions[f"iter{args.num_iterations}/optimizer"]
        result["optimizer_peak_dump"] = tracker.dump(opt_region.peak_seq, top=15)
        result["after_step_dump"] = tracker.dump(None, top=15, by_phase=True)
        if args.num_experts:
            result["after_step_dump_all"] = tracker.dump(None, top=None, by_phase=True)
        result["num_tracked_allocations"] = tracker.num_allocs
        if args.referee_eval_micro_batch_size:
            result["eval"] = _eval_step(args, model, forward_step, forward_backward_func, tracker, data_seed)

    timings["total_s"] = time.time() - t_start
    pos = {
        "rank": rank,
        "world_size": world_size,
        "tp_rank": mpu.get_tensor_model_parallel_rank(),
        "pp_rank": mpu.get_pipeline_model_parallel_rank(),
        "dp_rank": mpu.get_data_parallel_rank(),
        "tp_size": tp, "pp_size": pp, "dp_size": dp,
        "vpp_size": args.virtual_pipeline_model_parallel_size,
        "num_model_chunks": len(model),
        "num_microbatches": num_microbatches,
    }
    if args.num_experts:
        pos.update({
            "ep_rank": mpu.get_expert_model_parallel_rank(),
            "ep_size": mpu.get_expert_model_parallel_world_size(),
            "etp_rank": mpu.get_expert_tensor_parallel_rank(),
            "etp_size": mpu.get_expert_tensor_parallel_world_size(),
            "edp_rank": mpu.get_expert_data_parallel_rank(),
            "edp_size": mpu.get_expert_data_parallel_world_size(),
            "num_params_expert": result["num_params_expert"],
            "routing": routing,
            "routing_summary": moe_probe.summarize(routing),
            "peak_all_storages": result["peak_dump_all"],
            "after_step_all_storages": result["after_step_dump_all"],
        })
    out = dict(pos)
    out.update({
        "num_params": result["num_params"],
        "num_params_by_chunk": result["num_params_by_chunk"],
        "live_bytes_after_build": result["live_bytes_after_build"],
        "live_bytes_after_step": bytes_after_step,
        "peak_bytes": r_all["peak_bytes"],
        "peak_phase": r_all["peak_phase"],
        "peak_bytes_rounded512": r_all["peak_bytes_rounded512"],
        "live_bytes_after_step_rounded512": bytes_after_step_r512,
        "peak_bytes_per_iteration": [i["peak_bytes"] for i in iters],
        "optimizer_step_peak_bytes": last["optimizer_peak_bytes"],
        "optimizer_step_peak_bytes_per_iteration": [i["optimizer_peak_bytes"] for i in iters],
        "build_breakdown": result["build_breakdown"],
        "ddp_buffers": result["ddp_buffers"],
        "iterations": iters,
        "peak_live_by_phase_class": result["peak_dump_by_phase"],
        "peak_top_storages": result["peak_dump"],
        "optimizer_peak_top_storages": result["optimizer_peak_dump"],
        "after_step_top_storages": result["after_step_dump"],
        "num_tracked_allocations": result["num_tracked_allocations"],
        "timings": timings,
        "referee_adam_kernel": args.referee_adam_kernel,
        **({"eval": result["eval"]} if "eval" in result else {}),
        **({"pass_trace": pass_trace} if args.referee_pass_trace else {}),
    })
    torch.distributed.barrier()
    mpu.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return out


def _track_moe_metrics(args, num_microbatches: int, iteration: int) -> None:
    """training.py training_log (core_v0.16 era): reduce and clear the MoE aux-loss trackers."""
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    lb = args_list(getattr(args, "moe_router_load_balancing_type", "aux_loss"))
    names = [n for t, n in (("aux_loss", "load_balancing_loss"), ("seq_aux_loss", "seq_load_balancing_loss"),
                            ("global_aux_loss", "global_load_balancing_loss")) if t in lb]
    if getattr(args, "moe_z_loss_coeff", None) is not None:
        names.append("z_loss")
    track_moe_metrics(loss_scale=1 / num_microbatches, iteration=iteration, force_initialize=True,
                      track_names=names, num_layers=args.num_layers, moe_layer_freq=args.moe_layer_freq,
                      mtp_num_layers=None)


def args_list(v) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _phase_class(phase: str) -> str:
    """Coarse class of a phase label: build / optimizer state / activations of fwd / ..."""
    if phase.startswith("build"):
        return phase
    parts = phase.split(" ")
    if len(parts) >= 2 and parts[0].startswith("it"):
        if parts[1] in ("fwd", "bwd"):
            return f"{parts[0]} {parts[1]}" + (" loss_func" if phase.endswith("loss_func") else "")
        return " ".join(parts[:2])
    return phase


def _sum_by(records, keyf):
    out: Dict[str, int] = {}
    for r in records:
        k = keyf(r)
        out[k] = out.get(k, 0) + r[2]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _describe_buffers(model) -> List[Dict[str, Any]]:
    out = []
    for ci, m in enumerate(model):
        for b in list(m.buffers) + list(m.expert_parallel_buffers):
            out.append({
                "chunk": ci,
                "param_dtype": str(b.param_dtype).replace("torch.", ""),
                "grad_dtype": str(b.grad_dtype).replace("torch.", ""),
                "numel": b.numel,
                "numel_unpadded": b.numel_unpadded,
                "num_buckets": len(b.buckets),
                "has_param_buffer": b.param_data is not None,
            })
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--settings", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if os.environ.get("REFEREE_STACK_DUMP_AFTER"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["REFEREE_STACK_DUMP_AFTER"]), exit=True)
    with open(a.settings) as f:
        settings = json.load(f)
    try:
        res = run_rank(settings, a.rank, a.world_size, a.port)
        with open(a.out + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(a.out + ".tmp", a.out)
    except BaseException:
        tb = traceback.format_exc()
        with open(a.out + ".err", "w") as f:
            f.write(tb)
        sys.stderr.write(tb)
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
