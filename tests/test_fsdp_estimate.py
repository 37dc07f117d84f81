"""Megatron-FSDP, torch FSDP2 and optimizer CPU offload through resolve and the estimate: the rules
validate_args enforces (one-line errors naming the flag) and the breakdown's terms, by hand.

Model: Llama-3.1-8B (8,030,261,248 parameters, Meta's model card), TP1, 8 GPUs (DP 8).
Per rank under optim_grads_params (megatron-core 0.19 param_and_grad_buffer.py): 32 layer units of
218,112,000 elements (8,030,261,248 - 2 x 525,336,576 - 4,096 = 6,979,584,000 / 32), chunk factor
lcm(14336, 4096) = 28672 (fc2's row 14336, the other rows 4096, _get_parameter_groups step 3): each
bucket padded to a multiple of 8 x 28672 = 229,376 -> 218,136,576; one group outside units
(embedding, final norm, output layer: 1,050,677,248, factor 4096) padded to 32,768 -> 1,050,705,920.
Shard per rank: 32 x 27,267,072 + 131,338,240 = 1,003,884,544 elements.
"""
import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError

from conftest import LLAMA31_8B

BASE = LLAMA31_8B + ["--micro-batch-size", "1", "--global-batch-size", "64", "--seq-length", "4096",
                     "--max-position-embeddings", "4096"]
FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
SHARD = 1_003_884_544
UNITS = 32 * 218_136_576
OUTSIDE = 1_050_705_920


def terms(flags, version=None, world=8):
    est = estimate(layout_from_flags(BASE + flags, world_size=world, megatron_version=version))
    s = est.stages[0]
    return est, {t.name: t.bytes for t in s.terms}


def test_optim_grads_params_terms_by_hand():
    est, t = terms(FSDP + ["--data-parallel-sharding-strategy", "optim_grads_params"])
    assert t["fsdp_parameters"] == 2 * SHARD
    assert t["fsdp_gradients"] == 2 * SHARD               # core 0.19: grads in the param dtype
    assert t["fsdp_non_unit_parameters"] == 2 * OUTSIDE
    assert t["main_parameters"] == 4 * SHARD
    assert t["adam_exp_avg"] == t["adam_exp_avg_sq"] == 4 * SHARD
    assert "parameters" not in t and "gradient_buffer" not in t
    # after the step: the fp32 grad copies, and the units start_param_sync re-gathers: Megatron-FSDP
    # turns overlap_param_gather on under optim_grads_params (MegatronFSDP.__init__), so the embedding's
    # bucket with the prefetch behind it while under 5e8 elements (half of the 1e9 floor): 3 of the 32
    # units of 218,136,576 elements
    s = est.stages[0]
    state = 2 * SHARD * 2 + 2 * OUTSIDE + 12 * SHARD
    gathered = 3 * 2 * (UNITS // 32)
    other = sum(t.bytes for t in s.terms if t.name in ("rotary_cache", "cublas_workspaces", "te_workspace",
                                                      "dummy_wgrads"))
    assert s.persistent_bytes - state - other == 4 * SHARD + gathered


def test_core_0_16_grads_are_fp32_and_the_default_is_no_shard():
    # Before core 0.18 NullTokenizer counts one more token: vocabulary 128257 -> 128384, so the group
    # outside units has 2 x 128384 x 4096 + 4096 = 1,051,725,824 elements -> 1,051,754,496 padded.
    shard = 32 * 218_136_576 // 8 + 1_051_754_496 // 8
    _, t = terms(FSDP + ["--use-distributed-optimizer", "--data-parallel-sharding-strategy", "optim_grads_params"],
                 version="0.16.1")
    assert t["fsdp_gradients"] == 4 * shard
    _, t = terms(FSDP + ["--use-distributed-optimizer"], version="0.16.1")
    whole = 8_030_261_248 + 2 * 128 * 4096
    assert t["fsdp_gradients"] == 4 * whole       # no_shard: whole, unpadded, fp32
    assert t["main_parameters"] == 4 * whole


def test_megatron_fsdp_rules():
    with pytest.raises((ConfigError, ConfigErrors), match="--ckpt-format"):
        layout_from_flags(BASE + ["--use-megatron-fsdp", "--ckpt-format", "torch_dist"], world_size=8)
    with pytest.raises((ConfigError, ConfigErrors), match="--use-distributed-optimizer"):
        layout_from_flags(BASE + FSDP, world_size=8, megatron_version="0.16.1")
    with pytest.raises((ConfigError, ConfigErrors), match="--data-parallel-sharding-strategy"):
        layout_from_flags(BASE + FSDP + ["--data-parallel-sharding-strategy", "zero3"], world_size=8)
    with pytest.raises(NotModelledError, match="muon"):     # validate_args: adam or sgd (resolve/muon.py)
        layout_from_flags(BASE + FSDP + ["--optimizer", "muon"], world_size=8)
    with pytest.raises((ConfigError, ConfigErrors), match="--outer-dp-sharding-strategy"):
        layout_from_flags(BASE + FSDP + ["--outer-dp-sharding-strategy", "zero"], world_size=8)
    # 0.19 switches the distributed optimizer on (with a note), so --overlap-param-gather is allowed
    L = layout_from_flags(BASE + FSDP + ["--overlap-grad-reduce", "--overlap-param-gather"], world_size=8)
    assert L.use_distributed_optimizer and any("use-distributed-optimizer" in n for n in L.notes)


def test_megatron_fsdp_without_ckpt_format_is_refused_in_core_0_19_only():
    """core 0.19.2 megatron/training/arguments.py validate_args: under --use-megatron-fsdp
    ``assert args.ckpt_format == "fsdp_dtensor"``, and --ckpt-format defaults to torch_dist, so leaving the
    flag out fails in Megatron. megatron-core 0.16.1 is not held to it (its training source is not in the
    0.16.1 wheel or sdist; the explicit mismatch stays refused in both eras)."""
    with pytest.raises((ConfigError, ConfigErrors), match="--use-megatron-fsdp: requires --ckpt-format fsdp_dtensor"):
        layout_from_flags(BASE + ["--use-megatron-fsdp"], world_size=8)
    L = layout_from_flags(BASE + ["--use-megatron-fsdp", "--use-distributed-optimizer"], world_size=8,
                          megatron_version="0.16.1")
    assert L.use_megatron_fsdp


def test_torch_fsdp2_rules_and_terms():
    with pytest.raises((ConfigError, ConfigErrors), match="gradient accumulation fusion"):
        layout_from_flags(BASE + ["--use-torch-fsdp2"], world_size=8)
    with pytest.raises((ConfigError, ConfigErrors), match="pipeline"):
        layout_from_flags(BASE + ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion",
                                  "--pipeline-model-parallel-size", "2"], world_size=8)
    with pytest.raises((ConfigError, ConfigErrors), match="distributed-optimizer"):
        layout_from_flags(BASE + ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion",
                                  "--use-distributed-optimizer"], world_size=8)
    _, t = terms(["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"])
    # every parameter sharded over 8: (2 + 2 + 4 + 8) B x ceil(n / 8) per unit
    assert t["main_parameters"] == 2 * t["fsdp_parameters"] == 2 * t["fsdp_gradients"]
    assert abs(t["fsdp_parameters"] - 2 * 8_030_261_248 / 8) < 64


def test_optimizer_offload_moves_the_share_to_the_host():
    flags = ["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--optimizer-cpu-offload",
             "--optimizer-offload-fraction", "0.5"]
    est, t = terms(flags)
    s = est.stages[0]
    # DDP shard: 8,030,261,248 / 8 (the padding of the buffer is a few elements)
    shard = 8_030_261_248 // 8
    assert abs(t["main_parameters"] - 4 * shard / 2) < 4096
    assert abs(t["adam_exp_avg"] - 4 * shard / 2) < 4096
    assert abs(s.host_bytes - 16 * shard / 2) < 16384
    assert est.host_bytes_per_rank == s.host_bytes and est.host_bytes_per_node == 8 * s.host_bytes
    d = est.to_dict()
    assert d["host_bytes_per_rank"] == s.host_bytes and d["stages"][0]["host_bytes"] == s.host_bytes
    with pytest.raises((ConfigError, ConfigErrors), match="use-precision-aware-optimizer"):
        layout_from_flags(BASE + ["--use-distributed-optimizer", "--optimizer-cpu-offload"], world_size=8)


def test_off_by_default_leaves_the_ddp_terms():
    est, t = terms(["--use-distributed-optimizer"])
    assert "parameters" in t and "gradient_buffer" in t and not any(k.startswith("fsdp_") for k in t)
    assert est.host_bytes_per_rank == 0 and "host_bytes_per_rank" not in est.to_dict()


def test_megatron_namespace_after_validate_args():
    # The hook reads Megatron's args after validate_args (0.19): FSDP dtypes are torch dtypes, "auto" is None,
    # use_custom_fsdp and use_distributed_optimizer switched on.
    import argparse

    import torch

    from megatron_memguard import resolve
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    from megatron_memguard.readers.megatron_namespace import raw_from_namespace
    ns = argparse.Namespace(**parse_megatron_flags(BASE + FSDP).args)
    ns.use_custom_fsdp = ns.use_distributed_optimizer = True
    ns.megatron_fsdp_main_params_dtype, ns.megatron_fsdp_main_grads_dtype = torch.float32, None
    ns.world_size = 8
    L = resolve(raw_from_namespace(ns), world_size=8)
    assert (L.use_megatron_fsdp, L.megatron_fsdp_main_params_dtype, L.megatron_fsdp_main_grads_dtype) == \
        (True, "fp32", "auto")


def test_pipeline_stages_hold_their_own_groups():
    # PP 2: the embedding's group on the first stage, the final norm and output layer on the last;
    # each stage's 16 layer units alike (one FSDP module per model chunk)
    est = estimate(layout_from_flags(BASE + FSDP + ["--pipeline-model-parallel-size", "2"], world_size=8))
    first, last = ({t.name: t.bytes for t in s.terms} for s in est.stages)
    # 4 FSDP ranks (DP 4), buckets padded to 4 x 4096 = 16,384: the embedding's 525,336,576 elements
    # are a multiple already; final norm + output layer, 525,340,672, round up to 525,352,960
    assert first["fsdp_non_unit_parameters"] == 2 * 525_336_576
    assert last["fsdp_non_unit_parameters"] == 2 * 525_352_960
    assert first["fsdp_parameters"] - 2 * 525_336_576 // 4 == last["fsdp_parameters"] - 2 * 525_352_960 // 4


def test_activation_offloading_host_bytes_are_what_leaves_the_gpu():
    # --cpu-offloading-num-layers (TE cpu_offload, PP = 1): the layers' saved tensors move to the host;
    # the host figure is exactly what the GPU's layer activations lose (one micro-batch in flight)
    flags = ["--use-distributed-optimizer", "--no-gradient-accumulation-fusion"]
    est0 = estimate(layout_from_flags(BASE + flags, world_size=8))
    est1 = estimate(layout_from_flags(BASE + flags + ["--cpu-offloading-num-layers", "4"], world_size=8))
    a0 = {t.name: t.bytes for t in est0.stages[0].terms}["layer_activations"]
    s1 = est1.stages[0]
    a1 = {t.name: t.bytes for t in s1.terms}["layer_activations"]
    assert s1.in_flight == 1 and s1.host_bytes == a0 - a1 > 0
    assert [t.name for t in s1.host_terms] == ["host_offloaded_activations"] and est1.host_bytes_per_node == 8 * s1.host_bytes


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_mtp_layers_are_in_the_fsdp_weights(strategy):
    """Regression (props round): `--use-megatron-fsdp --mtp-num-layers 1` on PP 2 left the MTP block out of
    the last stage's FSDP weights (2,912 bytes for 3,072 parameters). By hand (h 8, one head of 8, ffn 8,
    LayerNorm, no biases, vocabulary 8 padded to 128): a layer is qkv 192 + proj 64 + fc1 64 + fc2 64 +
    two norms 32 = 416; the last stage holds one layer, the final norm 16 and the tied output copy 1,024
    (1,456), and the MTP depth its embedding copy 1,024, enorm and hnorm 32, eh_proj [8, 16] 128, a layer
    416 and its final norm 16 (1,616): 3,072 BF16 weights, unsharded with DP 1."""
    flags = ("--transformer-impl transformer_engine --num-layers 2 --hidden-size 8 --num-attention-heads 1 "
             "--kv-channels 8 --ffn-hidden-size 8 --seq-length 16 --max-position-embeddings 16 --micro-batch-size 1 "
             "--global-batch-size 1 --pipeline-model-parallel-size 2 --tokenizer-type NullTokenizer --vocab-size 8 "
             "--bf16 --position-embedding-type rope --disable-bias-linear --mtp-num-layers 1 --use-megatron-fsdp --ckpt-format fsdp_dtensor "
             f"--data-parallel-sharding-strategy {strategy}").split()
    last = estimate(layout_from_flags(flags, world_size=2)).stages[1]
    assert last.parameters == 3_072
    assert last.breakdown["fsdp_parameters"] == 2 * 3_072


def test_hybrid_fsdp_shards_the_optimizer_over_all_replicas():
    """--num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim (HFSDP, 0.16.1 and 0.19.2
    param_and_grad_buffer.py): the helper buffers of weights and gradients are sharded over one replica
    (8 / 2 = 4 ranks), main weights and Adam over all 8; buckets padded for all 8 as without HSDP. Per rank:
    weights and gradients on 2 x SHARD elements, the optimizer on SHARD (measured on the CPU referee:
    tests/test_referee_fsdp_stored.py, fsdp_dense_hfsdp)."""
    _, t = terms(FSDP + ["--num-distributed-optimizer-instances", "2", "--outer-dp-sharding-strategy", "optim"])
    assert t["fsdp_parameters"] == t["fsdp_gradients"] == 2 * 2 * SHARD
    assert t["main_parameters"] == t["adam_exp_avg"] == t["adam_exp_avg_sq"] == 4 * SHARD
    # plain HSDP: everything over the replica's 4 ranks, buckets padded for 4: units 218,136,576 (a multiple
    # of 4 x 28672 too), the group outside units 1,050,677,248 -> 1,050,689,536 (4 x 4096)
    _, t = terms(FSDP + ["--num-distributed-optimizer-instances", "2"])
    assert t["main_parameters"] == 4 * (32 * 218_136_576 // 4 + 1_050_689_536 // 4)
    with pytest.raises((ConfigError, ConfigErrors), match="--outer-dp-sharding-strategy"):
        layout_from_flags(BASE + FSDP + ["--num-distributed-optimizer-instances", "2", "--outer-dp-sharding-strategy",
                                         "optim", "--data-parallel-sharding-strategy", "optim_grads"], world_size=8)


_PIN_DTENSOR = """
import sys, tempfile, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
store_dir = tempfile.TemporaryDirectory()   # (the store's file is removed with it at exit)
dist.init_process_group("gloo", store=dist.FileStore(store_dir.name + "/store", 1), rank=0, world_size=1)
p = distribute_tensor(torch.zeros(8, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
try:
    p.detach().clone().cpu().pin_memory()
except RuntimeError as e:
    print(str(e).splitlines()[0])
dist.destroy_process_group()
"""


def test_optimizer_offload_cannot_pin_fsdp_parameters():
    """HybridDeviceOptimizer._get_sub_optimizer_param_groups (hybrid_optimizer.py line 274, core 0.16.1 and 0.19.2)
    moves each offloaded parameter to the host as param.detach().clone().cpu().pin_memory(). Under Megatron-FSDP
    (make_fsdp_dtensor, param_and_grad_buffer.py) and torch FSDP2 the optimizer's parameters are DTensors, and
    torch's DTensor has no sharding rule for pinning: the optimizer cannot be built."""
    import sys

    from build_util import run_script   # (through the fork server: torch imported once)
    pytest.importorskip("torch.distributed.tensor")
    out = run_script([sys.executable, "-c", _PIN_DTENSOR], timeout=120)
    assert "NYI: aten._pin_memory.default" in out.stdout, out.stderr[-500:]
    offload = ["--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"]
    fsdp = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params", "--ckpt-format",
            "fsdp_dtensor", "--use-distributed-optimizer"]
    with pytest.raises((ConfigError, ConfigErrors), match="--optimizer-cpu-offload.*DTensor"):
        layout_from_flags(BASE + fsdp + offload, world_size=8)
    with pytest.raises((ConfigError, ConfigErrors), match="--optimizer-cpu-offload.*torch FSDP2"):
        layout_from_flags(BASE + ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"] + offload, world_size=8)


def test_optimizer_offload_fraction_0_under_fsdp():
    """Fraction 0 offloads nothing (no pinning). HybridDeviceOptimizer._get_sub_optimizer_param_groups and
    _set_sub_optimizer_grads (hybrid_optimizer.py, core 0.16.1 and 0.19.2) clone only non-fp32 parameters to fp32
    and hand gradients only to those clones; Megatron-FSDP's fp32 main weights reach TE FusedAdam as they are, which
    reads p.grad (use_decoupled_grad defaults to False, fused_adam.py TE 2.20.2) while Megatron-FSDP under the
    precision-aware optimizer fills param.decoupled_grad only (param_and_grad_buffer.py update_main_grads, 0.16.1
    and 0.19.2; Bridge 0.6.2 config.py sets megatron_fsdp_use_decoupled_grad=True): nothing would be updated."""
    zero = ["--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0"]
    fsdp = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params", "--ckpt-format",
            "fsdp_dtensor", "--use-distributed-optimizer"]
    for version in ("0.16.1", "0.19.2"):
        with pytest.raises((ConfigError, ConfigErrors), match="--optimizer-cpu-offload.*decoupled_grad"):
            layout_from_flags(BASE + fsdp + zero, world_size=8, megatron_version=version)
    # bf16 main weights get the hybrid optimizer's fp32 clones (which do receive decoupled_grad): runs, not modelled
    with pytest.raises(NotModelledError, match="--optimizer-offload-fraction"):
        layout_from_flags(BASE + fsdp + zero + ["--megatron-fsdp-main-params-dtype", "bf16"], world_size=8,
                          megatron_version="0.19.2")
    with pytest.raises(NotModelledError, match="--optimizer-offload-fraction.*torch FSDP2"):
        layout_from_flags(BASE + ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"] + zero, world_size=8)


def test_core_0_17_and_0_18_main_grads_by_hand():
    """megatron-core 0.17.1 mcore_fsdp_adapter.py (and 0.18.2's): MixedPrecisionPolicy(main_params_dtype=
    --megatron-fsdp-main-params-dtype, main_grads_dtype=torch.float32 if grad_reduce_in_fp32 else
    --megatron-fsdp-main-grads-dtype). bf16 turns --accumulate-allreduce-grads-in-fp32 on (validate_args, main
    grads dtype fp32 by default), so the main gradients are fp32: 4 B per element; 0.19.2 ignores that flag (2 B).
    NullTokenizer up to 0.17 adds one token (the 0.16.1 shard above); 0.18 keeps 0.19's vocabulary."""
    shard17 = 32 * 218_136_576 // 8 + 1_051_754_496 // 8
    _, t = terms(FSDP + ["--use-distributed-optimizer", "--data-parallel-sharding-strategy", "optim_grads_params"],
                 version="0.17.1")
    assert t["fsdp_gradients"] == 4 * shard17 and t["fsdp_parameters"] == 2 * shard17
    _, t = terms(FSDP + ["--data-parallel-sharding-strategy", "optim_grads_params"], version="0.18.2")
    assert t["fsdp_gradients"] == 4 * SHARD
    _, t = terms(FSDP + ["--data-parallel-sharding-strategy", "optim_grads_params"], version="0.19.2")
    assert t["fsdp_gradients"] == 2 * SHARD
    # --grad-reduce-in-bf16 turns the fp32 accumulation off: "auto" = the parameter dtype (bf16), and 0.17.1 reads
    # --megatron-fsdp-main-params-dtype (0.16.1 has no such flag and keeps fp32 main weights)
    _, t = terms(FSDP + ["--use-distributed-optimizer", "--grad-reduce-in-bf16", "--megatron-fsdp-main-params-dtype",
                         "auto", "--data-parallel-sharding-strategy", "optim_grads_params"], version="0.17.1")
    assert t["fsdp_gradients"] == 2 * shard17 and "main_parameters" not in t


def test_core_0_17_megatron_fsdp_rules():
    # 0.17.1 validate_args: assert args.ckpt_format == "fsdp_dtensor" (the default is torch_dist), and no
    # switch of --use-distributed-optimizer (0.18.2 adds it)
    with pytest.raises((ConfigError, ConfigErrors), match="--ckpt-format fsdp_dtensor"):
        layout_from_flags(BASE + ["--use-megatron-fsdp", "--use-distributed-optimizer"], world_size=8,
                          megatron_version="0.17.1")
    with pytest.raises((ConfigError, ConfigErrors), match="--use-distributed-optimizer"):
        layout_from_flags(BASE + FSDP, world_size=8, megatron_version="0.17.1")
    L = layout_from_flags(BASE + FSDP + ["--use-distributed-optimizer"], world_size=8, megatron_version="0.17.1")
    assert L.to_dict()["data_parallel_sharding_strategy"] == "no_shard"
