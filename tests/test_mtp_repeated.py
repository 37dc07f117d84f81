"""--mtp-use-repeated-layer and --mtp-standalone.

Sources: megatron-core 0.19.2 transformer/multi_token_prediction.py MultiTokenPredictionBlock._build_layers
("build one layer, use it for all depths"; forward takes ``self.layers[0]`` at every depth; the same in 0.17.1 and
0.18.2, no such TransformerConfig field in 0.16.1), transformer_config.py (``mtp_standalone`` is set from
``--pipeline-model-parallel-layout`` when one is given) and pipeline_parallel/p2p_communication.py (the flag
alone only makes P2P exchange tensor shapes)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from build_util import run_script   # tests/e2e scripts through a fork server (torch and megatron imported once)

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 2 MoE layers (4 experts of SwiGLU 64, top-2), h 64, 4 heads of 16, RMSNorm, no biases, untied, PP 2, 3 MTP depths
FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --kv-channels 16 --ffn-hidden-size 128 --swiglu "
         "--disable-bias-linear --normalization RMSNorm --pipeline-model-parallel-size 2 --num-experts 4 "
         "--moe-ffn-hidden-size 64 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
         "--untie-embeddings-and-output-weights --seq-length 64 --max-position-embeddings 64 "
         "--position-embedding-type rope --vocab-size 1000 --micro-batch-size 1 --global-batch-size 8 "
         "--tokenizer-type NullTokenizer --bf16 --mtp-num-layers 3").split()
REPEATED = ["--mtp-use-repeated-layer"]
# one MoE layer: attention (QKV 64 x 192, proj 64 x 64) + input norm 64 + pre-MLP norm 64 + router 4 x 64
# + 4 experts (fc1 64 x 128, fc2 64 x 64): 12,288 + 4,096 + 128 + 256 + 4 x 12,288 = 65,920;
# one MTP depth adds enorm, hnorm, final norm (3 x 64) and eh_proj [64, 128]: 74,304
LAYER = 12_288 + 4_096 + 128 + 256 + 4 * 12_288
DEPTH = LAYER + 3 * 64 + 64 * 128


def _stages(extra, version="0.19"):
    return estimate(layout_from_flags(FLAGS + extra, world_size=2, megatron_version=version)).stages


def test_repeated_layer_counts_one_depths_parameters():
    assert (LAYER, DEPTH) == (65_920, 74_304)
    three, one = _stages([]), _stages(REPEATED)
    assert three[1].parameters - one[1].parameters == 2 * DEPTH
    assert three[0].parameters == one[0].parameters
    # the activations are the three depths' still: only the weights' terms move
    for name in ("mtp_block_activations", "mtp_loss_buffers", "layer_activations", "moe_layer_activations"):
        assert three[1].breakdown.get(name) == one[1].breakdown.get(name), name


def _core_python() -> str | None:
    """A Python whose megatron-core has mtp_use_repeated_layer (0.17 and later)."""
    for p in (os.environ.get("MEMGUARD_PY312"), os.path.join(ROOT, ".venv312", "bin", "python"), sys.executable):
        if not p or not os.path.exists(p):
            continue
        out = run_script([p, "-c", "from megatron.core import package_info as p; print(p.__version__)"])
        if out.returncode == 0 and tuple(int(x) for x in out.stdout.strip().split(".")[:2]) >= (0, 17):
            return p
    return None


def test_repeated_layer_parameters_are_megatron_cores():
    """The last stage's parameters as megatron-core builds them (tests/e2e/moe_rank_params.py), with and without
    the repeated layer (0.19.2 in the 3.12 venv: 419,968 and 271,360)."""
    python = _core_python()
    if python is None:
        pytest.skip("no megatron-core >= 0.17 ($MEMGUARD_PY312, .venv312)")
    job = dict(num_layers=2, hidden_size=64, heads=4, kv_channels=16, groups=None, ffn=128, bias=False, glu=True,
               norm="RMSNorm", tp=1, pp=2, vpp=None, ep=1, etp=1, experts=4, moe_ffn=64, topk=2, freq=1,
               shared_ffn=None, shared_gate=False, expert_bias=False, untied=True, seq=64, mtp=3, mla=None,
               first=None, last=None, acc_emb=False, acc_loss=False, layout=None, vocab=1024,
               ranks=[[0, None, 0, 0, 0], [1, None, 0, 0, 0]])
    jobs = [dict(job, mtp_repeated=False), dict(job, mtp_repeated=True)]
    env = dict(os.environ, PYTHONPATH=ROOT, MEMGUARD_E2E_PORT="29581", MASTER_PORT="29581")
    out = run_script([python, os.path.join(ROOT, "tests", "e2e", "moe_rank_params.py"), json.dumps(jobs)],
                     env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    built = json.loads(out.stdout.strip().splitlines()[-1])
    for records, extra in zip(built, ([], REPEATED)):
        stages = _stages(extra)
        assert [r["params"] for r in records] == [st.parameters for st in stages], extra
    assert built[0][1]["params"] - built[1][1]["params"] == 2 * DEPTH


def test_repeated_layer_rules():
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(FLAGS + REPEATED, world_size=2, megatron_version="0.16")
    assert "--mtp-use-repeated-layer" in str(e.value) and "0.17" in str(e.value)


def test_repeated_layer_as_one_fsdp2_unit():
    # TorchFullyShardedDataParallel (core 0.19.2) fully_shards every TransformerLayer: the one MTP layer is one FSDP2
    # unit called at the 3 depths (PP 1, DP 2: FSDP2 takes no pipeline). Its parameters once (2 depths' fewer than 3
    # layers: 2 x 74,304), and one unit gathered at a time as for 3 separate layers (tests/e2e/fsdp2_repeated_unit.py)
    fsdp2 = [a if not (a == "2" and FLAGS[i - 1] == "--pipeline-model-parallel-size") else "1"
             for i, a in enumerate(FLAGS)] + ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"]
    three, one = (estimate(layout_from_flags(fsdp2 + extra, world_size=2)).stages[0] for extra in ([], REPEATED))
    assert three.parameters - one.parameters == 2 * DEPTH == 148_608
    # each rank's bf16 shard of the parameters (one element = 2 bytes over 2 ranks)
    assert three.breakdown["fsdp_parameters"] - one.breakdown["fsdp_parameters"] == 148_608
    assert three.breakdown["fsdp_unsharded_parameters"] == one.breakdown["fsdp_unsharded_parameters"]
    assert three.breakdown["layer_activations"] == one.breakdown["layer_activations"]
    L = layout_from_flags(fsdp2 + REPEATED, world_size=2)
    assert any("one FSDP2 unit for the 3 depths" in n for n in L.notes)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_fsdp2_unit_called_at_every_depth_on_cpu():
    # torch FSDP2 on CPU with gloo (2 ranks): one fully_shard unit called at 3 depths is all-gathered at each call's
    # forward and again at each depth's backward (6), and its gradient, which autograd accumulates over the 3 calls
    # (the shared weight's AccumulateGrad runs once all of them are in), is reduce-scattered once, in the last
    # depth's post-backward hook (the earlier two find no gradient yet): one unsharded gradient of the unit, equal to
    # the sum of the 3 calls' (the eager model's)
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(port), os.path.join(ROOT, "tests", "e2e", "fsdp2_repeated_unit.py"), "3"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"all_gather": 6, "reduce_scatter": 1, "post_backward": 3, "reduced_at_post_backward": [3],
                   "gradient_is_the_sum": True}


FSDP_MEASURED = os.path.join(ROOT, "benchmarks", "results", "referee-fsdp-mtp-core019.json")


def test_repeated_layer_under_megatron_fsdp_against_the_referee():
    """benchmarks/referee/fsdp_grid.py FSDP_MTP on megatron-core 0.19.2 (CPU, 4 ranks: optim_grads_params, DP 4,
    EP 2, the MoE grid's model with 2 MTP depths): the repeated layer is one FSDP unit (its parameters, gradient and
    optimizer shards once), gathered and released at each of its calls. Each rank: parameters exact, live bytes
    after the step within 1%. The peak (at the loss of iteration 2's first micro-batch) is measured by the tracker
    that sees a storage's own resize_: Megatron-FSDP releases each unit's gathered weights after its forward
    (_free_storage, untyped storage resized to 0, megatron_fsdp/param_and_grad_buffer.py core 0.19.2), and from
    core 0.18 nothing gathers them again before the loss (the final norm's pre-forward hook no longer prefetches
    them: estimator/fsdp.py UNITS_REGATHERED_BEFORE_LOSS_UNTIL), so the peak holds no unit's weights and memguard
    names none there (it did, 11,821,056 / 9,850,880 B, and was 3.9-7.4% high). The estimate is within 1.5% of
    every rank's peak, which the ranks' routing spreads (-1.4..+1.4%)."""
    from benchmarks.referee.grids.fsdp import FSDP_MTP, stored_rank_layouts
    core, _, rows = stored_rank_layouts(FSDP_MEASURED, FSDP_MTP)
    assert core == "0.19.2"
    after = {}
    for cfg, r, L in rows:
        st = estimate(L, profile="local", device="cpu", dp_rank=r["dp_rank"] % L.dp_shard_size).stages[0]
        assert st.parameters == r["num_params"], (cfg["name"], r["rank"])
        assert abs(st.persistent_bytes / r["live_bytes_after_step"] - 1) <= 0.01, (cfg["name"], r["rank"])
        assert abs(st.peak_allocated_bytes / r["peak_bytes"] - 1) <= 0.015, (cfg["name"], r["rank"])
        assert not st.breakdown.get("fsdp_unsharded_parameters"), (cfg["name"], r["rank"])
        after[cfg["name"], r["rank"]] = (r["live_bytes_after_step"], st.persistent_bytes)
    # the one layer less: measured and estimated after the step alike (within 1% of the difference)
    for rank in range(4):
        (m2, e2), (m1, e1) = after["fsdp_moe_ep2_mtp2", rank], after["fsdp_moe_ep2_mtp2_repeated", rank]
        assert abs((e2 - e1) / (m2 - m1) - 1) < 0.01, rank


def test_repeated_layer_under_cuda_graphs():
    # local graphs (CudaGraphManager.get_cudagraph_runner, transformer/cuda_graphs.py core 0.17.1 to 0.19.2): a
    # call takes a FWD_READY runner and a recorded runner waits for its backward, so the 3 depths take 3 runners,
    # as 3 layers. Last stage: 1 decoder + 3 MTP graphed layers x 8 micro-batches (PP 2: a runner per micro-batch)
    # x static input and grad-output [64, 64] bf16 (2 x 8,192 B) = 524,288 B
    local = ["--cuda-graph-impl", "local"]
    three, one = _stages(local), _stages(REPEATED + local)
    assert three[1].breakdown["cuda_graph_static_io"] == one[1].breakdown["cuda_graph_static_io"] == 4 * 8 * 2 * 8_192
    assert three[1].parameters - one[1].parameters == 2 * DEPTH
    # Transformer Engine's graphs: one callable for the one MTP layer, replayed at every depth (module.py
    # cuda_graphs[current_microbatch % len]), each replay overwriting the graph's static outputs and saved tensors
    # (TE 2.20.2 graph.py Graphed.forward): the earlier depths' backward would run on the last depth's tensors, a
    # rule error naming the flag
    with pytest.raises(ConfigError) as e:
        _stages(REPEATED + ["--cuda-graph-impl", "transformer_engine"])
    assert str(e.value).startswith("--mtp-use-repeated-layer: does not work with --cuda-graph-impl transformer_engine "
                                   "when the MTP layer is graphed")
    assert "3 depths replay that graph" in str(e.value) and "--cuda-graph-impl local" in str(e.value)
    # an MTP layer the modules do not graph (its MoE MLP under --cuda-graph-modules mlp with a dense first layer:
    # _layer_is_graphable) is not captured: estimated
    dense_first = ["--moe-layer-freq", "[0,1]"]
    L = layout_from_flags(FLAGS + REPEATED + dense_first + ["--cuda-graph-impl", "transformer_engine",
                                                            "--cuda-graph-modules", "mlp"], world_size=2)
    assert L.mtp_use_repeated_layer
    # one depth: the repeated layer is the plain one, graphed alike
    one_depth = [a.replace("3", "1") if a == "3" else a for a in FLAGS]
    L = layout_from_flags(one_depth + REPEATED + ["--cuda-graph-impl", "transformer_engine"], world_size=2)
    assert L.mtp_num_layers == 1


def test_standalone_flag_without_a_layout_keeps_mtp_on_the_last_stage():
    plain = _stages([])
    L = layout_from_flags(FLAGS + ["--mtp-standalone"], world_size=2, megatron_version="0.19")
    flagged = estimate(L).stages
    assert [s.peak_allocated_bytes for s in flagged] == [s.peak_allocated_bytes for s in plain]
    assert any("--mtp-standalone" in n for n in L.notes)
