import collections
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# The CPU referee's ranks forked from the fork server (tests/build_util.py; MEMGUARD_E2E_FORK=0: new interpreters)
import build_util  # noqa: E402
from benchmarks.referee import run as _referee_run  # noqa: E402

_referee_run.set_rank_launcher(build_util.run_referee_ranks)

# Published model shapes, used across tests (Meta's model cards / Hugging Face config.json files).
LLAMA31_8B = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
              "--group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 "
              "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
              "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 "
              "--tokenizer-type NullTokenizer --vocab-size 128256 --bf16").split()
LLAMA31_70B = ("--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 "
               "--group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 "
               "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
               "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 "
               "--tokenizer-type NullTokenizer --vocab-size 128256 --bf16").split()
LLAMA2_7B = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 "
             "--seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope "
             "--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
             "--tokenizer-type NullTokenizer --vocab-size 32000 --bf16").split()


def pytest_configure(config):
    config.addinivalue_line("markers", "megatron_training: needs a real megatron.training (Python 3.12): the "
                            "config-container era's (megatron-core >= 0.18; tests/run.sh runs these in .venv312 and "
                            ".venv312-core018) or, for the legacy-era tests, core 0.17's (.venv312-core017)")
    config.addinivalue_line("markers", "legacy_standin: a legacy-era test run against tests/legacy_standin (no real "
                            "megatron.training installed)")
    config.addinivalue_line("markers", "bridge: needs the real Megatron-Bridge 0.6.2 (tests/run_bridge.sh installs it into "
                            ".venv312-bridge and runs these)")
    config.addinivalue_line("markers", "framework_free: set by tests/conftest.py on the tests of a file that imports no "
                            "torch, megatron or other venv-dependent module (tests/framework_free.py); "
                            "MEMGUARD_SKIP_FRAMEWORK_FREE=1 deselects them (tests/run.sh's 3.12 run)")
    config.addinivalue_line("markers", "without_extras(*names): set by tests/conftest.py on the tests of a framework-free "
                            "file that reaches an optional extra (matplotlib) through megatron_memguard/ only: they run "
                            "with it hidden, as in .venv312, which lacks it (tests/framework_free.py OPTIONAL_EXTRAS)")


def _framework_free_wanted(config) -> bool:
    """Whether this run needs the framework_free marks (reading every file's imports costs a second or two)."""
    return os.environ.get("MEMGUARD_SKIP_FRAMEWORK_FREE") == "1" or "framework_free" in (config.option.markexpr or "")


def pytest_itemcollected(item):
    # (during collection, so that `-m framework_free` and the deselection below see the mark)
    import framework_free
    if _framework_free_wanted(item.config) and framework_free.is_framework_free(str(item.path)):
        item.add_marker(pytest.mark.framework_free)
    # in every run: the 3.12 run skips such a file because this one ran it as a venv without the extra would
    extras = framework_free.hidden_extras(str(item.path))
    if extras:
        item.add_marker(pytest.mark.without_extras(*sorted(extras)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A without_extras test (with its fixtures' setup and teardown) runs with those packages unimportable: each
    one's entries in sys.modules are None (an import of it or of a submodule raises ImportError), put back after."""
    marker = item.get_closest_marker("without_extras")
    if marker is None:
        yield
        return
    def ours(name):
        return name.split(".")[0] in marker.args
    saved = {name: mod for name, mod in sys.modules.items() if ours(name)}
    sys.modules.update(dict.fromkeys([*saved, *marker.args]))
    try:
        yield
    finally:
        for name in [n for n in sys.modules if ours(n)]:
            del sys.modules[name]
        sys.modules.update(saved)


# The files that take longest in a suite run (CPU referee training runs, the hook's two-rank e2e training, fork-server
# builds; ci22's slowest tests and the referee files' --durations after their bf16 products went fp32, 2026-11-30),
# longest first. tests/run.sh runs `-n 2 --dist loadfile
# --no-loadscope-reorder`: xdist then hands whole files to the workers in collection order, so these start first and
# the many short files fill in at the end, and both workers end together (xdist's own order, most tests first, left
# test_hook_runtime_cpu's 7 tests and their 150 s setup for the end of a worker). Only the order changes.
SLOW_FILES_FIRST = (
    "tests/test_referee_ci.py", "tests/test_mtp_repeated.py", "tests/test_heterogeneous.py", "tests/test_eval_step.py",
    "tests/test_hook_runtime_cpu.py", "tests/test_dsa.py", "tests/test_properties_corners.py", "tests/test_fuzz_cli.py",
    "tests/test_referee_attention_probe.py", "tests/test_referee_moe.py", "tests/test_referee_mtp.py",
    "tests/test_gdn.py", "tests/test_examples.py", "tests/test_hybrid_graphs.py", "tests/test_mamba.py",
)


@pytest.hookimpl(trylast=True)   # after pytest's own reordering by fixture scope
def pytest_collection_modifyitems(config, items):
    """MEMGUARD_SKIP_FRAMEWORK_FREE=1 deselects the framework-free files' tests. Then the slow files first
    (SLOW_FILES_FIRST), then the others by number of tests, most first (xdist's own order); a stable sort, so each
    file's tests stay together and in their order."""
    def path(item):
        return item.nodeid.split("::", 1)[0]

    if os.environ.get("MEMGUARD_SKIP_FRAMEWORK_FREE") == "1":
        # the 3.11 run ran them with the same code and inputs: nothing new is proved here
        skipped = [item for item in items if item.get_closest_marker("framework_free")]
        if skipped:
            config.hook.pytest_deselected(items=skipped)
            items[:] = [item for item in items if not item.get_closest_marker("framework_free")]
    counts = collections.Counter(path(item) for item in items)
    rank = {f: i for i, f in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: (rank.get(path(item), len(rank)), -counts[path(item)]))
    seed = os.environ.get("MEMGUARD_PROPERTY_SEED")
    if seed:
        # a deeper search draws other examples: every hypothesis test runs from this seed instead of its derandomized
        # one (hypothesis core.get_random_for_wrapped_test reads the attribute @seed sets before derandomize)
        for item in items:
            test = getattr(item, "obj", None)
            if test is not None and hasattr(test, "hypothesis"):
                test._hypothesis_internal_use_seed = int(seed)


def megatron_training_era() -> str | None:
    """The era of the installed megatron.training, read from its files without importing megatron
    (test_planner_is_pure_python checks what a plan imports): "config-container" when arguments.py defines
    parse_and_validate_args (megatron-core >= 0.18), "legacy" when megatron.training exists without it
    (megatron-core 0.17.x, the first wheel that ships megatron.training), None when there is none
    (megatron-core <= 0.16, Python 3.11)."""
    if sys.version_info < (3, 12):
        return None
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return None
    for d in (spec.submodule_search_locations or ()) if spec is not None else ():
        path = os.path.join(d, "training", "arguments.py")
        if os.path.exists(path):   # the first megatron/training on the path is the one imported
            with open(path, encoding="utf-8") as f:
                return "config-container" if "def parse_and_validate_args(" in f.read() else "legacy"
    return None


def container_era() -> bool:
    """Python 3.12 with megatron-core >= 0.18, whose wheel ships the config-container era's megatron.training."""
    return megatron_training_era() == "config-container"


LEGACY_STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "legacy_standin")


def legacy_training() -> str | None:
    """Which megatron.training the legacy-era tests drive: "real" (megatron-core 0.17.x installed: its own
    megatron.training), "standin" (no megatron.training installed: tests/legacy_standin, core_v0.16.1's names
    over the installed megatron-core), or None (a config-container-era megatron.training is installed, which
    the stand-in must not shadow: those tests skip)."""
    era = megatron_training_era()
    if era == "legacy":
        return "real"
    return "standin" if era is None else None


def megatron_core_version() -> tuple[int, ...] | None:
    """The installed megatron-core's (major, minor, patch), from its package metadata (no import)."""
    from importlib import metadata
    try:
        v = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None
    return tuple(int(x) for x in v.split(".")[:3] if x.isdigit())


# the marks of a module that runs the real megatron.training (tests/run.sh runs them in .venv312)
CONTAINER_ERA = [
    pytest.mark.megatron_training,
    pytest.mark.skipif(not container_era(), reason="needs Python 3.12 with megatron-core >= 0.18 (megatron.training); "
                       "tests/run.sh runs these in .venv312"),
]

# torch.cuda.get_device_properties of an H100 SXM (what the hook reads for the GPU's memory)
Props = collections.namedtuple("Props", "name major minor total_memory multi_processor_count")
H100 = Props("NVIDIA H100 80GB HBM3", 9, 0, 85028896768, 132)


def validated_by_megatron(monkeypatch, script: str, flags: list[str], world: int = 8):
    """megatron.training's own parse_and_validate_args over ``script flags --memguard report`` (with the defaults
    pretrain_gpt.py passes) with memguard's hook installed, as rank 0 of ``world`` H100s (torch's device query
    faked): (the hook, the namespace). The environment is restored after the test."""
    import torch

    import megatron_memguard.megatron as hook
    from megatron.training import global_vars
    from megatron.training.arguments import parse_and_validate_args
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert hook.install(quiet=True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=None: H100)
    for k, v in (("WORLD_SIZE", str(world)), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(k, v)
    hook.STATE.decision = None
    monkeypatch.setattr(sys, "argv", [script, *flags, "--memguard", "report"])
    try:
        args = parse_and_validate_args(extra_args_provider=None, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    finally:
        global_vars.unset_global_variables()
    return hook, args


def run_as_written(command: str, cwd) -> "subprocess.CompletedProcess[str]":
    """A `memguard ...` line of the README or docs/*.md run as a user types it in ``cwd``: this tree's CLI, the
    line's shell globs expanded there, without the launcher's and the hook's variables of the test's environment."""
    import glob
    import shlex
    import subprocess
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MEMGUARD", "PET_")) and k != "WORLD_SIZE"}
    env["PYTHONPATH"] = ROOT
    words = []
    for w in shlex.split(command, comments=True)[1:]:
        words += sorted(glob.glob(w, root_dir=cwd)) or [w] if any(c in w for c in "*?") else [w]
    return subprocess.run([sys.executable, "-m", "megatron_memguard.cli.main", *words], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
