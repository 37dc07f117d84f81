"""The planner's memos give what a fresh computation gives (hypothesis, derandomized; MEMGUARD_PROPERTY_EXAMPLES
scales the count). Every memo in planner/ (TimeModel's layer, ends, rank, DP, optimizer, parameter and layer-kind
caches, the Planner's bound memos) is keyed by a part of the candidate; a key that leaves out something the cached
function reads hands one candidate its sibling's number (the DP memo without VPP did so for 2,256 DeepSeek-V3
layouts). Here the memos are filled with every candidate in enumeration order, then each candidate's memoised step
terms and bounds are compared with a TimeModel built for it alone.

Drawn: dense models, MoE with dense-first --moe-layer-freq lists or an every-other-layer frequency, MTP depths, gated
delta net layers (--linear-attention-freq), multi-latent attention, hybrid Mamba patterns (with MoE 'E' layers, '|'
pipeline segments, virtual stages written as segments, '/' MTP depths) and heterogeneous layer configs, FP8 in the config or searched (--fp8), Megatron-FSDP,
8 to 32 GPUs, uneven and interleaved pipeline splits (their layouts and account flags)."""
from __future__ import annotations

import copy
import os
import sys

import pytest
from hypothesis import HealthCheck, given, reject, settings, strategies as st

from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.planner.bounds import memory_lower_bound, stage_factor_bytes, stage_state_bytes
from megatron_memguard.planner.space import Constraints, enumerate_space
from megatron_memguard.planner.timing import TimeModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from planner_util import make_planner  # noqa: E402

EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))
# each example fills and checks a whole layout space (thousands of candidates): per kind of model (6) a hundredth of
# the common count
PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=max(2, EXAMPLES // 100),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@st.composite
def jobs(draw, mixer: str, moe: bool):
    """(model flags, GPUs, sequence length, global batch size, constraints) of a model with the token mixer
    ``mixer`` (gqa, mla or gdn), with experts or not."""
    # (the first of each list is what hypothesis tries first: the richer choice, where keys have most to miss)
    if mixer in ("hybrid", "het"):
        return draw(mixed_jobs(mixer, moe))
    layers = draw(st.sampled_from([12, 13, 8, 16, 4, 6, 10]))
    # (a small vocabulary lets the first stage's activations, not the last stage's logits, set the bound)
    vocab = draw(st.sampled_from([4096, 32000]))
    f = ("--hidden-size 512 --num-attention-heads 8 --max-position-embeddings 8192 --bf16 --normalization RMSNorm "
         "--swiglu --disable-bias-linear --ffn-hidden-size 1408 --position-embedding-type rope --untie-embeddings-and-output-weights").split() + [
        "--num-layers", str(layers), "--vocab-size", str(vocab)]
    if mixer == "mla":
        f += ["--multi-latent-attention", "--q-lora-rank", "128", "--kv-lora-rank", "64", "--qk-head-dim", "64",
              "--qk-pos-emb-head-dim", "32", "--v-head-dim", "64"]
    else:
        f += ["--group-query-attention", "--num-query-groups", "2", "--kv-channels", "64"]
    if mixer == "gdn":
        f += ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq",
              str(draw(st.sampled_from([2, 4]))), "--linear-num-key-heads", "4", "--linear-num-value-heads", "8",
              "--linear-key-head-dim", "64", "--linear-value-head-dim", "64", "--linear-conv-kernel-dim", "4"]
    if moe:
        f += ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256",
              "--moe-token-dispatcher-type", draw(st.sampled_from(["alltoall", "allgather"]))]
        if draw(st.booleans()):
            f += ["--moe-shared-expert-intermediate-size", "256"]
        freq = draw(st.sampled_from(["dense-first", "other", "every"]))
        if freq == "dense-first":
            k = draw(st.integers(1, min(3, layers - 1)))
            f += ["--moe-layer-freq", f"[0]*{k}+[1]*{layers - k}"]
        elif freq == "other":
            f += ["--moe-layer-freq", "2"]
    if draw(st.sampled_from([True, False])):
        f += ["--mtp-num-layers", "1"]
    if draw(st.booleans()):
        f += ["--fp8-format", "hybrid"]
    gpus = draw(st.sampled_from([8] if moe else [8, 16, 32]))    # (MoE spaces are many times larger)
    seq = draw(st.sampled_from([2048, 4096]))
    gbs = draw(st.sampled_from([32, 64]))
    cons = Constraints(
        mbs=(1, 2), recompute=draw(st.sampled_from([("none", "full"), ("selective",)] if moe else
                                                [("none", "selective", "full"), ("full",)])),
        fsdp=draw(st.sampled_from([("optim_grads",), ()])),
        fp8=draw(st.sampled_from([(None, "off", "tensorwise"), (None,)])),
        allow_ep_across_nodes=draw(st.booleans()))
    return f, gpus, seq, gbs, cons


HET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "heterogeneous")


@st.composite
def mixed_jobs(draw, mixer: str, moe: bool):
    """A hybrid Mamba model (a pattern of M, *, - and, with experts, E layers) or a heterogeneous layer config (the
    test configs of tests/data/heterogeneous: own FFN widths, no-op and linear blocks, own query groups)."""
    base = ("--hidden-size 512 --num-attention-heads 8 --group-query-attention --num-query-groups 2 --kv-channels 64 "
            "--max-position-embeddings 8192 --bf16 --normalization RMSNorm --disable-bias-linear "
            "--untie-embeddings-and-output-weights --tokenizer-type NullTokenizer").split()
    if mixer == "hybrid":
        unit = draw(st.sampled_from(["M-M*", "ME*E" if moe else "M*-M", "MM-*"]))
        layers = draw(st.sampled_from([12, 13, 8, 6]))
        pattern = (unit * layers)[:layers]
        # '|' segments kept as given (PP divides their count, VPP = count / PP); without them the planner's virtual
        # stages are written as segments; '/' MTP depths on the last stage
        cut = draw(st.sampled_from([0, 2, 4]))
        if cut:
            pattern = "|".join(pattern[i * layers // cut:(i + 1) * layers // cut] for i in range(cut))
        mtp = draw(st.sampled_from(["", "/M*", "/M-/M-"]))
        f = base + ["--squared-relu", "--ffn-hidden-size", "1408", "--position-embedding-type", "none",
                    "--hybrid-override-pattern", pattern + mtp, "--num-layers", str(layers),
                    "--mamba-num-heads", "16", "--mamba-num-groups", "4", "--vocab-size",
                    str(draw(st.sampled_from([4096, 32000])))]
        if moe:
            f += ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256",
                  "--moe-token-dispatcher-type", draw(st.sampled_from(["alltoall", "allgather"]))]
    else:
        if moe:
            reject()            # (the test configs have no MoE blocks)
        blocks = draw(st.sampled_from(["small_blocks.json", "linear_blocks.json", "top_mlp_only.json",
                                       "own_query_groups.json"]))
        f = base + ["--num-layers", "4", "--ffn-hidden-size", "1024", "--swiglu", "--position-embedding-type", "rope",
                    "--use-rope-scaling", "--use-rotary-position-embeddings", "--rotary-base", "500000",
                    "--hidden-dropout", "0", "--attention-dropout", "0", "--vocab-size", "1024",
                    "--heterogeneous-layers-config-path", os.path.join(HET_DIR, blocks)]
    if draw(st.booleans()):
        f += ["--fp8-format", "hybrid"]
    gpus = draw(st.sampled_from([8] if moe else [8, 16]))
    seq = draw(st.sampled_from([2048, 4096]))
    gbs = draw(st.sampled_from([32, 64]))
    cons = Constraints(
        mbs=(1, 2), recompute=draw(st.sampled_from([("none", "selective", "full"), ("full",)])),
        fsdp=draw(st.sampled_from([("optim_grads",), ()])),
        fp8=draw(st.sampled_from([(None, "off", "tensorwise"), (None,)])),
        allow_ep_across_nodes=draw(st.booleans()))
    return f, gpus, seq, gbs, cons


def _close(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-12 * max(abs(x), abs(y)) for x, y in zip(a, b))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("mixer", ["gqa", "mla", "gdn"])
def test_memoised_step_terms_and_bounds_equal_a_fresh_computation(mixer, moe):
    _check_memos(mixer, moe)


@pytest.mark.parametrize("mixer, moe", [("hybrid", False), ("hybrid", True), ("het", False)],
                         ids=["hybrid", "hybrid-moe", "heterogeneous"])
def test_memoised_step_terms_and_bounds_equal_a_fresh_computation_for_mixed_layers(mixer, moe):
    _check_memos(mixer, moe)


def _check_memos(mixer: str, moe: bool) -> None:
    @PROPERTY
    @given(jobs(mixer, moe))
    def check(job):
        _check_job(job)
    check()


# TimeModel's memos keyed by all the arguments of the method that fills them (layer_cost, moe_layer, gdn_layer,
# ends_cost): a fresh model per candidate shares them (they are checked entry by entry below), all others start empty
ARGUMENT_KEYED = ("_layer", "gdn_cost", "_ends")


def _fresh(template: TimeModel) -> TimeModel:
    """A TimeModel that has seen no other candidate (its argument-keyed layer memos aside)."""
    t = copy.copy(template)
    for name, value in vars(template).items():
        if isinstance(value, dict) and name not in ARGUMENT_KEYED:
            setattr(t, name, {})
    return t


def _check_job(job) -> None:
    """Planner.step_time / lower_bound / state_bound read memos filled by the other candidates; a TimeModel that
    has seen no other candidate, and memory_lower_bound / stage_state_bytes with it, compute the same numbers
    from scratch; explain (which skips the DP memo) too. They must agree for every candidate (to rounding: the
    same operations)."""
    flags, gpus, seq, gbs, cons = job
    try:
        p = make_planner(flags, gpus, seq, gbs)
        cands = enumerate_space(p.shape, p.cluster, gbs, cons)
    except (ConfigError, ConfigErrors, NotModelledError):
        reject()
    if not cands:
        reject()
    for c in cands:                      # fill every memo in enumeration order, siblings mixed
        p.timer.step_time_bound(c)
        p.step_time(c)
        p.lower_bound(c)
        p.state_bound(c)
    s, tm = p.shape, p.timer
    template = TimeModel(s, p.cluster, gbs, tp_overlap=tm.tp_overlap)
    for c in cands:
        fresh = _fresh(template)
        memo = tm.step_time(c).values
        assert _close(memo, fresh.step_time(c).values), c.name
        assert _close(memo, tm.explain(c).values), c.name
        # the search's lower bound of the step time (memoised without the split): a fresh one, and below the time
        assert tm.step_time_bound(c) == fresh.step_time_bound(c), c.name
        assert tm.step_time_bound(c) <= tm.step_time(c).seconds, c.name
        assert p.lower_bound(c) == memory_lower_bound(s, c, fresh.stage_params, fresh.stage_expert_params,
                                                      fresh.moe_layers_on), c.name
        assert p.state_bound(c) == max(
            stage_state_bytes(s, c, fresh.stage_params(c, i), fresh.stage_expert_params(c, i),
                              stage_factor_bytes(s, c, i, fresh.moe_layers_on)) for i in {0, c.pp - 1}), c.name
    # the best-first visit (step times computed lazily from the bound) in the order of the whole sort
    for rule in ("time", "fujii2024"):
        assert list(p.visit_order(cands, rule)) == sorted(cands, key=p.order_key(rule)), rule
    # the argument-keyed memos: every entry is what a new model computes from the key's arguments
    for key, lc in tm._layer.items():
        new = TimeModel(s, p.cluster, gbs, tp_overlap=tm.tp_overlap)
        if key[0] == "moe":
            assert new.moe_layer(*key[1:]) == lc, key
        elif key[0] == "kind":                 # one layer of a hybrid / heterogeneous model's kinds
            assert new.kind_cost(*key[1:]) == lc, key
        else:
            assert new.layer_cost(*key[:5], mlp=len(key) == 5) == lc, key
    for key, lg in tm.gdn_cost.items():
        assert TimeModel(s, p.cluster, gbs, tp_overlap=tm.tp_overlap).gdn_layer(*key) == lg, key
    for key, ec in tm._ends.items():
        assert TimeModel(s, p.cluster, gbs, tp_overlap=tm.tp_overlap).ends_cost(*key) == ec, key
