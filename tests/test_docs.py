"""Every term an estimate can show has a documentation page."""
import os

import pytest

from megatron_memguard import estimate, layout_from_flags

from conftest import LLAMA2_7B

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "terms")

VARIANTS = [
    ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
     "--use-distributed-optimizer"],
    ["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "2", "--grad-reduce-in-bf16",
     "--hidden-dropout", "0.1", "--position-embedding-type", "learned_absolute", "--transformer-impl", "local"],
    ["--fp16", "--fp16-lm-cross-entropy", "--recompute-granularity", "full", "--recompute-method", "uniform",
     "--recompute-num-layers", "2", "--optimizer", "sgd", "--defer-embedding-wgrad-compute",
     "--pipeline-model-parallel-size", "2"],
    # mixture of experts: every MoE term (dispatcher state, router buffers, grouped-GEMM workspaces)
    ["--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--moe-grouped-gemm",
     "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid", "--moe-token-dispatcher-type",
     "alltoall", "--moe-layer-freq", "2", "--moe-shared-expert-intermediate-size", "1024", "--disable-bias-linear"],
    ["--num-experts", "8", "--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "flex", "--disable-bias-linear"],
]


@pytest.mark.parametrize("extra", VARIANTS)
@pytest.mark.parametrize("profile", ["auto", "fujii2024"])
def test_every_term_is_documented(extra, profile):
    flags = [f for f in LLAMA2_7B if f != "--bf16" or "--fp16" not in extra] + [
        "--micro-batch-size", "1", "--global-batch-size", "64"] + extra
    est = estimate(layout_from_flags(flags, world_size=16), profile=profile)
    for stage in est.stages:
        for term in stage.terms:
            assert os.path.exists(os.path.join(DOCS, term.name + ".md")), term.name
            assert term.name in readme_rows(), term.name


@pytest.mark.parametrize("extra", [["--optimizer", "soap", "--use-distributed-optimizer"], ["--optimizer", "lion"],
                                   ["--optimizer", "adaptive_muon", "--muon-scalar-optimizer", "lion"],
                                   ["--grad-reduce-in-bf16", "--optimizer-cuda-graph", "--use-distributed-optimizer"],
                                   ["--pipeline-model-parallel-size", "4", "--fine-grained-activation-offloading",
                                    "--offload-modules", "core_attn", "--delta-offload-bytes-across-pp-ranks", "1000000",
                                    "--attention-output-gate"]])
def test_emerging_optimizer_terms_are_documented(extra):
    # (the fujii2024 profile refuses them: the paper's closed form has Adam and SGD only; with the optimizer CUDA
    # graph, offloading's tuning and the output gate, the terms they add)
    flags = LLAMA2_7B + ["--micro-batch-size", "1", "--global-batch-size", "64"] + extra
    for stage in estimate(layout_from_flags(flags, world_size=16)).stages:
        for term in stage.terms:
            assert os.path.exists(os.path.join(DOCS, term.name + ".md")), term.name
            assert term.name in readme_rows(), term.name


# --- every term name the estimator can emit has a page and a row in docs/terms/README.md (static: a new term on a
# path no estimate above reaches is caught too)

import ast
import re

ROOT = os.path.dirname(DOCS.rstrip(os.sep).rsplit(os.sep, 1)[0])
GROUPS = {"weights", "gradients", "optimizer", "transients", "activations", "logits_loss", "fixed", "allocator", "host"}
# where a breakdown is assembled: stage terms, per-micro-batch items, their group table
NAMED_DICTS = {"parts", "saved", "_END_GROUPS"}
# pages that explain a feature or a share of another term, not a term of the breakdown
OVERVIEW_PAGES = {"README", "dsa", "fp8", "fsdp", "gdn", "mamba", "moe", "optimizer_offload", "eval_step"}
LAYER_ITEM_FILES = {"activations.py", "fp8_layers.py"}


def _strs(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _strs(node.body) + _strs(node.orelse)
    return []


def emitted_term_names() -> set[str]:
    names: set[str] = set()
    est_dir = os.path.join(ROOT, "megatron_memguard", "estimator")
    for dirpath, _, files in os.walk(est_dir):
        for f in files:
            # layers/, activations.py and fp8_layers.py name the items a layer keeps (the per-layer table of
            # --detail), not breakdown terms
            if not f.endswith(".py") or os.path.basename(dirpath) == "layers" or f in LAYER_ITEM_FILES:
                continue
            tree = ast.parse(open(os.path.join(dirpath, f), encoding="utf-8").read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "Term" \
                        and node.args:
                    names.update(_strs(node.args[0]))
                elif isinstance(node, ast.Tuple) and len(node.elts) >= 3 and _strs(node.elts[0]) and any(
                        isinstance(e, ast.Constant) and e.value in GROUPS for e in node.elts[1:]):
                    names.update(_strs(node.elts[0]))       # (name, bytes, group, level, detail) rows
                elif isinstance(node, ast.Subscript) and getattr(node.value, "id", "") in NAMED_DICTS \
                        and isinstance(node.ctx, ast.Store):
                    names.update(_strs(node.slice))
                elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict) and any(
                        getattr(t, "id", "") in NAMED_DICTS for t in getattr(node, "targets", [getattr(node, "target", None)])):
                    names.update(s for k in node.value.keys if k is not None for s in _strs(k))
                elif isinstance(node, ast.Dict) and None in node.keys:      # {**parts, "offload_staging": ...}
                    if any(getattr(v, "id", "") == "parts" for k, v in zip(node.keys, node.values) if k is None):
                        names.update(s for k in node.keys if k is not None for s in _strs(k))
    return names


def readme_rows() -> set[str]:
    text = open(os.path.join(DOCS, "README.md"), encoding="utf-8").read()
    return {m for line in text.splitlines() if line.startswith("| [") for m in re.findall(r"\]\(([a-z0-9_]+)\.md\)", line)}


def test_the_static_scan_finds_terms_of_every_kind():
    # one name from each way a term is made: Term(...), a cuda-graph row, parts / saved keys, a {**parts, ...}
    names = emitted_term_names()
    assert {"parameters", "cuda_graph_pool", "layer_activations", "backward_transient", "loss_softmax_fp32",
            "embedding_indices", "offload_staging", "fsdp_unsharded_gradients", "host_gradients",
            "mtp_loss_buffers"} <= names


def test_every_emitted_term_has_a_page_and_a_readme_row():
    names, rows = emitted_term_names(), readme_rows()
    assert sorted(n for n in names if not os.path.exists(os.path.join(DOCS, n + ".md"))) == []
    assert sorted(names - rows) == []


def test_every_term_page_is_listed_and_every_row_has_a_page():
    pages = {f[:-3] for f in os.listdir(DOCS) if f.endswith(".md")}
    rows = readme_rows()
    assert sorted(pages - OVERVIEW_PAGES - rows) == []
    assert sorted(rows - pages) == []


# --- every key `memguard estimate --json` writes is in docs/json-schema.md (top level and per stage)

SCHEMA = os.path.join(ROOT, "docs", "json-schema.md")


def _schema_fields() -> tuple[set[str], set[str]]:
    """(top-level fields, stage fields: the stage table and the feature tables after it)."""
    tables = []
    for block in re.split(r"\n\s*\n", open(SCHEMA, encoding="utf-8").read()):
        rows = re.findall(r"^\| `(\w+)` \|", block, flags=re.M)
        if rows:
            tables.append(set(rows))
    return tables[0], set().union(*tables[1:])


@pytest.mark.parametrize("extra", [
    [],
    # MoE, FP8, activation and optimizer offloading: the optional top-level and stage fields
    ["--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "4", "--moe-grouped-gemm",
     "--disable-bias-linear", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--use-distributed-optimizer",
     "--fine-grained-activation-offloading", "--offload-modules", "core_attn", "--optimizer-cpu-offload",
     "--optimizer-offload-fraction", "0.5", "--use-precision-aware-optimizer"],
])
def test_every_json_key_is_in_the_schema_page(extra):
    top, stage = _schema_fields()
    flags = LLAMA2_7B + ["--micro-batch-size", "1", "--global-batch-size", "64", "--pipeline-model-parallel-size", "2"]
    doc = estimate(layout_from_flags(flags + extra, world_size=16), gpu_memory=80 * 2**30).to_dict()
    assert sorted(set(doc) - top) == []
    for st in doc["stages"]:
        assert sorted(set(st) - stage) == []
        for t in st["terms"]:
            assert set(t) == {"name", "bytes", "group", "level", "detail"}


# --- numbers the prose states: each is read from the page and recomputed, so a change of the estimate that moves
# one fails here until the page is updated (the command that gives each is named next to it)

def _doc(*parts: str) -> str:
    """A page with its line breaks folded to spaces (prose wraps wherever it likes)."""
    return " ".join(open(os.path.join(ROOT, *parts), encoding="utf-8").read().split())


def _blocks(*parts: str) -> list[list[str]]:
    """The fenced code blocks of a page, as lists of lines."""
    text = open(os.path.join(ROOT, *parts), encoding="utf-8").read()
    return [b.strip("\n").splitlines() for b in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S)]


def test_readme_quick_start_numbers_are_what_the_command_prints(capsys):
    # README "Quick start": memguard estimate --config examples/llama3_8b_h100.sh
    from megatron_memguard.cli.main import main
    m = re.search(r"the critical stage (pp\d+) needs ([\d.]+ GiB) = (\d+%) of the H100's ([\d.]+ GiB), so it fits "
                  r"\(exit code (\d)\), and its largest term is (\w+) \(([\d.]+ GiB)\)", _doc("README.md"))
    assert m, "README's quick start no longer states the example's numbers"
    stage, need, pct, gpu, code, term, term_size = m.groups()
    assert main(["estimate", "--config", os.path.join(ROOT, "examples", "llama3_8b_h100.sh")]) == int(code)
    out = capsys.readouterr().out
    assert (f"verdict: FITS - critical stage {stage} needs {need} = {pct} of {gpu} (threshold 80%"
            in out), out[-400:]
    assert f"largest term: {term} {term_size}" in out


def test_reports_sample_figure_numbers():
    # docs/reports.md, "memguard estimate --plot FILE": the sample figure of tests/test_plots_estimate.py
    from megatron_memguard import lookup_gpu
    from megatron_memguard.units import format_bytes
    from conftest import LLAMA31_8B
    flags = LLAMA31_8B + ["--micro-batch-size", "1", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                          "4", "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "64",
                          "--use-distributed-optimizer", "--sequence-parallel"]
    est = estimate(layout_from_flags(flags, world_size=32), gpu=lookup_gpu("H100-80GB"))
    page = _doc("docs", "reports.md")
    c, cap = est.critical, est.gpu_memory_bytes
    assert (f"`FITS: critical stage pp{c.pp_rank} needs {format_bytes(c.device_total_bytes)} = "
            f"{c.device_total_bytes / cap:.0%} of the H100-80GB {format_bytes(cap)} (threshold 80%)`") in page
    assert "(" + ", ".join(f"{s.device_total_bytes / cap:.0%}" for s in est.stages) + ")" in page
    acts = sum(t.bytes for t in est.stages[0].terms if t.group == "activations")
    assert f"(the orange segment, {acts / 2**30:.1f} GiB on pp0)" in page
    assert f"80% = {format_bytes(int(0.8 * cap))}" in page


def test_hook_autotune_examples_are_what_autotune_says():
    # docs/hook.md, "autotune": Llama-3.1-8B, TP2 (16 GPUs, MBS 4) and TP1 (8 GPUs, MBS 4, none fits) on an H100
    # reporting 79.19 GiB; autotune's summary lines, as the hook prints them after "[memguard]   "
    from megatron_memguard import lookup_gpu
    from megatron_memguard.autotune import autotune
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    from conftest import LLAMA31_8B
    blocks = [b for b in _blocks("docs", "hook.md") if b and b[0].startswith("[memguard]")]
    impossible = next(b for b in blocks if "none of" in b[0])
    changed = next(b for b in blocks if "autotune changed" in " ".join(b))
    mem = int(79.19 * 2**30)
    for block, world, extra in ((impossible, 8, []), (changed, 16, ["--tensor-model-parallel-size", "2"])):
        r = autotune(parse_megatron_flags(LLAMA31_8B + ["--micro-batch-size", "4"] + extra), world_size=world,
                     gpu=lookup_gpu("H100-80GB"), gpu_memory=mem)
        said = r.summary().splitlines()
        for line in block:
            if not line.startswith("[memguard]   "):
                continue
            line = line[len("[memguard]   "):]
            if line.endswith("; ..."):                       # the page cuts the line short
                assert any(s.startswith(line[:-3]) for s in said), (line, said)
            else:
                assert line in said, (line, said)
    changes = ", ".join(f"{k} {old if old is not None else '(default)'} -> {new}" for k, (old, new) in r.changes.items())
    assert f"[memguard] autotune changed {changes}" in changed


def test_oom_forensics_example(tmp_path):
    # docs/reports.md "Out-of-memory forensics" and README: the run of tests/test_report_megatron.py's
    # test_oom_forensics_blames_the_transient_term (8% over pp1's predicted peak, then 2 GiB more requested)
    import test_report_megatron as trm
    from megatron_logs import oom_message
    GiB, MiB = 2**30, 2**20
    est = estimate(trm.layout(), gpu=trm.H100, dp_rank=0)
    held = int(est.stages[1].peak_allocated_bytes * 1.08)
    msg = oom_message(requested=2 * GiB, capacity=int(79.11 * GiB), free=300 * MiB, process_used=held + 900 * MiB,
                      allocated=held, reserved=held + 200 * MiB)
    log = trm._combined_log(tmp_path, est, alloc=1.0, reserved=1.0, extra=[
        "8: [rank8]: Traceback (most recent call last):", "8: [rank8]: " + msg])
    out = trm._report(str(log), "--gpu", "H100-80GB").stdout.replace(str(log), "train.log")
    block = next(b for b in _blocks("docs", "reports.md") if b[0].startswith("out of memory on rank"))
    for line in block:
        assert line in out.splitlines(), (line, out[-1500:])
    needed = re.search(r"the run needed at least [\d.]+ GiB allocated: the prediction was low by at least [-+\d.]+%",
                       " ".join(block)).group(0)
    assert needed in _doc("README.md")


def test_readme_recipe_names_estimate_or_are_refused_as_it_says(capsys):
    # README "--model NAME": each Megatron-Bridge recipe it names gives an estimate on the recipe's own GPU count,
    # except those it says are refused by name (HybridEP), which exit 2 naming the dispatcher backend
    from megatron_memguard.cli.main import main
    from megatron_memguard.readers.models import recipe_gpus
    text = _doc("README.md")
    listed = re.search(r"a Megatron-Bridge recipe name \((.*?)\) gives the whole recipe", text).group(1)
    names = re.findall(r"`(\w+)`", listed)
    refused = re.findall(r"`(\w+)`", re.search(r"; (`qwen3_30b_a3b`.*?) are read but refused by name", text).group(1))
    assert "llama3_8b" in names and "deepseek_v3" in refused and set(refused) <= set(names)
    from megatron_memguard.readers.models import presets
    key_of = {fn: key for key, r in presets()["recipes"].items() for fn in r["functions"]}
    for name in names:
        code = main(["estimate", "--model", name, "--gpus", str(recipe_gpus(key_of.get(name, name)) or 16), "--json"])
        out = capsys.readouterr()
        if name in refused:
            assert code == 2 and "moe_flex_dispatcher_backend" in out.err and "hybridep" in out.err, (name, out.err)
            # the README's workaround is in the error
            assert "--set model.moe_flex_dispatcher_backend=deepep" in out.err, (name, out.err)
        else:
            assert code in (0, 1) and out.out.startswith("{"), (name, out.err)


def test_calibrate_pages_profile_example_loads(tmp_path):
    # docs/calibrate.md "The profile file": the example as written is a profile this memguard reads (a profile from a
    # newer memguard is refused, so the example carries a version number no newer than this one), with its two constants
    from megatron_memguard.site_profile import load_site_profile
    block = next(b for b in _blocks("docs", "calibrate.md") if any(line.startswith("schema: memguard.site/") for line in b))
    path = tmp_path / "site.yaml"
    path.write_text("\n".join(block) + "\n")
    prof = load_site_profile(str(path))
    assert prof.constants.changed() == {"allocator_fragmentation": 0.071, "cuda_context": 522 * 2**20}
    assert prof.gpu == "H100-80GB" and prof.time == {"gemm_efficiency": 0.58}   # its time section (schema /2)
