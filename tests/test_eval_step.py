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
    from benchmarks.referee.grid import COMMON, resolve_config
    from benchmarks.referee.run import run_referee
    return COMMON, resolve_config, run_referee


@functools.lru_cache(maxsize=None)
def _measured(extra: tuple, world: int) -> tuple:
    common, resolve_config, run_referee = _referee()
    from benchmarks.referee.grid import BASE as GRID_BASE
    flags = common + GRID_BASE + list(extra)
    L, settings = resolve_config(flags, world)
    settings["referee_eval_micro_batch_size"] = L.eval_micro_batch_size
    return L, run_referee(settings, world, timeout=900)


# measured on the referee (core 0.16.1, 2 ranks), each rank's eval peak vs memguard's eval figure (device cpu):
# PP2 eval MBS 8: +0.01% (stage 0, a layer's forward), +0.55% (stage 1, the loss);
# TP2 SP Llama-style eval MBS 8: -0.04% (the loss)
CASES = {
    "pp2": (("--pipeline-model-parallel-size", "2", "--eval-micro-batch-size", "8", "--eval-global-batch-size", "16"), 2),
    "tp2_sp_llama": (("--tensor-model-parallel-size", "2", "--sequence-parallel", "--swiglu", "--normalization", "RMSNorm",
                      "--position-embedding-type", "rope", "--disable-bias-linear",
                      "--untie-embeddings-and-output-weights", "--eval-micro-batch-size", "8",
                      "--eval-global-batch-size", "8"), 2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_eval_peak_against_the_referee(name):
    extra, world = CASES[name]
    L, ranks = _measured(extra, world)
    est = estimate(L, device="cpu")
    for r in ranks:
        e = r["eval"]
        assert e["start_bytes"] == r["live_bytes_after_step"]
        assert e["peak_bytes"] > r["peak_bytes"]     # the eval step peaks above training here
        got = est.stages[r["pp_rank"]].eval_step["peak_allocated_bytes"]
        assert abs(got - e["peak_bytes"]) < 0.01 * e["peak_bytes"], (name, r["rank"], got, e["peak_bytes"])


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
