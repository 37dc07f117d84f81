"""GPU-only terms whose sizes follow from library source: TE's cached placeholder weight gradients
and the cuBLAS workspaces that --deterministic-mode implies."""
import os
import sys

from megatron_memguard import estimate, layout_from_flags, lookup_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from accuracy_megatron_ci import evaluate, load_records  # noqa: E402

# gpt3_mcore_te_tp2_pp2_resume_torch_dist_defer_embedding_wgrad_compute's model (Megatron-LM CI)
CI = ["--num-layers", "12", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "1024",
      "--max-position-embeddings", "1024", "--micro-batch-size", "4", "--global-batch-size", "32", "--bf16",
      "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--vocab-size", "50257"]


def _term(stage, name):
    return sum(t.bytes for t in stage.terms if t.name == name)


def test_dummy_wgrads_one_per_weight_shape():
    est = estimate(layout_from_flags(CI, world_size=8), gpu=lookup_gpu("H100-80GB"))
    V = est.layout.padded_vocab_size
    # bf16 [rows, cols] per TP rank: qkv [3*512/2, 512], proj [512, 256], fc1 [2048/2, 512], fc2 [512, 1024]
    layers = (768 * 512 + 512 * 256 + 1024 * 512 + 512 * 1024) * 2
    assert _term(est.stages[0], "dummy_wgrads") == layers                          # 3 MiB, however many layers
    assert _term(est.stages[1], "dummy_wgrads") == layers + V // 2 * 512 * 2       # + the output layer [V/2, 512]
    off = estimate(layout_from_flags(CI + ["--no-gradient-accumulation-fusion"], world_size=8), gpu=lookup_gpu("H100-80GB"))
    assert _term(off.stages[1], "dummy_wgrads") == 0
    cpu = estimate(layout_from_flags(CI, world_size=8), device="cpu")
    assert _term(cpu.stages[1], "dummy_wgrads") == 0                              # no TE on the CPU referee


def test_megatron_ci_records_with_gradient_accumulation_fusion():
    # The only CI test that keeps fusion on: its goldens since megatron-core 0.14 (H100, A100, GB200,
    # clean and resumed runs) keep 26.6-27.6 MiB more after the step than the twin without fusion.
    rows = [evaluate(r) for r in load_records(include_flagged=True)
            if "defer_embedding_wgrad" in r["id"] and r["golden_last_commit_date"] >= "2025-11"]
    assert len(rows) >= 7
    for r in rows:
        assert abs(r.steady_err) <= 0.01, (r.id, r.steady_err)


def test_deterministic_mode_implies_the_deterministic_cublas_workspace():
    # A100: PyTorch's default workspace is 2 x 4 MiB + 8 x 16 KiB; --deterministic-mode sets
    # CUBLAS_WORKSPACE_CONFIG=:4096:8 (8 x 4 MiB) when unset (megatron/training/determinism.py)
    a100 = lookup_gpu("A100-80GB")
    plain = estimate(layout_from_flags(CI, world_size=8), gpu=a100)
    det = estimate(layout_from_flags(CI + ["--deterministic-mode"], world_size=8), gpu=a100)
    assert _term(plain.stages[0], "cublas_workspaces") == 2 * (2 * 4 * 2**20 + 8 * 16 * 1024)
    assert _term(det.stages[0], "cublas_workspaces") == 2 * 8 * 4 * 2**20
    explicit = estimate(layout_from_flags(CI + ["--deterministic-mode"], world_size=8,
                                          env={"CUBLAS_WORKSPACE_CONFIG": ":16:8"}), gpu=a100)
    assert _term(explicit.stages[0], "cublas_workspaces") == 2 * 8 * 16 * 1024


def test_dummy_wgrads_on_a_stage_without_layers():
    # --pipeline-model-parallel-layout "Etttt|L": the last stage holds only the output layer
    est = estimate(layout_from_flags(CI[:1] + ["4"] + CI[2:] + ["--pipeline-model-parallel-layout", "Etttt|L"],
                                     world_size=8), gpu=lookup_gpu("H100-80GB"))
    assert est.stages[1].num_layers == 0
    assert _term(est.stages[1], "dummy_wgrads") == est.layout.padded_vocab_size // 2 * 512 * 2


def test_replicated_gradients_all_reduced_after_the_backward():
    # finalize_model_grads flattens the gradients every TP rank holds whole (sequence_parallel params)
    # into one buffer. MLA with wide latents and a short sequence: that buffer is the peak.
    h, ql, kvl, pe = 4096, 4096, 4096, 64
    flags = ["--num-layers", "8", "--hidden-size", str(h), "--num-attention-heads", "32", "--multi-latent-attention",
             "--q-lora-rank", str(ql), "--kv-lora-rank", str(kvl), "--qk-pos-emb-head-dim", str(pe),
             "--normalization", "RMSNorm", "--disable-bias-linear", "--seq-length", "64", "--micro-batch-size", "1",
             "--bf16", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--vocab-size", "1000",
             "--tokenizer-type", "NullTokenizer"]
    stage = estimate(layout_from_flags(flags, world_size=2), gpu=lookup_gpu("H100-80GB")).stages[0]
    # per layer: q down [4096, 4096], kv down [4096 + 64, 4096], input norm and fc1 norm; + final norm;
    # fp32 main gradients
    assert stage.peak_phase == "finalize_model_grads"
    assert _term(stage, "replicated_grad_allreduce") == (8 * (ql * h + (kvl + pe) * h + 2 * h) + h) * 4
    no_sp = estimate(layout_from_flags([f for f in flags if f != "--sequence-parallel"], world_size=2),
                     gpu=lookup_gpu("H100-80GB")).stages[0]
    assert _term(no_sp, "replicated_grad_allreduce") == 0


def test_deterministic_mode_refuses_other_cublas_workspaces_since_0_19():
    # megatron/training/determinism.py (0.19): only :4096:8 and :16:8 are deterministic
    import pytest
    from megatron_memguard.errors import ConfigError
    flags = CI + ["--deterministic-mode"]
    with pytest.raises(ConfigError, match="--deterministic-mode: needs CUBLAS_WORKSPACE_CONFIG"):
        layout_from_flags(flags, world_size=8, env={"CUBLAS_WORKSPACE_CONFIG": ":1024:2"})
    assert layout_from_flags(flags, world_size=8, megatron_version="0.16", env={"CUBLAS_WORKSPACE_CONFIG": ":1024:2"})


def test_moe_only_workspaces_stay_off_a_stage_without_moe_layers():
    """An MoE model whose first pipeline stage holds only dense layers (--moe-layer-freq ([0]*2+[1]*2), PP 2):
    TE allocates its multi-stream grouped-GEMM workspaces on the first grouped GEMM (cpp_extensions/gemm.py
    get_cublas_workspace, TE 2.11) and DeepEP its buffer on the first dispatch (moe/fused_a2a.py get_buffer,
    core 0.19.2), so only the MoE stage holds them: 4 x (32 MiB + 1 KiB) on an H100, and DeepEP's buffer."""
    flags = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--ffn-hidden-size", "1024",
             "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "1",
             "--global-batch-size", "8", "--pipeline-model-parallel-size", "2", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "1000", "--bf16", "--disable-bias-linear", "--position-embedding-type", "rope",
             "--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "4",
             "--moe-ffn-hidden-size", "256", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "flex",
             "--moe-flex-dispatcher-backend", "deepep", "--moe-layer-freq", "([0]*2+[1]*2)"]
    est = estimate(layout_from_flags(flags, world_size=8), gpu=lookup_gpu("H100-80GB"))
    dense_stage, moe_stage = (s.breakdown for s in est.stages)
    assert moe_stage["te_grouped_gemm_workspaces"] == 4 * (32 * 2**20 + 1024)
    assert moe_stage["deepep_buffer"] > 0
    assert "te_grouped_gemm_workspaces" not in dense_stage and "deepep_buffer" not in dense_stage
    # every MoE layer on one stage, or an MTP layer (the last decoder layer's kind) there: both stages hold them
    for extra in (["--moe-layer-freq", "1"], ["--moe-layer-freq", "([1]*2+[0]*1+[1]*1)"]):
        est = estimate(layout_from_flags(flags[:-2] + extra, world_size=8), gpu=lookup_gpu("H100-80GB"))
        assert all(s.breakdown["te_grouped_gemm_workspaces"] == 4 * (32 * 2**20 + 1024) for s in est.stages)
    mtp = flags[:-2] + ["--moe-layer-freq", "([1]*2+[0]*1+[1]*1)", "--pipeline-model-parallel-layout", "Etttt|mL",
                        "--mtp-num-layers", "1"]
    est = estimate(layout_from_flags(mtp, world_size=8), gpu=lookup_gpu("H100-80GB"))
    assert est.stages[1].num_layers == 0 and est.stages[1].breakdown["te_grouped_gemm_workspaces"] > 0



# PP 2 with the first two of four layers dense (--moe-layer-freq), EP 4 on 16 GPUs
DENSE_FIRST_MOE_PP2 = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--ffn-hidden-size", "1024",
                       "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "1",
                       "--global-batch-size", "16", "--pipeline-model-parallel-size", "2", "--tokenizer-type", "NullTokenizer",
                       "--vocab-size", "1000", "--bf16", "--disable-bias-linear", "--position-embedding-type", "rope",
                       "--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "4",
                       "--moe-ffn-hidden-size", "256", "--moe-grouped-gemm", "--moe-layer-freq", "([0]*2+[1]*2)"]

def test_a_stage_without_moe_layers_has_no_expert_parallel_communicators():
    """NCCL makes a group's communicator and its channel buffers at the first collective on it (Megatron passes
    no device_id to init_process_group: megatron/training/initialize.py, core 0.19.2). A stage without MoE layers
    never dispatches over EP and has no expert parameters, so no expert DDP buffer and no expert optimizer
    (distributed_data_parallel.py, optimizer/__init__.py ``if len(moe_param_groups) > 0``, 0.16.1 and 0.19.2).
    World 16, PP 2, EP 4: DP 8, expert DP 2. MoE stage: PP, DP-CP, EP, EXPERT-DP; dense stage: PP, DP-CP;
    16 channels x 2 x 4 MiB = 128 MiB each."""
    flags = DENSE_FIRST_MOE_PP2
    est = estimate(layout_from_flags(flags, world_size=16), gpu=lookup_gpu("H100-80GB"))
    dense_stage, moe_stage = est.stages
    assert moe_stage.breakdown["nccl_buffers"] == 4 * 128 * 2**20
    assert dense_stage.breakdown["nccl_buffers"] == 2 * 128 * 2**20
    detail = next(t.detail for t in dense_stage.terms if t.name == "nccl_buffers")
    assert "(PP, DP-CP;" in detail and "no EP, EXPERT-DP" in detail
    every = estimate(layout_from_flags(flags[:-2] + ["--moe-layer-freq", "1"], world_size=16), gpu=lookup_gpu("H100-80GB"))
    assert all(s.breakdown["nccl_buffers"] == 4 * 128 * 2**20 for s in every.stages)


def test_calibration_counts_the_observed_stages_communicators():
    """A device-level calibration row counts the NCCL communicators of the rank it was measured on: on the
    dense stage of the model above (PP 2, EP 4, world 16) PP and DP-CP (2), on the MoE stage 4 (with EP and
    EXPERT-DP), as the estimate's nccl_buffers term does."""
    from megatron_memguard.calibrate.model import CalibrationRun, Observation, device_rows
    flags = DENSE_FIRST_MOE_PP2
    run = CalibrationRun("moe", layout_from_flags(flags, world_size=16), lookup_gpu("H100-80GB"),
                         [Observation(rank=0, pp_rank=0, reserved=1, device_used=2),
                          Observation(rank=15, pp_rank=1, reserved=1, device_used=2)])
    assert [r.a[1] for r in device_rows([run])] == [2.0, 4.0]


def test_dummy_wgrads_of_the_mtp_block():
    """The MTP block's linears fill TE's placeholder cache too: its layer's (the last decoder layer's kind) and
    eh_proj, a bias-free column-parallel [2h -> h] linear whose weight is [h/TP, 2h] per rank
    (multi_token_prediction.py MultiTokenPredictionLayer.__init__, megatron-core 0.16.1 and 0.19.2; TE's
    get_dummy_wgrad caches per (shape, dtype): transformer_engine/pytorch/module/base.py). On a '|mL' chunk (no
    decoder layer) the MTP layer's shapes are the only layer shapes there."""
    h100 = lookup_gpu("H100-80GB")
    # bf16 [rows, cols] per TP rank as in test_dummy_wgrads_one_per_weight_shape
    layers = (768 * 512 + 512 * 256 + 1024 * 512 + 512 * 1024) * 2
    eh_proj = 256 * 1024 * 2                                                       # [512/2, 2 x 512]
    for era in ("0.16", "0.19"):
        flags = CI[:1] + ["4"] + CI[2:] + ["--position-embedding-type", "rope", "--mtp-num-layers", "1"]
        mtp_last = estimate(layout_from_flags(flags, world_size=8, megatron_version=era), gpu=h100)
        V = mtp_last.layout.padded_vocab_size
        assert _term(mtp_last.stages[0], "dummy_wgrads") == layers                 # no MTP block on stage 0
        assert _term(mtp_last.stages[1], "dummy_wgrads") == layers + eh_proj + V // 2 * 512 * 2
        only_mtp = estimate(layout_from_flags(flags + ["--pipeline-model-parallel-layout", "Etttt|mL"],
                                              world_size=8, megatron_version=era), gpu=h100)
        assert only_mtp.stages[1].num_layers == 0
        assert _term(only_mtp.stages[1], "dummy_wgrads") == layers + eh_proj + V // 2 * 512 * 2
        standalone = estimate(layout_from_flags(flags[:-2] + ["--mtp-num-layers", "1", "--pipeline-model-parallel-size",
                                                               "3", "--pipeline-model-parallel-layout", "Etttt|m|L"],
                                                world_size=12, megatron_version=era), gpu=h100)
        # the MTP stage: its layer's shapes and eh_proj, no output layer; the loss stage: the output layer only
        assert _term(standalone.stages[1], "dummy_wgrads") == layers + eh_proj
        assert _term(standalone.stages[2], "dummy_wgrads") == V // 2 * 512 * 2
