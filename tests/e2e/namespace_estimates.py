"""What the Megatron hook estimates for a command line, from the namespace the real megatron.training builds.

    python tests/e2e/namespace_estimates.py --serve      # one job per stdin line: {"flags": [...], "world": N}

Needs a megatron.training (megatron-core 0.18+ in the 3.12 venv). For each job: WORLD_SIZE / RANK set as
torchrun sets them, ``megatron.training.arguments.parse_args()`` over the flags (sys.argv, as pretrain_gpt.py
runs it), then the hook's own path (megatron/preflight.py raw_config_from_args -> resolve at the namespace's
world size and the installed release's era -> estimate on an H100, B200 when the job runs a Blackwell-only
recipe). Answers each job with one line "@@{json}": the era and each stage's peak allocated and device total, or
the error (the test shows it).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _era() -> str:
    from megatron.core import package_info
    major, minor = (int(x) for x in package_info.__version__.split(".")[:2])
    return f"{major}.{minor}"


def _memoize_docstrings() -> None:
    """megatron.training 0.19.2's parse_args re-reads each config dataclass's source for its fields' help texts
    on every call (argument_utils.ArgumentGroupFactory._get_field_docstrings, an AST parse, about a second): the
    texts depend only on the class, so one read per class serves every job (the parsed values are the same)."""
    try:
        from megatron.training.argument_utils import ArgumentGroupFactory
    except ImportError:           # a release without dataclass-generated arguments
        return
    read, memo = ArgumentGroupFactory._get_field_docstrings, {}

    def once(self, cls):
        if cls not in memo:
            memo[cls] = read(self, cls)
        return dict(memo[cls])
    ArgumentGroupFactory._get_field_docstrings = once


def estimate_job(job: dict) -> dict:
    from megatron.training.arguments import parse_args

    from megatron_memguard import estimate, lookup_gpu
    from megatron_memguard.megatron.preflight import raw_config_from_args
    from megatron_memguard.resolve import resolve
    os.environ.update(WORLD_SIZE=str(job["world"]), RANK="0", LOCAL_RANK="0")
    sys.argv = ["pretrain_gpt.py", *job["flags"]]
    ns = parse_args()
    raw = raw_config_from_args(ns, {})
    L = resolve(raw, world_size=raw.world_size, megatron_version=_era())
    est = estimate(L, gpu=lookup_gpu(job.get("gpu", "H100-80GB")))
    return {"era": _era(), "world": raw.world_size, "verdict": est.verdict,
            "allocated": [s.peak_allocated_bytes for s in est.stages],
            "device": [s.device_total_bytes for s in est.stages]}


if __name__ == "__main__":
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    _memoize_docstrings()
    for line in sys.stdin:
        try:
            reply = estimate_job(json.loads(line))
        except BaseException as e:      # argparse exits on a flag it lacks: shown by the test
            reply = {"error": f"{type(e).__name__}: {e}"[:400]}
        print("@@" + json.dumps(reply), flush=True)
