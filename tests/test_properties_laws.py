"""Laws over corners the other property files do not draw (hypothesis, derandomized, framework-free), in both
Megatron eras memguard models (megatron-core 0.16.1 and 0.19.2):

- the order of the flags: argparse gives pretrain_gpt.py one Namespace whatever order the options come in (each
  given once), so a command line's option groups shuffled change no number of any rank;
- an expert-tensor-parallel size free of TP: tests/property_space.py's moe_specs draws ETP 1 or TP only, here ETP is
  any of 1, 2, 4, 8 other than TP (ETP > TP, ETP < TP > 1), with DP 1-3 times what the world needs for ETP x EP x PP
  (DP 3, 6: data-parallel groups that are not powers of two), under the features of feature_specs (FP8, MTP, offload,
  CUDA graphs, EP overlap): the MoE hand count, the expert shards, the terms' sums and levels, and the directions of
  the micro-batch, the sequence and twice the distributed optimizer's ranks hold as they do at ETP in {1, TP}.

Derandomized; MEMGUARD_PROPERTY_EXAMPLES sets the count (default 200; these use a quarter).
"""
from __future__ import annotations

import math
import os

from hypothesis import HealthCheck, assume, given, reject, settings, strategies as st

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError

from property_space import FeatureSpec, feature_specs, moe_specs
from property_spelling import _drop, _numbers
from test_properties_features import (test_every_feature_estimate_sums_its_terms_and_orders_its_levels as _sums,
                                      test_expert_optimizer_shards_partition_the_expert_state as _expert_shards,
                                      test_moe_parameters_over_tp_ep_etp_and_pp_ranks_add_up as _moe_hand_count)
from test_properties_layout_corners import (test_a_larger_micro_batch_never_lowers_a_stage_peak as _mbs_direction,
                                            test_a_longer_sequence_never_lowers_a_stage_peak as _seq_direction)
from test_properties_newest import (
    test_the_distributed_optimizer_over_twice_the_ranks_never_raises_a_stage_peak as _twice_dp)
from test_properties_pipeline_split import split_jobs

EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))
QUARTER = settings(derandomize=True, database=None, deadline=None, max_examples=max(1, EXAMPLES // 4),
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
ERA = st.sampled_from(["0.16", "0.19"])


def _option_groups(flags: list[str]) -> list[list[str]]:
    """The command line cut into options, each with the values after it (nargs='+' lists included)."""
    groups: list[list[str]] = []
    for f in flags:
        if f.startswith("--") or not groups:
            groups.append([f])
        else:
            groups[-1].append(f)
    return groups


def _estimate(flags: list[str], world: int, era: str):
    try:
        return estimate(layout_from_flags(flags, world_size=world, megatron_version=era))
    except (ConfigError, ConfigErrors, NotModelledError):
        reject()


def _assert_order_free(flags: list[str], world: int, era: str, order: list[int]) -> None:
    groups = _option_groups(flags)
    assert len({g[0] for g in groups}) == len(groups), "an option given twice: argparse's last one wins"
    shuffled = [x for i in order for x in groups[i]]
    assert _numbers(_estimate(shuffled, world, era)) == _numbers(_estimate(flags, world, era))


@QUARTER
@given(feature_specs(), ERA, st.data())
def test_the_order_of_the_flags_changes_no_number(fs, era, data):
    """Any order of a feature job's options (MoE, FP8, MTP, offload, CUDA graphs, Megatron-FSDP) is the same job:
    argparse fills one Namespace (megatron/training/arguments.py parse_args), and validate_args reads it after
    every option is in."""
    flags = fs.flags()
    order = data.draw(st.permutations(range(len(_option_groups(flags)))))
    _assert_order_free(flags, fs.world, era, order)


@QUARTER
@given(split_jobs(), st.data())
def test_the_order_of_the_split_flags_changes_no_number(job, data):
    """The same for tests/test_properties_pipeline_split.py's splits: a layout string, embedding / loss slots,
    uneven first / last stages under virtual stages, MTP depths, whichever option comes first."""
    flags = job.flags()
    order = data.draw(st.permutations(range(len(_option_groups(flags)))))
    _assert_order_free(flags, job.spec.world, job.era, order)


def _free_etp(draw, fs: FeatureSpec) -> FeatureSpec:
    """``fs`` (an MoE job) with an expert-tensor-parallel size other than its TP, the expert FFN a multiple of it,
    DP 1-3 times the least that lets the world divide into ETP x EP x PP (initialize_model_parallel:
    world % (ETP x EP x PP) == 0, the decoder's TP x CP x DP x PP being the world), no MoE bias unless ETP is 1
    (TransformerConfig), DeepEP's flex dispatcher over ETP x EP <= 8 ranks as moe_specs draws it."""
    b = fs.base
    etp = draw(st.sampled_from([e for e in (1, 2, 4, 8) if e != b.tp]))
    dp = draw(st.sampled_from([1, 2, 3])) * (etp * fs.ep // math.gcd(etp * fs.ep, b.tp * b.cp))
    dispatcher = fs.dispatcher if fs.dispatcher != "flex" or etp * fs.ep <= 8 else "alltoall"
    return fs.with_(etp=etp, moe_ffn=etp * 8 * draw(st.integers(1, 8)), dispatcher=dispatcher,
                    capacity=fs.capacity if dispatcher == "alltoall" else None,
                    pad=fs.pad and dispatcher == "alltoall").with_base(dp=dp, bias=b.bias and etp == 1)


@st.composite
def free_etp_moe_specs(draw) -> FeatureSpec:
    return _free_etp(draw, draw(moe_specs()))


@st.composite
def free_etp_feature_specs(draw) -> FeatureSpec:
    return _free_etp(draw, draw(moe_specs() if draw(st.booleans()) else
                                feature_specs().filter(lambda fs: fs.experts > 0)))


@QUARTER
@given(free_etp_moe_specs())
def test_moe_hand_count_with_an_expert_tp_free_of_tp(fs):
    """test_properties_features' hand count: one TP x EP x ETP rank of each stage holds the dense weights / TP and
    the routed experts / (EP x ETP), whatever ETP is beside TP."""
    _moe_hand_count.hypothesis.inner_test(fs)


@QUARTER
@given(free_etp_moe_specs())
def test_expert_shards_with_an_expert_tp_free_of_tp(fs):
    """test_properties_features' expert shards over EDP = world / (ETP x EP x PP), EDP 3 and 6 among them."""
    _expert_shards.hypothesis.inner_test(fs)


@QUARTER
@given(free_etp_feature_specs(), st.sampled_from(["gpu", "cpu"]))
def test_every_estimate_with_an_expert_tp_free_of_tp_sums_its_terms(fs, device):
    """test_properties_features' sums and levels of every term, with FP8, MTP, offload, CUDA graphs, EP overlap."""
    _sums.hypothesis.inner_test(fs, device)


@QUARTER
@given(free_etp_feature_specs(), st.integers(1, 4), ERA)
def test_a_larger_micro_batch_with_an_expert_tp_free_of_tp_lowers_no_peak(fs, extra, era):
    """test_properties_layout_corners' micro-batch direction: the tokens an ETP group gathers grow with b."""
    _mbs_direction.hypothesis.inner_test(fs, extra, era)


@QUARTER
@given(free_etp_feature_specs(), ERA)
def test_a_longer_sequence_with_an_expert_tp_free_of_tp_lowers_no_peak(fs, era):
    """test_properties_layout_corners' sequence direction."""
    _seq_direction.hypothesis.inner_test(fs, era)


@QUARTER
@given(free_etp_feature_specs())
def test_twice_the_distributed_optimizers_ranks_with_an_expert_tp_free_of_tp(fs):
    """test_properties_newest's law: twice the DP ranks (and so twice the expert-DP ranks) never raise a stage's
    peak under the distributed optimizer."""
    _twice_dp.hypothesis.inner_test(fs)


@QUARTER
@given(feature_specs(), st.sampled_from([3, 5, 6]), ERA)
def test_data_parallel_groups_not_powers_of_two_never_raise_a_stage_peak(fs, k, era):
    """k = 3, 5, 6 times the data-parallel ranks under the distributed optimizer: each rank's optimizer shard is a
    1 / (k DP CP) slice of buckets padded to lcm(k DP CP, 128) elements (param_and_grad_buffer.py, 0.16.1 / 0.19.2)
    instead of lcm(DP CP, 128), so no stage's allocated peak grows (test_properties_newest's law at DP x 2, where the
    padding unit stays the same, here where it grows). Not asserted where that law is not: Megatron-FSDP's 'optim' /
    'optim_grads' (buckets padded with DP), several optimizer instances."""
    if any(x in fs.extra for x in ("optim", "optim_grads")) or fs.base.instances > 1:
        reject()
    a = fs.with_base(dist_opt=True)
    b = a.with_base(dp=k * a.base.dp)
    ea = _estimate(a.flags(), a.world, era)
    eb = _estimate(b.flags(), b.world, era)
    for sa, sb in zip(ea.stages, eb.stages):
        assert sb.peak_allocated_bytes <= sa.peak_allocated_bytes, (sa.pp_rank, sa.peak_phase, sb.peak_phase)


def _flag_value(flags: tuple, name: str) -> int | None:
    return int(flags[flags.index(name) + 1]) if name in flags else None


def _split_as_layout(job) -> str:
    """The layers per (rank, virtual stage) of an uneven or embedding / loss-slot split (get_num_layers_to_build,
    transformer_block.py 0.16.1 / 0.19.2: the first / last rank's layers spread evenly over its virtual stages, the
    middle ranks' alike; a slot is one layer fewer on the first / last virtual stage) as the layout string of them,
    virtual-stage-major, the MTP depths on the last stage before the loss (where Megatron builds them without a
    layout: mtp_on_this_rank)."""
    s, f = job.spec, job.split
    pp, v = s.pp, _flag_value(f, "--num-virtual-stages-per-pipeline-rank") or 1
    first = _flag_value(f, "--decoder-first-pipeline-num-layers")
    last = _flag_value(f, "--decoder-last-pipeline-num-layers")
    emb = "--account-for-embedding-in-pipeline-split" in f
    loss = "--account-for-loss-in-pipeline-split" in f
    middle = pp - (first is not None) - (last is not None)
    rest = s.layers - (first or 0) - (last or 0)
    out = []
    for c in range(v):
        for r in range(pp):
            if first is not None and r == 0:
                k = first // v
            elif last is not None and r == pp - 1:
                k = last // v
            elif first is None and last is None:
                k = (s.layers + emb + loss) // (pp * v) - (emb and (r, c) == (0, 0)) - (loss and (r, c) == (pp - 1, v - 1))
            else:
                k = rest // middle // v
            end = (r, c) == (pp - 1, v - 1)
            out.append(("E" if (r, c) == (0, 0) else "") + "t" * k + ("m" * job.mtp + "L" if end else ""))
    return "|".join(out)


@QUARTER
@given(split_jobs())
def test_uneven_stages_and_slots_with_mtp_equal_their_layout_string(job):
    """Uneven first / last stages under 1-3 virtual stages, or the embedding / loss counted in the split, with MTP
    depths 0-2 and CP, TP, recompute as tests/property_space.py draws them: the same numbers on every rank as the
    layout string that places the same layers (test_properties_equivalence checks the slots without MTP, uneven
    splits or virtual stages beyond 2; test_properties_layout_corners the even / uneven splits of feature_specs)."""
    assume(job.stages is None)
    a = estimate(job.layout())
    drop = ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
            "--num-virtual-stages-per-pipeline-rank")
    flags = _drop(job.flags(), *drop)
    flags = [x for x in flags if x not in ("--account-for-embedding-in-pipeline-split",
                                           "--account-for-loss-in-pipeline-split")]
    b = _estimate(flags + ["--pipeline-model-parallel-layout", _split_as_layout(job)], job.spec.world, job.era)
    assert _numbers(b) == _numbers(a)
