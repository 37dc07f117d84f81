"""Hypothesis strategies over the newest features (tests/test_properties_hybrid.py, test_properties_newest.py):
hybrid Mamba models (--hybrid-layer-pattern with '|' segments, uneven stages, virtual stages) and LoRA / DoRA
fine-tuning of a dense GPT model. Each drawn job is one Megatron (and, for PEFT, Megatron-Bridge 0.6.2) builds:
the constraints are named where they are drawn.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hypothesis import strategies as st


@dataclass(frozen=True)
class HybridSpec:
    segments: tuple[str, ...] = ("M*-",)     # '|' segments of --hybrid-layer-pattern (one: no '|')
    tp: int = 1
    pp: int = 1
    dp: int = 1
    sp: bool = False
    hidden: int = 128
    heads: int = 4                           # attention heads
    groups: int | None = None                # attention query groups
    kv: int = 32
    ffn: int = 256
    mamba_head_dim: int = 32
    mamba_groups: int = 2
    state: int = 16
    seq: int = 256
    mbs: int = 1
    microbatches: int = 1
    untied: bool = True
    rmsnorm: bool = True
    bias: bool = False
    vocab: int = 1024
    precision: str = "bf16"
    dist_opt: bool = False
    recompute: tuple = ()                    # () | ("full", method, n)
    experts: int = 0                          # 'E' layers: experts of --num-experts
    ep: int = 1
    moe_ffn: int = 64
    squared_relu: bool = False
    mtp: str = ""                            # one MTP depth's pattern (after '/': core 0.17+), or none
    mtp_depths: int = 0                      # the '/' parts, each ``mtp``
    mtp_repeated: bool = False               # --mtp-use-repeated-layer: one depth's layers run at every depth

    @property
    def pattern(self) -> str:
        """The main pattern (without the MTP parts)."""
        return "|".join(self.segments)

    @property
    def layers(self) -> int:
        return sum(len(s) for s in self.segments)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def mamba_heads(self) -> int:
        return 2 * self.hidden // self.mamba_head_dim    # MambaMixer: d_inner = 2 h, nheads = d_inner / headdim

    def flags(self) -> list[str]:
        # (written with '=': a pattern starting with '-' is otherwise an option to argparse)
        mtp = "".join("/" + self.mtp for _ in range(self.mtp_depths))
        f = ["--hybrid-layer-pattern=" + self.pattern + mtp, "--hidden-size", str(self.hidden),
             "--num-attention-heads", str(self.heads), "--kv-channels", str(self.kv),
             "--ffn-hidden-size", str(self.ffn), "--seq-length", str(self.seq),
             "--max-position-embeddings", str(self.seq), "--micro-batch-size", str(self.mbs),
             "--global-batch-size", str(self.mbs * self.dp * self.microbatches),
             "--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp),
             "--mamba-state-dim", str(self.state), "--mamba-head-dim", str(self.mamba_head_dim),
             "--mamba-num-groups", str(self.mamba_groups), "--tokenizer-type", "NullTokenizer",
             "--vocab-size", str(self.vocab), "--make-vocab-size-divisible-by", "128",
             "--position-embedding-type", "none", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--" + self.precision]
        if self.groups is not None:
            f += ["--group-query-attention", "--num-query-groups", str(self.groups)]
        if self.sp:
            f.append("--sequence-parallel")
        if self.untied:
            f.append("--untie-embeddings-and-output-weights")
        if self.rmsnorm:
            f += ["--normalization", "RMSNorm"]
        if not self.bias:
            f.append("--disable-bias-linear")
        if self.squared_relu:
            f.append("--squared-relu")
        if self.dist_opt:
            f.append("--use-distributed-optimizer")
        if self.recompute:
            f += ["--recompute-granularity", "full", "--recompute-method", self.recompute[1],
                  "--recompute-num-layers", str(self.recompute[2])]
        if self.experts:
            f += ["--num-experts", str(self.experts), "--moe-router-topk", "2", "--moe-ffn-hidden-size",
                  str(self.moe_ffn), "--expert-model-parallel-size", str(self.ep), "--moe-token-dispatcher-type",
                  "alltoall", "--moe-grouped-gemm"]
        if self.mtp_repeated:
            f.append("--mtp-use-repeated-layer")
        return f

    def with_(self, **kw) -> "HybridSpec":
        return replace(self, **kw)


@st.composite
def hybrid_specs(draw, symbols: str = "M*-", max_segment: int = 4) -> HybridSpec:
    """Hybrid jobs megatron-core 0.19.2 builds: '|' segments a multiple of PP (validate_args; segment i on
    pp rank i % PP, virtual stage i // PP: select_pipeline_segment), or a pattern without '|' whose length PP
    divides; Mamba heads (2 h / head_dim) and groups divisible by TP and heads by groups (MambaMixer);
    attention heads and query groups as for GPT; SP's scatter needs TP | s."""
    tp = draw(st.sampled_from([1, 1, 2, 4]))
    pp = draw(st.sampled_from([1, 1, 2, 3, 4]))
    use_bars = pp > 1 and draw(st.booleans()) or draw(st.integers(0, 4)) == 0
    moe = "E" in symbols and draw(st.booleans())
    alphabet = symbols.replace("E", "") + ("E" if moe else "")
    if use_bars:
        vpp = draw(st.sampled_from([1, 1, 2])) if pp > 1 else 1
        segs = tuple(draw(st.text(alphabet=alphabet, min_size=1, max_size=max_segment)) for _ in range(pp * vpp))
    else:
        per = draw(st.integers(1, max_segment))
        segs = (draw(st.text(alphabet=alphabet, min_size=pp * per, max_size=pp * per)),)
    mamba_groups = tp * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([16, 32]))
    # heads = 2 h / head_dim must be a multiple of the groups (and so of TP)
    unit = mamba_groups * head_dim // math.gcd(2, mamba_groups * head_dim)
    unit = math.lcm(unit, 64)
    hidden = unit * draw(st.integers(1, max(1, 512 // unit)))
    heads = tp * draw(st.sampled_from([1, 2, 4]))
    groups = draw(st.one_of(st.none(), st.sampled_from([g for g in range(1, heads + 1)
                                                         if heads % g == 0 and (g % tp == 0 or tp % g == 0)])))
    kv = draw(st.sampled_from([16, 32]))
    seq = tp * 64 * draw(st.sampled_from([1, 2, 3, 4]))
    dp = draw(st.sampled_from([1, 1, 2, 4]))
    experts, ep = 0, 1
    if any("E" in seg for seg in segs):
        experts = draw(st.sampled_from([2, 4, 8]))
        # initialize_model_parallel: the world (TP PP DP) divides into ETP (= TP) x EP x PP
        ep = draw(st.sampled_from([e for e in (1, 2, 4) if experts % e == 0 and dp % e == 0]))
    rec: tuple = ()
    if draw(st.integers(0, 3)) == 0:
        method = draw(st.sampled_from(["uniform", "block"]))
        rec = ("full", method, draw(st.integers(1, max(1, sum(len(s) for s in segs) // pp))))
    vpp_used = use_bars and len(segs) > pp
    return HybridSpec(
        segments=segs, tp=tp, pp=pp, dp=dp, sp=tp > 1 and (bool(experts) or draw(st.booleans())), hidden=hidden,
        heads=heads, groups=groups, kv=kv, ffn=tp * 32 * draw(st.integers(1, 8)), mamba_head_dim=head_dim,
        mamba_groups=mamba_groups, state=draw(st.sampled_from([16, 32, 64])), seq=seq, mbs=draw(st.integers(1, 4)),
        microbatches=pp * draw(st.integers(1, 2)) if vpp_used else draw(st.integers(1, 4)),
        untied=draw(st.booleans()), rmsnorm=draw(st.booleans()), bias=not experts and draw(st.booleans()),
        vocab=draw(st.sampled_from([1000, 32000])), precision=draw(st.sampled_from(["bf16", "bf16", "fp16"])),
        dist_opt=draw(st.booleans()), recompute=rec, experts=experts, ep=ep, moe_ffn=tp * 16 * draw(st.integers(1, 4)),
        squared_relu=draw(st.booleans()))


@st.composite
def hybrid_mtp_specs(draw) -> HybridSpec:
    """hybrid_specs with multi-token prediction as '/' parts of the pattern (megatron-core 0.17+ parse_hybrid_pattern:
    1-3 depths of one identical pattern of Mamba, attention, MLP and, in an MoE model, MoE layers; no '|' in them),
    sometimes with --mtp-use-repeated-layer. Under full uniform recompute one layer per checkpoint
    (MultiTokenPredictionLayer._checkpointed_forward asserts recompute_num_layers == 1)."""
    hs = draw(hybrid_specs(symbols="M*-E"))
    rec = hs.recompute
    if rec and rec[1] == "uniform":
        rec = ("full", "uniform", 1)
    return hs.with_(mtp=draw(st.text(alphabet="M*-" + ("E" if hs.experts else ""), min_size=1, max_size=3)),
                    mtp_depths=draw(st.integers(1, 3)), mtp_repeated=draw(st.booleans()), recompute=rec)
