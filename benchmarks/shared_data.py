"""Where the workplace's read-only material lives: ``shared/`` next to this checkout (real configs,
Megatron CI measurements, throughput sweeps), or next to the local checkout this one was cloned from
(``git clone /work/main /tmp/x`` finds /work/shared). It is read from there, never copied into the
project; ``MEMGUARD_SHARED`` points elsewhere."""
import configparser
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _origin_checkout(root: str) -> str | None:
    """The local path this checkout was cloned from (its ``origin`` remote), if it is one."""
    cfg = configparser.ConfigParser(strict=False)
    try:
        cfg.read(os.path.join(root, ".git", "config"))
        url = cfg.get('remote "origin"', "url", fallback="")
    except (configparser.Error, OSError):
        return None
    url = url[len("file://"):] if url.startswith("file://") else url
    return url.rstrip("/") if os.path.isabs(url) else None


def _find_shared() -> str:
    beside = os.path.join(os.path.dirname(ROOT), "shared")
    if os.environ.get("MEMGUARD_SHARED"):
        return os.environ["MEMGUARD_SHARED"]
    origin = _origin_checkout(ROOT)
    if not os.path.isdir(beside) and origin:
        beside_origin = os.path.join(os.path.dirname(origin), "shared")
        if os.path.isdir(beside_origin):
            return beside_origin
    return beside


SHARED = _find_shared()
CONFIGS = os.path.join(SHARED, "configs")
GROUNDTRUTH = os.path.join(SHARED, "groundtruth")
DENSE_RECORDS = os.path.join(GROUNDTRUTH, "megatron-functional-dev.jsonl")
MOE_RECORDS = os.path.join(GROUNDTRUTH, "megatron-functional-moe-dev.jsonl")
THROUGHPUT = os.path.join(GROUNDTRUTH, "throughput")
# Megatron-Bridge's scripts/training/run_recipe.py and recipe_runner.py (not in its pip package), v0.6.0/ and main/.
BRIDGE_SCRIPTS = os.path.join(SHARED, "reference", "megatron-bridge-scripts")
