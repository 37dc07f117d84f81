"""TP communication overlap: the userbuffers Transformer Engine allocates, hand-computed.

Sources: megatron/training/initialize.py ``_initialize_tp_communicators`` (megatron-core 0.19.2): shape
[seq_length * micro_batch_size // CP, hidden_size], modes [FP8] with --fp8-format (+ [NONE] with
--first-last-layers-bf16), no dtype passed (TE's default bf16). transformer_engine/pytorch/module/base.py
``initialize_ub`` (TE 2.11): twelve GEMMs, their methods, fp8_buf = the all-gather GEMMs (+ a pipeline GEMM
whose config asks), the dgrad reduce-scatter rewrite. TE's CommOverlapP2PBase: a ring-exchange
reduce-scatter keeps 2 TP - 1 chunks of rows / TP rows; every other buffer the whole shape.
"""
import pytest

from megatron_memguard.config import RawConfig
from megatron_memguard.errors import ConfigError, ConfigErrors
from megatron_memguard.estimator import estimate
from megatron_memguard.estimator.userbuffers import ub_gemms, userbuffer_bytes, userbuffers
from megatron_memguard.resolve import resolve

# Llama-3-8B shape (hidden 4096, 32 heads), sequence 8192, micro-batch 1, TP 4 with SP
BASE = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, group_query_attention=True,
            ffn_hidden_size=14336, swiglu=True, seq_length=8192, max_position_embeddings=8192, micro_batch_size=1,
            global_batch_size=64, tensor_model_parallel_size=4, sequence_parallel=True, tp_comm_overlap=True,
            bf16=True, tokenizer_type="NullTokenizer", vocab_size=128256, use_distributed_optimizer=True,
            position_embedding_type="rope", normalization="RMSNorm", disable_bias_linear=True)
MiB = 2**20
FULL_BF16 = 8192 * 4096 * 2          # one [8192, 4096] bf16 buffer: 64 MiB
FULL_U8 = 8192 * 4096                # the same in uint8: 32 MiB


def layout(world=8, **kw):
    return resolve(RawConfig(args={**BASE, **kw}, world_size=world))


def write(tmp_path, text):
    p = tmp_path / "ub.yaml"
    p.write_text(text)
    return str(p)


def test_bf16_twelve_full_buffers():
    L = layout()
    bufs = userbuffers(L)
    assert len(bufs) == 12 and {b.gemm for b in bufs} == {g.gemm for g in ub_gemms()}
    assert all(b.bytes == FULL_BF16 and b.element_bytes == 2 for b in bufs)
    assert userbuffer_bytes(L) == 12 * FULL_BF16 == 768 * MiB
    # the default methods of initialize_ub
    by = {b.gemm: b for b in bufs}
    assert [g for g in by if by[g].method == "ring_exchange"] == ["qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad"]
    assert {g for g in by if by[g].reduce_scatter} == {"proj_fprop", "fc2_fprop", "qkv_wgrad", "fc1_wgrad"}


def test_fp8_all_gather_buffers_are_uint8():
    # fp8_buf for the eight all-gather GEMMs: uint8 [8192, 4096]; the four reduce-scatters stay bf16
    L = layout(fp8="hybrid", fp8_recipe="tensorwise")
    assert userbuffer_bytes(L) == 8 * FULL_U8 + 4 * FULL_BF16 == 512 * MiB
    # FP4 is not FP8 for Megatron's quantization_modes (args.fp8 is None): bf16 buffers
    assert userbuffer_bytes(layout(fp4="e2m1")) == 12 * FULL_BF16


def test_first_last_layers_bf16_adds_a_bf16_set():
    # quantization_modes [FP8, NONE]: both sets are allocated
    L = layout(fp8="hybrid", fp8_recipe="blockwise", first_last_layers_bf16=True)
    assert userbuffer_bytes(L) == (8 * FULL_U8 + 4 * FULL_BF16) + 12 * FULL_BF16
    L0 = layout(fp8="hybrid", fp8_recipe="blockwise", first_last_layers_bf16=True,
                num_layers_at_start_in_bf16=0, num_layers_at_end_in_bf16=0)
    assert userbuffer_bytes(L0) == 8 * FULL_U8 + 4 * FULL_BF16


def test_shape_divides_by_cp_and_grows_with_micro_batch():
    # rows = 8192 * 2 // 2 (CP 2, micro-batch 2): the same 8192 rows
    L = layout(world=16, context_parallel_size=2, micro_batch_size=2)
    assert userbuffer_bytes(L) == 12 * FULL_BF16
    assert userbuffer_bytes(layout(micro_batch_size=2)) == 12 * 2 * FULL_BF16


def test_small_buffers_round_up_to_the_granularity():
    # [1000, 1024] bf16 = 2,048,000 bytes -> one 2 MiB region each
    L = layout(seq_length=1000, max_position_embeddings=1000, hidden_size=1024, num_attention_heads=8,
               ffn_hidden_size=4096)
    assert all(b.bytes == 2 * MiB for b in userbuffers(L)) and userbuffer_bytes(L) == 24 * MiB


def test_yaml_ring_exchange_reduce_scatter_and_pipeline_fp8_buf(tmp_path):
    cfg = write(tmp_path, "proj_fprop:\n  method: ring_exchange\n  num_sm: 1\n"
                          "fc2_fprop:\n  method: pipeline\n  num_sm: 24\n  fp8_buf: 1\n")
    L = layout(fp8="hybrid", fp8_recipe="tensorwise", tp_comm_overlap_cfg=cfg)
    by = {b.gemm: b for b in userbuffers(L)}
    # ring-exchange reduce-scatter in bf16: 2 TP - 1 = 7 chunks of 8192 / 4 rows
    assert by["proj_fprop"].bytes == FULL_BF16 // 4 * 7 == 112 * MiB
    # a pipeline GEMM asking for fp8_buf gets uint8 in FP8 mode
    assert by["fc2_fprop"].bytes == FULL_U8
    assert userbuffer_bytes(L) == 7 * FULL_BF16 // 4 + FULL_U8 + 8 * FULL_U8 + 2 * FULL_BF16


def test_yaml_dgrad_reduce_scatter_rewrite(tmp_path):
    # qkv_dgrad off bulk: it becomes a reduce-scatter (2 TP - 1 chunks on ring exchange); qkv_wgrad keeps a
    # buffer but no longer reduce-scatters
    cfg = write(tmp_path, "qkv_dgrad: {method: ring_exchange}\n")
    L = layout(tensor_model_parallel_size=2, tp_comm_overlap_cfg=cfg)
    by = {b.gemm: b for b in userbuffers(L)}
    assert by["qkv_dgrad"].reduce_scatter and by["qkv_dgrad"].bytes == FULL_BF16 // 2 * 3
    assert not by["qkv_wgrad"].reduce_scatter and by["qkv_wgrad"].bytes == FULL_BF16
    assert userbuffer_bytes(L) == 11 * FULL_BF16 + FULL_BF16 // 2 * 3


@pytest.mark.parametrize("text, words", [
    ("qkv_fprop: {method: ring}\n", "qkv_fprop.method must be one of"),
    ("qkv_fprop: {method: pipeline}\n", "qkv_fprop the pipeline method needs a reduce-scatter"),
    ("fc2_wgrad: {method: bulk}\n", "fc2_wgrad must use the external method"),
    ("qkv_dgrad: {method: ring_exchange}\nqkv_wgrad: {method: bulk}\n", "qkv_wgrad cannot be set"),
    ("- a\n", "must be a mapping"),
])
def test_bad_yaml_names_the_flag(tmp_path, text, words):
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout(tp_comm_overlap_cfg=write(tmp_path, text))
    assert "--tp-comm-overlap-cfg" in str(e.value) and words in str(e.value)


def test_missing_yaml_is_an_error_naming_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--tp-comm-overlap-cfg: cannot read"):
        layout(tp_comm_overlap_cfg=str(tmp_path / "nope.yaml"))


def test_a_file_is_read_once_per_version_and_its_error_kept(tmp_path, monkeypatch):
    # memguard plan resolves the flag for every candidate: ci39's fuzz draw (20,000 nested brackets, 0.16 s a read)
    # ran 3 minutes over 1,122 candidates; one read per file version (files.read_once), and a changed file is read again
    import os

    from megatron_memguard import files
    reads = []
    real = files.read_text
    monkeypatch.setattr(files, "read_text", lambda p, *a, **k: reads.append(p) or real(p, *a, **k))
    bad = write(tmp_path, "[" * 200 + "\n")
    os.utime(bad, ns=(10**18, 10**18))      # (written long before the read: not racy)
    for _ in range(3):
        with pytest.raises((ConfigError, ConfigErrors), match="--tp-comm-overlap-cfg: cannot read"):
            layout(tp_comm_overlap_cfg=bad)
    assert reads == [bad]
    (tmp_path / "ub.yaml").write_text("qkv_dgrad: {method: ring_exchange}\n" + "#" * 400)   # another size: another version
    os.utime(bad, ns=(10**18, 10**18))      # (the same modification time: the size tells the versions apart)
    layout(tp_comm_overlap_cfg=bad)
    layout(tp_comm_overlap_cfg=bad)
    assert reads == [bad, bad]


def test_a_file_changed_just_before_its_read_is_read_again(tmp_path, monkeypatch):
    # a file modification time moves in clock ticks: a second write of the same size within the tick of a read would
    # look like the same version, so a read within 50 ms of the last change is not kept (files._RACY_NS)
    from megatron_memguard import files
    reads = []
    real = files.read_text
    monkeypatch.setattr(files, "read_text", lambda p, *a, **k: reads.append(p) or real(p, *a, **k))
    monkeypatch.setattr(files, "_RACY_NS", 10**18)    # (every read counts as just after a change)
    ub = write(tmp_path, "qkv_dgrad: {method: ring_exchange}\n")
    layout(tp_comm_overlap_cfg=ub)
    layout(tp_comm_overlap_cfg=ub)
    assert reads == [ub, ub]


def test_term_is_device_level_only():
    on, off = layout(), layout(tp_comm_overlap=False)
    e_on, e_off = estimate(on, gpu_memory=80 * 2**30), estimate(off, gpu_memory=80 * 2**30)
    s_on, s_off = e_on.critical, e_off.critical
    term = next(t for t in s_on.terms if t.name == "tp_comm_userbuffers")
    assert term.bytes == 768 * MiB and term.level == "device" and "outside PyTorch's allocator" in term.detail
    # outside PyTorch's caching allocator: allocated and reserved do not move, the device total does
    assert s_on.peak_allocated_bytes == s_off.peak_allocated_bytes
    assert s_on.device_total_bytes - s_off.device_total_bytes == 768 * MiB
    assert not any("userbuffers" in n for n in on.notes)
    # the CPU referee has no userbuffers
    assert not any(t.name == "tp_comm_userbuffers" for t in estimate(on, device="cpu").critical.terms)


def test_mapping_from_nemo_or_bridge_configs():
    # NeMo's model.ub_tp_comm_overlap_cfg (Hydra-loaded) and Megatron-Bridge's TransformerLayerTPOverlapCfg
    # arrive as mappings; a GEMM Bridge leaves unset is None (TE's default for it)
    cfg = {"proj_fprop": {"method": "ring_exchange", "num_sm": 1}, "fc1_fprop": None,
           "_target_": "megatron.bridge.training.comm_overlap.TransformerLayerTPOverlapCfg"}
    L = layout(tp_comm_overlap_cfg=cfg)
    assert L.kernels.tp_comm_overlap_cfg == ("proj_fprop.method=ring_exchange",)
    assert userbuffer_bytes(L) == 11 * FULL_BF16 + FULL_BF16 // 4 * 7
    # the words survive the JSON document of the layout
    from megatron_memguard.layout import Layout
    assert Layout.from_dict(L.to_dict()) == L


def test_bridge_pipeline_default_fp8_buf_tuple_is_true():
    # Megatron-Bridge 0.6.2 training/comm_overlap.py: PipelineOverlapCfg.fp8_buf defaults to (False,), a true value
    # for TE's `user_cfg.get("fp8_buf", False) and name in methods["pipeline"]`: the buffer is uint8 in FP8 mode
    cfg = {"fc2_fprop": {"method": "pipeline", "num_sm": 16, "cga_size": 2, "num_splits": 4, "set_sm_margin": True,
                         "fp8_buf": [False]}}
    L = layout(fp8="hybrid", fp8_recipe="tensorwise", tp_comm_overlap_cfg=cfg)
    assert {b.gemm: b for b in userbuffers(L)}["fc2_fprop"].bytes == FULL_U8


def test_symmetric_all_reduce_buffer():
    # TE 2.11 distributed.py symmetric_all_reduce: one cached symmetric tensor of the row-parallel output's numel,
    # used only on the all-reduce path (TP > 1, no SP): [8192, 4096] bf16 = 64 MiB + torch's 9,216-byte signal
    # pad, rounded up to 2 MiB = 66 MiB, outside PyTorch's allocator
    L = layout(sequence_parallel=False, tp_comm_overlap=False, symmetric_ar_type="two_shot")
    s = estimate(L, gpu_memory=80 * 2**30).critical
    term = next(t for t in s.terms if t.name == "symmetric_ar_buffer")
    assert term.bytes == 66 * MiB and term.level == "device"
    # with SP the outputs are reduce-scattered: no buffer
    with_sp = layout(tp_comm_overlap=False, symmetric_ar_type="one_shot")
    assert not any(t.name == "symmetric_ar_buffer" for t in estimate(with_sp).critical.terms)
    with pytest.raises(ConfigError, match="--symmetric-ar-type: must be one of"):
        layout(symmetric_ar_type="three_shot")
