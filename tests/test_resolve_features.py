"""The resolve sections of CUDA graphs, activation offloading, MTP and Muon, called on their own: Megatron's rules
(TransformerConfig.__post_init__, validate_args, the optimizer factory) as one error per broken rule naming the
flag the user wrote."""
from packaging.version import Version

from megatron_memguard.config import RawConfig
from megatron_memguard.resolve.args import Args, Context
from megatron_memguard.resolve.cuda_graphs import cuda_graphs
from megatron_memguard.resolve.muon import muon
from megatron_memguard.resolve.mtp import mtp
from megatron_memguard.resolve.offload import offload

V16, V19 = Context(Version("0.16.1"), None, None), Context(Version("0.19.2"), None, None)
KW = dict(num_layers=4, pipeline_model_parallel_size=1, recompute_granularity=None, position_embedding_type="rope",
          pipeline_model_parallel_layout=None, transformer_impl="transformer_engine", optimizer="adam", fp16=False,
          use_distributed_optimizer=False, num_distributed_optimizer_instances=1)


def run(section, args, ctx=V19, **kw):
    a = Args(RawConfig(args=args))
    out = section(a, {**KW, **kw}, ctx)
    return out, [str(e) for e in a.errors]


def test_cuda_graphs_impl_and_aliases():
    assert run(cuda_graphs, {}) == (dict(cuda_graph_impl="none", cuda_graph_modules=()), [])
    assert run(cuda_graphs, {"enable_cuda_graph": True})[0]["cuda_graph_impl"] == "local"
    assert run(cuda_graphs, {"external_cuda_graph": True})[0]["cuda_graph_impl"] == "transformer_engine"
    _, errs = run(cuda_graphs, {"enable_cuda_graph": True, "cuda_graph_impl": "local"})
    assert len(errs) == 1 and errs[0].startswith("--enable-cuda-graph")
    # 0.16's full-iteration graph: local + scope full_iteration; 0.16 has no full_iteration implementation
    out, errs = run(cuda_graphs, {"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"}, V16)
    assert out["cuda_graph_impl"] == "full_iteration" and not errs
    assert run(cuda_graphs, {"cuda_graph_impl": "full_iteration"}, V16)[1][0].startswith("--cuda-graph-impl")


def test_cuda_graphs_module_rules():
    out, errs = run(cuda_graphs, {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["attn", "mlp"]})
    assert out["cuda_graph_modules"] == ("attn", "mlp") and not errs
    # moe_preprocess needs moe_router; moe graphs need experts (TransformerConfig.__post_init__)
    _, errs = run(cuda_graphs, {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["moe_preprocess"]})
    assert any("moe_preprocess needs moe_router" in e for e in errs)
    _, errs = run(cuda_graphs, {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["moe_router"]})
    assert errs and errs[0].startswith("--cuda-graph-modules")
    _, errs = run(cuda_graphs, {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["attn"],
                                "cuda_graph_scope_deprecated": ["mlp"]})
    assert errs and "cannot be set together" in errs[0]
    # full recompute only with the full-iteration graph; full_iteration needs the NaN check off (0.19)
    _, errs = run(cuda_graphs, {"cuda_graph_impl": "local"}, recompute_granularity="full")
    assert errs and errs[0].startswith("--recompute-granularity")
    _, errs = run(cuda_graphs, {"cuda_graph_impl": "full_iteration"})
    assert errs and "--no-check-for-nan-in-loss-and-grad" in errs[0]
    assert run(cuda_graphs, {"cuda_graph_impl": "full_iteration", "check_for_nan_in_loss_and_grad": False})[1] == []


def test_offload_rules():
    out, errs = run(offload, {"cpu_offloading_num_layers": 2})
    assert out["cpu_offloading_num_layers"] == 2 and not errs
    assert run(offload, {"cpu_offloading_num_layers": 4})[1][0].startswith("--cpu-offloading-num-layers")
    assert run(offload, {"cpu_offloading_num_layers": 1}, pipeline_model_parallel_size=2)[1]
    assert run(offload, {"cpu_offloading_num_layers": 1}, recompute_granularity="selective")[1]
    out, errs = run(offload, {"fine_grained_activation_offloading": True, "offload_modules": ["core_attn", "attn_proj"]})
    assert out["offload_modules"] == ("core_attn", "attn_proj") and not errs
    _, errs = run(offload, {"fine_grained_activation_offloading": True, "offload_modules": ["attn_proj"]})
    assert errs and errs[0].startswith("--offload-modules") and "core_attn" in errs[0]
    _, errs = run(offload, {"fine_grained_activation_offloading": True, "offload_modules": ["core_attn"]},
                  transformer_impl="local")
    assert errs and errs[0].startswith("--fine-grained-activation-offloading")


def test_mtp_rules():
    assert run(mtp, {"mtp_num_layers": 2}) == (dict(mtp_num_layers=2), [])
    # validate_args (0.19.2): rope or none only
    _, errs = run(mtp, {"mtp_num_layers": 1}, position_embedding_type="learned_absolute")
    assert errs and errs[0].startswith("--mtp-num-layers")
    assert run(mtp, {"mtp_num_layers": 1}, V16, position_embedding_type="learned_absolute")[1] == []


def test_muon_rules():
    # OptimizerConfig's defaults (megatron-core 0.16.1 and 0.19.2): split QKV, blockwise, medium, no Nesterov
    assert run(muon, {}, optimizer="muon") == (dict(muon_scalar_optimizer="adam", muon_split_qkv=True,
                                                    muon_tp_mode="blockwise", muon_fp32_matmul_prec="medium",
                                                    muon_nesterov=False), [])
    out, errs = run(muon, {"muon_split_qkv": False, "muon_tp_mode": "duplicated", "muon_nesterov": True}, optimizer="muon")
    assert (out["muon_split_qkv"], out["muon_tp_mode"], out["muon_nesterov"], errs) == (False, "duplicated", True, [])
    # 0.16.1 names the Nesterov switch muon_use_nesterov
    assert run(muon, {"muon_use_nesterov": True}, V16, optimizer="muon")[0]["muon_nesterov"] is True
    assert run(muon, {"muon_fp32_matmul_prec": "low"}, optimizer="muon")[1][0].startswith("--muon-fp32-matmul-prec")
    # TE's single grouped expert weight: its shape decides Muon or the fallback; refused by name
    import pytest
    from megatron_memguard.errors import NotModelledError
    with pytest.raises(NotModelledError) as e:
        run(muon, {"moe_single_grouped_weight": True}, optimizer="muon")
    assert "--moe-single-grouped-weight" in str(e.value)
    _, errs = run(muon, {}, V16, optimizer="muon", use_distributed_optimizer=True)
    assert errs and errs[0].startswith("--use-distributed-optimizer")
    assert run(muon, {}, V19, optimizer="muon", use_distributed_optimizer=True)[1] == []
    assert run(muon, {}, optimizer="muon", fp16=True)[1][0].startswith("--optimizer")
    assert run(muon, {"muon_scalar_optimizer": "sgd"}, optimizer="muon")[1][0].startswith("--muon-scalar-optimizer")
    assert run(muon, {}, V16, optimizer="adaptive_muon")[1]


def test_mtp_in_a_pipeline_layout():
    # validate_layer_layout (core 0.16.1 to 0.19.2): the 'm' count is --mtp-num-layers, no decoder layer after an
    # MTP layer; an earlier stage than the loss's is Megatron's mtp_standalone (estimated)
    import pytest
    from megatron_memguard.errors import ConfigError
    assert run(mtp, {"mtp_num_layers": 1}, pipeline_model_parallel_layout="Et|tmL", pipeline_model_parallel_size=2)[1] == []
    _, errs = run(mtp, {"mtp_num_layers": 2}, pipeline_model_parallel_layout="Et|tmL", pipeline_model_parallel_size=2)
    assert errs and errs[0].startswith("--pipeline-model-parallel-layout")
    _, errs = run(mtp, {}, pipeline_model_parallel_layout="Et|tmL", pipeline_model_parallel_size=2)
    assert errs and "--mtp-num-layers is 0" in errs[0]
    assert run(mtp, {"mtp_num_layers": 1}, pipeline_model_parallel_layout="Etm|L", pipeline_model_parallel_size=2)[1] == []
    with pytest.raises(ConfigError, match="decoder layer 't' after an MTP layer"):
        run(mtp, {"mtp_num_layers": 1}, pipeline_model_parallel_layout="Etm|tL", pipeline_model_parallel_size=2)


def test_module_lists_as_yaml_and_flags_write_them():
    # functional-test model_config.yaml: "[attn mlp]"; the flag reader splits it into '[attn', 'mlp]'
    for v in ("[attn mlp]", ["[attn", "mlp]"], "attn,mlp", ["attn", "mlp"]):
        out, errs = run(cuda_graphs, {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": v})
        assert out["cuda_graph_modules"] == ("attn", "mlp") and not errs, v
    out, _ = run(offload, {"fine_grained_activation_offloading": True, "offload_modules": ["[core_attn", "attn_proj]"]})
    assert out["offload_modules"] == ("core_attn", "attn_proj")


def test_cuda_graph_modules_as_megatron_enums():
    # after validate_args the namespace the hook reads holds CudaGraphModule members
    import enum

    class CudaGraphModule(enum.Enum):
        attn = 2
        mlp = 3
    out, errs = run(cuda_graphs, {"cuda_graph_impl": "transformer_engine",
                                  "cuda_graph_modules": [CudaGraphModule.attn, CudaGraphModule.mlp]})
    assert out["cuda_graph_modules"] == ("attn", "mlp") and not errs
    out, errs = run(cuda_graphs, {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": "CudaGraphModule.attn"})
    assert out["cuda_graph_modules"] == ("attn",) and not errs
