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
    # megatron's local DotProductAttention has no context parallelism (it asserts CP == 1)
    cp = draw(st.sampled_from([1, 1, 2, 4, 8, 16])) if impl == "transformer_engine" else 1
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
