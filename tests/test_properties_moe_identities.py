"""Accounting identities that hold exactly for every MoE layout (hypothesis, derandomized), checked against
the model real megatron-core builds rank by rank (tests/e2e/moe_rank_params.py, one process for all
examples): this Python's megatron-core (0.16.1 in the 3.11 venv, 0.19.2 in the 3.12 one) and, when
$MEMGUARD_PY312 or .venv312 names a second Python, that one's too, each against memguard's rules of its era.

The drawn space (``corner_jobs``) reaches what tests/property_space.py's moe_specs does not: multi-latent
attention, MTP layers, --moe-router-enable-expert-bias, dense-first --moe-layer-freq lists, uneven first /
last stages, --pipeline-model-parallel-layout strings (empty stages, MTP before the loss),
--account-for-embedding/loss-in-pipeline-split, with TP, PP, VPP, EP, ETP, CP and DP.

1. parameters: the distinct ranks' parameters, each weighted by its copies, add up to the model's total;
   per rank and per tag (routed expert / TP-split / replicated / tied copy) they are megatron-core's;
2. optimizer state: dense shards over DP x CP and expert shards over world / (ETP x EP x PP) add up to the
   full fp32 state, the buffers padded exactly as param_and_grad_buffer.py pads them (worked out here);
3. placement: the layers, their MoE / dense kinds and the MTP block of every (stage, virtual stage) are
   those megatron-core's block spec builds;
4. activations: doubling the micro-batch doubles exactly the per-token terms; EP moves only expert-side
   terms.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, reject, settings, strategies as st

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.params import (chunk_expert_numels, chunk_numels, chunk_params, holds_mtp,
                                                total_parameters)
from megatron_memguard.estimator.states import stage_states
from megatron_memguard.layout import ShardGroup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))
# derandomized, few examples: the identities are exact, one counter-example is enough
PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=max(1, EXAMPLES // 10),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@dataclass(frozen=True)
class Job:
    """One MoE training job: the Megatron flags memguard reads and the same model for megatron-core."""
    flags: tuple
    world: int
    core: dict = field(hash=False, compare=False)    # tests/e2e/moe_rank_params.py's job (without ranks)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def _pipeline(draw, pp: int, mtp: int) -> dict:
    """How the layers are split over PP stages and virtual stages: even, uneven first/last, an explicit
    layout string, or the embedding / loss counted as layers (get_num_layers_to_build)."""
    kind = draw(st.sampled_from(["even", "uneven", "layout", "account"])) if pp > 1 else "even"
    vpp = draw(st.sampled_from([None, None, 2])) if pp > 1 else None
    v = vpp or 1
    if kind == "even":
        layers = pp * v * draw(st.integers(1, 2))
        return dict(layers=layers, vpp=vpp)
    if kind == "uneven":
        per = v * draw(st.integers(1, 2))
        first = v * draw(st.integers(0, 3)) if draw(st.booleans()) else None
        last = v * draw(st.integers(0, 3)) if (first is None or draw(st.booleans())) else None
        middle = pp - (first is not None) - (last is not None)
        layers = (first or 0) + (last or 0) + middle * per
        if layers == 0 or (vpp and not middle):
            reject()     # (no middle stage with VPP: megatron-core's layer offset divides by zero)
        return dict(layers=layers, vpp=vpp, first=first, last=last)
    if kind == "account":
        emb, loss = draw(st.sampled_from([(True, False), (False, True), (True, True)]))
        layers = pp * v * draw(st.integers(1, 2)) - emb - loss
        if layers < 1:
            reject()
        return dict(layers=layers, vpp=vpp, acc_emb=emb, acc_loss=loss)
    # layout: virtual-stage-major list of pp x v stages, 0..2 decoder layers each, MTP right before the loss or
    # (Megatron's mtp_standalone) on an earlier rank's last virtual stage, no decoder layer after it
    counts = [draw(st.integers(0, 2)) for _ in range(pp * v)]
    at = len(counts) - 1
    if mtp and draw(st.booleans()):
        at = (v - 1) * pp + draw(st.integers(0, pp - 2))
        counts[at + 1:] = [0] * (len(counts) - at - 1)
    if sum(counts) == 0:
        counts[0] = 1
    stages = []
    for i, k in enumerate(counts):
        s = ("E" if i == 0 else "") + "t" * k
        if i == at:
            s += "m" * mtp
        if i == len(counts) - 1:
            s += "L"
        stages.append(s)
    return dict(layers=sum(counts), vpp=vpp, layout="|".join(stages))



@st.composite
def _mla_core(draw) -> dict:
    """A small multi-latent attention shape, as the megatron-core build in tests/e2e takes it."""
    return dict(q_lora=draw(st.sampled_from([None, 32])), kv_lora=32, qk=16, pe=8, v=16, te_down=True)


def _mla_and_pipeline_flags(mla_core: dict | None, pipe: dict) -> list[str]:
    """The Megatron flags of an MLA shape (or none) and of a drawn pipeline split (_pipeline)."""
    f: list[str] = []
    if mla_core:
        f += ["--multi-latent-attention", "--kv-lora-rank", "32", "--qk-head-dim", "16", "--qk-pos-emb-head-dim",
              "8", "--v-head-dim", "16"] + (["--q-lora-rank", str(mla_core["q_lora"])] if mla_core["q_lora"] else [])
    if pipe.get("layout"):
        return f + ["--pipeline-model-parallel-layout", pipe["layout"]]
    if pipe.get("vpp"):
        f += ["--num-virtual-stages-per-pipeline-rank", str(pipe["vpp"])]
    if pipe.get("first") is not None:
        f += ["--decoder-first-pipeline-num-layers", str(pipe["first"])]
    if pipe.get("last") is not None:
        f += ["--decoder-last-pipeline-num-layers", str(pipe["last"])]
    if pipe.get("acc_emb"):
        f.append("--account-for-embedding-in-pipeline-split")
    if pipe.get("acc_loss"):
        f.append("--account-for-loss-in-pipeline-split")
    return f

@st.composite
def corner_jobs(draw) -> Job:
    tp = draw(st.sampled_from([1, 1, 2]))
    cp = draw(st.sampled_from([1, 1, 2]))
    pp = draw(st.sampled_from([1, 2, 2, 3, 4]))
    experts = draw(st.sampled_from([2, 4, 8]))
    ep = draw(st.sampled_from([d for d in _divisors(experts) if d <= 4]))
    etp = draw(st.sampled_from(sorted({1, tp, 2})))
    # the world divides into ETP x EP x PP (initialize_model_parallel)
    dp = draw(st.sampled_from([1, 2])) * (etp * ep // math.gcd(etp * ep, tp * cp))
    mtp = draw(st.sampled_from([0, 0, 1, 2]))
    pipe = draw(_pipeline(pp, mtp))
    layers = pipe["layers"]
    # MLA at any TP: the TE spec memguard models duplicates the down projections (TELinear parallel_mode
    # "duplicated"), which the CPU builder reproduces with a stand-in (moe_rank_params.py _te_down_projections);
    # megatron-core's local spec would split them over TP (memguard refuses MLA with the local implementation)
    mla = draw(st.booleans())
    # (TransformerConfig: "Bias in Moe is only supported when ETP==1")
    bias = draw(st.booleans()) and not mla and etp == 1
    shared = 0 if bias else draw(st.sampled_from([0, 16 * tp, 32 * tp]))
    heads = 2 * tp
    kv = 16
    hidden = 64
    freq_kind = draw(st.sampled_from(["all", "int", "dense_first", "list"]))
    if freq_kind == "all":
        pattern = [1] * layers
    elif freq_kind == "int":
        k = draw(st.integers(1, 3))
        pattern = [int(i % k == 0) for i in range(layers)]
    elif freq_kind == "dense_first":
        k = draw(st.integers(0, layers))
        pattern = [0] * k + [1] * (layers - k)
    else:
        pattern = [int(draw(st.booleans())) for _ in range(layers)]
    if not any(pattern):
        pattern[-1] = 1
    if freq_kind == "int":
        freq_flag, freq_core = str(k), k
    else:
        freq_flag, freq_core = "[" + ",".join(map(str, pattern)) + "]", pattern
    glu = draw(st.booleans())
    norm = draw(st.sampled_from(["RMSNorm", "LayerNorm"]))
    untied = draw(st.booleans())
    expert_bias = draw(st.booleans())
    shared_gate = bool(shared) and draw(st.booleans())
    topk = draw(st.integers(1, min(2, experts)))
    moe_ffn = 8 * etp * draw(st.integers(1, 4))
    ffn = 32 * tp
    seq = 16 * math.lcm(2 * cp if cp > 1 else 1, tp * cp)
    mbs = draw(st.integers(1, 2))
    dist_opt = draw(st.booleans())
    world = tp * cp * pp * dp
    v = pipe.get("vpp") or 1
    gbs = mbs * dp * (pp * draw(st.integers(1, 2)) if v > 1 else draw(st.integers(1, 3)))
    f = ["--transformer-impl", "transformer_engine", "--num-layers", str(layers), "--hidden-size", str(hidden),
         "--num-attention-heads", str(heads), "--kv-channels", str(kv), "--ffn-hidden-size", str(ffn),
         "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", str(mbs),
         "--global-batch-size", str(gbs), "--tensor-model-parallel-size", str(tp),
         "--pipeline-model-parallel-size", str(pp), "--context-parallel-size", str(cp),
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--bf16", "--position-embedding-type", "rope",
         "--normalization", norm, "--num-experts", str(experts), "--moe-router-topk", str(topk),
         "--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", str(etp),
         "--moe-ffn-hidden-size", str(moe_ffn), "--moe-token-dispatcher-type", "alltoall",
         "--moe-layer-freq", freq_flag, "--hidden-dropout", "0", "--attention-dropout", "0"]
    if tp > 1:
        f.append("--sequence-parallel")
    if glu:
        f.append("--swiglu")
    if not bias:
        f.append("--disable-bias-linear")
    if untied:
        f.append("--untie-embeddings-and-output-weights")
    if topk == 1:
        f.append("--moe-router-pre-softmax")
    if expert_bias:
        f += ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"]
    if shared:
        f += ["--moe-shared-expert-intermediate-size", str(shared)]
        if shared_gate:
            f.append("--moe-shared-expert-gate")
    if mtp:
        f += ["--mtp-num-layers", str(mtp)]
    if dist_opt:
        f.append("--use-distributed-optimizer")
        # several optimizer instances split DP x CP and the expert-data-parallel group alike
        # (initialize_model_parallel: intra_partial_expert_data_parallel_size = EDP / instances)
        if (dp * cp) % 2 == 0 and (world // (etp * ep * pp)) % 2 == 0 and draw(st.booleans()):
            f += ["--num-distributed-optimizer-instances", "2"]
    mla_core = draw(_mla_core()) if mla else None
    f += _mla_and_pipeline_flags(mla_core, pipe)
    core = dict(num_layers=layers, hidden_size=hidden, heads=heads, kv_channels=kv, groups=None, ffn=ffn,
                bias=bias, glu=glu, norm=norm, tp=tp, pp=pp, vpp=pipe.get("vpp"), ep=ep, etp=etp, experts=experts,
                moe_ffn=moe_ffn, topk=topk, freq=freq_core, shared_ffn=shared, shared_gate=shared_gate,
                expert_bias=expert_bias, untied=untied, seq=seq, mtp=mtp, mla=mla_core,
                first=pipe.get("first"), last=pipe.get("last"), acc_emb=pipe.get("acc_emb", False),
                acc_loss=pipe.get("acc_loss", False), layout=pipe.get("layout"))
    return Job(flags=tuple(f), world=world, core=core)


def _layout(job: Job, version: str = "0.16"):
    """memguard's Layout of the job, or (a combination memguard refuses) the refusal checked to be one line
    naming a flag and the example dropped."""
    try:
        return layout_from_flags(list(job.flags), world_size=job.world, megatron_version=version)
    except (ConfigError, ConfigErrors, NotModelledError) as e:
        for err in (e.errors if isinstance(e, ConfigErrors) else [e]):
            text = str(err)
            assert "\n" not in text and text.startswith("--") and len(text) < 400, text
        reject()


# ---------------------------------------------------------------------------------------------------
# real megatron-core, one process for every example

class _Core:
    def __init__(self, python: str = sys.executable) -> None:
        import socket
        with socket.socket() as sock:       # a free port for the one-rank gloo group
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=ROOT, MEMGUARD_E2E_PORT=str(port), MASTER_PORT=str(port))
        self.proc = subprocess.Popen([python, os.path.join(ROOT, "tests", "e2e", "moe_rank_params.py"),
                                      "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env)

    def ranks(self, job: Job, L, ranks: list) -> list[dict]:
        # megatron-core takes the vocabulary padded as megatron.training pads it (memguard's, checked elsewhere)
        self.era
        self.proc.stdin.write(json.dumps(dict(job.core, vocab=L.padded_vocab_size, ranks=ranks)) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        assert "error" not in reply, (reply["error"], job.flags)
        return reply["ranks"]

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        while line and not line.startswith("@@"):
            line = self.proc.stdout.readline()
        assert line, "the megatron-core builder stopped"
        return json.loads(line[2:])

    @property
    def era(self) -> str:
        """memguard's --megatron-version for the megatron-core the builder runs (read once)."""
        if not hasattr(self, "_era"):
            v = self._reply()["version"]
            self._era = "0.16" if tuple(int(x) for x in v.split(".")[:2]) < (0, 17) else "0.19"
        return self._era

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _other_python() -> str | None:
    """A second Python with megatron-core (the 3.12 venv tests/run.sh makes, or $MEMGUARD_PY312), so that
    one run checks both eras; None when it is this one or absent."""
    p = os.environ.get("MEMGUARD_PY312") or os.path.join(ROOT, ".venv312", "bin", "python")
    if not os.path.exists(p) or os.path.realpath(p) == os.path.realpath(sys.executable):
        return None
    return p


@pytest.fixture(scope="module", params=["this python", "other python"])
def core(request):
    """The builder in this Python's megatron-core, and in the other venv's (the other era) when there is one."""
    import importlib.util
    if request.param == "this python":
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            pytest.skip("megatron-core is not installed")
        c = _Core()
    else:
        other = _other_python()
        if other is None:
            pytest.skip("no second Python with megatron-core ($MEMGUARD_PY312, .venv312)")
        c = _Core(other)
    yield c
    c.close()


def _diagonal(L) -> list[tuple[int, int, int]]:
    """(TP rank, EP rank, ETP rank) of ranks that together hold every distinct TP shard and every distinct
    (EP, ETP) shard of experts once each."""
    tp, ep, etp = L.tp, L.parallel.expert_model_parallel_size, L.moe.etp
    return [(i % tp, (i // etp) % ep, i % etp) for i in range(max(tp, ep * etp))]


# ---------------------------------------------------------------------------------------------------
# 1 and 3: parameters and placement, rank by rank, against megatron-core's build

def _core_ranks(L) -> list:
    v = L.vpp if L.vpp and L.vpp > 1 else None
    return [[p, c, t, e, x] for p in range(L.pp) for c in (range(v) if v else [None]) for t, e, x in _diagonal(L)]


@PROPERTY
@given(corner_jobs())
def test_parameters_and_placement_rank_by_rank_are_megatron_cores(core, job):
    """Every (pipeline rank, virtual stage) builds in megatron-core 0.16.1 the decoder layers memguard places
    there (numbers and MoE / dense kinds: get_gpt_decoder_block_spec with moe_layer_freq,
    get_transformer_layer_offset or the PipelineParallelLayerLayout), MTP only where mtp_on_this_rank says;
    each rank holds the parameters memguard counts, its routed experts (megatron-core's allreduce=False)
    and the tied output copy (shared_embedding on a later stage) included; and the distinct ranks'
    parameters, weighted by their copies (TP-split once per TP rank, replicated once, experts once per
    (EP, ETP) rank and fc2's bias once per EP rank, the tied copy not at all), add up to memguard's total."""
    L = _layout(job, core.era)
    recs = core.ranks(job, L, _core_ranks(L))
    by_chunk: dict[tuple[int, int], list[dict]] = {}
    for r in recs:
        by_chunk.setdefault((r["rank"][0], r["rank"][1] or 0), []).append(r)
    weighted = 0
    mtp = L.mtp_num_layers or 0
    for p in range(L.pp):
        for c in L.stage_chunks(p):
            rs = by_chunk[(p, c.vpp_rank)]
            r0 = rs[0]
            mine = [(c.first_layer + i, k.mlp == "moe") for i, k in enumerate(c.layer_kinds)]
            assert [tuple(x) for x in r0["layers"]] == mine, (p, c.vpp_rank)
            assert r0["mtp"] == holds_mtp(L, c), (p, c.vpp_rank)
            ps = chunk_params(L, c)
            for r in rs:
                assert r["params"] == sum(q.numel for q in ps), (p, c.vpp_rank, r["rank"])
            assert r0["tags"]["expert"] == sum(q.numel for q in ps if q.expert), (p, c.vpp_rank)
            # the expert DDP buffer holds megatron-core's allreduce=False parameters (EP > 1 or ETP > 1)
            assert r0["tags"]["expert_buffer"] == sum(n for n, _ in chunk_expert_numels(L, c)), (p, c.vpp_rank)
            weighted += sum({tuple(r["rank"][2:3]): r["tags"]["tp_split"] for r in rs}.values())
            weighted += r0["tags"]["replicated"]
            weighted += sum({tuple(r["rank"][3:5]): r["expert_tp"].get("split", 0) for r in rs}.values())
            weighted += sum({r["rank"][3]: r["expert_tp"].get("whole", 0) for r in rs}.values())
    assert weighted == total_parameters(L)
    # --moe-router-enable-expert-bias: each router's fp32 expert_bias and local_tokens_per_expert buffers
    # (moe_router_buffers), the MTP block's MoE layers' included
    est = estimate(L)
    for p in range(L.pp):
        built = sum(r["router_buffers"] for r in recs if r["rank"][0] == p and r["rank"][2:] == [0, 0, 0])
        assert est.stages[p].breakdown.get("moe_router_buffers", 0) == built, p
    assert sum(stage_states(L, p).parameters for p in range(L.pp)) == sum(
        r["params"] for r in recs if r["rank"][2:] == [0, 0, 0])


# ---------------------------------------------------------------------------------------------------
# 2: the optimizer's shards add up to the full state

def _padded_buffer(params: list[tuple[int, bool]], group: int) -> tuple[int, list[tuple[int, int]], list[int]]:
    """_ParamAndGradBuffer.__init__ with the distributed optimizer and one bucket (param_and_grad_buffer.py,
    core 0.16.1 and 0.19.2), worked out here: parameters walked in reverse registration order, each start
    padded to a multiple of 64 elements, a shared embedding closing the bucket before it and forming its own,
    each bucket end padded to lcm(group, 128). Returns (buffer size, parameter spans, bucket ends)."""
    def up(x: int, m: int) -> int:
        return -(-x // m) * m
    div = math.lcm(group, 128)
    start = begin = 0
    spans, ends = [], []
    open_ = False
    for numel, shared in reversed(params):
        start = up(start, 64)
        if shared and open_:
            start = up(start, div)
            ends.append(start)
            begin, open_ = start, False
        spans.append((start, start + numel))
        open_ = True
        start += numel
        if shared:
            start = up(start, div)
            ends.append(start)
            begin, open_ = start, False
    if open_:
        ends.append(up(start, div))
    return (ends[-1] if ends else 0), spans, ends


def _owned(spans: list[tuple[int, int]], ends: list[int], group: int, rank: int) -> int:
    """Elements of real parameters in ``rank``'s slice of every bucket (distrib_optimizer.py
    _build_model_gbuf_range: each bucket cut into ``group`` equal slices)."""
    total, begin = 0, 0
    for end in ends:
        size = (end - begin) // group
        lo, hi = begin + rank * size, begin + (rank + 1) * size
        total += sum(max(0, min(e, hi) - max(s, lo)) for s, e in spans)
        begin = end
    return total


@PROPERTY
@given(corner_jobs(), st.sampled_from(["0.16", "0.19"]))
def test_optimizer_shards_add_up_to_the_full_state(job, era):
    """With the distributed optimizer each chunk's dense buffer is sharded over DP x CP / instances and its
    expert buffer (routed experts, EP > 1 or ETP > 1) over world / (ETP x EP x PP) / instances
    (initialize_model_parallel, the same in core 0.16.1 and 0.19.2). Per stage: the buffers memguard builds are
    padded exactly as worked out here; the dense shards of the DP x CP ranks add up to the rank's dense
    parameters and the expert shards of the expert-data-parallel ranks to its routed experts, so that over the
    TP x DP x CP = ETP x EP x EDP ranks of a stage the fp32 state is TP copies of the dense part and ETP x EP
    pieces of the experts; and the stage's state per rank is its own shard of each (rank 0: the first slice)."""
    job = Job(flags=tuple(x for x in job.flags if x != "--use-distributed-optimizer") + ("--use-distributed-optimizer",),
              world=job.world, core=job.core)
    L = _layout(job, era)
    assert L.use_distributed_optimizer
    inst = L.num_distributed_optimizer_instances
    dense_group = L.dp * L.cp // inst
    edp = job.world // (L.moe.etp * L.parallel.expert_model_parallel_size * L.pp) // inst
    assert L.parallel.shard_size(ShardGroup.DENSE_DP) == dense_group
    assert L.parallel.shard_size(ShardGroup.EXPERT_DP) == edp
    for p in range(L.pp):
        dense_params = expert_params = 0
        dense_numel = expert_numel = 0
        first = [0, 0]
        for c in L.stage_chunks(p):
            for numels, group, i in ((chunk_numels(L, c), dense_group, 0), (chunk_expert_numels(L, c), edp, 1)):
                size, spans, ends = _padded_buffer(numels, group)
                owned = [_owned(spans, ends, group, r) for r in range(group)]
                n = sum(k for k, _ in numels)
                assert sum(owned) == n, (p, c.vpp_rank, i)
                first[i] += owned[0]
                if i == 0:
                    dense_params, dense_numel = dense_params + n, dense_numel + size
                else:
                    expert_params, expert_numel = expert_params + n, expert_numel + size
        st_ = stage_states(L, p, 0)
        assert st_.parameters == dense_params + expert_params
        # the padded DDP buffers (gradients in fp32: 4 bytes per element, padding included)
        assert st_.buffer_numel == dense_numel + expert_numel
        assert st_.grad_bytes == 4 * (dense_numel + expert_numel)
        # DP rank 0 is expert-data-parallel rank 0 too (both groups' first rank): fp32 main weights and the
        # two Adam moments of its first slices
        assert st_.main_param_bytes == 4 * (first[0] + first[1])
        assert st_.exp_avg_bytes == st_.exp_avg_sq_bytes == 4 * (first[0] + first[1])


# ---------------------------------------------------------------------------------------------------
# 4: activations

# Terms that hold per-micro-batch tensors (every one a number of tokens x a width): what the layers keep
# for backward, the embedding's indices and dropout mask, the head's and MTP's logits and loss buffers, the
# MoE dispatcher's per-token state, the largest forward / backward working set, the pipeline's
# send / receive buffers and retained inputs, megatron's global memory buffer (the SP all-gather of one
# micro-batch's activations)
PER_TOKEN_GROUPS = {"activations", "logits_loss"}
PER_TOKEN_TERMS = {"moe_dispatcher_state", "forward_transient", "p2p_buffers_in_flight",
                   "pipeline_inputs_retained", "global_memory_buffer"}
# the largest working set of the backward pass: per-token tensors or a weight gradient (the embedding's,
# V / TP x h, materialised before it is added to main_grad), whichever is larger
MIXED = {"backward_transient"}
# derived from the allocated peak, not a tensor
DERIVED = {"allocator_fragmentation"}


def _with(job: Job, flag: str, value: str) -> Job:
    f = list(job.flags)
    i = f.index(flag)
    f[i + 1] = value
    return Job(flags=tuple(f), world=job.world, core=job.core)


@PROPERTY
@given(corner_jobs())
def test_doubling_the_micro_batch_doubles_exactly_the_per_token_terms(job):
    """Twice the micro-batch (and the global batch, so that the schedule keeps its micro-batches): on every
    stage whose peak stays at the same moment of the schedule, each per-token term is exactly twice as large
    (dropless routing: balanced expert rows T x k x ETP are linear in the tokens T), and every other term is
    unchanged (weights, gradients, optimizer state, workspaces, rotary tables, placeholder weight gradients,
    CUDA context)."""
    mbs = int(job.flags[job.flags.index("--micro-batch-size") + 1])
    gbs = int(job.flags[job.flags.index("--global-batch-size") + 1])
    one = estimate(_layout(job), device="gpu")
    two = estimate(_layout(_with(_with(job, "--micro-batch-size", str(2 * mbs)), "--global-batch-size", str(2 * gbs))),
                   device="gpu")
    for a, b in zip(one.stages, two.stages):
        if a.peak_phase != b.peak_phase or a.in_flight != b.in_flight:
            continue
        ta = {t.name: t for t in a.terms}
        tb = {t.name: t for t in b.terms}
        assert set(ta) == set(tb), (a.pp_rank, set(ta) ^ set(tb))
        for name, t in ta.items():
            if name in DERIVED:
                continue
            if name in MIXED:
                assert t.bytes <= tb[name].bytes <= 2 * t.bytes, (a.pp_rank, name)
                continue
            per_token = str(t.group) in PER_TOKEN_GROUPS or name in PER_TOKEN_TERMS
            assert tb[name].bytes == (2 if per_token else 1) * t.bytes, (a.pp_rank, name, t.bytes, tb[name].bytes)


# ---------------------------------------------------------------------------------------------------
# Regressions found by the properties above (hand counts)

MTP_JOB = ("--num-layers 2 --hidden-size 64 --num-attention-heads 2 --kv-channels 16 --ffn-hidden-size 32 "
           "--seq-length 16 --max-position-embeddings 16 --micro-batch-size 1 --global-batch-size 4 --vocab-size 1000 "
           "--tokenizer-type NullTokenizer --bf16 --transformer-impl transformer_engine --disable-bias-linear "
           "--position-embedding-type rope --normalization RMSNorm --num-experts 2 --moe-router-topk 1 "
           "--moe-router-pre-softmax --moe-ffn-hidden-size 8 --moe-token-dispatcher-type alltoall "
           "--pipeline-model-parallel-size 2").split()


def test_final_norm_follows_the_last_decoder_layer_with_mtp():
    """With MTP, megatron-core builds the decoder's final norm on the stage of the last decoder layer
    (TransformerBlock.has_final_layernorm_in_this_stage, core 0.16.1 and 0.19.2), not on the loss's stage:
    under the layout "Ett|mL" stage 0 holds both decoder layers and the final RMSNorm weight [64], stage 1
    only the MTP block and the head. megatron-core 0.16.1 builds 86,592 parameters on stage 0 and 149,952 on
    stage 1 (tests/e2e/moe_rank_params.py); without MTP ("Ett|L") the 64 are on stage 1."""
    def stages(extra):
        L = layout_from_flags(MTP_JOB + extra, world_size=2, megatron_version="0.16")
        return [stage_states(L, p).parameters for p in range(2)]
    with_mtp = stages(["--mtp-num-layers", "1", "--pipeline-model-parallel-layout", "Ett|mL"])
    without = stages(["--pipeline-model-parallel-layout", "Ett|L"])
    assert with_mtp == [86_592, 149_952]
    assert with_mtp[0] - without[0] == 64


def test_final_norm_keeps_its_activations_where_it_runs_with_mtp():
    """The final norm runs where megatron-core builds it (TransformerBlock.has_final_layernorm_in_this_stage,
    core 0.16.1 and 0.19.2): under "Ett|mL" on stage 0, so stage 0 keeps its input (s x b x h bf16 =
    16 x 1 x 64 x 2 = 2,048 B) and RMSNorm's fp32 rstd (16 x 4 = 64 B) per micro-batch; stage 1 keeps only the
    output layer's input. Without MTP ("Ett|L") they stay on the loss's stage."""
    from megatron_memguard.estimator.core import chunk_activations
    want = {"final_norm_input": 2048, "final_norm_stats": 64}

    def norm_items(extra):
        L = layout_from_flags(MTP_JOB + extra, world_size=2, megatron_version="0.16")
        return [{k: v for c in L.stage_chunks(p) for k, v in chunk_activations(L, c).ends.items() if k in want}
                for p in range(2)]
    assert norm_items(["--mtp-num-layers", "1", "--pipeline-model-parallel-layout", "Ett|mL"]) == [want, {}]
    assert norm_items(["--mtp-num-layers", "1", "--pipeline-model-parallel-layout", "Et|tmL"]) == [{}, want]
    assert norm_items(["--pipeline-model-parallel-layout", "Ett|L"]) == [{}, want]


def test_megatron_fsdp_groups_follow_the_final_norm_with_mtp():
    """Megatron-FSDP's groups (optim_grads_params, DP 2) under "Ett|mL" with MTP: each layer a unit of 8,448
    dense (qkv [96, 64], proj [64, 32], two norms of 64, router [2, 64]) and 2,048 expert elements; outside the
    units stage 0 holds the embedding [1024, 64] and the final norm [64] = 65,600 (row width lcm 64, padded to
    DP x 64 = 128: 65,664), stage 1 the MTP block's embedding copy and the output layer (2 x 65,536), its enorm,
    hnorm and final norm (3 x 64) and eh_proj [64, 128] = 139,456 (row width 128, padded to 256: 139,520).
    The groups add up to the parameters megatron-core 0.16.1 builds on each stage (86,592 and 149,952,
    test_final_norm_follows_the_last_decoder_layer_with_mtp)."""
    from megatron_memguard.estimator.fsdp import padded_numel
    from megatron_memguard.estimator.fsdp_layout import chunk_groups, fsdp_spec
    from megatron_memguard.estimator.params import holds_final_norm
    L = layout_from_flags(MTP_JOB + ["--mtp-num-layers", "1", "--pipeline-model-parallel-layout", "Ett|mL",
                                     "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                                     "--no-gradient-accumulation-fusion", "--use-distributed-optimizer"],
                          world_size=4, megatron_version="0.16")
    groups = [[g for c in L.stage_chunks(p) for g in chunk_groups(L, c.kind_runs, c.has_embedding, c.has_output,
                                                                  c.has_tied_output_copy, holds_final_norm(L, c))]
              for p in range(2)]
    assert [sum(g.numel for g in gs) for gs in groups] == [86_592, 149_952]
    assert [(g.numel, g.unit) for g in groups[0]] == [(8448, True), (2048, True)] * 2 + [(65_600, False)]
    assert [(g.numel, g.unit) for g in groups[1]] == [(8448, True), (2048, True), (139_456, False)]
    outside = [next(g for g in gs if not g.unit) for gs in groups]
    assert [padded_numel(fsdp_spec(L), g) for g in outside] == [65_664, 139_520]


def test_mla_down_projections_are_whole_on_every_tp_rank_in_the_te_spec():
    """TP 2 with SP, the TE spec: gpt_layer_specs.py builds linear_q_down_proj / linear_kv_down_proj as TELinear,
    which MLASelfAttention makes parallel_mode "duplicated" (whole weight on every TP rank, marked
    sequence_parallel: extensions/transformer_engine.py TELinear, megatron-core 0.16.1 and 0.19.2); the local spec
    would make them ColumnParallelLinear (split), which memguard refuses by name. Per rank and layer: input norm
    64, linear_proj [64, 4 x 16 / 2] = 2,048, q_down [32, 64] = 2,048, q_up [4 x 24 / 2, 32] = 1,536, kv_down
    [40, 64] = 2,560, kv_up [4 x 32 / 2, 32] = 2,048, fc1's norm 64, fc1 [64, 64] and fc2 [64, 64] = 8,192:
    18,560; with the embedding [1024 / 2, 64] and the final norm, 32,768 + 2 x 18,560 + 64 = 69,952 (the
    rank-by-rank build, test_parameters_and_placement_rank_by_rank_are_megatron_cores, checks the same at any
    TP). finalize_model_grads all-reduces the sequence_parallel gradients: 2 x (64 + 2,048 + 2,560 + 64) + 64
    = 9,536 fp32 = 38,144 B."""
    from megatron_memguard.estimator.core import replicated_grad_allreduce_bytes
    flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --multi-latent-attention --q-lora-rank 32 "
             "--kv-lora-rank 32 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16 --ffn-hidden-size 128 "
             "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 8 "
             "--vocab-size 1000 --tokenizer-type NullTokenizer --bf16 --transformer-impl transformer_engine "
             "--disable-bias-linear --position-embedding-type rope --normalization RMSNorm "
             "--tensor-model-parallel-size 2 --sequence-parallel").split()
    for era in ("0.16", "0.19"):
        L = layout_from_flags(flags, world_size=2, megatron_version=era)
        assert stage_states(L, 0).parameters == 69_952
        runs = tuple(c.kind_runs for c in L.stage_chunks(0))
        assert replicated_grad_allreduce_bytes(L, runs, True) == 38_144
    with pytest.raises(NotModelledError, match="--transformer-impl"):
        layout_from_flags(flags + ["--transformer-impl", "local"], world_size=2)


def test_sequence_parallel_grad_allreduce_counts_the_mtp_block():
    """finalize_model_grads flattens the gradients of every parameter marked sequence_parallel in every model
    chunk (_allreduce_non_tensor_model_parallel_grads, core 0.16.1 finalize_model_grads.py), the MTP block's
    included: TP 2 with SP, RMSNorm, no biases, 4 dense layers, one stage: 2 norms x 64 per layer (512) and
    the final norm (64) = 576 fp32 gradients; one MTP depth adds its layer's two norms (128) and its enorm,
    hnorm and final norm (192): 896 x 4 B = 3,584 B."""
    from megatron_memguard.estimator.core import replicated_grad_allreduce_bytes
    flags = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --kv-channels 16 --ffn-hidden-size 128 "
             "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 8 --vocab-size 1000 "
             "--tokenizer-type NullTokenizer --bf16 --transformer-impl transformer_engine --disable-bias-linear "
             "--position-embedding-type rope --tensor-model-parallel-size 2 --sequence-parallel "
             "--normalization RMSNorm").split()
    for extra, elems in (([], 576), (["--mtp-num-layers", "1"], 896)):
        L = layout_from_flags(flags + extra, world_size=2, megatron_version="0.19")
        runs = tuple(c.kind_runs for c in L.stage_chunks(0))
        assert replicated_grad_allreduce_bytes(L, runs, True) == 4 * elems


# the terms expert parallelism may move: the routed experts a rank holds (weights, gradient buffer, the
# optimizer's shards of them), the NCCL communicators of the EP groups, and the allocator slack on top;
# under balanced routing a rank's expert rows, T x k x ETP, do not depend on EP (layers/moe.py expert_rows)
EP_TERMS = {"parameters", "gradient_buffer", "main_parameters", "adam_exp_avg", "adam_exp_avg_sq",
            "main_grad_copies", "nccl_buffers", "allocator_fragmentation"}


@PROPERTY
@given(corner_jobs())
def test_expert_parallelism_moves_only_the_expert_side(job):
    """EP e against EP 1 on the same world: every stage keeps its activations, workspaces and transients;
    only EP_TERMS move, and the stage's parameters drop by exactly the routed experts it no longer holds:
    (E - E / e) experts of g x F x h + h x F weights (+ g x F + h biases) per MoE layer on the stage, the MTP
    block's on the last (megatron-core SequentialMLP / TEGroupedMLP: E / EP local experts)."""
    ep = int(job.flags[job.flags.index("--expert-model-parallel-size") + 1])
    if ep == 1:
        reject()
    L = _layout(job)
    one = estimate(_layout(_with(job, "--expert-model-parallel-size", "1")))
    many = estimate(L)
    c = job.core
    g, h, F = (2 if c["glu"] else 1), c["hidden_size"], c["moe_ffn"]
    # one expert on one rank: ETP splits fc1, fc2 and fc1's bias, and keeps fc2's bias whole
    per_expert_rank = (g * F * h + h * F + (g * F if c["bias"] else 0)) // c["etp"] + (h if c["bias"] else 0)
    mtp = L.mtp_num_layers or 0
    # the MTP layers take the last decoder layer's kind
    freq = c["freq"]
    last_moe = bool(freq[-1]) if isinstance(freq, list) else (c["num_layers"] - 1) % freq == 0
    for a, b in zip(one.stages, many.stages):
        moe_layers = sum(1 for ch in L.stage_chunks(a.pp_rank) for k in ch.layer_kinds if k.mlp == "moe")
        # the MTP block sits on the chunk that builds it: the last, or the one a layout's 'm' names (mtp_standalone)
        mtp_here = any(ch.has_mtp if ch.has_mtp is not None else ch.has_output for ch in L.stage_chunks(a.pp_rank))
        if mtp_here and last_moe:
            moe_layers += mtp
        E = c["experts"]
        assert a.parameters - b.parameters == moe_layers * (E - E // ep) * per_expert_rank, a.pp_rank
        if a.peak_phase != b.peak_phase:
            continue
        ta = {t.name: t.bytes for t in a.terms}
        tb = {t.name: t.bytes for t in b.terms}
        assert {k for k in set(ta) | set(tb) if ta.get(k) != tb.get(k)} <= EP_TERMS, a.pp_rank


# expert tensor parallelism (docs/terms/moe.md): each of a rank's experts is F / ETP wide and receives the
# tokens of its whole ETP group (balanced rows N = T k ETP), so the MoE layers' saved tensors, the
# dispatcher's per-token state, the working sets around the experts and the experts' placeholder weight
# gradients move besides EP_TERMS (the expert-data-parallel group is world / (ETP x EP x PP))
ETP_TERMS = EP_TERMS | {"moe_layer_activations", "moe_dispatcher_state", "forward_transient", "backward_transient",
                        "dummy_wgrads", "mtp_block_activations"}


@PROPERTY
@given(corner_jobs())
def test_expert_tensor_parallelism_moves_only_the_expert_side(job):
    """ETP = TP (sequence parallel) against ETP 1 on the same job: the attention, dense MLPs, embedding, head
    and loss terms stay; only ETP_TERMS move (the MTP block's activations too: its layer is MoE like the
    last decoder layer)."""
    etp = int(job.flags[job.flags.index("--expert-tensor-parallel-size") + 1])
    if etp == 1 or "--disable-bias-linear" not in job.flags:
        reject()
    a = estimate(_layout(job))
    b = estimate(_layout(_with(job, "--expert-tensor-parallel-size", "1")))
    for x, y in zip(a.stages, b.stages):
        if x.peak_phase != y.peak_phase:
            continue
        tx = {t.name: t.bytes for t in x.terms}
        ty = {t.name: t.bytes for t in y.terms}
        assert {k for k in set(tx) | set(ty) if tx.get(k) != ty.get(k)} <= ETP_TERMS, x.pp_rank


def test_biases_in_moe_layers_need_expert_tensor_parallel_size_one():
    """megatron-core's TransformerConfig.__post_init__ asserts "Bias in Moe is only supported when ETP==1"
    (core 0.16.1 and 0.19.2): biases (the default) with --expert-tensor-parallel-size 2, or with ETP left to
    default to TP 2, are an error naming the flag; --disable-bias-linear or ETP 1 are estimated."""
    flags = MTP_JOB[:MTP_JOB.index("--pipeline-model-parallel-size")]
    flags = [x for x in flags if x != "--disable-bias-linear"] + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    for extra in (["--expert-tensor-parallel-size", "2"], []):
        for era in ("0.16", "0.19"):
            with pytest.raises((ConfigError, ConfigErrors)) as e:
                layout_from_flags(flags + extra, world_size=2, megatron_version=era)
            errors = e.value.errors if isinstance(e.value, ConfigErrors) else [e.value]
            assert any(str(x).startswith("--expert-tensor-parallel-size: must be 1 with biases") for x in errors)
    layout_from_flags(flags + ["--expert-tensor-parallel-size", "1"], world_size=2, megatron_version="0.16")
    layout_from_flags(flags + ["--disable-bias-linear"], world_size=2, megatron_version="0.16")


def test_the_mtp_blocks_routed_experts_are_among_the_last_stages_parameters():
    """EP 2, 2 experts, MTP 1, PP 1, no biases: the rank holds one routed expert per MoE layer, the two decoder
    layers' and the MTP layer's (it takes the last decoder layer's MoE kind): 3 x (fc1 [8, 64] + fc2 [64, 8])
    = 3,072 expert parameters, tagged as routed experts in chunk_params (which Muon and the other emerging
    optimizers read) as in the stage's count; megatron-core 0.16.1 builds them (tests/e2e/moe_rank_params.py)."""
    flags = MTP_JOB[:MTP_JOB.index("--pipeline-model-parallel-size")] + [
        "--expert-model-parallel-size", "2", "--mtp-num-layers", "1"]
    L = layout_from_flags(flags, world_size=2, megatron_version="0.16")
    (c,) = L.stage_chunks(0)
    ps = chunk_params(L, c)
    assert sum(p.numel for p in ps if p.expert) == 3 * (8 * 64 + 64 * 8) == 3_072
    assert sum(p.numel for p in ps if p.expert and p.name.startswith("mtp.")) == 1_024
    assert sum(p.numel for p in ps) == stage_states(L, 0).parameters


def test_an_moe_mtp_layer_keeps_its_moe_half_in_moe_layer_activations():
    """The MTP layer takes the last decoder layer's kind (MultiTokenPredictionLayer); when that is MoE, its
    router / dispatcher / experts' saved tensors are MoE activations like a decoder MoE layer's: one stage,
    two MoE layers and one MTP layer, one micro-batch in flight: moe_layer_activations is 3/2 of the same job
    without MTP (and the worst-case routing figure scales all three). Untied: with tied weights at PP 1 this toy
    model's end of the backward (the embedding's gradient beside the tied output gradient's sum, head.tied_wgrad_wait)
    outweighs its forward, where the layers' activations are held."""
    flags = MTP_JOB[:MTP_JOB.index("--pipeline-model-parallel-size")] + ["--untie-embeddings-and-output-weights"]
    a = estimate(layout_from_flags(flags, world_size=1, megatron_version="0.19")).stages[0]
    b = estimate(layout_from_flags(flags + ["--mtp-num-layers", "1"], world_size=1, megatron_version="0.19")).stages[0]
    assert a.in_flight == b.in_flight == 1 and a.peak_phase.startswith("forward") and b.peak_phase.startswith("forward")
    assert 2 * b.breakdown["moe_layer_activations"] == 3 * a.breakdown["moe_layer_activations"]


# MoE layers 1-3, the last decoder layer dense, the MTP layer alone on the last stage with the loss
MTP_ALONE = MTP_JOB[:MTP_JOB.index("--pipeline-model-parallel-size")] + [
    "--pipeline-model-parallel-size", "2", "--moe-layer-freq", "([1]*3+[0])", "--mtp-num-layers", "1",
    "--pipeline-model-parallel-layout", "Etttt|mL"]
MTP_ALONE[MTP_ALONE.index("--num-layers") + 1] = "4"
MTP_ALONE_CORE = dict(num_layers=4, hidden_size=64, heads=2, kv_channels=16, groups=None, ffn=32, bias=False, glu=False,
                      norm="RMSNorm", tp=1, pp=2, vpp=None, ep=1, etp=1, experts=2, moe_ffn=8, topk=1, freq=[1, 1, 1, 0],
                      shared_ffn=0, shared_gate=False, expert_bias=False, untied=False, seq=16, mtp=1, mla=None,
                      layout="Etttt|mL")


def test_an_mtp_layer_alone_on_its_stage_is_moe_only_in_the_019_builder():
    """The MTP layer's MLP when its chunk holds no decoder layer ('|mL') and the last decoder layer is dense:
    dense by gpt_builders.py (0.16.1 to 0.18.2: the last decoder layer's spec), MoE by megatron-core 0.19.2's
    megatron/training/models/gpt.py mtp_block_spec (_te_or_local_layer_spec: the MoE layer spec). By hand, the
    dense MLP is fc1 [32, 64] + fc2 [64, 32] = 4,096 parameters, the MoE one the router [2, 64] and two experts
    of fc1 [8, 64] + fc2 [64, 8]: 128 + 2 x 1,024 = 2,176; the rest of the stage is the same. With a decoder
    layer beside it ('Ettt|tmL') both eras take the last decoder layer's (dense) spec."""
    old = layout_from_flags(MTP_ALONE, world_size=2, megatron_version="0.16")
    new = layout_from_flags(MTP_ALONE, world_size=2, megatron_version="0.19")
    assert stage_states(new, 1).parameters - stage_states(old, 1).parameters == 2_176 - 4_096
    assert stage_states(new, 0).parameters == stage_states(old, 0).parameters
    beside = [f if f != "Etttt|mL" else "Ettt|tmL" for f in MTP_ALONE]
    assert stage_states(layout_from_flags(beside, world_size=2, megatron_version="0.19"), 1).parameters == \
        stage_states(layout_from_flags(beside, world_size=2, megatron_version="0.16"), 1).parameters


def test_an_mtp_layer_alone_on_its_stage_has_megatron_cores_parameters(core):
    """The same job built by megatron-core (tests/e2e/moe_rank_params.py; in 0.19.2 through the builder's own
    _te_or_local_layer_spec): every rank's parameters equal memguard's count of its era, and the last stage's
    MTP layer is MoE exactly in the 0.19 era."""
    L = layout_from_flags(MTP_ALONE, world_size=2, megatron_version=core.era)
    recs = core.ranks(Job(flags=tuple(MTP_ALONE), world=2, core=MTP_ALONE_CORE), L, _core_ranks(L))
    for r in recs:
        (c,) = L.stage_chunks(r["rank"][0])
        assert r["params"] == sum(q.numel for q in chunk_params(L, c)), r["rank"]
        assert [tuple(x) for x in r["layers"]] == [(c.first_layer + i, k.mlp == "moe") for i, k in
                                                   enumerate(c.layer_kinds)]
    last = next(r for r in recs if r["rank"][0] == 1)
    assert last["mtp"] and last["layers"] == []
    # the MTP layer's routed experts: 2 x (fc1 [8, 64] + fc2 [64, 8]) in 0.19.2, none in 0.16.1
    assert last["tags"]["expert"] == (2 * 1_024 if core.era == "0.19" else 0)
