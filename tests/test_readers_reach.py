"""This session's optimizer / DDP keys reach memguard from Megatron-Bridge, NeMo 2 and NeMo 1 YAML (issue 17):
nothing memory-relevant is dropped silently, and the emerging optimizers are read the way Bridge 0.6.2 and NeMo 2
build them (training/optim.py setup_optimizer -> megatron-core 0.19.2 get_megatron_optimizer), which differs from
Megatron-LM's validate_args."""
import textwrap

import pytest

from megatron_memguard import estimate, resolve
from megatron_memguard.errors import ConfigError, NotModelledError
from megatron_memguard.readers.detect import read_config_file

from test_readers_bridge import FLAT
from test_readers_nemo1 import BASE as NEMO1
from test_readers_nemo2_moe import QWEN3_30B_A3B_EXPORT

ADAM_LINE = "optimizer: {optimizer: adam, use_distributed_optimizer: false, bf16: true}"
DDP_LINE = "ddp: {use_distributed_optimizer: true, grad_reduce_in_fp32: true, overlap_grad_reduce: true}"


def read(tmp_path, text, name="run_config.yaml", overrides=()):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return read_config_file(str(p), overrides=list(overrides))


def bridge(optimizer: str, ddp_dist: bool = True, extra_opt: str = "", extra_ddp: str = "") -> str:
    assert ADAM_LINE in FLAT and DDP_LINE in FLAT
    text = FLAT.replace(ADAM_LINE, f"optimizer: {{optimizer: {optimizer}, use_distributed_optimizer: false, "
                                   f"bf16: true{extra_opt}}}")
    return text.replace(DDP_LINE, f"ddp: {{use_distributed_optimizer: {str(ddp_dist).lower()}, "
                                  f"grad_reduce_in_fp32: true, overlap_grad_reduce: true{extra_ddp}}}")


def terms(est, stage=0):
    return {t.name: t.bytes for t in est.stages[stage].terms}


def test_bridge_dist_soap_is_megatrons_soap_with_the_distributed_optimizer(tmp_path):
    """Bridge's dist_soap (megatron-core strips dist_ and turns the layer-wise optimizer on) is what Megatron-LM
    builds from --optimizer soap --use-distributed-optimizer: the same state terms byte for byte. Before, the name
    dist_soap reached resolve as it was."""
    raw = read(tmp_path, bridge("dist_soap"))
    assert raw.args["optimizer"] == "soap" and raw.args["use_layer_wise_distributed_optimizer"] is True
    L = resolve(raw, world_size=8)
    megatron = resolve(raw.with_args(use_layer_wise_distributed_optimizer=False), world_size=8)  # validate_args' way
    assert L.optimizer == "soap" and L.use_distributed_optimizer
    a, b = terms(estimate(L)), terms(estimate(megatron))
    assert a["soap_preconditioners"] > 0 and a == b
    # the layer-wise flag written as a key gives the same
    raw2 = read(tmp_path, bridge("soap", extra_opt=", use_layer_wise_distributed_optimizer: true"))
    assert terms(estimate(resolve(raw2, world_size=8))) == a


def test_bridge_soap_with_the_distributed_optimizer_but_not_layer_wise_is_refused(tmp_path):
    """Bridge does not make soap / lion / muon layer-wise from use_distributed_optimizer (Megatron-LM does): core
    0.19.2 then wraps the emerging optimizer whole (Float16OptimizerWithFloat16Params, state on every rank) next
    to distributed-optimizer DDP buffers. Estimated as layer-wise sharded before (DP times too little state)."""
    for opt in ("soap", "lion", "muon"):
        with pytest.raises(NotModelledError) as e:
            read(tmp_path, bridge(opt))
        assert str(e.value).startswith("optimizer.optimizer: ") and "layer-wise" in str(e.value)
    # without the distributed optimizer the state is whole on every rank: estimated as Megatron's plain soap
    L = resolve(read(tmp_path, bridge("soap", ddp_dist=False)), world_size=8)
    assert L.optimizer == "soap" and not L.use_distributed_optimizer


def test_bridge_dist_muon_without_distributed_buffers_is_refused(tmp_path):
    """Kimi-K2's Bridge recipe with muon: dist_muon and ddp.use_distributed_optimizer False, core 0.19's legacy
    ping-pong layer-wise path (every parameter dealt out whole), which memguard does not model for core 0.19."""
    with pytest.raises(NotModelledError, match=r"^optimizer\.optimizer: dist_muon's layer-wise"):
        read(tmp_path, bridge("dist_muon", ddp_dist=False))
    L = resolve(read(tmp_path, bridge("dist_muon", extra_opt=", muon_scalar_optimizer: lion")), world_size=8)
    assert L.optimizer == "dist_muon" and L.muon_scalar_optimizer == "lion"   # was silently adam


def test_bridge_optimizer_and_ddp_keys_are_read(tmp_path):
    """optimizer.optimizer_cuda_graph / overlap_param_gather_with_optimizer_step and
    ddp.megatron_fsdp_enable_fine_grained_param_gather were dropped without a word."""
    raw = read(tmp_path, bridge("adam", extra_opt=", optimizer_cuda_graph: true",
                                extra_ddp=", megatron_fsdp_enable_fine_grained_param_gather: true"))
    assert raw.args["optimizer_cuda_graph"] is True
    assert raw.origin["optimizer_cuda_graph"] == "optimizer.optimizer_cuda_graph"
    assert raw.args["megatron_fsdp_enable_fine_grained_param_gather"] is True
    L = resolve(raw, world_size=8)
    assert L.optimizer_cuda_graph          # (its pool term appears when the peak is not the step itself)
    raw = read(tmp_path, bridge("dist_muon", extra_opt=", overlap_param_gather_with_optimizer_step: true"))
    with pytest.raises(ConfigError, match="overlap_param_gather_with_optimizer_step"):
        resolve(raw, world_size=8)      # core 0.19.2 asserts against it with the layer-wise optimizer


def test_nemo2_optimizer_keys(tmp_path):
    base = textwrap.dedent(QWEN3_30B_A3B_EXPORT)
    assert "    optimizer: adam\n    bf16: true\n    use_distributed_optimizer: true\n" in base
    text = base.replace("    optimizer: adam\n", "    optimizer: dist_soap\n    optimizer_cuda_graph: true\n")
    text = text.replace("      overlap_param_gather: true\n", "      overlap_param_gather: true\n"
                        "      delay_wgrad_compute: true\n")
    raw = read(tmp_path, text, "nemo2.yaml")
    assert raw.args["optimizer"] == "soap" and raw.args["use_layer_wise_distributed_optimizer"] is True
    assert raw.args["optimizer_cuda_graph"] is True
    assert raw.origin["delay_wgrad_compute"] == "trainer.strategy.ddp.delay_wgrad_compute"
    with pytest.raises(NotModelledError, match=r"^optim\.config\.optimizer: lion with use_distributed_optimizer"):
        read(tmp_path, base.replace("    optimizer: adam\n", "    optimizer: lion\n"), "nemo2.yaml")


def test_nemo2_ddp_fp32_and_user_buffer_keys(tmp_path):
    """trainer.strategy.ddp.nccl_ub (dropped before), reduce_scatter_with_fp32_accumulation and
    param_name_patterns_for_fp32_local_accumulation reach memguard under their Megatron dests."""
    base = textwrap.dedent(QWEN3_30B_A3B_EXPORT)
    text = base.replace("      overlap_param_gather: true\n", "      overlap_param_gather: true\n"
                        "      nccl_ub: true\n      reduce_scatter_with_fp32_accumulation: true\n"
                        "      param_name_patterns_for_fp32_local_accumulation: ['*router*']\n")
    raw = read(tmp_path, text, "nemo2.yaml")
    assert raw.args["nccl_ub"] is True and raw.args["ddp_reduce_scatter_with_fp32_accumulation"] is True
    assert list(raw.args["ddp_param_name_patterns_for_fp32_local_accumulation"]) == ["*router*"]
    assert raw.origin["nccl_ub"] == "trainer.strategy.ddp.nccl_ub"


@pytest.mark.parametrize("name", ["lion", "soap", "muon"])
def test_nemo1_has_no_emerging_optimizers(tmp_path, name):
    """NeMo 1 builds optimizers from its own registry (nemo/core/optim/optimizers.py), which has none of
    megatron-core's emerging ones: was estimated as Megatron's."""
    with pytest.raises(ConfigError, match=rf"^model\.optim\.name: '{name}' is not a NeMo 1 optimizer"):
        read(tmp_path, NEMO1.replace("optim: {name: fused_adam", f"optim: {{name: {name}"), "cfg.yaml")


MOE_MODEL = ("  num_moe_experts: 8\n  moe_router_topk: 2\n  moe_token_dispatcher_type: alltoall\n  moe_grouped_gemm: true\n"
             "  expert_model_parallel_size: 2\n  moe_ffn_hidden_size: 768\n")


def test_bridge_comm_overlap_section_writes_the_model_fields(tmp_path):
    """CommOverlapConfig.setup (Bridge 0.6.2 training/comm_overlap.py, run by ConfigContainer.validate) writes
    overlap_moe_expert_parallel_comm, delay_wgrad_compute, defer_embedding_wgrad_compute and tp_comm_overlap into
    the model config: the section's value, False where it leaves one unset. comm_overlap's own values were
    dropped, and a model.* True it turns off was estimated as on."""
    text = FLAT.replace("  bf16: true\n", "  bf16: true\n" + MOE_MODEL, 1)
    on = text + "comm_overlap: {tp_comm_overlap: false, overlap_moe_expert_parallel_comm: true, delay_wgrad_compute: true}\n"
    raw = read(tmp_path, on)
    assert raw.origin["overlap_moe_expert_parallel_comm"] == "comm_overlap.overlap_moe_expert_parallel_comm"
    L = resolve(raw, world_size=8)
    assert L.moe.overlap_moe_expert_parallel_comm and L.moe.delay_wgrad_compute
    off = text.replace("  bf16: true\n", "  bf16: true\n  overlap_moe_expert_parallel_comm: true\n  tp_comm_overlap: true\n", 1)
    raw = read(tmp_path, off + "comm_overlap: {tp_comm_overlap: false}\n")
    L = resolve(raw, world_size=8)
    assert not L.moe.overlap_moe_expert_parallel_comm and not L.tp_comm_overlap
    assert sum("CommOverlapConfig.setup turns it off" in w for w in raw.warnings) == 2
    # without a comm_overlap section Bridge leaves the model's own value
    L = resolve(read(tmp_path, off.replace("  tp_comm_overlap: true\n", "")), world_size=8)
    assert L.moe.overlap_moe_expert_parallel_comm


@pytest.mark.parametrize("extra", [
    "--optimizer soap --use-distributed-optimizer --tp-comm-overlap --tensor-model-parallel-size 2 --sequence-parallel",
    "--attention-output-gate --freeze-all-layers --symmetric-ar-type two_shot --tensor-model-parallel-size 2",
])
def test_functional_test_yaml_model_args_estimate_as_the_flags(tmp_path, extra):
    """Megatron CI's model_config.yaml (MODEL_ARGS): the same estimate, term for term, as the flags."""
    import yaml

    from conftest import LLAMA31_8B
    from megatron_memguard import layout_from_flags
    flags = LLAMA31_8B + extra.split() + ["--micro-batch-size", "1"]
    args, i = {}, 0
    while i < len(flags):
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            args[flags[i]], i = flags[i + 1], i + 2
        else:
            args[flags[i]], i = True, i + 1
    p = tmp_path / "model_config.yaml"
    p.write_text(yaml.safe_dump({"ENV_VARS": {"CUDA_DEVICE_MAX_CONNECTIONS": 1}, "MODEL_ARGS": args}))
    L = resolve(read_config_file(str(p)), world_size=16, megatron_version="0.19.2")
    M = layout_from_flags(flags, world_size=16, megatron_version="0.19.2")
    assert [terms(estimate(L), i) for i in range(L.pp)] == [terms(estimate(M), i) for i in range(M.pp)]


def test_bridge_fsdp_gradient_modes_without_a_megatron_flag_are_read(tmp_path):
    """DistributedDataParallelConfig fields of core 0.18+ with no Megatron flag that change the gradient copies
    Megatron-FSDP keeps: dropped silently at first, then refused, modelled now (tests/test_ddp_fsdp_flags.py).
    The CUDA-graph-safe mode keeps the cast gradient copy (main_grad_copies) through the next iteration; decoupled
    gradients need the precision-aware optimizer."""
    fsdp = ", use_megatron_fsdp: true, data_parallel_sharding_strategy: optim_grads_params"
    raw = read(tmp_path, bridge("adam", extra_ddp=fsdp + ", megatron_fsdp_cuda_graph_mode: true"))
    L = resolve(raw, world_size=8)
    assert L.megatron_fsdp_cuda_graph_mode
    t = terms(estimate(L))
    assert t["main_grad_copies"] == t["main_parameters"] > 0
    raw = read(tmp_path, bridge("adam", extra_ddp=fsdp + ", megatron_fsdp_use_decoupled_grad: true"))
    with pytest.raises(ConfigError, match=r"^ddp\.megatron_fsdp_use_decoupled_grad: .*precision-aware"):
        resolve(raw, world_size=8)
    raw = read(tmp_path, bridge("adam", extra_ddp=", use_megatron_fsdp: true, megatron_fsdp_cuda_graph_mode: false"))
    assert resolve(raw, world_size=8).use_megatron_fsdp


def test_bridge_ddp_fp32_keys_are_read(tmp_path):
    """ddp.reduce_scatter_with_fp32_accumulation and ddp.param_name_patterns_for_fp32_local_accumulation reach the
    Megatron dests (resolve/optimizer.py)."""
    raw = read(tmp_path, bridge("adam", extra_ddp=", reduce_scatter_with_fp32_accumulation: true, nccl_ub: true"))
    L = resolve(raw, world_size=8)
    assert L.ddp_reduce_scatter_with_fp32_accumulation and L.nccl_ub
    raw = read(tmp_path, bridge("adam", extra_ddp=", param_name_patterns_for_fp32_local_accumulation: ['*norm*']"))
    with pytest.raises(ConfigError, match=r"^ddp\.param_name_patterns_for_fp32_local_accumulation: .*grad_reduce_in_fp32"):
        resolve(raw, world_size=8)      # the helper's ddp writes grad_reduce_in_fp32: true
