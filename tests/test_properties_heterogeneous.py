"""Properties of heterogeneous layer configs (--heterogeneous-layers-config-path: resolve/heterogeneous.py,
estimator/layers/noop.py, linear_block.py), drawn where megatron-core builds them: a config whose blocks are all the
flags' own layer is the homogeneous model (byte for byte), and every pipeline stage's parameters per TP rank are the
hand count of its blocks (megatron-core 0.19.2 heterogeneous_layer_specs.py, linear_replacements.py; the same modules
in 0.16.1), summing to the model's total; a larger micro-batch or sequence never lowers a stage's peak, the
distributed optimizer's shards partition each stage's state, and an MTP depth is the flags' own layer.

Derandomized; MEMGUARD_PROPERTY_EXAMPLES sets the count (default 200, these use a quarter: each example writes a
config file and resolves and estimates one or two layouts).
"""
from __future__ import annotations

import json
import os
import tempfile

from hypothesis import HealthCheck, given, reject, settings, strategies as st

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.params import total_parameters
from megatron_memguard.estimator.states import stage_states
from megatron_memguard.resolve.heterogeneous import ffn_mult_to_size

EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))
QUARTER = settings(derandomize=True, database=None, deadline=None, max_examples=max(1, EXAMPLES // 4),
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
VOCAB = 1024          # NullTokenizer: 1024 (+ 1 EOD token under 0.16), padded to 128 x TP


def _layout(flags: list[str], world: int, version: str):
    try:
        return layout_from_flags(flags, world_size=world, megatron_version=version)
    except (ConfigError, ConfigErrors, NotModelledError) as e:
        errors = e.errors if isinstance(e, ConfigErrors) else [e]
        for err in errors:
            assert "\n" not in str(err) and str(err).startswith("--"), str(err)
        reject()


@st.composite
def het_jobs(draw, uniform: bool):
    """(flags without the config path, the config document, world size, version). ``uniform``: every block the
    flags' own layer (attention with the flags' query groups, a dense MLP of --ffn-hidden-size, by ffn_hidden_size or
    by an ffn_mult giving that size); else each block's attention and MLP drawn among full, no-op and linear, the
    dense MLPs of their own widths."""
    tp = draw(st.sampled_from([1, 1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 4]))
    layers = pp * draw(st.integers(1, 3))
    heads = tp * draw(st.sampled_from([1, 2, 4]))
    # one n_heads_in_group for every block (validate_model_config_args_from_heterogeneous_config); the groups a
    # multiple or a divisor of TP (validate_args)
    n = draw(st.sampled_from([k for k in range(1, heads + 1) if heads % k == 0
                              and ((heads // k) % tp == 0 or tp % (heads // k) == 0)]))
    d = draw(st.sampled_from([16, 32, 64]))
    hidden = heads * d
    ffn = 256 * draw(st.integers(1, 4))
    seq, mbs = draw(st.sampled_from([64, 128, 256])), draw(st.sampled_from([1, 2]))
    dp, micro = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    impl = draw(st.sampled_from(["local", "transformer_engine"]))
    sp = tp > 1 and draw(st.booleans())
    version = draw(st.sampled_from(["0.16", "0.19"]))
    recompute = draw(st.sampled_from([(), ("full", "uniform"), ("full", "block"), ("selective",)]))
    flags = ["--transformer-impl", impl, "--num-layers", str(layers), "--hidden-size", str(hidden),
             "--num-attention-heads", str(heads), "--group-query-attention", "--num-query-groups", str(heads // n),
             "--ffn-hidden-size", str(ffn), "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
             "rope", "--use-rope-scaling", "--use-rotary-position-embeddings", "--rotary-base", "500000",
             "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--seq-length", str(seq),
             "--max-position-embeddings", str(seq), "--micro-batch-size", str(mbs), "--global-batch-size",
             str(mbs * dp * micro), "--bf16", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--tensor-model-parallel-size", str(tp),
             "--pipeline-model-parallel-size", str(pp)]
    if sp:
        flags.append("--sequence-parallel")
    if draw(st.booleans()):
        flags.append("--use-distributed-optimizer")
    if recompute and recompute[0] == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", recompute[1], "--recompute-num-layers",
                  str(draw(st.integers(1, layers // pp)))]
    elif recompute:
        flags += ["--recompute-granularity", "selective"]
    attention = {"n_heads_in_group": n, "no_op": False, "replace_with_linear": False}
    if uniform:
        by_mult = ffn % 256 == 0 and draw(st.booleans())
        # ffn_mult_to_size: int(2 m h / 3) rounded up to 256; m = 3 F / (2 h) gives F back (F a multiple of 256)
        mlp = {"ffn_mult": 3 * ffn / (2 * hidden)} if by_mult else {"ffn_hidden_size": ffn}
        if by_mult and ffn_mult_to_size(mlp["ffn_mult"], hidden) != ffn:
            reject()
        blocks = [{"attention": attention, "ffn": dict(mlp, no_op=False, replace_with_linear=False)}] * layers
    else:
        blocks = []
        for _ in range(layers):
            a = draw(st.sampled_from(["attention", "no_op", "linear"]))
            m = draw(st.sampled_from(["dense", "no_op", "linear"]))
            att = attention if a == "attention" else {"n_heads_in_group": None, "no_op": a == "no_op",
                                                      "replace_with_linear": a == "linear"}
            f = ({"ffn_hidden_size": tp * 128 * draw(st.integers(1, 8)), "no_op": False, "replace_with_linear": False}
                 if m == "dense" else {"ffn_hidden_size": None, "no_op": m == "no_op",
                                       "replace_with_linear": m == "linear"})
            blocks.append({"attention": att, "ffn": f})
    doc = {"hidden_act": "silu", "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
           "tie_word_embeddings": False, "rope_theta": 500000, "rope_scaling": {"factor": 8.0},
           "block_configs": blocks}
    return flags, doc, tp * pp * dp, version


def _with_config(flags: list[str], doc: dict, world: int, version: str):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(doc, fh)
    try:
        return _layout(flags + ["--heterogeneous-layers-config-path", fh.name], world, version)
    finally:
        os.unlink(fh.name)


@QUARTER
@given(het_jobs(uniform=True))
def test_a_config_of_the_flags_own_blocks_is_the_homogeneous_model(job):
    """get_config_for_layer gives every layer the flags' attention and MLP when each block repeats them: the same
    TransformerLayers as the plain model, so every stage's terms, peak and its moment are the homogeneous estimate's,
    to the byte, under any parallel layout and recompute setting either release takes."""
    flags, doc, world, version = job
    plain = _layout(flags, world, version)
    het = _with_config(flags, doc, world, version)
    assert het.heterogeneous_layers and total_parameters(het) == total_parameters(plain)
    a, b = estimate(plain), estimate(het)
    for sa, sb in zip(a.stages, b.stages, strict=True):
        assert [(t.name, t.bytes) for t in sb.terms] == [(t.name, t.bytes) for t in sa.terms]
        assert (sb.peak_allocated_bytes, sb.peak_phase) == (sa.peak_allocated_bytes, sa.peak_phase)


def _block_params(block: dict, hidden: int, heads: int, tp: int) -> int:
    """One block's parameters on one TP rank, by hand (RMSNorm, no biases; megatron-core 0.19.2
    heterogeneous_layer_specs.py, linear_replacements.py): attention = input norm h (replicated) + linear_qkv
    (a + 2 g) d x h / TP + linear_proj h x a d / TP; a linear replacement = its norm h + one column-parallel [h, h]
    / TP; a dense MLP of F = pre-MLP norm h + fc1 2 F x h / TP (SwiGLU) + fc2 h x F / TP; a no-op half nothing."""
    att, mlp = block["attention"], block["ffn"]
    d = hidden // heads
    n = 0
    if att["replace_with_linear"]:
        n += hidden + hidden * hidden // tp
    elif not att["no_op"]:
        g = heads // att["n_heads_in_group"]
        n += hidden + (heads + 2 * g) * d * hidden // tp + hidden * heads * d // tp
    if mlp["replace_with_linear"]:
        n += hidden + hidden * hidden // tp
    elif not mlp["no_op"]:
        F = mlp["ffn_hidden_size"]
        n += hidden + 3 * F * hidden // tp
    return n


@QUARTER
@given(het_jobs(uniform=False))
def test_each_stages_parameters_are_its_blocks_and_sum_to_the_model(job):
    """Blocks of full, no-op and linear halves with their own MLP widths: each pipeline stage's parameters on a TP
    rank are its layers' blocks (an even split) by hand, the first stage adding the embedding [V / TP, h], the last
    the output layer [V / TP, h] and the final norm h; times TP for the split weights, summed over the stages, the
    model's total."""
    flags, doc, world, version = job
    L = _with_config(flags, doc, world, version)
    tp, pp, h, heads = L.tp, L.pp, doc["hidden_size"], doc["num_attention_heads"]
    blocks = doc["block_configs"]
    per = len(blocks) // pp
    emb = L.padded_vocab_size // tp * h
    est = estimate(L)
    whole = 0        # the model's total: each stage's split weights x TP, its replicated norms once
    for p, st_ in enumerate(est.stages):
        mine = blocks[p * per:(p + 1) * per]
        want = sum(_block_params(b, h, heads, tp) for b in mine) + (emb if p == 0 else 0) + (
            emb + h if p == pp - 1 else 0)
        assert st_.parameters == want, p
        norms = sum(h for b in mine for half in ("attention", "ffn")
                    if not b[half]["no_op"]) + (h if p == pp - 1 else 0)
        whole += (want - norms) * tp + norms
    assert whole == total_parameters(L)


IDENTITY = {"attention": {"n_heads_in_group": None, "no_op": True, "replace_with_linear": False},
            "ffn": {"ffn_hidden_size": None, "no_op": True, "replace_with_linear": False}}


@QUARTER
@given(het_jobs(uniform=False), st.data())
def test_identity_blocks_on_top_of_each_stage_change_nothing(job, data):
    """A block whose attention and MLP are both no-op returns its input (heterogeneous_layer_specs.py: IdentityOp
    halves, IdentityFuncOp bias-dropout-adds): no parameter, nothing saved, and the output gradient passes to the
    layer below unchanged. One on top of every stage's layers leaves every estimate as it was, byte for byte, without
    recompute, with selective recompute and with full block recompute of up to all the original layers (the identity
    not checkpointed: the layer under it is handed the stage's own output gradient, which on a stage before the last
    the schedule holds, so a replayed full layer there holds no copy of it)."""
    flags, doc, world, version = job
    pp = int(flags[flags.index("--pipeline-model-parallel-size") + 1])
    blocks = list(doc["block_configs"])
    per = len(blocks) // pp
    full = {"attention": next((b["attention"] for b in blocks if b["attention"]["n_heads_in_group"]),
                              {"n_heads_in_group": 1, "no_op": False, "replace_with_linear": False}),
            "ffn": {"ffn_hidden_size": doc["hidden_size"] * 2, "no_op": False, "replace_with_linear": False}}
    if full["attention"]["n_heads_in_group"] != doc["num_attention_heads"] // int(
            flags[flags.index("--num-query-groups") + 1]):
        reject()
    for p in range(pp):
        if data.draw(st.booleans()):
            blocks[p * per + per - 1] = full      # a full layer under the identity (its replay merges below its MLP)
    if "full" in flags:
        i = flags.index("--recompute-method")
        flags = flags[:i] + ["--recompute-method", "block", "--recompute-num-layers",
                             str(data.draw(st.integers(1, per)))] + flags[i + 4:]
    more = [b for p in range(pp) for b in blocks[p * per:(p + 1) * per] + [IDENTITY]]
    n = flags.index("--num-layers") + 1
    flags2 = flags[:n] + [str(len(more))] + flags[n + 1:]
    a = _with_config(flags, dict(doc, block_configs=blocks), world, version)
    b = _with_config(flags2, dict(doc, num_hidden_layers=len(more), block_configs=more), world, version)
    ea, eb = estimate(a), estimate(b)
    for sa, sb in zip(ea.stages, eb.stages, strict=True):
        assert [(t.name, t.bytes) for t in sb.terms] == [(t.name, t.bytes) for t in sa.terms]
        assert sb.peak_allocated_bytes == sa.peak_allocated_bytes


def _set(flags: list[str], flag: str, value) -> list[str]:
    i = flags.index(flag) + 1
    return flags[:i] + [str(value)] + flags[i + 1:]


@QUARTER
@given(het_jobs(uniform=False), st.sampled_from(["mbs", "seq"]))
def test_a_larger_micro_batch_or_sequence_never_lowers_a_heterogeneous_stage_peak(job, what):
    """Whatever a block keeps (a full, linear or no-op half; an MLP of its own width) is [s, b, ...]: one more
    sequence per micro-batch (the number of micro-batches kept) or twice the sequence lowers no stage's peak. And
    under the distributed optimizer each stage's fp32 shards add up to its parameters, none over its slice of the
    padded buffer (distrib_optimizer.py _build_model_gbuf_range)."""
    flags, doc, world, version = job
    L = _with_config(flags, doc, world, version)
    if what == "mbs":
        mbs = L.micro_batch_size
        bigger = _set(_set(flags, "--micro-batch-size", mbs + 1), "--global-batch-size",
                      L.global_batch_size // mbs * (mbs + 1))
    else:
        bigger = _set(_set(flags, "--seq-length", 2 * L.seq_length), "--max-position-embeddings", 2 * L.seq_length)
    for a, b in zip(estimate(L).stages, estimate(_with_config(bigger, doc, world, version)).stages):
        assert b.peak_allocated_bytes >= a.peak_allocated_bytes, (a.pp_rank, a.peak_phase, b.peak_phase)
    if L.use_distributed_optimizer:
        n = L.dp_shard_size
        for p in range(L.pp):
            st_ = stage_states(L, p)
            shards = [stage_states(L, p, r).exp_avg_bytes // 4 for r in range(n)]
            assert sum(shards) == st_.parameters and max(shards) <= st_.buffer_numel // n, p


@QUARTER
@given(het_jobs(uniform=False), st.integers(1, 2))
def test_mtp_depths_of_a_heterogeneous_model_are_the_flags_own_layer(job, depth):
    """megatron/training's mtp_block_spec (models/gpt.py, 0.19.2; memguard refuses the 0.16 to 0.18 builders' MTP with
    a heterogeneous config by name, their spec not being in the wheels) takes the last of
    get_gpt_decoder_layer_specs, the spec of the model's flags, not the heterogeneous block spec, and
    MultiTokenPredictionLayer builds it with the model's config: each MTP depth is the flags' own layer (attention of
    --num-query-groups, a SwiGLU MLP of --ffn-hidden-size) whatever the last block is, plus enorm, hnorm and
    final_layernorm h each and eh_proj [h / TP, 2 h]; on the last stage, which with PP > 1 also builds its own word
    embedding [V / TP, h] (gpt_model.py: pre_process or mtp_process). No other stage changes. By hand."""
    flags, doc, world, _ = job
    version = "0.19"
    if "full" in flags:
        # MultiTokenPredictionLayer._checkpointed_forward asserts recompute_num_layers == 1 under full recompute
        i = flags.index("--recompute-method")
        flags = flags[:i] + ["--recompute-method", "uniform", "--recompute-num-layers", "1"] + flags[i + 4:]
    plain = _with_config(flags, doc, world, version)
    L = _with_config(flags + ["--mtp-num-layers", str(depth)], doc, world, version)
    tp, pp, h, heads = L.tp, L.pp, doc["hidden_size"], doc["num_attention_heads"]
    groups = int(flags[flags.index("--num-query-groups") + 1])
    own = {"attention": {"n_heads_in_group": heads // groups, "no_op": False, "replace_with_linear": False},
           "ffn": {"ffn_hidden_size": int(flags[flags.index("--ffn-hidden-size") + 1]), "no_op": False,
                   "replace_with_linear": False}}
    added = depth * (3 * h + 2 * h * h // tp + _block_params(own, h, heads, tp))
    added += L.padded_vocab_size // tp * h if pp > 1 else 0
    got = [stage_states(L, p).parameters - stage_states(plain, p).parameters for p in range(pp)]
    assert got == [0] * (pp - 1) + [added]


def test_an_mtp_depth_over_a_linear_and_no_op_last_block_by_hand():
    """The property above's rule by hand: h 64, 4 heads of 16, 2 query groups, --ffn-hidden-size 256 (SwiGLU,
    RMSNorm, no biases), two blocks, the last one a linear attention and a no-op MLP. The MTP depth is the flags'
    own layer, not that block: input norm 64 + linear_qkv (4 + 2 x 2) x 16 x 64 = 8,192 + linear_proj 64 x 64 = 4,096
    + pre-MLP norm 64 + fc1 2 x 256 x 64 = 32,768 + fc2 64 x 256 = 16,384 = 61,568; with enorm, hnorm and
    final_layernorm 3 x 64 and eh_proj 64 x 128 = 8,192: 69,952 more on the one stage (PP 1: no embedding copy)."""
    flags = ["--transformer-impl", "transformer_engine", "--num-layers", "2", "--hidden-size", "64",
             "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size",
             "256", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--use-rope-scaling",
             "--use-rotary-position-embeddings", "--rotary-base", "500000", "--untie-embeddings-and-output-weights",
             "--disable-bias-linear", "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size",
             "1", "--global-batch-size", "1", "--bf16", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)]
    attention = {"n_heads_in_group": 2, "no_op": False, "replace_with_linear": False}
    blocks = [{"attention": attention, "ffn": {"ffn_hidden_size": 128, "no_op": False, "replace_with_linear": False}},
              {"attention": {"n_heads_in_group": None, "no_op": False, "replace_with_linear": True},
               "ffn": {"ffn_hidden_size": None, "no_op": True, "replace_with_linear": False}}]
    doc = {"hidden_act": "silu", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "tie_word_embeddings": False, "rope_theta": 500000, "rope_scaling": {"factor": 8.0}, "block_configs": blocks}
    plain = _with_config(flags, doc, 1, "0.19")
    L = _with_config(flags + ["--mtp-num-layers", "1"], doc, 1, "0.19")
    layer = 64 + 8 * 16 * 64 + 64 * 64 + 64 + 2 * 256 * 64 + 64 * 256
    assert layer == 61_568
    assert stage_states(L, 0).parameters - stage_states(plain, 0).parameters == 3 * 64 + 64 * 128 + layer == 69_952


@QUARTER
@given(het_jobs(uniform=False), st.data())
def test_a_layout_strings_stages_hold_their_blocks(job, data):
    """--pipeline-model-parallel-layout placing the blocks unevenly (0 to all of them on a rank: empty ranks too)
    puts block i on the stage of the i-th 't' (PipelineParallelLayerLayout, core 0.16.1 / 0.19.2; the heterogeneous
    spec builds each layer from its own block config, get_config_for_layer): each stage's parameters per TP rank are
    its blocks by hand, the first adding the embedding [V / TP, h], the last the output layer [V / TP, h] and the
    final norm h (the loss's stage)."""
    flags, doc, world, version = job
    pp = int(flags[flags.index("--pipeline-model-parallel-size") + 1])
    if pp == 1:
        reject()
    blocks = doc["block_configs"]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(blocks)), min_size=pp - 1, max_size=pp - 1)))
    bounds = [0, *cuts, len(blocks)]
    stages = [("E" if p == 0 else "") + "t" * (bounds[p + 1] - bounds[p]) + ("L" if p == pp - 1 else "")
              for p in range(pp)]
    if "full" in flags:
        # (a chunk of one block or none: one layer per checkpoint)
        i = flags.index("--recompute-method")
        flags = flags[:i] + ["--recompute-method", "uniform", "--recompute-num-layers", "1"] + flags[i + 4:]
    L = _with_config(flags + ["--pipeline-model-parallel-layout", "|".join(stages)], doc, world, version)
    tp, h, heads = L.tp, doc["hidden_size"], doc["num_attention_heads"]
    emb = L.padded_vocab_size // tp * h
    for p in range(pp):
        want = sum(_block_params(b, h, heads, tp) for b in blocks[bounds[p]:bounds[p + 1]])
        want += (emb if p == 0 else 0) + (emb + h if p == pp - 1 else 0)
        assert stage_states(L, p).parameters == want, (p, stages)
