"""`memguard plan`: exit codes, --json schema, --explain, the flags to paste, model presets."""
import json
import re
import sys

import pytest

from megatron_memguard import estimate, layout_from_flags, lookup_gpu
from megatron_memguard.cli.main import main
from megatron_memguard.planner.search import TIE_WINDOW
from megatron_memguard.planner.timing import TERM_NAMES

from conftest import LLAMA2_7B, LLAMA31_70B, LLAMA31_8B

BASE = ["plan", "--gpus", "64", "--gpu", "H100-80GB", "--seq-length", "8192", "--global-batch-size", "512"]


def run(capsys, *args, model=LLAMA31_8B):
    code = main([*args, "--", *model] if model else list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_schema(capsys):
    code, out, _ = run(capsys, *BASE, "--top", "3", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["schema"] == "memguard.plan/1"
    for k in ("rule", "gpus", "gpu", "gpus_per_node", "gpu_memory_bytes", "threshold", "seq_length",
              "global_batch_size", "model_flops_per_token", "search", "layouts", "notes"):
        assert k in doc
    assert doc["gpus"] == 64 and doc["gpus_per_node"] == 8 and doc["rule"] == "time"
    for k in ("considered", "visited", "pruned_by_memory_bound", "rejected_by_megatron_rules", "estimated", "fitting"):
        assert isinstance(doc["search"][k], int)
    assert len(doc["layouts"]) == 3
    # the layout as `memguard estimate --json` writes it
    code_e = main(["estimate", "--world-size", "64", "--json", "--", *LLAMA31_8B, "--micro-batch-size", "1",
                   "--tensor-model-parallel-size", "2"])
    est_doc = json.loads(capsys.readouterr().out)
    assert code_e in (0, 1)
    times = [e["step_time_s"] for e in doc["layouts"]]
    for i, e in enumerate(doc["layouts"], 1):
        assert e["rank"] == i
        assert set(e["layout"]) == set(est_doc["layout"])
        assert isinstance(e["peak_device_bytes"], int) and e["peak_device_bytes"] == max(e["stage_device_bytes"])
        assert e["verdict"] == "fits" and e["peak_device_bytes"] <= 0.8 * doc["gpu_memory_bytes"]
        assert 0 < e["mfu"] < 1 and e["tokens_per_s_per_gpu"] > 0
        assert list(e["step_time_terms"]) == list(TERM_NAMES)
        assert sum(e["step_time_terms"].values()) == pytest.approx(e["step_time_s"], rel=1e-12)
        assert e["tokens_per_s_per_gpu"] == pytest.approx(512 * 8192 / e["step_time_s"] / 64)
        # fastest first, up to the tie window: never slower than (1 + window) x any layout ranked after it
        assert e["step_time_s"] <= (1 + TIE_WINDOW) * min(times[i - 1:])
        assert e["megatron_flags"] and e["nemo2_overrides"] and e["bridge_overrides"]
        # the layout reproduces from the model and the flags the planner prints
        L = layout_from_flags(LLAMA31_8B + " ".join(e["megatron_flags"]).split(), world_size=64)
        got = {k: v for k, v in e["layout"].items() if k not in ("env", "notes")}
        assert {k: v for k, v in L.to_dict().items() if k not in ("env", "notes")} == got
        # only memory-relevant environment variables travel into the layout
        assert all(k.startswith(("CUBLAS_", "NCCL_", "CUDA_", "NVTE_", "PYTORCH_", "TORCH_")) for k in e["layout"]["env"])


def test_text_output_and_flags_to_paste(capsys):
    code, out, _ = run(capsys, *BASE, "--top", "4")
    assert code == 0
    assert "stage peaks GiB" in out and "tok/s/GPU" in out and "MFU" in out
    assert "Megatron flags:" in out and "NeMo 2" in out and "Megatron-Bridge" in out
    assert "--tensor-model-parallel-size" in out and "trainer.strategy.tensor_model_parallel_size" in out
    assert "model.tensor_model_parallel_size" in out and "train.micro_batch_size" in out
    assert re.search(r"^1\s+TP\d", out, re.M)


def _explain_text_terms(out):
    terms = {}
    for line in out.splitlines():
        m = re.match(r"^\s+(\S+|= step)\s+([0-9.]+) s\s+[0-9.]+%", line)
        if m:
            terms[m.group(1)] = float(m.group(2))
    return terms


def test_explain_terms_sum_to_the_step_time(capsys):
    code, out, _ = run(capsys, "plan", "--gpus", "1024", "--seq-length", "8192", "--global-batch-size", "1024",
                       "--explain", "tp=8,pp=4,vpp=5,cp=1,mbs=1,recompute=none", model=LLAMA31_70B)
    assert code == 0
    terms = _explain_text_terms(out)
    step = terms.pop("= step")
    assert list(terms) == list(TERM_NAMES)
    assert sum(terms.values()) == pytest.approx(step, abs=5e-4)      # printed to 0.1 ms
    assert "the other 3 ranks' work per micro-batch / VPP" in out and "/ 5 (step = m x slowest rank" in out
    assert "one micro-batch per rank, ms:" in out and "slowest rank 3" in out
    assert "memory: fits" in out
    code, out, _ = run(capsys, "plan", "--gpus", "1024", "--seq-length", "8192", "--global-batch-size", "1024",
                       "--explain", "tp=8,pp=4,vpp=5,cp=1,mbs=1,recompute=none", "--json", model=LLAMA31_70B)
    doc = json.loads(out)
    assert doc["schema"] == "memguard.plan.explain/1"
    assert sum(doc["step_time_terms"].values()) == pytest.approx(doc["step_time_s"], rel=1e-12)
    assert set(doc["term_details"]) == set(TERM_NAMES)
    assert doc["layout"]["virtual_pipeline_model_parallel_size"] == 5
    # the memory verdict is the estimator's
    L = layout_from_flags(LLAMA31_70B + "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 "
                          "--num-virtual-stages-per-pipeline-rank 5 --sequence-parallel --micro-batch-size 1 "
                          "--global-batch-size 1024 --use-distributed-optimizer --overlap-grad-reduce "
                          "--overlap-param-gather".split(), world_size=1024)
    assert estimate(L, gpu=lookup_gpu("H100-80GB")).peak_device_bytes == doc["peak_device_bytes"]


def test_explain_of_a_layout_that_does_not_fit_exits_1(capsys):
    code, out, _ = run(capsys, *BASE, "--explain", "tp=1,pp=1,cp=1,mbs=4")
    assert code == 1 and "will not fit" in out


def test_nothing_fits_exits_1(capsys):
    code, out, _ = run(capsys, "plan", "--gpus", "8", "--gpu", "A100-40GB", "--seq-length", "8192",
                       "--global-batch-size", "64", model=LLAMA31_70B)
    assert code == 1 and "no layout fits" in out


def test_fujii_rule(capsys):
    code, out, _ = run(capsys, *BASE, "--rule", "fujii2024", "--top", "3", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["rule"] == "fujii2024"
    mp = [(e["layout"]["tensor_model_parallel_size"] * e["layout"]["pipeline_model_parallel_size"]
           * e["layout"]["context_parallel_size"], -e["layout"]["micro_batch_size"]) for e in doc["layouts"]]
    assert mp == sorted(mp)


def test_constraints_from_the_command_line(capsys):
    code, out, _ = run(capsys, *BASE, "--tp", "4", "--pp", "1,2", "--mbs", "1", "--no-recompute", "--no-dist-opt",
                       "--top", "20", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["layouts"]
    for e in doc["layouts"]:
        L = e["layout"]
        assert L["tensor_model_parallel_size"] == 4 and L["pipeline_model_parallel_size"] in (1, 2)
        assert L["micro_batch_size"] == 1 and L["recompute_granularity"] is None
        assert L["use_distributed_optimizer"] is False


def test_model_config_parallel_flags_are_ignored_with_a_note(capsys):
    code, out, _ = run(capsys, *BASE, "--top", "1", model=LLAMA31_8B + ["--tensor-model-parallel-size", "8",
                                                                         "--micro-batch-size", "4"])
    assert code == 0
    assert "note: the planner chooses --tensor-model-parallel-size, --micro-batch-size itself" in out


@pytest.mark.parametrize("args, model, key, rule", [
    (["plan", "--seq-length", "8192", "--global-batch-size", "64"], LLAMA31_8B, "--gpus", "required"),
    (["plan", "--gpus", "8", "--global-batch-size", "64"], ["--num-layers", "2", "--hidden-size", "64",
                                                            "--num-attention-heads", "4"], "--seq-length", "required"),
    (["plan", "--gpus", "8", "--seq-length", "8192"], LLAMA31_8B, "--global-batch-size", "required"),
    (["plan", "--gpus", "8", "--seq-length", "8192", "--global-batch-size", "64", "--tp", "two"], LLAMA31_8B,
     "--tp", "integer"),
    (["plan", "--gpus", "8", "--seq-length", "8192", "--global-batch-size", "64", "--explain", "tp=8,foo=1"],
     LLAMA31_8B, "--explain", "unknown key 'foo'"),
    (["plan", "--gpus", "8", "--seq-length", "8192", "--global-batch-size", "64", "--explain", "tp=3"],
     LLAMA31_8B, "--explain", "not divisible"),
    (["plan", "--gpus", "6", "--seq-length", "8192", "--global-batch-size", "64", "--explain", "tp=3,pp=2"],
     LLAMA31_8B, "--num-attention-heads", "not divisible by tensor-model-parallel size 3"),
    (["plan", "--gpus", "8", "--seq-length", "8192", "--global-batch-size", "64", "--rule", "fastest"], LLAMA31_8B,
     "--rule", "invalid choice"),
    (["plan", "--gpus", "8", "--seq-length", "8192", "--global-batch-size", "64", "--gpu", "V100"], LLAMA31_8B,
     "--gpu", "unknown GPU"),
    (["plan", "--gpus", "8", "--seq-length", "8192", "--global-batch-size", "64"], ["--num-layers", "2"],
     "--hidden-size", "is required"),
])
def test_bad_input_exits_2(capsys, args, model, key, rule):
    code = main([*args, "--", *model])
    err = capsys.readouterr().err
    assert code == 2, err
    assert key in err and rule in err and "Traceback" not in err


def test_seq_length_from_the_model_flags(capsys):
    code, out, _ = run(capsys, "plan", "--gpus", "64", "--global-batch-size", "512", "--top", "1")
    assert code == 0 and "seq 8192" in out          # LLAMA31_8B carries --seq-length 8192


def test_model_preset_goes_through_read_model(capsys):
    """--model NAME is read by the presets of megatron_memguard.readers.models and planned like flags."""
    code = main([*BASE, "--model", "llama3.1-8b", "--top", "1", "--json"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    doc = json.loads(cap.out)
    lay = doc["layouts"][0]["layout"]
    # Llama-3.1-8B's published shape (its config.json)
    assert (lay["num_layers"], lay["hidden_size"], lay["ffn_hidden_size"], lay["num_query_groups"]) == (32, 4096, 14336, 8)


def test_planner_is_pure_python():
    """Planning imports neither torch nor megatron (subprocess: a clean interpreter)."""
    import subprocess
    code = ("import sys; sys.path.insert(0, 'tests'); from conftest import LLAMA31_8B; "
            "from megatron_memguard.cli.main import main; import contextlib, io; "
            "f = io.StringIO(); "
            "ctx = contextlib.redirect_stdout(f); ctx.__enter__(); "
            "main(['plan', '--gpus', '16', '--seq-length', '8192', '--global-batch-size', '64', '--top', '1', '--', *LLAMA31_8B]); "
            "ctx.__exit__(None, None, None); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'transformer_engine')]; "
            "print(','.join(bad))")
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == ""


def test_config_breaking_its_own_format_rules_exits_2(capsys, tmp_path):
    """A Bridge YAML whose dataset.seq_length disagrees with model.seq_length is refused by plan as by estimate."""
    from test_readers_bridge import FLAT
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(FLAT.replace("dataset: {seq_length: 1024}", "dataset: {seq_length: 2048}"))
    for cmd in (["plan", "--gpus", "8", "--global-batch-size", "32"], ["estimate", "--world-size", "8"]):
        code = main([*cmd, "--config", str(cfg)])
        err = capsys.readouterr().err
        assert code == 2 and "model.seq_length" in err and "Traceback" not in err, (cmd, err)


def test_bare_explain_shows_the_chosen_layout_and_the_runner_up_side_by_side(capsys):
    code, out, _ = run(capsys, *BASE, "--top", "2", "--json")
    ranked = [e["name"] for e in json.loads(out)["layouts"]]
    code, out, _ = run(capsys, *BASE, "--explain")
    assert code == 0
    assert "A: #1 (chosen): " in out and f"({ranked[0]})" in out and "B: #2 (runner-up): " in out and f"({ranked[1]})" in out
    terms = _explain_text_terms(out)
    step = terms.pop("= step")
    assert list(terms) == list(TERM_NAMES) and sum(terms.values()) == pytest.approx(step, abs=1e-3)
    code, out, _ = run(capsys, *BASE, "--explain", "--json")
    doc = json.loads(out)
    assert doc["name"] == ranked[0] and doc["compared_with"]["name"] == ranked[1]
    assert doc["role"] == "#1 (chosen)" and doc["compared_with"]["role"] == "#2 (runner-up)"
    diff = doc["term_differences_s"]
    assert sum(diff.values()) == pytest.approx(doc["compared_with"]["step_time_s"] - doc["step_time_s"], rel=1e-9)
    # a layout of one's own is shown next to the chosen one
    code, out, _ = run(capsys, *BASE, "--explain", "tp=8,pp=1,cp=1,mbs=1", "--json")
    doc = json.loads(out)
    assert doc["role"] == "asked" and doc["compared_with"]["name"] == ranked[0]
    assert doc["step_time_s"] > doc["compared_with"]["step_time_s"]


def test_cluster_speeds_from_the_command_line(capsys):
    """--network-gbps replaces the GPU table's network: data-parallel traffic slows on a slower fabric."""
    args = ["plan", "--gpus", "256", "--gpu", "A100-40GB", "--seq-length", "8192", "--global-batch-size", "1024",
            "--explain", "tp=4,pp=1,cp=2,mbs=1", "--json"]
    doc = json.loads(run(capsys, *args)[1])
    slow = json.loads(run(capsys, *args, "--network-gbps", "25")[1])
    assert slow["step_time_terms"]["dp_comm"] > doc["step_time_terms"]["dp_comm"]
    assert slow["step_time_terms"]["gemm"] == doc["step_time_terms"]["gemm"]
    fast = json.loads(run(capsys, *args, "--gemm-efficiency", "0.39")[1])       # half the A100 table's 0.78
    assert fast["step_time_terms"]["gemm"] == pytest.approx(2 * doc["step_time_terms"]["gemm"], rel=0.02)
    code, _, err = run(capsys, *args, "--attention-efficiency", "0")
    assert code == 2 and "--attention-efficiency" in err and "(0, 1]" in err


def test_tie_window_zero_ranks_by_time_alone_and_bad_values_are_refused(capsys):
    code, out, _ = run(capsys, *BASE, "--top", "6", "--json", "--tie-window", "0")
    assert code == 0
    doc = json.loads(out)
    assert doc["tie_window"] == 0
    times = [e["step_time_s"] for e in doc["layouts"]]
    assert times == sorted(times)
    code, out, err = run(capsys, *BASE, "--tie-window", "1.5")
    assert code != 0 and "--tie-window" in err and "Traceback" not in err


def test_explain_says_when_the_tie_window_put_a_slower_layout_first(capsys):
    """Llama-2-7B on 16 H100s, seq 2048, GBS 256: TP2 MBS4 is predicted 2.2% slower than TP1 PP2 MBS2 (the same
    TP x CP x PP); within a 3% window the larger micro-batch ranks first, and --explain says why. Within the
    default 4% window TP1 PP1 MBS1 (predicted 3.7% slower than TP1 PP2 MBS2, 1.5% slower than TP2 MBS4)
    ranks first: the least TP x CP x PP."""
    code, out, _ = run(capsys, "plan", "--gpus", "16", "--gpu", "H100-80GB", "--seq-length", "2048",
                       "--global-batch-size", "256", "--explain", "--tie-window", "0.03", model=LLAMA2_7B)
    assert code == 0
    assert "A: #1 (chosen): TP2 PP1 CP1 DP8 MBS4" in out and "B: #2 (runner-up): TP1 PP2" in out
    assert re.search(r"predicted 2\.\d% slower than the runner-up: within the tie window \(3%\)", out)
    code, out, _ = run(capsys, "plan", "--gpus", "16", "--gpu", "H100-80GB", "--seq-length", "2048",
                       "--global-batch-size", "256", "--explain", model=LLAMA2_7B)
    assert "A: #1 (chosen): TP1 PP1 CP1 DP16 MBS1" in out and "B: #2 (runner-up): TP2 PP1 CP1 DP8 MBS4" in out
    assert re.search(r"predicted 1\.\d% slower than the runner-up: within the tie window \(4%\)", out)
    code, out, _ = run(capsys, "plan", "--gpus", "16", "--gpu", "H100-80GB", "--seq-length", "2048",
                       "--global-batch-size", "256", "--explain", "--tie-window", "0", model=LLAMA2_7B)
    assert "A: #1 (chosen): TP1 PP2" in out and "tie window" not in out
