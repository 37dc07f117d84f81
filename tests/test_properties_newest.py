"""Properties of the newest features on the dense space (tests/property_space.py specs): LoRA / DoRA fine-tuning
(resolve/peft.py, estimator/peft.py; the adapters as Megatron-Bridge 0.6.2 builds them, megatron/bridge/peft/
lora.py, dora.py, utils.py ParallelLinearAdapter), multi-token prediction on its own pipeline stage ('m' in
--pipeline-model-parallel-layout), and every term a documented name.

Derandomized; MEMGUARD_PROPERTY_EXAMPLES sets the count (default 200, these use a quarter).
"""
from __future__ import annotations

import json
import os

from hypothesis import HealthCheck, given, reject, settings, strategies as st

from megatron_memguard import estimate, layout_from_flags, resolve
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.peft import adapter_param_count, stage_peft_states
from megatron_memguard.estimator.result import GROUPS
from megatron_memguard.estimator.states import stage_states
from megatron_memguard.layout import TensorKind
from megatron_memguard.readers.megatron_flags import parse_megatron_flags

from property_space import Spec, feature_specs, moe_specs, specs
from megatron_memguard.gpus import GPUS
from test_properties_features import _moe_counts, layout as moe_layout
from megatron_memguard.estimator.params import total_parameters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))
QUARTER = settings(derandomize=True, database=None, deadline=None, max_examples=max(1, EXAMPLES // 4),
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _resolve(flags: list[str], world: int, **peft):
    raw = parse_megatron_flags(flags)
    if peft:
        # Megatron-LM has no PEFT flags: the Bridge / NeMo readers set these dests (resolve/peft.py)
        raw = raw.with_args(**peft)
    try:
        return resolve(raw, world_size=world, megatron_version="0.19")
    except (ConfigError, ConfigErrors, NotModelledError) as e:
        errors = e.errors if isinstance(e, ConfigErrors) else [e]
        for err in errors:
            text = str(err)
            assert "\n" not in text and len(text) < 400, text
        reject()


@st.composite
def peft_jobs(draw):
    """A dense TE job (Bridge builds TE layers) with LoRA or DoRA: a rank TP divides when a column-parallel
    linear is wrapped (ColumnParallelLinear(in, r) splits r), DoRA without dropout (not modelled)."""
    s = draw(specs(max_layers=8)).with_(impl="transformer_engine", distribute_saved=False)
    scheme = draw(st.sampled_from(["lora", "dora"]))
    targets = tuple(t for t in TARGETS if draw(st.booleans())) or ("linear_qkv",)
    dim = s.tp * draw(st.sampled_from([1, 2, 4, 8]))
    dropout = 0.0 if scheme == "dora" else draw(st.sampled_from([0.0, 0.0, 0.1]))
    return s, dict(peft_scheme=scheme, peft_dim=dim, peft_target_modules=list(targets), peft_dropout=dropout)


def _hand_adapters(s: Spec, L, peft: dict) -> tuple[int, int]:
    """(trainable parameters of the whole model, of one TP rank summed over the pipeline stages), by hand:
    r (in + out) per wrapped linear; DoRA adds the wrapped weight's output rows (its magnitude), whole on every
    TP rank for the row-parallel linears (the norms of the local [out, in / TP] rows)."""
    h, a, d, g = s.hidden, s.heads, s.kv_channels, s.groups or s.heads
    ffn_out = s.ffn * (2 if s.swiglu else 1)
    shapes = {"linear_qkv": (h, (a + 2 * g) * d), "linear_proj": (a * d, h), "linear_fc1": (h, ffn_out),
              "linear_fc2": (s.ffn, h)}
    r, t, dora = peft["peft_dim"], s.tp, peft["peft_scheme"] == "dora"
    total = per_rank = 0
    for name in peft["peft_target_modules"]:
        i, o = shapes[name]
        total += r * (i + o) + (o if dora else 0)
        per_rank += r * (i + o) // t + ((o // t if name in ("linear_qkv", "linear_fc1") else o) if dora else 0)
    return total * s.layers, per_rank * s.layers


@QUARTER
@given(peft_jobs())
def test_peft_trains_only_the_adapters_of_the_hand_count(job):
    """LoRA / DoRA: the adapters are r (in + out) per wrapped linear (DoRA: and the magnitude), per TP rank
    their / TP; the base weights are the same parameters as the full run's, frozen: no gradient buffer, main
    copy or optimizer state for them (megatron-core's DDP buffers only parameters that require grad), so every
    stage's weights + gradients + optimizer bytes are below the full run's when the adapters are fewer than half
    the base (a rank r near the hidden size can make them more), and its gradient buffer holds the adapters only. (The whole peak is not always below the full run's: the adapters keep their [s b, r]
    intermediates, under SP the whole-sequence input TE gathers for a column-parallel adapter, TP times the base's
    shard, and with dropout a copy of their input; their input gradients come next to the base's in backward. On
    activation-heavy jobs, 25% of the stages drawn here, these outweigh the states saved.)"""
    s, peft = job
    full = _resolve(s.flags(), s.world)
    L = _resolve(s.flags(), s.world, **peft)
    total, per_rank = _hand_adapters(s, L, peft)
    assert adapter_param_count(L) == total
    ranks = [stage_peft_states(L, p, stage_states(full, p).parameters) for p in range(L.pp)]
    assert sum(ps.adapter_params for ps in ranks) == per_rank
    ef, ep = estimate(full), estimate(L)
    nb = L.precision.byte_sizes()
    for p, (sf, sp_) in enumerate(zip(ef.stages, ep.stages)):
        # the frozen base: the full run's parameters, in the model dtype, outside DDP's buffers
        assert sp_.breakdown["parameters"] == stage_states(full, p).parameters * nb[TensorKind.PARAM]
        # the gradient buffer holds the adapters (and their bucket padding) only
        ps = ranks[p]
        assert ps.buffer_unpadded == ps.adapter_params
        assert sp_.breakdown.get("gradient_buffer", 0) == ps.buffer_numel * nb[TensorKind.MAIN_GRAD]
        # a frozen base element keeps its weight (2 B) and frees its gradient and optimizer state (at least 4 + 4 B
        # with Adam or SGD, the optimizer sharded or not); an adapter element costs all of them: with fewer adapters
        # than half the base (r small against the linears' sizes, Bridge's use) PEFT holds less
        if 2 * ps.adapter_params < ps.base_params:
            states = ("weights", "gradients", "optimizer")
            assert sum(t.bytes for t in sp_.terms if str(t.group) in states) < sum(
                t.bytes for t in sf.terms if str(t.group) in states)


_INPUT = {"linear_qkv": "qkv_input", "linear_proj": "proj_input", "linear_fc1": "fc1_input", "linear_fc2": "fc2_input"}


@QUARTER
@given(peft_jobs())
def test_a_frozen_layer_keeps_its_adapters_inputs_and_intermediates(job):
    """Without sequence parallelism or adapter dropout, a layer under LoRA / DoRA keeps what the full layer keeps,
    less the inputs of the frozen linears no adapter wraps (TE 2.11 module/linear.py: ``backward_needs_input =
    weight.requires_grad``; linear_proj's input stays when the cuDNN fused attention or its CP ring keeps its output,
    the same storage), plus one [s b, r] intermediate per adapter (its linear_out's input); DoRA also keeps each wrapped
    linear's output for ``mag_norm_scale * (base + adapter)``."""
    from megatron_memguard.estimator.activations import layer_activations
    from megatron_memguard.estimator.layers.attention import attention_keeps_proj_input
    s, peft = job
    s = s.with_(sp=False, recompute=())
    peft = dict(peft, peft_dropout=0.0)
    full = _resolve(s.flags(), s.world)
    L = _resolve(s.flags(), s.world, **peft)
    a, b = layer_activations(full).saved, layer_activations(L).saved
    tf = s.seq // s.cp * s.mbs                   # tokens of the micro-batch on this rank (no SP: whole)
    e = 4 if s.precision == "fp32" else 2
    r = peft["peft_dim"]
    targets = peft["peft_target_modules"]
    dropped = {_INPUT[t] for t in _INPUT if t not in targets}
    if attention_keeps_proj_input(a):
        dropped.discard("proj_input")
    want = {k: v for k, v in a.items() if k not in dropped}
    want["lora_intermediates"] = len(targets) * tf * r * e
    if peft["peft_scheme"] == "dora":
        h, g, d, heads = s.hidden, s.groups or s.heads, s.kv_channels, s.heads
        out = {"linear_qkv": (heads + 2 * g) * d // s.tp, "linear_proj": h,
               "linear_fc1": s.ffn * (2 if s.swiglu else 1) // s.tp, "linear_fc2": h}
        want["dora_scaled_outputs"] = sum(tf * out[t] * e for t in targets)
    assert b == want


@QUARTER
@given(peft_jobs(), st.sampled_from(["mbs", "seq"]))
def test_a_larger_micro_batch_or_sequence_never_lowers_a_peft_stage_peak(job, what):
    """Under LoRA / DoRA every kept tensor (the adapters' inputs and intermediates, DoRA's scaled outputs, the
    frozen layers' remaining saved tensors) and every working set grows with the micro-batch's tokens: one more
    sequence per micro-batch, or twice the sequence, never lowers a stage's peak."""
    s, peft = job
    bigger = s.with_(mbs=s.mbs + 1) if what == "mbs" else s.with_(seq=2 * s.seq)
    a = estimate(_resolve(s.flags(), s.world, **peft))
    b = estimate(_resolve(bigger.flags(), bigger.world, **peft))
    for sa, sb in zip(a.stages, b.stages):
        assert sb.peak_allocated_bytes >= sa.peak_allocated_bytes


# ---------------------------------------------------------------------------------------------------
# Latent MoE

@QUARTER
@given(moe_specs(), st.sampled_from([8, 16, 32]))
def test_latent_moe_parameters_over_tp_ep_etp_and_pp_ranks_add_up(fs, latent):
    """--moe-latent-size (megatron-core 0.19.2 transformer/moe/moe_layer.py, experts.py): each MoE layer gains
    fc1_latent_proj [latent, h] and fc2_latent_proj [h, latent] (and their biases with --add-bias-linear), TELinear
    "duplicated" (whole on every TP rank),
    and its routed experts work at the latent width (fc1 [g F / ETP, latent], fc2 [latent, F / ETP], fc2's bias
    latent wide, whole on each ETP rank); the router and the shared experts keep the full width. One rank of each
    stage summed over the stages, and the model's total, are the plain model's hand count plus that difference
    (tests/test_properties_features.py _moe_counts counts the plain model from megatron-core's modules)."""
    b = fs.base
    fs_lat = fs.with_(extra=fs.extra + ("--moe-latent-size", str(latent)))
    L0, L = moe_layout(fs), moe_layout(fs_lat)
    per_rank, total, _ = _moe_counts(fs, L0)
    h, F, E, gl = b.hidden, fs.moe_ffn, fs.experts, 2 if b.swiglu else 1
    n_moe = sum(fs.moe_pattern())

    def experts(width: int) -> tuple[int, int]:    # (split over ETP, whole on each ETP rank) of one expert
        return gl * F * width + width * F + (gl * F if b.bias else 0), (width if b.bias else 0)

    (s_lat, w_lat), (s_h, w_h) = experts(latent), experts(h)
    # the projections' biases (latent and h) with --add-bias-linear (moe_layer.py: bias=config.add_bias_linear)
    proj = 2 * latent * h + ((latent + h) if b.bias else 0)
    d_rank = n_moe * (proj + (E // fs.ep) * ((s_lat - s_h) // fs.etp + w_lat - w_h))
    d_total = n_moe * (proj + E * (s_lat - s_h + w_lat - w_h))
    assert total_parameters(L) == total + d_total
    assert sum(stage_states(L, p).parameters for p in range(L.pp)) == per_rank + d_rank


# ---------------------------------------------------------------------------------------------------
# Capacity factor

@QUARTER
@given(moe_specs(), st.sampled_from([1.0, 1.5, 4.0]))
def test_a_capacity_that_drops_nothing_at_balanced_routing_is_the_dropless_estimate(fs, factor):
    """With the alltoall dispatcher, a capacity factor >= 1 gives each expert C = ceil(T k / E x factor) >= T k / E
    slots per source rank (moe_utils.py get_capacity / apply_router_token_dropping, megatron-core 0.16.1 and 0.19.2):
    balanced routing drops no token, so every term of every stage is the dropless estimate's. The worst case is
    bounded by the capacity instead: C E ETP rows, never more than dropless's worst, T ETP EP min(k, E / EP);
    padded to capacity (--moe-pad-expert-input-to-capacity) the rows are exactly C E ETP, never below balanced."""
    if fs.dispatcher != "alltoall":
        fs = fs.with_(dispatcher="alltoall")
    drop = estimate(moe_layout(fs.with_(capacity=None, pad=False)))
    cap = estimate(moe_layout(fs.with_(capacity=factor, pad=False)))
    pad = estimate(moe_layout(fs.with_(capacity=factor, pad=True)))
    for a, b, c in zip(drop.stages, cap.stages, pad.stages):
        assert b.breakdown == a.breakdown and b.peak_allocated_bytes == a.peak_allocated_bytes
        assert b.moe["expert_rows_balanced"] == a.moe["expert_rows_balanced"]
        assert b.moe["expert_rows_worst"] <= a.moe["expert_rows_worst"]
        assert c.moe["expert_rows_balanced"] == c.moe["expert_rows_worst"] >= a.moe["expert_rows_balanced"]


# ---------------------------------------------------------------------------------------------------
# The attention kernel --attention-backend auto runs on each GPU

@QUARTER
@given(feature_specs(), st.sampled_from(sorted(GPUS)))
def test_auto_attention_is_the_kernel_it_selects_on_each_gpu(fs, gpu_name):
    """--attention-backend auto is Transformer Engine's choice on the GPU (estimator/attention_backend.py: flash-attn 2
    below sm90 and for Blackwell deterministic training with dropout, cuDNN fused otherwise, TE 2.11 / 2.20.2
    get_attention_backend): the estimate on that GPU is, term by term, the estimate with that kernel asked for by
    name (its selection's 'selected' in the JSON)."""
    from megatron_memguard.estimator.attention_backend import select
    gpu = GPUS[gpu_name]
    base = fs.base.with_(backend="auto")
    L = moe_layout(fs.with_(base=base))
    chosen = select(L, gpu).selected
    if chosen not in ("flash", "fused"):
        reject()
    Lx = moe_layout(fs.with_(base=base.with_(backend=chosen)))
    try:
        a = estimate(L, gpu=gpu)
    except ConfigError as e:
        # the GPU cannot run the job (FP8 / FP4 below sm89): one line naming --gpu
        assert str(e).startswith("--gpu: ") and "\n" not in str(e), str(e)
        reject()
    b = estimate(Lx, gpu=gpu)
    for sa, sb in zip(a.stages, b.stages):
        assert sa.breakdown == sb.breakdown, (gpu_name, chosen)


# ---------------------------------------------------------------------------------------------------
# Megatron-FSDP over a one-rank group

@QUARTER
@given(specs(max_layers=6))
def test_megatron_fsdp_over_one_rank_shards_nothing(s):
    """With DP x CP = 1 every Megatron-FSDP group is one rank: sharding the optimizer state, and the gradients too,
    divides by 1 (megatron_fsdp param_and_grad_buffer.py, core 0.19.2: the shard of a one-rank group is the whole
    buffer), so 'optim' and 'optim_grads' estimate alike, term by term; 'optim_grads_params' has nothing to gather
    (from core 0.17.1 ``is_data_distributed`` needs a group of more than one rank: its weight buffer serves as the
    unit's bucket), so no unsharded-parameter or double buffers appear, and its weights and gradients differ from
    'optim' only by bucket padding: each group is padded to its chunk_size_factor, the lcm of its row widths
    (_get_parameter_groups step 3), so by less than lcm(h, a d, ffn) elements per group, one group per layer and a
    few outside the units (embedding, final norm and output layer)."""
    import math
    s = s.with_(impl="transformer_engine", dp=1, cp=1, rope=True, distribute_saved=False, dist_opt=True, instances=1)
    est, lay = {}, {}
    for k in ("optim", "optim_grads", "optim_grads_params"):
        lay[k] = _resolve(s.flags() + ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor",
                                       "--data-parallel-sharding-strategy", k], s.world)
        est[k] = estimate(lay[k])
    L = lay["optim"]
    nb = L.precision.byte_sizes()
    row = math.lcm(s.hidden, s.heads * s.kv_channels, s.ffn)
    for a, b, c in zip(est["optim"].stages, est["optim_grads"].stages, est["optim_grads_params"].stages):
        assert a.breakdown == b.breakdown
        assert not {"fsdp_unsharded_parameters", "fsdp_double_buffers", "fsdp_gathered_after_step"} & set(c.breakdown)
        groups = a.num_layers + 4
        assert abs(c.breakdown["fsdp_parameters"] - a.breakdown["fsdp_parameters"]) < groups * row * nb[TensorKind.PARAM]
        assert c.breakdown["fsdp_parameters"] >= stage_states(L, a.pp_rank).parameters * nb[TensorKind.PARAM]


# ---------------------------------------------------------------------------------------------------
# MoE upcycling (megatron-core 0.16)

def _strip_moe(flags: list[str], ffn: int) -> list[str]:
    """The dense model megatron/training builds for upcycling: the same flags without the MoE ones, FFN ffn."""
    out, skip = [], 0
    valued = {"--num-experts", "--moe-router-topk", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
              "--moe-ffn-hidden-size", "--moe-token-dispatcher-type", "--moe-shared-expert-intermediate-size",
              "--moe-layer-freq", "--moe-expert-capacity-factor", "--moe-flex-dispatcher-backend"}
    for i, f in enumerate(flags):
        if skip:
            skip -= 1
            continue
        if f in valued:
            skip = 1
            continue
        if f.startswith("--moe-"):
            continue
        out.append(f)
    i = out.index("--ffn-hidden-size")
    out[i + 1] = str(ffn)
    return out


@QUARTER
@given(moe_specs(), st.sampled_from([1, 2]))
def test_upcycling_adds_a_startup_figure_of_both_models(fs, g):
    """--moe-use-upcycling (megatron/training training.py setup_model_and_optimizer, upcycling_utils.py, core 0.16.1):
    training is the MoE run's, term by term; the start-up holds the MoE model's weights, gradient buffer and main
    parameters, the dense model (the same job without experts, FFN x granularity, EP 1) wrapped in DDP, and both state
    dicts deep-copied in the parameter dtype; the stage needs the larger of training and start-up."""
    b = fs.base
    # upcycling_utils: every layer MoE, no virtual stages, the dense FFN x g a multiple of the expert FFN, whose
    # ratio divides the experts; no capacity, shared experts or the legacy grouped GEMM
    fs = fs.with_(freq=None, capacity=None, pad=False, shared_ffn=0, shared_gate=False, moe_ffn=b.ffn * g // 2
                  if (b.ffn * g) % 2 == 0 and fs.experts % 2 == 0 else b.ffn * g)
    fs = fs.with_base(vpp=None, recompute=() if b.vpp else b.recompute,
                      microbatches=b.microbatches if not b.vpp else 1)
    up = ["--moe-use-upcycling", "--moe-upcycling-granularity", str(g), "--save", "/ckpt/moe"]
    try:
        plain = layout_from_flags(fs.flags(), world_size=fs.world, megatron_version="0.16")
        L = layout_from_flags(fs.flags() + up, world_size=fs.world, megatron_version="0.16")
    except (ConfigError, ConfigErrors, NotModelledError) as e:
        text = str(e)
        assert text.startswith("--") and "\n" not in text, text
        reject()
    # (its recompute settings do not change its parameters or gradient buffer: left out, 'moe_act' needs experts)
    dense = layout_from_flags(_strip_moe(fs.with_base(recompute=()).flags(), b.ffn * g), world_size=fs.world,
                              megatron_version="0.16")
    p_bytes = L.precision.byte_sizes()[TensorKind.PARAM]
    for s0, s in zip(estimate(plain).stages, estimate(L).stages):
        assert s.breakdown == s0.breakdown
        terms = {t["name"]: t["bytes"] for t in s.startup["terms"]}
        d, m = stage_states(dense, s.pp_rank), stage_states(L, s.pp_rank)
        assert terms["upcycling_dense_model"] == d.param_bytes + d.grad_bytes
        assert terms["upcycling_state_dict_copies"] == (d.parameters + m.parameters) * p_bytes
        assert terms["upcycling_moe_model_state"] == (s.breakdown["parameters"] + s.breakdown["gradient_buffer"]
                                                      + s.breakdown.get("main_parameters", 0))
        assert s.required_device_bytes == max(s.device_total_bytes, s.startup["device_total_bytes"])
        for name in terms:
            assert os.path.exists(os.path.join(ROOT, "docs", "terms", name + ".md")), name


# ---------------------------------------------------------------------------------------------------
# Multi-token prediction on its own pipeline stage

@st.composite
def mtp_layouts(draw):
    """--pipeline-model-parallel-layout strings with D MTP layers 'm' in one stage of a rank's last virtual stage,
    no decoder layer after them (PipelineParallelLayerLayout.validate_layer_layout, core 0.16.1 to 0.19.2)."""
    pp = draw(st.integers(2, 5))
    vpp = draw(st.sampled_from([1, 1, 2]))
    n = pp * vpp
    j = draw(st.integers((vpp - 1) * pp, n - 1))           # the stage of the MTP block
    depth = draw(st.integers(1, 2))
    counts = [draw(st.integers(0, 2)) if i <= j else 0 for i in range(n)]
    if not sum(counts):
        counts[0] = 1
    stages = ["t" * c for c in counts]
    stages[j] += "m" * depth
    stages[0] = "E" + stages[0]
    stages[-1] += "L"
    return "|".join(stages), pp, vpp, j, depth, sum(counts)


@QUARTER
@given(mtp_layouts(), st.sampled_from([1, 2]), st.booleans(), st.sampled_from([64, 128]))
def test_mtp_anywhere_parameters_over_the_stages_add_up(lay, tp, untied, h):
    """Wherever the layout puts the MTP block, one TP rank of every stage together holds each decoder layer and
    each MTP depth once (layer + enorm + hnorm + its final norm + eh_proj [h, 2h] / TP), the final norm once, and the
    vocabulary-parallel word embedding V h / TP on every chunk that embeds: the first (pre_process) and the MTP
    block's (GPTModel builds its embedding when pre_process or mtp_process, gpt_model.py, core 0.19.2), plus the
    output layer on the last (its own weight unless that chunk is also pre_process: never, PP > 1). By hand."""
    layout_str, pp, vpp, j, depth, n_dec = lay
    F, heads, kv = 128, 4 * tp, 16
    f = ["--transformer-impl", "transformer_engine", "--num-layers", str(n_dec), "--hidden-size", str(h),
         "--num-attention-heads", str(heads), "--kv-channels", str(kv), "--ffn-hidden-size", str(F),
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
         "--global-batch-size", str(2 * pp), "--tensor-model-parallel-size", str(tp),
         "--pipeline-model-parallel-size", str(pp), "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
         "--bf16", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0", "--mtp-num-layers", str(depth),
         "--pipeline-model-parallel-layout", layout_str] + (["--sequence-parallel"] if tp > 1 else []) + (
        ["--untie-embeddings-and-output-weights"] if untied else [])
    L = _resolve(f, tp * pp)
    V = L.padded_vocab_size
    # a layer on one TP rank: fused norms h (replicated), linear_qkv 3 a d x h, linear_proj h x a d, fc1 2 F x h,
    # fc2 h x F, split over TP
    layer = 2 * h + (3 * heads * kv * h + h * heads * kv + 2 * F * h + h * F) // tp
    mtp_depth = layer + 3 * h + 2 * h * h // tp
    embeds = 2 + (j != 0)
    want = n_dec * layer + depth * mtp_depth + h + embeds * V * h // tp
    assert sum(stage_states(L, p).parameters for p in range(pp)) == want


# ---------------------------------------------------------------------------------------------------
# Directions a Megatron user expects, with every feature

def _both(a, b):
    try:
        return (layout_from_flags(a.flags(), world_size=a.world, megatron_version="0.19"),
                layout_from_flags(b.flags(), world_size=b.world, megatron_version="0.19"))
    except (ConfigError, ConfigErrors, NotModelledError):
        reject()


@QUARTER
@given(feature_specs())
def test_twice_the_tensor_parallelism_with_sp_never_raises_a_stage_peak(fs):
    """The same world with TP doubled and DP halved, sequence parallelism on: every sharded weight, gradient and
    optimizer shard per rank is the same or half (P / (TP DP) for the distributed optimizer's), every saved
    tensor of a layer is divided by TP (SP) or kept whole, the vocabulary per rank shrinks (padded to a multiple of
    128 x TP, ceil(V / 128 TP) x 128 is non-increasing), and the SP all-gather buffer is [s b, h] whatever TP:
    no stage's allocated peak grows (dense, MoE with ETP 1, FP8, MTP, offloading, CUDA graphs, Megatron-FSDP). Not
    where the doubled TP exceeds the key groups: Attention then all-gathers the whole qkv projection and q, k, v are
    views of it (get_query_key_value_tensors), TP times the rank's own output
    (test_twice_the_tensor_parallelism_past_the_key_groups_gathers_the_projection_by_hand)."""
    s = fs.base
    t2, g = 2 * s.tp, s.groups or s.heads
    if s.dp % 2 or s.heads % t2 or g < t2 or g % t2 or s.ffn % t2 or (s.seq // s.cp) % t2 or (2 * g * s.kv_channels) % t2:
        reject()
    if fs.experts and (fs.etp != 1 or fs.shared_ffn % t2):
        reject()
    La, Lb = _both(fs.with_base(sp=s.tp > 1), fs.with_base(tp=t2, dp=s.dp // 2, sp=True))
    for sa, sb in zip(estimate(La).stages, estimate(Lb).stages):
        assert sb.peak_allocated_bytes <= sa.peak_allocated_bytes


def test_twice_the_tensor_parallelism_past_the_key_groups_gathers_the_projection_by_hand():
    """The case props8's sweep drew (seed 2026113001, 400 examples) for the property above: one layer, h 64, 16 heads
    of d 8 in 8 key groups, s 64 x b 2 = 128 tokens, bf16, TE. At TP 8 each rank's q, k, v are views of its own
    linear_qkv output, (16 + 2 x 8) x 8 / 8 = 32 wide: 128 x 32 x 2 = 8,192 B. At TP 16 the 8 groups are fewer than
    the ranks: Attention all-gathers the whole projection, (16 + 16) x 8 = 256 wide, and slices its group from it
    (get_query_key_value_tensors, megatron-core 0.16.1 / 0.19.2): 65,536 B kept through the views."""
    from megatron_memguard.estimator.activations import layer_activations
    base = Spec(tp=8, dp=2, layers=1, heads=16, groups=8, kv_channels=8, hidden=64, ffn=64, seq=64, mbs=2, vocab=8)
    L8 = layout_from_flags(base.with_(sp=True).flags(), world_size=16, megatron_version="0.19")
    L16 = layout_from_flags(base.with_(tp=16, dp=1, sp=True).flags(), world_size=16, megatron_version="0.19")
    assert layer_activations(L8).saved["qkv_output"] == 128 * 32 * 2 == 8_192
    assert layer_activations(L16).saved["qkv_output"] == 128 * 256 * 2 == 65_536


@QUARTER
@given(feature_specs())
def test_the_distributed_optimizer_over_twice_the_ranks_never_raises_a_stage_peak(fs):
    """Twice the data-parallel ranks with the distributed optimizer: each rank's optimizer shard halves (up to the
    buckets' padding to lcm(DP, 128)), nothing else per rank grows, so no stage's allocated peak does. Not asserted under Megatron-FSDP's 'optim' / 'optim_grads' strategies: their whole
    weights sit in buckets padded to a multiple of DP x CP x chunk_size_factor (megatron_fsdp
    param_and_grad_buffer.py), padding that grows with DP (+2 MB on 1.5 GB of weights at DP x CP 96 here)."""
    if any(x in fs.extra for x in ("optim", "optim_grads")) or fs.base.instances > 1:
        reject()
    a = fs.with_base(dist_opt=True)
    La, Lb = _both(a, a.with_base(dp=2 * a.base.dp))
    for sa, sb in zip(estimate(La).stages, estimate(Lb).stages):
        assert sb.peak_allocated_bytes <= sa.peak_allocated_bytes
