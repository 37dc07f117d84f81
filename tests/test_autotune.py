"""The framework-free autotuner: MBS down, PP up, Megatron's rules kept, Fujii et al.'s order."""
import pytest

from conftest import LLAMA31_8B
from megatron_memguard import estimate, lookup_gpu, resolve
from megatron_memguard.autotune import autotune
from megatron_memguard.errors import ConfigError, ConfigErrors, MemguardError
from megatron_memguard.readers.megatron_flags import parse_megatron_flags
from megatron_memguard.units import GiB, format_bytes

H100 = lookup_gpu("H100")


def raw_of(*extra):
    return parse_megatron_flags(LLAMA31_8B + [str(x) for x in extra])


def test_fits_already_changes_nothing():
    r = autotune(raw_of("--micro-batch-size", 1, "--tensor-model-parallel-size", 8), world_size=16, gpu=H100)
    assert r.status == "fits" and r.chosen is None and not r.changes


def test_mbs_down_pp_up_and_defaulted_gbs_pinned():
    raw = raw_of("--micro-batch-size", 4, "--tensor-model-parallel-size", 2)
    r = autotune(raw, world_size=16, gpu=H100)
    assert r.status == "changed"
    L = r.chosen.layout
    assert r.changes["global_batch_size"] == (None, 32)           # MBS 4 x DP 8, pinned
    assert L.global_batch_size == 32
    assert L.micro_batch_size < 4 and L.pp >= 1
    assert r.chosen.estimate.verdict == "fits"
    # The updates, applied to the raw config, resolve to the same layout (what the hook relies on).
    again = resolve(raw.with_args(**r.updates), world_size=16)
    assert again.micro_batch_size == L.micro_batch_size and again.pp == L.pp and again.global_batch_size == 32
    assert "micro-batch size 4 -> " in r.summary() and "pinned at 32" in r.summary()


def test_order_is_least_pipeline_then_largest_micro_batch():
    """Brute force every (PP, MBS) candidate independently: the chosen one is the first that fits."""
    raw = raw_of("--micro-batch-size", 4, "--global-batch-size", 64, "--tensor-model-parallel-size", 2)
    r = autotune(raw, world_size=16, gpu=H100)
    fitting = []
    for pp in (1, 2, 4, 8):
        for mbs in (4, 3, 2, 1):
            try:
                L = resolve(raw.with_args(micro_batch_size=mbs, pipeline_model_parallel_size=pp), world_size=16)
            except (ConfigError, ConfigErrors):
                continue
            if estimate(L, gpu=H100).verdict == "fits":
                fitting.append((pp, -mbs))
    assert fitting, "test setup: something must fit"
    pp, neg_mbs = min(fitting)
    assert (r.chosen.layout.pp, r.chosen.layout.micro_batch_size) == (pp, -neg_mbs)


def test_explicit_gbs_is_kept_and_divisible():
    raw = raw_of("--micro-batch-size", 4, "--global-batch-size", 32, "--tensor-model-parallel-size", 2)
    r = autotune(raw, world_size=16, gpu=H100)
    L = r.chosen.layout
    assert "global_batch_size" not in r.changes and L.global_batch_size == 32
    assert 32 % (L.micro_batch_size * L.dp) == 0
    assert any("not divisible by MBS x DP" in why for _, why in r.rejected)


def test_deterministic():
    raw = raw_of("--micro-batch-size", 4, "--tensor-model-parallel-size", 2)
    a = autotune(raw, world_size=16, gpu=H100)
    b = autotune(raw, world_size=16, gpu=H100)
    assert a.changes == b.changes and a.reasons == b.reasons


def test_explicit_pipeline_layout_keeps_pp():
    raw = raw_of("--micro-batch-size", 4, "--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2,
                 "--pipeline-model-parallel-layout", "Et*16|t*16L")
    r = autotune(raw, world_size=16, gpu=H100)
    assert any("encodes PP 2" in line for line in r.reasons)
    if r.chosen is not None:
        assert r.chosen.layout.pp == 2 and "pipeline_model_parallel_size" not in r.changes


def test_checkpoint_that_cannot_be_resharded_keeps_pp():
    raw = raw_of("--micro-batch-size", 4, "--tensor-model-parallel-size", 2, "--load", "/ckpt", "--ckpt-format", "torch")
    r = autotune(raw, world_size=16, gpu=H100)
    assert any("cannot be resharded" in line for line in r.reasons)
    assert r.chosen is None or r.chosen.layout.pp == 1


def test_interleaved_rules_hold_for_the_chosen_layout():
    # 32 layers, VPP via 2 layers per virtual stage; GBS 16 with DP shrinking as PP grows.
    raw = raw_of("--micro-batch-size", 2, "--global-batch-size", 16, "--tensor-model-parallel-size", 2,
                 "--pipeline-model-parallel-size", 2, "--num-layers-per-virtual-pipeline-stage", 2)
    r = autotune(raw, world_size=16, gpu=H100, threshold=0.65)
    assert r.chosen is not None, r.summary()
    L = r.chosen.layout
    m, pp, g = L.num_microbatches, L.pp, L.microbatch_group_size_per_vp_stage or L.pp
    if L.vpp > 1:
        assert pp <= g <= m and (m % g == 0 or m % g >= pp)
        assert (L.num_layers // pp) % 2 == 0
    # every rejection names a rule
    assert all(why for _, why in r.rejected)


def test_uneven_first_last_stage_counts_are_respected():
    # 32 layers on PP3 as 10 | 12 | 10; world 24 with TP2 allows PP 3, 4, 6, 12.
    raw = raw_of("--micro-batch-size", 4, "--global-batch-size", 48, "--tensor-model-parallel-size", 2,
                 "--pipeline-model-parallel-size", 3, "--decoder-first-pipeline-num-layers", 10,
                 "--decoder-last-pipeline-num-layers", 10)
    r = autotune(raw, world_size=24, gpu=H100)
    assert r.chosen is not None
    L = r.chosen.layout
    assert L.decoder_first_pipeline_num_layers == 10 and (32 - 20) % (L.pp - 2) == 0
    # Nothing stays within 5%: the search walks every PP; PP 12 leaves 12 layers for 10 middle stages.
    none = autotune(raw, world_size=24, gpu=H100, threshold=0.05)
    assert none.status in ("tight", "impossible")
    assert any("PP 12" in cand and "middle" in why for cand, why in none.rejected)


def test_recompute_only_when_allowed():
    # TP8 on 8 GPUs leaves no room for PP and MBS is 1 already: 64k tokens only fit with recomputation.
    raw = raw_of("--micro-batch-size", 1, "--tensor-model-parallel-size", 8, "--sequence-parallel",
                 "--seq-length", 65536, "--max-position-embeddings", 65536)
    without = autotune(raw, world_size=8, gpu=H100)
    assert without.chosen is None and without.status in ("tight", "impossible")
    assert any("--memguard-allow-recompute" in line for line in without.reasons)
    with_rc = autotune(raw, world_size=8, gpu=H100, allow_recompute=True)
    assert with_rc.status == "changed"
    # the recompute ladder's first rung that fits: selective recompute of the MLP, not full recompute. What it
    # frees by hand (TE's LayerNormLinear keeps the norm output; SwiGLU): per layer and rank, fc1's input h, its
    # output 2F and the SwiGLU output F (bf16) for 65,536 / TP 8 = 8,192 tokens, less the checkpoint's input h:
    # 3F x 2 B x 8,192 = 704.6 MB x 32 layers = 21.0 GiB
    assert with_rc.changes["recompute_granularity"] == (None, "selective")
    assert with_rc.changes["recompute_modules"] == (None, ["mlp"])
    assert with_rc.chosen.layout.recompute_method is None and with_rc.chosen.layout.recompute_modules == ("mlp",)
    freed = with_rc.original.peak_device_bytes - with_rc.chosen.estimate.peak_device_bytes
    assert abs(freed - 3 * 14336 * 2 * 8192 * 32) < 0.1 * freed
    assert with_rc.considered >= 2  # the layout itself, then the first rung


def test_accept_veto_moves_to_the_next_candidate():
    raw = raw_of("--micro-batch-size", 4, "--tensor-model-parallel-size", 2)
    first = autotune(raw, world_size=16, gpu=H100)
    vetoed = dict(first.updates)
    second = autotune(raw, world_size=16, gpu=H100, accept=lambda u: "vetoed by the test" if dict(u) == vetoed else None)
    assert second.chosen is not None and second.updates != vetoed
    assert any("vetoed by the test" in why for _, why in second.rejected)


def test_rampup_steps_must_stay_divisible():
    raw = raw_of("--micro-batch-size", 4, "--global-batch-size", 64, "--tensor-model-parallel-size", 2,
                 "--rampup-batch-size", "8", "8", "1000")
    r = autotune(raw, world_size=16, gpu=H100)
    if r.chosen is not None:
        L = r.chosen.layout
        assert all(g % (L.micro_batch_size * L.dp) == 0 for g in range(8, 65, 8))


def test_a_tight_layout_is_never_chosen():
    # Llama-3.1-8B on 8 H100s with MBS 4 (issue 20): no micro-batch / pipeline size stays within 80%; the best,
    # MBS 1 on PP 8, is tight. autotune must not start it: impossible, with the nearest layouts and what fits.
    raw = raw_of("--micro-batch-size", 4)
    r = autotune(raw, world_size=8, gpu=H100)
    assert r.status == "impossible" and r.chosen is None and not r.changes
    peaks = [c.estimate.peak_device_bytes for c in r.nearest]
    assert peaks == sorted(peaks) and len(peaks) == 3
    # the nearest is the lowest peak of every valid MBS / PP pair (GBS pinned at MBS 4 x DP 8 = 32)
    every = [estimate(resolve(raw.with_args(micro_batch_size=m, pipeline_model_parallel_size=p, global_batch_size=32),
                              world_size=8), gpu=H100).peak_device_bytes
             for p in (1, 2, 4, 8) for m in (1, 2, 3, 4) if 32 % (m * (8 // p)) == 0]
    assert peaks[0] == min(every) and 0.8 < r.nearest[0].fraction <= 1.0      # tight: over 80%, within the GPU
    assert r.nearest[0].layout.micro_batch_size == 1 and r.nearest[0].layout.pp == 8
    assert any(line.startswith("nearest: MBS 1, PP 8") for line in r.reasons)
    # what would fit: recomputation (not allowed here); the same search with it allowed agrees
    assert r.hints and r.hints[0].startswith("with activation recomputation (--memguard-allow-recompute): ")
    allowed = autotune(raw, world_size=8, gpu=H100, allow_recompute=True)
    assert allowed.status == "changed" and allowed.chosen.fraction <= 0.8
    assert allowed.chosen.describe() in r.hints[0]


def test_tight_input_is_not_kept_and_more_gpus_are_suggested():
    raw = raw_of("--micro-batch-size", 1, "--global-batch-size", 8, "--tensor-model-parallel-size", 8)
    # 8 GPUs: TP8 leaves no room for PP; give just enough memory that the layout itself is tight.
    need = estimate(resolve(raw, world_size=8), gpu=H100).peak_device_bytes
    E = estimate(resolve(raw, world_size=8), gpu_memory=int(need / 0.9), threshold=0.8)
    tight = autotune(raw, world_size=8, gpu_memory=int(need / 0.9), threshold=0.8)
    assert E.verdict == "tight" and tight.status == "impossible" and tight.chosen is None
    assert tight.nearest[0].changes == {} and tight.nearest[0].estimate.peak_device_bytes == E.peak_device_bytes
    # twice the GPUs allow PP 2, which halves the layers per stage: the hint names it, and it fits
    two = autotune(raw, world_size=16, gpu_memory=int(need / 0.9), threshold=0.8)
    assert two.status == "changed" and two.chosen.layout.pp == 2
    assert tight.hints[0].startswith("with activation recomputation (--memguard-allow-recompute): MBS 1, PP 1")
    assert tight.hints[1] == (f"on 16 GPUs (2x as many): {two.chosen.describe()}, "
                              f"{format_bytes(two.chosen.estimate.peak_device_bytes)} = {two.chosen.fraction:.0%}")
    impossible = autotune(raw, world_size=8, gpu_memory=int(need / 1.5), threshold=0.8)
    assert impossible.status == "impossible" and impossible.chosen is None


def test_unknown_gpu_memory_is_an_error():
    with pytest.raises(MemguardError):
        autotune(raw_of("--micro-batch-size", 4), world_size=8)


def test_step_batch_size_schedule_is_left_alone():
    raw = raw_of("--micro-batch-size", 4, "--tensor-model-parallel-size", 2).with_args(step_batch_size_schedule="0:16,100:32")
    r = autotune(raw, world_size=16, gpu=H100)
    assert r.status == "impossible" and "step-batch-size-schedule" in r.reasons[0]


def test_gib_sanity():
    raw = raw_of("--micro-batch-size", 4, "--tensor-model-parallel-size", 2)
    r = autotune(raw, world_size=16, gpu=H100)
    assert r.chosen.estimate.peak_device_bytes <= 0.8 * H100.memory_bytes < 80 * GiB


def test_hint_when_neither_recomputation_nor_more_gpus_alone_fits():
    # Llama-3.1-70B at TP8 on 8 H100s: PP stays 1 (8 / TP8), so only recomputation could help here, and it does
    # not (full recompute still keeps 80 layers' inputs, ~168 GiB); more GPUs without recomputation do not either
    # (at most PP8 on 64 GPUs, 8 micro-batches of 10 layers in flight on the first stage). Both together do:
    # the hint names that layout, and the search it names agrees.
    from conftest import LLAMA31_70B
    raw = parse_megatron_flags(LLAMA31_70B + ["--micro-batch-size", "1", "--tensor-model-parallel-size", "8",
                                              "--global-batch-size", "64"])
    r = autotune(raw, world_size=8, gpu=H100)
    assert r.status == "impossible" and len(r.hints) == 1
    assert autotune(raw, world_size=8, gpu=H100, allow_recompute=True).status == "impossible"
    assert all(autotune(raw, world_size=8 * k, gpu=H100).chosen is None for k in (2, 4, 8))
    k = next(k for k in (2, 4, 8) if autotune(raw, world_size=8 * k, gpu=H100, allow_recompute=True).chosen)
    c = autotune(raw, world_size=8 * k, gpu=H100, allow_recompute=True).chosen
    assert r.hints[0] == (f"on {8 * k} GPUs ({k}x as many) with activation recomputation (--memguard-allow-recompute): "
                          f"{c.describe()}, {format_bytes(c.estimate.peak_device_bytes)} = "
                          f"{c.estimate.peak_device_bytes / c.estimate.gpu_memory_bytes:.0%}")
