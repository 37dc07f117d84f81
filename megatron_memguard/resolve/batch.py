"""Section: micro-batch, global batch and the number of micro-batches (validate_args)."""
from __future__ import annotations

from typing import Any, Mapping

from .args import Args, Context, Stop


def batch(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    dp = kw["data_parallel_size"]
    mbs = a.int_arg("micro_batch_size", required=True)
    gbs = a.int_arg("global_batch_size")
    if mbs is None:
        raise Stop
    if gbs is None:
        gbs = mbs * dp
        a.notes.append(f"global batch size defaults to micro-batch size x DP = {gbs}")
    if gbs % (mbs * dp):
        if a.bool_arg("decrease_batch_size_if_needed", False):
            gbs = gbs // (mbs * dp) * (mbs * dp)
            if gbs == 0:
                a.fail("global_batch_size", f"is smaller than micro-batch size x DP = {mbs}*{dp}")
                raise Stop
            a.notes.append(f"--decrease-batch-size-if-needed: global batch size rounded down to {gbs}")
        else:
            a.fail("global_batch_size", f"{gbs} is not divisible by micro-batch size x DP = {mbs}*{dp} = {mbs * dp}",
                   f"use a multiple of {mbs * dp}")
    num_microbatches = max(1, gbs // (mbs * dp))  # (a placeholder after the error above: checks go on)
    if a.bool_arg("skip_train", False):
        # setup_model_and_optimizer (megatron/training/training.py, core 0.19.2): has_normal_optimizer = not
        # skip_train, and without an optimizer the model is not wrapped in DDP; pretrain then only evaluates
        a.notes.append("--skip-train: megatron.training builds neither the optimizer nor DDP's gradient buffer and "
                       "runs no training step: the training figure does not occur, and the evaluation step's figure "
                       "counts gradient and optimizer terms that are not allocated (upper bounds)")
    return dict(micro_batch_size=mbs, global_batch_size=gbs, num_microbatches=num_microbatches,
                **_eval_micro_batch(a, mbs, gbs, dp))


def _eval_micro_batch(a: Args, mbs: int, gbs: int, dp: int) -> dict[str, int | None]:
    """The evaluation step's micro-batch when it is larger than the training one (--eval-micro-batch-size), else
    None: the forward-only peak of a micro-batch no larger than the training one is bounded by the training step's
    forward of it, which holds the same tensors and its saved activations besides (estimator/eval_step.py).
    ``--eval-iters 0`` runs no evaluation step. With it, its number of micro-batches: evaluate() (training.py, core
    0.19.2) runs eval_global_batch_size // (eval_micro_batch_size x DP)."""
    given = a.int_arg("eval_micro_batch_size")
    # --eval-iters is an int argument (argparse type=int; Bridge's ValidationConfig.eval_iters: int | None), checked
    # whatever else is given. A negative count runs no step, like 0 (training.py evaluate: 'while iteration < eval_iters')
    iters = a.int_arg("eval_iters", 100, minimum=None)
    # validate_args (megatron/training/arguments.py, core 0.19.2): eval_global_batch_size (default: the global
    # batch) % (eval_micro_batch_size (default: the training one) x data_parallel_size) == 0, asserted whatever
    # --eval-iters is (neither given: the training batch's own check above covers it)
    em = mbs if given is None else given
    egbs = a.int_arg("eval_global_batch_size", gbs)
    if (given is not None or a.given("eval_global_batch_size")) and egbs is not None and egbs % (em * dp):
        a.fail("eval_global_batch_size", f"{egbs} is not divisible by eval micro-batch size x DP = {em}*{dp} = "
               f"{em * dp}", f"use a multiple of {em * dp}")
    if given is None or iters is None or iters <= 0 or em <= mbs:
        return dict(eval_micro_batch_size=None, eval_num_microbatches=None)
    return dict(eval_micro_batch_size=em, eval_num_microbatches=max(1, (egbs or gbs) // (em * dp)))
