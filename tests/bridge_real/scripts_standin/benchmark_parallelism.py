"""Stand-in for Megatron-Bridge's scripts/common/benchmark_parallelism.py (imported by run_recipe.py, used only
for benchmark recipes, which the stand-in recipe_metadata never reports)."""
ParallelTopology = object


def data_parallel_size(*, num_gpus, topology):
    raise AssertionError("benchmark recipes only")


def topology_from_config(model):
    return None


def weak_scaled_global_batch_size(**kwargs):
    raise AssertionError("benchmark recipes only")
