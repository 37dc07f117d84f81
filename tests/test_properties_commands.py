"""The commands a user runs on one job agree, to the byte (hypothesis, derandomized), over dense and MoE jobs
drawn where Megatron accepts them (tests/property_space.py specs, moe_specs, feature_specs):

1. `memguard estimate --json` per stage is the library's estimate, and `--detail --all-stages` prints those bytes;
2. `memguard check` of the launch command gives estimate's verdict, stage bytes and exit code;
3. `--dp-rank max` bounds every data-parallel rank's and every expert-data-parallel rank's stage;
4. the change autotune proposes (as `memguard check` / the hook spell it), added to the command, estimates to the
   bytes autotune reported and fits under its threshold;
5. each layout `memguard plan` reports, written as the exported Megatron flags in the user's command (minus the
   flags the plan says to remove), estimates to the plan's stage bytes and resolves to the planned layout;
6. the Megatron hook, fed the namespace real megatron.training's parse_args builds from the same command line
   (megatron-core 0.19.2, the 3.12 venv), estimates what `memguard estimate` does.

MEMGUARD_PROPERTY_EXAMPLES sets the count (default 200; each property runs a fraction of it).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, reject, settings, strategies as st

from megatron_memguard import estimate, layout_from_flags, lookup_gpu
from megatron_memguard.config import MEMORY_ENV_VARS
from megatron_memguard.errors import ConfigError, ConfigErrors, MemguardError, NotModelledError
from megatron_memguard.layout import ShardGroup
from megatron_memguard.units import format_bytes

from property_space import feature_specs, moe_specs, specs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))
SOME = settings(derandomize=True, database=None, deadline=None, max_examples=max(1, EXAMPLES // 5),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
# the hook's property pays megatron.training's parse_args (about a second each in the 3.12 venv)
FEW = settings(SOME, max_examples=max(1, EXAMPLES // 25))

# dense, MoE, and either with the newer features (FP8 / FP4, MTP, offload, CUDA graphs, FSDP, EP overlap)
JOBS = st.one_of(specs(max_layers=12), moe_specs(), feature_specs())


def _gpu(flags: list[str]) -> str:
    """MXFP8 and NVFP4 run on Blackwell only (memguard refuses them on an H100 by name)."""
    blackwell = "--fp4-format" in flags or ("--fp8-recipe" in flags and flags[flags.index("--fp8-recipe") + 1] == "mxfp8")
    return "B200" if blackwell else "H100-80GB"


def _job(s) -> tuple[list[str], int, str]:
    """(flags, world, GPU) of a drawn job memguard estimates; a job it refuses is one line naming a flag, dropped."""
    flags = s.flags()
    try:
        L = layout_from_flags(flags, world_size=s.world)
        estimate(L, gpu=lookup_gpu(_gpu(flags)))
    except (ConfigError, ConfigErrors, NotModelledError) as e:
        for err in (e.errors if isinstance(e, ConfigErrors) else [e]):
            assert "\n" not in str(err) and str(err).startswith("--"), str(err)
        reject()
    return flags, s.world, _gpu(flags)


def _clean_env_of(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k not in MEMORY_ENV_VARS}


def _clean_env() -> dict[str, str]:
    """os.environ without the variables memguard reads as the job's (config.MEMORY_ENV_VARS): an earlier test of the
    same process (Megatron's own code sets CUDA_DEVICE_MAX_CONNECTIONS, NVTE_*_ATTN) must not change these jobs."""
    return _clean_env_of(dict(os.environ))


def _cli(*argv: str) -> tuple[int, str, str]:
    from megatron_memguard.cli.main import main
    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(_clean_env_of(saved))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(list(argv))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return rc, out.getvalue(), err.getvalue()


def _without(flags: list[str], names: set[str]) -> list[str]:
    """``flags`` with the named flags and their values removed."""
    out, i = [], 0
    while i < len(flags):
        if flags[i] in names:
            i += 1
            while i < len(flags) and not flags[i].startswith("--"):
                i += 1
        else:
            out.append(flags[i])
            i += 1
    return out


# ---------------------------------------------------------------------------------------------------
# 1-3: estimate, its JSON and text, check, --dp-rank

@SOME
@given(JOBS)
def test_estimate_json_detail_and_check_agree(s):
    """`estimate --json`: every stage's terms and levels are the library's; `--detail --all-stages` shows each
    term's bytes (format_bytes of the JSON number) and the stage's three levels under that stage; `check` on
    `python pretrain_gpt.py <flags>` has the same verdict, stage bytes and exit code."""
    flags, world, gpu = _job(s)
    est = estimate(layout_from_flags(flags, world_size=world), gpu=lookup_gpu(gpu))
    rc, out, err = _cli("estimate", "--world-size", str(world), "--gpu", gpu, "--json", "--", *flags)
    assert rc in (0, 1), err
    doc = json.loads(out)
    assert doc["verdict"] == est.verdict
    for js, st_ in zip(doc["stages"], est.stages, strict=True):
        assert js["breakdown"] == st_.breakdown
        assert (js["peak_allocated_bytes"], js["peak_reserved_bytes"], js["device_total_bytes"]) == (
            st_.peak_allocated_bytes, st_.peak_reserved_bytes, st_.device_total_bytes)
    rc_text, text, _ = _cli("estimate", "--world-size", str(world), "--gpu", gpu, "--detail", "--all-stages", "--",
                            *flags)
    assert rc_text == rc
    sections = text.split(" at its peak: ")
    for js in doc["stages"]:
        body = next(sec for prev, sec in zip(sections, sections[1:]) if prev.rstrip().endswith(f"pp{js['pp_rank']}")
                    or prev.rstrip().endswith(f"pp{js['pp_rank']} *"))
        body = body.split("\n\n")[0]
        rows = {line.split()[0]: line for line in body.splitlines()[3:] if line.startswith("  ")}
        for t in js["terms"]:
            assert format_bytes(t["bytes"]) in rows[t["name"]].split("  " + t["group"], 1)[1], (js["pp_rank"], t)
        for level, key in (("peak allocated", "peak_allocated_bytes"), ("peak reserved", "peak_reserved_bytes"),
                           ("device total", "device_total_bytes")):
            line = next(x for x in body.splitlines() if x.startswith("= " + level))
            assert line.split()[-2:] == format_bytes(js[key]).split(), (level, line)
    rc_check, out_check, err_check = _cli("check", "--world-size", str(world), "--gpu", gpu, "--json", "--no-suggest",
                                          "--", "python", "pretrain_gpt.py", *flags)
    assert rc_check == rc, err_check
    chk = json.loads(out_check)
    assert chk["verdict"] == doc["verdict"]
    assert [x["device_total_bytes"] for x in chk["stages"]] == [x["device_total_bytes"] for x in doc["stages"]]


@SOME
@given(st.one_of(moe_specs(), specs(max_layers=8)))
def test_dp_rank_max_bounds_every_data_parallel_and_expert_data_parallel_rank(s):
    """`--dp-rank max` (the default) is the largest distributed-optimizer shard: no DP rank's stage (and, with
    experts, no expert-data-parallel rank's) allocates more; `--dp-rank last` on the command line is the library's
    last rank."""
    flags, world, gpu = _job(s.with_base(dist_opt=True) if hasattr(s, "with_base") else s.with_(dist_opt=True))
    L = layout_from_flags(flags, world_size=world)
    g = lookup_gpu(gpu)
    top = estimate(L, gpu=g)
    edp = L.parallel.shard_size(ShardGroup.EXPERT_DP) if L.moe else 1
    pairs = [(r, None) for r in range(min(L.dp_shard_size, 16))]
    pairs += [(r, m) for r in (0, L.dp_shard_size - 1) for m in range(min(edp, 16))] if L.moe else []
    for r, m in pairs:
        for a, b in zip(top.stages, estimate(L, gpu=g, dp_rank=r, expert_dp_rank=m).stages):
            assert b.peak_allocated_bytes <= a.peak_allocated_bytes, (a.pp_rank, r, m)
            assert b.device_total_bytes <= a.device_total_bytes, (a.pp_rank, r, m)
    rc, out, _ = _cli("estimate", "--world-size", str(world), "--gpu", gpu, "--dp-rank", "last", "--json", "--", *flags)
    last = estimate(L, gpu=g, dp_rank="last")
    assert [x["device_total_bytes"] for x in json.loads(out)["stages"]] == [x.device_total_bytes for x in last.stages]


# ---------------------------------------------------------------------------------------------------
# 4: autotune

@SOME
@given(JOBS, st.sampled_from([0.1, 0.3, 0.6]))
def test_autotunes_change_added_to_the_command_fits_with_the_bytes_reported(s, cut):
    """A GPU whose 80% is the job's device total less ``cut`` of the critical stage's transient part (so that
    the job does not fit and something can): the change autotune chooses, spelled as `memguard check` and the
    hook print it (`--micro-batch-size 2, --pipeline-model-parallel-size 4, ...`) and added to the command,
    estimates to exactly the bytes autotune reported, under the threshold, on the layout it chose."""
    from megatron_memguard.autotune import autotune
    from megatron_memguard.cli.check import _spelled
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    flags, world, gpu = _job(s)
    g = lookup_gpu(gpu)
    est = estimate(layout_from_flags(flags, world_size=world), gpu=g)
    c = est.critical
    mem = int((est.peak_device_bytes - cut * (c.peak_allocated_bytes - c.persistent_bytes)) / 0.8)
    raw = parse_megatron_flags(flags)
    r = autotune(raw, world_size=world, gpu=g, gpu_memory=mem, threshold=0.8, allow_recompute=True)
    if r.status != "changed":
        reject()
    said = [_spelled(raw, k, new) for k, (_, new) in r.changes.items() if new is not None and new is not False]
    L2 = layout_from_flags(flags + shlex.split(" ".join(said)), world_size=world)
    assert L2 == r.chosen.layout, said
    again = estimate(L2, gpu=g, gpu_memory=mem, threshold=0.8)
    assert again.verdict == "fits" and again.peak_device_bytes <= 0.8 * mem
    assert [x.device_total_bytes for x in again.stages] == [x.device_total_bytes for x in r.chosen.estimate.stages]


# ---------------------------------------------------------------------------------------------------
# 5: plan

@SOME
@given(JOBS)
def test_planned_layouts_estimate_to_the_bytes_the_plan_reports(s):
    """`memguard plan --json` on the job's own command (the planner searches TP / PP / VPP / CP / SP / MBS /
    recomputation / distributed optimizer / EP / ETP): for each layout it reports, the command without the flags
    the plan names in megatron_flags_to_remove, plus its exported megatron_flags, is the planned layout (every
    field) and `memguard estimate` gives the plan's stage device totals and verdict."""
    flags, world, gpu = _job(s)
    if world > 64:
        reject()
    rc, out, err = _cli("plan", "--gpus", str(world), "--gpu", gpu, "--json", "--top", "3", "--", *flags)
    assert rc in (0, 1), err
    for e in json.loads(out)["layouts"]:
        cmd = _without(flags, set(e["megatron_flags_to_remove"])) + shlex.split(" ".join(e["megatron_flags"]))
        rc2, out2, err2 = _cli("estimate", "--world-size", str(world), "--gpu", gpu, "--json", "--", *cmd)
        assert rc2 in (0, 1), (err2, e["megatron_flags"])
        doc = json.loads(out2)
        assert doc["layout"] == e["layout"], e["label"]
        assert [x["device_total_bytes"] for x in doc["stages"]] == e["stage_device_bytes"], e["label"]
        assert doc["verdict"] == e["verdict"]


def test_plan_names_the_commands_flags_its_layout_switches_off():
    """Megatron's store-true flags have no off switch and a value flag stays in force unless repeated: a
    command with full recomputation, sequence parallelism and virtual stages, planned on 8 GPUs where the
    fastest layout needs none of them, gets them named for removal (text and JSON) and not among the exported
    flags. By hand: 2 layers of hidden 256 fit one H100 many times over, so the planner takes no recomputation
    and TP 1 (SP off at TP 1)."""
    flags = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --ffn-hidden-size 1024 --seq-length 256 "
             "--max-position-embeddings 256 --micro-batch-size 1 --global-batch-size 64 --vocab-size 1000 "
             "--tokenizer-type NullTokenizer --bf16 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
             "--num-layers-per-virtual-pipeline-stage 1 --sequence-parallel --recompute-granularity full "
             "--recompute-method uniform --recompute-num-layers 1").split()
    rc, out, _ = _cli("plan", "--gpus", "8", "--json", "--top", "1", "--tp", "1", "--pp", "1", "--recompute", "none",
                      "--", *flags)
    e = json.loads(out)["layouts"][0]
    assert e["megatron_flags_to_remove"] == ["--sequence-parallel", "--num-layers-per-virtual-pipeline-stage",
                                             "--recompute-granularity", "--recompute-method", "--recompute-num-layers"]
    assert not set(e["megatron_flags_to_remove"]) & {f.split()[0] for f in e["megatron_flags"]}
    rc, text, _ = _cli("plan", "--gpus", "8", "--top", "1", "--tp", "1", "--pp", "1", "--recompute", "none", "--",
                       *flags)
    assert ("Megatron flags (first remove --sequence-parallel, --num-layers-per-virtual-pipeline-stage, "
            "--recompute-granularity, --recompute-method, --recompute-num-layers from your command):") in text


def test_plan_takes_a_valid_ep_overlap_job():
    """--overlap-moe-expert-parallel-comm needs EP > 1 (TransformerConfig.__post_init__, core 0.16.1 and 0.19.2):
    the planner's one-GPU probe (EP 1) used to refuse the whole command although it is valid at EP 2; now the
    plan searches it and keeps only layouts with EP > 1."""
    flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 2 --ffn-hidden-size 128 --seq-length 128 "
             "--max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 16 --vocab-size 1000 "
             "--tokenizer-type NullTokenizer --bf16 --transformer-impl transformer_engine --disable-bias-linear "
             "--position-embedding-type rope --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64 "
             "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
             "--overlap-moe-expert-parallel-comm").split()
    layout_from_flags(flags, world_size=4)
    rc, out, err = _cli("plan", "--gpus", "4", "--json", "--top", "3", "--", *flags)
    assert rc == 0, err
    layouts = json.loads(out)["layouts"]
    assert layouts and all(x["layout"]["expert_model_parallel_size"] > 1 for x in layouts)


def test_plan_takes_a_valid_fp4_job_whose_micro_batch_makes_its_gemms_divisible():
    """NVFP4 needs every GEMM's token count divisible by 16 (Transformer Engine's 16-element blocks): sequence 8
    with micro-batch 2 gives 16 tokens and is valid; the planner's probe at micro-batch 1 (8 tokens) used to
    refuse the command; now it probes with the configured micro-batch and plans (micro-batch 2 or more)."""
    flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 2 --ffn-hidden-size 128 --seq-length 8 "
             "--max-position-embeddings 8 --micro-batch-size 2 --global-batch-size 16 --vocab-size 1000 "
             "--tokenizer-type NullTokenizer --bf16 --transformer-impl transformer_engine --disable-bias-linear "
             "--position-embedding-type rope --fp4-format e2m1 --fp4-recipe nvfp4").split()
    layout_from_flags(flags, world_size=2)
    rc, out, err = _cli("plan", "--gpus", "2", "--gpu", "B200", "--json", "--top", "3", "--", *flags)
    assert rc == 0, err
    layouts = json.loads(out)["layouts"]
    assert layouts and all(x["layout"]["micro_batch_size"] * 8 % 16 == 0 for x in layouts)


# ---------------------------------------------------------------------------------------------------
# 6: the hook's namespace

def _training_python() -> str | None:
    """A Python whose megatron.training has the config-container era's parse_args: this one, or the 3.12 venv
    ($MEMGUARD_PY312, .venv312)."""
    import importlib.util
    if importlib.util.find_spec("megatron") and importlib.util.find_spec("megatron.training"):
        return sys.executable
    p = os.environ.get("MEMGUARD_PY312") or os.path.join(ROOT, ".venv312", "bin", "python")
    return p if os.path.exists(p) else None


@pytest.fixture(scope="module")
def namespace_server():
    python = _training_python()
    if python is None:
        pytest.skip("no megatron.training (the 3.12 venv: $MEMGUARD_PY312, .venv312)")
    proc = subprocess.Popen([python, os.path.join(ROOT, "tests", "e2e", "namespace_estimates.py")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(_clean_env(), PYTHONPATH=ROOT))

    def ask(job: dict) -> dict:
        proc.stdin.write(json.dumps(job) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        while line and not line.startswith("@@"):
            line = proc.stdout.readline()
        assert line, "the megatron.training process stopped"
        return json.loads(line[2:])
    yield ask
    proc.stdin.close()
    proc.terminate()       # (its interpreter's exit, torch's teardown, takes seconds)
    proc.wait(timeout=60)


@FEW
@given(JOBS)
def test_the_hooks_namespace_estimates_what_the_cli_does(namespace_server, s):
    """megatron.training 0.19.2's parse_args over the command line (WORLD_SIZE as torchrun sets it), read as the
    hook reads it (preflight.raw_config_from_args, resolve at the namespace's world size): every stage's peak
    allocated and device total and the verdict equal `memguard estimate --megatron-version 0.19` of the flags."""
    flags, world, gpu = _job(s)
    got = namespace_server({"flags": flags, "world": world, "gpu": gpu})
    assert "error" not in got, (got, flags)
    assert got["world"] == world
    rc, out, err = _cli("estimate", "--world-size", str(world), "--gpu", gpu, "--megatron-version", got["era"],
                        "--json", "--", *flags)
    doc = json.loads(out)
    assert got["allocated"] == [x["peak_allocated_bytes"] for x in doc["stages"]]
    assert got["device"] == [x["device_total_bytes"] for x in doc["stages"]]
    assert got["verdict"] == doc["verdict"]


def test_bridge_overrides_clear_the_recipes_settings_the_plan_leaves_unset():
    """Megatron-Bridge's llama3_8b recipe (32 layers) with uneven stages and full recomputation set in the config,
    planned on 16 H100s: every layout the plan reports is even and needs no recomputation, so its Bridge overrides
    must clear model.num_layers_in_first/last_pipeline_stage and model.recompute_method / recompute_num_layers
    (an absent override keeps the config's value: 7 + 7 first / last layers over the planned PP 1 or 2 leave no
    middle stage, an error); the recipe with those overrides is the planned layout, to the byte."""
    base = ["--model", "llama3_8b", "--set", "model.pipeline_model_parallel_size=4", "--set",
            "model.num_layers_in_first_pipeline_stage=7", "--set", "model.num_layers_in_last_pipeline_stage=7", "--set",
            "model.recompute_granularity=full", "--set", "model.recompute_method=uniform", "--set",
            "model.recompute_num_layers=1"]
    rc, out, err = _cli("plan", "--gpus", "16", "--json", "--top", "3", "--recompute", "none", "--pp", "1,2", *base)
    assert rc == 0, err
    layouts = json.loads(out)["layouts"]
    assert layouts
    for e in layouts:
        assert {"model.num_layers_in_first_pipeline_stage=null", "model.num_layers_in_last_pipeline_stage=null",
                "model.recompute_granularity=null", "model.recompute_method=null",
                "model.recompute_num_layers=null"} <= set(e["bridge_overrides"]), e["bridge_overrides"]
        sets = [t for o in e["bridge_overrides"] for t in ("--set", o)]
        rc2, out2, err2 = _cli("estimate", "--gpus", "16", "--json", *base, *sets)
        assert rc2 in (0, 1), err2
        doc = json.loads(out2)
        assert doc["layout"] == e["layout"], e["label"]
        assert [x["device_total_bytes"] for x in doc["stages"]] == e["stage_device_bytes"]


def test_bridge_moe_recipes_plan_and_estimate_alike():
    """Bridge's MoE recipes memguard estimates (deepseek_v2_lite, olmoe_7b): each planned layout's Bridge overrides
    on the recipe resolve to the planned layout (its notes too: the recipe's recompute method is cleared with the
    granularity) and estimate to its stage bytes."""
    for recipe, gpus in (("deepseek_v2_lite", 16), ("olmoe_7b", 8)):
        rc, out, err = _cli("plan", "--gpus", str(gpus), "--json", "--top", "2", "--model", recipe)
        assert rc == 0, err
        for e in json.loads(out)["layouts"]:
            sets = [t for o in e["bridge_overrides"] for t in ("--set", o)]
            rc2, out2, err2 = _cli("estimate", "--gpus", str(gpus), "--json", "--model", recipe, *sets)
            assert rc2 in (0, 1), err2
            doc = json.loads(out2)
            assert doc["layout"] == e["layout"], (recipe, e["label"])
            assert [x["device_total_bytes"] for x in doc["stages"]] == e["stage_device_bytes"], (recipe, e["label"])


def test_a_setting_memguard_makes_is_named_by_megatrons_flag():
    """`memguard plan --fp8 tensorwise` on a --transformer-impl local model sets FP8 on every candidate, which has
    no effect there (only Transformer Engine modules quantize): the note names Megatron's flag --fp8-format (the
    dest is fp8; Megatron has no --fp8 flag, knobs.py), as the same flags given on the command line do, so that
    the planned layout and `memguard estimate` of its exported flags agree in their notes too."""
    flags = ("--transformer-impl local --num-layers 2 --hidden-size 64 --num-attention-heads 2 --ffn-hidden-size 128 "
             "--seq-length 32 --max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 8 --vocab-size 1000 "
             "--tokenizer-type NullTokenizer --bf16").split()
    rc, out, err = _cli("plan", "--gpus", "2", "--fp8", "tensorwise", "--json", "--top", "1", "--", *flags)
    assert rc == 0, err
    (e,) = json.loads(out)["layouts"]
    assert any(n.startswith("--fp8-format: no effect with --transformer-impl local") for n in e["layout"]["notes"])
    rc, out, _ = _cli("estimate", "--world-size", "2", "--json", "--", *flags, *shlex.split(" ".join(e["megatron_flags"])))
    assert json.loads(out)["layout"]["notes"] == e["layout"]["notes"]
