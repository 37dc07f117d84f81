"""The evaluation step (--eval-micro-batch-size): its forward-only peak per stage, beside the training peak.

By hand: the loss's tensors at the eval micro-batch (logits, their fp32 copy, the targets). Measured: the CPU referee
runs megatron-core 0.16.1's schedule with forward_only=True under torch.no_grad in eval mode after two training
steps, as megatron/training evaluate() does (training.py, core 0.19.2), and its peak is compared with the figure.
"""
import functools
import json

import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError

# the referee grid's small GPT (benchmarks/referee/grid.py BASE): 4 layers, h 256, 8 heads, seq 256, vocab 8000
# padded to 8064, bf16, local spec, no dropout
BASE = ("--transformer-impl local --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion "
        "--no-gradient-accumulation-fusion --hidden-dropout 0.0 --attention-dropout 0.0 --tokenizer-type NullTokenizer "
        "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
        "--micro-batch-size 2 --global-batch-size 4 --vocab-size 8000 --make-vocab-size-divisible-by 128 "
        "--bf16").split()
PP2_EVAL8 = BASE + "--pipeline-model-parallel-size 2 --eval-micro-batch-size 8 --eval-global-batch-size 16".split()


def _layout(flags, world):
    return layout_from_flags(flags, world_size=world, megatron_version="0.19")


def _terms(stage) -> dict:
    return {t["name"]: t["bytes"] for t in stage.eval_step["terms"]}


def test_the_loss_at_the_eval_micro_batch_by_hand():
    last = estimate(_layout(PP2_EVAL8, 2), device="cpu").stages[1]
    tokens, v = 256 * 8, 8064       # s x b_eval; NullTokenizer 8000 + 1 padded to a multiple of 128
    logits = tokens * v * 2         # bf16 [s, b, V] (the referee's dump: mm bf16 [2048, 8064])
    fp32 = tokens * v * 4           # the cross entropy's fp32 copy (the dump: _to_copy fp32 [256, 8, 8064])
    targets = tokens * 9            # int64 masked targets + bool mask
    final_norm = tokens * 256 * 2 + tokens * 8   # the final LayerNorm's input (bf16) and fp32 mean / rstd
    output_input = tokens * 256 * 2
    assert _terms(last)["eval_logits_loss"] == logits + fp32 + targets + final_norm + output_input == 101_222_400
    # the eval batch: labels (int64) and loss mask (fp32) per token, the dataloader's bool [b, 1, s, s] mask
    assert _terms(last)["eval_batch"] == tokens * 12 + 8 * 256 * 256
    # the activation received from stage 0: [s, b_eval, h] bf16
    assert _terms(last)["eval_received_input"] == tokens * 256 * 2


def test_the_pipeline_tensors_of_the_forward_only_schedule_by_hand():
    # forward_backward_pipelining_without_interleaving (schedules.py, megatron-core 0.16.1 and 0.19.2) receives and
    # sends [s, b, h] at the micro-batch evaluate() passes it (the eval one), and keeps the previous micro-batch's
    # sent output in output_tensor through the next forward (deallocate_output_tensor runs on the training path only)
    act_eval, act_train = 256 * 8 * 256 * 2, 256 * 2 * 256 * 2     # [s, b, h] bf16 at b_eval 8 / b 2
    est = estimate(_layout(PP2_EVAL8, 2), device="gpu", gpu_memory=4 * 2 ** 30)
    first, last = (_terms(s) for s in est.stages)
    assert first["eval_previous_output"] == act_eval and "eval_previous_output" not in last     # the last sends none
    assert "eval_received_input" not in first and last["eval_received_input"] == act_eval
    # the buffer NCCL still holds: the eval micro-batch's on the receiving stage (training's: the training one); on
    # the first stage, which only sends, it is the previous output already counted
    assert {t.name: t.bytes for t in est.stages[1].terms}["p2p_buffers_in_flight"] == act_train
    assert last["p2p_buffers_in_flight"] == act_eval and "p2p_buffers_in_flight" not in first
    assert {t.name: t.bytes for t in est.stages[0].terms}["p2p_buffers_in_flight"] == act_train


def test_the_other_chunks_inputs_under_interleaving_by_hand():
    # interleaved forward-only (schedules.py forward_backward_pipelining_with_interleaving, 0.16.1 and 0.19.2) pops
    # each input after its forward and frees each sent output (deallocate_pipeline_outputs, set by megatron.training);
    # what stays is each chunk's TransformerBlock.input_tensor: the eval input once the chunk ran, the training's
    # input and its gradient before (pipeline_inputs_retained). Stage 1 of PP2 x VPP2: both chunks receive.
    vpp = "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1".split()
    est = estimate(_layout(BASE + vpp + "--eval-micro-batch-size 8 --eval-global-batch-size 16".split(), 2), device="cpu")
    last = _terms(est.stages[1])
    assert last["eval_received_input"] == 256 * 8 * 256 * 2
    assert last["eval_other_chunks_inputs"] == max(256 * 8 * 256 * 2, 2 * 256 * 2 * 256 * 2) == 1_048_576
    assert "eval_previous_output" not in last       # interleaving frees the sent outputs
    # eval micro-batch 3 (training 2): the training's input and gradient, 2 x [s, 2, h], outweigh one [s, 3, h]
    est = estimate(_layout(BASE + vpp + "--eval-micro-batch-size 3 --eval-global-batch-size 12".split(), 2), device="cpu")
    assert _terms(est.stages[1])["eval_other_chunks_inputs"] == 2 * 256 * 2 * 256 * 2 == 524_288


def test_the_moe_dispatchers_state_at_the_eval_micro_batch_by_hand():
    # the alltoall dispatcher keeps self.probs [T, E] (the router's dtype: bf16 here), self.routing_map [T, E] bool
    # and the permute's int64 mapping [T k] until the layer's next forward (token_dispatcher.py, megatron-core 0.16.1
    # and 0.19.2): after an eval forward they are the eval micro-batch's; the figure adds the growth under its own
    # name, not the GlobalMemoryBuffer's
    moe = ("--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
           "--pipeline-model-parallel-size 2 --eval-micro-batch-size 8 --eval-global-batch-size 16").split()
    L = _layout(BASE + moe, 4)
    for s in estimate(L, device="cpu").stages:
        t = _terms(s)
        # 2 MoE layers per stage, (2 + 1) bytes per token and expert and 8 per token and choice (k 2), T = s x b:
        # 256 x 8 against 256 x 2
        assert t["eval_moe_dispatcher_state_growth"] == 2 * (3 * 4 + 8 * 2) * (256 * 8 - 256 * 2) == 86_016
        assert t["moe_dispatcher_state"] == 2 * (3 * 4 + 8 * 2) * 256 * 2   # the training's, in the static terms
        # the local attention's baddbmm score buffer [b x heads, s, s] bf16 in the GlobalMemoryBuffer, alone
        assert t["eval_global_memory_buffer_growth"] == (8 - 2) * 8 * 256 * 256 * 2


def test_eval_step_in_the_verdict_and_the_json():
    L = _layout(PP2_EVAL8, 2)
    est = estimate(L, device="gpu", gpu_memory=4 * 2 ** 30)
    last = est.stages[1]
    assert last.eval_step["device_total_bytes"] > last.device_total_bytes      # 4x the micro-batch, at the loss
    assert est.peak_device_bytes == last.eval_step["device_total_bytes"]
    doc = est.to_dict()
    assert doc["stages"][1]["eval_step"]["micro_batch_size"] == 8
    assert doc["layout"]["eval_micro_batch_size"] == 8
    json.dumps(doc)
    # the static memory of training stays: the eval figure carries its state terms unchanged
    train = {t.name: t.bytes for t in last.terms}
    for name in ("parameters", "gradient_buffer", "adam_exp_avg", "adam_exp_avg_sq"):
        assert _terms(last)[name] == train[name]
    assert not any("evaluation step" in n for n in est.notes)


def test_no_figure_when_the_training_step_bounds_it():
    # an eval micro-batch no larger than the training one: its forward is the training forward's, less what that
    # saves; --eval-iters 0: no evaluation step at all
    for extra in ("--eval-micro-batch-size 2", "--eval-micro-batch-size 1",
                  "--eval-micro-batch-size 8 --eval-global-batch-size 16 --eval-iters 0"):
        L = _layout(BASE + extra.split(), 1)
        assert L.eval_micro_batch_size is None
        assert estimate(L, device="cpu").stages[0].eval_step is None


def test_skip_train_is_noted():
    # setup_model_and_optimizer (megatron/training/training.py, core 0.19.2): has_normal_optimizer = not skip_train, and
    # no DDP wrapper without an optimizer; pretrain only evaluates. The figures then count what is not allocated.
    L = _layout(PP2_EVAL8 + ["--skip-train"], 2)
    assert any(n.startswith("--skip-train: megatron.training builds neither the optimizer nor DDP's gradient buffer")
               for n in estimate(L, device="cpu").notes)
    assert not any("--skip-train" in n for n in estimate(_layout(PP2_EVAL8, 2), device="cpu").notes)


def test_eval_global_batch_must_divide():
    # validate_args (megatron/training/arguments.py, core 0.19.2) asserts eval_global_batch_size % (eval MBS x DP) == 0;
    # the eval global batch defaults to the training one (4 here)
    with pytest.raises(ConfigError, match="--eval-global-batch-size: 4 is not divisible by eval micro-batch size x DP"):
        _layout(BASE + ["--eval-micro-batch-size", "8"], 1)
    # the assert runs whatever --eval-iters is and with the eval micro-batch defaulting to the training one (2 here):
    # 5 % (2 x 1) and 12 % (8 x 1) fail it
    with pytest.raises(ConfigError, match="--eval-global-batch-size: 5 is not divisible by eval micro-batch size x DP"):
        _layout(BASE + ["--eval-global-batch-size", "5"], 1)
    with pytest.raises(ConfigError, match="--eval-global-batch-size: 12 is not divisible by eval micro-batch size x DP"):
        _layout(BASE + "--eval-micro-batch-size 8 --eval-global-batch-size 12 --eval-iters 0".split(), 1)
    # neither eval flag: the training global batch's own error, not a second one under an eval flag not given
    with pytest.raises(ConfigError) as e:
        _layout(BASE + ["--global-batch-size", "5"], 1)
    assert "eval" not in str(e.value)


def test_unmodelled_combinations_keep_the_note():
    L = _layout(PP2_EVAL8 + ["--mtp-num-layers", "1", "--position-embedding-type", "rope"], 2)
    est = estimate(L, device="cpu")
    assert all(s.eval_step is None for s in est.stages)
    assert any("--eval-micro-batch-size: the evaluation step is not estimated (the MTP block" in n for n in est.notes)


# ----- measured: the CPU referee (megatron-core 0.16.1 on CPU, gloo)

def _referee():
    pytest.importorskip("megatron.core")
    from benchmarks.referee.run import unsupported_reason
    if unsupported_reason() is not None:
        pytest.skip(str(unsupported_reason()))
    from benchmarks.referee.grids.dense import COMMON, resolve_config
    from benchmarks.referee.run import run_referee
    return COMMON, resolve_config, run_referee


@functools.lru_cache(maxsize=None)
def _measured(extra: tuple, world: int, microbatches: int = 2) -> tuple:
    common, resolve_config, run_referee = _referee()
    from benchmarks.referee.grids.dense import BASE as GRID_BASE
    flags = common + GRID_BASE + list(extra)
    L, settings = resolve_config(flags, world)
    settings["referee_eval_micro_batch_size"] = L.eval_micro_batch_size
    settings["referee_eval_microbatches"] = microbatches
    return L, run_referee(settings, world, timeout=900)


_PP2 = ("--pipeline-model-parallel-size", "2", "--eval-micro-batch-size", "8", "--eval-global-batch-size", "16")
_VPP2 = ("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
         "--eval-micro-batch-size", "8", "--eval-global-batch-size", "32")

# measured on the referee (core 0.16.1, 2 ranks), each rank's eval peak vs memguard's eval figure (device cpu), with
# the tolerance each case is held to (name: (flags, world, eval micro-batches, tolerance per pipeline rank)):
# PP2 eval MBS 8: +1.04% (stage 0: one layer's forward is an upper bound, 25.0 MiB for a measured 24.0 MiB moment),
# +0.55% (stage 1, the loss); TP2 SP Llama-style eval MBS 8: -0.04% (the loss); PP2 x VPP2 with 4 eval micro-batches
# (the second round of chunk 0 runs while chunk 1 keeps its eval input): +2.1% (stage 0: the layer bound, 25.0 MiB for
# a 23.0 MiB moment just after the embedding), +0.55% (stage 1, the loss)
CASES = {
    "pp2": (_PP2, 2, 2, (0.011, 0.01)),
    "tp2_sp_llama": (("--tensor-model-parallel-size", "2", "--sequence-parallel", "--swiglu", "--normalization", "RMSNorm",
                      "--position-embedding-type", "rope", "--disable-bias-linear",
                      "--untie-embeddings-and-output-weights", "--eval-micro-batch-size", "8",
                      "--eval-global-batch-size", "8"), 2, 2, (0.01,)),
    "pp2_vpp2": (_VPP2, 2, 4, (0.025, 0.01)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_eval_peak_against_the_referee(name):
    extra, world, m, tol = CASES[name]
    L, ranks = _measured(extra, world, m)
    est = estimate(L, device="cpu")
    for r in ranks:
        e = r["eval"]
        assert e["start_bytes"] == r["live_bytes_after_step"]
        assert e["peak_bytes"] > r["peak_bytes"]     # the eval step peaks above training here
        got = est.stages[r["pp_rank"]].eval_step["peak_allocated_bytes"]
        assert abs(got - e["peak_bytes"]) < tol[r["pp_rank"]] * e["peak_bytes"], (name, r["rank"], got, e["peak_bytes"])


def _made_at_peak(rank: dict, shape: list, phase: str) -> int:
    """Bytes of the storages of ``shape`` the evaluation step made in ``phase`` and still live at its peak."""
    return sum(d["bytes"] for d in rank["eval"]["peak_dump_made"] if d["shape"] == shape and d["phase"] == phase)


def test_the_pipeline_tensors_against_the_referee():
    # the referee's live storages at the eval peak, made by the evaluation step (phases: 'it2 fwd [cK] mbN' for the
    # forwards (its micro-batches follow the two training ones), 'it2 schedule' for the received tensors)
    act = [256, 8, 256]         # [s, b_eval, h]
    L, ranks = _measured(*CASES["pp2"][:3])
    est = estimate(L, device="cpu")
    first, last = ranks
    assert first["eval"]["peak_phase"] == "it2 fwd mb3"     # the second eval micro-batch's forward
    # the first eval micro-batch's output, live through the second's forward
    assert _made_at_peak(first, act, "it2 fwd mb2") == _terms(est.stages[0])["eval_previous_output"] == 1_048_576
    assert _made_at_peak(last, act, "it2 schedule") == _terms(est.stages[1])["eval_received_input"]
    L, ranks = _measured(*CASES["pp2_vpp2"][:3])
    est = estimate(L, device="cpu")
    # stage 1's peak (chunk 1's loss): its received input and chunk 0's last eval input, both [s, b_eval, h]
    t = _terms(est.stages[1])
    assert _made_at_peak(ranks[1], act, "it2 schedule") == t["eval_received_input"] + t["eval_other_chunks_inputs"]


@pytest.mark.parametrize("extra", [
    "", "--pipeline-model-parallel-size 2", "--tensor-model-parallel-size 2 --sequence-parallel",
    "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1",
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
    "--recompute-granularity selective",
])
def test_the_training_step_bounds_an_eval_micro_batch_no_larger(extra):
    # why resolve gives no figure for eval MBS <= MBS: at the training micro-batch the forward-only figure stays below
    # the training peak (even under full recomputation, whose forward keeps only the checkpoint inputs)
    world = 2 if extra else 1
    L = _layout(BASE + extra.split(), world)
    est = estimate(L.replace(eval_micro_batch_size=L.micro_batch_size), device="cpu")
    for s in est.stages:
        assert s.eval_step["peak_allocated_bytes"] <= s.peak_allocated_bytes, (extra, s.pp_rank)


def test_one_eval_micro_batch_keeps_no_previous_output():
    """forward_backward_pipelining_without_interleaving (schedules.py, megatron-core 0.16.1 and 0.19.2) runs a
    forward-only step's micro-batches as warm-up forwards, rebinding ``output_tensor`` as each forward_step returns:
    with one eval micro-batch (eval global batch 8 = eval micro-batch 8 x DP 1, evaluate() in training.py 0.19.2) no
    earlier output is live during its forward, so the first stage has no eval_previous_output. Measured on the
    referee: the first stage's eval peak is one [s, b_eval, h] bf16 tensor (256 x 8 x 256 x 2 = 1,048,576 B) lower
    with one eval micro-batch than with two, and memguard's figure moves by the same bytes (before, it counted the
    previous output whatever the count: +1,048,576 B on the one-micro-batch run)."""
    one = _layout(BASE + "--pipeline-model-parallel-size 2 --eval-micro-batch-size 8 --eval-global-batch-size 8".split(),
                  2)
    assert one.eval_num_microbatches == 1 and _layout(PP2_EVAL8, 2).eval_num_microbatches == 2
    assert "eval_previous_output" not in _terms(estimate(one, device="cpu").stages[0])
    L2, ranks2 = _measured(*CASES["pp2"][:3])
    L1, ranks1 = _measured(("--pipeline-model-parallel-size", "2", "--eval-micro-batch-size", "8",
                            "--eval-global-batch-size", "8"), 2, 1)
    assert L1.eval_num_microbatches == 1
    est1, est2 = (estimate(L, device="cpu").stages[0].eval_step["peak_allocated_bytes"] for L in (L1, L2))
    measured_drop = ranks2[0]["eval"]["peak_bytes"] - ranks1[0]["eval"]["peak_bytes"]
    assert est2 - est1 == 256 * 8 * 256 * 2
    # (measured 1,048,580 B: the tensor and one 4-byte scalar of the second micro-batch)
    assert 0 <= measured_drop - (est2 - est1) <= 8
    # and the one-micro-batch figure errs as the two-micro-batch one does (the layer bound: within 1.1%)
    assert abs(est1 - ranks1[0]["eval"]["peak_bytes"]) < 0.011 * ranks1[0]["eval"]["peak_bytes"]
