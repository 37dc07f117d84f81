"""Hostile inputs for the fuzz tests and the hostile-input benchmark: values, YAML snippets, shell lines,
run-log fields, and an in-process runner for ``memguard`` that captures output, CPU time and hangs."""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import yaml

from megatron_memguard.cli.main import main

# What a promise-keeping run looks like (docs/assumptions.md, "Bounds on inputs").
EXIT_CODES = (0, 1, 2)
MAX_ERROR_LINE = 1200            # characters of one stderr line (errors cut long values to 60)

BIG = 300_000                    # characters of the long hostile values (inputs stay under 1 MB)


class V(str):
    """A hostile value whose repr (in hypothesis' report of a failing case) is cut to 80 characters."""

    def __repr__(self) -> str:
        r = super().__repr__()
        return r if len(r) <= 80 else f"{r[:38]}...{r[-30:]} ({len(self)} chars)"


def _v(values: list[str]) -> list[str]:
    return [V(x) for x in values]
def alias_bomb(levels: int = 5, width: int = 10) -> str:
    """A flow sequence of about 100 characters per level whose aliases expand to width**levels values."""
    parts = ["&a0 [" + ", ".join(["x"] * width) + "]"]
    for i in range(1, levels):
        parts.append(f"&a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "[" + ", ".join(parts) + "]"


# Hostile values by class: a fuzz case draws a class, then a value in it, so that every class (and
# not only the largest) is tried often.
# Numbers where Megatron wants a count or a size.
NUMBER_CLASSES = {
    "non-finite": ["inf", "-inf", "nan", "NaN", "Infinity"],
    "huge": ["1e30", "1" + "0" * 30, "1e309", "1e400", "9" * 40, str(2**64)],
    "digits": ["9" * 5000, "1" * 5000, "-" + "9" * 5000],
    "out of range": ["0", "-1", "-1e309", "1.5", "1e-400", "2147483648", "9223372036854775808", "1048577", "10001"],
    "extreme but valid": ["1", "2", "3", "8", "1024", "10000", "65536", "1048576", "2147483647", "4.0"],
    "not a number": ["", "abc", "${X}", "0x10", "1_0", "٣"],
}
# Any text: quotes, expansions, control characters, very long values.
TEXT_CLASSES = {
    "shell": ["'", '"', "\\", "$", "${", "$(", "`", "$A$A", "*"],
    "odd": ["--", "=", "é\u202e", "\t", "a b", "???", "\x00"],
    "long": ["x" * BIG, "[" * 100_000, "$(" * 50_000],
    "interpolation": ["${oc.decode:'[1,2]'}", "${missing.key}", "${oc.env:HOME}"],
}
# YAML written in place of a value (one line, flow style).
YAML_CLASSES = {
    "non-finite": [".inf", "-.inf", ".nan", "1e400"],
    "digits": ["9" * 5000, "-" + "9" * 5000],
    "nesting": ["[" * 100_000, "[" * 70 + "]" * 70, "{" * 50_000, "{a: " * 100 + "1" + "}" * 100],
    "aliases": [alias_bomb(5), alias_bomb(4), alias_bomb(6, 6), "*undefined", "&r [*r]"],
    "interpolation": ["\"${oc.decode:'[1,2]'}\"", "\"${oc.decode:'{a: 1}'}\"", "\"${oc.create:'[1]'}\"",
                      "${missing.key}", "???", "${multiply:1e400,2}"],
    "types": ["{a: 1}", "[1, 2]", "null", "true", "'x'", "0", "-1", "1.5", "3"],
    "bad scalars": ["!!binary xx", "!!python/object/apply:os.system [ls]", "2001-02-31", "\"\\u\"", "'unterminated"],
    "long": ["x" * BIG],
}
# Lines added to a launch script.
SHELL_CLASSES = {
    "re-expansion": ["A='$A$A'\n" + "A=$A$A\n" * 20 + 'OPTS="--save $A"\n', "A='${A}${A}'\n" + "A=${A}${A}\n" * 18],
    "unterminated": ['B="unterminated\n', "cat <<EOF\nnever ends\n", "ARR=(\n", "${" * 20_000 + "\n",
                     "$(" * 20_000 + "\n"],
    "nesting": ["C=${A:-" * 3_000 + "x" + "}" * 3_000 + "\n", "D=$((1/0))\n", "eval \"$(cat x)\"\n"],
    "numbers": ["export WORLD_SIZE=" + "9" * 5000 + "\n", "#SBATCH --nodes=1e30\n", "#SBATCH --ntasks-per-node=inf\n",
                "srun -N " + "9" * 5000 + " true\n", "export PET_NNODES=inf\n"],
    "more": ["torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 2\n", "x" * BIG + "\n"],
}
# Values of a run-log record field (JSON text).
JSON_CLASSES = {
    "huge integers": ["1" + "0" * 400, "2" + "0" * 330, "1" + "0" * 30],
    "digits": ["9" * 5000, "-" + "9" * 5000],
    "non-finite": ["1e400", "NaN", "Infinity", "-Infinity"],
    "nesting": ["[" * 100_000, "{\"a\": " * 10_000 + "1" + "}" * 10_000],
    "types": ["\"x\"", "{}", "[]", "null", "true", "-1", "0.5", "1.5e300"],
    "long": ["\"" + "x" * BIG + "\""],
}

# Issue hostile5: a small hybrid Mamba model's flags (tests/test_mamba.py's shape), hybrid layer patterns and
# pipeline layouts with MTP layers ('m'), by class
HYBRID = ["--hidden-size", "256", "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
          "--ffn-hidden-size", "512", "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
          "--global-batch-size", "8", "--bf16", "--vocab-size", "1024", "--tokenizer-type", "NullTokenizer",
          "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "none",
          "--mamba-state-dim", "16", "--mamba-head-dim", "32", "--mamba-num-groups", "2"]
HYBRID_PATTERNS = {   # --hybrid-layer-pattern / --hybrid-override-pattern / Bridge's hybrid_layer_pattern
    "valid": ["M*M-", "M*|M-", "MM**", "M-M-|M*M-", "M*M-/", "****", "M*-E"],
    "separators": ["", "|", "||", "|M*", "M*|", "M||*", "/", "M*/M", "M*/M/M-", "M*/|", "/M*", "M*//", "M*|M-" * 2 + "|"],
    "symbols": ["m*", "MX", "G*", "D*", "+M", "M\u2217M", "\uff2d*", "M\u200b*", "M* M", "M\n*", "\x00", "é", "0", "M*\u202e-"],
    "huge": ["M" * 100_000, "M" * 100_001, "M*" * 5_000, "M|" * 5_000, "|" * 100_000, "M" + "|" * 99_999],
}
MTP_LAYOUTS = {
    "standalone": ["Ett|tt|m|L", "Etttt|m|L", "Et|tt|tm|L", "Ett|ttmL", "E|tttt|m|L", "Etttt|m||L"],
    "odd": ["mEtttt|L", "Et|m|m|tttL", "Etttt|L|m", "Etmtmtmt|L", "m", "Etttt|Lm", "|Etttt|m|L", "Etttt|m|L|",
            "Etttt|m*2|L", "Etttt|(m)*3|L", "Etttt|m*100000|L", "Etttt|\uff4d|L", "Etttt|M|L", "Etttt,m,L"],
    "huge": ["Etttt|m|L" * 1_000, "E" + "t" * 4 + "|" * 50_000 + "mL", "Etttt|" + "m" * 100_000 + "|L"],
}


def _flat(classes: dict) -> list[str]:
    return _v([x for values in classes.values() for x in values])


NUMBERS, TEXTS = _flat(NUMBER_CLASSES), _flat(TEXT_CLASSES)
YAML_VALUES, SHELL_LINES, JSON_VALUES = _flat(YAML_CLASSES), _flat(SHELL_CLASSES), _flat(JSON_CLASSES)


# --------------------------------------------------------------------------------------------------
# Seeds: valid inputs of every kind
# --------------------------------------------------------------------------------------------------
SMALL = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
         "--micro-batch-size 2 --global-batch-size 16 --tokenizer-type NullTokenizer --vocab-size 1000 --bf16 "
         "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --use-distributed-optimizer").split()
NUMERIC_FLAGS = ["--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--max-position-embeddings",
                 "--micro-batch-size", "--global-batch-size", "--vocab-size", "--tensor-model-parallel-size",
                 "--pipeline-model-parallel-size", "--context-parallel-size", "--ffn-hidden-size", "--kv-channels",
                 "--num-query-groups", "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
                 "--decoder-first-pipeline-num-layers", "--recompute-num-layers", "--ddp-bucket-size",
                 "--microbatch-group-size-per-vp-stage", "--make-vocab-size-divisible-by", "--hidden-dropout",
                 "--rotary-percent", "--num-distributed-optimizer-instances", "--hierarchical-context-parallel-sizes",
                 "--pipeline-model-parallel-layout", "--recompute-granularity", "--train-iters", "--lr"]
LAUNCH = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=4
MODEL_ARGS=(
    --num-layers 4 --hidden-size 256 --num-attention-heads 8   # the shape
    --seq-length 512 --max-position-embeddings 512
)
OTHER="--micro-batch-size 2 --global-batch-size 16 --tokenizer-type NullTokenizer --vocab-size 1000"
torchrun --nproc-per-node $GPUS_PER_NODE --nnodes ${NNODES:-2} pretrain_gpt.py \\
    "${MODEL_ARGS[@]}" $OTHER --bf16 --tensor-model-parallel-size 2 --save "/ckpt/run 1" --save-interval 100 2>&1 | tee log.txt
"""
HF = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
      "num_key_value_heads": 4, "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 512,
      "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def _shared(*parts: str) -> str:
    from benchmarks.shared_data import CONFIGS
    with open(os.path.join(CONFIGS, *parts), encoding="utf-8") as f:
        return f.read()


# (file name, text, memguard options that make it estimable)
YAML_SEEDS = [
    ("nemo1.yaml", _shared("nemo1", "megatron_gpt_config.yaml"), ["--gpus", "8", "--vocab-size", "32000"]),
    ("nemo1_llama.yaml", _shared("nemo1", "megatron_llama_config.yaml"), ["--gpus", "8", "--vocab-size", "32000"]),
    ("launcher.yaml", _shared("nemo-launcher", "llama_llama3_1_8b.yaml"), ["--gpus", "64", "--vocab-size", "128256"]),
    ("functional.yaml", _shared("megatron-functional", "gpt3_mcore_te_tp2_pp2_cross_entropy_loss_fusion.yaml"),
     ["--gpus", "8", "--vocab-size", "50257"]),
    ("bridge_override.yaml", _shared("megatron-bridge", "llama32_1b_pretrain_override.yaml"),
     ["--gpus", "8", "--model", "llama32_1b"]),
    ("context_model.yaml", _shared("nemo2", "context_model.yaml"), ["--gpus", "8"]),
    ("config.json", json.dumps(HF, indent=1), ["--gpus", "8", "--", "--micro-batch-size", "1"]),
]


def _leaves(doc, prefix=()):
    """Key paths of a parsed document's values (the places a mutation may replace)."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _leaves(v, prefix + (k,))
    elif isinstance(doc, list) and doc:
        for i, v in enumerate(doc[:3]):
            yield from _leaves(v, prefix + (i,))
    if prefix:
        yield prefix


def _value_at(doc, path):
    for k in path:
        doc = doc[k]
    return doc


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# each seed parsed once (PyYAML's pure-Python parser: parsing again for every path took 17 s of CPU at every import of
# this module, in every test process that collects a file using it); read only, never changed
_SEED_DOCS = {name: yaml.safe_load(text) for name, text, _ in YAML_SEEDS}
LEAVES = {name: list(_leaves(doc)) for name, doc in _SEED_DOCS.items()}
# the paths of numbers (counts, sizes): where most of the damage is done
NUMBER_LEAVES = {name: [p for p in LEAVES[name] if _is_number(_value_at(_SEED_DOCS[name], p))] or LEAVES[name]
                 for name in LEAVES}
SENTINEL = "memguard-fuzz-sentinel"


def with_values(text: str, name: str, values: list[tuple[tuple, str]]) -> str:
    """The seed with the value at each path written as raw YAML/JSON (the raw text goes in after the
    document is written out, so the generator never parses hostile text)."""
    doc = yaml.safe_load(text)
    for k, (path, _) in enumerate(values):
        node = doc
        try:
            for p in path[:-1]:
                node = node[p]
            node[path[-1]] = f"{SENTINEL}{k}x"
        except (KeyError, IndexError, TypeError):  # an earlier value replaced this path's parent
            pass
    out = json.dumps(doc) if name.endswith(".json") else yaml.safe_dump(doc, sort_keys=False, width=10**9)
    for k, (_, raw) in enumerate(values):
        out = out.replace(f'"{SENTINEL}{k}x"' if name.endswith(".json") else f"{SENTINEL}{k}x", raw)
    return out


def _record(event: str, **fields) -> dict:
    return {"schema": "memguard.runtime/1", "event": event, "time": 1.0, "rank": 0, "pp_rank": 0, **fields}


PRED = {"peak_allocated": 40 * 2**30, "peak_reserved": 42 * 2**30, "device_total": 44 * 2**30, "persistent": 20 * 2**30}
ACTUAL = {"allocated": 20 * 2**30, "max_allocated": 39 * 2**30, "reserved": 21 * 2**30, "max_reserved": 41 * 2**30,
          "device_used": 43 * 2**30}
RUNLOG = [
    _record("start", source="static", interval=10, tolerance=0.05, reset_peak=False, predicted=dict(PRED), actual=dict(ACTUAL)),
    _record("sample", iteration=10, actual=dict(ACTUAL), predicted=dict(PRED)),
    _record("warning", iteration=20, metric="max_allocated", actual_bytes=45 * 2**30, predicted_bytes=40 * 2**30),
    _record("sample", iteration=20, actual=dict(ACTUAL), predicted=dict(PRED)),
    _record("oom", iteration=21, alloc_bytes=2**30, actual_bytes=79 * 2**30),
    _record("summary", iterations=21),
]
RUNLOG_FIELDS = [(i, k) for i, r in enumerate(RUNLOG) for k in r] + \
    [(i, ("actual", k)) for i in (1, 3) for k in ACTUAL] + [(i, ("predicted", k)) for i in (1, 3) for k in PRED]
RUNLOG_NUMBER_FIELDS = [(i, k) for i, k in RUNLOG_FIELDS
                        if _is_number(RUNLOG[i][k[0]][k[1]] if isinstance(k, tuple) else RUNLOG[i][k])]
# per record (a record is drawn first, then one of its fields): (number fields, other fields)
RUNLOG_RECORD_FIELDS = [([k for j, k in RUNLOG_NUMBER_FIELDS if j == i], [k for j, k in RUNLOG_FIELDS if j == i])
                        for i in range(len(RUNLOG))]



# A Megatron log as its ranks print it: the argument table of tests/data (megatron-core 0.19.2), iteration
# and report_memory lines, and PyTorch's out-of-memory error (formats in report/megatron_log.py).
_MEM_LINE = ("[Rank 0] (after {k} iterations) memory (MB) | allocated: 20480.12 | max allocated: 39000.50 | "
             "reserved: 41000.00 | max reserved: 41000.00\n")
_IT_LINE = " [2026-01-01 00:00:0{k}] iteration        {k}/      10 | consumed samples:          {k} |\n"
OOM_LINE = ("[default0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
            "capacity of 79.11 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.04 GiB "
            "memory in use. Of the allocated memory 75.50 GiB is allocated by PyTorch, and 1.21 GiB is reserved by "
            "PyTorch but unallocated.\n")
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "megatron-0.19.2-rank0-start.log"),
          encoding="utf-8") as _f:
    MEGATRON_LOG = _f.read() + "".join(_IT_LINE.format(k=k) + _MEM_LINE.format(k=k) for k in (1, 2, 3)) + OOM_LINE
MEGATRON_LOG_LINES = {
    "progress bar": ["\r".join(["iteration 1/10 |"] * 20_000) + "\n", "x" * BIG + "\n"],
    "tables": ["-------------------- arguments --------------------\n", "  num_layers " + "." * 38 + " 1e400\n",
               "  world_size " + "." * 38 + " " + "9" * 5000 + "\n"],
    "memory": [_MEM_LINE.format(k="9" * 5000), _MEM_LINE.format(k=1).replace("20480.12", "1e400"),
               _MEM_LINE.format(k=1).replace("[Rank 0]", "[Rank " + "9" * 5000 + "]")],
    "oom": [OOM_LINE.replace("2.00", "9" * 400), OOM_LINE.replace("2.00", "1.2.3"), OOM_LINE.replace("GPU 0", "GPU " + "9" * 5000),
            "[memguard] rank " + "9" * 5000 + " (pp0) ran out of GPU memory\n"],
}


class CaseTimeout(BaseException):  # (not an Exception: no except clause of memguard swallows it)
    pass


@dataclass
class Outcome:
    argv: list[str]
    code: object = None
    out: str = ""
    err: str = ""
    cpu: float = 0.0
    wall: float = 0.0
    error: str = ""              # an exception that escaped main(), with its traceback
    where: str = ""              # memguard's innermost frame when it escaped (or the run was stopped)
    timed_out: bool = False
    problems: list[str] = field(default_factory=list)
    note: str = ""               # what the fuzz case changed in its input files

    def describe(self) -> str:
        argv = " ".join(a if len(a) <= 80 else a[:40] + f"...({len(a)} chars)" for a in self.argv)
        note = f" [{self.note}]" if self.note else ""
        return f"memguard {argv}{note}: " + "; ".join(self.problems)


def run_memguard(argv: list[str], files: dict[str, str | bytes] | None = None, env: dict[str, str] | None = None,
                 wall_limit: int = 60, cpu_limit: float | None = None) -> Outcome:
    """Run ``memguard argv`` in-process in a fresh directory holding ``files``, with ``env`` added to the
    environment; a run longer than ``wall_limit`` seconds is stopped (SIGALRM). The outcome lists what
    breaks the promise: an exit code outside 0/1/2, a traceback or an internal error, an error line not
    starting with 'memguard' or longer than MAX_ERROR_LINE, more than ``cpu_limit`` seconds of CPU."""
    o = Outcome(argv=list(argv))
    old_cwd, old_env = os.getcwd(), dict(os.environ)
    out, err = io.StringIO(), io.StringIO()

    def alarm(signum, frame):
        o.timed_out = True   # (code that catches the exception, or fails while cleaning up, cannot hide the hang)
        raise CaseTimeout()

    with tempfile.TemporaryDirectory(prefix="memguard-fuzz-") as d:
        for name, content in (files or {}).items():
            mode = "wb" if isinstance(content, bytes) else "w"
            os.makedirs(os.path.dirname(os.path.join(d, name)), exist_ok=True)   # (run directories: 'a/x.jsonl')
            with open(os.path.join(d, name), mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as f:
                f.write(content)
        os.chdir(d)
        os.environ.update(env or {})
        prev = signal.signal(signal.SIGALRM, alarm)
        signal.alarm(wall_limit)
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                o.code = main(list(argv))
        except SystemExit as e:      # argparse usage errors (exit 2) and --help (0)
            o.code = 0 if e.code is None else e.code
        except CaseTimeout as e:
            o.error, o.where = _trace(e)
        except BaseException as e:  # noqa: BLE001 - the point is to catch anything that escapes
            o.error, o.where = _trace(e)
        finally:
            signal.alarm(0)
            o.wall, o.cpu = time.perf_counter() - t0, time.process_time() - c0
            signal.signal(signal.SIGALRM, prev)
            os.chdir(old_cwd)
            os.environ.clear()
            os.environ.update(old_env)
    o.out, o.err = out.getvalue(), err.getvalue()
    _judge(o, cpu_limit, wall_limit)
    return o


def _trace(e: BaseException) -> tuple[str, str]:
    """(the end of the traceback, where memguard's innermost frame was: ``file:line (function)``)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "megatron_memguard" in f.filename]
    where = ""
    if frames:
        f = frames[-1]
        where = f"{f.filename[f.filename.rindex('megatron_memguard'):]}:{f.lineno} ({f.name})"
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))[-3000:], where


def _judge(o: Outcome, cpu_limit: float | None, wall_limit: int) -> None:
    p = o.problems
    where = f" at {o.where}" if o.where else ""
    if o.timed_out:
        p.append(f"still running after {wall_limit} s (stopped{where})")
        return
    if o.error:
        p.append("exception escaped: " + o.error.strip().splitlines()[-1][:300] + where)
    if not o.timed_out and not o.error and o.code not in EXIT_CODES:
        p.append(f"exit code {o.code!r}")
    if "Traceback" in o.err or "Traceback" in o.out:
        p.append("a traceback in the output")
    if "internal error" in o.err:
        p.append("internal error: " + next(l for l in o.err.splitlines() if "internal error" in l)[:300])
    for line in o.err.splitlines():
        if line.strip() and not line.startswith("memguard"):
            p.append(f"stderr line not from memguard: {line[:120]!r}")
            break
        if len(line) > MAX_ERROR_LINE:
            p.append(f"stderr line of {len(line)} characters")
            break
    if cpu_limit is not None and o.cpu > cpu_limit:
        p.append(f"{o.cpu:.1f} s of CPU (limit {cpu_limit} s)")
