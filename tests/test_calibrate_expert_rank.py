"""memguard calibrate predicts each JSONL rank at its own expert-data-parallel optimizer position: megatron-core's
``expert_optimizer_rank`` when the hook recorded it, else worked out from the dense optimizer rank and ``tp_rank``,
else (an older log) TP rank 0's position."""
from megatron_memguard import layout_from_flags, lookup_gpu
from megatron_memguard.calibrate.model import stage
from megatron_memguard.calibrate.runs import read_runs
from megatron_memguard.estimator import DEFAULT_SITE
from megatron_memguard.runtime import MemoryMonitor, Reading, StaticSource
from megatron_memguard.runtime.sinks import JsonlSink

# TP 4, EP 2, ETP 1 on 16 GPUs (one stage, bf16, distributed optimizer): dense DP 4, expert DP 16 / 2 = 8.
# megatron-core's RankGenerator (order "tp-cp-ep-dp-pp") puts dense DP rank 1 (global ranks 4-7) at expert
# positions 2, 2, 3, 3 on TP ranks 0-3 (tests/test_expert_dp_rank_hook.py checks the order against it).
FLAGS = ("--num-layers 2 --hidden-size 256 --num-attention-heads 8 --ffn-hidden-size 512 --seq-length 256 "
         "--max-position-embeddings 256 --micro-batch-size 1 --global-batch-size 16 --vocab-size 1000 --bf16 "
         "--tensor-model-parallel-size 4 --sequence-parallel --num-experts 4 --moe-router-topk 2 "
         "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --moe-ffn-hidden-size 200 "
         "--use-distributed-optimizer").split()
A100 = lookup_gpu("A100-80GB")

# The expert shard by hand. Each EP rank holds 2 layers x 2 experts; one expert's DDP buffer, in reverse
# parameter order (megatron-core distributed/param_and_grad_buffer.py, each param's start padded to 64 elements
# with the distributed optimizer): fc2.bias 256, fc2.weight 200 x 256 = 51200, fc1.bias 200 (+56 gap),
# fc1.weight 256 x 200 = 51200: 102912 elements, 4 x 102912 = 411648 in all, a multiple of lcm(8, 128) (no
# end padding), so each of the 8 expert shards is 51456 elements = half an expert: even positions own
# fc2.bias + fc2.weight (51456 real elements), odd ones fc1.bias + its gap + fc1.weight (51400). The optimizer
# keeps 12 bytes per owned element (fp32 main parameter + Adam's two fp32 moments), so an odd position holds
# 56 x 12 = 672 bytes less than an even one.
ODD_LESS = 56 * 12


def _write(d, ctxs, L):
    d.mkdir()
    for rank, ctx in ctxs:
        src = StaticSource(Reading(allocated=10 ** 9, max_allocated=2 * 10 ** 9, reserved=3 * 10 ** 9,
                                   max_reserved=3 * 10 ** 9, device_used=4 * 10 ** 9))
        m = MemoryMonitor(src, None, rank=rank, pp_rank=0, interval=1,
                          sinks=[JsonlSink(JsonlSink.path_for(str(d), rank))],
                          context={"layout": L.to_dict(), "decision": {"gpu": "A100-80GB"}, "pp_rank": 0, **ctx})
        m.start()
        m.step(1)
        m.finish()
    return str(d)


def _persistent(path):
    (run,) = read_runs([path])
    obs = sorted(run.observations, key=lambda o: o.rank)
    return [o.expert_dp_rank for o in obs], [stage(run, o, DEFAULT_SITE).persistent_bytes for o in obs]


def test_calibrate_predicts_each_tp_rank_at_its_expert_position(tmp_path):
    L = layout_from_flags(FLAGS, world_size=16, megatron_version="0.19")
    # the hook's context of global ranks 4-7 without megatron-core's expert rank: worked out from tp_rank
    worked = _write(tmp_path / "worked", [(4 + t, {"tp_rank": t, "dp_rank": 1, "optimizer_rank": 1})
                                          for t in range(4)], L)
    pos, got = _persistent(worked)
    assert pos == [2, 2, 3, 3]
    assert got[0] == got[1] and got[2] == got[3] and got[0] - got[2] == ODD_LESS
    # megatron-core's own position wins over the worked-out one (here a position of the other parity)
    given = _write(tmp_path / "given", [(4 + t, {"tp_rank": t, "dp_rank": 1, "optimizer_rank": 1,
                                                  "expert_optimizer_rank": 5 - t // 2}) for t in range(4)], L)
    pos, got2 = _persistent(given)
    assert pos == [5, 5, 4, 4] and got2 == [got[2], got[2], got[0], got[0]]
    # an older log (no tp_rank): TP rank 0's position for every rank, the old behaviour
    old = _write(tmp_path / "old", [(4 + t, {"dp_rank": 1}) for t in range(4)], L)
    pos, got3 = _persistent(old)
    assert pos == [None] * 4 and got3 == [got[0]] * 4
