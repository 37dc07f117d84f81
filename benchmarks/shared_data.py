"""Where the workplace's read-only material lives: ``shared/`` next to this checkout (real configs,
Megatron CI measurements, throughput sweeps). It is read from there, never copied into the project;
``MEMGUARD_SHARED`` points elsewhere."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("MEMGUARD_SHARED") or os.path.join(os.path.dirname(ROOT), "shared")
CONFIGS = os.path.join(SHARED, "configs")
GROUNDTRUTH = os.path.join(SHARED, "groundtruth")
DENSE_RECORDS = os.path.join(GROUNDTRUTH, "megatron-functional-dev.jsonl")
MOE_RECORDS = os.path.join(GROUNDTRUTH, "megatron-functional-moe-dev.jsonl")
THROUGHPUT = os.path.join(GROUNDTRUTH, "throughput")
# Megatron-Bridge's scripts/training/run_recipe.py and recipe_runner.py (not in its pip package), v0.6.0/ and main/.
BRIDGE_SCRIPTS = os.path.join(SHARED, "reference", "megatron-bridge-scripts")
