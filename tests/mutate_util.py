"""Structured mutations of REAL inputs (issue hostile2): every file and command line memguard reads, as the
project and its users have them (examples/, ../shared/configs, tests/data, the runtime monitor's JSONL, a
Megatron log, a site profile), parsed, damaged one structural step at a time, and written back, so that the
readers get past the parser and the damage reaches the code that uses each value.

A mutation is a pure function of (seed, Random): tests/test_fuzz_structured.py draws them with hypothesis
(derandomized) and benchmarks/hostile_input.py replays a fixed list."""
from __future__ import annotations

import json
import math
import os
import random
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# --------------------------------------------------------------------------------------------------
# Hostile values, as Python objects (dumped as YAML / JSON by the seed's own format)
# --------------------------------------------------------------------------------------------------
HUGE_TEXT = "x" * 200_000


def _deep(n: int) -> Any:
    v: Any = 1
    for _ in range(n):
        v = [v]
    return v


VALUES: list[tuple[str, Any]] = [
    ("None", None), ("empty", ""), ("-1", -1), ("0", 0), ("1e309", math.inf), ("-inf", -math.inf), ("NaN", math.nan),
    ("True", True), ("False", False), ("[]", []), ("{}", {}), ("abc", "abc"), ("2**80", 2**80), ("-2**80", -(2**80)),
    ("1.5", 1.5), ("huge string", HUGE_TEXT), ("nested 100", _deep(100)), ("nested 40", _deep(40)),
    ("1e-300", 1e-300), ("'8'", "8"), ("'1e309'", "1e309"), ("[1, 2]", [1, 2]), ("{a: 1}", {"a": 1}),
]
# raw YAML text in place of a value (anchors and aliases cannot be written from Python objects)
RAW_YAML = [
    ("billion laughs", "&l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"),
    ("alias bomb", None),   # filled below
    ("self alias", "&r [*r]"),
    ("undefined alias", "*nowhere"),
    ("merge key", "{<<: {num_layers: 2, hidden_size: 64}, a: 1}"),
    ("bad merge", "{<<: 3}"),
    ("tag", "!!python/object/apply:os.system [ls]"),
    ("binary", "!!binary AAAA"),
    ("set", "!!set {a, b}"),
    ("timestamp", "2001-12-14t21:59:43.10-05:00"),
    ("interpolation", "${model.num_layers}"),
    ("self interpolation", "${.}"),
    ("oc.env", "${oc.env:MEMGUARD_FUZZ_UNSET}"),
    ("oc.decode", "\"${oc.decode:'[1,2]'}\""),
    ("missing", "???"),
    ("resolver", "${multiply:1e400,2}"),
]


def alias_bomb(levels: int = 6, width: int = 9) -> str:
    parts = ["&a0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        parts.append(f"&a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "[" + ", ".join(parts) + "]"


RAW_YAML[1] = ("alias bomb", alias_bomb())

# The numbers of a layout, by the names each input kind gives them: swapping them (TP = layers, EP = world)
# keeps every value a valid integer while breaking the rules between them.
LAYOUT_KEYS = {
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size", "num_layers", "num_hidden_layers",
    "hidden_size", "num_attention_heads", "num_query_groups", "num_key_value_heads", "ffn_hidden_size",
    "intermediate_size", "seq_length", "encoder_seq_length", "max_position_embeddings", "micro_batch_size",
    "global_batch_size", "devices", "num_nodes", "num_moe_experts", "num_experts", "num_local_experts",
    "moe_router_topk", "num_experts_per_tok", "vocab_size", "kv_channels", "moe_ffn_hidden_size", "world_size",
}
LAYOUT_FLAGS = ["--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                "--num-layers", "--hidden-size", "--num-attention-heads", "--num-query-groups", "--ffn-hidden-size",
                "--seq-length", "--max-position-embeddings", "--micro-batch-size", "--global-batch-size",
                "--expert-model-parallel-size", "--num-experts", "--moe-router-topk", "--vocab-size",
                "--num-layers-per-virtual-pipeline-stage", "--world-size", "--nproc-per-node", "--nnodes", "--gpus"]
# hostile values of one command-line token
TOKENS = ["", "-1", "0", "1e309", "nan", "NaN", "True", "[]", "{}", "abc", str(2**80), "x" * 100_000, "1.5", "-",
          "--", "=", "0x10", "١٢", "8 8", "\x00", "$(reboot)", "${A}", "'", "@", "null", "~"]
DASHES = ["\u2014", "\u2013", "\u2212\u2212", "\u2010\u2010", "\uff0d\uff0d", "\u2012"]


# --------------------------------------------------------------------------------------------------
# Seeds
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Seed:
    """A real input: ``files`` written in the run's directory (the first is the one mutated), and the
    memguard commands that read it, ``{file}`` standing for the mutated file's name."""
    name: str
    kind: str                      # "doc" (YAML / JSON), "script" (shell), "jsonl", "log", "nemo" (a tar)
    files: tuple[tuple[str, str], ...]
    commands: tuple[tuple[str, ...], ...]

    @property
    def file(self) -> str:
        return self.files[0][0]

    @property
    def text(self) -> str:
        return self.files[0][1]


def _read(*parts: str) -> str:
    with open(os.path.join(*parts), encoding="utf-8") as f:
        return f.read()


def _shared() -> str:
    from benchmarks.shared_data import SHARED
    return SHARED


PLAN = ("plan", "--seq-length", "512", "--global-batch-size", "16", "--max-tp", "2", "--top", "1")


def _config_commands(opts: tuple[str, ...], flags: tuple[str, ...] = ()) -> tuple[tuple[str, ...], ...]:
    flags = ("--", *flags) if flags else ()
    return (("estimate", "--config", "{file}", *opts, *flags),
            ("estimate", "--config", "{file}", "--json", "--detail", *opts, *flags),
            ("validate", "{file}", *opts, *flags),
            (*PLAN, "--config", "{file}", *[o for o in opts if o not in ("--gpus", "8", "64", "16")], "--gpus", "8", *flags))


# What a config.json does not give (sequence length, batch), so that its mutants reach the estimator (without
# them every command stopped at '--seq-length: is required'); EP 4 divides every seed's experts (60 to 256).
HF_FLAGS = ("--micro-batch-size", "1", "--seq-length", "4096", "--global-batch-size", "64", "--expert-model-parallel-size", "4")


def seeds() -> list[Seed]:
    """Every real input memguard reads, as found in the repository and ../shared (read-only: copies are
    mutated in a temporary directory)."""
    from fuzz_util import HF, RUNLOG, MEGATRON_LOG
    out: list[Seed] = []
    shared = os.path.join(_shared(), "configs")
    # config files: ../shared/configs (Megatron functional tests, NeMo 1, NeMo launcher, Bridge, NeMo 2)
    for sub, opts in (("megatron-functional", ("--gpus", "8", "--vocab-size", "50257")),
                      ("nemo1", ("--gpus", "8", "--vocab-size", "32000")),
                      ("nemo-launcher", ("--gpus", "64", "--vocab-size", "32000")),
                      ("megatron-bridge", ("--gpus", "8", "--model", "llama32_1b")),
                      ("nemo2", ("--gpus", "8"))):
        for name in sorted(os.listdir(os.path.join(shared, sub))):
            if name.endswith(".yaml"):
                out.append(Seed(f"{sub}/{name}", "doc", (("c.yaml", _read(shared, sub, name)),), _config_commands(opts)))
    # examples/ and tests/data: NeMo 1 YAML, Hugging Face config.json, --yaml-cfg, heterogeneous blocks
    out.append(Seed("examples/nemo1/conf/megatron_llama_config.yaml", "doc",
                    (("c.yaml", _read(ROOT, "examples", "nemo1", "conf", "megatron_llama_config.yaml")),),
                    _config_commands(("--gpus", "8", "--vocab-size", "32000"))))
    hf = os.path.join(HERE, "data", "hf")
    for name in sorted(os.listdir(hf)):
        out.append(Seed(f"tests/data/hf/{name}", "doc", (("config.json", _read(hf, name)),),
                        _config_commands(("--gpus", "64"), HF_FLAGS)
                        + (("estimate", "--model", "{file}", "--world-size", "64", "--", *HF_FLAGS),)))
    out.append(Seed("fuzz_util.HF config.json", "doc", (("config.json", json.dumps(HF, indent=1)),),
                    _config_commands(("--gpus", "8"), ("--micro-batch-size", "1"))))
    small = ("--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "512",
             "--max-position-embeddings", "512", "--micro-batch-size", "1", "--global-batch-size", "8",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--bf16")
    out.append(Seed("tests/data/yaml_cfg/gpt_small.yaml", "doc", (("y.yaml", _read(HERE, "data", "yaml_cfg", "gpt_small.yaml")),),
                    (("estimate", "--world-size", "8", "--", "--yaml-cfg", "{file}"),
                     ("validate", "--world-size", "8", "--", "--yaml-cfg", "{file}"))))
    het = os.path.join(HERE, "data", "heterogeneous")
    for name in sorted(os.listdir(het)):
        out.append(Seed(f"tests/data/heterogeneous/{name}", "doc", (("h.json", _read(het, name)),),
                        (("estimate", "--world-size", "8", "--", *small, "--heterogeneous-layers-config-path", "{file}"),
                         ("estimate", "--world-size", "8", "--json", "--", *small, "--heterogeneous-layers-config-path", "{file}",
                          "--heterogeneous-layers-config-encoded-json", "{}"))))
    # Megatron-Bridge ConfigContainer dumps (flat and nested layouts) and NeMo 2 exports: tests' real-format texts
    from test_readers_bridge import FLAT, NESTED
    from test_readers_nemo2_moe import DEEPSEEK_V2_LITE_CONTEXT, QWEN3_30B_A3B_EXPORT
    for label, text in (("bridge run_config flat", FLAT), ("bridge run_config nested", NESTED)):
        out.append(Seed(label, "doc", (("run_config.yaml", text),), _config_commands(("--gpus", "8"))))
    from test_bridge_moe_recipes import MLA_MODEL
    mla = {"_target_": "megatron.bridge.training.config.ConfigContainer", "model": MLA_MODEL,
           "train": {"micro_batch_size": 1, "global_batch_size": 64}, "dataset": {"seq_length": 4096},
           "tokenizer": {"tokenizer_type": "NullTokenizer", "vocab_size": 32000},
           "ddp": {"use_distributed_optimizer": True}, "mixed_precision": "bf16_mixed"}
    out.append(Seed("bridge run_config MLA MoE", "doc", (("run_config.yaml", yaml.safe_dump(mla, sort_keys=False)),),
                    _config_commands(("--gpus", "8"))))
    for label, text in (("nemo2 qwen3-30b-a3b export", QWEN3_30B_A3B_EXPORT), ("nemo2 deepseek-v2-lite context",
                                                                              DEEPSEEK_V2_LITE_CONTEXT)):
        out.append(Seed(label, "doc", (("model.yaml", text),), _config_commands(("--gpus", "16"))))
    # a NeMo 1 .nemo checkpoint (a tar holding model_config.yaml)
    nemo_cfg = _read(shared, "nemo1", "megatron_gpt_config.yaml")
    out.append(Seed("nemo1 .nemo checkpoint", "nemo", (("model.nemo", nemo_cfg),),
                    (("estimate", "--config", "{file}", "--gpus", "8"), ("validate", "{file}", "--gpus", "8"))))
    # a site profile (memguard calibrate's output)
    profile = ("schema: memguard.site/1\nmemguard_version: 0.1.0\nname: cluster a\ngpu: H100-80GB\n"
               "constants:\n  cuda_context: 600MiB\n  nccl_per_communicator: 96MiB\n  allocator_fragmentation: 7.5%\n"
               "fit:\n  runs: 12\n")
    out.append(Seed("site profile", "doc", (("site.yaml", profile),),
                    (("estimate", "--site-profile", "{file}", "--world-size", "8", "--", *small),
                     ("validate", "--site-profile", "{file}", "--world-size", "8", "--", *small),
                     ("report", "run", "--site-profile", "{file}")))
               )
    # launch scripts: examples/ and tests/data/launch
    for rel in ("llama3_8b_h100.sh", "slurm_preflight.sbatch", "megatron/run_pretrain_gpt.sh", "torchrun_preflight.sh"):
        out.append(Seed(f"examples/{rel}", "script", (("run.sh", _read(ROOT, "examples", rel)),),
                        (("check", "--file", "{file}"), ("estimate", "--config", "{file}", "--json"),
                         ("validate", "{file}"))))
    launch = os.path.join(HERE, "data", "launch")
    for name in sorted(os.listdir(launch)):
        out.append(Seed(f"tests/data/launch/{name}", "script", (("run.sh", _read(launch, name)),),
                        (("check", "--file", "{file}"), ("estimate", "--config", "{file}"))))
    # the runtime monitor's JSONL, a Megatron log (report, calibrate)
    jsonl = "\n".join(json.dumps(r) for r in RUNLOG) + "\n"
    out.append(Seed("runtime JSONL", "jsonl", (("memguard-rank00000.jsonl", jsonl),),
                    (("report", "."), ("report", ".", "--json"), ("report", ".", "--skip-bad-lines", "--all-ranks"),
                     ("calibrate", "a", "b", "c"))))
    out.append(Seed("megatron log", "log", (("rank0.log", MEGATRON_LOG),),
                    (("report", "{file}"), ("report", "{file}", "--json"), ("calibrate", "{file}", "{file}", "{file}"))))
    return out


# Command lines: Megatron flags as users write them, with memguard's options
LLAMA = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
         "--num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope "
         "--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
         "--tokenizer-type NullTokenizer --vocab-size 128256 --micro-batch-size 1 --global-batch-size 128 --bf16 "
         "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel "
         "--use-distributed-optimizer --recompute-granularity selective").split()
MOE_FLAGS = LLAMA + ("--num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 2 --moe-grouped-gemm "
                     "--moe-token-dispatcher-type alltoall").split()
COMMAND_LINES = [
    ("estimate", ["estimate", "--world-size", "16", "--", *LLAMA]),
    ("estimate moe", ["estimate", "--world-size", "16", "--json", "--", *MOE_FLAGS]),
    ("validate", ["validate", "--world-size", "16", "--", *LLAMA]),
    ("check", ["check", "--", "torchrun", "--nproc-per-node", "8", "--nnodes", "2", "pretrain_gpt.py", *LLAMA]),
    ("plan", ["plan", "--gpus", "8", "--seq-length", "4096", "--global-batch-size", "64", "--max-tp", "2", "--top", "1",
              "--", *LLAMA[:LLAMA.index("--micro-batch-size")]]),
    ("estimate model", ["estimate", "--model", "llama3.1-8b", "--gpus", "16", "--", "--micro-batch-size", "1",
                        "--tensor-model-parallel-size", "2"]),
    ("estimate recipe", ["estimate", "--model", "llama32_1b", "--gpus", "8", "--set", "train.micro_batch_size=2"]),
    ("estimate moe recipe", ["estimate", "--model", "deepseek_v2_lite", "--gpus", "16", "--set", "model.num_moe_experts=32",
                             "--set", "model.expert_model_parallel_size=8"]),
    ("validate moe recipe", ["validate", "--model", "qwen3_30b_a3b_8gpu", "--gpus", "8", "--",
                             "train.global_batch_size=64", "model.moe_router_topk=4"]),
    ("plan moe", ["plan", "--gpus", "8", "--seq-length", "1024", "--global-batch-size", "32", "--max-tp", "2", "--top", "1",
                  "--", *MOE_FLAGS[:MOE_FLAGS.index("--micro-batch-size")], "--num-experts", "8", "--moe-router-topk", "2"]),
]


# --------------------------------------------------------------------------------------------------
# Mutations
# --------------------------------------------------------------------------------------------------
@dataclass
class Mutant:
    files: dict[str, str | bytes]
    argv: list[str]
    notes: list[str] = field(default_factory=list)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a parsed document (lists: their first three items)."""
    out: list[tuple] = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append(prefix + (k,))
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):
            out.append(prefix + (i,))
            out += _paths(v, prefix + (i,))
    return out


def _get(doc: Any, path: tuple) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _parent(doc: Any, path: tuple):
    return _get(doc, path[:-1]), path[-1]


SENTINEL = "memguard-structured-sentinel"


def _dump(doc: Any, as_json: bool) -> str:
    if as_json:
        return json.dumps(doc, indent=1)
    return yaml.safe_dump(doc, sort_keys=False, width=10**9, allow_unicode=True)


def mutate_doc(text: str, as_json: bool, rnd: random.Random, notes: list[str]) -> str:
    """One to three structural mutations of a YAML / JSON document."""
    doc = yaml.safe_load(text)
    raws: list[str] = []
    post: list[str] = []
    for _ in range(rnd.randint(1, 3)):
        paths = _paths(doc)
        if not paths:
            break
        # the layout numbers and the number leaves are where memguard computes: picked half the time
        numeric = [p for p in paths if isinstance(p[-1], str) and p[-1] in LAYOUT_KEYS]
        path = rnd.choice(numeric if numeric and rnd.random() < 0.5 else paths)
        node, key = _parent(doc, path)
        how = rnd.choice(["delete", "value", "value", "value", "swap type", "unknown key", "layout swap", "raw",
                          "duplicate", "truncate"])
        if how == "delete":
            del node[key]
            notes.append(f"delete {'.'.join(map(str, path))}")
        elif how == "value":
            label, v = rnd.choice(VALUES)
            node[key] = v
            notes.append(f"{'.'.join(map(str, path))} = {label}")
        elif how == "swap type":
            v = node[key]
            new = [v] if not isinstance(v, list) else (v[0] if v else 0)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and rnd.random() < 0.5:
                new = str(v)
            elif isinstance(v, str) and rnd.random() < 0.5:
                new = len(v)
            elif isinstance(v, dict):
                new = list(v.items())[:2] if rnd.random() < 0.5 else len(v)
            node[key] = new
            notes.append(f"{'.'.join(map(str, path))} type {type(v).__name__} -> {type(new).__name__}")
        elif how == "unknown key":
            target = node if isinstance(node, dict) else doc if isinstance(doc, dict) else None
            if target is not None:
                target[rnd.choice(["memguard_fuzz_unknown", "num_layerz", "tensor_model_paralel_size", "_target_"])] = \
                    rnd.choice([1, "x", None, {"a": 1}])
                notes.append("unknown key")
        elif how == "layout swap":
            if len(numeric) >= 2:
                a, b = rnd.sample(numeric, 2)
                na, ka = _parent(doc, a)
                nb, kb = _parent(doc, b)
                na[ka] = nb[kb]
                notes.append(f"{'.'.join(map(str, a))} = {'.'.join(map(str, b))}")
        elif how == "raw" and not as_json:
            label, raw = rnd.choice(RAW_YAML)
            node[key] = f"{SENTINEL}{len(raws)}x"
            raws.append(raw)
            notes.append(f"{'.'.join(map(str, path))} = {label}")
        elif how == "duplicate":
            post.append(str(key) if isinstance(key, str) else "")
            notes.append(f"duplicate {key}")
        else:
            post.append("\0truncate")
    out = _dump(doc, as_json)
    for k, raw in enumerate(raws):
        out = out.replace(f"{SENTINEL}{k}x", raw)
    for p in post:
        if p == "\0truncate":
            cut = rnd.randint(0, max(0, len(out) - 1))
            out = out[:cut]
            notes.append(f"truncated at byte {cut}")
        elif p:
            out = duplicate_key(out, p, as_json, rnd)
    return out


def duplicate_key(text: str, key: str, as_json: bool, rnd: random.Random) -> str:
    """The first line defining ``key`` repeated right after itself with another value."""
    if as_json:
        m = re.search(rf'^(\s*)"{re.escape(key)}": ([^\n]*?)(,?)$', text, re.M)
        if not m:
            return text
        other = rnd.choice(["0", "-1", "\"x\"", "null", "1e400", "[]"])
        return text[:m.end()] + ("" if m.group(3) else ",") + f'\n{m.group(1)}"{key}": {other}' + \
            ("," if m.group(3) else "") + text[m.end():]
    m = re.search(rf"^(\s*)({re.escape(key)}):([^\n]*)$", text, re.M)
    if not m:
        return text
    other = rnd.choice(["0", "-1", "x", "null", ".inf", "[]", "{}", "2"])
    return text[:m.end()] + f"\n{m.group(1)}{key}: {other}" + text[m.end():]


FLAG_RE = re.compile(r"(--[A-Za-z][\w-]*)(?:=|\s+)(\S+)")


def mutate_script(text: str, rnd: random.Random, notes: list[str]) -> str:
    """Launch scripts: a flag's value replaced, dropped, repeated, a layout number swapped, unicode dashes,
    truncation."""
    for _ in range(rnd.randint(1, 3)):
        found = list(FLAG_RE.finditer(text))
        how = rnd.choice(["value", "value", "drop value", "repeat", "layout swap", "dash", "truncate", "equals"])
        if not found or how == "truncate":
            cut = rnd.randint(0, max(0, len(text) - 1))
            text = text[:cut]
            notes.append(f"truncated at byte {cut}")
            continue
        layout = [m for m in found if m.group(1) in LAYOUT_FLAGS or m.group(1).startswith("--n")]
        m = rnd.choice(layout if layout and rnd.random() < 0.6 else found)
        flag, value = m.group(1), m.group(2)
        if how == "value":
            new = rnd.choice(TOKENS)
            new = shlex.quote(new) if rnd.random() < 0.7 else new
            text = text[:m.start(2)] + new + text[m.end(2):]
            notes.append(f"{flag} {new[:30]!r}")
        elif how == "drop value":
            text = text[:m.start(2)] + text[m.end(2):]
            notes.append(f"{flag} without its value")
        elif how == "repeat":
            other = rnd.choice(["1", "3", "7", "0", "64", "abc"])
            text = text[:m.end()] + f" {flag} {other}" + text[m.end():]
            notes.append(f"{flag} repeated with {other}")
        elif how == "layout swap" and len(layout) >= 2:
            a, b = rnd.sample(layout, 2)
            text = text[:a.start(2)] + b.group(2) + text[a.end(2):] if a.start() > b.start() else \
                text[:a.start(2)] + b.group(2) + text[a.end(2):]
            notes.append(f"{a.group(1)} = {b.group(1)}'s {b.group(2)}")
        elif how == "dash":
            dash = rnd.choice(DASHES)
            text = text[:m.start(1)] + dash + flag[2:] + text[m.end(1):]
            notes.append(f"{dash}{flag[2:]}")
        elif how == "equals":
            text = text[:m.start()] + f"{flag}={value}" + text[m.end():]
            notes.append(f"{flag}={value}")
    return text


def _is_flag(tok: str) -> bool:
    return tok.startswith("--") and len(tok) > 2


def mutate_argv(argv: list[str], rnd: random.Random, notes: list[str], files: dict[str, str]) -> list[str]:
    """Command lines: drop a value after a flag, repeat a flag with a conflicting value, ``--flag=value`` vs
    ``--flag value``, unicode dashes, ``@file`` arguments, hostile values, layout numbers swapped."""
    argv = list(argv)
    for _ in range(rnd.randint(1, 3)):
        flags = [i for i, t in enumerate(argv) if _is_flag(t)]
        valued = [i for i in flags if i + 1 < len(argv) and not argv[i + 1].startswith("-")]
        how = rnd.choice(["drop value", "repeat", "equals", "split equals", "dash", "@file", "value", "value",
                          "layout swap", "delete", "move"])
        if how == "drop value" and valued:
            i = rnd.choice(valued)
            notes.append(f"{argv[i]} without its value")
            del argv[i + 1]
        elif how == "repeat" and valued:
            i = rnd.choice(valued)
            other = rnd.choice(["1", "3", "0", "7", "64", "abc", "inf"])
            at = rnd.choice([len(argv), i + 2, i])
            argv[at:at] = [argv[i], other]
            notes.append(f"{argv[at]} repeated with {other}")
        elif how == "equals" and valued:
            i = rnd.choice(valued)
            argv[i:i + 2] = [f"{argv[i]}={argv[i + 1]}"]
            notes.append(f"{argv[i]}")
        elif how == "split equals":
            eq = [i for i, t in enumerate(argv) if "=" in t]
            if eq:
                i = rnd.choice(eq)
                argv[i:i + 1] = argv[i].split("=", 1)
                notes.append(f"{argv[i]} {argv[i + 1]} (split)")
        elif how == "dash" and flags:
            i = rnd.choice(flags)
            argv[i] = rnd.choice(DASHES) + argv[i][2:]
            notes.append(f"{argv[i]}")
        elif how == "@file":
            content = rnd.choice(["--num-layers 2\n", "--tensor-model-parallel-size 3\n", "", "@args.txt\n", "x" * 1000])
            files["args.txt"] = content
            at = rnd.randint(0, len(argv))
            argv.insert(at, rnd.choice(["@args.txt", "@missing.txt", "@"]))
            notes.append(f"{argv[at]} at {at} ({content[:20]!r})")
        elif how == "value" and valued:
            i = rnd.choice(valued)
            argv[i + 1] = rnd.choice(TOKENS)
            notes.append(f"{argv[i]} {argv[i + 1][:30]!r}")
        elif how == "layout swap":
            lay = [i for i in valued if argv[i] in LAYOUT_FLAGS]
            if len(lay) >= 2:
                a, b = rnd.sample(lay, 2)
                argv[a + 1] = argv[b + 1]
                notes.append(f"{argv[a]} = {argv[b]}'s {argv[b + 1]}")
        elif how == "delete" and flags:
            i = rnd.choice(flags)
            n = 2 if i in valued else 1
            notes.append(f"no {argv[i]}")
            del argv[i:i + n]
        elif how == "move" and valued:
            i = rnd.choice(valued)   # a memguard option after '--' or a Megatron flag before it
            pair = argv[i:i + 2]
            del argv[i:i + 2]
            at = rnd.randint(1, len(argv))
            argv[at:at] = pair
            notes.append(f"{pair[0]} moved to {at}")
    return argv


def mutate_lines(text: str, rnd: random.Random, notes: list[str], jsonl: bool) -> str:
    """Run logs: a JSON record's field mutated structurally (the JSONL), a number of a Megatron log line
    replaced; truncation; a line repeated."""
    lines = text.split("\n")
    for _ in range(rnd.randint(1, 3)):
        how = rnd.choice(["field", "field", "truncate", "repeat", "swap"])
        if how == "truncate":
            joined = "\n".join(lines)
            cut = rnd.randint(0, max(0, len(joined) - 1))
            lines = joined[:cut].split("\n")
            notes.append(f"truncated at byte {cut}")
        elif how == "repeat" and lines:
            j = rnd.randrange(len(lines))
            lines[j:j] = [lines[j]] * rnd.choice([2, 50])
            notes.append(f"line {j} repeated")
        elif jsonl:
            idx = [j for j, line in enumerate(lines) if line.startswith("{")]
            if not idx:
                continue
            j = rnd.choice(idx)
            try:
                rec = json.loads(lines[j])
            except ValueError:
                continue
            paths = _paths(rec)
            if not paths:
                continue
            path = rnd.choice(paths)
            node, key = _parent(rec, path)
            if how == "swap":
                nums = [p for p in paths if isinstance(_get(rec, p), (int, float))]
                if nums:
                    node[key] = _get(rec, rnd.choice(nums))
            elif rnd.random() < 0.2:
                del node[key]
                notes.append(f"record {j}: delete {'.'.join(map(str, path))}")
            else:
                label, v = rnd.choice(VALUES)
                node[key] = v
                notes.append(f"record {j}: {'.'.join(map(str, path))} = {label}")
            lines[j] = json.dumps(rec)
        else:
            nums = [(j, m) for j, line in enumerate(lines) for m in re.finditer(r"\d+(?:\.\d+)?", line)
                    if "memory" in line or "iteration" in line or "rank" in line.lower() or "  " in line[:3]]
            if not nums:
                continue
            j, m = rnd.choice(nums)
            new = rnd.choice(TOKENS[:13] + ["1" + "0" * 400, "-5", "0.0"])
            lines[j] = lines[j][:m.start()] + new + lines[j][m.end():]
            notes.append(f"line {j}: {m.group(0)} -> {new[:20]!r}")
    return "\n".join(lines)


def nemo_archive(config: str, rnd: random.Random, notes: list[str]) -> bytes:
    """A .nemo tar around ``config`` (itself mutated), damaged as an archive: compressed, the config behind
    other members, twice, as a directory or a link, the archive cut at a random byte."""
    import io
    import tarfile

    def add(tar, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
        ti = tarfile.TarInfo(name)
        ti.type, ti.linkname, ti.size = kind, link, len(data) if kind == tarfile.REGTYPE else 0
        tar.addfile(ti, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

    how = rnd.choice(["plain", "gz", "xz", "behind", "twice", "directory", "symlink", "hardlink", "cut", "absolute"])
    notes.append(f".nemo {how}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode={"gz": "w:gz", "xz": "w:xz"}.get(how, "w")) as tar:
        data = config.encode("utf-8", "surrogatepass")
        if how == "behind":
            for i in range(rnd.choice([10, 500, 3000])):
                add(tar, f"model_weights/shard_{i}.distcp", b"\0" * 64)
        if how == "directory":
            add(tar, "model_config.yaml", kind=tarfile.DIRTYPE)
        elif how == "symlink":
            add(tar, "model_config.yaml", kind=tarfile.SYMTYPE, link=rnd.choice(["/etc/passwd", "../x", "model_config.yaml"]))
        elif how == "hardlink":
            add(tar, "model_config.yaml", kind=tarfile.LNKTYPE, link="nowhere.yaml")
        else:
            add(tar, "/model_config.yaml" if how == "absolute" else "./model_config.yaml", data)
        if how == "twice":
            add(tar, "model_config.yaml", b"model: 3\n")
        add(tar, "model_weights.ckpt", b"\0" * 512)
    out = buf.getvalue()
    if how == "cut":
        cut = rnd.randint(0, len(out) - 1)
        notes.append(f"cut at byte {cut}")
        out = out[:cut]
    return out


def mutant(seed: Seed, rnd: random.Random) -> Mutant:
    """The seed's file mutated structurally, and one of its commands (whose arguments may be mutated too)."""
    notes = [seed.name]
    name, text = seed.files[0]
    files = dict(seed.files)
    if seed.kind == "doc":
        text = mutate_doc(text, name.endswith(".json"), rnd, notes)
    elif seed.kind == "nemo":
        text = nemo_archive(mutate_doc(text, False, rnd, notes) if rnd.random() < 0.7 else text, rnd, notes)
    elif seed.kind == "script":
        text = mutate_script(text, rnd, notes)
    else:
        text = mutate_lines(text, rnd, notes, seed.kind == "jsonl")
    files[name] = text
    argv = [a.replace("{file}", name) for a in rnd.choice(seed.commands)]
    if argv[0] == "calibrate" and seed.kind == "jsonl":   # three run directories holding the run log
        files = {f"{d}/{name}": text for d in ("a", "b", "c")}
    elif argv[0] == "report" and seed.name == "site profile":
        from fuzz_util import RUNLOG
        files["run/memguard-rank00000.jsonl"] = "\n".join(json.dumps(r) for r in RUNLOG) + "\n"
    if rnd.random() < 0.25:
        argv = mutate_argv(argv, rnd, notes, files)
    return Mutant(files, argv, notes)


def command_mutant(label: str, argv: list[str], rnd: random.Random) -> Mutant:
    files: dict[str, str] = {}
    notes = [label]
    return Mutant(files, mutate_argv(argv, rnd, notes, files), notes)


# --------------------------------------------------------------------------------------------------
# The Megatron hook: a namespace as Megatron's parser leaves it, each field mutated the same way
# --------------------------------------------------------------------------------------------------
def _legacy_arguments():
    """tests/legacy_standin's arguments.py (core_v0.16.1's option names and defaults), loaded by path so
    that a real megatron.training (Python 3.12) stays where it is."""
    import importlib.util
    import sys
    name = "memguard_fuzz_legacy_arguments"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(HERE, "legacy_standin", "megatron", "training", "arguments.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules[name] = mod
    return sys.modules[name]


HOOK_FLAGS = LLAMA[:LLAMA.index("--recompute-granularity")] + ["--lr", "1e-4", "--train-iters", "10",
                                                               "--memguard-gpu-memory", "79.1GiB"]


def hook_namespaces() -> dict[str, Any]:
    """Namespaces the hook's validate_args wrapper receives: core_v0.16.1's (the legacy stand-in's parser)
    and core 0.19.2's (the real parser, where megatron.training is installed), each with the --memguard
    group; and the --yaml-cfg namespace load_yaml makes (tests/data/yaml_cfg/gpt_small.yaml)."""
    import argparse
    import types

    from megatron_memguard.megatron.flags import add_arguments
    out: dict[str, Any] = {}
    try:
        legacy = _legacy_arguments()
        p = add_arguments(legacy.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)), environ={})
        ns = p.parse_args(HOOK_FLAGS)
        ns.rank, ns.world_size = 0, 16
        out["legacy 0.16"] = ns
    except ImportError:   # no torch
        pass
    try:
        from megatron.training.arguments import add_megatron_arguments
        p = add_arguments(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)), environ={})
        ns = p.parse_args(HOOK_FLAGS + ["--mock-data"])
        ns.rank, ns.world_size = 0, 16
        out["container 0.19"] = ns
    except Exception:     # (not installed: Python 3.11)
        pass
    doc = yaml.safe_load(_read(HERE, "data", "yaml_cfg", "gpt_small.yaml"))
    ns = json.loads(json.dumps(doc), object_hook=lambda item: types.SimpleNamespace(**item))
    ns.yaml_cfg, ns.rank, ns.world_size = "gpt_small.yaml", 0, 16
    out["yaml-cfg"] = ns
    return out


class _Opaque:
    def __repr__(self) -> str:
        return "<object>"


def _numpy_values() -> list[tuple[str, Any]]:
    """NumPy numbers, as a launcher that computed a size with NumPy leaves them (issue hostile3)."""
    try:
        import numpy as np
    except ImportError:
        return []
    return [("np.int64 8", np.int64(8)), ("np.float64 0.5", np.float64(0.5)), ("np.bool_", np.bool_(True))]


HOOK_VALUES = VALUES + [("object", _Opaque()), ("lambda", lambda: 1), ("bytes", b"\xff"), ("tuple", (1, 2)),
                        ("set", {1}), ("complex", 1j), ("namespace", None), ("lock", __import__("threading").Lock()),
                        *_numpy_values()]


def mutate_namespace(ns: Any, rnd: random.Random, notes: list[str]) -> Any:
    """A deep copy of ``ns`` with one to three fields deleted, replaced, type-swapped or set to another
    layout field's value (sections of a --yaml-cfg namespace included)."""
    import copy
    import types
    ns = copy.deepcopy(ns)
    for _ in range(rnd.randint(1, 3)):
        holders = [("", ns)] + [(k + ".", v) for k, v in vars(ns).items() if isinstance(v, types.SimpleNamespace)]
        prefix, holder = rnd.choice(holders) if rnd.random() < 0.4 else holders[0]
        names = sorted(vars(holder))
        layout = [k for k in names if k in LAYOUT_KEYS]
        mine = [k for k in names if k.startswith("memguard")]
        pool = layout if layout and rnd.random() < 0.4 else mine if mine and rnd.random() < 0.15 else names
        if not pool:
            continue
        key = rnd.choice(pool)
        how = rnd.choice(["value", "value", "value", "delete", "swap type", "layout swap"])
        if how == "delete":
            delattr(holder, key)
            notes.append(f"del {prefix}{key}")
        elif how == "value":
            label, v = rnd.choice(HOOK_VALUES)
            if label == "namespace":
                v = types.SimpleNamespace(a=1)
            setattr(holder, key, v)
            notes.append(f"{prefix}{key} = {label}")
        elif how == "swap type":
            v = getattr(holder, key)
            new = [v] if not isinstance(v, list) else (v[0] if v else 0)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and rnd.random() < 0.5:
                new = str(v)
            setattr(holder, key, new)
            notes.append(f"{prefix}{key} {type(v).__name__} -> {type(new).__name__}")
        elif layout:
            other = rnd.choice(layout)
            setattr(holder, key, getattr(holder, other))
            notes.append(f"{prefix}{key} = {prefix}{other}")
    return ns


@dataclass
class HookOutcome:
    carried_on: bool = False       # Megatron's own validate_args ran after memguard's decision
    aborted: bool = False          # MemguardAbort (the user asked for abort / autotune)
    exit2: str = ""                # a --memguard setting refused as argparse would (one line)
    internal: int = 0              # exceptions memguard caught inside itself (its own bugs)
    escaped: str = ""              # an exception that left the hook
    timed_out: bool = False
    emitted: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    action: str = ""

    def problems(self, mutated_settings: bool) -> list[str]:
        p = []
        if self.timed_out:
            p.append("still running")
        if self.escaped:
            p.append("exception escaped the hook: " + self.escaped)
        if self.internal:
            p.append(f"{self.internal} internal error(s): {' | '.join(self.errors)[:300]}")
        if self.exit2 and not mutated_settings:
            p.append("exit 2 without a bad --memguard setting: " + self.exit2)
        if self.exit2 and (len(self.exit2.splitlines()) != 1 or "memguard" not in self.exit2):
            p.append("exit 2 message not one line naming the setting: " + self.exit2[:200])
        if not (self.carried_on or self.aborted or self.exit2 or self.escaped or self.timed_out):
            p.append("Megatron's validate_args was not called")
        return p


def run_hook(ns: Any, wall_limit: int = 10, reject: bool = False) -> HookOutcome:
    """``ns`` through the hook's validate_args / validate_yaml wrapper around a stand-in Megatron validator
    that accepts anything (or, ``reject``, raises as Megatron's asserts do), with an H100's memory."""
    import signal

    from fuzz_util import CaseTimeout
    from megatron_memguard.decision import MemguardAbort
    from megatron_memguard.megatron import hook
    from megatron_memguard.megatron.yaml_args import is_yaml_namespace

    o = HookOutcome()
    calls: list[int] = []

    def validate(args, defaults=None, *a, **k):
        if reject:
            raise AssertionError("Megatron rejects it")
        calls.append(1)
        return args

    try:
        yaml_shaped = is_yaml_namespace(ns)
    except Exception:     # (the wrapper asks again, and must survive it)
        yaml_shaped = True
    wrap = hook._wrap_validate_yaml(validate) if yaml_shaped else hook._wrap_validate(validate)
    state = hook.STATE
    saved = (state.emit, state.emit_error, state.error, state.decision, state.settings)
    from megatron_memguard.runtime.reporting import ErrorReporter
    state.emit = o.emitted.append
    state.emit_error = o.emitted.append
    state.error = ErrorReporter(o.errors.append, prefix="[memguard]")
    env = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("MEMGUARD")}
    old_env = {k: os.environ.get(k) for k in ("MEMGUARD_GPU_MEMORY", "WORLD_SIZE", "RANK")}
    os.environ.update({"WORLD_SIZE": "16", "RANK": "0"})
    argv = __import__("sys").argv
    __import__("sys").argv = ["pretrain_gpt.py"]

    def alarm(signum, frame):
        o.timed_out = True
        raise CaseTimeout()

    prev = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(wall_limit)
    try:
        try:
            known = bool(getattr(ns, "memguard_gpu_memory", None))
        except Exception:     # (a namespace whose values raise when read: the hook's own reading is what is tested)
            known = False
        if not known:
            os.environ["MEMGUARD_GPU_MEMORY"] = "79.1GiB"    # (no GPU here: the device query would say unknown)
        wrap(ns, {"tokenizer_type": "GPT2BPETokenizer"})
    except MemguardAbort:
        o.aborted = True
    except SystemExit as e:
        o.exit2 = "\n".join(o.emitted[-1:]) if e.code == 2 else f"exit {e.code}"
        if e.code != 2:
            o.escaped = f"SystemExit({e.code})"
    except CaseTimeout:
        o.timed_out = True
    except AssertionError as e:
        if not reject or "Megatron rejects it" not in str(e):
            o.escaped = f"AssertionError: {e}"[:300]
    except BaseException as e:  # noqa: BLE001
        o.escaped = f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, prev)
        __import__("sys").argv = argv
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        os.environ.update(env)
        o.internal = state.error.errors
        o.action = getattr(state.decision, "action", "") or ""
        state.emit, state.emit_error, state.error, state.decision, state.settings = saved
    o.carried_on = bool(calls) or reject
    return o


# --------------------------------------------------------------------------------------------------
# The Megatron-Bridge pre-flight (bridge.preflight): a ConfigContainer as a dict, mutated the same way
# --------------------------------------------------------------------------------------------------
def bridge_seeds() -> list[Seed]:
    return [s for s in seeds() if "run_config" in s.name or s.name.startswith("megatron-bridge/")]


def run_bridge_preflight(seed: Seed, rnd: random.Random) -> tuple[list[str], list[str]]:
    """(notes, problems) of bridge.preflight on the seed's document mutated by structure: an exception that
    leaves the pre-flight (other than the abort asked for) or an internal error it caught is a problem."""
    import textwrap

    from megatron_memguard.bridge import preflight
    from megatron_memguard.decision import MemguardAbort
    notes = [seed.name]
    text = mutate_doc(textwrap.dedent(seed.text), False, rnd, notes)
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError:   # (a raw YAML value or a cut that no longer parses: no dict to hand over)
        return notes, []
    mode = rnd.choice(["warn", "report", "abort"])
    out: list[str] = []
    try:
        r = preflight(cfg, world_size=8, gpu="H100-80GB", mode=mode, emit=out.append, environ={})
    except MemguardAbort:
        return notes, [] if mode == "abort" else [f"aborted in mode {mode}"]
    except Exception as e:  # noqa: BLE001
        return notes, [f"exception escaped: {type(e).__name__}: {str(e)[:200]}"]
    bad = [line for line in out + [r.reason or ""] if "internal error" in line]
    return notes, [f"internal error: {bad[0][:300]}"] if bad else []
