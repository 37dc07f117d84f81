"""Hypothesis strategies over the layout space Megatron accepts (tests/test_properties.py).

A ``Spec`` is one training job in Megatron's own terms; ``Spec.flags()`` writes it as the
pretrain_gpt.py command line memguard reads. The strategy builds specs that satisfy Megatron's
start-up rules by construction (validate_args, TransformerConfig / ModelParallelConfig
``__post_init__``, megatron-core's model-build asserts), so that every drawn example is a job Megatron
would start, reaching the corners the measured data never visit: DP x CP = 1, PP = number of layers,
the largest VPP (one layer per virtual stage), uneven first/last stages, CP up to 16, TP up to 64,
MBS up to 16, every recompute variant, fp16/bf16/fp32, tied and untied, vocabularies from 8 to 10^6
tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hypothesis import strategies as st


@dataclass(frozen=True)
class Spec:
    impl: str = "transformer_engine"
    backend: str = "auto"
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    layers: int = 2
    first: int | None = None          # --decoder-first-pipeline-num-layers
    last: int | None = None           # --decoder-last-pipeline-num-layers
    vpp: int | None = None            # --num-virtual-stages-per-pipeline-rank
    heads: int = 4
    groups: int | None = None         # --num-query-groups (GQA) or None (MHA)
    kv_channels: int = 16
    hidden: int = 64
    ffn: int = 256
    seq: int = 128
    mbs: int = 1
    microbatches: int = 1
    precision: str = "bf16"           # bf16 | fp16 | fp32
    untied: bool = False
    vocab: int = 1000
    recompute: tuple = ()             # () | ("selective", modules) | ("full", method, layers)
    sp: bool = False
    dist_opt: bool = False
    instances: int = 1
    overlap_grad_reduce: bool = False
    swiglu: bool = False
    rmsnorm: bool = False
    rope: bool = False
    bias: bool = True
    dropout: float = 0.0
    fp32_residual: bool = False
    distribute_saved: bool = False
    optimizer: str = "adam"

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def flags(self) -> list[str]:
        f = ["--transformer-impl", self.impl, "--num-layers", str(self.layers), "--hidden-size", str(self.hidden),
             "--num-attention-heads", str(self.heads), "--kv-channels", str(self.kv_channels),
             "--ffn-hidden-size", str(self.ffn), "--seq-length", str(self.seq),
             "--max-position-embeddings", str(self.seq), "--micro-batch-size", str(self.mbs),
             "--global-batch-size", str(self.mbs * self.dp * self.microbatches),
             "--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp),
             "--context-parallel-size", str(self.cp), "--tokenizer-type", "NullTokenizer",
             "--vocab-size", str(self.vocab), "--hidden-dropout", str(self.dropout),
             "--attention-dropout", str(self.dropout), "--optimizer", self.optimizer]
        if self.impl == "transformer_engine":
            f += ["--attention-backend", self.backend]
        if self.precision != "fp32":
            f.append("--" + self.precision)
        if self.first is not None:
            f += ["--decoder-first-pipeline-num-layers", str(self.first)]
        if self.last is not None:
            f += ["--decoder-last-pipeline-num-layers", str(self.last)]
        if self.vpp:
            f += ["--num-virtual-stages-per-pipeline-rank", str(self.vpp)]
        if self.groups is not None:
            f += ["--group-query-attention", "--num-query-groups", str(self.groups)]
        if self.untied:
            f.append("--untie-embeddings-and-output-weights")
        if self.recompute:
            f += ["--recompute-granularity", self.recompute[0]]
            if self.recompute[0] == "selective":
                f += ["--recompute-modules", *self.recompute[1]]
            else:
                f += ["--recompute-method", self.recompute[1], "--recompute-num-layers", str(self.recompute[2])]
        if self.sp:
            f.append("--sequence-parallel")
        if self.dist_opt:
            f.append("--use-distributed-optimizer")
            if self.instances > 1:
                f += ["--num-distributed-optimizer-instances", str(self.instances)]
        if self.overlap_grad_reduce:
            f.append("--overlap-grad-reduce")
        if self.swiglu:
            f.append("--swiglu")
        if self.rmsnorm:
            f += ["--normalization", "RMSNorm"]
        if self.rope:
            f += ["--position-embedding-type", "rope"]
        if not self.bias:
            f.append("--disable-bias-linear")
        if self.fp32_residual:
            f.append("--fp32-residual-connection")
        if self.distribute_saved:
            f.append("--distribute-saved-activations")
        return f

    def with_(self, **kw) -> "Spec":
        return replace(self, **kw)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def specs(draw, max_layers: int = 32) -> Spec:
    impl = draw(st.sampled_from(["transformer_engine", "local"]))
    backend = draw(st.sampled_from(["auto", "flash", "fused", "unfused"])) if impl == "transformer_engine" else "auto"
    tp = draw(st.sampled_from([1, 1, 2, 4, 8, 16, 32, 64]))
    # megatron's local DotProductAttention has no context parallelism (it asserts CP == 1), nor has TE's
    # unfused attention (get_attention_backend disables it under CP: no backend is left, TE 2.11)
    cp = draw(st.sampled_from([1, 1, 2, 4, 8, 16])) if impl == "transformer_engine" and backend != "unfused" else 1
    dp = draw(st.sampled_from([1, 1, 2, 3, 4, 8]))
    # heads divisible by TP; query groups dividing the heads, a multiple or a divisor of TP (validate_args)
    heads = tp * draw(st.sampled_from([1, 2, 3, 4, 8]))
    groups = draw(st.one_of(st.none(), st.sampled_from(
        [g for g in _divisors(heads) if g % tp == 0 or tp % g == 0])))
    # linear_qkv is column-parallel: TP divides its (heads + 2 groups) x head-dim outputs (tensor_parallel
    # layers.py ColumnParallelLinear, divide(output_size, world_size))
    kv = draw(st.sampled_from([k for k in (8, 16, 32, 64, 128) if (2 * (groups or heads) * k) % tp == 0]))
    hidden = draw(st.sampled_from([heads * kv, 64 * draw(st.integers(1, 64))]))
    ffn = tp * 8 * draw(st.integers(1, 64))

    # pipeline: even split, PP = layers, uneven first/last stages; virtual stages up to one layer each
    kind = draw(st.sampled_from(["even", "even", "one_layer_each", "uneven"]))
    first = last = vpp = None
    if kind == "uneven":
        pp = draw(st.integers(2, 8))
        v = draw(st.sampled_from([1, 1, 2]))
        per_mid = v * draw(st.integers(1, 3))
        first = v * draw(st.integers(1, 4)) if draw(st.booleans()) else None
        last = v * draw(st.integers(1, 4)) if (first is None or draw(st.booleans())) else None
        middle = pp - (first is not None) - (last is not None)
        if v > 1 and not middle:
            # no middle stage: megatron-core's interleaved layer offset divides by zero (memguard refuses it)
            last = None
            middle = 1
        layers = (first or 0) + (last or 0) + middle * per_mid
        vpp = v if v > 1 else None
    else:
        pp = draw(st.integers(1, 16)) if kind == "even" else None
        per_stage = draw(st.integers(1, max(1, max_layers // (pp or max_layers))))
        if kind == "one_layer_each":
            layers = draw(st.integers(1, max_layers))
            pp, per_stage = layers, 1
        else:
            layers = pp * per_stage
        if pp > 1 and per_stage > 1 and draw(st.booleans()):
            vpp = draw(st.sampled_from([v for v in _divisors(per_stage) if v > 1]))  # per_stage: the largest
    # the interleaved schedule takes micro-batches in groups of PP and refuses a partial last group
    microbatches = pp * draw(st.integers(1, 3)) if vpp else draw(st.integers(1, 8))

    # sequence: s % 2CP == 0 (CP's load balancing), (s / CP) % TP == 0 (the SP scatter)
    base = math.lcm(2 * cp if cp > 1 else 1, cp * tp)
    seq = base * draw(st.sampled_from([1, 2, 3, 4, 8, 16, 64, 256, 1024]))
    seq = max(seq, base * (-(-16 // base)))      # a few tokens at least
    mbs = draw(st.integers(1, 16))
    precision = draw(st.sampled_from(["bf16", "bf16", "fp16", "fp32"]))
    if backend in ("flash", "fused") and precision == "fp32":
        # Transformer Engine has no flash or fused attention for fp32 q/k/v (refused): what runs is its unfused one
        backend = "unfused"
    if backend in ("auto", "unfused") and precision == "fp32":
        # auto runs TE's unfused attention in fp32 (flash-attn and cuDNN take bf16/fp16 only): no CP either (the
        # sequence drawn for CP is a multiple of TP, which CP 1 needs)
        cp = 1
    vocab = draw(st.sampled_from([8, 1000, 32000, 50257, 128256, 256000, 1_000_000]))

    rec_kind = draw(st.sampled_from(["none", "selective", "full_uniform", "full_block"]))
    recompute: tuple = ()
    if rec_kind == "selective":
        mods = draw(st.lists(st.sampled_from(["core_attn", "mlp", "layernorm"]), min_size=1, max_size=3, unique=True))
        recompute = ("selective", tuple(mods))
    elif rec_kind == "full_uniform":
        recompute = ("full", "uniform", draw(st.integers(1, layers)))
    elif rec_kind == "full_block":
        recompute = ("full", "block", draw(st.integers(0, layers)))
    sp = tp > 1 and draw(st.booleans())
    dist_opt = draw(st.booleans())
    instances = 2 if dist_opt and (dp * cp) % 2 == 0 and draw(st.booleans()) else 1
    return Spec(
        impl=impl, backend=backend, tp=tp, pp=pp, cp=cp, dp=dp, layers=layers, first=first, last=last, vpp=vpp,
        heads=heads, groups=groups, kv_channels=kv, hidden=hidden, ffn=ffn, seq=seq, mbs=mbs,
        microbatches=microbatches, precision=precision, untied=draw(st.booleans()), vocab=vocab,
        recompute=recompute, sp=sp, dist_opt=dist_opt, instances=instances,
        overlap_grad_reduce=draw(st.booleans()), swiglu=draw(st.booleans()), rmsnorm=draw(st.booleans()),
        rope=draw(st.booleans()), bias=draw(st.booleans()), dropout=draw(st.sampled_from([0.0, 0.1])),
        fp32_residual=precision != "fp32" and draw(st.booleans()),
        distribute_saved=bool(recompute) and recompute[0] == "full" and tp > 1 and not sp and draw(st.booleans()),
        optimizer=draw(st.sampled_from(["adam", "adam", "sgd"])),
    )


# ---------------------------------------------------------------------------------------------------
# This round's features: mixture of experts, FP8, Megatron-FSDP, offloading, CUDA graphs, MTP, EP overlap

@dataclass(frozen=True)
class FeatureSpec:
    """A Spec plus the settings of the newer features, written as Megatron flags."""
    base: Spec
    experts: int = 0
    topk: int = 2
    ep: int = 1
    etp: int = 1
    moe_ffn: int = 64
    shared_ffn: int = 0
    shared_gate: bool = False
    dispatcher: str = "alltoall"
    grouped: bool = False
    freq: str | None = None          # --moe-layer-freq (an int or a list expression)
    capacity: float | None = None
    pad: bool = False
    extra: tuple = ()                # more flags (FP8, offload, CUDA graphs, MTP, FSDP, EP overlap)

    @property
    def world(self) -> int:
        return self.base.world

    def moe_pattern(self) -> tuple[bool, ...]:
        """Which layers are MoE (megatron/training/arguments.py moe_freq_type, as written by moe_layer_freq)."""
        n = self.base.layers
        if not self.experts:
            return (False,) * n
        if self.freq is None:
            return (True,) * n
        if self.freq.isdigit():
            return tuple(i % int(self.freq) == 0 for i in range(n))
        k = int(self.freq.split("*")[1].split("+")[0])     # "([0]*k+[1]*m)"
        return (False,) * k + (True,) * (n - k)

    def flags(self) -> list[str]:
        f = self.base.flags()
        if self.experts:
            f += ["--num-experts", str(self.experts), "--moe-router-topk", str(self.topk),
                  "--expert-model-parallel-size", str(self.ep), "--expert-tensor-parallel-size", str(self.etp),
                  "--moe-ffn-hidden-size", str(self.moe_ffn), "--moe-token-dispatcher-type", self.dispatcher]
            if self.dispatcher == "flex":
                f += ["--moe-flex-dispatcher-backend", "deepep"]
            if self.topk == 1:
                f.append("--moe-router-pre-softmax")
            if self.shared_ffn:
                f += ["--moe-shared-expert-intermediate-size", str(self.shared_ffn)]
                if self.shared_gate:
                    f.append("--moe-shared-expert-gate")
            if self.grouped:
                f.append("--moe-grouped-gemm")
            if self.freq is not None:
                f += ["--moe-layer-freq", self.freq]
            if self.capacity is not None:
                f += ["--moe-expert-capacity-factor", str(self.capacity)]
                if self.pad:
                    f.append("--moe-pad-expert-input-to-capacity")
        return f + list(self.extra)

    def with_(self, **kw) -> "FeatureSpec":
        return replace(self, **kw)

    def with_base(self, **kw) -> "FeatureSpec":
        return replace(self, base=replace(self.base, **kw))


@st.composite
def moe_specs(draw, max_per_stage: int = 3) -> FeatureSpec:
    """MoE jobs Megatron builds: EP divides the experts, the world divides into ETP x EP x PP
    (initialize_model_parallel), SP with TP > 1 (MoELayer), biases only with ETP 1, top-k <= experts, top-1 softmax with
    --moe-router-pre-softmax, shared experts without biases (SharedExpertMLP asserts it), the expert
    FFN divisible by ETP, capacity only with a load balancing Megatron allows (aux_loss by default)."""
    tp = draw(st.sampled_from([1, 1, 2, 4]))
    cp = draw(st.sampled_from([1, 1, 2]))
    pp = draw(st.sampled_from([1, 1, 2, 4]))
    per_stage = draw(st.integers(1, max_per_stage))
    layers = pp * per_stage
    vpp = None
    if pp > 1 and per_stage > 1 and draw(st.booleans()):
        vpp = draw(st.sampled_from([v for v in _divisors(per_stage) if v > 1]))
    experts = draw(st.sampled_from([2, 4, 8, 16, 64]))
    ep = draw(st.sampled_from(_divisors(experts)[:5]))
    etp = draw(st.sampled_from([1, tp]))
    dp = draw(st.sampled_from([1, 2])) * (etp * ep // math.gcd(etp * ep, tp * cp))
    heads = tp * draw(st.sampled_from([1, 2]))
    kv = draw(st.sampled_from([16, 32]))
    # biases in MoE layers need ETP 1 (TransformerConfig: "Bias in Moe is only supported when ETP==1")
    bias = draw(st.booleans()) and etp == 1
    shared = 0 if bias else draw(st.sampled_from([0, 0, tp * 16, tp * 48]))
    base_seq = math.lcm(2 * cp if cp > 1 else 1, cp * tp)
    seq = base_seq * draw(st.sampled_from([8, 32, 128]))
    microbatches = pp * draw(st.integers(1, 2)) if vpp else draw(st.integers(1, 4))
    rec_kind = draw(st.sampled_from(["none", "none", "selective", "full"]))
    recompute: tuple = ()
    if rec_kind == "selective":
        pool = ["core_attn", "layernorm", "moe", "moe_act"] + (["shared_experts"] if shared else [])
        recompute = ("selective", tuple(draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))))
    elif rec_kind == "full":
        recompute = ("full", "uniform", draw(st.integers(1, per_stage)))
    base = Spec(impl="transformer_engine", tp=tp, pp=pp, cp=cp, dp=dp, layers=layers, vpp=vpp, heads=heads,
                kv_channels=kv, hidden=heads * kv, ffn=tp * 8 * draw(st.integers(1, 16)), seq=seq,
                mbs=draw(st.integers(1, 4)), microbatches=microbatches, precision=draw(st.sampled_from(["bf16", "bf16", "fp16"])),
                untied=draw(st.booleans()), vocab=draw(st.sampled_from([1000, 32000])), recompute=recompute,
                sp=tp > 1, dist_opt=draw(st.booleans()), swiglu=draw(st.booleans()), rmsnorm=draw(st.booleans()),
                rope=True, bias=bias, overlap_grad_reduce=draw(st.booleans()))
    dispatcher = draw(st.sampled_from(["allgather", "alltoall", "alltoall"] + (["flex"] if etp * ep <= 8 else [])))
    capacity = None
    pad = False
    if dispatcher == "alltoall" and draw(st.booleans()):
        capacity = draw(st.sampled_from([1.0, 1.5, 4.0]))
        pad = draw(st.booleans())
    freq = draw(st.sampled_from([None, None, "2", f"([0]*1+[1]*{layers - 1})" if layers > 1 else None]))
    # moe_act recompute needs the grouped GEMM (TransformerConfig)
    grouped = draw(st.booleans()) or "moe_act" in (recompute[1] if rec_kind == "selective" else ())
    return FeatureSpec(base=base, experts=experts, topk=draw(st.integers(1, min(4, experts))), ep=ep, etp=etp,
                       moe_ffn=etp * 8 * draw(st.integers(1, 8)), shared_ffn=shared,
                       shared_gate=bool(shared) and draw(st.booleans()), dispatcher=dispatcher,
                       grouped=grouped, freq=freq, capacity=capacity, pad=pad)


FP8_RECIPES = [("hybrid", "tensorwise"), ("e4m3", "delayed"), ("hybrid", "blockwise"), ("hybrid", "delayed"),
               ("e4m3", "mxfp8")]


@st.composite
def feature_specs(draw) -> FeatureSpec:
    """A dense or MoE job with some of the newer features on (each drawn where Megatron takes it; what
    memguard's resolver still refuses is a one-line error naming a flag, checked by the tests)."""
    if draw(st.booleans()):
        fs = draw(moe_specs())
    else:
        base = draw(specs(max_layers=12)).with_(impl="transformer_engine", rope=True, backend="auto",
                                               distribute_saved=False)
        if base.precision == "fp32" and base.cp > 1:
            # auto runs TE's unfused attention in fp32, which has no context parallelism (refused)
            base = base.with_(precision="bf16")
        fs = FeatureSpec(base=base)
    extra: list[str] = []
    b = fs.base
    if b.recompute[:1] == ("full",) and draw(st.integers(0, 3)) == 0:
        b = b.with_(recompute=())
        fs = fs.with_(base=b)
    rec = b.recompute
    if draw(st.booleans()):
        # (TransformerConfig: moe_act and layernorm recompute do not work with delayed scaling)
        delayed_ok = not (rec and rec[0] == "selective" and {"moe_act", "layernorm"} & set(rec[1]))
        fmt, recipe = draw(st.sampled_from([r for r in FP8_RECIPES if delayed_ok or r[1] != "delayed"]))
        extra += ["--fp8-format", fmt, "--fp8-recipe", recipe]
        if b.dist_opt and draw(st.booleans()):
            extra.append("--fp8-param-gather")
    elif draw(st.integers(0, 3)) == 0:
        extra += ["--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"]
        if b.dist_opt and draw(st.booleans()):
            extra.append("--fp4-param-gather")
    if draw(st.integers(0, 3)) == 0:
        extra += ["--mtp-num-layers", str(draw(st.integers(1, 2)))]
    if b.dist_opt and draw(st.integers(0, 3)) == 0:
        extra += ["--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction", str(draw(st.sampled_from([0.5, 1.0])))]
    if draw(st.integers(0, 4)) == 0:
        extra += ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules",
                  *draw(st.lists(st.sampled_from(["attn", "mlp"] + (["moe_router"] if fs.experts else [])),
                                 min_size=1, max_size=2, unique=True))]
    # EP overlap (TransformerConfig): the alltoall or flex dispatcher, virtual stages with PP, no full
    # recompute and no 'moe' recompute module
    if (fs.experts and fs.dispatcher in ("alltoall", "flex") and (b.pp == 1 or b.vpp) and rec[:1] != ("full",)
            and "moe" not in (rec[1] if rec else ()) and draw(st.integers(0, 3)) == 0):
        extra.append("--overlap-moe-expert-parallel-comm")
        if draw(st.booleans()):
            extra.append("--delay-wgrad-compute")
    if not fs.experts and draw(st.integers(0, 3)) == 0:
        # (validate_args, core 0.19.2: Megatron-FSDP requires the fsdp_dtensor checkpoint format)
        extra += ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--data-parallel-sharding-strategy",
                  draw(st.sampled_from(["no_shard", "optim", "optim_grads", "optim_grads_params"]))]
    return fs.with_(extra=tuple(extra))
