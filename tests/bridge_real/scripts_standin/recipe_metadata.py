"""Stand-in for Megatron-Bridge's scripts/training/recipe_metadata.py, which run_recipe.py and recipe_runner.py
import but which is not in ../shared/reference/megatron-bridge-scripts. Library recipes only: no benchmark
(perf_recipes) metadata. ``recipe_task`` / ``infer_recipe_mode`` use the task words of the names
megatron.bridge.recipes exports (``..._pretrain_...``, ``..._sft_...``, ``..._peft_...``), as memguard assumes
(megatron_memguard/readers/run_recipe.py)."""
BENCHMARK_RECIPE_PRECEDENCE_COLLISIONS = frozenset()
LIBRARY_RECIPE_PRECEDENCE_COLLISIONS = frozenset()
BenchmarkRecipeMetadata = object


def recipe_task(mode):
    return "peft" if mode in ("lora", "dora") else mode


def infer_recipe_mode(recipe_name):
    words = recipe_name.lower().split("_")
    for task, mode in (("pretrain", "pretrain"), ("sft", "sft"), ("peft", "lora")):
        if task in words:
            return mode
    return None


def recipe_step(recipe_name, native_energon_packing=False):
    return "llm_step"


def recipe_steps_match(a, b):
    return a == b


def resolved_benchmark_recipe_metadata(recipe_name):
    return None


def validate_benchmark_recipe_scope(*args, **kwargs):
    raise AssertionError("no benchmark recipes in the stand-in")


def benchmark_recipe_family(recipe_name):
    raise ValueError(recipe_name)
