"""Multi-token prediction on its own pipeline stage (Megatron's mtp_standalone: a --pipeline-model-parallel-layout
'm' on a stage before the loss's), megatron-core 0.16.1 to 0.19.2 (TransformerConfig.mtp_standalone from
PipelineParallelLayerLayout.validate_layer_layout, the same code in 0.16.1, 0.17.1, 0.18.2 and 0.19.2).

Parameters rank by rank against megatron-core's own CPU build (tests/e2e/moe_rank_params.py; this Python's core
and, with $MEMGUARD_PY312 or .venv312, the other era's); activations and P2P tensors worked out by hand from
GPTModel._postprocess, MultiTokenPredictionBlock.forward and process_mtp_loss (core 0.19.2).
"""
from __future__ import annotations

import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors
from megatron_memguard.estimator.params import chunk_params, holds_mtp, total_parameters
from megatron_memguard.estimator.states import stage_states
from megatron_memguard.partition import after_mtp, mtp_standalone

from test_properties_moe_identities import Job, core  # noqa: F401  (core: the megatron-core builder fixture)

H, FFN, HEADS, KV, VOCAB, SEQ = 64, 128, 4, 16, 1024, 64


def _job(layout: str, pp: int, mtp: int, *, tp: int = 1, untied: bool = False, moe: bool = False,
         ep: int = 1, norm: str = "RMSNorm") -> Job:
    layers = layout.replace("|", "").count("t")
    vpp = len(layout.split("|")) // pp
    dp = max(1, ep // tp)
    world = tp * pp * dp
    f = ["--transformer-impl", "transformer_engine", "--num-layers", str(layers), "--hidden-size", str(H),
         "--num-attention-heads", str(HEADS * tp), "--kv-channels", str(KV), "--ffn-hidden-size", str(FFN),
         "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1",
         "--global-batch-size", str(dp * pp * 2), "--tensor-model-parallel-size", str(tp),
         "--pipeline-model-parallel-size", str(pp), "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
         "--bf16", "--position-embedding-type", "rope", "--normalization", norm, "--swiglu", "--disable-bias-linear",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--mtp-num-layers", str(mtp),
         "--pipeline-model-parallel-layout", layout]
    if tp > 1:
        f.append("--sequence-parallel")
    if untied:
        f.append("--untie-embeddings-and-output-weights")
    core_job = dict(num_layers=layers, hidden_size=H, heads=HEADS * tp, kv_channels=KV, groups=None, ffn=FFN,
                    bias=False, glu=True, norm=norm, tp=tp, pp=pp, vpp=vpp if vpp > 1 else None, ep=1, etp=1,
                    experts=None, moe_ffn=None, topk=2, freq=1, untied=untied, seq=SEQ, mtp=mtp, mla=None,
                    layout=layout)
    if moe:
        f += ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", str(ep),
              "--moe-ffn-hidden-size", "32", "--moe-token-dispatcher-type", "alltoall"]
        core_job.update(ep=ep, experts=4, moe_ffn=32)
    return Job(flags=tuple(f), world=world, core=core_job)


JOBS = [
    _job("Et|tt|tm|L", 4, 1, untied=True),                 # MTP with the last decoder layer, a stage before the loss
    _job("Et|tt|mm|L", 4, 2),                               # MTP alone on its stage, tied embeddings
    _job("Et|t|m|L", 4, 1, tp=2, norm="LayerNorm"),        # TP 2 + SP
    _job("Etm|L", 2, 1),                                   # MTP on the first stage: its embedding serves both
    _job("Et|t|tm|L", 2, 1),                               # VPP 2: MTP on rank 0's last virtual stage
    _job("Et|tt|m||L", 5, 1, untied=True),                 # an empty stage between the MTP and the loss
    _job("Et|tt|tm|L", 4, 1, moe=True, ep=2),              # MoE, EP 2
    _job("Et|tt|m|L", 4, 1, moe=True),                     # MoE, the MTP chunk without decoder layers
]


def _layout(job: Job, era: str):
    return layout_from_flags(list(job.flags), world_size=job.world, megatron_version=era)


@pytest.mark.parametrize("job", JOBS, ids=[j.core["layout"] + (" moe" if j.core["experts"] else "") for j in JOBS])
def test_standalone_parameters_rank_by_rank_are_megatron_cores(core, job):
    """Every (pipeline rank, virtual stage, TP rank) of a layout with its MTP block before the loss's stage holds
    in megatron-core's own build (GPTModel with mtp_on_this_rank's MTP block spec) what memguard counts: the MTP
    chunk its own embedding copy (pre_process or mtp_process, gpt_model.py) unless it is the first chunk, the MTP
    block and no output layer; the loss chunk the output layer and no MTP block. The stage sums are the stage's
    parameters and the distinct ranks add up to the model's total."""
    L = _layout(job, core.era)
    assert mtp_standalone(L)
    v = L.vpp if L.vpp and L.vpp > 1 else None
    ranks = [[p, c, t, e, 0] for p in range(L.pp) for c in (range(v) if v else [None])
             for t, e in sorted({(0, 0), (L.tp - 1, L.parallel.expert_model_parallel_size - 1)})]
    recs = core.ranks(job, L, ranks)
    by_chunk: dict[tuple[int, int], list[dict]] = {}
    for r in recs:
        by_chunk.setdefault((r["rank"][0], r["rank"][1] or 0), []).append(r)
    for p in range(L.pp):
        for c in L.stage_chunks(p):
            rs = by_chunk[(p, c.vpp_rank)]
            assert rs[0]["mtp"] == holds_mtp(L, c), (p, c.vpp_rank)
            assert [x[0] for x in rs[0]["layers"]] == [c.first_layer + i for i in range(c.num_layers)]
            n = sum(q.numel for q in chunk_params(L, c))
            for r in rs:
                assert r["params"] == n, (p, c.vpp_rank, r["rank"], r["tags"])
        assert stage_states(L, p).parameters == sum(
            r["params"] for r in recs if r["rank"][0] == p and r["rank"][2] == 0 and r["rank"][3] == 0)
    if not job.core["experts"]:
        weighted = 0
        for rs in by_chunk.values():
            weighted += L.tp * rs[0]["tags"]["tp_split"] + rs[0]["tags"]["replicated"]
        # (the MTP chunk's embedding copy is megatron-core's shared_embedding: a copy, not in the model's total)
        assert weighted == total_parameters(L)


def _row(L) -> int:
    """One [s/CP (/TP with SP), b, h] bf16 activation."""
    return L.seq_length * L.micro_batch_size // (L.tp if L.sequence_parallel else 1) * L.hidden_size * 2


@pytest.mark.parametrize("era", ["0.16", "0.19"])
def test_standalone_activations_by_hand(era):
    """'Et|tt|mm|L' with D = 2, TP 1, s = 64, b = 1, h = 64, bf16 (row = 64 x 64 x 2 = 8 KiB): the MTP stage keeps
    per micro-batch the block's tensors less the concatenation it sends on (deallocate_output_tensor) plus hnorm's
    input: D x (enorm input 1 + eh_proj input 2 + final-norm input 1) rows + hnorm's input 1 row, 3 RMSNorm
    rstd rows of fp32 per depth, the rolled ids (int64) per depth, and (no decoder layer on the chunk) the received
    hidden states, which the schedule keeps while the empty TransformerBlock's clone of them is hnorm's input
    (transformer_block.py: ``hidden_states.clone()`` when not pre_process, no layer, no final norm; core 0.16.1 and
    0.19.2); the loss stage keeps the received (1 + D)-fold concatenation (3 rows) and the clone its empty block
    makes of it (3 rows), whose views the heads keep, and no output-layer input of its own, and its received inputs
    and P2P buffers are (1 + D)-fold."""
    job = _job("Et|tt|mm|L", 4, 2)
    L = _layout(job, era)
    row = _row(L)
    assert row == 64 * 64 * 2
    est = estimate(L)
    s2, s3 = est.stages[2].breakdown, est.stages[3].breakdown
    stats = 64 * 4                    # RMSNorm: one fp32 rstd per row
    ids = 64 * 8                      # the rolled input ids (int64), TP 1, rope: no position ids
    # + depth 1's output, which depth 2's hnorm keeps (MultiTokenPredictionBlock.forward): one row
    per_mb_block = 2 * (4 * row + 3 * stats + ids) + row + row + row
    held2 = est.stages[2].in_flight
    assert s2["mtp_block_activations"] == held2 * per_mb_block
    assert "mtp_loss_buffers" not in s2 and "loss_softmax_fp32" not in s2
    held3 = est.stages[3].in_flight
    assert s3["mtp_received_hidden"] == held3 * 2 * 3 * row
    assert "output_layer_input" not in s3 and "mtp_block_activations" not in s3
    # the D extra heads' fp32 softmax [s, V] (+ targets, rolled labels, mask, per-token loss) on the loss stage
    softmax = 4 * 64 * L.padded_vocab_size
    assert s3["mtp_loss_buffers"] == held3 * 2 * (softmax + 64 * 9 + 64 * 16)
    # P2P: the loss stage receives [(1 + D) s, b, h]; its NCCL buffer in flight is that size too
    assert after_mtp(L, 3, 0) and not after_mtp(L, 2, 0)
    assert s3["p2p_buffers_in_flight"] == 3 * row
    assert s2["p2p_buffers_in_flight"] == 3 * row           # it sends the concatenation
    assert est.stages[1].breakdown["p2p_buffers_in_flight"] == row


@pytest.mark.parametrize("layout, pp, depths, kw", [("Et|t|m|L", 4, 1, dict(tp=2, norm="LayerNorm")),
                                                      ("Et|tt|tm|L", 4, 1, dict(untied=True))])
def test_standalone_received_gradient_counted_once_on_a_gpu(layout, pp, depths, kw):
    """The MTP stage's backward starts in its MTP layers beside the received gradient of the (1 + D)-fold
    concatenation it sent. On a GPU that gradient is the receive buffer itself (p2p_communication.py _communicate's
    torch.empty, returned as backward_step's output_tensor_grad, megatron-core 0.16.1 and 0.19.2), which the widened
    p2p_buffers_in_flight counts: the GPU peak is the CPU's (where the schedule's received tensor is an activation,
    CPU referee 'Et|tm|L' within 220 B) plus the GPU-only allocated terms, less that one tensor, (1 + D) rows. (It was
    counted twice before: the GPU peak was the CPU's plus the GPU-only terms.)"""
    L = _layout(_job(layout, pp, depths, **kw), "0.19")
    from megatron_memguard.gpus import lookup_gpu
    cpu, gpu = estimate(L, device="cpu").stages[2], estimate(L, gpu=lookup_gpu("H100-80GB")).stages[2]
    assert cpu.peak_phase == gpu.peak_phase and cpu.peak_phase.startswith("backward")
    assert gpu.breakdown["p2p_buffers_in_flight"] == (1 + depths) * _row(L)
    gpu_only = sum(t.bytes for t in gpu.terms if t.level == "allocated" and t.name not in cpu.breakdown)
    assert gpu.peak_allocated_bytes - gpu_only == cpu.peak_allocated_bytes - (1 + depths) * _row(L)


def test_standalone_embedding_copy_by_hand():
    """The MTP stage of 'Et|tt|mm|L' (no decoder layer there) holds its embedding copy [V, h], D MTP depths of
    enorm + hnorm + final norm (RMSNorm: h each) + eh_proj [h, 2h] + one transformer layer, and no output layer;
    the loss stage the output layer [V, h] (tied: its own copy, the embedding group's shared weight)."""
    L = _layout(_job("Et|tt|mm|L", 4, 2), "0.19")
    V = L.padded_vocab_size
    mtp_chunk, loss_chunk = L.stage_chunks(2)[0], L.stage_chunks(3)[0]
    ps = chunk_params(L, mtp_chunk)
    layer = sum(q.numel for q in ps if ".transformer_layer." in q.name) // 2
    assert sum(q.numel for q in ps) == V * H + 2 * (3 * H + 2 * H * H + layer)
    assert not any(q.name.startswith("output_layer") for q in ps)
    assert [q.name for q in chunk_params(L, loss_chunk)] == ["output_layer.weight"]
    assert [q.shared_embedding for q in ps if q.name.startswith("embedding.")] == [True]


@pytest.mark.parametrize("layout, rule", [
    ("Et|m|t|L", "decoder layer 't' after an MTP layer"),
    ("Et|tm|t|L", "decoder layer 't' after an MTP layer"),
    ("Et|m|tt|L", "decoder layer 't' after an MTP layer"),
])
def test_validate_layer_layout_rules_refused(layout, rule):
    """PipelineParallelLayerLayout.validate_layer_layout's MTP rules (core 0.16.1 to 0.19.2): decoder layers
    before MTP layers; MTP only in a rank's last virtual stage; all of it in one stage."""
    job = _job(layout, 4, 1)
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        _layout(job, "0.19")
    assert rule in str(e.value) and "--pipeline-model-parallel-layout" in str(e.value)


def test_mtp_outside_the_last_virtual_stage_and_split_mtp_refused():
    for layout, pp, mtp, rule in [("Et|tm||L", 2, 1, "last virtual stage"),
                                  ("Et|t|m|mL", 2, 2, "several stages"),
                                  ("Etm|t|t|L", 2, 1, "decoder layer")]:
        with pytest.raises((ConfigError, ConfigErrors)) as e:
            _layout(_job(layout, pp, mtp), "0.19")
        assert rule in str(e.value) and "--pipeline-model-parallel-layout" in str(e.value), (layout, str(e.value))


def test_rotary_table_per_chunk_after_the_mtp_stage():
    # 'Et|t|t|t|tm|L', PP 2 x VPP 3, D = 1: only the loss chunk 5 (rank 1's last) comes after the MTP chunk 4 (rank 0's
    # last; Megatron keeps MTP layers in a rank's last virtual stage) and takes the (1 + D)-fold input. Each chunk is a
    # GPTModel with its own RotaryEmbedding whose forward's lru_cache is keyed on the instance (rotary_pos_embedding.py;
    # the MTP block takes its GPTModel's table, MultiTokenPredictionBlock.forward; megatron-core 0.16.1 and 0.19.2):
    # rank 1 keeps s + s + 2 s rows (two chunks of input s), not one table per input length (s + 2 s); rank 0 three
    # tables of s rows. fp32, rotary dim = kv_channels 16.
    for era in ("0.16", "0.19"):
        L = layout_from_flags(list(_job("Et|t|t|t|tm|L", 2, 1).flags), world_size=2, megatron_version=era)
        assert [after_mtp(L, r, v) for r in (0, 1) for v in (0, 1, 2)] == [False] * 5 + [True]
        est = estimate(L, device="cpu")
        assert est.stages[0].breakdown["rotary_cache"] == 3 * SEQ * KV * 4
        assert est.stages[1].breakdown["rotary_cache"] == (1 + 1 + 2) * SEQ * KV * 4
