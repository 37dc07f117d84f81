"""Context parallelism (issue 13): what TE's ring attention and megatron's rotary cache keep per CP rank.

Sources: Transformer Engine's AttnFuncWithCPAndKVP2P (transformer_engine/pytorch/attention/
dot_product_attention/context_parallel.py, read in TE 2.11.0 and 2.20.2) and megatron-core's
RotaryEmbedding.forward / get_pos_emb_on_this_cp_rank (models/common/embeddings/, 0.16.1 and 0.19.2).
Measured: Megatron-LM's CI runs with CP2 (shared/groundtruth/).
"""
import os
import statistics
import sys

import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.estimator.activations import layer_activations

from conftest import LLAMA31_70B

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The 12-layer Llama-3-70B shape (h 8192, ffn 28672, 64 heads / 8 groups, vocab 128256), MBS 1,
# bf16, untied, distributed optimizer, cross-entropy fusion, at 131072 tokens.
SEQ = 131072
SHAPE = [a if a != "80" else "12" for a in LLAMA31_70B]


def flags(seq: int = SEQ, tp: int = 2, cp: int = 4, *extra: str) -> list[str]:
    out = [a for a in SHAPE]
    for key, value in (("--seq-length", seq), ("--max-position-embeddings", seq)):
        out[out.index(key) + 1] = str(value)
    return out + ["--micro-batch-size", "1", "--global-batch-size", "8", "--tensor-model-parallel-size", str(tp),
                  "--context-parallel-size", str(cp), "--use-distributed-optimizer", "--cross-entropy-loss-fusion",
                  *(["--sequence-parallel"] if tp > 1 else []), *extra]


# per CP rank: s/CP = 32768 tokens; heads/TP = 32, query groups/TP = 4, head dim 128, bf16
Q = 32768 * 32 * 128 * 2          # one query-sized tensor
KV1 = 32768 * 4 * 128 * 2         # one of K or V
STATS = 32 * 32768 * 4            # fp32 softmax statistics [b, heads/TP, s/CP]


def _layout(*extra, version="0.19"):
    return layout_from_flags(flags(SEQ, 2, 4, *extra), world_size=8, megatron_version=version)


def test_shape():
    L = _layout()
    assert (L.hidden_size, L.seq_length, L.cp, L.tp, L.num_layers) == (8192, SEQ, 4, 2, 12)


def test_ring_attention_keeps_q_the_last_kv_buffer_the_output_and_the_statistics():
    # AttnFuncWithCPAndKVP2P.forward: k and v go into the ring's first buffer (torch.cat), the function
    # saves q, the last received K/V buffer p2p_comm_buffers[-1], out and softmax_lse. Nothing keeps
    # megatron's qkv projection output or the rope'd key any more (FusedAttention .contiguous() on q
    # and k leaves the rope outputs as they are; v's contiguous copy goes into the cat).
    saved = layer_activations(_layout(), True).saved
    assert saved["query_rope"] == Q
    assert saved["cp_kv_buffer"] == 2 * KV1
    assert saved["softmax_stats"] == STATS
    assert saved["proj_input"] == Q                        # the output, as linear_proj keeps it
    assert "qkv_output" not in saved and "key_rope" not in saved
    # without CP the cuDNN path keeps the qkv output (through v's view) and both rope outputs
    one = layer_activations(layout_from_flags(flags(SEQ // 4, 2, 1), world_size=2, megatron_version="0.19"), True).saved
    assert one["qkv_output"] == Q + 2 * KV1 and one["key_rope"] == KV1


def test_flash_backend_keeps_its_bshd_output_too():
    # FlashAttention.forward transposes q, k, v to [b, s, h, d] copies and returns
    # output.view(b, s, -1).transpose(0, 1).contiguous(): the ring function keeps its [b, s, h, d] output
    # and linear_proj the [s, b, h] copy.
    saved = layer_activations(_layout("--attention-backend", "flash"), True).saved
    assert saved["attention_output_bshd"] == Q and saved["proj_input"] == Q
    assert saved["query_rope"] == Q and saved["cp_kv_buffer"] == 2 * KV1


@pytest.mark.parametrize("cp, backend, together", [
    (4, "fused", {"cp_kv_buffer"}), (4, "flash", {"cp_kv_buffer", "attention_output_bshd"}),
    (1, "flash", {"flash_qkv", "attention_output_bshd"}),
])
def test_the_core_attentions_saved_tensors_are_freed_together(cp, backend, together):
    # one autograd node saves them and frees them after its backward: the ring (TE 2.11 context_parallel.py
    # AttnFuncWithCPAndKVP2P.forward: ctx.save_for_backward of q, the last K/V buffer, out and softmax_lse) and
    # flash-attn's function under TE's FlashAttention (q, k, v, its [b, s, h, d] out and softmax_lse): every
    # backward step after the core attention's (those that no longer hold the statistics) no longer holds them
    L = layout_from_flags(flags(SEQ // 4 * cp, 2, cp, "--attention-backend", backend), world_size=2 * cp,
                          megatron_version="0.19")
    la = layer_activations(L, True)
    assert together <= set(la.saved)
    after_core = [names for names, _ in la.bwd_steps if "softmax_stats" in names]
    assert after_core and all(together <= names for names in after_core)


def test_ring_transients_by_transformer_engine_version():
    # TE 2.20.2 double-buffers the ring (two K/V buffers and two partial outputs besides the output);
    # TE 2.11 (megatron-core 0.16 pins TE < 2.12) keeps all CP of each until the forward ends.
    new = layer_activations(_layout(), True)
    old = layer_activations(_layout(version="0.16"), True)
    assert new.fwd_steps[0][1] == 3 * Q + 4 * KV1
    assert old.fwd_steps[0][1] == (4 + 1) * Q + 3 * 2 * KV1
    # backward (AttnFuncWithCPAndKVP2P.backward, TE 2.11 / 2.20.2 context_parallel.py) at an upper-triangle step:
    # dO handed in (Q), dq buffer empty_like(q) (Q), two [2, K/V] buffers of K/V and dK/dV (2 x 2 x 2 KV1), the
    # contiguous halves of q, out and dO (1.5 Q), the step's half dq (Q / 2) and dk, dv (2 KV1); the statistics
    core = [w for names, w in new.bwd_steps if "softmax_stats" not in names and "proj_input" in names]
    by_hand = Q + Q + 8 * KV1 + 3 * Q // 2 + Q // 2 + 2 * KV1 + STATS
    assert by_hand == 4 * Q + 10 * KV1 + STATS
    assert core and core[0] == 32768 // 2 * 8192 * 2 + by_hand   # + G, the incoming gradient


def test_rotary_table_is_this_cp_ranks_rows():
    # RotaryEmbedding.forward (lru_cache) returns get_pos_emb_on_this_cp_rank(emb): an index_select of
    # this rank's two s/(2 CP) chunks, [s/CP, 1, 1, 128] fp32.
    terms = estimate(_layout()).stages[0].breakdown
    assert terms["rotary_cache"] == SEQ // 4 * 128 * 4


def test_megatron_ci_context_parallel_records():
    # Megatron-LM's CI runs with --context-parallel-size 2 (flash backend, small GPT; 27 clean records on
    # A100, H100 and GB200): the median absolute peak error is 1.1% (1.8% before the ring attention was
    # modelled), the mean error within 0.5%.
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from accuracy_megatron_ci import evaluate, load_records
    errs = [evaluate(r).peak_err for r in load_records() if r["model_args"].get("--context-parallel-size", 1) > 1]
    errs = [e for e in errs if e is not None]
    assert len(errs) == 27
    assert statistics.median(abs(e) for e in errs) <= 0.0125
    assert abs(statistics.mean(errs)) <= 0.005
    assert max(abs(e) for e in errs) <= 0.05


@pytest.mark.parametrize("tp, cp", [(2, 4), (1, 8)])
def test_long_context_keeps_q_and_one_kv_buffer_per_layer(tp, cp):
    # TP2 CP4 and TP1 CP8 as in the issue: per layer q and the [2, s/CP, b, g/t, d] ring buffer, where the
    # CP-less model counted the qkv output and the rope'd key besides q (q + kv1 more per layer).
    L = layout_from_flags(flags(SEQ, tp, cp), world_size=tp * cp, megatron_version="0.19")
    s = SEQ // cp
    q, kv1 = s * 64 // tp * 128 * 2, s * 8 // tp * 128 * 2
    la = layer_activations(L, True)
    assert la.saved["query_rope"] + la.saved["cp_kv_buffer"] == q + 2 * kv1
    assert "qkv_output" not in la.saved


@pytest.mark.parametrize("backend", ["unfused", "local"])
def test_attention_backends_without_context_parallelism_are_refused(backend):
    """CP 4 with --attention-backend unfused: TE's get_attention_backend disables UnfusedDotProductAttention under
    context parallelism (TE 2.11 attention/dot_product_attention/utils.py, 'does not support context
    parallelism') and the backend's NVTE_* variables switch flash and fused off, so the first forward raises;
    'local' builds megatron-core's DotProductAttention, which asserts context_parallel_size == 1. A one-line
    error naming the flag, not an estimate of a job that cannot run. CP 1 (or the auto backend) stays estimated."""
    from megatron_memguard.errors import ConfigError, ConfigErrors
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(flags(cp=4) + ["--attention-backend", backend], world_size=8)
    text = str(e.value)
    assert text.startswith("--attention-backend:") and "context parallelism" in text and "\n" not in text
    assert layout_from_flags(flags(cp=1) + ["--attention-backend", "unfused"], world_size=2).cp == 1
    assert layout_from_flags(flags(cp=4) + ["--attention-backend", "auto"], world_size=8).cp == 4
