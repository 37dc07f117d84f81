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
