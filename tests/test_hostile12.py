"""Regressions of issue hostile12 (benchmarks/hostile_input.py's hostile12 group): inputs the hostile11 round left
accepted. Each is the smallest input of its class, with what the real framework does and what memguard does now."""
from __future__ import annotations

import json
import os

import pytest

from fuzz_util import run_memguard
from test_eval_step import BASE as EVAL
from test_heterogeneous import BLOCKS, FLAGS as HET
from test_readers_bridge import FLAT

HERE = os.path.dirname(os.path.abspath(__file__))
S = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
     "--micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 1000 --bf16").split()


def one_error(o, text: str) -> None:
    assert not o.problems, o.describe()
    lines = [line for line in o.err.splitlines() if line.strip()]
    assert o.code == 2 and len(lines) == 1, (o.code, o.err)
    assert lines[0] == "memguard: error: " + text, lines[0]


def test_heterogeneous_json_with_a_utf8_bom_is_refused():
    # validate_model_config_args_from_heterogeneous_config (megatron-core 0.19.2 training/arguments.py):
    # json.loads(Path(path).read_text()) -> 'Unexpected UTF-8 BOM'; memguard's reader dropped the mark and estimated
    with open(BLOCKS, "rb") as f:
        data = f.read()
    assert json.loads(data.decode("utf-8"))["block_configs"]      # the same file without the mark is good JSON
    with pytest.raises(json.JSONDecodeError, match="BOM"):
        json.loads(("\ufeff" + data.decode("utf-8")))              # what Megatron's loader does with the mark
    argv = ["estimate", "--world-size", "1", "--", *HET, "--heterogeneous-layers-config-path", "b.json"]
    one_error(run_memguard(argv, {"b.json": b"\xef\xbb\xbf" + data}),
              "--heterogeneous-layers-config-path: starts with a UTF-8 byte-order mark, which Megatron's json.loads "
              "refuses; save it as UTF-8 without a BOM")
    assert run_memguard(argv, {"b.json": data}).code == 0


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "num_local_experts", "rope_theta"])
def test_hf_numbers_written_as_strings_are_refused(key):
    # transformers' PretrainedConfig keeps "4096" a str (MixtralConfig: self.hidden_size = hidden_size) and the model
    # build fails on it (nn.Embedding takes no str); memguard read it as the number and estimated
    doc = json.load(open(os.path.join(HERE, "data", "hf", "mixtral-8x7b.json")))
    text = str(doc[key])
    doc[key] = text
    argv = ["estimate", "--config", "config.json", "--world-size", "64", "--", "--micro-batch-size", "1",
            "--seq-length", "4096", "--global-batch-size", "64"]
    one_error(run_memguard(argv, {"config.json": json.dumps(doc)}),
              f"{key}: expects a JSON number, got the string {text!r} (transformers keeps it as text and building the "
              "model fails on it); write it without quotes")


@pytest.mark.parametrize("value, text", [
    # megatron.training's argparse: --eval-iters type=int ('x', '1.5' stop it) whatever --eval-micro-batch-size says
    ("x", "--eval-iters: must be an integer, got 'x' (Megatron's argparse reads it with type=int: digits only)"),
    ("1.5", "--eval-iters: must be an integer, got '1.5' (Megatron's argparse reads it with type=int: digits only)"),
])
def test_eval_iters_checked_without_an_eval_micro_batch(value, text):
    one_error(run_memguard(["estimate", "--world-size", "1", "--", *S, "--eval-iters", value]), text)
    # a negative count runs no evaluation (training.py evaluate: 'while iteration < eval_iters'): accepted, as 0
    assert run_memguard(["estimate", "--world-size", "1", "--", *S, "--eval-iters", "-1"]).code == 0


def test_bridge_eval_iters_checked_without_an_eval_micro_batch():
    # ValidationConfig.eval_iters: int | None (megatron-core 0.19.2 training/config/training_config.py)
    o = run_memguard(["estimate", "--config", "c.yaml", "--gpus", "8", "--set", "validation.eval_iters=x"], {"c.yaml": FLAT})
    assert o.code == 2 and not o.problems and "validation.eval_iters" in o.err, o.describe()


@pytest.mark.parametrize("cmd", ["report", "estimate", "plan"])
def test_named_pipe_without_reader_refused_before_rendering(cmd, tmp_path, monkeypatch):
    # open(O_WRONLY | O_NONBLOCK) of a FIFO nobody reads fails with ENXIO (POSIX open(2)); memguard drew the figure
    # first (about 2 s of CPU under load) and only then opened the pipe: now it opens it before reading the logs
    pytest.importorskip("matplotlib")
    from fuzz_util import RUNLOG
    from megatron_memguard.report import plots
    drawn = []
    for name in ("report_figure", "estimate_figure", "plan_figure"):
        real = getattr(plots, name)
        monkeypatch.setattr(plots, name, lambda *a, _real=real, **k: drawn.append(1) or _real(*a, **k))
    fifo = str(tmp_path / "out.html")
    os.mkfifo(fifo)
    run = {"memguard-rank00000.jsonl": json.dumps(RUNLOG[0]) + "\n" + json.dumps(RUNLOG[1]) + "\n"}
    argv = {"report": ["report", ".", "--out", fifo], "estimate": ["estimate", "--world-size", "8", "--plot", fifo, "--", *S],
            "plan": ["plan", "--gpus", "8", "--global-batch-size", "64", "--top", "2", "--plot", fifo, "--", *S]}[cmd]
    o = run_memguard(argv, run if cmd == "report" else {})
    one_error(o, f"{'--out' if cmd == 'report' else '--plot'}: cannot write {fifo}: a named pipe that nobody reads")
    assert drawn == []
    # a regular file still gets the figure (drawn once)
    out = str(tmp_path / "out2.html")
    argv[argv.index(fifo)] = out
    o = run_memguard(argv, run if cmd == "report" else {})
    assert o.code in (0, 1) and not o.problems and drawn == [1] and os.path.getsize(out) > 0, o.describe()


def test_eval_step_with_pp_and_vpp_bad_eval_batch():
    # validate_args (0.19.2): eval_global_batch_size % (eval_micro_batch_size x DP) == 0, asserted with PP / VPP too
    argv = ["estimate", "--world-size", "4", "--", "--pipeline-model-parallel-size", "2",
            "--num-layers-per-virtual-pipeline-stage", "1", *EVAL, "--eval-micro-batch-size", "3",
            "--eval-global-batch-size", "8"]
    o = run_memguard(argv)
    assert o.code == 2 and not o.problems and "--eval-global-batch-size" in o.err, o.describe()
