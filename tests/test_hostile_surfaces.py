"""Regressions of issue hostile3: the surfaces the earlier fuzzers drew least from (Hugging Face config.json
fields, Megatron logs as terminals and crashed file systems leave them, `memguard plan` over extreme spaces,
the hook's namespace holding NumPy numbers or uncopyable values, the runtime monitor with odd counters).
Each is the smallest input that broke the promise (a wrong number taken silently, a hang, an internal error,
an exception leaving the monitor), with what memguard does now."""
from __future__ import annotations

import copy
import json
import os

import pytest

from fuzz_util import run_memguard

HERE = os.path.dirname(os.path.abspath(__file__))
GiB = 2**30
FLAGS = ["--micro-batch-size", "1", "--expert-model-parallel-size", "4", "--seq-length", "4096", "--global-batch-size", "64",
         "--bf16"]


def _hf(name: str, **changes) -> str:
    with open(os.path.join(HERE, "data", "hf", name), encoding="utf-8") as f:
        doc = json.load(f)
    doc.update(changes)
    return json.dumps(doc)


def _estimate_hf(text: str):
    return run_memguard(["estimate", "--json", "--model", "config.json", "--world-size", "64", "--", *FLAGS],
                        {"config.json": text}, cpu_limit=5.0)


def _one_error(o) -> str:
    assert not o.problems, o.describe()
    lines = [line for line in o.err.splitlines() if line.strip()]
    assert o.code == 2 and lines, (o.code, o.err)
    return lines[0]


# --- Hugging Face config.json -------------------------------------------------------------------------------
def test_tied_embeddings_change_the_count_by_one_vocabulary_matrix():
    # Mixtral-8x7B: vocab 32000 (a multiple of 128, so Megatron pads nothing at TP 1), hidden 4096; tying the
    # output layer to the embedding removes one 32000 x 4096 matrix = 131,072,000 parameters
    untied, tied = (_estimate_hf(_hf("mixtral-8x7b.json", tie_word_embeddings=t)) for t in (False, True))
    assert not untied.problems and not tied.problems, (untied.describe(), tied.describe())
    n = [json.loads(o.out)["model_parameters"]["total"] for o in (untied, tied)]
    assert n[0] - n[1] == 32000 * 4096


@pytest.mark.parametrize("key, value", [("tie_word_embeddings", "no"), ("tie_word_embeddings", 0),
                                        ("attention_bias", "false"), ("mlp_bias", [True]), ("norm_topk_prob", "false")])
def test_true_false_fields_take_only_true_or_false(key, value):
    # bool("no") is True: a config.json saying "no" was read as tied embeddings (131 M parameters fewer)
    line = _one_error(_estimate_hf(_hf("mixtral-8x7b.json", **{key: value})))
    assert f"{key}: expects true or false, got {value!r}" in line, line


@pytest.mark.parametrize("name, key", [("deepseek-v3.json", "moe_layer_freq"), ("qwen3-30b-a3b.json", "decoder_sparse_step")])
def test_a_sparse_layer_step_of_zero_is_refused(name, key):
    # transformers takes the layer index modulo the step (DeepseekV2DecoderLayer, Qwen3MoeDecoderLayer): 0 builds
    # no model there; memguard read it as 1 (every layer MoE)
    line = _one_error(_estimate_hf(_hf(name, **{key: 0})))
    assert f"{key}: must be >= 1" in line, line


# --- Megatron logs ------------------------------------------------------------------------------------------
def _log_with_peak(transform) -> dict:
    from megatron_logs import args_of, print_args, report_memory

    from fuzz_util import SMALL
    lines = print_args(args_of(SMALL, 8)) + [report_memory(0, "(after 10 iterations)", GiB, 3 * GiB, 4 * GiB, 4 * GiB)]
    o = run_memguard(["report", "--json", "run.log"], {"run.log": "".join(transform(x) + "\n" for x in lines)}, cpu_limit=2.0)
    assert not o.problems and o.code in (0, 1), o.describe()
    return json.loads(o.out)


@pytest.mark.parametrize("label, transform", [
    ("colour codes", lambda line: "\x1b[32m" + line + "\x1b[0m"),     # a logger that colours its lines
    ("NULs", lambda line: line + "\x00\x00"),                          # what a lost write leaves in a file
])
def test_log_lines_with_colour_codes_or_nuls_read_as_plain_ones(label, transform):
    # 'None\x1b[0m' was not None: the table's hybrid_layer_pattern became a pattern, refused as Mamba
    plain, odd = _log_with_peak(lambda line: line), _log_with_peak(transform)
    assert [r["actual_max_allocated"] for r in odd["ranks"]] == [3 * GiB]
    assert odd["ranks"] == plain["ranks"], label


# --- memguard plan over extreme spaces -------------------------------------------------------------------
def test_uneven_vpp_split_of_ten_thousand_layers_by_hand():
    # 10,000 layers on PP 1024 x VPP 8 = 8,192 virtual stages: no first/last or account-flag split (10,001
    # and 10,002 are no multiples of 8,192), so the layout deals the 10,002 slots (embedding and loss counted):
    # 10,002 = 8,192 + 1,810, i.e. 1,810 stages of 2 slots and 6,382 of 1; the embedding and the loss take a
    # slot of the first and the last stage
    from megatron_memguard.planner.space import _uneven_vpp_splits, uneven_vpp_splits
    _uneven_vpp_splits.cache_clear()
    (x,) = uneven_vpp_splits(10_000, 1024, 8)
    slots = list(x.chunks)
    slots[0] += 1
    slots[-1] += 1
    assert len(x.chunks) == 8192 and sum(x.chunks) == 10_000
    assert sorted(set(slots)) == [1, 2] and slots.count(2) == 1810 and slots.count(1) == 6382


def test_plan_on_a_million_gpus_with_ten_thousand_layers_and_vpp_finishes():
    # the uneven VPP splits were rebuilt for every TP x CP with a list scan per stage (PP x VPP up to 10**4
    # stages): 2**20 GPUs, 10,000 layers and --vpp 1,2,4,8,16,32 ran for minutes; now about 0.3 s of CPU
    from megatron_memguard.planner.space import _uneven_vpp_splits
    _uneven_vpp_splits.cache_clear()
    o = run_memguard(["plan", "--gpus", str(2**20), "--seq-length", "4096", "--global-batch-size", "1024",
                      "--vpp", "1,2,4,8,16,32", "--", "--num-layers", "10000", "--hidden-size", "4096",
                      "--num-attention-heads", "32", "--max-position-embeddings", "4096", "--tokenizer-type",
                      "NullTokenizer", "--vocab-size", "32000", "--bf16"], cpu_limit=10.0, wall_limit=120)
    assert not o.problems and o.code == 0, o.describe()
    assert "--pipeline-model-parallel-size" in o.out


# --- the Megatron hook ---------------------------------------------------------------------------------------
def _namespace():
    from mutate_util import hook_namespaces
    return copy.deepcopy(hook_namespaces()["legacy 0.16"])


def _numpy(v):
    np = pytest.importorskip("numpy")
    if isinstance(v, bool):
        return np.bool_(v)
    if isinstance(v, int):
        return np.int64(v)
    if isinstance(v, float):
        return np.float64(v)
    if isinstance(v, list):
        return [_numpy(x) for x in v]
    return v


def test_hook_reads_numpy_numbers_as_the_numbers_they_hold():
    # a launcher that computed sizes with NumPy: 'world size must be an integer, got np.int64(16)' (unchecked
    # run), and np.int64 in --memguard-gpu-memory stopped the job with exit 2; the decision is now the plain one
    from mutate_util import run_hook
    plain, ns = _namespace(), _namespace()
    for k, v in list(vars(ns).items()):
        setattr(ns, k, _numpy(v))
    ns.memguard_gpu_memory = _numpy(int(79.1 * GiB))
    a, b = run_hook(plain), run_hook(ns)
    assert a.problems(mutated_settings=False) == [] and b.problems(mutated_settings=False) == [], (a, b)
    assert a.action == b.action == "fits" and a.emitted == b.emitted


def test_hook_namespace_holding_an_uncopyable_value():
    # other code hung a lock / a generator on the namespace: the dry run's deepcopy failed, an internal error
    import threading

    from mutate_util import run_hook
    plain = run_hook(_namespace())
    for value in (threading.Lock(), (i for i in range(3))):
        ns = _namespace()
        ns.launcher_state = value
        o = run_hook(ns)
        assert o.problems(mutated_settings=False) == [] and o.carried_on, o
        assert o.emitted == plain.emitted and ns.launcher_state is value


# --- the runtime monitor ---------------------------------------------------------------------------------------
def _monitor(errors: list):
    from megatron_memguard.runtime.monitor import MemoryMonitor, Prediction
    from megatron_memguard.runtime.sources import Reading, StaticSource
    pred = Prediction(pp_rank=0, peak_allocated=40 * GiB, peak_reserved=42 * GiB, device_total=44 * GiB, persistent=20 * GiB)
    r = Reading(allocated=20 * GiB, max_allocated=30 * GiB, reserved=21 * GiB, max_reserved=31 * GiB, device_used=33 * GiB)
    return MemoryMonitor(StaticSource(r), pred, interval=10, emit=lambda s: None, emit_error=errors.append)


def test_monitor_step_with_a_counter_that_is_no_integer_reports_once():
    # step('10') raised TypeError out of the monitor (whose contract is never to raise)
    errors: list[str] = []
    m = _monitor(errors)
    for it in ("10", [10], 1.5, object()):
        m.step(it)
    assert m.samples == 0 and m.errors == 4 and len(errors) == 1 and "iteration must be an integer" in errors[0]
    m.step(_numpy(20))            # a NumPy counter is an integer
    assert m.samples == 1 and m.last_iteration == 20


def test_is_oom_never_raises():
    from megatron_memguard._integration import is_oom

    class Unprintable(RuntimeError):
        def __str__(self):
            raise ValueError("no message")
    assert is_oom(Unprintable()) is False
    assert is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")) is True


# --- figures -----------------------------------------------------------------------------------------------
def test_report_figure_is_as_wide_as_its_table():
    # one pipeline stage, 7.5 in wide, under a per-rank table of 14 columns (about 150 characters at 8 pt,
    # 10.5 in): the constrained layout collapsed, matplotlib warned on stderr and cut off the title and table
    pytest.importorskip("matplotlib")
    import warnings

    from fuzz_util import RUNLOG
    run = {"memguard-rank00000.jsonl": "\n".join(json.dumps(r) for r in RUNLOG) + "\n"}
    with warnings.catch_warnings(record=True) as caught:   # (the CLI prints them on stderr; pytest would keep them)
        warnings.simplefilter("always")
        o = run_memguard(["report", ".", "--out", "r.png"], run, cpu_limit=10.0)
    assert not o.problems and o.code == 1, o.describe()
    assert o.err.strip() == "memguard: report written to r.png"
    assert [str(w.message) for w in caught] == []


def test_bridge_preflight_reads_numpy_numbers_in_a_container_dict():
    # 'model.num_layers: must be an integer, got np.int64(4)': the pre-flight left the run unchecked
    import textwrap

    import yaml

    from megatron_memguard.bridge import preflight
    from test_readers_bridge import FLAT
    doc = yaml.safe_load(textwrap.dedent(FLAT))
    as_numpy = {k: ({f: _numpy(v) for f, v in sec.items()} if isinstance(sec, dict) else sec) for k, sec in doc.items()}
    said: list[list[str]] = [[], []]
    results = [preflight(d, world_size=8, gpu="H100-80GB", mode="report", emit=said[i].append, environ={})
               for i, d in enumerate((doc, as_numpy))]
    assert results[0].reason == results[1].reason == "" and said[0] == said[1] and "verdict: FITS" in said[0][0]
