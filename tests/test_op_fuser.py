"""--use-transformer-engine-op-fuser: Megatron's rules as one-line errors naming the flag, and the saved
tensors of TE's operation fuser by hand (megatron-core 0.19.2 extensions/transformer_engine.py TEFusedMLP,
transformer/moe/experts.py TEGroupedMLP; TE 2.11 transformer_engine/pytorch/ops/basic/*.py)."""
import os
import sys

import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.layers import mlp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

# A small dense SwiGLU GPT on 8 GPUs: h 512, ffn 1024, seq 1024, mbs 4, no biases
BASE = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
        "--micro-batch-size 4 --global-batch-size 32 --bf16 --position-embedding-type rope --hidden-dropout 0 "
        "--attention-dropout 0 --swiglu --ffn-hidden-size 1024 --disable-bias-linear").split()
FUSER = ["--use-transformer-engine-op-fuser"]
MOE = ("--num-experts 4 --moe-router-topk 1 --moe-router-load-balancing-type sinkhorn --moe-grouped-gemm "
       "--moe-token-dispatcher-type alltoall").split()
CUTEDSL = {"NVTE_CUTEDSL_FUSED_GROUPED_MLP": "1"}


def _layout(flags, world=8, **kw):
    return layout_from_flags(BASE + flags, world_size=world, **kw)


def _err(flags, world=8, **kw):
    with pytest.raises((ConfigError, ConfigErrors, NotModelledError)) as e:
        _layout(flags, world, **kw)
    return str(e.value)


def test_dense_mlp_saves_only_the_activation_input():
    # SwiGLU without --bias-swiglu-fusion: megatron's MLP keeps fc1's output, silu's output and the
    # offset copy (glu), then fc2's input; TEFusedMLP's SwiGLU op keeps only its input (ops/basic/
    # activation.py save_for_backward(x)) and the second BasicLinear its input (basic_linear.py).
    # Tokens s*b = 4096, ffn 1024 on TP 1, bf16: fc1 output 4096 x 2048 x 2 B, fc2 input 4096 x 1024 x 2 B.
    fused = _layout(["--no-bias-swiglu-fusion"] + FUSER)
    assert fused.use_transformer_engine_op_fuser
    assert mlp.activations(fused, set(), 0).saved == {"fc1_output": 4096 * 2048 * 2, "fc2_input": 4096 * 1024 * 2}
    plain = _layout(["--no-bias-swiglu-fusion"])
    assert set(mlp.activations(plain, set(), 0).saved) == {"fc1_output", "activation_gate", "activation_linear",
                                                           "fc2_input"}
    # the whole stage: 4 layers x one micro-batch in flight (PP 1) x the two [4096, 1024] bf16 factors
    a, b = (next(t.bytes for t in estimate(L).stages[-1].terms if t.name == "layer_activations") for L in (plain, fused))
    assert a - b == 4 * 2 * 4096 * 1024 * 2


def test_fused_activation_unchanged_and_parameters_the_same():
    # with the fused bias-SwiGLU the saved tensors are those of the TE modules already; the op fuser
    # shares the modules' parameters (op.weight = self.linear_fc1.weight), adding none
    plain, fused = _layout([]), _layout(FUSER)
    assert mlp.activations(plain, set(), 0) == mlp.activations(fused, set(), 0)
    assert mlp.params(plain) == mlp.params(fused)
    p, f = estimate(plain), estimate(fused)
    assert p.stages[-1].peak_allocated_bytes == f.stages[-1].peak_allocated_bytes


def test_local_spec_ignores_the_flag():
    L = _layout(FUSER + ["--transformer-impl", "local"])
    assert not L.use_transformer_engine_op_fuser
    assert any("--use-transformer-engine-op-fuser" in n and "local" in n for n in L.notes)


def test_rules_and_refusals():
    # TEFusedMLP._make_activation_op (0.19.2): no TE op for squared ReLU (NotImplementedError at first forward)
    no_glu = [f for f in BASE if f != "--swiglu"]
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(no_glu + FUSER + ["--squared-relu"], world_size=8)
    assert "--use-transformer-engine-op-fuser" in str(e.value) and "squared ReLU" in str(e.value)
    # FP8 under the op fuser: a dense model's TEFusedMLP is sized (tests/test_fp8_op_fuser.py), the experts' fused
    # grouped MLP under delayed scaling too (tests/test_fp8_moe_op_fuser.py), and tensorwise
    assert _layout(FUSER + ["--fp8-format", "hybrid"]).use_transformer_engine_op_fuser
    assert _layout(FUSER + MOE + ["--fp8-format", "hybrid"], env=CUTEDSL).use_transformer_engine_op_fuser
    # tensorwise: sized as TE's grouped-tensor GroupedLinear path, with a note (tests/test_fp8_moe_op_fuser.py)
    L = _layout(FUSER + MOE + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"], env=CUTEDSL)
    assert L.use_transformer_engine_op_fuser and any("tensorwise recipe take" in n for n in L.notes)


def test_moe_experts_rules():
    # TEGroupedMLP._is_fused_impl_supported (0.19.2): NVTE_CUTEDSL_FUSED_GROUPED_MLP for the GLU fusion,
    # expert TP 1; otherwise Megatron asserts at build time
    assert "NVTE_CUTEDSL_FUSED_GROUPED_MLP" in _err(MOE + FUSER)
    two = "--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 2".split()
    assert "expert tensor parallel size 1" in _err(MOE + FUSER + two, env=CUTEDSL)
    ok = _layout(MOE + FUSER, env=CUTEDSL)
    assert ok.use_transformer_engine_op_fuser
    # SequentialMLP experts (no --moe-grouped-gemm) never use it
    seq = _layout([f for f in MOE if f != "--moe-grouped-gemm"] + FUSER)
    assert not seq.use_transformer_engine_op_fuser and any("SequentialMLP" in n for n in seq.notes)
    # the flag is in megatron-core 0.18.2's parser, not 0.17.1's (tests/test_flag_releases.py)
    assert "is not a flag of megatron-core 0.16 (added in 0.18)" in _err(MOE + FUSER, megatron_version="0.16")


def test_moe_fused_experts_ignore_moe_act_recompute():
    # the fused path (TEGroupedMLP._fused_forward) never enters the moe_act checkpoint, so fc2's input
    # ([N, F] bf16 per MoE layer) stays saved
    from megatron_memguard.estimator.layers.moe import moe_activations
    rec = "--recompute-granularity selective --recompute-modules moe_act".split()
    unfused = _layout(MOE + rec)
    fused = _layout(MOE + rec + FUSER, env=CUTEDSL)
    a = moe_activations(unfused, unfused.moe, mods={"moe_act"}).saved["moe_expert_activations"]
    b = moe_activations(fused, fused.moe, mods={"moe_act"}).saved["moe_expert_activations"]
    # N = 4096 tokens x top-1 routed to the 4 local experts (EP 1), F = 1024: one [4096, 1024] bf16 more
    assert b - a == 4096 * 1024 * 2


def test_ci_record_with_the_op_fuser():
    # Megatron CI moe/gpt3_mcore_te_tp1_pp1_te_4experts_groupedGEMM_op_fuser (H100, bf16, 4 experts
    # grouped GEMM, NVTE_CUTEDSL_FUSED_GROUPED_MLP=1): measured peak allocated 2.753 GiB
    from accuracy_megatron_ci import evaluate, load_records
    from shared_data import MOE_RECORDS
    rows = [evaluate(r) for r in load_records(MOE_RECORDS) if "op_fuser" in r["id"]]
    assert len(rows) == 1 and rows[0].error is None, [r.error for r in rows]
    assert abs(rows[0].peak_err) <= 0.03 and abs(rows[0].steady_err) <= 0.03


OFFLOAD_FUSED = "--fine-grained-activation-offloading --offload-modules fused_group_mlp".split()


def test_fused_group_mlp_offload():
    # TEGroupedMLP._fused_forward (core 0.19.2 transformer/moe/experts.py): one 'fused_group_mlp' group around the
    # op fuser's call takes what the call saves: fc1's input [N, h] (N = 4096 tokens x top-1, EP 1), fc1's output
    # [N, 2F] and fc2's input [N, F], bf16: 2 x 4096 x (512 + 2048 + 1024) = 29,360,128 B per MoE layer
    G = 2 * 4096 * (512 + 2048 + 1024)
    plain = estimate(_layout(MOE + FUSER, env=CUTEDSL)).stages[-1]
    off = estimate(_layout(MOE + FUSER + OFFLOAD_FUSED, env=CUTEDSL)).stages[-1]
    # 4 layers, PP 1 (the last stage keeps the last layer's group): 3 groups leave
    assert plain.breakdown["moe_layer_activations"] - off.breakdown["moe_layer_activations"] == 3 * G
    # one copy pending and one reloaded ahead (fine_grained_activation_offload.py ChunkOffloadHandler)
    assert off.breakdown["offload_staging"] == 2 * G


def test_fused_group_mlp_rules():
    # TransformerConfig.__post_init__ (core 0.19.2): needs the op fuser, excludes expert_fc1 / moe_act; the name is
    # not an offload module before 0.19 (0.16.1, 0.17.1, 0.18.2 transformer_config.py)
    assert "--use-transformer-engine-op-fuser" in _err(MOE + OFFLOAD_FUSED)
    assert "expert_fc1" in _err(MOE + FUSER + OFFLOAD_FUSED + ["expert_fc1"], env=CUTEDSL)
    assert "0.19" in _err(MOE + FUSER + OFFLOAD_FUSED, env=CUTEDSL, megatron_version="0.18.2")
    # a dense model has no fused grouped MLP: the group offloads nothing (a note says so)
    dense = _layout(FUSER + OFFLOAD_FUSED)
    assert dense.offload_modules == () and any("fused_group_mlp offloads nothing" in n for n in dense.notes)
