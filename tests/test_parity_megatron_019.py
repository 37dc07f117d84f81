"""The differential fuzz against megatron-core 0.19.2's real megatron.training (Python 3.12): command lines
drawn by parity_space.command_lines() go through Megatron's own parser, validate_args, the TransformerConfig
and optimizer/DDP configs pretrain_gpt.py builds, and the build-time rules (parity_space.megatron_reads), and
through memguard's three readings (the flags, the hook's namespace, the validated namespace). Whatever Megatron
rejects memguard refuses; whatever Megatron accepts memguard estimates (or refuses as not modelled), with the
same numbers from all three readings. Derandomized; MEMGUARD_PARITY_EXAMPLES (default 300) searches deeper."""
import collections
import os
import sys

import pytest
from conftest import CONTAINER_ERA, H100, megatron_core_version
from hypothesis import HealthCheck, given, settings

import parity_space as P

# the rules and source lines of this file are megatron-core 0.19.2's (tests/run_releases.sh also runs the
# megatron_training tests against 0.17.1 and 0.18.2, whose validate_args differ)
pytestmark = [*CONTAINER_ERA, pytest.mark.skipif((megatron_core_version() or (0,)) < (0, 19),
                                                reason="the parity fuzz compares with megatron-core 0.19")]
EXAMPLES = int(os.environ.get("MEMGUARD_PARITY_EXAMPLES", "300"))
GOOD = {"ok-reject", "ok-same", "ok-refused", "env"}


@pytest.fixture(scope="module")
def megatron_on_cpu():
    """An H100 for torch's device queries, Transformer Engine 2.11 for Megatron's version checks, the
    environment Megatron's rules ask for (one CUDA connection unless FSDP, TE's offloading v1)."""
    import torch
    from megatron.core import utils
    from megatron.core.transformer.moe import moe_utils
    saved = (utils._te_version, {k: getattr(moe_utils, k, None) for k in dir(moe_utils) if k.startswith("fused_")})
    # (the hook's reading imports megatron_memguard.megatron, which installs the hook: undone after, unless an
    # earlier test had installed it)
    hook_before = "megatron_memguard.megatron" in sys.modules
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "get_device_properties", lambda i=None: H100)
        mp.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
        mp.setenv("NVTE_CPU_OFFLOAD_V1", "1")
        mp.setenv("RANK", "0")
        P.pretend_te()
        yield mp
    utils._te_version = saved[0]
    for k, v in saved[1].items():
        setattr(moe_utils, k, v)
    if not hook_before and "megatron_memguard.megatron" in sys.modules:
        sys.modules["megatron_memguard.megatron"].uninstall()


def classify(case, mp):
    mp.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8" if case.fsdp else "1")   # FSDP asserts it is not 1
    mp.setenv("WORLD_SIZE", str(case.world))
    return P.classify(case)


def test_memguard_reads_what_megatron_reads(megatron_on_cpu):
    counts: collections.Counter = collections.Counter()
    found: list[str] = []

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(P.command_lines())
    def run(case):
        kind, why = classify(case, megatron_on_cpu)
        counts[kind] += 1
        if kind not in GOOD:
            found.append(f"({kind}) {why}\n    {case}")

    run()
    assert not found, f"{len(found)} findings:\n" + "\n".join(found[:10])
    # the draw reaches both sides: jobs Megatron starts (compared number by number) and jobs it rejects
    total = sum(counts.values())
    assert counts["ok-same"] >= total // 8 and counts["ok-reject"] >= total // 4, counts


def test_the_model_builds_tensor_parallel_splits(megatron_on_cpu):
    """The model build's divide() asserts (parity_space._tp_split) and group-limited routing, on jobs that break
    no other rule: memguard refuses what the build refuses and estimates the rest with the same numbers."""
    counts: collections.Counter = collections.Counter()
    found: list[str] = []

    @settings(max_examples=max(EXAMPLES // 5, 20), derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(P.split_shapes())
    def run(case):
        kind, why = classify(case, megatron_on_cpu)
        counts[kind, "divide" in why or "group_limited" in why] += 1
        if kind not in GOOD:
            found.append(f"({kind}) {why}\n    {case}")

    run()
    assert not found, f"{len(found)} findings:\n" + "\n".join(found[:10])
    # both sides: jobs the build refuses on a split, and jobs compared number by number
    assert counts["ok-reject", True] and counts["ok-same", False], counts


@pytest.mark.parametrize("found", P.FOUND, ids=[f.key for f in P.FOUND])
def test_what_the_fuzz_found_megatron_rejects(megatron_on_cpu, found):
    kind, why = classify(found.case(), megatron_on_cpu)
    assert kind == "ok-reject", (kind, why, found.source)


def test_offloading_with_moe_layer_recompute_megatron_accepts_memguard_refuses_as_not_modelled(megatron_on_cpu):
    case = P.Case(tuple(P.BASE) + ("--cpu-offloading-num-layers", "1", "--moe-layer-recompute"), 1)
    kind, why = classify(case, megatron_on_cpu)
    assert kind == "ok-refused" and why.startswith("--cpu-offloading-num-layers"), (kind, why)


def test_a_difference_between_the_readings_is_found(megatron_on_cpu, monkeypatch):
    """The comparison is live: a reading that drops a setting (here the hook's namespace losing its
    micro-batch size) is classified as a wrong number, not passed."""
    from megatron_memguard.megatron import preflight
    case = P.Case(tuple(P.BASE) + ("--micro-batch-size", "2"), 2)
    assert classify(case, megatron_on_cpu)[0] == "ok-same"
    real = preflight.raw_config_from_args

    def forgetful(args, defaults=None):
        raw = real(args, defaults)
        raw.args["micro_batch_size"] = 1
        return raw
    monkeypatch.setattr(preflight, "raw_config_from_args", forgetful)
    kind, why = classify(case, megatron_on_cpu)
    assert kind == "c" and "hook" in why, (kind, why)


def test_without_max_position_embeddings_megatron_does_not_start_memguard_notes_it(megatron_on_cpu):
    """validate_args's required arguments (arguments.py line 1274), rotary positions too: a known difference (docs/
    readers.md): memguard estimates the run with the flag taken as --seq-length and notes Megatron requires it."""
    flags = list(P.BASE)
    i = flags.index("--max-position-embeddings")
    kind, why = classify(P.Case(tuple(flags[:i] + flags[i + 2:]), 1), megatron_on_cpu)
    assert kind == "a" and "max_position_embeddings argument is None" in why, (kind, why)


def test_pp1_first_and_last_stage_layers_megatron_starts_a_model_of_other_than_num_layers(megatron_on_cpu):
    """Megatron's TransformerConfig accepts the pair at PP 1 (-1 middle stages); the stages it would build add
    up to 6 layers of a 4-layer model, which the classifier counts as a rejection; memguard refuses it."""
    case = P.Case(tuple(P.BASE) + ("--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "3"), 1)
    megatron_on_cpu.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    megatron_on_cpu.setenv("WORLD_SIZE", "1")
    before, after, rejected = P.megatron_reads(case)
    assert rejected and rejected.startswith("model build: the stages build"), rejected
    kind, why = classify(case, megatron_on_cpu)
    assert kind == "ok-reject", (kind, why)


@pytest.mark.parametrize("script", ["examples/llama3_8b_h100.sh", "examples/slurm_preflight.sbatch"])
def test_the_bundled_launch_scripts_pass_megatrons_validate_args(megatron_on_cpu, script):
    """The README's launch scripts, as memguard check reads them, go through the real parser and validate_args of
    megatron-core 0.19.2 (they once gave --save without --save-interval, which validate_args asserts on while
    memguard said "OK to launch"); the world size is the launcher's."""
    import copy
    import inspect

    from megatron.training.arguments import validate_args

    from megatron_memguard.megatron.preflight import silenced
    from megatron_memguard.readers.launch_command import parse_launch_script
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, script)) as f:
        launch = parse_launch_script(f.read(), environ={})
    world = launch.world_size
    assert world == 16    # 2 nodes x 8 GPUs, as both scripts say
    megatron_on_cpu.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    megatron_on_cpu.setenv("WORLD_SIZE", str(world))
    with silenced():
        ns = P.megatron_parser().parse_args(list(launch.script_args))
        ns._is_global_batch_size_explicitly_specified = ns.global_batch_size is not None
        ns.rank, ns.world_size = 0, world
        inspect.unwrap(validate_args)(copy.deepcopy(ns), dict(P.DEFAULTS))   # raises on a broken rule
    assert ns.save is None or ns.save_interval > 0
