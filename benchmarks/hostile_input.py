"""Does every command finish within 2 s on any input under 1 MB? (issue 14)

    python benchmarks/hostile_input.py            # the whole corpus (a few thousand runs, minutes)
    python benchmarks/hostile_input.py --quick    # every tenth case
    python benchmarks/hostile_input.py --group newest   # one group (reproductions, flags, ..., hostile17, hostile18, hostile19, hostile20, hostile21)
    python benchmarks/hostile_input.py --big      # also time 10**6-line logs (130 MB and 390 MB files)

Also: real inputs mutated by structure (tests/mutate_util.py: ten mutants of every config, script, log and
command line) and the Megatron hook's validate_args on mutated namespaces (600; 60 with --quick).

Runs ``memguard`` in-process over a corpus of hostile inputs, every one under 1 MB: issue 14's
thirteen reproductions; every numeric Megatron flag with every hostile value of tests/fuzz_util.py
(inf, nan, 1e400, 5000 digits, 300,000 characters, ...); every config seed (NeMo 1, NeMo launcher,
Megatron functional-test, Bridge, NeMo 2, Hugging Face) with every hostile YAML value (nesting,
alias bombs, huge numbers) at its shape keys; every hostile shell line in a launch script; every
hostile JSON value in every run-log field; the largest inputs memguard accepts (1 MB files,
10,000 YAML values, 2**20 GPUs, 500,000 expert weights per rank, 100 MTP depths); and MoE / MTP /
TP-overlap inputs (--moe-layer-freq and --tp-comm-overlap-cfg bombs); hostile files at every path
argument (a named pipe nobody writes to, /dev/zero, a directory, a symlink loop, UTF-16); Megatron logs
of 7,000 ranks, an out-of-memory flood and numbers no GPU prints; every field of the MoE config.json files,
Megatron logs with colour codes / NULs / garbage / cuts, and plan over extreme spaces (issue hostile3); odd
--megatron-version values, DDP's fp32 accumulation pattern bombs, JSON objects at MoE config.json fields, every
Bridge model field set to a mapping or a word, argument-table lines of 64 KiB, plan --top 10**9 (issue hostile4);
hybrid Mamba patterns, Nemotron-H recipe fields, MTP stages, latent MoE / capacity / upcycling sizes (issue hostile5);
hybrid MTP patterns, Bridge PEFT keys, heterogeneous block configs, MoE values, '???' / null outside Bridge's model section,
at --yaml-cfg's top level and in NeMo 1 / NeMo 2's trainer, strategy, data, precision and optimizer sections, adversarial Megatron logs, plan over 10**18 GPUs (issue hostile8, the hostile9 round; --big
adds 100 MB logs); NeMo 2 / Bridge PEFT, run_recipe.py modes, '*' target patterns, CP communication types, attention
backends, heterogeneous MoE / MTP configs, module lists, emerging-optimizer values, plan's cluster speeds and NeMo 1
optimizer nulls, plus (hook10) hostile namespaces through the hook and garbage memory sources through the runtime monitor
(issue hostile10); DSA / GDN / eval-step flags, hybrid D / G / + patterns, heterogeneous JSON, NeMo 1 LoRA, FP8 / FP4 names,
deepseek_v32 / qwen3_next config.json, calibrate on hostile Megatron logs, plan bounds and MEMGUARD_* variables (issue
hostile11); BOM'd heterogeneous JSON, HF numbers as strings, eval flags with PP / VPP, --save, Bridge CUDA graph /
comm_overlap overrides, NCCL / cuBLAS environment, output pipes and plan of GDN models (issue hostile12); plan of GDN
models with --explain / --rule / --top, eval / save / rerun flags, Bridge bool fields and overrides, calibrate on damaged
Megatron logs and every subcommand's file arguments (issue hostile13); the paged stash and rank capacity, FSDP with the
EP overlap, Bridge offload fractions, FP8 attention CP types, eval counts, YAML keys that are not names and structure
in every reader, launch-script arrays / appends / heredocs / 470,000 words, plan over 720,720 GPUs and hook values
that are numpy scalars or tensors (issue hostile14); launch-script positional parameters, functions, eval, slices,
lengths and arithmetic, MoE-only flags on dense models and Bridge bool fields given any value (issue hostile15); bash's
pattern / case / indirection operators and command substitutions, NeMo 1 / Bridge YAML with nesting, alias bombs, NaN /
inf, BOM, CRLF, tabs and look-alike keys, unicode dashes in flags and plan's options (issue hostile16); named pipes, 2 GiB sparse
files, UTF-16 / UTF-32 / Latin-1 files at every config, log and profile argument and MEMGUARD_PROFILE, calibrate on hostile
iteration and memory lines, site profiles with hostile time constants, schemas and GPUs in every command, damaged runtime
JSONL, plan --explain with other options, NeMo / Bridge overrides holding command substitutions and MEMGUARD_* variables
(issue hostile17); memguard plan on 8 and 64 GPUs with hostile --tp-comm-overlap-cfg and
--heterogeneous-layers-config-path files, which every candidate layout resolves (issue hostile18); 950 kB lines of braced defaults,
substitutions and arithmetic, calibrate over many or repeated runs and extreme step times, plan's option lists of
1,024 values, plan of 10,000-layer hybrid models, interleaved runtime JSONL and YAML merge keys (issue hostile19); calibrate over 40-290 runs, a partial last group at VPP 1,250 and plan --top 50 of 10,000 layers (issue hostile20); plan --explain / --rule values, site profiles' time constants, step times of 0 ms, JSONL iterations out of order, 10**12-value alias bombs, MEMGUARD_TE_VERSION garbage and calibrate --name (issue hostile21). Prints, per command, the number of runs, how many broke the
promise (exit code outside 0/1/2, a traceback, an unreadable error line), and the worst CPU and
wall time with the input that took it. CPU time is the target's measure (the machines these run on
are shared); a new interpreter adds its start-up (benchmarks/cold_start.py) on top.
"""
from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from benchmarks.shared_data import SHARED  # noqa: E402
from fuzz_util import (  # noqa: E402
    HYBRID, HYBRID_PATTERNS, JSON_VALUES, LAUNCH, LEAVES, MTP_LAYOUTS, NUMBERS, NUMBER_CLASSES, NUMERIC_FLAGS, RUNLOG,
    RUNLOG_FIELDS, SENTINEL, SHELL_LINES, SMALL, TEXTS, YAML_SEEDS, YAML_VALUES, alias_bomb, run_memguard, with_values,
)

TARGET = 2.0          # seconds per command (CPU)
LIMIT = 1_000_000     # bytes: the inputs stay under this
S = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
     "--micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 1000 --bf16").split()
PLAN = ["plan", "--gpus", "8", "--seq-length", "512", "--global-batch-size", "64"]


# A NeMo 2 --to-yaml export with every non-model section the reader takes (NeMo 2.5.0 class paths).
_NEMO2 = """_target_: nemo.collections.llm.api.pretrain
model:
  _target_: nemo.collections.llm.gpt.model.base.GPTModel
  config: {_target_: nemo.collections.llm.gpt.model.base.GPTConfig, num_layers: 4, hidden_size: 512,
           num_attention_heads: 8, seq_length: 1024, vocab_size: 32000}
trainer:
  _target_: nemo.lightning.pytorch.trainer.Trainer
  devices: 8
  num_nodes: 1
  strategy: {_target_: nemo.lightning.pytorch.strategies.megatron_strategy.MegatronStrategy, tensor_model_parallel_size: 2,
             sequence_parallel: true, ddp: {use_distributed_optimizer: true, grad_reduce_in_fp32: true}}
  plugins: {_target_: nemo.lightning.pytorch.plugins.mixed_precision.MegatronMixedPrecision, precision: bf16-mixed}
data: {_target_: nemo.collections.llm.gpt.data.mock.MockDataModule, micro_batch_size: 1, global_batch_size: 8, seq_length: 1024}
optim: {config: {optimizer: adam, use_distributed_optimizer: true}}
"""


def _nemo(value: str) -> str:
    text = dict((n, t) for n, t, _ in YAML_SEEDS)["nemo1_llama.yaml"]
    return text.replace("  num_layers: 32 ", f"  num_layers: {value} ", 1)


def reproductions():
    """Issue 14's thirteen reproductions (tests/test_hostile_input.py asserts their output)."""
    digits = "1" * 5000
    start = json.dumps({"schema": "memguard.runtime/1", "event": "start", "rank": 0})
    warning = json.dumps({"schema": "memguard.runtime/1", "event": "warning", "rank": 0, "iteration": 1,
                          "actual_bytes": 1, "predicted_bytes": 100}).replace('"actual_bytes": 1', '"actual_bytes": 1' + "0" * 400)
    script = "A='$A$A'\n" + "A=$A$A\n" * 20 + "torchrun --nproc-per-node 8 pretrain_gpt.py " + " ".join(S) + \
        ' --save-interval 100 --save "$A"\n'   # (validate_args asserts an interval with --save, core >= 0.17)
    nemo_llama = os.path.join(SHARED, "configs", "nemo1", "megatron_llama_config.yaml")
    yield "1 --num-layers inf", ["estimate", "--world-size", "1", "--", *S, "--num-layers", "inf"], {}
    yield "1 --num-layers 5000 digits", ["estimate", "--world-size", "1", "--", *S, "--num-layers", digits], {}
    yield "1 validate 1e309", ["validate", "--world-size", "1", "--", *S, "--num-layers", "1e309"], {}
    yield "1 check nan", ["check", "--", "torchrun", "pretrain_gpt.py", *S, "--num-layers", "nan"], {}
    yield "1 plan inf", [*PLAN, "--", *S, "--num-layers", "inf"], {}
    yield "2 --gpu-memory 1e400", ["estimate", "--world-size", "8", "--gpu-memory", "1e400", "--", *S], {}
    yield "2 --memguard-gpu-memory 1e400GiB", ["check", "--", "torchrun", "--nproc-per-node", "8", "pretrain_gpt.py", *S,
                                               "--memguard-gpu-memory", "1e400GiB"], {}
    yield "3 --num-layers 1e30", ["estimate", "--world-size", "1", "--", *S, "--num-layers", "1e30"], {}
    yield "4 NeMo num_layers: .inf", ["validate", "c.yaml"], {"c.yaml": _nemo(".inf")}
    yield "5 100,000 [", ["estimate", "--config", "d.yaml"], {"d.yaml": "[" * 100_000}
    yield "6 run log 100,000 [", ["report", "."], {"memguard-rank00000.jsonl": "[" * 100_000 + "\n"}
    yield "6 run log 5000 digits", ["report", "."], {"memguard-rank00000.jsonl": start.replace("0}", digits + "}")}
    yield "7 actual_bytes 1e400", ["report", "."], {"memguard-rank00000.jsonl": start + "\n" + warning + "\n"}
    yield "8 --set 5000 digits", ["estimate", "--model", "llama32_1b", "--gpus", "8", "--set", f"model.num_layers={digits}"], {}
    yield "9 oc.decode", ["validate", "c.yaml"], {"c.yaml": _nemo("\"${oc.decode:'[1,2]'}\"")}
    yield "10 model=3", ["validate", nemo_llama, "model=3"], {}
    yield "11 GBS 1e30", ["plan", "--gpus", "8", "--seq-length", "4096", "--global-batch-size", "1" + "0" * 30,
                          "--model", "llama-3.2-1b"], {}
    yield "11 GBS 2**31-1, 2**20 GPUs", ["plan", "--gpus", "1048576", "--seq-length", "4096", "--global-batch-size",
                                         "2147483647", "--model", "llama-3.2-1b"], {}
    yield "12 A='$A$A' x 20", ["check", "--file", "s.sh"], {"s.sh": script}
    yield "13 alias bomb, 4 levels", ["validate", "c.yaml"], {"c.yaml": _nemo(alias_bomb(4))}
    yield "13 alias bomb, 5 levels", ["validate", "c.yaml"], {"c.yaml": _nemo(alias_bomb(5))}
    yield "no command", [], {}


def flag_cases():
    for flag in NUMERIC_FLAGS:
        for v in NUMBERS + TEXTS:
            yield f"estimate {flag} {v!r}", ["estimate", "--world-size", "8", "--", *SMALL, flag, v], {}
    for flag in ("--num-layers", "--pipeline-model-parallel-size", "--global-batch-size", "--seq-length",
                 "--microbatch-group-size-per-vp-stage", "--pipeline-model-parallel-layout", "--micro-batch-size"):
        for v in NUMBERS + TEXTS:
            yield f"validate {flag} {v!r}", ["validate", "--world-size", "8", "--", *SMALL, flag, v], {}
            yield f"plan {flag} {v!r}", [*PLAN, "--", *SMALL, flag, v], {}
            yield f"check {flag} {v!r}", ["check", "--", "torchrun", "--nproc-per-node", "8", "pretrain_gpt.py", *SMALL,
                                          flag, v], {}
    for opt in ("--gpus", "--seq-length", "--global-batch-size", "--tp", "--pp", "--mbs", "--explain", "--top",
                "--gpu-memory", "--threshold"):
        for v in NUMBERS + TEXTS:
            argv = [*PLAN, "--model", "llama-3.2-1b"]
            if opt in argv:
                argv[argv.index(opt) + 1] = v
            else:
                argv += [opt, v]
            yield f"plan {opt} {v!r}", argv, {}


def config_cases():
    shape_keys = ("num_layers", "num_hidden_layers", "hidden_size", "global_batch_size", "micro_batch_size", "devices",
                  "tensor_model_parallel_size", "pipeline_model_parallel_size", "--num-layers", "seq_length")
    for name, text, opts in YAML_SEEDS:
        paths = [p for p in LEAVES[name] if str(p[-1]) in shape_keys][:4] or LEAVES[name][:2]
        raws = JSON_VALUES if name.endswith(".json") else YAML_VALUES
        own = opts[:opts.index("--")] if "--" in opts else list(opts)
        flags = opts[opts.index("--"):] if "--" in opts else []
        for path in paths:
            for raw in raws:
                files = {name: with_values(text, name, [(path, raw)])}
                yield f"validate {name} {'.'.join(map(str, path))}={raw!r}", ["validate", name, *own, *flags], files
                yield f"estimate {name} {'.'.join(map(str, path))}={raw!r}", ["estimate", "--config", name, *own, *flags], files
        if not name.endswith(".json"):
            for raw in YAML_VALUES:
                key = ".".join(map(str, paths[0]))
                yield f"estimate {name} --set {key}={raw!r}", ["estimate", "--config", name, "--set", f"{key}={raw}", *own,
                                                              *flags], {name: text}


def launch_cases():
    for line in SHELL_LINES:
        script = LAUNCH.replace("export CUDA", line + "export CUDA", 1)
        if line.startswith("A='$A$A'"):
            script = script.replace('--save "/ckpt/run 1"', '--save "$A" $OPTS')
        yield f"check line {line!r}", ["check", "--file", "run.sh"], {"run.sh": script}
        yield f"estimate line {line!r}", ["estimate", "--config", "run.sh"], {"run.sh": script}


def runlog_cases():
    for i, key in RUNLOG_FIELDS:
        for raw in JSON_VALUES:
            records = json.loads(json.dumps(RUNLOG))
            node, leaf = (records[i][key[0]], key[1]) if isinstance(key, tuple) else (records[i], key)
            node[leaf] = SENTINEL
            text = "\n".join(json.dumps(r) for r in records).replace(f'"{SENTINEL}"', raw)
            yield f"report {i}.{key}={raw!r}", ["report", ".", "--skip-bad-lines"], {"memguard-rank00000.jsonl": text}


def largest_cases():
    """The largest inputs memguard accepts, each just under 1 MB."""
    blend = ",".join(["x"] * 9_000)  # ~9,000 values: under the 10,000-value limit
    nemo = _nemo("4\n  data_blend: [" + blend + "]")
    yield "validate NeMo with 9,000 values", ["validate", "c.yaml", "--gpus", "8", "--vocab-size", "32000"], {"c.yaml": nemo}
    comments = "# " + "x" * 78 + "\n"
    script = comments * (950_000 // len(comments)) + LAUNCH
    yield "check 950 kB script", ["check", "--file", "run.sh"], {"run.sh": script}
    yield "check 950 kB of $(", ["check", "--file", "run.sh"], {"run.sh": LAUNCH + "$(" * 475_000 + "\n"}
    yield "check 950 kB of ${A:-", ["check", "--file", "run.sh"], {"run.sh": LAUNCH + "${A:-x}" * 135_000 + "\n"}
    yield "estimate 950 kB --save value", ["estimate", "--world-size", "8", "--", *SMALL, "--save-interval", "1", "--save",
                                            "x" * 950_000], {}
    sample = json.dumps(RUNLOG[1])
    log = "\n".join([json.dumps(RUNLOG[0])] + [sample.replace('"iteration": 10', f'"iteration": {10 * k}')
                                              for k in range(1, 950_000 // len(sample))])
    yield "report 950 kB run log", ["report", "."], {"memguard-rank00000.jsonl": log}
    hf = json.loads(dict((n, t) for n, t, _ in YAML_SEEDS)["config.json"])
    hf["padding"] = "x" * 950_000
    yield "estimate 950 kB config.json", ["estimate", "--config", "config.json", "--gpus", "8", "--", "--micro-batch-size",
                                         "1"], {"config.json": json.dumps(hf)}
    yield "plan 2**20 GPUs", ["plan", "--gpus", "1048576", "--seq-length", "8192", "--global-batch-size", "1048576",
                              "--model", "llama3.1-70b"], {}
    yield "estimate 10,000 layers PP 1024", ["estimate", "--world-size", "1024", "--", *S, "--num-layers", "10000",
                                             "--pipeline-model-parallel-size", "1024", "--global-batch-size", "1024"], {}


MOE = [*SMALL, "--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--sequence-parallel",
       "--position-embedding-type", "rope"]


def feature_cases():
    """Mixture of experts, MTP and TP-overlap inputs: the largest memguard accepts (500,000 expert weights
    per rank, 100 MTP depths) and hostile ones (list-expression and YAML bombs)."""
    big = [*S, "--num-layers", "250", "--num-experts", "1000", "--moe-router-topk", "2", "--disable-bias-linear",
           "--global-batch-size", "8"]
    yield "estimate 250 layers x 1,000 experts (the bound)", ["estimate", "--world-size", "8", "--", *big], {}
    yield "plan 250 layers x 1,000 experts (the bound)", [*PLAN, "--", *big], {}
    mtp = [*MOE, "--num-experts", "256", "--disable-bias-linear", "--mtp-num-layers", "100"]
    yield "estimate MoE with 100 MTP depths", ["estimate", "--world-size", "8", "--", *mtp], {}
    yield "plan MoE with 100 MTP depths", [*PLAN, "--", *mtp], {}
    yield "plan --mtp-num-layers 10000", [*PLAN, "--", *MOE, "--mtp-num-layers", "10000"], {}
    yield "estimate 10,000 layers x 65,536 experts", ["estimate", "--world-size", "8", "--", *SMALL, "--num-layers", "10000",
                                                      "--num-experts", "65536", "--moe-router-topk", "2", "--sequence-parallel"], {}
    for expr in ["+".join(["[1]*99999"] * 900), "(" * 3000 + "[1]" + ")" * 3000, "[1]*" + "9" * 400, "[1]" + "*2" * 60]:
        yield f"estimate --moe-layer-freq {expr[:30]!r}", ["estimate", "--world-size", "8", "--", *MOE, "--moe-layer-freq", expr], {}
    ub = {"alias bomb": f"qkv_fprop: {alias_bomb(6, 6)}\n", "30,000 GEMMs": "".join(f"k{i}: {{method: ring_exchange}}\n"
                                                                                    for i in range(30_000)),
          "100,000 [": "[" * 100_000 + "\n"}
    for label, text in ub.items():
        yield f"estimate --tp-comm-overlap-cfg {label}", ["estimate", "--world-size", "8", "--", *MOE, "--tp-comm-overlap",
                                                          "--tp-comm-overlap-cfg", "ub.yaml"], {"ub.yaml": text}


def hybrid_cases():
    """Issue hostile5: hybrid Mamba patterns of every class (separators, odd symbols, 10**5 symbols) with PP / VPP /
    layouts, Mamba sizes, the nemotronh_8b recipe's fields with --set, plan of hybrid models over 10**6 GPUs, MTP on its
    own stage ('m' anywhere, 10**5 of them), latent MoE / capacity factor / upcycling sizes, empty --gpu, and the log of
    a run launched with the deprecated --hybrid-override-pattern."""
    values = [v for vs in HYBRID_PATTERNS.values() for v in vs]
    for v in values:
        for more in ([], ["--pipeline-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "4", "--num-layers", "3"]):
            yield f"estimate --hybrid-layer-pattern {v[:20]!r} {more[:1]}", [
                "estimate", "--world-size", "8", "--", *HYBRID, "--hybrid-layer-pattern", v, *more], {}
        yield f"plan --hybrid-layer-pattern {v[:20]!r}", ["plan", "--gpus", "1000000", "--seq-length", "128",
                                                          "--global-batch-size", "1024", "--", *HYBRID, "--hybrid-layer-pattern", v], {}
        yield f"estimate nemotronh_8b pattern={v[:20]!r}", ["estimate", "--model", "nemotronh_8b", "--gpus", "8", "--set",
                                                            f"model.hybrid_layer_pattern={v}"], {}
    numbers = [v for vs in NUMBER_CLASSES.values() for v in vs]
    for flag in ("--mamba-state-dim", "--mamba-head-dim", "--mamba-num-groups", "--mamba-num-heads"):
        for v in numbers:
            yield f"estimate {flag} {v[:20]!r}", ["estimate", "--world-size", "8", "--", *HYBRID, "--hybrid-layer-pattern",
                                                  "M*M-", "--tensor-model-parallel-size", "2", flag, v], {}
    for key in ("model.mamba_chunk_size", "model.num_layers", "model.virtual_pipeline_model_parallel_size", "peft"):
        for v in ["0", "''", "null", "|", "-1", "1e400", "lora", "3"]:
            yield f"estimate nemotronh_8b {key}={v}", ["estimate", "--model", "nemotronh_8b", "--gpus", "8", "--set",
                                                       f"{key}={v}"], {}
    yield "plan nemotronh_8b on 10**6 GPUs", ["plan", "--model", "nemotronh_8b", "--gpus", "1000000", "--seq-length", "8192",
                                             "--global-batch-size", "1048576", "--vpp", "1,2,4,8"], {}
    mtp = SMALL[:SMALL.index("--tensor-model-parallel-size")]
    for v in [v for vs in MTP_LAYOUTS.values() for v in vs]:
        for pp, depth in (("2", "1"), ("4", "2")):
            yield f"estimate layout {v[:20]!r} PP {pp} MTP {depth}", [
                "estimate", "--world-size", "8", "--", *mtp, "--pipeline-model-parallel-size", pp, "--mtp-num-layers", depth,
                "--pipeline-model-parallel-layout", v], {}
    for flag in ("--moe-latent-size", "--moe-expert-capacity-factor", "--moe-upcycling-granularity"):
        for v in numbers:
            for dispatcher in ("alltoall", "allgather", "flex"):
                yield f"estimate {flag} {v[:20]!r} {dispatcher}", [
                    "estimate", "--world-size", "8", "--", *MOE, "--moe-token-dispatcher-type", dispatcher, flag, v], {}
    for option in ("--gpu", "--gpu-memory"):
        yield f"estimate {option} ''", ["estimate", "--world-size", "8", option, "", "--", *SMALL], {}
    from megatron_logs import args_of, print_args, report_memory
    args = args_of(HYBRID + ["--hybrid-layer-pattern", "M*M-"], 8)
    args.update(num_layers=4, hybrid_override_pattern="M*M-")
    log = "\n".join(print_args(args) + [report_memory(0, "(after 10 iterations)", 2**30, 2**31, 2**31, 2**31)]) + "\n"
    yield "report log of a --hybrid-override-pattern run", ["report", "run.log"], {"run.log": log}
    yield "calibrate log of a --hybrid-override-pattern run", ["calibrate", "run.log", "run.log"], {"run.log": log}


def newest_cases():
    """Issue hostile8 (the hostile9 round): hybrid MTP patterns ('/' depths, the legacy --mtp-hybrid-override-pattern,
    100,000-symbol depths), Megatron-Bridge PEFT keys on a scheme name (every LoRA / DoRA field with words, lists,
    negative, huge and null values; 50,000-entry target lists), heterogeneous block configs (wrong types, missing keys,
    15,000 blocks, NaN / Infinity / 5000-digit tokens), MoE flags and Bridge keys with strings / lists / negative / huge
    values, '???' and null in every Bridge section memguard reads and at --yaml-cfg's top level, adversarial Megatron
    logs (10,000 argument tables, a memory line per iteration of 10,000 ranks, 1 MB lines), and plan over 10**6 and
    10**18 GPUs with 10**9 layers, 10**9 hidden size or 10**6 experts."""
    import copy

    from test_readers_bridge import FLAT
    values = ["x", "[1,2]", "-1", "0", "1e400", "9" * 30, "1.5", "", "null", "true", "{a: 1}", "nan", "'???'"]
    for pat in ("M*M-/MM", "M*M-/MM/MM", "M*M-/MM/M*", "M*M-/" + "MM/" * 1000, "M*M-/" + "M" * 99_000,
                "M*M-" + "/" * 99_000, "M*M-/MM|", "M*M-/E", "M*M-//MM", "/MM", "M*M-" + ("/" + "M" * 999) * 20):
        for more in ([], ["--mtp-num-layers", "2"], ["--pipeline-model-parallel-size", "2"],
                     ["--mtp-hybrid-override-pattern", "MM", "--mtp-num-layers", "3"]):
            yield f"estimate hybrid MTP {pat[:20]!r} {more[:1]}", ["estimate", "--world-size", "8", "--", *HYBRID,
                                                                   "--hybrid-layer-pattern", pat, *more], {}
        yield f"estimate nemotronh_8b MTP pattern {pat[:20]!r}", ["estimate", "--model", "nemotronh_8b", "--gpus", "8", "--set",
                                                                  f"model.hybrid_layer_pattern={pat}"], {}
    for v in ("MM", "M" * 99_000, "/", "x"):
        for depth in ("1", "100", "1000000000", "x"):
            yield f"estimate --mtp-hybrid-override-pattern {v[:10]!r} x {depth}", [
                "estimate", "--world-size", "8", "--", *HYBRID, "--hybrid-layer-pattern", "M*M-",
                "--mtp-hybrid-override-pattern", v, "--mtp-num-layers", depth], {}
    for key in ("dim", "alpha", "dropout", "dropout_position", "target_modules", "exclude_modules", "_target_",
                "a2a_experimental", "lora_dtype", "canonical_mapping"):
        for v in values + ["[]", "[x]", "linear_qkv", "[" + ",".join(["linear_qkv"] * 50_000) + "]", "os.system"]:
            for scheme in ("lora", "dora"):
                yield f"estimate peft={scheme} {key}={v[:20]}", ["estimate", "--config", "c.yaml", "--gpus", "8", "--set",
                                                                  f"peft={scheme}", "--set", f"peft.{key}={v}"], {"c.yaml": FLAT}
                if scheme == "lora":   # (a recipe's PEFT object takes +peft.FIELD overrides)
                    yield f"estimate llama32_1b_peft +peft.{key}={v[:20]}", [
                        "estimate", "--model", "llama32_1b_peft", "--gpus", "8", "--set", f"+peft.{key}={v}"], {}
    base = json.load(open(os.path.join(ROOT, "tests", "data", "heterogeneous", "small_blocks.json")))
    flags = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
             "--ffn-hidden-size 1024 --swiglu --normalization RMSNorm --position-embedding-type rope --use-rope-scaling "
             "--disable-bias-linear --seq-length 256 --max-position-embeddings 256 --micro-batch-size 2 --bf16 "
             "--tokenizer-type NullTokenizer --vocab-size 1024 --untie-embeddings-and-output-weights "
             "--global-batch-size 4").split()
    docs: dict[str, str] = {}
    for v in ({}, "x", 5, None, [], [None] * 4, [{}] * 4):
        docs[f"block_configs={json.dumps(v)[:16]}"] = json.dumps(dict(base, block_configs=v))
    small = {"attention": {"n_heads_in_group": 4}, "ffn": {"ffn_mult": 1}}   # (the shortest block: 15,000 under 1 MB)
    docs["15,000 blocks"] = json.dumps(dict(base, block_configs=[small] * 15_000, num_hidden_layers=15_000), separators=(",", ":"))
    docs["15,000 blocks, 4 layers"] = json.dumps(dict(base, block_configs=[small] * 15_000), separators=(",", ":"))
    for part, key in (("attention", "n_heads_in_group"), ("ffn", "ffn_mult"), ("attention", "no_op"),
                      ("ffn", "replace_with_linear"), ("attention", "num_query_groups"), ("ffn", "ffn_hidden_size")):
        for v in ("x", -1, 0, 10**30, True, None, [4], {"a": 1}, 1e-300):
            d = copy.deepcopy(base)
            for b in d["block_configs"]:
                b[part][key] = v
            docs[f"{part}.{key}={v!r}"] = json.dumps(d)
    for token in ("NaN", "Infinity", "-Infinity", "9" * 5000):
        docs[f"ffn_mult {token[:10]}"] = json.dumps(base).replace("2.625", token)
    docs["[ x 100,000"] = "[" * 100_000
    for label, text in docs.items():
        yield f"estimate heterogeneous {label}", ["estimate", "--world-size", "1", "--", *flags,
                                                  "--heterogeneous-layers-config-path", "h.json"], {"h.json": text}
    for flag in ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size",
                 "--moe-router-num-groups", "--moe-router-group-topk", "--moe-expert-capacity-factor", "--moe-layer-freq",
                 "--expert-tensor-parallel-size", "--moe-router-dtype", "--moe-token-dispatcher-type", "--moe-latent-size"):
        for v in values[:-1] + ["[2]*3", "-" + "9" * 20]:
            yield f"estimate {flag} {v[:20]!r}", ["estimate", "--world-size", "8", "--", *MOE, flag, v], {}
    for key in ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_token_dispatcher_type",
                "moe_router_dtype", "expert_model_parallel_size", "moe_shared_expert_intermediate_size", "mtp_num_layers"):
        for v in values + ["[2, 3]", "[" + ",".join(["1"] * 100_000) + "]"]:
            yield f"estimate qwen3_30b_a3b {key}={v[:20]}", ["estimate", "--model", "qwen3_30b_a3b", "--gpus", "64", "--set",
                                                             f"model.{key}={v}"], {}
    from megatron_memguard.readers._common import section_typed_field
    for sec, name in (("train", "micro_batch_size"), ("ddp", "num_distributed_optimizer_instances"), ("ddp", "bucket_size"),
                      ("optimizer", "optimizer"), ("mixed_precision", "grad_reduce_in_fp32"), ("dataset", "seq_length"),
                      ("tokenizer", "vocab_size"), ("scheduler", "lr_warmup_iters"), ("checkpoint", "save"), ("train", ""),
                      ("profiling", ""), ("logger", "")):
        assert sec == "train" or section_typed_field(sec, "") is not None
        key = f"{sec}.{name}" if name else sec
        for v in ("null", "'???'"):
            yield f"estimate llama32_1b {key}={v}", ["estimate", "--model", "llama32_1b", "--gpus", "8", "--set", f"{key}={v}"], {}
    yaml_cfg = open(os.path.join(ROOT, "tests", "data", "yaml_cfg", "gpt_small.yaml")).read()
    for key in ("optimizer", "micro_batch_size", "global_batch_size", "make_vocab_size_divisible_by", "log_interval",
                "use_distributed_optimizer", "seq_length"):
        for v in ("null", "'???'"):
            text = f"{key}: {v}\n" + "\n".join(x for x in yaml_cfg.splitlines() if not x.startswith(f"{key}:"))
            yield f"estimate --yaml-cfg {key}: {v}", ["estimate", "--world-size", "8", "--", "--yaml-cfg", "c.yaml"], {"c.yaml": text}
    # '???' and null in NeMo 1's and NeMo 2's non-model sections (issue nemonulls)
    nemo1 = dict((n, t) for n, t, _ in YAML_SEEDS)["nemo1_llama.yaml"]
    for key in ("trainer.devices", "trainer.num_nodes", "trainer.accumulate_grad_batches", "trainer.precision",
                "model.micro_batch_size", "model.global_batch_size", "model.optim", "model.optim.name",
                "model.optim.grad_sync_dtype", "model.data.seq_length"):
        # (the world size is the file's trainer.devices x num_nodes; grad_sync_dtype is read by mcore's optimizer)
        more = ["--set", "model.optim.name=mcore_distributed_optim"] if key.endswith("grad_sync_dtype") else []
        for v in ("null", "'???'"):
            yield f"estimate NeMo 1 {key}={v}", ["estimate", "--config", "c.yaml", "--vocab-size", "32000", *more,
                                                  "--set", f"{key}={v}"], {"c.yaml": nemo1}
    for key in ("trainer.devices", "trainer.num_nodes", "trainer.strategy.tensor_model_parallel_size",
                "trainer.strategy.sequence_parallel", "trainer.strategy.ddp.grad_reduce_in_fp32", "trainer.strategy.ddp",
                "trainer.plugins.precision", "trainer.plugins.grad_reduce_in_fp32", "data.micro_batch_size",
                "data.seq_length", "optim.config.optimizer", "optim.config.store_param_remainders",
                "optim.config.main_grads_dtype", "optim"):
        for v in ("null", "'???'"):
            yield f"estimate NeMo 2 {key}={v}", ["estimate", "--config", "c.yaml", "--set", f"{key}={v}"], {"c.yaml": _NEMO2}
    from megatron_logs import args_of, print_args, report_memory
    head = "\n".join(print_args(args_of(SMALL, 8))) + "\n"
    logs = {"10,000 argument tables": head * (900_000 // len(head)),
            "a line per iteration of 10,000 ranks": head + "\n".join(
                report_memory(r % 10_000, f"(after {r} iterations)", 2**30, 2**31, 2**31, 2**31) for r in range(6_000)),
            "1 MB lines": head + ("[Rank 0] (after 10 iterations) memory (MB) | allocated: " + "9" * 450_000 + "\n") * 2,
            "an argument table that never ends": head.split("\n")[0] + "\n" + "".join(
                f"  num_layers{i} {'.' * 36} {i}\n" for i in range(15_000))}
    for label, text in logs.items():
        for cmd in (["report", "run.log"], ["calibrate", "run.log", "run.log", "run.log"]):
            yield f"{cmd[0]} Megatron log, {label}", cmd, {"run.log": text}
    dense = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--max-position-embeddings", "4096",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000", "--bf16"]
    for gpus in ("1000000", str(10**18)):
        for more in (["--num-layers", "1000000000"], ["--hidden-size", "1000000000"], ["--vocab-size", "1000000000000"],
                     ["--num-experts", "1000000", "--moe-router-topk", "2"], ["--seq-length", "1000000000",
                                                                               "--max-position-embeddings", "1000000000"]):
            yield f"plan {gpus} GPUs {' '.join(more)[:40]}", ["plan", "--gpus", gpus, "--seq-length", "4096",
                                                               "--global-batch-size", "1048576", "--", *dense, *more], {}


def hostile10_cases():
    """Issue hostile10 (the tenth round): NeMo 2 PEFT (a finetune export's `peft:`, a checkpoint's `model_transform`),
    run_recipe.py --mode lora|dora (bad modes, unknown recipes, overrides of the wrong type), `*` patterns in
    target_modules (10**5 stars, regex metacharacters, unicode, patterns matching nothing or everything), DoRA dropout,
    --cp-comm-type a2a / per-layer lists / a2a+p2p with odd heads and CP sizes, --attention-backend spellings,
    heterogeneous block configs with MoE / MTP, hybrid CUDA-graph scopes, offloaded module lists, Muon / Lion / SOAP
    values, plan's cluster-speed and ranking options (0, -1, nan, inf, 1e308, unknown rules, --explain with nothing
    fitting), and NeMo 1 optimizer keys set to null."""
    from test_peft_nemo2 import LLAMA3_8B_LORA as NEMO2_LORA
    from test_readers_bridge import FLAT
    words = ["x", "", "null", "'???'", "-1", "0", "1e400", "nan", "[1, 2]", "{a: 1}", "true", "9" * 30]
    # NeMo 2 finetune exports: every LoRA / DoRA field with hostile values, on both schemes
    for scheme in ("lora.LoRA", "dora.DoRA"):
        text = NEMO2_LORA.replace("lora.LoRA", scheme)
        for key in ("dim", "alpha", "dropout", "dropout_position", "target_modules", "_target_", "lora_A_init_method",
                    "dropout_recompute"):
            for v in words + ["2", "0.5", "post", "pre", "1e-300", "-0.0"]:
                body = text.replace("  dim: 8\n", "") if key == "dim" else text
                yield (f"estimate NeMo 2 {scheme} {key}={v[:20]}", ["estimate", "--config", "ft.yaml"],
                       {"ft.yaml": body + f"  {key}: {v}\n"})
    pats = ["'*'", "'**'", "'*' * 3", "''", "'*.'", "'.*'", "'[a-z]*'", "'(.*)'", "'linear_q?v'", "'*.linear_qkv$'",
            "'^*linear_qkv'", "'*линейный*'", "'*\\u0000*'", "'*linear_qkv*' ", "'" + "*" * 100_000 + "'",
            "'" + "*a" * 50_000 + "b'", "'*" + "linear_" * 10_000 + "qkv'", "'*.layers.*.*.*.*.linear_qkv'",
            "'*.layers.9999999999999999999.*'", "'*.layers.-1.*'", "'*[!x]inear_qkv'", "'*\\\\linear_qkv'",
            "'*{linear_qkv,linear_proj}'", "'*linear_qkv|linear_proj'", "'*LINEAR_QKV'", "'* linear_qkv'", "5", "null",
            "'*.experts.*'", "'*.mtp.*'", "'*.decoder.*'", "'*.embedding*'"]
    for p in pats:
        for shape in ("[{}]", "[{}, '*.linear_proj']"):
            targets = shape.format(p)
            yield (f"estimate NeMo 2 target_modules {targets[:40]}", ["estimate", "--config", "ft.yaml"],
                   {"ft.yaml": NEMO2_LORA + f"  target_modules: {targets}\n"})
            yield (f"estimate Bridge target_modules {targets[:40]}", ["estimate", "--config", "c.yaml", "--gpus", "8"],
                   {"c.yaml": FLAT + "peft:\n  _target_: megatron.bridge.peft.dora.DoRA\n  dim: 8\n"
                                     f"  target_modules: {targets}\n"})
    yield ("estimate NeMo 2 target_modules 20,000 patterns", ["estimate", "--config", "ft.yaml"],
           {"ft.yaml": NEMO2_LORA + "  target_modules: [" + ", ".join(f"'*.l{i}*'" for i in range(20_000)) + "]\n"})
    # a checkpoint's context/model.yaml with a model_transform
    ckpt = ("_target_: nemo.collections.llm.gpt.model.llama.LlamaModel\nconfig:\n  _target_: "
            "nemo.collections.llm.gpt.model.llama.Llama3Config8B\n  seq_length: 2048\n")
    for v in ("null", "'???'", "lora", "x", "[]", "{}", "5", "{_target_: nemo.collections.llm.peft.lora.LoRA, dim: x}",
              "{_target_: nemo.collections.llm.peft.dora.DoRA, dropout: 2}", "{_target_: os.system}",
              "{_target_: nemo.collections.llm.peft.lora.LoRA, target_modules: ['*']}",
              "{_target_: nemo.collections.llm.peft.lora.LoRA, _partial_: true}", "{dim: 8}",
              "{_target_: nemo.collections.llm.peft.lora.LoRA, dim: 1e400}"):
        for more in ([], ["--", "--micro-batch-size", "1", "--global-batch-size", "64"]):
            yield (f"estimate NeMo 2 model_transform: {v[:30]} {more[:1]}",
                   ["estimate", "--config", "model.yaml", "--world-size", "8", *more], {"model.yaml": ckpt + f"model_transform: {v}\n"})
    # run_recipe.py --mode / --recipe / overrides
    launch = ["check", "--", "torchrun", "--nproc-per-node", "8", "run_recipe.py"]
    for mode in ("lora", "dora", "LoRA", "DORA", "lora ", "", "peft", "sft", "pretrain", "lora,dora", "qlora", "x" * 10_000,
                 "ло́ра", "None"):
        for sel in (["--model", "llama32_1b"], ["--recipe", "llama32_1b_peft_config"], ["--recipe", "llama32_1b_pretrain_config"]):
            yield f"check run_recipe.py {sel[1]} --mode {mode[:20]!r}", [*launch, *sel, "--mode", mode], {}
    for name in ("llama32_1b_peft_config ", "LLAMA32_1B_PEFT_CONFIG", "llama32_1b_peft", "llama32_1b_peft_config_x", "../x",
                 "a" * 100_000, "llama32_1b_peft_config\x00", "__import__('os')", "_peft_config", "peft", "qwen3_8b_peft_config",
                 "llama3_70b_peft_config", "nemotronh_8b_peft_config", "llama32_1b_sft_config"):
        for mode in ([], ["--mode", "lora"], ["--mode", "dora"]):
            yield f"check run_recipe.py --recipe {name[:30]!r} {mode}", [*launch, "--recipe", name, *mode], {}
    for ov in ("peft.dim=x", "peft.dim=0", "peft.dim=-8", "peft.dim=1e30", "peft.dim=null", "peft.alpha=nan",
               "peft.dropout=2", "peft.dropout=-0.5", "peft.dropout=nan", "peft.dropout=0.1", "peft.dropout_position=x",
               "peft.dropout_position=post", "peft.target_modules=[]", "peft.target_modules=x",
               "peft.target_modules=['*']", "peft.target_modules=['*.linear_qkv']", "peft=null", "peft=x", "peft=lora",
               "peft=dora", "peft={}", "peft.dim=[8]", "+peft.rank=8", "~peft", "~peft.dim", "model.num_layers=x",
               "model.num_layers=[1]", "model.num_layers={a: 1}", "model.tensor_model_parallel_size=3",
               "train.micro_batch_size=-1", "model.seq_length=1e400", "model=null", "peft.dim=8=8", "=8", "peft..dim=8",
               "peft.dim.x=8", "model.num_layers=" + "9" * 5000, "peft.lora_dtype=x"):
        for mode in ("lora", "dora"):
            yield f"check run_recipe.py --mode {mode} {ov[:30]}", [*launch, "--model", "llama32_1b", "--mode", mode, ov], {}
    for opt in ("-tp", "-pp", "-sl", "--gbs", "--mbs", "--dataset", "-cp", "--seq-length"):
        for v in ("x", "0", "-1", "1e400", "nan", "9" * 30, ""):
            yield f"check run_recipe.py --mode lora {opt} {v[:10]!r}", [*launch, "--model", "llama32_1b", "--mode", "lora",
                                                                        opt, v], {}
    # --cp-comm-type and --attention-backend
    attn = ["--num-layers", "4", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "4800",
            "--max-position-embeddings", "4800", "--micro-batch-size", "1", "--global-batch-size", "48",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--bf16", "--position-embedding-type", "rope"]
    for cp in ("2", "3", "4", "5", "8", "12", "16", "1"):
        for ct in (["a2a"], ["a2a+p2p"], ["A2A"], ["a2a", "p2p", "a2a", "all_gather"], ["a2a", "p2p"],
                   ["a2a"] * 5, ["a2a,p2p"], [""], ["a2a+p2p", "--hierarchical-context-parallel-sizes", "2", str(max(1, int(cp) // 2))],
                   ["a2a+p2p", "--hierarchical-context-parallel-sizes", "3", "1"]):
            for heads in (["--num-attention-heads", "12"], ["--num-attention-heads", "7", "--hidden-size", "896"],
                          ["--group-query-attention", "--num-query-groups", "3"]):
                yield (f"estimate CP {cp} --cp-comm-type {' '.join(ct)[:30]} {heads[-1]}",
                       ["estimate", "--world-size", "48", "--", *attn, *heads, "--context-parallel-size", cp,
                        "--cp-comm-type", *ct], {})
    for backend in ("flash", "FLASH", "Flash", "fused", "unfused", "local", "auto", "AttnBackend.flash", "flash,fused",
                    "", "x", "None", "null", "0"):
        for more in ([], ["--context-parallel-size", "2", "--cp-comm-type", "a2a"], ["--fp8-format", "hybrid",
                                                                                    "--fp8-dot-product-attention"]):
            yield f"estimate --attention-backend {backend!r} {more[:2]}", ["estimate", "--world-size", "8", "--", *attn,
                                                                         "--attention-backend", backend, *more], {}
    yield "estimate --attention-backend flash fused", ["estimate", "--world-size", "8", "--", *attn, "--attention-backend",
                                                      "flash", "fused"], {}
    for v in ("flash", "FLASH", "[flash]", "null", "5", "AttnBackend.flash", "{_target_: x}"):
        yield f"estimate Bridge attention_backend={v}", ["estimate", "--config", "c.yaml", "--gpus", "8", "--set",
                                                        f"model.attention_backend={v}"], {"c.yaml": FLAT}
        yield f"estimate Bridge cp_comm_type={v}", ["estimate", "--config", "c.yaml", "--gpus", "8", "--set",
                                                   "model.context_parallel_size=2", "--set", f"model.cp_comm_type={v}"],\
            {"c.yaml": FLAT}
    for v in ("a2a", "[a2a, p2p]", "[a2a]", "['a2a'] * 2", "[null]", "[]", "[a2a, a2a, a2a, a2a, a2a]", "A2A", "7"):
        yield f"estimate Bridge cp_comm_type={v} CP 2", ["estimate", "--config", "c.yaml", "--gpus", "8", "--set",
                                                        "model.context_parallel_size=2", "--set", f"model.cp_comm_type={v}"],\
            {"c.yaml": FLAT}
    # heterogeneous block configs with MoE / MTP (megatron-core 0.19) and hostile JSON
    base = json.load(open(os.path.join(ROOT, "tests", "data", "heterogeneous", "small_blocks.json")))
    from test_heterogeneous import FLAGS as het_flags
    hflags = [*het_flags, "--megatron-version", "0.19.2"]
    hmoe = ["--num-experts", "4", "--moe-ffn-hidden-size", "256", "--moe-router-topk", "2", "--moe-token-dispatcher-type",
            "alltoall"]
    docs: dict[str, object] = {"as is": base}
    # (deep nesting written as text: json.dumps recurses)
    docs["5,000 levels of block_configs"] = '{"block_configs":' * 5000 + json.dumps(base) + "}" * 5000
    docs["block_configs 3,000 lists deep"] = json.dumps(dict(base, block_configs=[])).replace(
        '"block_configs": []', '"block_configs": ' + "[" * 3000 + "null" + "]" * 3000)
    for label, blk in (("nulls", {"attention": None, "ffn": None}), ("nested nulls", {"attention": {"n_heads_in_group": None,
                       "no_op": None, "replace_with_linear": None}, "ffn": {"ffn_mult": None, "no_op": None,
                       "replace_with_linear": None}}), ("moe key", {"attention": {"n_heads_in_group": 4}, "ffn": {"ffn_mult": 1,
                       "moe": {"num_local_experts": 8}}}), ("mlp not ffn", {"attention": {"n_heads_in_group": 4},
                       "mlp": {"ffn_mult": 1}}), ("strings", {"attention": {"n_heads_in_group": "4"}, "ffn": {"ffn_mult": "1"}}),
                       ("bool mult", {"attention": {"n_heads_in_group": 4}, "ffn": {"ffn_mult": True}}),
                       ("no_op string", {"attention": {"n_heads_in_group": 4, "no_op": "false"}, "ffn": {"ffn_mult": 1}}),
                       ("both no_op and linear", {"attention": {"n_heads_in_group": 4, "no_op": True,
                                                                "replace_with_linear": True}, "ffn": {"ffn_mult": 1}})):
        docs[f"4 blocks of {label}"] = dict(base, block_configs=[blk] * 4)
    small = {"attention": {"n_heads_in_group": 4}, "ffn": {"ffn_mult": 1}}
    docs["100,000 blocks"] = dict(base, block_configs=[small] * 100_000)
    docs["100,000 layers"] = dict(base, block_configs=[small] * 10, num_hidden_layers=100_000)
    for k, v in (("num_hidden_layers", None), ("num_hidden_layers", "4"), ("hidden_size", 4.5), ("rope_scaling", None),
                 ("rope_scaling", {"factor": None}), ("num_attention_heads", 0), ("hidden_act", None), ("block_configs", None)):
        docs[f"{k}={v!r}"] = dict(base, **{k: v})
    for label, doc in docs.items():
        text = doc if isinstance(doc, str) else json.dumps(doc, separators=(",", ":"))
        if len(text) > 900_000:
            continue
        for more_label, more in (("MoE", hmoe), ("MTP", ["--mtp-num-layers", "2"]), ("MoE+MTP", [*hmoe, "--mtp-num-layers", "1"]),
                                 ("MoE freq", [*hmoe, "--moe-layer-freq", "[1,0,1,0]"])):
            yield f"estimate heterogeneous {more_label} {label}", ["estimate", "--world-size", "1", "--", *hflags, *more,
                                                                   "--heterogeneous-layers-config-path", "h.json"], {"h.json": text}
    # hybrid CUDA-graph scopes, offloaded modules, Muon / Lion / SOAP values
    hyb = [*HYBRID, "--hybrid-layer-pattern", "M*M-", "--megatron-version", "0.19.2"]
    for impl in ("local", "transformer_engine", "full_iteration", "LOCAL", "x", ""):
        for mods in (["mamba"], ["attn", "mamba", "mlp"], ["moe"], ["mamba", "mamba"], ["MAMBA"], ["x"], [""],
                     ["mamba,attn"], ["full_iteration"], ["moe_router", "moe_preprocess"]):
            for flag in ("--cuda-graph-modules", "--cuda-graph-scope"):
                yield f"estimate hybrid --cuda-graph-impl {impl} {flag} {mods}", [
                    "estimate", "--world-size", "8", "--", *hyb, "--cuda-graph-impl", impl, flag, *mods], {}
    for mods in (["attn_norm"], ["core_attn", "mlp_norm", "expert_fc1", "moe_act"], ["mamba"], ["x"], [""], ["ATTN_NORM"],
                 ["attn_norm"] * 50, ["qkv_linear,core_attn"], ["fused_group_mlp"], ["attn_proj"]):
        for model in (("dense", SMALL), ("hybrid", hyb), ("moe", MOE)):
            for inflight in ([], ["--fine-grained-offloading-max-inflight-offloads", "0"],
                             ["--fine-grained-offloading-max-inflight-offloads", "-1"],
                             ["--fine-grained-offloading-max-inflight-offloads", str(10**9)]):
                yield f"estimate {model[0]} --offload-modules {' '.join(mods)[:20]} {inflight[1:]}", [
                    "estimate", "--world-size", "8", "--megatron-version", "0.19.2", "--", *model[1],
                    "--fine-grained-activation-offloading", "--offload-modules", *mods, *inflight], {}
    opt_values = {"--muon-momentum": ["nan", "-1", "1e400", "x", "2"], "--muon-num-ns-steps": ["0", "-1", "1e9", "x", "2.5"],
                  "--muon-tp-mode": ["BLOCKWISE", "x", "", "duplicated"], "--muon-scale-mode": ["x", "", "spectral"],
                  "--muon-extra-scale-factor": ["nan", "-1", "inf"], "--muon-coefficient-type": ["x", "", "quintic"],
                  "--muon-fp32-matmul-prec": ["HIGHEST", "x", ""], "--muon-scalar-optimizer": ["LION", "sgd", "", "muon"],
                  "--lion-beta1": ["nan", "-1", "2", "x"], "--lion-beta2": ["inf", "0", "x"],
                  "--soap-precondition-frequency": ["0", "-1", "x", "1e400"], "--soap-shampoo-beta": ["nan", "x"],
                  "--optimizer": ["MUON", "Lion", "soap", "adamw", "", "x", "dist_muon"]}
    for optimizer in ("muon", "lion", "soap", "adaptive_muon"):
        for flag, vs in opt_values.items():
            for v in vs:
                yield f"estimate --optimizer {optimizer} {flag} {v!r}", [
                    "estimate", "--world-size", "8", "--megatron-version", "0.19.2", "--", *SMALL, "--optimizer", optimizer,
                    flag, v], {}
    # plan's cluster speeds, ranking and --explain
    plan = ["plan", "--gpus", "8", "--seq-length", "2048", "--global-batch-size", "64", "--model", "llama-3.2-1b"]
    for opt in ("--network-gbps", "--tie-window", "--gemm-efficiency", "--attention-efficiency"):
        for v in ("0", "-1", "nan", "inf", "-inf", "1e308", "1e-308", "5e-324", "x", "", "1.5", "100", "0x10", "1_0"):
            yield f"plan {opt} {v!r}", [*plan, opt, v], {}
            yield f"plan {opt} {v!r} --explain", [*plan, opt, v, "--explain"], {}
    for rule in ("unknown", "", "TIME", "fujii2024 ", "time,fujii2024"):
        yield f"plan --rule {rule!r}", [*plan, "--rule", rule], {}
    nothing = ["plan", "--gpus", "1", "--seq-length", "131072", "--global-batch-size", "1", "--model", "llama3.1-70b"]
    for extra in ([], ["--explain"], ["--explain", "tp=1,pp=1,vpp=1,cp=1,mbs=1,recompute=full"], ["--explain", "x"],
                  ["--explain", "tp=8"], ["--rule", "fujii2024", "--explain"], ["--tie-window", "1e308", "--explain"],
                  ["--json", "--explain"], ["--top", "0", "--explain"]):
        yield f"plan nothing fits {' '.join(extra)[:40]}", [*nothing, *extra], {}
    for extra in (["--explain", "tp=1,pp=1,vpp=1,cp=1,mbs=1,recompute=none"], ["--explain", "tp=1,tp=2"],
                  ["--explain", "tp=999999999999999999999"], ["--explain", "tp=-1,pp=0"], ["--explain", "tp=nan"],
                  ["--explain", "=,=,="], ["--explain", "tp=1," * 20_000], ["--explain", "recompute=x"],
                  ["--tie-window", "1", "--rule", "fujii2024"], ["--network-gbps", "1e-300", "--tie-window", "0"]):
        yield f"plan {' '.join(extra)[:50]}", [*plan, *extra], {}
    # NeMo 1 optimizer keys set to null (and '???')
    nemo1 = dict((n, t) for n, t, _ in YAML_SEEDS)["nemo1_llama.yaml"]
    for key in ("model.optim.num_distributed_optimizer_instances", "model.optim.overlap_grad_sync",
                "model.optim.overlap_param_sync", "model.optim.contiguous_grad_buffer", "model.optim.bucket_cap_mb",
                "model.optim.grad_sync_dtype", "model.optim.betas", "model.optim.weight_decay", "model.optim.lr",
                "model.optim.sched", "model.optim.ddp_bucket_size", "model.optim.distribute_within_nodes",
                "model.optim.overlap_param_gather_with_optimizer_step", "model.optim.use_precision_aware_optimizer",
                "model.optim.store_param_remainders", "model.optim.main_grads_dtype", "model.optim.exp_avg_dtype",
                "model.optim.optimizer_cpu_offload", "model.optim.optimizer_offload_fraction",
                "model.optim.use_distributed_optimizer", "model.optim.fp32_grad_accumulation"):
        for name in ("distributed_fused_adam", "mcore_distributed_optim"):
            for v in ("null", "'???'", "x", "[1]"):
                yield f"estimate NeMo 1 {name} {key}={v}", ["estimate", "--config", "c.yaml", "--vocab-size", "32000", "--set",
                                                          f"model.optim.name={name}", "--set", f"{key}={v}"], {"c.yaml": nemo1}



def hostile12_cases(d: str):
    """Issue hostile12 (the twelfth round): the hostile11 leftovers (a heterogeneous JSON with a UTF-8 BOM, Hugging Face
    numbers written as strings, --eval-iters / validation.eval_iters without an eval micro-batch, report --out / estimate
    --plot at a named pipe nobody reads) and the surfaces changed this session: the eval step with PP / VPP, --save
    without --save-interval, Bridge cuda_graph_scope / comm_overlap overrides, NCCL_BUFFSIZE / CUBLAS_WORKSPACE_CONFIG in
    a launch script, report --env and calibrate --env, and memguard plan of gated delta net models with odd
    --linear-attention-freq values. ``d``: a directory for the named pipes."""
    from test_eval_step import BASE as EVAL
    from test_heterogeneous import BLOCKS, FLAGS as HET
    from test_planner_gdn import MODEL as GDN_PLAN
    from test_readers_bridge import FLAT
    V = ["x", "", "0", "-1", "1e400", "nan", "inf", "9" * 30, "1.5", "-0", "0x10", "None", "[1,2]", "true", "3", "7"]
    Y = ["null", "'???'", "x", "-1", "0", "1.5", "[1]", "{a: 1}", "true", "1e400", "9" * 40, ".nan", ".inf", "''", "'4'"]
    # heterogeneous layer JSON with a byte-order mark (file and encoded JSON), UTF-16, a BOM inside
    blocks = open(BLOCKS, "rb").read()
    het = ["estimate", "--world-size", "1", "--", *HET]
    for label, data in (("UTF-8 BOM", b"\xef\xbb\xbf" + blocks), ("two BOMs", b"\xef\xbb\xbf" * 2 + blocks),
                        ("BOM after a space", b" \xef\xbb\xbf" + blocks), ("UTF-16", blocks.decode().encode("utf-16")),
                        ("BOM only", b"\xef\xbb\xbf"), ("zero-width space", "\u200b".encode() + blocks)):
        yield f"estimate heterogeneous path {label}", [*het, "--heterogeneous-layers-config-path", "b.json"], {"b.json": data}
        yield (f"estimate heterogeneous encoded {label}",
               [*het, "--heterogeneous-layers-config-encoded-json", data.decode("utf-8", "replace")], {})
    # Hugging Face numbers written as strings (every key the reader takes), in each family
    hf_cmd = ["estimate", "--config", "config.json", "--world-size", "64", "--", "--micro-batch-size", "1",
              "--seq-length", "4096", "--global-batch-size", "64"]
    for name in ("mixtral-8x7b", "deepseek-v3", "qwen3-30b-a3b"):
        doc = json.load(open(os.path.join(ROOT, "tests", "data", "hf", name + ".json")))
        for key, v in doc.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                for text in (str(v), f" {v}", f"{v}x", "0x10", "1e3"):
                    yield f"estimate HF {name} {key}={text!r}", hf_cmd, {"config.json": json.dumps(dict(doc, **{key: text}))}
    # --eval-iters / validation.eval_iters without (and with) an eval micro-batch, with PP / VPP
    pp2 = ["--pipeline-model-parallel-size", "2", *EVAL]
    vpp = [*pp2, "--num-layers-per-virtual-pipeline-stage", "1"]
    for v in V:
        yield f"estimate --eval-iters {v!r}", ["estimate", "--world-size", "2", "--", *pp2, "--eval-iters", v], {}
        for base, ws in ((pp2, "2"), (vpp, "2"), (vpp, "4")):
            for flag in ("--eval-micro-batch-size", "--eval-global-batch-size"):
                yield (f"estimate PP/VPP ws {ws} {flag} {v!r}",
                       ["estimate", "--world-size", ws, "--", *base, flag, v, "--eval-iters", "1"], {})
    for v in Y:
        yield f"estimate Bridge validation.eval_iters={v}", ["estimate", "--config", "c.yaml", "--gpus", "8", "--set",
                                                              f"validation.eval_iters={v}"], {"c.yaml": FLAT}
    # --save without --save-interval, odd --save-interval values
    for extra in ([], ["--save-interval", "x"], ["--save-interval", "0"], ["--save-interval", "-1"], ["--save-interval", "1e400"],
                  ["--save-interval", ""], ["--save-interval", "9" * 30], ["--save-interval", "1"], ["--save", ""],
                  ["--save", "/dev/null"], ["--save", "x" * 100_000], ["--save", "ckpt", "--save", "ckpt2"]):
        yield f"estimate --save ckpt {extra[:2]}", ["estimate", "--world-size", "8", "--", *SMALL, "--save", "ckpt", *extra], {}
        yield f"check --save ckpt {extra[:2]}", ["check", "--", "torchrun", "--nproc-per-node", "8", "pretrain_gpt.py",
                                                   *SMALL, "--save", "ckpt", *extra], {}
    # Bridge cuda_graph_scope / cuda_graph_modules / comm_overlap overrides
    for v in ("full", "full_iteration", "null", "[attn]", "[full]", "[]", "x", "[x]", "'???'", "[attn, attn]", "FULL", "1",
              "{a: 1}", "[null]", "attn"):
        for impl in ("none", "local", "transformer_engine", "full_iteration"):
            yield (f"estimate Bridge cuda_graph_scope={v} impl={impl}",
                   ["estimate", "--config", "c.yaml", "--gpus", "8", "--set", f"model.cuda_graph_impl={impl}", "--set",
                    f"model.cuda_graph_scope={v}", "--set", "rerun_state_machine.check_for_nan_in_loss=false"], {"c.yaml": FLAT})
        yield (f"estimate Bridge cuda_graph_modules={v}",
               ["estimate", "--config", "c.yaml", "--gpus", "8", "--set", "model.cuda_graph_impl=transformer_engine",
                "--set", f"model.cuda_graph_modules={v}"], {"c.yaml": FLAT})
    launch = ["check", "--", "torchrun", "--nproc-per-node", "8", "run_recipe.py"]
    for recipe in ("llama3_8b", "llama3_70b"):
        for ov in ("comm_overlap.tp_comm_overlap=true", "comm_overlap.tp_comm_overlap=x", "comm_overlap.tp_comm_overlap=null",
                   "comm_overlap=null", "comm_overlap={}", "comm_overlap=x", "~comm_overlap", "+comm_overlap.x=1",
                   "comm_overlap.data_parallel_size=0", "comm_overlap.data_parallel_size=x", "comm_overlap.data_parallel_size=-8",
                   "comm_overlap.overlap_grad_reduce=1e400", "comm_overlap.tp_comm_overlap_cfg=x",
                   "comm_overlap.tp_comm_overlap_cfg={a: 1}", "comm_overlap.defer_embedding_wgrad_compute=true",
                   "comm_overlap.wgrad_deferral_limit=-1", "model.cuda_graph_scope=full", "model.cuda_graph_scope=[x]"):
            yield f"check run_recipe.py {recipe} {ov}", [*launch, "--recipe", recipe + "_pretrain_config", ov], {}
    # NCCL_BUFFSIZE / CUBLAS_WORKSPACE_CONFIG in a launch script, report --env, calibrate --env
    run = {"memguard-rank00000.jsonl": json.dumps(RUNLOG[0]) + "\n" + json.dumps(RUNLOG[1]) + "\n"}
    for key, vs in (("NCCL_BUFFSIZE", ["0x", "0x0", "0X400000", "4194304 ", " 4194304", "4MB", "4M", "+4194304", "010",
                                        "1e6", "0b1", "", "'4194304'", '"0x400000"', "$X", "${NCCL_BUFFSIZE:-0}", "9" * 5000]),
                    ("CUBLAS_WORKSPACE_CONFIG", [":4096:8", ":16:8", ":4096:8:16:8", ":0:0", ":-1:8", "4096:8", ":4096",
                                                 ":4096:8:", "::", ":x:y", ":4096:8," * 1000, "", ":1e3:8",
                                                 ":2147483648:1", ":4096:-8", "'  :4096:8'"])):
        for v in vs:
            yield f"estimate script {key}={v[:30]!r}", ["estimate", "--config", "s.sh"], {
                "s.sh": f"export {key}={v}\ntorchrun --nproc-per-node 8 pretrain_gpt.py {' '.join(SMALL)}\n"}
            yield (f"estimate script {key}={v[:30]!r} deterministic", ["estimate", "--config", "s.sh"], {
                "s.sh": f"export {key}={v}\ntorchrun --nproc-per-node 8 pretrain_gpt.py {' '.join(SMALL)} --deterministic-mode\n"})
            yield f"report --env {key}={v[:30]!r}", ["report", ".", "--env", f"{key}={v}"], run
    for kv in ("", "=", "NCCL_BUFFSIZE", "=4194304", "NCCL_BUFFSIZE==1", "X=1", "NCCL_BUFFSIZE=1=2"):
        yield f"report --env {kv!r}", ["report", ".", "--env", kv], run
    # report --out / estimate --plot / plan --plot at a named pipe nobody reads (refused before any rendering)
    for name in ("out12.html", "out12.png", "out12.svg"):
        fifo = os.path.join(d, name)
        if not os.path.exists(fifo):
            os.mkfifo(fifo)
        yield f"report --out pipe {name}", ["report", ".", "--out", fifo], run
        yield f"estimate --plot pipe {name}", ["estimate", "--world-size", "8", "--plot", fifo, "--", *SMALL], {}
        yield f"plan --plot pipe {name}", [*PLAN, "--plot", fifo, "--", *SMALL], {}
    # memguard plan of gated delta net models, odd --linear-attention-freq values
    gdn = list(GDN_PLAN)
    i = gdn.index("--linear-attention-freq")
    del gdn[i:i + 2]
    for v in ["1", "2", "3", "5", "7", "8", "9", "0", "-1", "x", "1.5", "[1]*8", "[0]*8", "[1,0]*4", "[1,1,1,0,1,1,1]",
              "[1]*9", "([1]*3+[0])*2", "[0,1,1,1]*2", "[2]*8", "[True]*8", "99999999", "([1]*3+[0])*" + "9" * 20, "[]",
              "None", "(" * 500 + "4" + ")" * 500]:
        yield f"plan GDN --linear-attention-freq {v[:30]!r}", ["plan", "--gpus", "8", "--seq-length", "1024",
                                                                "--global-batch-size", "32", "--", *gdn,
                                                                "--linear-attention-freq", v], {}
        yield (f"plan GDN PP --linear-attention-freq {v[:30]!r}",
               ["plan", "--gpus", "16", "--seq-length", "1024", "--global-batch-size", "64", "--top", "3", "--", *gdn,
                "--linear-attention-freq", v, "--num-layers", "9"], {})


def hostile13_cases(d: str):
    """Issue hostile13 (the thirteenth round): memguard plan of gated delta net models (--explain, --rule, --top,
    cluster constants, GDN head flags, hybrid G patterns), the eval-step / --skip-train / --save / rerun flags, Bridge
    overrides (every bool field of optimizer / ddp / dist / comm_overlap / rerun_state_machine with words, numbers,
    lists and unicode; cuda_graph_scope lists / strings / nulls; mixed_precision.* and optimizer offload keys; dotted
    keys into scalars, duplicated and unicode keys), memguard calibrate on damaged Megatron logs (truncated lines,
    spliced and mixed ranks) and every subcommand's file arguments (a directory, /dev/zero, /dev/full, /proc/self/mem,
    a symlink loop, names with a line break, a NUL, 300 / 6,000 characters, an empty name). ``d``: a directory for the
    files."""
    from megatron_logs import args_of, print_args, report_memory
    from test_eval_step import BASE as EVAL
    from test_planner_gdn import MODEL as GDN, MOE
    from test_readers_bridge import FLAT
    PLANG = ["plan", "--gpus", "8", "--seq-length", "1024", "--global-batch-size", "32"]
    # memguard plan of GDN models: --explain, --rule, --top, cluster constants, constraints
    for extra in (["--explain"], ["--explain", "tp=2"], ["--explain", "tp=2,pp=1,vpp=1,cp=1,mbs=1,recompute=none"],
                  ["--explain", "tp=3,pp=1"], ["--explain", "tp=1,tp=2"], ["--explain", "tp=8,pp=1,cp=1,mbs=1,recompute=none"],
                  ["--explain", "tp=1,pp=2,vpp=4,cp=1,mbs=1,recompute=none"], ["--explain", "ep=2"], ["--explain", "tp=nan"],
                  ["--explain", "fsdp=x"], ["--explain", "tp=1,pp=1,cp=2,mbs=1,recompute=full"], ["--rule", "fujii2024"],
                  ["--rule", "memory"], ["--top", "0"], ["--top", "50"], ["--top", "9" * 30], ["--cp", "2,4,8"],
                  ["--cp", "8", "--tp", "1"], ["--tp", "8"], ["--vpp", "2,8"], ["--fp8", "tensorwise"], ["--fp8", "mxfp8"],
                  ["--network-gbps", "nan"], ["--network-gbps", "1e-300"], ["--gemm-efficiency", "inf"],
                  ["--attention-efficiency", "5e-324"], ["--tie-window", "0.999999"], ["--json", "--explain"],
                  ["--fsdp", "optim_grads_params"], ["--recompute", "selective"], ["--no-sp"], ["--max-tp", "0"],
                  ["--ep", "2"], ["--etp", "2"], ["--gpu", "B200"], ["--gpu-memory", "1KiB"]):
        yield f"plan GDN {' '.join(extra)[:40]}", [*PLANG, *extra, "--", *GDN], {}
        yield f"plan GDN MoE {' '.join(extra)[:40]}", [*PLANG, *extra, "--", *GDN, *MOE], {}
    for flag in ("--linear-num-key-heads", "--linear-num-value-heads", "--linear-key-head-dim", "--linear-value-head-dim",
                 "--linear-conv-kernel-dim"):
        for v in ("0", "-1", "1", "3", "x", "1e400", "1024", "nan", "9" * 30):
            yield f"plan GDN {flag} {v[:20]}", [*PLANG, "--top", "2", "--", *GDN, flag, v], {}
            yield (f"estimate GDN {flag} {v[:20]}", ["estimate", "--world-size", "8", "--", *GDN, "--seq-length", "1024",
                                                     "--micro-batch-size", "1", flag, v], {})
    hyb = [x for x in GDN]
    for f in ("--experimental-attention-variant", "--linear-attention-freq"):
        i = hyb.index(f)
        del hyb[i:i + 2]
    for pat in ("G*G*G*G*", "GGGGGGGG", "G-G-G-G-", "GEGEGEGE", "G", "M*G*", "G/G", "GGGGGGGG/*", "G" * 5000):
        yield f"plan hybrid {pat[:20]}", [*PLANG, "--", *hyb, "--hybrid-layer-pattern", pat], {}
        yield f"plan hybrid {pat[:20]} --explain", [*PLANG, "--explain", "--", *hyb, "--hybrid-layer-pattern", pat], {}
    # the eval step, --skip-train, --save, rerun_state_machine flags
    ev = ["estimate", "--world-size", "2", "--", *EVAL, "--eval-micro-batch-size", "8", "--eval-global-batch-size", "16",
          "--save", "c", "--save-interval", "10"]
    for flag, vals in (("--skip-train", [None, "x"]), ("--eval-interval", ["0", "-1", "x", "1.5", "1e400", ""]),
                       ("--eval-iters", ["0", "-5", "9" * 21]), ("--rerun-mode", ["disabled", "validate_results", "x", ""]),
                       ("--error-injection-rate", ["-1", "x"]), ("--check-for-nan-in-loss-and-grad", [None]),
                       ("--no-check-for-nan-in-loss-and-grad", [None]), ("--check-for-spiky-loss", [None]),
                       ("--non-persistent-save-interval", ["0", "x"]), ("--async-save", [None]),
                       ("--ckpt-format", ["torch", "x"])):
        for v in vals:
            yield f"estimate eval {flag} {v!r}", [*ev, flag] + ([] if v is None else [v]), {}
    # Bridge overrides
    Y = ["null", "x", "[]", "[1]", "{}", "{a: 1}", "true", "0", "-1", "1e400", ".nan", "'???'", "\u00f1", "0.5", "2", "'1'"]
    keys = ("optimizer.use_precision_aware_optimizer", "optimizer.optimizer_cpu_offload", "optimizer.store_param_remainders",
            "optimizer.optimizer_offload_fraction", "optimizer.overlap_cpu_optimizer_d2h_h2d", "optimizer.main_params_dtype",
            "optimizer.use_distributed_optimizer", "ddp.use_distributed_optimizer", "ddp.overlap_param_gather",
            "dist.use_torch_fsdp2", "dist.use_megatron_fsdp", "comm_overlap.tp_comm_overlap",
            "comm_overlap.overlap_grad_reduce", "comm_overlap.delay_wgrad_compute", "mixed_precision.bf16",
            "mixed_precision.fp8", "mixed_precision", "rerun_state_machine.check_for_nan_in_loss",
            "rerun_state_machine.rerun_mode", "rerun_state_machine", "validation.eval_iters", "validation.eval_interval",
            "validation.eval_micro_batch_size", "validation.eval_global_batch_size", "train.skip_train",
            "checkpoint.save", "checkpoint.save_interval", "model.cuda_graph_scope", "model.hidden_size.x",
            "model.num_layers.a.b", "optimizer.optimizer_offload_fraction.x", "model.\u00f1", "\u00f1.x")
    for key in keys:
        for v in Y:
            yield f"estimate Bridge {key}={v}", ["estimate", "--config", "c.yaml", "--gpus", "8", "--set", f"{key}={v}"], {
                "c.yaml": FLAT}
    te = ["--set", "model.cuda_graph_impl=transformer_engine"]
    pao = ["--set", "optimizer.use_precision_aware_optimizer=true", "--set", "optimizer.optimizer_cpu_offload=true"]
    for label, sets in (("dup", ["--set", "model.hidden_size=512", "--set", "model.hidden_size=1024"]),
                        ("dotted into a scalar", ["--set", "model.hidden_size=512", "--set", "model.hidden_size.a=1"]),
                        ("scalar then its field", ["--set", "optimizer=adam", "--set", "optimizer.lr=1"]),
                        ("scope list", [*te, "--set", "model.cuda_graph_scope=[attn, 'mlp']"]),
                        ("scope string list", [*te, "--set", "model.cuda_graph_scope='[attn]'"]),
                        ("scope csv", [*te, "--set", "model.cuda_graph_scope=attn,mlp"]),
                        ("scope null in a list", [*te, "--set", "model.cuda_graph_scope=[null, attn]"]),
                        ("scope nested", [*te, "--set", "model.cuda_graph_scope=[[attn]]"]),
                        ("scope moe_router", [*te, "--set", "model.cuda_graph_scope=[moe_router]"]),
                        ("offload", pao), ("offload fraction 2", [*pao, "--set", "optimizer.optimizer_offload_fraction=2"]),
                        ("offload fraction nan", [*pao, "--set", "optimizer.optimizer_offload_fraction=.nan"]),
                        ("offload fraction x", [*pao, "--set", "optimizer.optimizer_offload_fraction=x"]),
                        ("eval mbs 4 iters 0", ["--set", "validation.eval_micro_batch_size=4", "--set", "validation.eval_iters=0"]),
                        ("eval mbs 4 skip", ["--set", "validation.eval_micro_batch_size=4", "--set", "train.skip_train=true"]),
                        ("eval gbs 3", ["--set", "validation.eval_micro_batch_size=4", "--set", "validation.eval_global_batch_size=3"]),
                        ("unicode key", ["--set", "mod\u00e8l.hidden_size=1"]), ("empty key", ["--set", "=1"]),
                        ("dots", ["--set", "model..hidden_size=1"]), ("trailing dot", ["--set", "model.=1"]),
                        ("no =", ["--set", "model.hidden_size"]), ("~", ["--set", "~model.hidden_size"]),
                        ("++", ["--set", "++model.hidden_size=1"])):
        yield f"estimate Bridge {label}", ["estimate", "--config", "c.yaml", "--gpus", "8", *sets], {"c.yaml": FLAT}
    # memguard calibrate on damaged Megatron logs: truncated lines, spliced lines, mixed and huge ranks, no table end
    flags = [*S, "--train-iters", "10"]
    table = "\n".join(print_args(args_of(flags, 8)))
    mem = [report_memory(r, f"(after {i} iterations)", 2**30, 2**31, 2**31 + 2**29, 2**31 + 2**30, 2**32)
           for i in (1, 2) for r in range(8)]
    body = "\n".join(mem)
    for label, text in (("as printed", table + "\n" + body), ("every line cut in half", table + "\n" + "\n".join(m[:len(m) // 2] for m in mem)),
                        ("two lines spliced", table + "\n" + "".join(mem)), ("no table end", table.rsplit("\n", 1)[0] + "\n" + body),
                        ("rank 10**6", table + "\n" + body.replace("[Rank 3]", "[Rank 1000000]")),
                        ("rank -1", table + "\n" + body.replace("[Rank 3]", "[Rank -1]")),
                        ("ranks of another world", table + "\n" + body.replace("[Rank 1]", "[Rank 9]")),
                        ("table twice", table + "\n" + table + "\n" + body), ("NUL mid-line", table + "\n" + body.replace("|", "\x00|", 3)),
                        ("CR progress bars", table + "\n" + body.replace("\n", "\r")),
                        ("1,500 x the same line", table + "\n" + "\n".join([mem[0]] * 1_500))):
        files = {f"run{i}/stdout.log": text for i in range(3)}
        yield f"calibrate damaged {label}", ["calibrate", "run0", "run1", "run2", "--gpu", "A100-80GB"], files
        yield f"report damaged {label}", ["report", "run0/stdout.log"], files
    # every subcommand's file arguments
    os.makedirs(os.path.join(d, "dir13"), exist_ok=True)
    loop = os.path.join(d, "loop13")
    if not os.path.lexists(loop):
        os.symlink("loop13", loop)
    nl = os.path.join(d, "a\nb.yaml")
    with open(nl, "w") as f:
        f.write("x: 1\n")
    paths = {"a directory": os.path.join(d, "dir13"), "/dev/zero": "/dev/zero", "/dev/full": "/dev/full",
             "a symlink loop": loop, "a line break": nl, "300 characters": "/tmp/" + "a" * 300 + ".yaml",
             "6,000 characters": "/tmp/" + "/".join(["d" * 200] * 30) + "/x.yaml", "an empty name": "", "/dev/null": "/dev/null",
             "a NUL": "a\x00b", "a lone surrogate": "a\udcff.yaml", "-": "-"}
    if os.path.exists("/proc/self/mem"):
        paths["/proc/self/mem"] = "/proc/self/mem"
    run = {"runs/memguard-rank00000.jsonl": json.dumps(RUNLOG[0]) + "\n" + json.dumps(RUNLOG[1]) + "\n"}
    for label, p in paths.items():
        for cmd, args in (("estimate --config", ["estimate", "--config", p]),
                          ("estimate --site-profile", ["estimate", "--site-profile", p, "--world-size", "8", "--", *S]),
                          ("estimate --model", ["estimate", "--model", p, "--world-size", "8"]),
                          ("estimate --plot", ["estimate", "--plot", p, "--world-size", "8", "--", *S]),
                          ("validate", ["validate", p]), ("check -f", ["check", "-f", p]),
                          ("check --cwd", ["check", "--cwd", p, "--", "torchrun", "--nproc-per-node", "8", "pretrain_gpt.py", *S]),
                          ("plan --config", [*PLAN, "--config", p]), ("plan --plot", [*PLAN, "--plot", p, "--", *S]),
                          ("report", ["report", p]), ("report --out", ["report", "runs", "--out", p]),
                          ("calibrate", ["calibrate", p]), ("calibrate --out", ["calibrate", "runs", "--out", p]),
                          ("estimate --heterogeneous-layers-config-path", ["estimate", "--world-size", "8", "--", *S,
                                                                          "--heterogeneous-layers-config-path", p]),
                          ("estimate --yaml-cfg", ["estimate", "--world-size", "8", "--", "--yaml-cfg", p])):
            yield f"{cmd} {label}", args, run


def hostile14_cases():
    """Issue hostile14 (the fourteenth round): --moe-paged-stash and its rules, --moe-expert-rank-capacity-factor,
    --overlap-moe-expert-parallel-comm under Megatron-FSDP strategies, Bridge optimizer CPU offload fractions without
    the precision-aware optimizer, FP8 attention with per-layer --cp-comm-type lists, eval micro-batch counts, YAML
    structure in every reader (keys that are numbers / bools / null, interpolation cycles, resolvers, 4301 digits,
    -0.0 / 1e309 / NaN, tags, merge keys), launch scripts (heredocs, exec, arrays and appends, doubling arrays, set --,
    ${X:-4} / ${X:?}, CRLF, BOM, nested quotes, 470,000 words) and memguard plan over 720,720 GPUs (240 divisors)."""
    from test_fsdp_moe import ZP_Z3
    from test_readers_bridge import FLAT
    seeds = {n: (t, o) for n, t, o in YAML_SEEDS}
    moe = ["--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "8", "--moe-grouped-gemm",
           "--moe-token-dispatcher-type", "alltoall"]
    est = ["estimate", "--world-size", "8", "--megatron-version", "0.19.2", "--", *S]
    rank = ["--moe-expert-rank-capacity-factor", "1.5"]
    for extra in (["--moe-paged-stash"], ["--moe-paged-stash", *rank], ["--moe-paged-stash", "--cpu-offloading-num-layers", "1", *rank],
                  ["--moe-paged-stash", *rank, "--fine-grained-activation-offloading", "--offload-modules", "expert_fc1"],
                  ["--moe-paged-stash", *rank, "--offload-modules", "EXPERT_FC1"], ["--moe-paged-stash=1"],
                  ["--moe-paged-stash", "--no-moe-paged-stash"], ["--moe-paged-stash-page-size", "0"],
                  ["--moe-paged-stash-buffer-size-factor-cuda", "nan"], ["--moe-expert-rank-capacity-factor", "nan"],
                  ["--moe-expert-rank-capacity-factor", "-5"], ["--moe-expert-rank-capacity-factor", "x"]):
        yield f"estimate MoE {' '.join(extra)[:60]}", [*est, *moe, *extra], {}
        yield f"estimate dense {' '.join(extra)[:60]}", [*est, *extra], {}
    yield "estimate paged stash 0.16", ["estimate", "--world-size", "8", "--megatron-version", "0.16.1", "--", *S, *moe,
                                        "--moe-paged-stash"], {}
    for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params", "x", ""):
        flags = [f for f in ZP_Z3]
        if "--data-parallel-sharding-strategy" in flags:
            flags[flags.index("--data-parallel-sharding-strategy") + 1] = strategy
        for version in ("0.16.1", "0.19.2"):
            yield (f"estimate FSDP {strategy!r} EP overlap {version}",
                   ["estimate", "--world-size", "8", "--megatron-version", version, "--", *flags,
                    "--moe-token-dispatcher-type", "alltoall", "--overlap-moe-expert-parallel-comm"], {})
    bridge = ["estimate", "--config", "c.yaml", "--gpus", "8"]
    off = ["--set", "optimizer.optimizer_cpu_offload=true"]
    for v in ("0.5", "0", "1", "-0.1", "1.5", ".nan", "nan", ".inf", "x", "'0.5'", "[0.5]", "null", "1e309", "-0.0",
              "true", "'???'", "{}", "1" * 5000):
        yield f"estimate Bridge offload fraction {v[:20]}", [*bridge, *off, "--set", f"optimizer.optimizer_offload_fraction={v}"], {
            "c.yaml": FLAT}
        yield (f"estimate Bridge no offload, fraction {v[:20]}", [*bridge, "--set", f"optimizer.optimizer_offload_fraction={v}"],
               {"c.yaml": FLAT})
    fp8 = ["--gpus", "16", "--set", "mixed_precision=bf16_with_fp8_delayed_scaling_mixed", "--set",
           "model.fp8_dot_product_attention=true", "--set", "model.context_parallel_size=2"]
    for v in ("p2p", "P2P", "[p2p, p2p, p2p, p2p]", "[p2p, all_gather, p2p, p2p]", "[p2p]", "[p2p, p2p]", "[P2P, p2p, p2p, p2p]",
              "[1, 2, 3, 4]", "[[p2p], p2p, p2p, p2p]", "[null, p2p, p2p, p2p]", "null", "[]", "a2a", "'a2a '", "{a: 1}",
              "[a2a, p2p, p2p, p2p]", "allgather", "[all_gather,all_gather,all_gather,all_gather]", "'p2p,p2p,p2p,p2p'", "1",
              "true", "'???'", "[" + ", ".join(["p2p"] * 5000) + "]"):
        yield f"estimate FP8 attention cp_comm_type={v[:30]}", ["estimate", "--config", "c.yaml", *fp8, "--set",
                                                                 f"model.cp_comm_type={v}"], {"c.yaml": FLAT}
    evs = [*S, "--global-batch-size", "16"]
    for flag in ("--eval-micro-batch-size", "--eval-global-batch-size", "--eval-iters"):
        for v in ("0", "-1", "-0", "1" + "0" * 30, "9" * 5000, "1e3", "0x10", "+4", "\u0664", "4_0", " 4", "4.0", str(2**62)):
            yield f"estimate {flag} {v[:20]!r}", ["estimate", "--world-size", "2", "--", *evs, flag, v], {}
    for v in ("0", "-1", "1e309", ".nan", "'4'", "4.0", "-0.0", "9" * 5000, str(2**62), "true", "[4]"):
        for key in ("eval_micro_batch_size", "eval_iters", "eval_global_batch_size"):
            yield (f"estimate Bridge validation.{key}={v[:20]}", [*bridge, "--set", "validation.eval_micro_batch_size=4",
                                                                   "--set", f"validation.{key}={v}"], {"c.yaml": FLAT})
    # YAML structure in every reader
    values = ["${model.num_layers}", "${model.x1}\n  x1: ${model.num_layers}", "${nope:1}", "${oc.env:HOSTILE14_UNSET}",
              "${oc.env:HOSTILE14_UNSET,4}", "${oc.select:model.nope,4}", "${oc.dict.keys:model}", "1" * 4301, "-0.0",
              "1e309", "0x10", "0o17", "1_000", ".5", "!!python/object/apply:os.system ['true']", "!!python/name:os.system",
              "!!set {a, b}", "2001-12-14", "!!int '4'", "!foo 4", "4\n  <<: {hidden_size: 4096}", "4\n  num_layers: 8",
              "&x ${model.num_layers}"]
    nemo, nemo_o = seeds["nemo1_llama.yaml"]
    for v in values:
        yield f"validate NeMo 1 num_layers: {v[:40]!r}", ["validate", "c.yaml", *nemo_o], {
            "c.yaml": nemo.replace("  num_layers: 32 ", f"  num_layers: {v} ", 1)}
    for key in ("1", "true", "on", "1.5", "null", "~", "'1'", "[a, b]", "? [a]\n  "):
        for name, anchor in (("nemo1_llama.yaml", "model:\n"), ("nemo1_llama.yaml", "trainer:\n"), ("launcher.yaml", "model:\n"),
                             ("functional.yaml", "MODEL_ARGS:\n"), ("functional.yaml", "ENV_VARS:\n"),
                             ("bridge_override.yaml", "model:\n"), ("context_model.yaml", "config:\n")):
            text, opts = seeds[name]
            nxt = text[text.index(anchor) + len(anchor):].split("\n")[0]
            indent = nxt[:len(nxt) - len(nxt.lstrip())]
            files = {name: text.replace(anchor, f"{anchor}{indent}{key}: 4\n", 1)}
            cmd = ["estimate", "--config", name, *opts] if name == "bridge_override.yaml" else ["validate", name, *opts]
            yield f"{cmd[0]} {name} {anchor.strip()} key {key!r}", cmd, files
            yield f"{cmd[0]} {name} top-level key {key!r}", cmd, {name: f"{key}: 4\n" + text}
        yield f"estimate Bridge model key {key!r}", bridge, {"c.yaml": FLAT.replace("model:\n", f"model:\n  {key}: 4\n", 1)}
        yield f"estimate Bridge top-level key {key!r}", bridge, {"c.yaml": f"{key}: 4\n" + FLAT}
        yield (f"estimate --yaml-cfg key {key!r}", ["estimate", "--world-size", "8", "--", "--yaml-cfg", "y.yaml"],
               {"y.yaml": f"{key}: 4\nlanguage_model: {{num_layers: 4}}\nmodel_parallel: {{{key}: 1}}\n"})
    # launch scripts
    s = " ".join(S) + " --global-batch-size 16"
    run = "torchrun --nproc-per-node 8 pretrain_gpt.py "
    scripts = [f"cat <<EOF > x\n--num-layers 99\nEOF\n{run}{s}\n", f"cat <<'EOF' > r.sh\n{run}{s}\nEOF\n{run}{s}\n",
               f"cat <<-EOF\n\t{run}{s}\n", f"exec {run}{s}\n", f"ARGS=({s})\n{run}\"${{ARGS[@]}}\"\n",
               f"ARGS=({s})\n{run}${{ARGS[*]}}\n", f"ARGS=({s})\nARGS+=(--num-layers 8)\n{run}\"${{ARGS[@]}}\"\n",
               f"A=\"{s}\"\nA+=\" --num-layers 8\"\n{run}$A\n", f"ARGS=({s})\n{run}\"${{ARGS[@]:0:4}}\"\n",
               f"declare -a ARGS=({s})\n{run}\"${{ARGS[@]}}\"\n", f"{run}{s} \"--num-layers\\\n\" 8\n",
               f"{run}{s} '--num-\\\nlayers' 8\n", f"{run}\\\r\n {s}\r\n", f"{run}{s}\r\n", f"{run}\\\r {s}\r",
               f"\ufeff{run}{s}\n", f"\ufeff#!/bin/bash\n{run}{s}\n", f"set -- {s}\n{run}\"$@\"\n",
               f"torchrun --nproc-per-node ${{X:-4}} pretrain_gpt.py {s}\n", f"torchrun --nproc-per-node ${{X:?need X}} pretrain_gpt.py {s}\n",
               f"torchrun --nproc-per-node ${{X:=4}} pretrain_gpt.py {s} --tensor-model-parallel-size $X\n",
               f"X=8.5\ntorchrun --nproc-per-node ${{X%%.*}} pretrain_gpt.py {s}\n", f"{run}{s} --save \"a'b\"\"c'd\" --save-interval 1\n",
               f"{run}{s} \"$(echo \"--num-layers\")\" 8\n", f"{run}{s} $'--num-layers' 8\n", f"{run}{s} --num-layers {{4,8}}\n",
               f"torchrun --nproc-per-node $((2**62)) pretrain_gpt.py {s}\n", f"run() {{ {run}{s} \"$@\"; }}\nrun --num-layers 8\n",
               f"{run}{s} --num-layers\x008\n", f"CMD=\"{run}{s}\"\neval \"$CMD\"\n", f"X=${{X:-${{X:-${{X}}}}}}\n{run}{s}\n",
               "A=(x)\n" + "A=(\"${A[@]}\" \"${A[@]}\")\n" * 30 + f"{run}{s} --save \"${{A[*]}}\" --save-interval 1\n",
               "A=(x)\n" + "A=(${A[@]} ${A[@]})\n" * 30 + f"{run}{s}\n", "A=(x)\n" + "A+=(\"${A[@]}\")\n" * 30 + f"{run}{s}\n",
               "set -- x\n" + "set -- \"$@\" \"$@\"\n" * 30 + f"{run}{s}\n", "ARGS=(" + " x" * 99_000 + ")\n" + f"{run}{s} \"${{ARGS[@]}}\"\n",
               "ARGS=(" + " x" * 470_000 + ")\n" + f"{run}{s} \"${{ARGS[@]}}\"\n", f"{run}{s}" + " x" * 470_000 + "\n",
               f"{run}{s}" + " --bf16" * 130_000 + "\n", "A=(x)\n" + f"{run}{s}" + " \"${A[@]}\"" * 99_000 + "\n"]
    for text in scripts:
        label = text.replace("\n", "\\n")[:60]
        yield f"check script {label!r}", ["check", "--file", "run.sh"], {"run.sh": text}
        yield f"estimate script {label!r}", ["estimate", "--config", "run.sh"], {"run.sh": text}
    # memguard plan over 720,720 GPUs (the most divisors, 240, under the 2**20 bound) and --top bounds
    for model in ("llama-3.2-1b", "mixtral-8x7b", "qwen3-30b-a3b"):
        yield f"plan 720720 GPUs {model}", ["plan", "--seq-length", "4096", "--gpus", "720720", "--global-batch-size", "720720",
                                           "--model", model, "--top", "50"], {}
    # issue plancap: Mixtral in fp32 at 131,072 tokens where nothing fits (589 and 1,851 layouts were estimated)
    for gpus in ("4096", "720720"):
        yield f"plan {gpus} GPUs mixtral-8x7b fp32 seq 131072 --cp", [
            "plan", "--seq-length", "131072", "--gpus", gpus, "--global-batch-size", gpus, "--model", "mixtral-8x7b",
            "--cp", "1,2,4,8,16,32"], {}
    for top in ("0", "-1", "9" * 30, "1e3", "nan", "51", "2147483648"):
        yield f"plan --top {top[:20]}", ["plan", "--seq-length", "4096", "--gpus", "720720", "--global-batch-size", "720720",
                                         "--model", "llama-3.2-1b", "--top", top], {}
    yield "plan 720720 GPUs --tp 1..1999", ["plan", "--seq-length", "4096", "--gpus", "720720", "--global-batch-size", "720720",
                                             "--model", "llama-3.2-1b", "--tp", ",".join(str(i) for i in range(1, 2000))], {}
    yield "plan 720720 GPUs --mbs 1..4999", ["plan", "--seq-length", "4096", "--gpus", "720720", "--global-batch-size", "720720",
                                              "--model", "llama-3.2-1b", "--mbs", ",".join(str(i) for i in range(1, 5000))], {}


def hostile15_cases():
    """Issue hostile15 (the fifteenth round): launch-script forms bash reads and memguard now follows (set -- / "$@" /
    $N / $# / shift, ${#X}, ${A[@]:o:n} / ${X:o:n} slices, $((arithmetic)) with its overflow / division / precedence,
    functions (one-line, multi-line, recursive, never called), eval, export lists, source, here-strings, backslashes
    followed by spaces) with hostile values; MoE-only flags on a dense model (megatron-core's unguarded
    TransformerConfig rules); and Bridge bool fields given any value, as Bridge's override path takes it."""
    from test_readers_bridge import FLAT
    s = " ".join(S) + " --global-batch-size 16"
    run = "torchrun --nproc-per-node 8 pretrain_gpt.py "
    arith = ["2**63", "2**64", "-2**63 / -1", "1/0", "5%0", "2**-1", "1<<64", "(" * 70 + "1" + ")" * 70, "-" * 70 + "1",
             "9" * 30, "0x7fffffffffffffff + 1", "08", "N++", "a=4", "1 ? 2 : 3", "1,2", "2#101", "$1", "$(echo 4)", "",
             " + ".join(["1"] * 20_000), "2**2**2**2**2**2", "X", "${X}*2", "N" * 5000]
    scripts = [f"N=3\nX=abc\n{run}{s} --num-layers $(({a}))\n" for a in arith]
    scripts += [f"{run}{s} --num-layers ${{#{v}}}\n" for v in ("X", "X[@]", "@", "*", "#", "1", "", "!", "X[", "9" * 5000)]
    scripts += [f"X=abcdef\nA=(a b c)\n{run}{s} --save ${{{v}}} --save-interval 1\n"
                for v in ("X:1:2", "X: -2", "X:-2", "X:1:-9", "X:9", "X:2**70", "X:1/0", "A[@]:1", "A[@]:-1:1", "A[@]:0:-1",
                          "@:1", "@:0", "*:1", "X:" + "9" * 30, "X::", "X:1:2:3")]
    scripts += [f"set -- {s}\n{run}\"$@\"\n", f"set -- {s}\n{run}${{@:1:4}}\n", f"set -- {s}\nshift 99\n{run}\"$@\"\n",
                f"set -- {s}\nshift x\n{run}\"$@\"\n", f"set -e -- {s}\n{run}\"$@\"\n", f"set -x\n{run}{s} \"$@\"\n",
                f"{run}{s} \"$@\"\n", f"{run}{s} $*\n", f"{run}{s} \"${{@:2}}\"\n", f"{run}{s} $0 $# $9 ${{10}}\n",
                f"run() {{ {run}{s} \"$@\"; }}\nrun --num-layers 8\n", f"function run {{\n{run}\"$@\"\n}}\nrun {s}\n",
                f"run() {{\n{run}{s}\n", f"run() {{ {run}{s}; }}\n", "f() { f; }\nf\n" + f"{run}{s}\n",
                "f() { g; }\ng() { f; }\nf\n" + f"{run}{s}\n", "f() { f; f; }\nf\n",
                "".join(f"f{i}() {{ f{i + 1}; f{i + 1}; }}\n" for i in range(15)) + f"f15() {{ :; }}\nf0\n{run}{s}\n",
                f"CMD=\"{run}{s}\"\neval \"$CMD\"\n", f"CMD=\"{run}{s}\"\neval $CMD --num-layers 8\n",
                "E='eval \"$E\"'\neval \"$E\"\n" + f"{run}{s}\n", f"eval\n{run}{s}\n",
                f"export A=1 B C=$((2*3))\n{run}{s}\n", f"export\n{run}{s}\n", f"source\n{run}{s}\n",
                f". /dev/zero\n{run}{s}\n", f"{run}{s} <<< \"$(cat /dev/zero)\"\n", f"{run}\\ \n{s}\n",
                f"{run}\\\t\n{s}\n", f"{run}{s} '\\ '\n", f"{run}{s} \\\\ \n", f"{run}{s} \"\\ \n\" --bf16\n",
                "set -- " + " x" * 99_000 + f"\n{run}{s} \"$@\"\n", f"{run}{s}" + " $((1+1))" * 20_000 + "\n",
                f"{run}{s}" + " ${#X}" * 50_000 + "\n"]
    for text in scripts:
        label = text.replace("\n", "\\n")[:60]
        yield f"check script {label!r}", ["check", "--file", "run.sh"], {"run.sh": text}
        yield f"estimate script {label!r}", ["estimate", "--config", "run.sh"], {"run.sh": text}
    # MoE-only flags on a dense model, in both releases
    for extra in (["--moe-paged-stash"], ["--moe-expert-rank-capacity-factor", "1.5"], ["--moe-ffn-hidden-size", "512"],
                  ["--moe-ffn-hidden-size", "512", "--moe-layer-freq", "[0,1,0,1]"], ["--moe-ffn-hidden-size", "x"],
                  ["--moe-enable-deepep"], ["--moe-flex-dispatcher-backend", "ncclep"],
                  ["--moe-shared-expert-intermediate-size", "0"],
                  ["--moe-shared-expert-intermediate-size", "-" + "9" * 30],
                  ["--moe-expert-capacity-factor", "nan", "--moe-router-load-balancing-type", "sinkhorn"],
                  ["--moe-pad-expert-input-to-capacity"], ["--moe-router-enable-expert-bias"], ["--moe-router-topk", "1"],
                  ["--moe-router-topk", "x"], ["--moe-router-group-topk", "2"], ["--moe-router-padding-for-quantization"],
                  ["--moe-router-padding-for-fp8", "--fp8-format", "hybrid"]):
        for version in ("0.16.1", "0.19.2"):
            yield f"validate dense {version} {' '.join(extra)[:50]}", ["validate", "--world-size", "8", "--megatron-version",
                                                                        version, "--", *S, *extra], {}
    # Bridge bool fields given any value (a warning; comm_overlap's stay true / false)
    bridge = ["estimate", "--config", "c.yaml", "--gpus", "8"]
    for key in ("optimizer.use_precision_aware_optimizer", "optimizer.store_param_remainders", "ddp.overlap_grad_reduce",
                "ddp.use_distributed_optimizer", "dist.use_torch_fsdp2", "rerun_state_machine.check_for_nan_in_loss",
                "comm_overlap.tp_comm_overlap"):
        for v in ("x", "no", "'false'", "'0'", "2", "0.5", "nan", ".nan", "[]", "[1]", "{}", "{a: 1}", "''", "1" * 5000, "null"):
            yield f"estimate Bridge {key}={v[:20]}", [*bridge, "--set", f"{key}={v}"], {"c.yaml": FLAT}


def hostile16_cases():
    """Issue hostile16 (the sixteenth round): bash's pattern / case / indirection operators and command substitutions in
    launch scripts with hostile values (patterns that backtrack, 100,000-character values, '&' replacements that grow,
    nesting, unicode case mappings, unclosed forms); the NeMo 1 and Megatron-Bridge YAML readers under deep nesting,
    alias bombs, huge ints, NaN / inf spellings, byte-order marks, CRLF, tabs and unicode look-alike keys; Megatron flags
    written with unicode dashes; and memguard plan's options with hostile values."""
    from test_readers_bridge import FLAT
    s = " ".join(S) + " --global-batch-size 16"
    run = "torchrun --nproc-per-node 8 pretrain_gpt.py "
    big = "a" * 100_000
    pre = f"X=hello_world\nB={big}\nA=(one two)\nN=X\nM=@\nI=A[@]\nS=ß\nT=ǅ\nset -- p q\n"
    forms = ["${B//*a*a*a*a*b/}", "${B//a/&&&&&&&&}", "${B//?/${B}}", "${B/%a*b/x}", "${B##*a*a*a*c}", "${B%%a*a*b}",
             "${B^^}", "${B~~[a]}", "${X/[/x}", "${X//[!/x}", "${X//[[:bogus:]]/x}", "${X//\\/x}", "${X/#}", "${X/%}",
             "${X//}", "${X^^[}", "${X,,[[:upper:]]}", "${S^^}", "${T,,}${T^}", "${!N}", "${!M}", "${!I}", "${!I^^}",
             "${!}", "${!#}", "${!X}", "${!N/#/&}", "${!A[@]}", "${!A[*]}", "${!XYZ*}", "${!*}", "${@/p/P}", "${*^^}",
             "${1/p/&&}", "${A[@]/#/--}", "${A[*]//o/ }", "${X/$(nproc)/y}", "${X/\"$(a)\"/`b`}", "${X/'/x}", '${X/"/x}',
             "${X/" + "${X/" * 40 + "l" + "}" * 40 + "/y}", "${X" + "//a" * 5000 + "}", "${X/" + "*" * 20_000 + "/y}",
             "${X/" + "[a]" * 5000 + "/y}", "${X//&/&}", "${X/hello/\\&\\\\&}"]
    scripts = [f"{pre}{run}{s} --save {f} --save-interval 1\n" for f in forms]
    subst = ["$(nproc)", "`nproc`", "$(( $(nproc) * 2 ))", "$((`nproc` + 1))", "$( \"a)\" )", "$(echo \"$(echo ')')\")",
             "$(", "`", "$((", "$(" * 5000, "`" * 5001, "$(printf '%s' \"$(hostname)\")", "$(<file)", "$(( N++ ))",
             "$(cat <<EOF\n4\nEOF\n)", "$(echo $(echo $(echo 4)))", "\"$(nproc)\"", "'$(nproc)'", "\\$(nproc)"]
    for v in subst:
        scripts += [f"{run}{s} --micro-batch-size {v}\n", f"{run}{s} --seed {v} --lr {v}\n",
                    f"MBS={v}\n{run}{s} --micro-batch-size $MBS\n", f"ARGS=(--tensor-model-parallel-size {v})\n{run}{s} "
                    "\"${ARGS[@]}\"\n", f"torchrun --nproc-per-node {v} pretrain_gpt.py {s}\n"]
    scripts += [f"{run}{s}" + " --seed $(date)" * 20_000 + "\n", f"{run}{s}" + " $(x)" * 30_000 + "\n",
                "X=$(a)\n" * 20_000 + f"{run}{s} --micro-batch-size $X\n"]
    for text in scripts:
        label = text.replace("\n", "\\n")[:70]
        yield f"check script {label!r}", ["check", "--file", "run.sh"], {"run.sh": text}
        yield f"estimate script {label!r}", ["estimate", "--config", "run.sh"], {"run.sh": text}
    # unicode dashes and look-alikes in Megatron flags (after --, in a launch script, in a --yaml-cfg mapping)
    for dash in ("\u2013-", "\u2014", "\u2212\u2212", "\uff0d\uff0d", "\u2010\u2010", "-\u2013", "\u2011-", "\ufe63\ufe63"):
        flag = dash + "micro-batch-size"
        yield f"estimate {flag!r}", ["estimate", "--world-size", "8", "--", *S, flag, "2"], {}
        yield f"estimate {flag!r}=2", ["estimate", "--world-size", "8", "--", *S, flag + "=2"], {}
        yield f"check script {flag!r}", ["check", "--file", "run.sh"], {"run.sh": f"{run}{s} {flag} 2\n"}
    for flag in ("--micro\u2010batch-size", "--micro-batch-size\u200b", "--micro-batch-size\u00a02", "--\u200bbf16",
                 "--ｍicro-batch-size", "--micro_batch\u2013size"):
        yield f"estimate {flag!r}", ["estimate", "--world-size", "8", "--", *S, flag, "2"], {}
    # NeMo 1 and Bridge YAML: values at a shape key, and whole-file mutations
    nemo = dict((n, t) for n, t, _ in YAML_SEEDS)["nemo1_llama.yaml"]
    values = ["[" * 10_000 + "]" * 10_000, "{a: " * 3000 + "1" + "}" * 3000, alias_bomb(6), alias_bomb(8, 12),
              "9" * 5000, "-" + "9" * 5000, "1e400", "-1e400", ".nan", ".NaN", "NaN", "nan", "'nan'", ".inf", "-.inf", "inf",
              "'inf'", "'Infinity'", "0x7fffffffffffffff", "0x" + "f" * 40, "1_000", "0o17", "0b1010", "+12", "12.0",
              "!!float 4", "!!int '4'", "!!binary aGk=", "!!python/object:os.system x", "*undefined", "&a 4", "~", "''",
              "'\u0664'", "\u0664", "\uff14", "'4\u200b'", "4 # comment", "|\n    4", ">-\n    4"]
    for v in values:
        yield f"validate NeMo 1 num_layers {v[:30]!r}", ["validate", "c.yaml", "--gpus", "8"], {"c.yaml": _nemo(v)}
        yield f"estimate Bridge num_layers={v[:30]!r}", ["estimate", "--config", "c.yaml", "--gpus", "8", "--set",
                                                        f"model.num_layers={v}"], {"c.yaml": FLAT}
    look = {"BOM": lambda x: "\ufeff" + x, "2 BOMs": lambda x: "\ufeff\ufeff" + x, "CRLF": lambda x: x.replace("\n", "\r\n"),
            "CR": lambda x: x.replace("\n", "\r"), "tabs": lambda x: x.replace("  ", "\t"),
            "tab after colon": lambda x: x.replace(": ", ":\t"), "NEL": lambda x: x.replace("\n", "\u0085"),
            "LS": lambda x: x.replace("\n", "\u2028"), "NUL": lambda x: x.replace("\n", "\n\0", 3),
            "look-alike key": lambda x: x.replace("num_layers", "num_lаyers"),     # a Cyrillic 'а'
            "fullwidth key": lambda x: x.replace("num_layers", "ｎum_layers"), "zero-width key": lambda x:
            x.replace("num_layers", "num_\u200blayers"), "duplicated key": lambda x: x.replace("num_layers: ", "num_layers: 2\n  num_layers: ", 1),
            "deep doc": lambda x: x + "\nextra: " + "[" * 20_000 + "]" * 20_000 + "\n",
            "alias bomb doc": lambda x: x + "\nextra: " + alias_bomb(9, 10) + "\n",
            "anchored model": lambda x: x.replace("model:", "model: &m", 1) + "\nother: *m\n",
            "merge key loop": lambda x: x + "\nbase: &b {a: 1}\nloop: {<<: [*b, *b, *b, *b]}\n"}
    for name, f in look.items():
        yield f"validate NeMo 1 {name}", ["validate", "c.yaml", "--gpus", "8"], {"c.yaml": f(nemo)}
        yield f"estimate Bridge {name}", ["estimate", "--config", "c.yaml", "--gpus", "8"], {"c.yaml": f(FLAT)}
        yield f"check script {name}", ["check", "--file", "run.sh"], {"run.sh": f(f"#!/bin/bash\n{run}{s}\n")}
    # memguard plan's options
    plan = ["plan", "--gpus", "8", "--seq-length", "512", "--global-batch-size", "64"]
    model = ["--", *S]
    for opt, vals in (("--gpus", ["0", "-8", "1e400", "nan", "9" * 5000, "8.5", "0x10", "\u0668"]),
                      ("--seq-length", ["0", "-1", "inf", "2**70", "9" * 400, "\uff15\uff11\uff12"]),
                      ("--global-batch-size", ["0", "nan", "1e30", "7", "-" + "9" * 30]),
                      ("--tp", ["0", "3", "1,2", "9" * 40]), ("--pp", ["-1", "8", "nan"]), ("--cp", ["0", "16"]),
                      ("--vpp", ["0", "99999999999"]), ("--mbs", ["0", "1e9", "x"]), ("--max-tp", ["0", "-1", "1e3"]),
                      ("--recompute", ["", "x", "full,full", "selective," * 2000]), ("--fsdp", ["", "x", "optim," * 5000]),
                      ("--fp8", ["", "x", "tensorwise\u200b", "TENSORWISE"]), ("--ep", ["0", "3", "9" * 30]),
                      ("--etp", ["0", "-2"]), ("--network-gbps", ["0", "-1", "nan", "inf", "1e400"]),
                      ("--gemm-efficiency", ["0", "1.5", "nan", "-0.0"]), ("--attention-efficiency", ["2", "inf"]),
                      ("--top", ["0", "-1", "10**9", "9" * 5000]), ("--tie-window", ["-1", "nan", "2"]),
                      ("--threshold", ["0", "1.6", "nan"]), ("--gpu-memory", ["0", "1e400GiB", "-80GiB", "80 GiB GiB"]),
                      ("--explain", ["x", "TP1 PP1", "\u2013"]), ("--plot-layouts", ["0", "-1", "x", "all"]),
                      ("--megatron-version", ["", "0.16.1\u200b", "99", "0.19.2" * 1000])):
        for v in vals:
            yield f"plan {opt} {v[:30]!r}", [*plan, opt, v, *model], {}
    yield "plan --config run.sh with $(nproc)", [*plan, "--config", "run.sh"], {
        "run.sh": f"{run}{s} --seq-length $(nproc) --micro-batch-size $(nproc) --tensor-model-parallel-size `x`\n"}
    yield "plan --config run.sh with ${X^^}", [*plan, "--config", "run.sh"], {"run.sh": f"X=bf16\n{run}{s} --${{X,,}}\n"}


def hostile17_files(d: str) -> dict[str, str]:
    """Files that are no regular text file, made in ``d`` (named ``*.yaml`` / ``*.log`` / ``*.jsonl`` so every reader
    takes them by name): a named pipe nobody writes to, a 2 GiB sparse file, a file nobody may read (mode 000; root
    reads it all the same), Latin-1 and lone 0xff bytes, UTF-16 with and without its BOM, UTF-32, an empty file, a
    directory and a symlink loop; and /dev/zero, /dev/urandom."""
    out = {}
    for ext in ("yaml", "log", "jsonl", "json"):
        sub = os.path.join(d, "h17-" + ext)
        os.makedirs(sub, exist_ok=True)
        paths = {}
        fifo = os.path.join(sub, f"fifo.{ext}")
        if not os.path.exists(fifo):
            os.mkfifo(fifo)
        paths["a named pipe"] = fifo
        sparse = os.path.join(sub, f"sparse.{ext}")
        with open(sparse, "wb") as f:
            f.truncate(2 * 2**30)
        paths["a 2 GiB sparse file"] = sparse
        text = "schema: memguard.site/1\nconstants: {cuda_context: 600MiB}\n"
        for label, data in (("mode 000", text.encode()), ("Latin-1", "name: caf\xe9\n".encode("latin-1") + text.encode()),
                            ("0xff bytes", b"\xff\xfe\xff" * 100), ("UTF-16 BOM", text.encode("utf-16")),
                            ("UTF-16-LE no BOM", text.encode("utf-16-le")), ("UTF-32", text.encode("utf-32")),
                            ("empty", b"")):
            path = os.path.join(sub, label.replace(" ", "_") + "." + ext)
            with open(path, "wb") as f:
                f.write(data)
            if label == "mode 000":
                os.chmod(path, 0)
            paths[label] = path
        paths["a directory"] = os.path.join(sub, "dir." + ext)
        os.makedirs(paths["a directory"], exist_ok=True)
        loop = os.path.join(sub, "loop." + ext)
        if not os.path.lexists(loop):
            os.symlink(loop, loop)
        paths["a symlink loop"] = loop
        paths.update({"/dev/zero": "/dev/zero", "/dev/urandom": "/dev/urandom"})
        out.update({f"{ext} {k}": v for k, v in paths.items()})
    return out


def hostile17_cases(d: str):
    """Issue hostile17 (the seventeenth round), over the surfaces earlier rounds touched least: files that are no regular
    text file (hostile17_files) at every argument and variable that names a config, log or profile; memguard calibrate on
    binary, cut, mixed-era Megatron logs with NaN / inf / negative / huge iteration and memory values, duplicate ranks
    and only a warm-up iteration; site profiles (schema /1 and /2) with hostile time constants, unknown keys and newer
    schemas in every command that takes --site-profile, the launch's --memguard-profile or MEMGUARD_PROFILE; memguard
    report on damaged runtime JSONL; memguard plan --explain with option combinations; NeMo / Bridge overrides of a
    launch line holding command substitutions; and the MEMGUARD_* variables. ``d``: a directory for the files."""
    from megatron_logs import args_of, print_args, report_memory, training_log
    from test_calibrate_time import iteration_line
    files = hostile17_files(d)
    run = "torchrun --nproc-per-node 8 pretrain_gpt.py "
    s = " ".join(S) + " --global-batch-size 16"
    prof_opt = ["--site-profile"]
    jsonl = {"memguard-rank00000.jsonl": json.dumps(RUNLOG[0]) + "\n" + json.dumps(RUNLOG[1]) + "\n"}
    log_text = "\n".join(print_args(args_of([*S, "--train-iters", "10"], 8))) + "\n" + \
        "\n".join(report_memory(r, "(after 1 iterations)", 2**30, 2**31, 2**31 + 2**29, 2**31 + 2**30, 2**32)
                  for r in range(8)) + "\n"
    # -- files that are no regular text file, everywhere a file is named ----------------------------------------------
    for kind, p in files.items():
        ext = kind.split()[0]
        if ext == "yaml":
            yield f"estimate --config {kind}", ["estimate", "--config", p, "--world-size", "8"], {}
            yield f"validate {kind}", ["validate", p, "--gpus", "8"], {}
            yield f"plan --config {kind}", [*PLAN, "--config", p], {}
            yield f"estimate --yaml-cfg {kind}", ["estimate", "--world-size", "8", "--", "--yaml-cfg", p], {}
            yield f"estimate --tp-comm-overlap-cfg {kind}", ["estimate", "--world-size", "8", "--", *S, "--sequence-parallel",
                                                             "--tensor-model-parallel-size", "2", "--tp-comm-overlap",
                                                             "--tp-comm-overlap-cfg", p], {}
            for cmd in (["estimate", "--world-size", "8", "--", *S], ["validate", "--world-size", "8", "--", *S],
                        [*PLAN, "--", *S], ["check", "--", *run.split(), *S],
                        ["report", "."], ["calibrate", "a.log", "b.log", "c.log"]):
                files_ = jsonl if cmd[0] == "report" else {n: log_text for n in ("a.log", "b.log", "c.log")} \
                    if cmd[0] == "calibrate" else {}
                at = cmd.index("--") if "--" in cmd else len(cmd)
                yield f"{cmd[0]} --site-profile {kind}", [*cmd[:at], *prof_opt, p, *cmd[at:]], files_
                yield f"{cmd[0]} MEMGUARD_PROFILE={kind}", cmd, files_, {"MEMGUARD_PROFILE": p}
            yield f"check launch MEMGUARD_PROFILE={kind}", ["check", "--file", "run.sh"], {
                "run.sh": f"export MEMGUARD_PROFILE={p}\n{run}{s}\n"}
            yield f"check launch --memguard-profile {kind}", ["check", "--file", "run.sh"], {
                "run.sh": f"{run}{s} --memguard-profile {p}\n"}
        elif ext == "log":
            yield f"report {kind}", ["report", p], {}
            yield f"report --format megatron {kind}", ["report", "--format", "megatron", p], {}
            yield f"calibrate {kind}", ["calibrate", p, "a.log", "b.log"], {"a.log": log_text, "b.log": log_text}
            yield f"check --file {kind}", ["check", "--file", p], {}
            yield f"estimate --config run.sh at {kind}", ["estimate", "--config", p], {}
        elif ext == "jsonl":
            yield f"report jsonl {kind}", ["report", "--format", "jsonl", p], {}
        else:
            yield f"estimate --model {kind}", ["estimate", "--model", p, "--world-size", "8"], {}
            yield f"estimate --heterogeneous-layers-config-path {kind}", [
                "estimate", "--world-size", "8", "--", *S, "--heterogeneous-layers-config-path", p], {}
    # -- site profiles with hostile values, in every command that reads one ---------------------------------------------
    head2 = "schema: memguard.site/2\nmemguard_version: 0.1.0.dev0\ngpu: H100-80GB\n"
    profiles = {f"time.{k}={v}": f"{head2}time: {{{k}: {v}}}\n" for k in ("gemm_efficiency", "attention_efficiency", "network_gbps")
                for v in (".nan", "-.inf", ".inf", "-0.5", "0", "1e400", "'0.7'", "x", "true", "[0.7]", "{a: 1}", "null", "~",
                          "0x10", "1e-320", "72001", "0.009", "9" * 5000)}
    profiles.update({
        "time without gpu": "schema: memguard.site/2\ntime: {gemm_efficiency: 0.7}\n",
        "time on schema /1": "schema: memguard.site/1\ngpu: H100-80GB\ntime: {gemm_efficiency: 0.7}\n",
        "time on an unknown gpu": "schema: memguard.site/2\ngpu: Z9000\ntime: {gemm_efficiency: 0.7}\n",
        "gpu a list": "schema: memguard.site/2\ngpu: [H100-80GB]\ntime: {gemm_efficiency: 0.7}\n",
        "gpu 5000 chars": "schema: memguard.site/2\ngpu: " + "H" * 5000 + "\ntime: {gemm_efficiency: 0.7}\n",
        "time unknown key": f"{head2}time: {{gemm_eff: 0.7}}\n", "time a list": f"{head2}time: [0.7]\n",
        "time a string": f"{head2}time: fast\n", "time 10,000 keys": head2 + "time: {" + ", ".join(f"k{i}: 1" for i in range(10_000)) + "}\n",
        "time empty": f"{head2}time: {{}}\n", "time null": f"{head2}time: ~\n",
        "unknown top key": f"{head2}extra: 1\n", "schema /3": "schema: memguard.site/3\n",
        "schema /999999": "schema: memguard.site/999999\n", "schema /0": "schema: memguard.site/0\n",
        "schema /-1": "schema: memguard.site/-1\n", "schema /1.5": "schema: memguard.site/1.5\n",
        "schema /02": "schema: memguard.site/02\n", "schema number": "schema: 2\n", "no schema": "constants: {}\n",
        "schema with 5000 digits": "schema: memguard.site/" + "9" * 5000 + "\n",
        "newer version": "schema: memguard.site/2\nmemguard_version: 99.0\n",
        "version 5000 digits": "schema: memguard.site/2\nmemguard_version: '" + "9" * 5000 + "'\n",
        "version a number": "schema: memguard.site/2\nmemguard_version: 0.1\n",
        "constants.cuda_context .nan": "schema: memguard.site/1\nconstants: {cuda_context: .nan}\n",
        "constants.cuda_context -1": "schema: memguard.site/1\nconstants: {cuda_context: -1}\n",
        "constants.allocator_fragmentation 'nan%'": "schema: memguard.site/1\nconstants: {allocator_fragmentation: 'nan%'}\n",
        "constants.allocator_fragmentation 'inf%'": "schema: memguard.site/1\nconstants: {allocator_fragmentation: 'inf%'}\n",
        "constants.allocator_fragmentation '1e400%'": "schema: memguard.site/1\nconstants: {allocator_fragmentation: '1e400%'}\n",
        "constants.nccl_per_communicator 1e400MiB": "schema: memguard.site/1\nconstants: {nccl_per_communicator: 1e400MiB}\n",
        "constants.cuda_context 1e30": "schema: memguard.site/1\nconstants: {cuda_context: 1e30}\n",
        "constants.cuda_context 2**70": f"schema: memguard.site/1\nconstants: {{cuda_context: {2**70}}}\n",
        "fit a list": "schema: memguard.site/1\nfit: [1]\n", "created a list": "schema: memguard.site/1\ncreated: [1]\n",
        "created a date": "schema: memguard.site/1\ncreated: 2026-01-01\n", "name a mapping": "schema: memguard.site/1\nname: {a: 1}\n",
        "a YAML list": "- schema: memguard.site/1\n", "a scalar": "memguard.site/1\n", "two documents": "schema: memguard.site/1\n---\nx: 1\n",
        "BOM": "\ufeffschema: memguard.site/2\ngpu: H100-80GB\ntime: {gemm_efficiency: 0.7}\n",
        "CRLF": "schema: memguard.site/2\r\ngpu: H100-80GB\r\ntime: {gemm_efficiency: 0.7}\r\n",
        "alias bomb": "schema: memguard.site/1\nfit: " + alias_bomb(8, 10) + "\n"})
    plan_gpu = [*PLAN, "--gpu", "H100-80GB"]
    for label, text in profiles.items():
        for cmd in (["estimate", "--world-size", "8", "--site-profile", "p.yaml", "--", *S],
                    ["validate", "--world-size", "8", "--site-profile", "p.yaml", "--", *S],
                    ["check", "--site-profile", "p.yaml", "--", *run.split(), *S],
                    [*plan_gpu, "--site-profile", "p.yaml", "--", *S], ["plan", "--site-profile", "p.yaml", *PLAN[1:], "--", *S],
                    [*plan_gpu, "--site-profile", "p.yaml", "--explain", "tp=1,pp=1,cp=1,mbs=1", "--", *S],
                    ["report", ".", "--site-profile", "p.yaml"], ["calibrate", "a.log", "b.log", "c.log", "--site-profile", "p.yaml"]):
            files_ = dict(jsonl) if cmd[0] == "report" else {n: log_text for n in ("a.log", "b.log", "c.log")} \
                if cmd[0] == "calibrate" else {}
            yield f"{cmd[0]} --site-profile {label[:40]}", cmd, {**files_, "p.yaml": text}
        yield f"estimate MEMGUARD_PROFILE {label[:40]}", ["estimate", "--world-size", "8", "--", *S], {"p.yaml": text}, \
            {"MEMGUARD_PROFILE": "p.yaml"}
        yield f"plan MEMGUARD_PROFILE {label[:40]}", [*PLAN, "--", *S], {"p.yaml": text}, {"MEMGUARD_PROFILE": "p.yaml"}
        yield f"check launch --memguard-profile {label[:40]}", ["check", "--file", "run.sh"], {
            "p.yaml": text, "run.sh": f"{run}{s} --memguard-profile p.yaml\n"}
        yield f"check launch MEMGUARD_PROFILE {label[:40]}", ["check", "--file", "run.sh"], {
            "p.yaml": text, "run.sh": f"MEMGUARD_PROFILE=p.yaml {run}{s}\n"}
    # -- memguard calibrate on hostile Megatron logs ----------------------------------------------------------------
    def mlog(flags: list[str], ws: int, its: list[str], mem_era: str = "0.19", ranks: list[int] | None = None,
             alloc: str | None = None) -> str:
        mem = [report_memory(r, "(after 10 iterations)", 2**30, 2**31, 2**31 + 2**29, 2**31 + 2**30,
                             device_used=2**32 if mem_era != "old" else None, era=mem_era) for r in (ranks or range(ws))]
        if alloc is not None:
            mem = [m.replace("| allocated: 1024.00", f"| allocated: {alloc}").replace("| allocated: 1024.0", f"| allocated: {alloc}")
                   for m in mem]
        return "\n".join(print_args(args_of(flags, ws))) + "\n" + "\n".join(its) + "\n" + "\n".join(mem) + "\n"
    its = [iteration_line(1, 100, 9000.0, 10.0), iteration_line(10, 100, 1200.0, 150.0), iteration_line(20, 100, 1210.0, 149.0)]
    base = [[*S, "--global-batch-size", "16", "--train-iters", "100"],
            [*S, "--global-batch-size", "16", "--train-iters", "100", "--recompute-activations"],
            [*S, "--global-batch-size", "32", "--train-iters", "100"]]
    good = {f"r{i}.log": mlog(f, 8, its) for i, f in enumerate(base)}
    calib = ["calibrate", "r0.log", "r1.log", "r2.log", "--gpu", "H100-80GB"]
    bad_its = {}
    for v in ("nan", "inf", "-inf", "-1200.0", "0.0", "1e400", "9" * 400, "1e-320", "1,200.0", "0x10", "", "x"):
        bad_its[f"elapsed {v!r}"] = [its[0], its[1].replace("1200.0", v), its[2].replace("1210.0", v)]
        bad_its[f"TFLOP/s {v!r}"] = [its[0], its[1].replace("150.0", v), its[2].replace("149.0", v)]
    for v in ("-1", "0", "9" * 400, "1e400", "x", "nan"):
        bad_its[f"iteration number {v!r}"] = [its[0], its[1].replace("      10/", f" {v}/"), its[2]]
        bad_its[f"of total {v!r}"] = [its[0], its[1].replace("/     100", f"/ {v}"), its[2]]
    bad_its.update({"only the warm-up line": its[:1], "no iteration line": [], "the warm-up line 1,000 times": its[:1] * 1000,
                    "one line 1,000 times": [its[1]] * 1_000, "iterations backwards": its[::-1],
                    "a line cut mid-number": [its[0], its[1][:its[1].index("1200") + 2], its[2]],
                    "lines cut in half": [x[:len(x) // 2] for x in its], "lines spliced": ["".join(its)],
                    "a 64 KiB line": [its[0], its[1] + "x" * 65_536, its[2]], "NUL inside": [x.replace("|", "\x00|", 2) for x in its],
                    "colour codes": ["\x1b[32m" + x + "\x1b[0m" for x in its], "CR progress": ["\r".join(its)]})
    for label, lines in bad_its.items():
        yield f"calibrate iteration lines {label}", calib, {**good, "r2.log": mlog(base[2], 8, lines)}
        yield f"calibrate all runs' iteration lines {label}", calib, {n: mlog(f, 8, lines) for n, f in zip(good, base)}
    for v in ("nan", "inf", "-inf", "-1024.00", "1e400", "9" * 400, "1e-320", "0"):
        yield f"calibrate memory allocated {v!r}", calib, {**good, "r2.log": mlog(base[2], 8, its, alloc=v)}
        yield f"report memory allocated {v!r}", ["report", "r2.log"], {"r2.log": mlog(base[2], 8, its, alloc=v)}
    yield "calibrate duplicate ranks", calib, {**good, "r2.log": mlog(base[2], 8, its, ranks=[0, 0, 0, 1, 1, 2, 2, 2])}
    yield "calibrate rank 7 only, 1,000 times", calib, {**good, "r2.log": mlog(base[2], 8, its, ranks=[7] * 1000)}
    yield "calibrate mixed eras", calib, {**good, "r2.log": mlog(base[2], 8, its, mem_era="old")}
    yield "calibrate mixed eras in one log", calib, {**good, "r2.log": mlog(base[2], 8, its) + mlog(base[2], 8, its, mem_era="old")}
    yield "calibrate an old-era log", ["calibrate", "r0.log", "r1.log", "r2.log"], {
        n: mlog(f, 8, [training_log(10, 100, 80, 16)], mem_era="old") for n, f in zip(good, base)}
    yield "calibrate binary", calib, {**good, "r2.log": bytes(range(256)) * 3000}
    yield "calibrate binary with an argument table", calib, {**good, "r2.log": good["r2.log"].encode() + bytes(range(256)) * 2000}
    yield "calibrate cut in the argument table", calib, {**good, "r2.log": good["r2.log"][:500]}
    yield "calibrate 5,000 memory lines", calib, {**good, "r2.log": good["r2.log"] + "\n".join(
        report_memory(i % 8, f"(after {i} iterations)", 2**30, 2**31, 2**31, 2**31) for i in range(5_000)) + "\n"}
    yield "calibrate the same run three times", ["calibrate", "r0.log", "r0.log", "r0.log", "--gpu", "H100-80GB"], good
    yield "calibrate --fit time constants, memory lines only", [*calib, "--fit", "gemm_efficiency"], {
        n: mlog(f, 8, []) for n, f in zip(good, base)}
    yield "calibrate --out at a FIFO", [*calib, "--out", files["yaml a named pipe"]], good
    # -- memguard report on damaged runtime JSONL -------------------------------------------------------------------
    recs = [json.dumps(r) for r in RUNLOG]
    text = "\n".join(recs) + "\n"
    damaged = {"cut last line": text[:-20], "cut last line, no newline": text.rstrip("\n")[:-1],
               "last line only '{'": text + "{", "a NUL at the end": text + "\x00" * 100, "binary tail": text.encode() + bytes(range(256)) * 100,
               "Latin-1 byte": text.replace("sample", "sampl\xe9", 1).encode("latin-1", "replace"),
               "UTF-16": text.encode("utf-16"), "CRLF": text.replace("\n", "\r\n"), "empty": "", "blank lines": "\n" * 10_000,
               "1,000 start records": (recs[0] + "\n") * 1000, "only a summary": recs[-1] + "\n"}
    for field in ("iteration", "actual_bytes", "predicted_bytes", "rank", "interval", "tolerance", "iterations", "alloc_bytes"):
        for v in ('"8"', "8.5", "-1", "1e400", str(2**64), "9" * 4000, "NaN", "Infinity", "-Infinity", "true", "null", "[1]",
                  '{"a": 1}', '""'):
            t = text
            for r in RUNLOG:
                if field in r:
                    t = t.replace(f'"{field}": {json.dumps(r[field])}', f'"{field}": {v}', 1)
            damaged[f"{field}={v[:20]}"] = t
    for key in ("allocated", "max_allocated", "reserved", "max_reserved", "device_used"):
        for v in ("NaN", "-1", "1e400", '"1GiB"', "null", "[]"):
            damaged[f"actual.{key}={v}"] = text.replace(f'"{key}": ', f'"{key}": {v}, "_{key}": ', 1)
    for label, t in damaged.items():
        for extra in ([], ["--skip-bad-lines"], ["--json"], ["--run", "all", "--all-ranks"]):
            yield f"report jsonl {label} {' '.join(extra)}", ["report", ".", *extra], {"memguard-rank00000.jsonl": t}
    # -- memguard plan --explain with option combinations ---------------------------------------------------------
    plan = [*PLAN, "--model", "llama-3.2-1b"]
    for ex in ("tp=1,pp=1,cp=1,mbs=1", "tp=2,pp=1,cp=1,mbs=1", "tp=8,pp=8,cp=8,mbs=8", "tp=1", "pp=1,tp=1,cp=1,mbs=1,mbs=2",
               "tp=1,pp=1,cp=1,mbs=1,vpp=2", "tp=1,pp=1,cp=1,mbs=1,ep=2", "tp=1,pp=1,cp=1,mbs=1,recompute=full",
               "tp=1,pp=1,cp=1,mbs=1,fsdp=optim", "tp=1,pp=1,cp=1,mbs=1,fp8=tensorwise", "tp=1,pp=1,cp=1,mbs=1,x=1", "=", ",",
               "tp==1", "tp=1;pp=1", "TP1 PP1 CP1 MBS1", "tp=1e400,pp=1,cp=1,mbs=1", "tp=-1,pp=1,cp=1,mbs=1",
               "tp=" + "9" * 5000, ",".join(["tp=1"] * 5000), "tp=1,pp=1,cp=1,mbs=1" + ",tp=1" * 1000):
        for extra in ([], ["--top", "3"], ["--json"], ["--rule", "memory"], ["--tp", "2"], ["--tp", "1", "--pp", "1"],
                      ["--recompute", "full"], ["--fp8", "tensorwise"], ["--network-gbps", "1"], ["--vpp", "2"],
                      ["--plot-layouts", "3"], ["--gpu-memory", "1GiB"], ["--explain", "tp=1,pp=1,cp=1,mbs=1"]):
            yield f"plan --explain {ex[:30]!r} {' '.join(extra)}", [*plan, "--explain", ex, *extra], {}
    # -- NeMo / Bridge overrides of a launch line holding command substitutions (issue hostile17, part 1) ------------
    from fuzz_util import YAML_SEEDS as _SEEDS
    nemo = dict((n, t) for n, t, _ in _SEEDS)["nemo1_llama.yaml"]
    hydra = "torchrun --nproc-per-node 8 megatron_gpt_pretraining.py --config-path=conf --config-name=c "
    bridge = "torchrun --nproc-per-node 8 run_recipe.py --recipe llama32_1b_pretrain_config "
    for v in ("$(nproc)", "`nproc`", "$(( $(nproc) * 2 ))", "$((N++))", "$(", "`", "$(echo \"$(echo ')')\")", "\"$(nproc)\"",
              "$(cat <<EOF\n4\nEOF\n)", "$(x)" * 5000):
        for key in ("model.tensor_model_parallel_size", "model.micro_batch_size", "model.seed", "+model.x", "trainer.devices",
                    "trainer.num_nodes", "model.num_layers"):
            yield f"check hydra {key}={v[:20]!r}", ["check", "--file", "run.sh"], {
                "run.sh": f"{hydra}{key}={v}\n", "conf/c.yaml": nemo}
            yield f"check hydra python {key}={v[:20]!r}", ["check", "--file", "run.sh"], {
                "run.sh": f"X={v}\npython megatron_gpt_pretraining.py --config-path=conf --config-name=c {key}=$X\n",
                "conf/c.yaml": nemo}
        for key in ("model.tensor_model_parallel_size", "train.micro_batch_size", "train.global_batch_size", "model.seed",
                    "rng.seed", "model.num_layers", "mixed_precision"):
            yield f"check run_recipe {key}={v[:20]!r}", ["check", "--file", "run.sh"], {"run.sh": f"{bridge}{key}={v}\n"}
    yield "check run_recipe 30,000 $(x) overrides", ["check", "--file", "run.sh"], {
        "run.sh": bridge + " ".join(f"model.k{i}=$(x)" for i in range(30_000)) + "\n"}
    # -- the MEMGUARD_* variables -----------------------------------------------------------------------------------
    for var, vals in (("MEMGUARD_PROFILE", ["p.yaml", "\x01", " ", "p.yaml\n", "/", "x" * 5000]),
                      ("MEMGUARD_THRESHOLD", ["0.8 ", "8e-1", "1e-400", "0x1", "\u0660.8", "80%", "1_0"]),
                      ("MEMGUARD_GPU_MEMORY", ["80GiB ", "80 gib", "8e10", "0x10", "\u0668\u0660GiB", "1e-400GiB", "80GB"]),
                      ("MEMGUARD_LOG_INTERVAL", ["1.0", "1e3", " 5", "\u0665"]), ("MEMGUARD_LOG_DIR", ["x" * 5000, "\x01"]),
                      ("MEMGUARD", ["report ", "Warn", "abort\n"]), ("MEMGUARD_DEBUG", ["", "0"])):
        for v in vals:
            prof = {"p.yaml": f"{head2}time: {{gemm_efficiency: 0.7}}\n"}
            yield f"estimate {var}={v[:20]!r}", ["estimate", "--world-size", "8", "--", *S], prof, {var: v}
            yield f"check {var}={v[:20]!r}", ["check", "--", *run.split(), *S], prof, {var: v}
            yield f"plan {var}={v[:20]!r}", [*PLAN, "--", *S], prof, {var: v}


def hook14_cases() -> tuple[int, list[str], float, str]:
    """Issue hostile14: the hook's validate_args wrapper on Megatron's namespaces with a numpy scalar or array, a torch
    tensor (0-d, 1-d, NaN), an int subclass whose __int__ raises or an object refusing str() / int() / bool() at the
    shape, batch, parallelism, precision, eval, CP and paged-stash fields. (runs, broken, worst CPU seconds, its case)."""
    try:
        import numpy as np
        import torch
    except ImportError:   # (both come with torch in the test venvs)
        return 0, [], 0.0, ""

    class RaisesStr:
        def __str__(self):
            raise RuntimeError("str")
        __repr__ = __str__

        def __int__(self):
            raise RuntimeError("int")
        __index__ = __float__ = __int__

        def __bool__(self):
            raise RuntimeError("bool")

    class RaisesInt(int):
        def __int__(self):
            raise RuntimeError("int")

        def __index__(self):
            raise RuntimeError("index")

    values = {"np.int64(8)": np.int64(8), "np.float32(8)": np.float32(8), "np.bool_": np.bool_(True),
              "np.array([8])": np.array([8]), "np.int64(2**62)": np.int64(2**62), "np.nan": np.float64("nan"),
              "tensor(8)": torch.tensor(8), "tensor([8, 8])": torch.tensor([8, 8]), "tensor(nan)": torch.tensor(float("nan")),
              "RaisesStr": RaisesStr(), "RaisesInt(8)": RaisesInt(8)}
    fields = ["num_layers", "hidden_size", "micro_batch_size", "global_batch_size", "seq_length", "num_attention_heads",
              "tensor_model_parallel_size", "bf16", "sequence_parallel", "recompute_granularity", "num_experts",
              "eval_micro_batch_size", "cp_comm_type", "moe_paged_stash", "memguard_gpu_memory"]
    return _hook_field_cases("hook14", fields, list(values.items()), deep=False)


def hostile11_cases():
    """Issue hostile11 (the eleventh round): DeepSeek sparse attention flags (the variant's spellings, dsa_* / indexer
    values, a top-k above the sequence), gated delta net (--linear-attention-freq ints, lists and expressions, linear_*
    values, the variant flag in hybrid models, hybrid patterns with D / G / +), the eval step's flags and Bridge's
    validation section (a word where the section goes), heterogeneous layer JSON (wrong types, missing keys, BOM, NaN,
    nesting, 50,000 keys), NeMo 1 LoRA target lists / variant / layer_selection, Bridge exclude_modules, MoE capacity and
    router padding, FP8 / FP4 names in any case, Hugging Face deepseek_v32 / qwen3_next config.json, memguard calibrate
    on hostile Megatron logs (binary, 900 KB lines, NaN / negative counts, spliced ranks, truncation, UTF-16),
    memguard plan with hostile bounds, and the monitor's MEMGUARD_* variables around check / estimate."""
    from megatron_logs import args_of, interleave, print_args, report_memory, training_log
    from test_dsa import BASE as DSA, HYBRID as DSA_HYBRID, TP2
    from test_eval_step import BASE as EVAL
    from test_gdn import GPT as GDN
    from test_heterogeneous import FLAGS as HET
    from test_peft import NEMO1
    from test_readers_bridge import FLAT
    V = ["x", "", "0", "-1", "1e400", "nan", "inf", "9" * 30, "1.5", "-0", "0x10", "None", "[1,2]", "true"]
    Y = ["null", "'???'", "x", "-1", "0", "1.5", "[1]", "{a: 1}", "true", "1e400", "9" * 40, ".nan", ".inf", "''", "2.0", "'4'"]
    v19 = ["--megatron-version", "0.19.2"]
    # DSA flags and the variant's spellings
    for flag in ("--dsa-indexer-n-heads", "--dsa-indexer-head-dim", "--dsa-indexer-topk", "--dsa-indexer-topk-freq",
                 "--dsa-indexer-skip-topk-offset", "--dsa-indexer-loss-coeff", "--dsa-kernel-backend",
                 "--dsa-indexer-use-sparse-loss", "--experimental-attention-variant"):
        for v in V + ["100000000", "999999"]:
            yield f"estimate DSA {flag} {v!r}", ["estimate", "--world-size", "2", *v19, "--", *DSA, *TP2, flag, v], {}
    for v in ("DSA", " dsa", "Dsa", "dsa,gated_delta_net", "GATED_DELTA_NET", "None"):
        yield f"estimate --experimental-attention-variant {v!r}", ["estimate", "--world-size", "2", *v19, "--", *DSA, *TP2,
                                                                   "--experimental-attention-variant", v], {}
    # gated delta net: --linear-attention-freq and the mixer's shape
    for v in V + ["[1]*8", "([1]*3+[0])*2", "[1,1,1,0,1,1,1,0]", "[2,0,0,0,0,0,0,0]", "[-1]*8", "[1.5]*8", "'4'",
                  "([1]*3+[0])*" + "9" * 20, "(" * 5000 + "1" + ")" * 5000, "[" * 5000 + "]" * 5000, "[1]*100000000", "4.0",
                  "[[1]]*8", "[True]*8", "[None]*8", "lambda: 1", "__import__('os')", "[1]*8+", "100000000"]:
        yield f"estimate GDN --linear-attention-freq {v[:30]!r}", ["estimate", "--world-size", "1", *v19, "--", *GDN,
                                                                   "--linear-attention-freq", v], {}
    for flag in ("--linear-conv-kernel-dim", "--linear-key-head-dim", "--linear-value-head-dim", "--linear-num-key-heads",
                 "--linear-num-value-heads"):
        for v in V:
            yield f"estimate GDN {flag} {v!r}", ["estimate", "--world-size", "1", *v19, "--", *GDN, flag, v], {}
    # hybrid patterns with D / G / +, the variant flags beside them
    hd = list(DSA_HYBRID)
    del hd[hd.index("--hybrid-layer-pattern"):hd.index("--hybrid-layer-pattern") + 2]
    hd += [*v19, "--no-rope-fusion", "--mamba-state-dim", "16", "--mamba-head-dim", "32", "--mamba-num-groups", "2"]
    for pat in ("MD-MD-", "MG-", "GGGG", "DDDD", "M+M-", "D+G-", "MDGE", "D|G", "MD-/D", "DG*-", "MD-/G", "MD-/+",
                "MDMD|MDMD", "D", "G", "+", "GDGD", "D-" * 3000, "G-" * 3000, "MD-/" + "D" * 1000):
        for extra in ([], ["--tensor-model-parallel-size", "2", "--sequence-parallel"], ["--pipeline-model-parallel-size", "2"],
                      ["--dsa-indexer-topk", "99999999"], ["--experimental-attention-variant", "gated_delta_net"],
                      ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "4"],
                      ["--experimental-attention-variant", "dsa"]):
            ws = "2" if "--tensor-model-parallel-size" in extra or "--pipeline-model-parallel-size" in extra else "1"
            yield (f"estimate hybrid {pat[:20]} {' '.join(extra)[:50]}",
                   ["estimate", "--world-size", ws, "--", *hd, "--hybrid-layer-pattern", pat, *extra], {})
        yield f"plan hybrid {pat[:20]}", ["plan", "--gpus", "4", "--", *hd, "--hybrid-layer-pattern", pat], {}
    # the eval step's flags
    pp2 = ["--pipeline-model-parallel-size", "2", *EVAL]
    for flag in ("--eval-micro-batch-size", "--eval-global-batch-size", "--eval-iters", "--eval-interval"):
        for v in V + ["3", "7", "1000000000"]:
            yield f"estimate {flag} {v!r}", ["estimate", "--world-size", "2", "--", *pp2, flag, v], {}
    # MoE capacity, router padding, FP8 / FP4 names
    moe = [*MOE, "--moe-token-dispatcher-type", "alltoall"]
    for flag, vs in (("--moe-expert-capacity-factor", V + ["0.0001", "1e-300", "1e300"]), ("--moe-router-padding-for-fp8", ["x"]),
                     ("--moe-pad-expert-input-to-capacity", ["x"]), ("--moe-token-drop-policy", ["x", "", "probs", "position"]),
                     ("--fp8-recipe", ["x", "", "delayed", "mxfp8", "custom", "DELAYED"]), ("--fp4-recipe", ["x", "nvfp4", "NVFP4"]),
                     ("--fp8-format", ["x", "", "e4m3", "HYBRID"]), ("--fp4-format", ["x", "E2M1"]),
                     ("--num-layers-at-start-in-bf16", V)):
        for v in vs:
            for extra in ([], ["--fp8-format", "hybrid", "--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity",
                               "--moe-router-padding-for-fp8"]):
                yield f"estimate MoE {flag} {v!r} {extra[:2]}", ["estimate", "--world-size", "8", *v19, "--", *moe, *extra,
                                                                  flag, v], {}
    # Hugging Face deepseek_v32 / qwen3_next
    ds = json.load(open(os.path.join(ROOT, "tests", "data", "hf", "deepseek-v3.json")))
    ds.update(model_type="deepseek_v32", index_n_heads=64, index_head_dim=128, index_topk=2048)
    hf_cmd = ["estimate", "--config", "config.json", "--world-size", "64", *v19, "--", "--micro-batch-size", "1",
              "--seq-length", "4096", "--global-batch-size", "64"]
    for key in ("index_n_heads", "index_head_dim", "index_topk"):
        for v in ["null", '"64"', "64.5", "true", "-1", "0", "1e400", "[64]", "{}", "9" * 40, '"x"', "NaN", "Infinity",
                  "64.0", '""', "MISSING"]:
            text = json.dumps({k: x for k, x in ds.items() if k != key}) if v == "MISSING" else \
                json.dumps(ds).replace(f'"{key}": {ds[key]}', f'"{key}": {v}')
            yield f"estimate HF deepseek_v32 {key}={v}", hf_cmd, {"config.json": text}
            yield f"estimate --model HF deepseek_v32 {key}={v}", ["estimate", "--model", "config.json", "--gpus", "64", *v19], \
                {"config.json": text}
    for mt in ("DeepSeek_V32", "deepseek_v32 ", "qwen3_next", "Qwen3_Next", "deepseek-v32", None, 5, ["deepseek_v32"]):
        yield f"estimate HF model_type {mt!r}", hf_cmd, {"config.json": json.dumps(dict(ds, model_type=mt))}
    # Megatron-Bridge: validation / eval keys, sections that are words, model DSA / GDN / FP8 fields, exclude_modules
    for key in ("eval_micro_batch_size", "eval_global_batch_size", "eval_iters", "eval_interval"):
        for sec in ("validation", "train"):
            for v in Y:
                yield f"estimate Bridge {sec}.{key}={v}", ["estimate", "--config", "c.yaml", "--gpus", "8", "--set",
                                                           f"{sec}.{key}={v}"], {"c.yaml": FLAT}
    for sec in ("validation", "ddp", "train", "optimizer", "comm_overlap", "checkpoint", "logger", "mixed_precision"):
        for v in ("x", "[1]", "5", "null", "'???'", "{}", "true"):
            yield f"estimate Bridge {sec}: {v}", ["estimate", "--config", "c.yaml", "--gpus", "8"], {"c.yaml": FLAT + f"{sec}: {v}\n"}
    flat_nomp = FLAT.replace("mixed_precision: bf16_mixed\n", "")
    dsa_on = ["--set", "model.experimental_attention_variant=dsa", "--set", "model.multi_latent_attention=true"]
    gdn_on = ["--set", "model.experimental_attention_variant=gated_delta_net", "--set", "model.linear_attention_freq=4"]
    for key, vs, extra in (
            ("experimental_attention_variant", ["DSA", "dsa", "' dsa'", "gated_delta_net", "Gated_Delta_Net", "x", "null", "''",
                                                "[dsa]", "1"], []),
            ("linear_attention_freq", Y + ["'[1,1,1,0]'", "[1,1,1,0]", "'([1]*3+[0])*1'", "[true, true, true, false]", "[2,1,1,0]"],
             gdn_on[:2]),
            ("dsa_indexer_topk", Y, dsa_on), ("dsa_kernel_backend", ["None", "none", "NONE", "x", "null"], dsa_on),
            ("linear_num_key_heads", Y, gdn_on),
            ("moe_expert_capacity_factor", Y, ["--set", "model.num_moe_experts=8", "--set", "model.moe_router_topk=2", "--set",
                                               "model.moe_token_dispatcher_type=alltoall"]),
            ("fp8", ["hybrid", "HYBRID", "e5m2", "x", "true", "null"], []), ("fp8_recipe", ["DELAYED", "Delayed", "x", "[delayed]"],
                                                                           ["--set", "model.fp8=hybrid"]),
            ("fp4", ["e2m1", "E2M1", "x"], []), ("fp4_recipe", ["NVFP4", "x"], ["--set", "model.fp4=e2m1"]),
            ("cp_comm_type", ["[p2p, a2a, a2a, a2a]", "[p2p]", "[x]", "[null, null, null, null]"],
             ["--set", "model.context_parallel_size=2"])):
        for v in vs:
            for label, text in (("", FLAT), (" no mixed_precision", flat_nomp)):
                yield (f"estimate Bridge model.{key}={v}{label}", ["estimate", "--config", "c.yaml", "--gpus", "8", *extra, "--set",
                                                                   f"model.{key}={v}"], {"c.yaml": text})
    for v in ("[]", "[linear_qkv]", "[output_layer]", "x", "null", "[null]", "[5]", "['*']", "['*.linear_qkv']", "[LINEAR_QKV]",
              "['']", "{a: 1}"):
        yield f"estimate Bridge exclude_modules {v}", ["estimate", "--config", "c.yaml", "--gpus", "8"], {
            "c.yaml": FLAT + f"peft:\n  _target_: megatron.bridge.peft.lora.LoRA\n  dim: 8\n  target_modules: []\n  exclude_modules: {v}\n"}
    # NeMo 1 LoRA: layer_selection, variant, targets
    for v in Y + ["[1, 2]", "[0]", "[5]", "[1, 1, 1]", "[-1]", "[1.5]", "['1']", "[true]", "[[1]]", "[1, null]",
                  "[" + ",".join(["1"] * 100_000) + "]", "{1: 2}"]:
        yield f"estimate NeMo 1 layer_selection {v[:30]}", ["estimate", "--config", "c.yaml"], {
            "c.yaml": NEMO1.replace("adapter_dropout: 0.0}", f"adapter_dropout: 0.0, layer_selection: {v}}}")}
    for tgt in ("[all]", "[mlp_fc2]", "[]", "all", "[ALL]", "[null]", "[[attention]]", "[attention_qkv, attention_qkv]"):
        for var in ("canonical", "CANONICAL", "nemo", "x", "null", "[canonical]"):
            yield f"estimate NeMo 1 LoRA {var} {tgt}", ["estimate", "--config", "c.yaml"], {
                "c.yaml": NEMO1.replace("target_modules: [attention, mlp_fc1]", f"target_modules: {tgt}, variant: {var}")}
    # heterogeneous layer JSON
    base = json.load(open(os.path.join(ROOT, "tests", "data", "heterogeneous", "small_blocks.json")))
    blk = base["block_configs"][0]
    het: dict[str, str] = {"top list": "[1,2]", "top string": '"x"', "top null": "null", "empty": "", "ws 900k": " " * 900_000,
                           "BOM": "\ufeff" + json.dumps(base), "NaN": json.dumps(base).replace("2.625", "NaN"),
                           "Infinity": json.dumps(base).replace("2.625", "Infinity"), "trailing garbage": json.dumps(base) + "x",
                           "nested 2000": '{"block_configs":[' + '{"attention":' * 2000 + "1" + "}" * 2000 + "]}",
                           "50,000 keys": json.dumps(dict(base, **{f"k{i}": i for i in range(50_000)}))}
    for label, blocks in (("dict", {"0": blk}), ("string", "x"), ("empty", []), ("lists", [[1]] * 4), ("nulls", [None] * 4),
                          ("no ffn", [{"attention": blk["attention"]}] * 4), ("empty blocks", [{}] * 4),
                          ("3 of 4", base["block_configs"][:3]), ("5 of 4", base["block_configs"] + [blk])):
        het[f"block_configs {label}"] = json.dumps(dict(base, block_configs=blocks))
    for v in (0, -1, 3, 16, 1e308, 2**70, "4", 4.0, True, [4]):
        het[f"n_heads_in_group {v!r}"[:40]] = json.dumps(dict(base, block_configs=[
            {"attention": dict(blk["attention"], n_heads_in_group=v), "ffn": blk["ffn"]}] * 4))
    for v in (0, -1, 1e308, 5e-324, 2**70, "2", True, 1000.0):
        het[f"ffn_mult {v!r}"[:40]] = json.dumps(dict(base, block_configs=[
            {"attention": blk["attention"], "ffn": dict(blk["ffn"], ffn_mult=v)}] * 4))
    for v in (None, 0, 3, 8, "4", 4.0, 2**70):
        het[f"num_hidden_layers {v!r}"] = json.dumps(dict(base, num_hidden_layers=v))
    for label, text in het.items():
        for ver in ("0.19.2", "0.16.1"):
            yield f"estimate heterogeneous {ver} {label}", ["estimate", "--world-size", "1", "--megatron-version", ver, "--", *HET,
                                                           "--heterogeneous-layers-config-path", "h.json"], {"h.json": text}
        yield f"estimate heterogeneous encoded {label}", ["estimate", "--world-size", "1", "--", *HET,
                                                         "--heterogeneous-layers-config-encoded-json", text[:100_000]], {}
    # memguard calibrate on hostile Megatron logs
    def log(flags, ws):
        mem = "\n".join(report_memory(r, "(after 10 iterations)", 2**30, 2**31, 2**31 + 2**29, 2**31 + 2**30, device_used=2**32)
                        for r in range(ws))
        return "\n".join(print_args(args_of(flags, ws))) + "\n" + training_log(10, 100, 80, 8) + "\n" + mem + "\n"
    good = [log(SMALL, 8), log([*SMALL, "--recompute-activations"], 8), log(SMALL[:-1], 8)]
    runs = {"a.log": good[0], "b.log": good[1], "c.log": good[2]}
    lines = good[2].splitlines()
    spliced = "\n".join(line[:40] + lines[i - 1][20:] if "memory (MB)" in line and i % 2 else line for i, line in enumerate(lines))
    bad: dict[str, str | bytes] = {
        "binary": bytes(range(256)) * 3000, "binary tail": good[2].encode() + bytes(range(256)) * 1000,
        "NUL": good[2].replace("allocated:", "allo\x00cated:"), "900 KB line": "x" * 900_000 + "\n" + good[2][:50_000],
        "interleaved": "\n".join(interleave(good[0].splitlines(), good[1].splitlines())), "spliced ranks": spliced,
        "CRLF": good[2].replace("\n", "\r\n"), "CR": good[2].replace("\n", "\r"), "two tables": good[2] + good[0],
        "UTF-16": good[2].encode("utf-16"), "rank 10**9": good[2].replace("[Rank 0]", "[Rank 1000000000]"),
        "rank 400 digits": good[2].replace("[Rank 0]", "[Rank " + "9" * 400 + "]")}
    for cut in (100, 1000, len(good[2]) // 2, len(good[2]) - 30):
        bad[f"cut at {cut}"] = good[2][:cut]
    for v in ("nan", "inf", "-1", "-0.5", "1e400", "0", "1e-320", "9" * 400, "1,024.5", "0x10", "1_000"):
        bad[f"allocated {v}"] = good[2].replace("allocated: 1024.00", f"allocated: {v}")
        bad[f"max reserved {v}"] = good[2].replace("max reserved: 3072.00", f"max reserved: {v}")
        bad[f"device used {v}"] = good[2].replace("total device memory used: 4096.00", f"total device memory used: {v}")
    for label, text in bad.items():
        yield f"calibrate log {label}", ["calibrate", "a.log", "b.log", "c.log", "--out", "site.yaml"], dict(runs, **{"c.log": text})
        yield f"report log {label}", ["report", "c.log"], {"c.log": text}
    yield "calibrate DSA runs", ["calibrate", "0.log", "1.log", "2.log", *v19], {f"{i}.log": log([*DSA, *TP2], 2) for i in range(3)}
    yield "calibrate GDN runs", ["calibrate", "0.log", "1.log", "2.log", *v19], {f"{i}.log": log(GDN, 1) for i in range(3)}
    for opt, vs in (("--min-runs", ["0", "1", "2", "-1", "x", "1e400", "9" * 40]), ("--fit", ["", "x", ",", ",".join(["cuda_context"] * 10_000)]),
                    ("--env", ["X", "=", "NCCL_BUFFSIZE=x", "NCCL_BUFFSIZE=-1", "NCCL_BUFFSIZE=" + "9" * 400,
                               "CUBLAS_WORKSPACE_CONFIG=:4096:" + "9" * 50]),
                    ("--name", ["", "x" * 100_000, "\x00", "a\nb: c"]), ("--out", ["", ".", "/dev/null", "/nonexistent/dir/x.yaml"])):
        for v in vs:
            yield f"calibrate {opt} {v[:20]!r}", ["calibrate", "a.log", "b.log", "c.log", opt, v], runs
    # memguard plan with hostile bounds
    plan = ["plan", "--gpus", "8", "--seq-length", "2048", "--global-batch-size", "64", "--model", "llama-3.2-1b"]
    for opt, vs in (("--tp", ["0", "-1", "x", "1,2,", "1,,2", "3", "1e400", "9" * 40, "1" * 5000, ",".join(str(i) for i in range(1, 20_000)),
                              "nan", "2.0", " 2", "2-4"]),
                    ("--pp", ["0", "16", "1,2,4,8,16,32", "9" * 40, ""]), ("--cp", ["0", "3", "9" * 40]),
                    ("--vpp", ["0", "-1", "100000", "9" * 40]), ("--mbs", ["0", "-1", "100000", "9" * 40, "1,2,4,8,16,32,64,128"]),
                    ("--max-tp", ["0", "-1", "9" * 40, "x"]), ("--ep", ["0", "3", "9" * 40]), ("--etp", ["0", "3", "9" * 40]),
                    ("--recompute", ["x", "", "full,none", "FULL"]), ("--fsdp", ["x", "", "all"]),
                    ("--fp8", ["x", "", "delayed,mxfp8", "DELAYED", "hybrid"]), ("--top", ["0", "-1", "9" * 40]),
                    ("--threshold", ["0", "-1", "nan", "1.5", "inf"]), ("--gpu-memory", ["0", "-1GiB", "nan", "1e400GiB", "1B"]),
                    ("--nnodes", ["0", "3", "9" * 40]), ("--seq-length", ["0", "-1", "9" * 40, "3"])):
        for v in vs:
            yield f"plan {opt} {v[:20]!r}", [*plan, opt, v], {}
    yield "plan DSA", ["plan", "--gpus", "8", "--seq-length", "4096", "--global-batch-size", "16", *v19, "--", *DSA], {}
    yield "plan GDN", ["plan", "--gpus", "8", "--seq-length", "512", "--global-batch-size", "16", *v19, "--", *GDN], {}
    # the runtime monitor's variables around check / estimate
    for env, vs in (("MEMGUARD_THRESHOLD", ["x", "nan", "-1", "2", "inf", ""]), ("MEMGUARD_GPU_MEMORY", ["x", "0", "-1GiB", "1e400GiB"]),
                    ("MEMGUARD_PROFILE", ["/nonexistent", "/dev/zero", ".", ""]), ("MEMGUARD_LOG_INTERVAL", ["0", "-1", "x", "9" * 40]),
                    ("MEMGUARD_LOG_DIR", ["/dev/null", "/nonexistent/x", ""]), ("MEMGUARD_RESET_PEAK", ["maybe", ""]),
                    ("MEMGUARD", ["x", "ABORT", ""]), ("MEMGUARD_ALLOW_RECOMPUTE", ["2", "x"])):
        for v in vs:
            yield f"check {env}={v[:20]!r}", ["check", "--", "torchrun", "--nproc-per-node", "8", "pretrain_gpt.py", *SMALL], {}, {env: v}
            yield f"estimate {env}={v[:20]!r}", ["estimate", "--world-size", "8", "--", *SMALL], {}, {env: v}

def hostile_files(d: str) -> dict[str, str]:
    """Files no config is, made in ``d``: a named pipe nobody writes to, a directory, a symlink loop,
    UTF-16 text; and /dev/zero, /dev/urandom (endless)."""
    os.mkfifo(os.path.join(d, "pipe.yaml"))
    os.mkfifo(os.path.join(d, "ckpt.nemo"))
    os.mkfifo(os.path.join(d, "out.html"))
    os.mkdir(os.path.join(d, "dir.yaml"))
    os.symlink(os.path.join(d, "b.yaml"), os.path.join(d, "a.yaml"))
    os.symlink(os.path.join(d, "a.yaml"), os.path.join(d, "b.yaml"))
    with open(os.path.join(d, "utf16.yaml"), "wb") as f:
        f.write("schema: memguard.site/1\n".encode("utf-16"))
    names = {"named pipe": "pipe.yaml", "named pipe .nemo": "ckpt.nemo", "directory": "dir.yaml", "symlink loop": "a.yaml",
             "UTF-16": "utf16.yaml"}
    return {**{k: os.path.join(d, v) for k, v in names.items()}, "/dev/zero": "/dev/zero", "/dev/urandom": "/dev/urandom"}


def file_cases(paths: dict[str, str]):
    """Every argument that names a file, given each hostile file (a named pipe stopped memguard forever
    at open(); it now waits files.PIPE_WAIT for data, set to 0.5 s here)."""
    run = {"memguard-rank00000.jsonl": json.dumps(RUNLOG[0]) + "\n" + json.dumps(RUNLOG[1]) + "\n"}
    for kind, p in paths.items():
        yield f"estimate --config {kind}", ["estimate", "--config", p, "--world-size", "8"], {}
        yield f"estimate --model {kind}", ["estimate", "--model", p, "--world-size", "8"], {}
        yield f"estimate --site-profile {kind}", ["estimate", "--site-profile", p, "--world-size", "8", "--", *SMALL], {}
        yield f"estimate --yaml-cfg {kind}", ["estimate", "--world-size", "8", "--", "--yaml-cfg", p], {}
        yield f"estimate --tp-comm-overlap-cfg {kind}", ["estimate", "--world-size", "8", "--", *MOE, "--tp-comm-overlap",
                                                         "--tp-comm-overlap-cfg", p], {}
        yield f"estimate --heterogeneous-layers-config-path {kind}", [
            "estimate", "--world-size", "8", "--", *SMALL, "--heterogeneous-layers-config-path", p], {}
        yield f"validate {kind}", ["validate", p, "--gpus", "8"], {}
        yield f"check --file {kind}", ["check", "--file", p], {}
        yield f"check --cwd {kind}", ["check", "--cwd", p, "--", "torchrun", "pretrain_gpt.py", *SMALL], {}
        yield f"plan --config {kind}", ["plan", "--config", p, "--gpus", "8", "--seq-length", "512",
                                        "--global-batch-size", "16"], {}
        yield f"report {kind}", ["report", p], {}
        yield f"calibrate {kind}", ["calibrate", p], {}
    out = os.path.join(os.path.dirname(paths["named pipe"]), "out.html")   # a named pipe nobody reads
    yield "report --out a named pipe", ["report", ".", "--out", out], run
    yield "estimate --plot a named pipe", ["estimate", "--world-size", "8", "--plot", out, "--", *SMALL], {}


def log_cases():
    """Megatron logs just under 1 MB: 7,000 ranks of one memory line (grouped in one pass: a scan per
    rank was quadratic), 1,600 out-of-memory messages (64 analysed), hostile numbers in every field."""
    from megatron_logs import args_of, oom_message, print_args, report_memory
    head = "\n".join(print_args(args_of(SMALL, 8))) + "\n"
    ranks = head + "\n".join(report_memory(r, "(after 10 iterations)", 2**30, 2**31, 2**31, 2**31) for r in range(7_000))
    yield "report 7,000 ranks", ["report", "run.log"], {"run.log": ranks + "\n"}
    yield "calibrate 7,000 ranks", ["calibrate", "run.log"], {"run.log": ranks + "\n"}
    oom = "[rank0]: " + oom_message(2**20, 80 * 2**30, 2**20, 79 * 2**30, 70 * 2**30, 75 * 2**30)
    yield "report 1,600 OOM messages", ["report", "run.log"], {"run.log": head + "\n".join([oom] * 1_600) + "\n"}
    for v in NUMBERS[:20]:
        mem = f"[Rank 0] (after {v} iterations) memory (MB) | allocated: {v} | max allocated: {v} | reserved: 1 | max reserved: {v}"
        yield f"report memory line {v!r}", ["report", "run.log"], {"run.log": head + mem + "\n"}
        yield f"report OOM of {v!r} GiB", ["report", "run.log"], {"run.log": head + oom.replace("80.00 GiB", f"{v} GiB") + "\n"}
        yield f"report argument table num_layers {v!r}", ["report", "run.log"], {
            "run.log": head.replace("  num_layers ", f"  num_layers {v} #", 1) + mem + "\n"}
        yield f"estimate site profile cuda_context {v!r}", ["estimate", "--site-profile", "p.yaml", "--world-size", "8", "--",
                                                            *SMALL], {"p.yaml": f"schema: memguard.site/1\nconstants: {{cuda_context: {v}}}\n"}


def structured_regressions():
    """What the structured mutations found (tests/test_hostile_structured.py): a lone '-' after srun, a NUL in
    a path, a .nemo archive of empty members, an FFN narrower than TP in the planner."""
    flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 1 --seq-length 128 "
             "--max-position-embeddings 128 --tokenizer-type NullTokenizer --vocab-size 100 --bf16").split()
    yield "srun with a lone '-'", ["check", "--file", "run.sh"], {"run.sh": "srun --ntasks 8 - pretrain_gpt.py --num-layers 2\n"}
    yield "--config with a NUL", ["estimate", "--config", "a\x00b"], {}
    yield "--yaml-cfg with a NUL", ["estimate", "--world-size", "8", "--", "--yaml-cfg", "a\x00b"], {}
    import lzma
    import tarfile
    member = tarfile.TarInfo("model_weights/a.distcp").tobuf(format=tarfile.GNU_FORMAT)
    yield ".nemo of 200,000 empty members (xz, 15 kB)", ["estimate", "--config", "m.nemo", "--gpus", "8"], {
        "m.nemo": lzma.compress(member * 200_000 + b"\0" * 1024, preset=0)}
    yield "plan ffn 1 < TP 2", ["plan", "--gpus", "2", "--seq-length", "128", "--global-batch-size", "8", "--tp", "2", "--", *flags], {}


def surface_cases():
    """The surfaces the earlier fuzzers drew least from (issue hostile3): every field of the Mixtral, Qwen-MoE
    and DeepSeek config.json files set to null / a list / a string / a negative, huge, fractional or boolean
    value, or deleted, with the flags that take them to the estimator; Megatron logs as terminals and crashed
    file systems leave them (colour codes, NULs, CRLF, binary garbage, cut at any point); `memguard plan`
    over extreme spaces (2**20 and 2**40 GPUs, 10,000 layers with --vpp lists, vocab 1, 0 GPUs per node)."""
    import random
    flags = ["--micro-batch-size", "1", "--seq-length", "4096", "--global-batch-size", "64", "--expert-model-parallel-size", "4",
             "--bf16"]
    hf_dir = os.path.join(ROOT, "tests", "data", "hf")
    values = [None, [8], "8", "no", -4, 7.5, 8.0, True, 10**30, 0, {"type": "yarn", "factor": None}]
    for name in sorted(os.listdir(hf_dir)):
        with open(os.path.join(hf_dir, name), encoding="utf-8") as f:
            doc = json.load(f)
        for key in doc:
            for v in values + ["(deleted)"]:
                d = {k: x for k, x in doc.items() if not (k == key and v == "(deleted)")}
                if v != "(deleted)":
                    d[key] = v
                yield f"estimate {name} {key}={v!r}", ["estimate", "--model", "config.json", "--world-size", "64", "--", *flags], {
                    "config.json": json.dumps(d)}
    from fuzz_util import MEGATRON_LOG as log
    rnd = random.Random(0)
    logs = {"CRLF": log.replace("\n", "\r\n"), "colour codes": "".join(f"\x1b[32m{x}\x1b[0m\n" for x in log.splitlines()),
            "NULs": log.replace("\n", "\x00\n"), "a NUL tail": log + "\x00" * 65_536,
            "binary garbage": bytes(rnd.getrandbits(8) for _ in range(100_000)) + log.encode(),
            "900 kB without a newline": log + "x" * 900_000, "UTF-16": log.encode("utf-16")}
    logs.update({f"cut at byte {k}": log[:k] for k in range(0, len(log), len(log) // 20)})
    for label, text in logs.items():
        for cmd in (["report", "run.log", "--json"], ["calibrate", "run.log", "run.log", "run.log"]):
            yield f"{cmd[0]} Megatron log, {label}", cmd, {"run.log": text}
    dense = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--max-position-embeddings", "4096",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000", "--bf16"]
    for gpus, extra, more in ((str(2**20), ["--vpp", "1,2,4,8,16,32"], ["--num-layers", "10000"]),
                              (str(2**20), [], ["--num-layers", "10000"]), (str(2**40), [], []),
                              ("1048576", ["--vpp", "1000000"], []), ("8", ["--gpus-per-node", "0"], []),
                              ("65536", [], ["--vocab-size", "1"]), ("720720", ["--tp", "1,2,4,8", "--pp", "1,2,3,4,5,6,7,8"], [])):
        yield f"plan {gpus} GPUs {' '.join(extra + more)[:40]}", ["plan", "--gpus", gpus, "--seq-length", "4096",
                                                                   "--global-batch-size", "1024", *extra, "--", *dense, *more], {}


def release_cases():
    """The surfaces added since hostile3 (issue hostile4): --megatron-version of every odd form (pre-releases, dev
    and local builds, epochs, empty, 40 digits) with the flags newer releases added; DDP's fp32 accumulation
    patterns (100,000 of them, '[' and '*' bombs, digit patterns over 10,000 layers and 500,000 expert weights);
    a JSON object / list / word at every MoE field of the config.json files; every Megatron-Bridge model field set to
    a mapping or a word through --set; the argument table of a Megatron log holding 64 KiB lines of spaces or dashes;
    plan --top 10**9 and over EP / ETP lists that leave nothing; site profiles with odd versions."""
    moe = [*SMALL, "--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--sequence-parallel",
           "--disable-bias-linear", "--position-embedding-type", "rope"]
    newer = ["--moe-router-score-function", "sqrtsoftplus", "--moe-router-load-balancing-type", "quantile_balancing",
             "--moe-input-jitter-eps", "0.01", "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--use-nccl-ub"]
    for v in ("0.19.0rc0", "0.18.0.dev0+g1", "0.16.1.post2", "1!0.16", "", " ", "0.15", "99", "0." + "9" * 38, "9" * 41,
              "core_v0.17.1", "v0.18", "0.18.", "٠.١٨"):
        yield f"estimate --megatron-version {v[:20]!r}", ["estimate", "--world-size", "8", "--megatron-version", v, "--",
                                                          *moe, *newer], {}
    bf16 = [*SMALL, "--grad-reduce-in-bf16"]
    tenk = ["--num-layers", "10000", "--pipeline-model-parallel-size", "1"]
    experts = ["--num-layers", "120", "--pipeline-model-parallel-size", "1", "--num-experts", "2048", "--moe-router-topk", "2",
               "--sequence-parallel", "--disable-bias-linear", "--moe-grouped-gemm"]
    pats = "--ddp-param-name-patterns-for-fp32-local-accumulation"
    for label, patterns, more in (("100,000 patterns", [f"*x{i}*" for i in range(100_000)], []),
                                  ("100 patterns, 200 characters", ["*" + "a*" * 99 + str(i) for i in range(100)], tenk),
                                  ("'[' x 100,000", ["[" * 100_000], []), ("'[' x 200", ["[" * 199 + "a"] * 100, tenk),
                                  ("'*a' x 100,000", ["*a" * 100_000], []), ("8 digit patterns, 10,000 layers",
                                                                           [f"*layers.{i}*" for i in range(8)], tenk),
                                  ("index-blind, 10,000 layers", ["*mlp*", "*norm*"], tenk),
                                  ("500,000 expert weights", ["*experts*", "*weight1?"], experts)):
        yield f"estimate {pats[2:22]} {label}", ["estimate", "--world-size", "8", "--", *bf16, *more, pats, *patterns], {}
    hf_dir = os.path.join(ROOT, "tests", "data", "hf")
    for name in sorted(os.listdir(hf_dir)):
        with open(os.path.join(hf_dir, name), encoding="utf-8") as f:
            doc = json.load(f)
        for key in [k for k in doc if isinstance(doc[k], (int, float)) and not isinstance(doc[k], bool)]:
            for v in ({"a": 1}, {}, float("nan"), 10**9):
                d = dict(doc, **{key: v})
                yield f"estimate {name} {key}={v!r}", ["estimate", "--model", "config.json", "--world-size", "64", "--",
                                                      "--micro-batch-size", "1", "--seq-length", "4096",
                                                      "--global-batch-size", "64"], {"config.json": json.dumps(d)}
    from megatron_memguard.readers._common import GPT_LEVEL_FIELDS, LEGACY_MCORE_FIELDS, mcore_model_fields, megatron_dests
    fields = sorted(megatron_dests() & (mcore_model_fields() | LEGACY_MCORE_FIELDS | GPT_LEVEL_FIELDS))
    for name in fields:
        for v in ("{a: 1}", "maybe", "[1, 2]"):
            yield f"estimate --set model.{name}={v}", ["estimate", "--model", "qwen3_30b_a3b", "--gpus", "64", "--set",
                                                       "model.moe_flex_dispatcher_backend=deepep", "--set",
                                                       f"model.{name}={v}"], {}
    for override in ("model=1", "model.num_layers.x=4", "model..num_layers=4", "model.=4"):
        yield f"estimate --set {override}", ["estimate", "--model", "llama32_1b", "--gpus", "8", "--set", override], {}
    from fuzz_util import MEGATRON_LOG
    head = "------------------------ arguments ------------------------\n"
    for label, line in (("spaces", "a . " + " " * 65_000 + "b"), ("leading spaces", " " * 65_000 + "x"),
                        ("dashes", "-" * 65_000 + " arguments --"), ("dots", "a " + "." * 65_000)):
        yield f"report argument table, 64 KiB of {label} x 10", ["report", "run.log"], {
            "run.log": head + (line + "\n") * 10 + MEGATRON_LOG}
    plan = ["plan", "--gpus", "64", "--seq-length", "4096", "--global-batch-size", "256", "--model", "mixtral-8x7b"]
    for extra in (["--top", "1000000000"], ["--top", "50"], ["--ep", "3", "--explain"], ["--ep", "8", "--etp", "3"],
                  ["--ep", ",".join(["1"] * 100_000)], ["--ep", "8", "--explain", "x" * 5000]):
        yield f"plan {' '.join(extra)[:40]}", [*plan, *extra], {}
    for version in ("9" * 5000, "abc", "99.0", "0.0.0"):
        text = f"schema: memguard.site/1\nmemguard_version: '{version}'\nconstants: {{}}\n"
        yield f"estimate --site-profile memguard_version {version[:20]}", ["estimate", "--site-profile", "s.yaml",
                                                                          "--world-size", "8", "--", *SMALL], {"s.yaml": text}


def structured_cases():
    """Real inputs mutated by structure (tests/mutate_util.py, issue hostile2): ten mutants of every real
    input and of every command line, each from a fixed Random."""
    import random

    from mutate_util import COMMAND_LINES, command_mutant, mutant, seeds
    for seed in seeds():
        for k in range(10):
            m = mutant(seed, random.Random(k))
            yield "; ".join(m.notes)[:100], m.argv, m.files
    for label, argv in COMMAND_LINES:
        for k in range(10):
            m = command_mutant(label, argv, random.Random(k))
            yield "; ".join(m.notes)[:100], m.argv, m.files


def hook_cases(n: int) -> tuple[int, list[str], float, str]:
    """The hook's validate_args wrapper on ``n`` mutated namespaces (both eras' shapes where installed, the
    --yaml-cfg one): (runs, broken, worst CPU seconds, its case)."""
    import random
    import time

    from mutate_util import hook_namespaces, mutate_namespace, run_hook
    spaces = hook_namespaces()
    names = sorted(spaces)
    broken, worst = [], (0.0, "")
    for k in range(n):
        rnd = random.Random(k)
        notes = [names[k % len(names)]]
        ns = mutate_namespace(spaces[notes[0]], rnd, notes)
        c0 = time.process_time()
        o = run_hook(ns, reject=rnd.random() < 0.05)
        cpu = time.process_time() - c0
        if cpu > worst[0]:
            worst = (cpu, "; ".join(notes)[:90])
        p = o.problems(mutated_settings=any("memguard" in x for x in notes))
        if p:
            broken.append(f"{'; '.join(notes)[:100]}: {'; '.join(p)[:200]}")
    return n, broken, worst[0], worst[1]


class _Refusing:
    """A value that refuses str(), repr(), bool() and == (a framework's lazy or half-built config object)."""

    def __str__(self):
        raise RuntimeError("no str")

    __repr__ = __str__

    def __bool__(self):
        raise RuntimeError("no bool")

    def __eq__(self, other):
        raise RuntimeError("no ==")

    __hash__ = object.__hash__


def hook10_cases() -> tuple[int, list[str], float, str]:
    """Issue hostile10: the hook's validate_args / validate_yaml wrappers on whole hostile namespaces (empty; None, 0,
    'x', 10**30, NaN, [] or an object refusing str / bool / == at every field; --memguard* attributes that raise when
    read), in warn and abort mode, and the runtime monitor fed by memory sources that raise or return garbage (NaN, inf,
    negative, boolean, 2**64 or fractional byte counts, a dict, an int). The promise: Megatron's validation runs (or
    the abort / argparse-style error the user asked for), at most one memguard error line, never a warning or a summary
    built on a garbage reading. (runs, broken, worst CPU seconds, its case)."""
    import copy
    import time
    import types

    from mutate_util import hook_namespaces, run_hook
    from megatron_memguard.runtime import MemoryMonitor, Prediction, Reading, StaticSource

    class Raising(types.SimpleNamespace):
        def __getattribute__(self, name):
            if name.startswith("memguard"):
                raise KeyError(name)
            return super().__getattribute__(name)

    cases: list[tuple[str, Any, str]] = []
    for label, base in hook_namespaces().items():
        def every(v, base=base):
            ns = copy.deepcopy(base)
            for k, sub in list(vars(ns).items()):
                if k in ("rank", "world_size", "yaml_cfg"):
                    continue
                if isinstance(sub, types.SimpleNamespace):
                    for kk in list(vars(sub)):
                        setattr(sub, kk, v)
                else:
                    setattr(ns, k, v)
            return ns
        for mode in ("warn", "abort"):
            spaces = {"empty": types.SimpleNamespace(), "rank and world only": types.SimpleNamespace(rank=0, world_size=8)}
            for v_label, v in (("None", None), ("0", 0), ("'x'", "x"), ("10**30", 10**30), ("nan", float("nan")),
                               ("[]", []), ("an object refusing str/bool/==", _Refusing())):
                spaces[f"{v_label} everywhere"] = every(v)
            spaces["--memguard* raising when read"] = Raising(**vars(copy.deepcopy(base)))
            for s_label, ns in spaces.items():
                try:
                    object.__setattr__(ns, "memguard", mode) if not isinstance(ns, Raising) else None
                except Exception:
                    pass
                cases.append((f"{label} {mode}: {s_label}", ns, mode))
    broken, worst = [], (0.0, "")
    for label, ns, mode in cases:
        c0 = time.process_time()
        o = run_hook(ns)
        cpu = time.process_time() - c0
        if cpu > worst[0]:
            worst = (cpu, label)
        p = _hook_problems(o, exit_message=True)
        if p:
            broken.append(f"hook {label}: {'; '.join(p)[:200]}")
    # the runtime monitor with sources that raise or return garbage
    from megatron_memguard import estimate, layout_from_flags
    est = estimate(layout_from_flags(SMALL, world_size=8))
    pred = Prediction.from_estimate(est, 0)
    ok = dict(allocated=pred.persistent, max_allocated=2 * pred.peak_allocated, reserved=pred.persistent,
              max_reserved=2 * pred.peak_reserved, device_used=2 * pred.device_total)   # twice the prediction: warns
    sources: dict[str, Any] = {"raises": lambda: (_ for _ in ()).throw(RuntimeError("CUDA error")),
                               "returns a dict": lambda: dict(ok), "returns an int": lambda: 5}
    for field in ok:
        for v_label, v in (("nan", float("nan")), ("inf", float("inf")), ("-1", -1), ("True", True), ("2**64", 2**64),
                           ("1.5", 1.5), ("'x'", "x")):
            sources[f"{field}={v_label}"] = (lambda field=field, v=v: Reading(**{**ok, field: v}))
    for label, fn in sources.items():
        lines: list[str] = []
        c0 = time.process_time()
        try:
            m = MemoryMonitor(StaticSource(fn), pred, interval=1, emit=lines.append, emit_error=lines.append)
            m.start()
            for it in range(1, 101):
                m.step(it)
            s = m.finish() or {}
            p = []
            if m.warned is not None or any("WARNING" in x for x in lines):
                p.append("a warning from a garbage reading")
            if len([x for x in lines if "error" in x]) > 1:
                p.append("more than one error line")
            if any(v is not None for v in (s.get("max") or {}).values()):
                p.append(f"a summary of garbage: {s.get('max')}")
        except Exception as e:  # noqa: BLE001
            p = [f"escaped: {type(e).__name__}: {e}"[:200]]
        cpu = time.process_time() - c0
        if cpu > worst[0]:
            worst = (cpu, f"monitor {label}")
        if p:
            broken.append(f"monitor {label}: {'; '.join(p)}")
    return len(cases) + len(sources), broken, worst[0], worst[1]


def hook13_cases() -> tuple[int, list[str], float, str]:
    """Issue hostile13: the hook's validate_args wrapper on Megatron's own namespaces (core 0.16's stand-in parser, and
    0.19.2's real one where installed) with one of the newer flags (eval step, --skip-train, --save, GDN and DSA shape,
    rerun, CUDA graphs) set to a value of the wrong type: a str, a float, a negative, a list, a bool, NaN, inf, 10**30, a
    dict, bytes, an object refusing int() / bool() / ==. The promise: Megatron's validation runs, at most one memguard
    error line, no exception escapes. (runs, broken, worst CPU seconds, its case)."""

    class Refusing:
        def __int__(self):
            raise ValueError("no")
        __index__ = __float__ = __int__

        def __bool__(self):
            raise ValueError("no")

        def __eq__(self, other):
            raise ValueError("no")
        __hash__ = None  # type: ignore[assignment]

    values = [("'8'", "8"), ("1.5", 1.5), ("-1", -1), ("[]", []), ("True", True), ("nan", float("nan")),
              ("inf", float("inf")), ("10**30", 10**30), ("a dict", {"a": 1}), ("bytes", b"8"), ("Refusing", Refusing())]
    fields = ["eval_micro_batch_size", "eval_global_batch_size", "eval_iters", "eval_interval", "skip_train", "save",
              "save_interval", "experimental_attention_variant", "linear_attention_freq", "linear_num_key_heads",
              "linear_num_value_heads", "linear_key_head_dim", "linear_conv_kernel_dim", "dsa_indexer_topk",
              "dsa_indexer_n_heads", "hybrid_layer_pattern", "rerun_mode", "check_for_nan_in_loss_and_grad",
              "cuda_graph_impl", "cuda_graph_modules", "cuda_graph_scope"]
    def variant_on(ns: Any, f: str) -> None:
        if f.startswith("linear_"):      # (the GDN flags are read with the variant on)
            ns.experimental_attention_variant = "gated_delta_net"
            if f != "linear_attention_freq":
                ns.linear_attention_freq = 4
        if f.startswith("dsa_"):
            ns.experimental_attention_variant = "dsa"

    return _hook_field_cases("hook13", fields, values, deep=True, prepare=variant_on)


def _hook_field_cases(group: str, fields: list[str], values: list[tuple[str, Any]], deep: bool,
                      prepare: Any = None) -> tuple[int, list[str], float, str]:
    """The hook on each of Megatron's namespaces (but the --yaml-cfg one) with each field set to each value (after
    ``prepare(ns, field)``), in warn mode, timed. (runs, broken, worst CPU seconds, its case)."""
    import copy
    import time

    from mutate_util import hook_namespaces, run_hook
    broken, worst, n = [], (0.0, ""), 0
    for label, base in hook_namespaces().items():
        if label == "yaml-cfg":
            continue
        for f in fields:
            for v_label, v in values:
                ns = copy.deepcopy(base) if deep else copy.copy(base)
                setattr(ns, f, v)
                if prepare is not None:
                    prepare(ns, f)
                ns.memguard = "warn"
                c0 = time.process_time()
                o = run_hook(ns)
                cpu = time.process_time() - c0
                n += 1
                case = f"{label} {f}={v_label}"
                if cpu > worst[0]:
                    worst = (cpu, case)
                p = _hook_problems(o, exit_message=False)
                if p:
                    broken.append(f"{group} {case}: {'; '.join(p)[:200]}")
    return n, broken, worst[0], worst[1]


def _hook_problems(o: Any, exit_message: bool) -> list[str]:
    """What a hook run broke of the promise: it escaped or hung, Megatron's validation was never reached, more than
    one error line, and (``exit_message``) an exit 2 whose message is not one line naming memguard's setting."""
    p = []
    if o.escaped or o.timed_out:
        p.append(f"escaped: {o.escaped}" if o.escaped else "still running")
    if not (o.carried_on or o.aborted or o.exit2):
        p.append("Megatron's validation was not called")
    if exit_message and o.exit2 and (len(o.exit2.splitlines()) != 1 or "memguard" not in o.exit2):
        p.append("exit 2 message not one line naming the setting: " + o.exit2[:200])
    if len(o.errors) > 1:
        p.append(f"{len(o.errors)} error lines")
    return p


def big_logs(d: str) -> None:
    """--big: logs far over 1 MB that a long run writes (10**6 memory lines; 10**6 JSONL samples), timed."""
    import resource
    from megatron_logs import args_of, print_args, report_memory
    path = os.path.join(d, "big.log")
    with open(path, "w") as f:
        f.write("\n".join(print_args(args_of(SMALL, 8))) + "\n")
        for i in range(10**6):
            f.write(report_memory(i % 4, f"(after {i // 4} iterations)", 2**30, 2**31, 2**31, 2**31) + "\n")
    os.mkdir(os.path.join(d, "jsonl"))
    sample = json.loads(json.dumps(RUNLOG[1]))
    with open(os.path.join(d, "jsonl", "memguard-rank00000.jsonl"), "w") as f:
        f.write(json.dumps(RUNLOG[0]) + "\n")
        for i in range(10**6):
            sample["iteration"] = i
            f.write(json.dumps(sample) + "\n")
    for label, args in (("report 10**6 Megatron memory lines", ["report", path]),
                        ("calibrate 10**6 Megatron memory lines", ["calibrate", path]),      # (one run: read, then refused)
                        ("report 10**6 JSONL samples", ["report", os.path.join(d, "jsonl")])):
        o = run_memguard(args, wall_limit=600)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"  {label:<40} exit {o.code}  {o.cpu:6.2f} s CPU  {o.wall:6.2f} s wall  (process peak RSS so far {rss:,.0f} MiB)"
              + (f"  BROKEN: {'; '.join(o.problems)[:200]}" if o.problems else ""))


def hostile18_cases():
    """Issue hostile18: memguard plan resolves the config for every candidate layout, so a file the config names was
    read and parsed once per candidate (ci39: a --tp-comm-overlap-cfg of 20,000 nested brackets, 3 minutes); every such
    file (--tp-comm-overlap-cfg, --heterogeneous-layers-config-path) hostile, valid or not, under plan on 8 and 64
    GPUs (files.read_once: once per file version). --yaml-cfg, --config and --site-profile are read once by plan."""
    het = ("--num-layers 32 --hidden-size 512 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
           "--ffn-hidden-size 1024 --swiglu --normalization RMSNorm --position-embedding-type rope --use-rope-scaling "
           "--use-rotary-position-embeddings --rotary-base 500000 --untie-embeddings-and-output-weights "
           "--disable-bias-linear --max-position-embeddings 4096 --bf16 --hidden-dropout 0 --attention-dropout 0 "
           "--tokenizer-type NullTokenizer --vocab-size 1024 --heterogeneous-layers-config-path h.json").split()
    base = json.load(open(os.path.join(ROOT, "tests", "data", "heterogeneous", "small_blocks.json")))
    base = dict(base, num_hidden_layers=32, block_configs=base["block_configs"] * 8)
    nest: Any = 1
    for _ in range(60):
        nest = [nest]
    docs = {"valid": json.dumps(base),
            "9,000 strings of 100 (valid, unused key)": json.dumps(dict(base, pad=["x" * 100] * 9_000)),
            "60-deep nesting (valid, unused key)": json.dumps(dict(base, pad=[nest] * 140)),
            "900 KB of blanks (valid)": json.dumps(base) + " " * 900_000,
            "\\u escapes (valid, unused key)": json.dumps(dict(base, pad="\u00e9" * 150_000), ensure_ascii=True),
            "100,000 [": "[" * 100_000, "10,001 values": json.dumps(dict(base, pad=[0] * 10_001)),
            "BOM": "\ufeff" + json.dumps(base)}
    ub = {"ci39: 20,000 [": "[" * 20_000 + "\n", "100,000 [": "[" * 100_000 + "\n",
          "alias bomb": f"qkv_fprop: {alias_bomb(6, 6)}\n",
          "valid, 900 KB of comments": "qkv_dgrad: {method: ring_exchange}\n" + ("#" * 99 + "\n") * 9_000,
          "30,000 GEMMs": "".join(f"k{i}: {{method: ring_exchange}}\n" for i in range(30_000))}
    for gpus in ("8", "64"):
        plan = ["plan", "--gpus", gpus, "--seq-length", "512", "--global-batch-size", "64"]
        for label, text in docs.items():
            yield f"plan {gpus} GPUs heterogeneous {label}", [*plan, "--", *het], {"h.json": text}
        for label, text in ub.items():
            yield f"plan {gpus} GPUs --tp-comm-overlap-cfg {label}", [*plan, "--", *MOE, "--tp-comm-overlap",
                                                                      "--tp-comm-overlap-cfg", "ub.yaml"], {"ub.yaml": text}


def hostile19_cases():
    """Issue hostile19: the slowest --quick inputs' classes (a line of 950 kB of braced defaults or substitutions in each
    form bash reads), memguard calibrate over many runs, one run named thousands of times, step times from 1e-300 to
    1e300 ms, runs naming other GPUs, thousands of iteration lines and option lists; memguard plan with option lists of
    1,024 values, 2**60, primes and 2**20 GPUs, --rule with --explain; plan of hybrid models of 10,000 layers ('E-', 'ME',
    '|' segments) and hostile Mamba shapes; report on runtime JSONL with ranks interleaved in one file; NeMo / Bridge
    YAML with merge keys over anchors."""
    from megatron_logs import args_of, print_args, report_memory
    from test_calibrate_time import iteration_line
    # -- part 1: the reader's slowest line classes -----------------------------------------------------------------
    for unit in ("${A:-x}", "${A:=x}", "${A+x}", "${A-x}", "${A}", "${A:-}", '"${A:-x}"', "${A:-x y}", "$(x)", "$((1))",
                 "$(${A:-x}", "${A:-$(}", "$(" * 3 + ")" * 3):
        yield f"check 900 kB of {unit}", ["check", "--file", "run.sh"], {
            "run.sh": LAUNCH + "X=" + unit * (900_000 // len(unit)) + "\n"}
    yield "check 840 kB of ${A:-x} as an argument", ["check", "--file", "run.sh"], {
        "run.sh": LAUNCH.rstrip("\n").replace("| tee log.txt", "--save-x ") + "${A:-x}" * 120_000 + " | tee log.txt\n"}
    yield "check 900 kB of ( in quotes", ["check", "--file", "run.sh"], {"run.sh": LAUNCH + "X='" + "(" * 900_000 + "'\n"}
    yield "check 900 kB of unclosed ( lines", ["check", "--file", "run.sh"], {"run.sh": LAUNCH + "(\n" * 450_000}
    yield "check $((1+1+...)) of 900 kB", ["check", "--file", "run.sh"], {"run.sh": LAUNCH + "X=$((" + "1+" * 450_000 + "1))\n"}
    # -- memguard calibrate over many runs and odd run lists -----------------------------------------------------
    s_ = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
          "--micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 1000 --bf16 --train-iters 100").split()

    def mlog(gbs: int, its: list[str], head: str = "") -> str:
        mem = [report_memory(r, "(after 10 iterations)", 2**30, 2**31, 2**31 + 2**29, 2**31 + 2**30, device_used=2**32)
               for r in range(8)]
        return head + "\n".join(print_args(args_of([*s_, "--global-batch-size", str(gbs)], 8))) + "\n" + \
            "\n".join(its) + "\n" + "\n".join(mem) + "\n"

    def its(ms: str, n: int = 2) -> list[str]:
        return [iteration_line(1, 100, 9000.0, 10.0)] + [iteration_line(10 * k, 100, 1200.0, 150.0).replace("1200.0", ms)
                                                         for k in range(1, n + 1)]
    one = mlog(16, its("1200.0"))
    calib = ["calibrate", "--gpu", "H100-80GB"]
    yield "calibrate one run named 1,000 times", [*calib, *["r.log"] * 1_000], {"r.log": one}
    yield "calibrate one run named 100,000 times", ["calibrate", *["r.log"] * 100_000], {"r.log": one}
    yield "calibrate a directory named 5,000 times", ["calibrate", *["d"] * 5_000], {"d/r.log": one}
    yield "calibrate 5,000 names, the last repeated", [*calib, *[f"r{i}.log" for i in range(4_999)], "r0.log"], \
        {f"r{i}.log": "x\n" for i in range(4_999)}
    yield "calibrate 10 runs alike", [*calib, *[f"r{i}.log" for i in range(10)]], {f"r{i}.log": one for i in range(10)}
    for ms in ("1e-300", "1e300", "1e-5", "1e12", "0.0001", "nan", "inf"):
        runs = {f"r{i}.log": mlog(8 * (i + 1), its(ms)) for i in range(3)}
        yield f"calibrate 3 runs of {ms} ms steps", [*calib, *runs], runs
        yield f"calibrate 2 runs of {ms} ms steps and one of 1200", [*calib, *runs], {**runs, "r0.log": one}
    smi = ["GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-1)\n", "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-2)\n",
           "GPU 0: NVIDIA B200 (UUID: GPU-3)\n"]
    mixed = {f"r{i}.log": mlog(8 * (i + 1), its(str(1200.0 + i)), smi[i % 3]) for i in range(6)}
    yield "calibrate runs on three GPU types", ["calibrate", *mixed], mixed
    yield "calibrate runs on three GPU types --gpu", [*calib, *mixed], mixed
    yield "calibrate runs on three GPU types --fit gemm_efficiency", ["calibrate", *mixed, "--fit", "gemm_efficiency"], mixed
    yield "calibrate a run naming two GPUs", ["calibrate", "r0.log", "r1.log", "r2.log"], {
        "r0.log": smi[0] + smi[1] + one, "r1.log": one, "r2.log": one}
    long = {f"r{i}.log": mlog(8 * (i + 1), its("1200.0", 1_000)) for i in range(3)}
    yield "calibrate 3 runs of 1,000 iteration lines", [*calib, *long], long
    two = {"a.log": one, "b.log": one}
    yield "calibrate --min-runs 10**30", ["calibrate", *two, "--min-runs", "1" + "0" * 30], two
    yield "calibrate --fit one name 10,000 times", ["calibrate", *two, "--fit", ",".join(["gemm_efficiency"] * 10_000)], two
    yield "calibrate --env 5,000 times", ["calibrate", *two, *[f"--env=NCCL_BUFFSIZE={i}" for i in range(5_000)]], two
    # -- memguard plan's option lists --------------------------------------------------------------------------------
    plan = ["plan", "--gpus", "64", "--seq-length", "512", "--global-batch-size", "64", "--model", "llama-3.2-1b"]
    seq = ",".join(str(i) for i in range(1, 1025))
    for opt in ("--tp", "--pp", "--cp", "--vpp", "--mbs", "--ep"):
        for label, v in (("1..1024", seq), ("2**0..2**60", ",".join(str(2**k) for k in range(61))),
                         ("1 100,000 times", ",".join(["1"] * 100_000)), ("empty items", ",,,1,,"), ("0", "0")):
            yield f"plan {opt} {label}", [*plan, opt, v], {}
    for g in ("1", "7", "999983", "720720", "1048576"):
        yield f"plan --gpus {g} every list 1..1024", ["plan", "--gpus", g, "--seq-length", "8192", "--global-batch-size", g,
                                                      "--tp", seq, "--pp", seq, "--cp", seq, "--mbs", seq, "--vpp", seq,
                                                      "--model", "llama-3.2-1b"], {}
    for rule in ("time", "fujii2024"):
        for more in ([], ["--explain", "tp=1,pp=1,cp=1,mbs=1"], ["--rule", "fujii2024"], ["--rule", "time", "--top", "50"]):
            yield f"plan --rule {rule} {' '.join(more)}", [*plan, "--rule", rule, *more], {}
    # -- memguard plan of hybrid models (planner/hybrid.py) ------------------------------------------------------------
    hplan = ["plan", "--gpus", "8", "--seq-length", "128", "--global-batch-size", "8"]
    moe = ["--num-experts", "4", "--moe-router-topk", "2"]
    for pat in ("E-" * 5_000, "ME" * 5_000, "E" * 1_000, "ME*G" * 100, "M-" * 500 + "|" + "*-" * 500, "M*E-G",
                "|".join(["M*E-"] * 64)):
        for more in ([], ["--pp", "1,2,4,8"], ["--tp", "1,2,4,8", "--cp", "1,2"], ["--explain", "tp=1,pp=1,cp=1,mbs=1"],
                     ["--ep", "1,2,4"], ["--json"]):
            yield f"plan hybrid {pat[:12]!r} of {len(pat)} {' '.join(more)[:30]}", [
                *hplan, *more, "--", *HYBRID, "--hybrid-layer-pattern=" + pat, *moe], {}
    for flag, values in (("--mamba-num-heads", ("1", "3", "1024", "65536")), ("--mamba-head-dim", ("1", "3", "4096")),
                         ("--mamba-state-dim", ("1", "65536")), ("--mamba-chunk-size", ("1", "3", "1000000"))):
        for v in values:
            yield f"plan hybrid {flag} {v}", [*hplan, "--", *HYBRID, "--hybrid-layer-pattern=M*M-", flag, v], {}
    # -- memguard report on runtime JSONL: ranks interleaved in one file ---------------------------------------------
    recs = [json.dumps(dict(r, rank=k, pp_rank=k % 4)) for r in RUNLOG[:4] for k in range(8)]
    yield "report JSONL of 8 ranks interleaved in one file", ["report", "."], {"memguard-rank00000.jsonl": "\n".join(recs) + "\n"}
    many = [json.dumps(dict(RUNLOG[1], rank=k % 1024, iteration=10 * (k // 1024 + 1))) for k in range(1_024 * 2)]
    yield "report JSONL of 1,024 ranks interleaved, no start", ["report", "."], {"memguard-rank00000.jsonl": "\n".join(many) + "\n"}
    start = [json.dumps(dict(RUNLOG[0], rank=k)) for k in range(1_024)]
    yield "report JSONL of 1,024 start records interleaved with samples", ["report", "."], {
        "memguard-rank00000.jsonl": "\n".join(x for pair in zip(start, many) for x in pair) + "\n"}
    # -- NeMo / Bridge YAML: merge keys over anchors ------------------------------------------------------------------
    nemo = dict((n, t) for n, t, _ in YAML_SEEDS)["nemo1_llama.yaml"]
    merge = "base: &b {num_layers: 4, hidden_size: 256}\n" + "".join(f"m{i}: &m{i} {{<<: *{'b' if i == 0 else f'm{i - 1}'}, k{i}: 1}}\n"
                                                                    for i in range(2_000))
    yield "validate NeMo with 2,000 chained merge keys", ["validate", "c.yaml", "--gpus", "8"], {"c.yaml": merge + nemo}
    wide = "base: &b {" + ", ".join(f"k{i}: {i}" for i in range(5_000)) + "}\n" + "".join(f"m{i}: {{<<: *b}}\n" for i in range(5_000))
    yield "validate NeMo with 5,000 merges of a 5,000-key anchor", ["validate", "c.yaml", "--gpus", "8"], {"c.yaml": wide + nemo}
    yield "validate NeMo model merged from an alias bomb", ["validate", "c.yaml", "--gpus", "8"], {
        "c.yaml": "x: &x " + alias_bomb(6, 10) + "\n" + nemo.replace("model:\n", "model:\n  <<: {bomb: *x}\n", 1)}
    yield "estimate Bridge override merging an anchor into model", [
        "estimate", "--model", "llama32_1b", "--gpus", "8", "--config", "o.yaml"], {
        "o.yaml": "a: &a {tensor_model_parallel_size: 2, num_layers: 4}\nmodel:\n  <<: *a\n  <<: *a\n"}



def hostile20_cases():
    """Issue hostile20: the three costs hostile19 left open. memguard calibrate over 40, 80 and 290 runs (a 1 MB input;
    above 30 runs 10-fold held-out errors and fewer bootstrap resamples), the interleaved schedule with a partial last
    group at PP 8 x VPP 1,250 (schedule.p2p_peak's sampled path), and memguard plan --top 50 of a 10,000-layer model
    whose listed layouts run every micro-batch in the warm-up (the first stage's warm-up and cool-down sampled whole).
    The schedule's part of the last two is linear in VPP since vppspeed4 (docs/testing.md)."""
    import random
    from megatron_logs import args_of, print_args, report_memory
    from test_calibrate_time import iteration_line
    s_ = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
          "--micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 1000 --bf16 --train-iters 100").split()
    rng = random.Random(5)

    def mlog(i: int) -> str:
        a = 2**30 + rng.randint(0, 2**28)
        mem = [report_memory(r, "(after 10 iterations)", a, a + 2**30, a + 2**29 + rng.randint(0, 2**27), a + 3 * 2**29,
                             device_used=a + 2**32 + rng.randint(0, 2**28)) for r in range(8)]
        its = [iteration_line(1, 100, 9000.0, 10.0)] + [iteration_line(10 * k, 100, 1200.0 + i * 7 % 50, 150.0)
                                                         for k in range(1, 3)]
        return "\n".join(print_args(args_of([*s_, "--global-batch-size", str(8 * (i % 16 + 1))], 8))) + "\n" + \
            "\n".join(its) + "\n" + "\n".join(mem) + "\n"
    for n in (40, 80, 290):
        runs = {f"r{i}.log": mlog(i) for i in range(n)}
        yield f"calibrate {n} runs", ["calibrate", "--gpu", "H100-80GB", *runs], runs
    yield "estimate PP 8 x VPP 1,250, a partial last group", ["estimate", "--gpus", "16", "--", "--num-layers", "10000",
        "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256", "--max-position-embeddings", "256",
        "--micro-batch-size", "1", "--global-batch-size", "40", "--pipeline-model-parallel-size", "8",
        "--num-virtual-stages-per-pipeline-rank", "1250", "--vocab-size", "1000",
        "--microbatch-group-size-per-virtual-pipeline-stage", "12"], {}
    small = ["--num-layers", "10000", "--hidden-size", "256", "--num-attention-heads", "4", "--max-position-embeddings",
             "512", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--bf16"]
    for more in ([], ["--num-experts", "8", "--moe-router-topk", "2", "--disable-bias-linear"]):
        yield f"plan --top 50 of 10,000 layers on 64 GPUs {' '.join(more)[:20]}", [
            "plan", "--gpus", "64", "--seq-length", "512", "--global-batch-size", "64", "--top", "50", "--", *small, *more], {}


def hostile21_cases():
    """Issue hostile21: where earlier rounds did not look. memguard plan --explain and --rule with values no round gave
    (digits of other scripts, underscores, signs, keys twice in other cases, every key at once); site profiles whose
    time constants are huge, NaN, inf, negative, YAML integers of 400 digits or not numbers, read by plan --rule time,
    estimate and MEMGUARD_PROFILE; calibrate with step times of 0 ms, every run alike, slower with fewer samples; report
    on runtime JSONL with iterations out of order, repeated 2,000 times, negative, of 400 digits or not integers, and
    time running backwards; NeMo / Bridge YAML whose aliases expand to 10**12 values (lists and mappings, at every
    section) or whose anchors hold themselves, and override lists nested 5,000 deep; MEMGUARD_TE_VERSION and the other MEMGUARD_* variables holding
    garbage (5,000 digits, other scripts' digits, local versions, control characters); calibrate --name in any text."""
    from megatron_logs import args_of, print_args, report_memory
    from test_calibrate_time import iteration_line
    plan = ["plan", "--gpus", "8", "--seq-length", "512", "--global-batch-size", "64"]
    # -- memguard plan --explain / --rule ------------------------------------------------------------------------
    for ex in ("tp=\u0661,pp=1,cp=1,mbs=1", "tp=1_0", "tp=+1,pp=1,cp=1,mbs=1", "TP=1,PP=1,CP=1,MBS=1", "tp=1,TP=2",
               "tp=1;pp=1", "tp:1", "tp==1", "tp=1\npp=1", "tp=1.0,pp=1,cp=1,mbs=1", "tp=1e0", "tp=0b1", "tp=\u00b9",
               "tp=1,pp=1,cp=1,mbs=1,vpp=1,ep=1,etp=1,recompute=none,fsdp=0,x=1", " tp = 1 , pp = 1 ", "tp=" + "9" * 5_000,
               "tp=1,pp=1,cp=1,mbs=1,recompute=" + "full" * 20_000, "," * 100_000, "tp=1=2", "\x00", "tp=1,pp=1,vpp=" + "2" * 400):
        yield f"plan --explain {ex[:40]!r}", [*plan, "--explain", ex, "--", *S], {}
    for rule in ("TIME", "time ", "time,memory", "Memory", "\u2013", "time\n", "fujii2024 ", "x" * 100_000, "memory" * 1_000):
        yield f"plan --rule {rule[:30]!r}", [*plan, "--rule", rule, "--", *S], {}
        yield f"plan --rule {rule[:30]!r} --explain", [*plan, "--rule", rule, "--explain", "tp=1,pp=1,cp=1,mbs=1", "--", *S], {}
    # -- site profiles with hostile time constants ----------------------------------------------------------------
    head = "schema: memguard.site/2\nmemguard_version: 0.1.0.dev0\ngpu: H100-80GB\ntime:\n"
    for k in ("gemm_efficiency", "attention_efficiency", "network_gbps"):
        for v in (".nan", ".inf", "-.inf", "-1", "0", "1e400", "-1e400", "9" * 400, "-" + "9" * 400, "1e-400", "0x10",
                  "'0.5'", "[0.5]", "{a: 1}", "true", "~", "!!binary aGVsbG8=", "2026-01-01", "1_000", "0.5 # c", "&a 0.5"):
            text = head + f"  {k}: {v}\n"
            yield f"plan --rule time profile {k}: {v[:20]}", [*plan, "--rule", "time", "--site-profile", "p.yaml", "--", *S], \
                {"p.yaml": text}
            yield f"estimate profile {k}: {v[:20]}", ["estimate", "--world-size", "8", "--site-profile", "p.yaml", "--", *S], \
                {"p.yaml": text}
            yield f"plan MEMGUARD_PROFILE {k}: {v[:20]}", [*plan, "--", *S], {"p.yaml": text}, {"MEMGUARD_PROFILE": "p.yaml"}
    # -- calibrate: step times of 0 ms, every run alike, slower with more samples --------------------------------------
    s_ = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
          "--micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 1000 --bf16 --train-iters 100").split()

    def mlog(gbs: int, ms: list[float], tflops: float | None = 150.0) -> str:
        mem = [report_memory(r, "(after 10 iterations)", 2**30, 2**31, 2**31 + 2**29, 2**31 + 2**30, device_used=2**32)
               for r in range(8)]
        its = [iteration_line(1, 100, 9000.0, 10.0)] + [iteration_line(10 * (k + 1), 100, m, tflops) for k, m in enumerate(ms)]
        return "\n".join(print_args(args_of([*s_, "--global-batch-size", str(gbs)], 8))) + "\n" + "\n".join(its) + "\n" + \
            "\n".join(mem) + "\n"
    calib = ["calibrate", "--gpu", "H100-80GB"]
    for label, runs in (
            ("0 ms steps", {f"r{i}.log": mlog(8 * (i + 1), [0.0, 0.0]) for i in range(4)}),
            ("0 ms and 1200 ms steps", {f"r{i}.log": mlog(8 * (i + 1), [0.0, 1200.0]) for i in range(4)}),
            ("every run alike (gbs and times)", {f"r{i}.log": mlog(16, [1200.0, 1200.0]) for i in range(6)}),
            ("the same time at every batch", {f"r{i}.log": mlog(8 * (i + 1), [1200.0, 1200.0]) for i in range(6)}),
            ("slower with fewer samples", {f"r{i}.log": mlog(8 * (i + 1), [12000.0 / (i + 1)] * 2) for i in range(6)}),
            ("no throughput column", {f"r{i}.log": mlog(8 * (i + 1), [1200.0 * (i + 1)] * 2, None) for i in range(4)}),
            ("steps of 1e-320 ms", {f"r{i}.log": mlog(8 * (i + 1), [1e-320 * (i + 1)] * 2) for i in range(4)}),
            ("one step of inf among finite", {f"r{i}.log": mlog(8 * (i + 1), [1200.0 * (i + 1), float("inf")]) for i in range(4)}),
            ("1,000 alike steps", {f"r{i}.log": mlog(8 * (i + 1), [1200.0] * 1_000) for i in range(3)})):
        yield f"calibrate {label}", [*calib, *runs], runs
        yield f"calibrate --fit gemm_efficiency {label}", [*calib, *runs, "--fit", "gemm_efficiency"], runs
    # calibrate --name: written into the profile (an emoji gave a file memguard could not read; not UTF-8: refused)
    runs = {f"r{i}.log": mlog(8 * (i + 1), [1200.0 * (i + 1)] * 2) for i in range(4)}
    for name in ("x\udcff", "team \U0001F600", "a\x85b", "\u2028", "\x00\x7f", "'; constants: {", "x" * 100_000):
        yield f"calibrate --name {name[:20]!r}", [*calib, *runs, "--name", name, "--out", "s.yaml"], runs
    # -- report on runtime JSONL: iterations out of order, repeated, odd ---------------------------------------------
    start, sample = RUNLOG[0], RUNLOG[1]

    def jl(recs: list[dict]) -> dict[str, str]:
        return {"memguard-rank00000.jsonl": "\n".join(json.dumps(r) for r in recs) + "\n"}
    for label, its_ in (("out of order", [100, 10, 50, 20, 90]), ("repeated 2,000 times", [10] * 2_000),
                        ("descending 2,000", list(range(2_000, 0, -1))), ("negative", [-10, -20]), ("400 digits", [10**400]),
                        ("1e308 as float", [1e308]), ("strings", ["10", "20"]), ("booleans", [True, False]),
                        ("nan", [float("nan")]), ("zero then huge", [0, 2**63, 2**64])):
        recs = [start] + [dict(sample, iteration=i, time=float(k)) for k, i in enumerate(its_)]
        yield f"report JSONL iterations {label}", ["report", "."], jl(recs)
    yield "report JSONL time running backwards", ["report", "."], jl(
        [start] + [dict(sample, iteration=10 * k, time=1e9 - k * 1e6) for k in range(1, 200)])
    yield "report JSONL two starts and summaries first", ["report", "."], jl(
        [RUNLOG[5], RUNLOG[5], start, sample, start, sample, RUNLOG[4], RUNLOG[4]])
    yield "report JSONL 5,000 warnings of one iteration", ["report", "."], jl([start] + [RUNLOG[2]] * 5_000)
    # -- NeMo / Bridge YAML: 10**12 values behind aliases, override lists nested 5,000 deep ---------------------------
    seeds = dict((n, t) for n, t, _ in YAML_SEEDS)
    nemo = seeds["nemo1_llama.yaml"]
    map_bomb = "".join(f"m{i}: &m{i} {{" + ", ".join(f"k{j}: *m{i - 1}" if i else f"k{j}: x" for j in range(10)) + "}\n"
                       for i in range(12))
    for where, text in (("a list bomb at the top", "bomb: " + alias_bomb(12, 10) + "\n" + nemo),
                        ("a mapping bomb at the top", map_bomb + nemo),
                        ("a mapping bomb merged into model", map_bomb + nemo.replace("model:\n", "model:\n  <<: *m11\n", 1)),
                        ("a mapping bomb as trainer", map_bomb + nemo.replace("trainer:\n", "trainer_old:\n", 1) + "trainer: *m11\n"),
                        ("model.num_layers a mapping bomb", map_bomb + nemo.replace("model:\n", "model:\n  tokenizer: *m11\n", 1)),
                        ("exp_manager a list bomb", nemo + "exp_manager: " + alias_bomb(12, 10) + "\n")):
        yield f"validate NeMo {where}", ["validate", "c.yaml", "--gpus", "8"], {"c.yaml": text}
    for where, text in (("a list holding itself", "a: &a [*a]\n" + nemo),
                        ("model holding itself", nemo.replace("model:\n", "model: &m\n  self: *m\n", 1)),
                        ("trainer holding itself", nemo.replace("trainer:\n", "trainer: &t\n  loop: *t\n", 1))):
        yield f"validate NeMo {where}", ["validate", "c.yaml", "--gpus", "8"], {"c.yaml": text}
    yield "estimate Bridge override model holding itself", ["estimate", "--model", "llama32_1b", "--gpus", "8", "--config",
                                                            "o.yaml"], {"o.yaml": "model: &m\n  loop: *m\n  num_layers: 4\n"}
    for n, t in seeds.items():
        if "bridge" in n or "override" in n:
            yield f"estimate Bridge {n} with a mapping bomb", ["estimate", "--model", "llama32_1b", "--gpus", "8", "--config",
                                                             "o.yaml"], {"o.yaml": map_bomb + t}
    deep = "[" * 5_000 + "1" + "]" * 5_000
    yield "estimate Bridge override nested 5,000 deep", ["estimate", "--model", "llama32_1b", "--gpus", "8", "--config", "o.yaml"], {
        "o.yaml": f"model:\n  num_layers: {deep}\n"}
    yield "estimate Bridge override list of 5,000 nested mappings", ["estimate", "--model", "llama32_1b", "--gpus", "8",
                                                                      "--config", "o.yaml"], {
        "o.yaml": "model:\n  x: " + "{a: " * 5_000 + "1" + "}" * 5_000 + "\n"}
    yield "validate NeMo override list nested 5,000 deep", ["validate", "c.yaml", "--gpus", "8"], {
        "c.yaml": nemo + f"overrides: {deep}\n"}
    # -- MEMGUARD_* variables holding garbage --------------------------------------------------------------------
    for v in ("9" * 5_000, "\u0662.14.1", "2.14.1+local.\x01", "2.14", "2", "2." * 20_000, "v2.14.1", " 2.14.1 ", "1e400",
              "nan", "2.14.1rc0.post1.dev3", "0!2.14", "2.14.1" + "\u0301", "99999999999999999999.0", "-2.14"):
        for cmd in (["estimate", "--world-size", "8", "--", *S, "--fp8-format", "hybrid"], [*plan, "--", *S]):
            yield f"{cmd[0]} MEMGUARD_TE_VERSION={v[:20]!r}", cmd, {}, {"MEMGUARD_TE_VERSION": v}
        yield f"check launch exporting MEMGUARD_TE_VERSION={v[:20]!r}", ["check", "--file", "run.sh"], {
            "run.sh": LAUNCH.replace("export CUDA_DEVICE_MAX_CONNECTIONS=1", f"export CUDA_DEVICE_MAX_CONNECTIONS=1\nexport "
                                     f"MEMGUARD_TE_VERSION='{v}'")}
    for var in ("MEMGUARD_THRESHOLD", "MEMGUARD_GPU_MEMORY", "MEMGUARD_LOG_INTERVAL", "MEMGUARD_PROFILE", "MEMGUARD"):
        for v in ("9" * 5_000, "\u0662", "\x1b[31m", "1" * 400 + "GiB", "-0", "0x" + "f" * 1000):
            yield f"estimate {var}={v[:20]!r}", ["estimate", "--world-size", "8", "--", *S], {}, {var: v}


def main(argv: list[str]) -> int:
    import tempfile

    import megatron_memguard.files as mg_files
    mg_files.PIPE_WAIT = 0.5
    step = 10 if "--quick" in argv else 1
    tmp = tempfile.TemporaryDirectory(prefix="memguard-hostile-")
    if "--big" in argv:
        print("logs a long run writes (--big):")
        big_logs(tmp.name)
        print()
    groups = [("reproductions", reproductions()), ("flags", flag_cases()), ("configs", config_cases()),
              ("launch", launch_cases()), ("run logs", runlog_cases()), ("largest", largest_cases()),
              ("features", feature_cases()), ("files", file_cases(hostile_files(tmp.name))), ("logs", log_cases()),
              ("structured regressions", structured_regressions()), ("surfaces", surface_cases()),
              ("releases", release_cases()), ("structured", structured_cases()), ("hybrid", hybrid_cases()),
              ("newest", newest_cases()), ("hostile10", hostile10_cases()), ("hostile11", hostile11_cases()),
              ("hostile12", hostile12_cases(tmp.name)), ("hostile13", hostile13_cases(tmp.name)),
              ("hostile14", hostile14_cases()), ("hostile15", hostile15_cases()), ("hostile16", hostile16_cases()),
              ("hostile17", hostile17_cases(tmp.name)),
              ("hostile18", hostile18_cases()), ("hostile19", hostile19_cases()), ("hostile20", hostile20_cases()),
              ("hostile21", hostile21_cases())]
    if "--group" in argv:   # one group only (its name as printed below, e.g. --group newest)
        only = argv[argv.index("--group") + 1]
        groups = [g for g in groups if g[0] == only]
    worst: dict[str, tuple[float, float, str]] = {}
    runs: dict[str, int] = defaultdict(int)
    broken: dict[str, list[str]] = defaultdict(list)
    rows = []
    for group, cases in groups:
        for k, (label, args, files, *env) in enumerate(cases):   # (env: the MEMGUARD_* variables of a case, hostile11)
            if step > 1 and group not in ("reproductions", "largest", "features", "files", "structured regressions") and k % step:
                continue
            size = sum(len(c) for c in files.values()) + sum(len(a) for a in args)
            assert size < LIMIT, (label, size)
            o = run_memguard(args, files, env=env[0] if env else None)
            cmd = args[0] if args else "(none)"
            runs[cmd] += 1
            if o.problems:
                broken[cmd].append(f"{label[:100]}: {'; '.join(o.problems)[:200]}")
            if cmd not in worst or o.cpu > worst[cmd][0]:
                worst[cmd] = (o.cpu, o.wall, label[:90])
            if group == "reproductions":
                rows.append(f"  {label:<34} exit {o.code}  {o.cpu:5.2f} s CPU  {o.wall:5.2f} s wall  "
                            f"{(o.err.strip().splitlines() or [''])[0][:90]}")
    print("issue 14's reproductions (CPU and wall time in-process):")
    print("\n".join(rows))
    print()
    print(f"{'command':<10} {'runs':>6} {'broken':>7} {'worst CPU':>10} {'its wall':>9}  worst input")
    for cmd in sorted(runs):
        c, w, label = worst[cmd]
        print(f"{cmd:<10} {runs[cmd]:>6} {len(broken[cmd]):>7} {c:>9.2f}s {w:>8.2f}s  {label}")
    n, hook_broken, hook_cpu, hook_label = hook_cases(0 if "--group" in argv else 60 if step > 1 else 600)
    print(f"{'hook':<10} {n:>6} {len(hook_broken):>7} {hook_cpu:>9.2f}s {'':>9}  {hook_label}")
    runs["hook"], broken["hook"], worst["hook"] = n, hook_broken, (hook_cpu, 0.0, hook_label)
    if "--group" not in argv or "hostile10" in argv:   # (the hook's and monitor's hostile10 cases: all of them, quick too)
        n, hook_broken, hook_cpu, hook_label = hook10_cases()
        print(f"{'hook10':<10} {n:>6} {len(hook_broken):>7} {hook_cpu:>9.2f}s {'':>9}  {hook_label}")
        runs["hook10"], broken["hook10"], worst["hook10"] = n, hook_broken, (hook_cpu, 0.0, hook_label)
    if "--group" not in argv or "hostile13" in argv:   # (the hook's hostile13 cases: all of them, quick too)
        n, hook_broken, hook_cpu, hook_label = hook13_cases()
        print(f"{'hook13':<10} {n:>6} {len(hook_broken):>7} {hook_cpu:>9.2f}s {'':>9}  {hook_label}")
        runs["hook13"], broken["hook13"], worst["hook13"] = n, hook_broken, (hook_cpu, 0.0, hook_label)
    if "--group" not in argv or "hostile14" in argv:   # (the hook's hostile14 cases: all of them, quick too)
        n, hook_broken, hook_cpu, hook_label = hook14_cases()
        print(f"{'hook14':<10} {n:>6} {len(hook_broken):>7} {hook_cpu:>9.2f}s {'':>9}  {hook_label}")
        runs["hook14"], broken["hook14"], worst["hook14"] = n, hook_broken, (hook_cpu, 0.0, hook_label)
    total = sum(runs.values())
    over = [cmd for cmd in runs if worst[cmd][0] > TARGET]
    nbroken = sum(len(v) for v in broken.values())
    print(f"\n{total} runs, {nbroken} broke the promise; every command under {TARGET:.0f} s of CPU: "
          f"{'yes' if not over else 'no (' + ', '.join(over) + ')'}")
    for cmd, items in broken.items():
        for item in items[:5]:
            print(f"  broken: {cmd}: {item}")
    return 0 if not over and not nbroken else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
