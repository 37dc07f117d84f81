"""memguard report predicts each logged rank at its own position: the global rank N of a Megatron log line
(``[Rank N] ...``, report_memory) fixes its pipeline stage, its slice of the distributed optimizer (DP x CP
group) and its expert-data-parallel slice, in megatron-core's rank order, checked here against megatron-core's
own RankGenerator (parallel_state, core 0.16.1 and 0.19.2). The layouts are chosen so that the last optimizer
slices hold 64 padding elements: those ranks hold 64 x 12 bytes (fp32 main parameter + Adam's two moments,
megatron/core/optimizer/distrib_optimizer.py) less optimizer state than rank 0, a hand count."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from megatron_logs import args_of, interleave, print_args, report_memory
from megatron_memguard import estimate, layout_from_flags, lookup_gpu
from megatron_memguard.calibrate.runs import megatron_observations
from megatron_memguard.report.megatron_log import read_megatron_logs
from megatron_memguard.report.megatron_run import rank_position

# One layer, hidden 192, RMSNorm, no biases, swiglu, vocab 1000 -> 1024 (padded to 128 x TP):
# dense parameters 192 (norm) + 192 x 576 (QKV) + 192 x 192 (proj) + 192 (pre-MLP norm) + 2 x 192 (router)
#   + 1024 x 192 (embedding) + 256 x 192 (learned positions) + 192 (final norm) = 394,176 = 3079.5 x 128;
# one local expert (2 experts, EP 2): 2 x 199 x 192 (fc1, swiglu) + 199 x 192 (fc2) = 114,624 = 895.5 x 128.
# Every parameter is a multiple of 64 elements (no alignment holes); each buffer's end is padded to
# lcm(shard, 128) (megatron/core/distributed/param_and_grad_buffer.py): 64 padding elements, all in the
# last rank's slice.
FLAGS = ("--num-layers 1 --hidden-size 192 --num-attention-heads 8 --ffn-hidden-size 512 --seq-length 256 "
         "--max-position-embeddings 256 --micro-batch-size 1 --global-batch-size 16 --vocab-size 1000 --bf16 "
         "--num-experts 2 --moe-router-topk 1 --moe-router-pre-softmax --expert-model-parallel-size 2 "
         "--expert-tensor-parallel-size 1 --moe-ffn-hidden-size 199 --swiglu --normalization RMSNorm "
         "--disable-bias-linear --use-distributed-optimizer").split()
PAD_BYTES = 64 * (4 + 4 + 4)
H100 = lookup_gpu("H100-80GB")


def _report(*argv):
    return subprocess.run([sys.executable, "-m", "megatron_memguard.cli.main", "report", *argv], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})


@pytest.mark.parametrize("tp,cp,dp,pp,ep,etp,mapping", [
    (1, 1, 8, 1, 2, 1, False), (4, 1, 4, 1, 2, 1, False), (2, 2, 2, 2, 2, 1, False), (2, 2, 2, 2, 2, 1, True),
    (1, 2, 2, 2, 4, 1, True), (2, 1, 4, 2, 1, None, True), (1, 4, 2, 1, 1, None, False)])
def test_positions_are_megatron_cores_rank_generator(tp, cp, dp, pp, ep, etp, mapping):
    """Stage, dense DP x CP index and expert-DP index of every global rank, as parallel_state's generators
    (dense: EP 1; expert: TP = ETP, CP 1) give them, in the order initialize_model_parallel uses."""
    ps = pytest.importorskip("megatron.core.parallel_state")
    world = tp * cp * dp * pp
    flags = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
             "--max-position-embeddings", "256", "--micro-batch-size", "1", "--global-batch-size", "64",
             "--vocab-size", "1000", "--bf16", "--use-distributed-optimizer",
             "--tensor-model-parallel-size", str(tp), "--context-parallel-size", str(cp),
             "--pipeline-model-parallel-size", str(pp)]
    if tp > 1:
        flags.append("--sequence-parallel")
    if etp is not None:
        flags += ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", str(ep),
                  "--expert-tensor-parallel-size", str(etp), "--moe-ffn-hidden-size", "128"]
    if mapping:
        flags.append("--use-tp-pp-dp-mapping")
    L = layout_from_flags(flags, world_size=world, megatron_version="0.19")
    order = "tp-cp-ep-pp-dp" if mapping else "tp-cp-ep-dp-pp"
    dense = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    pp_of = {g: i for grp in dense.get_ranks("pp") for i, g in enumerate(grp)}
    tp_of = {g: i for grp in dense.get_ranks("tp") for i, g in enumerate(grp)}
    cp_of = {g: i for grp in dense.get_ranks("cp") for i, g in enumerate(grp)}
    dp_of = {g: i for grp in dense.get_ranks("dp") for i, g in enumerate(grp)}
    opt_of = {g: i for grp in dense.get_ranks("dp-cp") for i, g in enumerate(grp)}
    edp_of = None
    if etp is not None:
        expert = ps.RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)
        edp_of = {g: i for grp in expert.get_ranks("dp") for i, g in enumerate(grp)}
    for g in range(world):
        p = rank_position(g, L, mapping)
        assert (p.pp, p.tp, p.cp, p.dp, p.optimizer_rank) == (pp_of[g], tp_of[g], cp_of[g], dp_of[g], opt_of[g]), g
        assert p.expert_optimizer_rank == (edp_of[g] if edp_of else None), g


def _all_ranks_log(tmp_path, L, world, est_of, era):
    """Every rank's report_memory line (a log of all ranks, e.g. a patched report_memory), 2% over the
    prediction the test works out for that rank."""
    lines = print_args(args_of(FLAGS + ["--context-parallel-size", str(L.cp)], world))
    streams = []
    for r in range(world):
        s = est_of(r).stages[0]
        streams.append([report_memory(r, f"(after {it} iterations)", s.persistent_bytes,
                                      int(s.peak_allocated_bytes * 1.02), s.peak_reserved_bytes,
                                      s.peak_reserved_bytes, era=era) for it in (1, 2)])
    p = tmp_path / "train.log"
    p.write_text("\n".join(lines + interleave(*streams, seed=1)) + "\n")
    return p


@pytest.mark.parametrize("era", ["0.19", "old"])
def test_every_rank_is_predicted_at_its_dense_and_expert_slice(tmp_path, era):
    """TP 1, EP 2, DP 8: dense optimizer index = rank, expert-DP index = rank // 2 (RankGenerator above).
    Ranks 6 and 7 hold the last expert slice (64 padding elements), rank 7 the last dense slice too."""
    L = layout_from_flags(FLAGS, world_size=8, megatron_version="0.19")
    exp = {r: (r, r // 2) for r in range(8)}
    log = _all_ranks_log(tmp_path, L, 8, lambda r: estimate(L, gpu=H100, dp_rank=exp[r][0], expert_dp_rank=exp[r][1]),
                         era)
    r = _report(str(log), "--gpu", "H100-80GB", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    peaks = {x["rank"]: x["predicted_peak_allocated"] for x in doc["ranks"]}
    assert sorted(peaks) == list(range(8))
    assert len({peaks[r] for r in range(6)}) == 1
    assert peaks[0] - peaks[6] == PAD_BYTES            # the last expert slice
    assert peaks[0] - peaks[7] == 2 * PAD_BYTES        # and the last dense slice
    for x in doc["ranks"]:
        assert x["error_max_allocated"] == pytest.approx(0.02, abs=1e-4), x["rank"]
    # calibrate reads the same positions
    obs = megatron_observations(read_megatron_logs(str(log)), L, False)
    assert [(o.rank, o.dp_rank, o.expert_dp_rank) for o in obs] == [(r, r, r // 2) for r in range(8)]


def test_context_parallel_ranks_of_dp_rank_0_own_different_slices(tmp_path):
    """Stock Megatron: report_memory prints on DP rank 0, i.e. on both CP ranks of TP 1 CP 2 DP 1. CP rank 1
    (global 1) is index 1 of the DP x CP group of 2: the last dense slice, 64 padding elements (the dense
    buffer 394,176 -> 394,240, lcm(2, 128)); the expert group has one member."""
    L = layout_from_flags(FLAGS + ["--context-parallel-size", "2"], world_size=2, megatron_version="0.19")
    assert [(rank_position(r, L).cp, rank_position(r, L).optimizer_rank) for r in (0, 1)] == [(0, 0), (1, 1)]
    log = _all_ranks_log(tmp_path, L, 2, lambda r: estimate(L, gpu=H100, dp_rank=r), "0.19")
    doc = json.loads(_report(str(log), "--gpu", "H100-80GB", "--json").stdout)
    peaks = {x["rank"]: x["predicted_peak_allocated"] for x in doc["ranks"]}
    assert peaks[0] - peaks[1] == PAD_BYTES
    assert all(x["error_max_allocated"] == pytest.approx(0.02, abs=1e-4) for x in doc["ranks"])


def test_oom_forensics_compare_the_failing_rank_at_its_own_slices(tmp_path):
    """An out-of-memory error on rank 7 (TP 1, EP 2, DP 8: last dense and last expert slice) is compared with
    that rank's prediction: 2 x 64 x 12 bytes less persistent state than rank 0's."""
    from megatron_logs import oom_message
    L = layout_from_flags(FLAGS, world_size=8, megatron_version="0.19")
    log = _all_ranks_log(tmp_path, L, 8, lambda r: estimate(L, gpu=H100, dp_rank=r, expert_dp_rank=r // 2), "0.19")
    GiB = 2**30
    msg = oom_message(requested=GiB, capacity=int(79.11 * GiB), free=GiB, process_used=70 * GiB,
                      allocated=60 * GiB, reserved=61 * GiB)
    with open(log, "a") as f:
        f.write(f"[rank7]: {msg}\n")
    r = _report(str(log), "--gpu", "H100-80GB", "--json")
    assert r.returncode == 1, r.stderr
    (fx,) = json.loads(r.stdout)["oom_forensics"]
    rank0 = estimate(L, gpu=H100, dp_rank=0).stages[0].persistent_bytes
    assert fx["rank"] == 7 and rank0 - fx["predicted"]["persistent"] == 2 * PAD_BYTES
