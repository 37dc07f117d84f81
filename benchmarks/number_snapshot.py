"""The yardstick of refactors: every number memguard prints, over a fixed corpus, as one JSON file.

A refactor must not change a number. This runs a fixed corpus through a given source tree and writes
what came out, so that two trees can be compared byte for byte:

    python benchmarks/number_snapshot.py --out /tmp/after.json                 # this tree
    python benchmarks/number_snapshot.py --src /tmp/main-src --out /tmp/before.json
    python benchmarks/number_snapshot.py --compare /tmp/before.json /tmp/after.json

``--src DIR`` names a directory that holds a ``megatron_memguard`` package (e.g. ``git archive main
megatron_memguard | tar -x -C DIR``). The corpus:
- every Megatron CI record of ../shared/groundtruth (dense and MoE, flagged ones too): the whole
  ``estimate --json`` document of the last DP rank, or the error;
- ``memguard estimate --json`` of every example and every shared config memguard reads, and of the
  bundled model presets on 8 and 64 GPUs;
- a deterministic grid of about 400 Megatron flag sets over the layout corners (TP, PP, VPP, uneven
  stages, CP, DP 1, recompute variants, precisions, MLA, GQA, tied/untied, fusions);
- ``memguard plan --json`` for three models, ``validate --json`` on the shared NeMo/Bridge configs.
Each case records its exit code, stdout and stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import gzip
import io
import itertools
import json
import os
import random
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.append(ROOT)
from benchmarks.shared_data import CONFIGS, DENSE_RECORDS, MOE_RECORDS  # noqa: E402

MODELS = ["llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b"]


def _grid(n: int = 400) -> list[list[str]]:
    """Flag sets Megatron would start (TP divides heads and groups, PP divides layers unless uneven)."""
    rng = random.Random(20261124)
    out = []
    for _ in range(n):
        tp = rng.choice([1, 2, 4, 8])
        pp = rng.choice([1, 1, 2, 4])
        cp = rng.choice([1, 1, 2, 4])
        dp = rng.choice([1, 2, 4])
        layers = pp * rng.choice([1, 2, 4])
        heads, groups = rng.choice([(8, None), (16, 4), (32, 8), (16, 16)])
        mla = rng.random() < 0.12
        mbs = rng.choice([1, 2, 4])
        m = rng.choice([1, 2, 4, 8])
        seq = rng.choice([256, 1024, 4096]) * max(1, cp)
        hidden = 64 * heads
        f = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
             "--ffn-hidden-size", str(rng.choice([4 * hidden, 3 * hidden + 64])), "--seq-length", str(seq),
             "--max-position-embeddings", str(seq), "--micro-batch-size", str(mbs),
             "--global-batch-size", str(mbs * m * dp), "--tensor-model-parallel-size", str(tp),
             "--pipeline-model-parallel-size", str(pp), "--context-parallel-size", str(cp),
             "--vocab-size", str(rng.choice([32000, 50257, 128256])), "--tokenizer-type", "NullTokenizer"]
        if groups and not mla:
            f += ["--group-query-attention", "--num-query-groups", str(groups)]
        if tp > 1 and rng.random() < 0.8:
            f += ["--sequence-parallel"]
        dist = rng.random() < 0.7
        if dist:
            f += ["--use-distributed-optimizer"]
        f += rng.choice([["--bf16"], ["--bf16"], ["--fp16"], []])
        f += rng.choice([[], ["--swiglu"], ["--swiglu", "--normalization", "RMSNorm"]])
        if rng.random() < 0.5:
            f += ["--position-embedding-type", "rope"]
        if rng.random() < 0.5:
            f += ["--untie-embeddings-and-output-weights"]
        if pp > 1 and layers >= 2 * pp and rng.random() < 0.4:
            f += ["--num-layers-per-virtual-pipeline-stage", "1"]
            m = pp * rng.choice([1, 2])   # the interleaved schedule needs a multiple of PP micro-batches
            i = f.index("--global-batch-size")
            f[i + 1] = str(mbs * m * dp)
        r = rng.random()
        if r < 0.15:
            f += ["--recompute-granularity", "full", "--recompute-method", rng.choice(["uniform", "block"]),
                  "--recompute-num-layers", "1"]
        elif r < 0.3:
            f += ["--recompute-granularity", "selective"]
        elif r < 0.4:
            f += ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp", "layernorm"]
        if cp == 1 and not mla and rng.random() < 0.3:
            f += ["--transformer-impl", "local"]
        if rng.random() < 0.3:
            f += ["--cross-entropy-loss-fusion"]
        if dist and rng.random() < 0.3:
            f += ["--overlap-grad-reduce", "--overlap-param-gather"]
        if mla:
            f += ["--multi-latent-attention", "--kv-lora-rank", "64", "--qk-head-dim", "32",
                  "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32", "--rope-type", "yarn"]
            if rng.random() < 0.5:
                f += ["--q-lora-rank", "128"]
        world = tp * pp * cp * dp
        out.append(["estimate", "--json", "--world-size", str(world), "--gpu",
                    rng.choice(["H100-80GB", "A100-40GB", "GB200"]), "--dp-rank", rng.choice(["0", "last", "max"]),
                    "--"] + f)
    return out


def _cli_cases() -> list[tuple[str, list[str]]]:
    cases: list[tuple[str, list[str]]] = []
    for path in sorted(glob.glob(os.path.join(ROOT, "examples", "**", "*"), recursive=True)):
        if os.path.isfile(path) and path.endswith((".sh", ".yaml", ".yml", ".sbatch")):
            cases.append((f"example:{os.path.relpath(path, ROOT)}", ["estimate", "--json", "--config", path]))
    for path in sorted(glob.glob(os.path.join(CONFIGS, "**", "*"), recursive=True)):
        if os.path.isfile(path) and path.endswith((".sh", ".yaml", ".yml")):
            rel = os.path.relpath(path, CONFIGS)
            cases.append((f"config:{rel}", ["estimate", "--json", "--config", path]))
            cases.append((f"config64:{rel}", ["estimate", "--json", "--gpus", "64", "--config", path]))
            if path.endswith((".yaml", ".yml")):
                cases.append((f"validate:{rel}", ["validate", "--json", path]))
    for model in MODELS:
        for gpus in ("8", "64"):
            cases.append((f"model:{model}:{gpus}", ["estimate", "--json", "--model", model, "--gpus", gpus, "--",
                                                      "--micro-batch-size", "1", "--global-batch-size", "512",
                                                      "--seq-length", "4096", "--bf16", "--use-distributed-optimizer",
                                                      "--tensor-model-parallel-size", "4" if gpus == "64" else "2"]))
        cases.append((f"plan:{model}", ["plan", "--json", "--gpus", "64", "--seq-length", "4096",
                                        "--global-batch-size", "512", "--model", model]))
    for i, argv in enumerate(_grid()):
        cases.append((f"grid:{i:03d}", argv))
        if i < 60:   # the text report (--detail) too, for a part of the grid
            cases.append((f"grid-text:{i:03d}", [a for a in argv if a != "--json"][:1] + ["--detail"]
                          + [a for a in argv if a != "--json"][1:]))
    return cases


def _untimed(text: str) -> str:
    """The planner prints how long it searched: the one figure that differs between identical runs."""
    return re.sub(r'"seconds": [0-9.e-]+', '"seconds": "-"', text)


def _run_cli(main, argv: list[str]) -> dict:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        except Exception as e:  # a traceback is a result too: record it
            code = f"exception {type(e).__name__}: {e}"
    return {"exit": code, "stdout": _untimed(out.getvalue()), "stderr": err.getvalue()}


def _records() -> list[tuple[str, dict]]:
    from benchmarks.accuracy_megatron_ci import PLATFORM_GPU, record_raw
    from megatron_memguard.errors import MemguardError
    from megatron_memguard.estimator.core import estimate
    from megatron_memguard.gpus import lookup_gpu
    from megatron_memguard.resolve import resolve
    out = []
    for path in (DENSE_RECORDS, MOE_RECORDS):
        with open(path) as fh:
            for line in fh:
                r = json.loads(line)
                if r.get("category") != "training" or r.get("world_size") is None:
                    continue
                try:
                    layout = resolve(record_raw(r))
                    est = estimate(layout, gpu=lookup_gpu(PLATFORM_GPU.get(r["platform"], "H100-80GB")),
                                   dp_rank="last")
                    res = {"estimate": est.to_dict()}
                except MemguardError as e:
                    res = {"error": str(e)}
                out.append((f"record:{os.path.basename(path)}:{r['id']}", res))
    return out


def snapshot() -> dict:
    """Run the corpus in this process (sys.path decides which megatron_memguard is used)."""
    import megatron_memguard
    from megatron_memguard.cli.main import main
    result = {"_source": os.path.dirname(megatron_memguard.__file__)}
    for name, res in _records():
        result[name] = res
    for name, argv in _cli_cases():
        result[name] = _run_cli(main, argv)
    return result


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.load(gzip.open(p, "rt")) if p.endswith(".gz") else json.load(open(p)) for p in (a_path, b_path))
    a.pop("_source", None)
    b.pop("_source", None)
    keys = sorted(set(a) | set(b))
    diff = [k for k in keys if a.get(k) != b.get(k)]
    errors = sum(1 for k in keys if isinstance(b.get(k), dict) and ("error" in b[k] or b[k].get("exit") not in (0, None)))
    print(f"{len(keys)} cases, {len(keys) - len(diff)} identical, {len(diff)} differ "
          f"({errors} cases end in an error or non-zero exit in both or either)")
    for k in diff[:30]:
        print(f"  differs: {k}")
    return 1 if diff else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", help="directory holding the megatron_memguard package to measure (default: this tree)")
    p.add_argument("--out", help="where to write the snapshot (.json or .json.gz)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two snapshots; exit 1 when any case differs")
    ns = p.parse_args(argv)
    if ns.compare:
        return compare(*ns.compare)
    if not ns.out:
        p.error("--out is required unless --compare is given")
    if ns.src:
        # a fresh interpreter, so that only the chosen tree's package is imported
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(ns.src), ROOT]))
        code = ("import sys; sys.path.insert(0, %r); sys.path.insert(1, %r); from benchmarks import number_snapshot as n; "
                "n._write(n.snapshot(), %r)" % (os.path.abspath(ns.src), ROOT, ns.out))
        return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT).returncode
    _write(snapshot(), ns.out)
    return 0


def _write(result: dict, path: str) -> None:
    text = json.dumps(result, indent=1, sort_keys=True)
    if path.endswith(".gz"):
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        with open(path, "w") as fh:
            fh.write(text)
    print(f"{len(result) - 1} cases from {result['_source']} -> {path}")


if __name__ == "__main__":
    sys.exit(main())
