"""Virtual pipeline stages on uneven layer counts (issues 16 + 18): the planner searches the splits
Megatron accepts when PP x VPP does not divide the layers (megatron-core 0.16.1
transformer/transformer_config.py ``__post_init__``: first/last stage sizes > 0 and divisible by VPP, the
middle stages even and divisible by VPP; ``account_for_embedding/loss_in_pipeline_split`` with
(L + 1 or 2) / PP divisible by VPP; or ``pipeline_model_parallel_layout``), and what it exports estimates
the same from the flags."""
import shlex

import pytest

from megatron_memguard.partition import parse_pipeline_layout
from megatron_memguard.planner.space import Constraints, enumerate_space, layer_splits, uneven_vpp_splits

from conftest import LLAMA31_8B
from planner_util import make_planner


def _with_layers(flags, n):
    out = list(flags)
    out[out.index("--num-layers") + 1] = str(n)
    return out


def test_a_model_whose_only_vpp_splits_are_uneven():
    """14 layers on PP 4 with VPP 2, by hand: no even split (14 / 4 is not whole), and the gcd of the
    plain uneven splits (3,4,4,3) / (4,3,3,4) is 1, so before issue 18 no VPP 2 layout existed. Megatron
    accepts first = 2, last = 4 (both even; the middle 8 layers give 4 per stage, even) and the mirror,
    and the embedding + loss slots: (14 + 2) / 4 = 4 per rank, 4 / 2 = 2 per virtual stage, the first
    virtual stage holding 1 layer beside the embedding and the last 1 beside the loss."""
    model = _with_layers(LLAMA31_8B, 14)
    assert {s for _, _, s in layer_splits(14, 4)} == {(3, 4, 4, 3), (4, 3, 3, 4)}
    P = make_planner(model, 32, 4096, 64)
    cands = enumerate_space(P.shape, P.cluster, 64, Constraints(pp=(4,), vpp=(2,), tp=(8,), mbs=(1,),
                                                                   recompute=("none",), dist_opt=(True,)))
    got = {(c.stage_layers, c.first, c.last, c.acc_emb, c.acc_loss, c.pp_layout) for c in cands}
    assert got == {((2, 4, 4, 4), 2, 4, False, False, None), ((4, 4, 4, 2), 4, 2, False, False, None),
                   ((3, 4, 4, 3), None, None, True, True, None)}
    for c in cands:
        L = P.layout(c)                                  # Megatron's rules, checked again by resolve
        assert L.vpp == 2
        by_rank = [[ch.num_layers for ch in L.stage_chunks(r)] for r in range(4)]
        assert [sum(x) for x in by_rank] == list(c.stage_layers)
        assert [by_rank[r][v] for v in range(2) for r in range(4)] == list(c.chunks)
    acc = next(c for c in cands if c.acc_emb)
    assert acc.chunks == (1, 2, 2, 2, 2, 2, 2, 1)


def test_deepseek_v3_pp16_vpp2_layout_by_hand():
    """61 layers on PP 16 x VPP 2 = 32 virtual stages: 61 is odd, so neither first/last sizes (all even
    with VPP 2) nor the account flags (62 and 63 are not multiples of 32) work; the layout with the
    embedding and loss counted as a layer gives 63 slots, 31 stages of 2 and one of 1: 'Et|(tt|)*30L'
    (1 layer beside E, 30 stages of 2, the loss alone). Rank 0 holds 1 + 2 = 3 layers, rank 15 2 + 0."""
    (x,) = uneven_vpp_splits(61, 16, 2)
    assert x.layout == "Et|(tt|)*30L" and x.first is None and not (x.acc_emb or x.acc_loss)
    assert x.stages == (3,) + (4,) * 14 + (2,)
    assert [st.count("t") for st in parse_pipeline_layout(x.layout, 16)] == list(x.chunks)
    (m,) = uneven_vpp_splits(61, 16, 2, mtp=1)       # the MTP depth goes beside the loss
    assert m.layout == "Et|(tt|)*30mL"
    assert uneven_vpp_splits(64, 16, 2) == []        # the even split exists: nothing added


@pytest.fixture(scope="module")
def deepseek():
    from benchmarks.plan_speed import DSV3_FLAGS, DSV3_GBS, DSV3_SEQ
    from megatron_memguard.gpus import lookup_gpu
    from megatron_memguard.planner import Cluster, Planner
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    from megatron_memguard.readers.models import read_model
    gpu = lookup_gpu("H100-80GB")
    raw = read_model("deepseek-v3").merged(parse_megatron_flags(DSV3_FLAGS))
    cluster = Cluster(gpus=1024, gpus_per_node=gpu.gpus_per_node, gpu=gpu, nvlink_domain=gpu.nvlink_domain,
                      gpu_memory_bytes=gpu.memory_bytes)
    P = Planner(raw, cluster, seq_length=DSV3_SEQ, global_batch_size=DSV3_GBS)
    return P, raw, DSV3_FLAGS, P.plan(Constraints(vpp=(2,), allow_ep_across_nodes=True), top=3)


def test_deepseek_v3_with_vpp2_plans_pp16_with_uneven_ends(deepseek):
    P, _, _, res = deepseek
    assert res.entries                              # before issue 18: 0 layouts
    pp16 = [e for e in res.entries if e.candidate.pp == 16]
    assert pp16
    for e in pp16:
        c = e.candidate
        assert c.vpp == 2 and c.pp_layout == "Et|(tt|)*30L" and e.layout.vpp == 2
        assert (c.stage_layers[0], c.stage_layers[-1]) == (3, 2)


def test_deepseek_v3_exported_flags_estimate_the_same(deepseek):
    """`memguard estimate` on the model plus the exported flags: the same layout and the same bytes."""
    from megatron_memguard import estimate
    from megatron_memguard.planner.export import bridge_overrides, megatron_flags
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    from megatron_memguard.readers.models import read_model
    from megatron_memguard.resolve import resolve
    P, _, flags, res = deepseek
    for e in res.entries:
        exported = megatron_flags(e.layout, e.experts)
        assert any(f.startswith("--pipeline-model-parallel-layout 'Et|(tt|)*30L'") for f in exported)
        assert not any(f.startswith("--num-virtual-stages-per-pipeline-rank") for f in exported)
        raw = read_model("deepseek-v3").merged(parse_megatron_flags(list(flags) + shlex.split(" ".join(exported))))
        L = resolve(raw, world_size=1024)
        assert L == e.layout
        est = estimate(L, gpu=P.cluster.gpu, threshold=P.threshold)
        assert est.peak_device_bytes == e.estimate.peak_device_bytes
        assert [s.device_total_bytes for s in est.stages] == [s.device_total_bytes for s in e.estimate.stages]
        bridge = bridge_overrides(e.layout, e.experts)
        # megatron-core's TransformerConfig asserts a given VPP equals the layout's (0.16.1 __post_init__)
        assert {"model.pipeline_model_parallel_layout='Et|(tt|)*30L'",
                "model.virtual_pipeline_model_parallel_size=2"} <= set(bridge)


def test_account_and_first_last_exports_round_trip():
    """The other two spellings, on a dense model: the exported Megatron flags resolve to the planned layout and
    estimate the same bytes; the Bridge overrides write the split's own keys."""
    from megatron_memguard import estimate, layout_from_flags
    from megatron_memguard.planner.export import bridge_overrides, megatron_flags
    model = _with_layers(LLAMA31_8B, 14)
    P = make_planner(model, 32, 4096, 64)
    cands = enumerate_space(P.shape, P.cluster, 64, Constraints(pp=(4,), vpp=(2,), tp=(8,), mbs=(1,),
                                                                   recompute=("selective",), dist_opt=(True,), sp=(True,)))
    assert len(cands) == 3
    for c in cands:
        planned = P.layout(c)
        exported = megatron_flags(planned)
        L = layout_from_flags(model + shlex.split(" ".join(exported)), world_size=32)
        assert L == planned, c.name
        assert estimate(L, gpu=P.cluster.gpu).peak_device_bytes == P.estimate(planned).peak_device_bytes
        bridge = bridge_overrides(planned)
        if c.acc_emb:
            assert "--account-for-embedding-in-pipeline-split" in exported
            assert {"model.account_for_embedding_in_pipeline_split=true",
                    "model.account_for_loss_in_pipeline_split=true"} <= set(bridge)
        else:
            assert f"model.num_layers_in_first_pipeline_stage={c.first}" in bridge
        assert "model.virtual_pipeline_model_parallel_size=2" in bridge


def test_explain_takes_the_names_of_uneven_virtual_splits():
    """`--explain` accepts the name the planner prints for each spelling and rebuilds the same candidate."""
    from megatron_memguard.errors import ConfigError
    from megatron_memguard.planner.explain import explain
    model = _with_layers(LLAMA31_8B, 14)
    P = make_planner(model, 32, 4096, 64)
    cands = enumerate_space(P.shape, P.cluster, 64, Constraints(pp=(4,), vpp=(2,), tp=(8,), mbs=(1,),
                                                                   recompute=("none",), dist_opt=(True,), sp=(True,)))
    for c in cands:
        x = explain(P, c.name)
        assert x.candidate == c and x.candidate.chunks == c.chunks and x.candidate.stage_layers == c.stage_layers
        assert x.time.seconds == P.step_time(c).seconds
    # the layout spelling: 14 layers on PP 4 x VPP 2 written out by hand, 'E' and 'L' beside a layer each
    x = explain(P, "tp=8,pp=4,cp=1,mbs=1,recompute=none,layout=Et|(tt|)*6tL")
    assert x.candidate.vpp == 2 and x.candidate.stage_layers == (3, 4, 4, 3) and x.layout.vpp == 2
    with pytest.raises(ConfigError, match="account must be"):
        explain(P, "tp=8,pp=4,vpp=2,account=bias")
    with pytest.raises(ConfigError, match="15 layers"):
        explain(P, "tp=8,pp=4,vpp=2,account=embedding")
