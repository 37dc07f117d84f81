"""Every example in examples/ runs here, the launch step stubbed with MEMGUARD_LAUNCH_STUB=echo (no cluster):
the wrappers launch only when memguard check passes, MEMGUARD_FORCE=1 overrides, a command memguard cannot
understand is refused (exit 2)."""
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from benchmarks.shared_data import CONFIGS as SHARED_CONFIGS

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EX = os.path.join(ROOT, "examples")
MEMGUARD = f"{sys.executable} -m megatron_memguard.cli.main"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

SMALL = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
         "--num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope "
         "--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
         "--tokenizer-type NullTokenizer --vocab-size 128256 --bf16 --global-batch-size 64 "
         "--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer").split()


def env(**extra):
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("SLURM_", "MEMGUARD", "PET_")) and k not in ("WORLD_SIZE", "RANK")}
    e.update(PYTHONPATH=ROOT, MEMGUARD_CMD=MEMGUARD, MEMGUARD_LAUNCH_STUB="echo")
    e.update(extra)
    return e


def sh(*argv, **extra):
    return subprocess.run(["bash", *argv], env=env(**extra), capture_output=True, text=True, timeout=300)


def launched(out, word):
    return any(line.startswith(word) for line in out.stdout.splitlines())


# --------------------------------------------------------------------------------------------------
def test_torchrun_wrapper():
    wrapper = os.path.join(EX, "torchrun_preflight.sh")
    ok = sh(wrapper, "--nnodes", "2", "--nproc-per-node", "8", "pretrain_gpt.py", "--micro-batch-size", "1", *SMALL)
    assert ok.returncode == 0, ok.stderr
    assert "memguard check: OK to launch" in ok.stdout
    assert launched(ok, "torchrun --nnodes 2 --nproc-per-node 8 pretrain_gpt.py --micro-batch-size 1")
    big = ["--nnodes", "1", "--nproc-per-node", "2", "pretrain_gpt.py", "--micro-batch-size", "8", *SMALL]
    no = sh(wrapper, *big)
    assert no.returncode == 1 and "DO NOT LAUNCH" in no.stdout and not launched(no, "torchrun")
    assert "not launching (MEMGUARD_FORCE=1 overrides)" in no.stderr
    forced = sh(wrapper, *big, MEMGUARD_FORCE="1")
    assert forced.returncode == 0 and launched(forced, "torchrun --nnodes 1") and "launching anyway" in forced.stderr
    # options for memguard itself
    a100 = sh(wrapper, "--nnodes", "2", "--nproc-per-node", "8", "pretrain_gpt.py", "--micro-batch-size", "1", *SMALL,
              MEMGUARD_CHECK_ARGS="--gpu A100-40GB")
    assert "A100-40GB" in a100.stdout
    # a command memguard cannot understand is refused, not guessed
    odd = sh(wrapper, "--nproc-per-node", "gpu", "pretrain_gpt.py", *SMALL)
    assert odd.returncode == 2 and not launched(odd, "torchrun") and "depends on the machine" in odd.stderr


def test_slurm_batch_script():
    script = os.path.join(EX, "slurm_preflight.sbatch")
    # on the login node: check, then queue the script itself
    login = sh(script)
    assert login.returncode == 0, login.stderr
    assert "world:  16 ranks (srun --nodes 2 x --ntasks-per-node 8)" in login.stdout
    assert launched(login, f"sbatch {script}")
    # inside the allocation: check again, then srun the training
    job = sh(script, SLURM_JOB_ID="1234", SLURM_NNODES="4")
    assert job.returncode == 0 and "32 ranks" in job.stdout
    assert launched(job, "srun --nodes 4 --ntasks-per-node 8") and "python -u pretrain_gpt.py" in job.stdout
    # a layout that does not fit never reaches the queue; MEMGUARD_FORCE=1 overrides
    no = sh(script, TP="1", PP="1", MICRO_BATCH_SIZE="4")
    assert no.returncode == 1 and not launched(no, "sbatch") and "not launching" in no.stderr
    forced = sh(script, TP="1", PP="1", MICRO_BATCH_SIZE="4", MEMGUARD_FORCE="1")
    assert forced.returncode == 0 and launched(forced, "sbatch")
    # memguard check reads the script itself too (its srun launch line and #SBATCH directives)
    plain = {k: v for k, v in env().items() if k not in ("MEMGUARD_LAUNCH_STUB", "MEMGUARD_CMD")}
    direct = subprocess.run([*MEMGUARD.split(), "check", "--json", "--file", script], env=plain, capture_output=True,
                            text=True, timeout=120)
    doc = json.loads(direct.stdout)
    assert direct.returncode == 0 and doc["launch"]["world_size"] == 16 and doc["launch"]["launcher"] == "srun"


@pytest.mark.skipif(importlib.util.find_spec("omegaconf") is None, reason="reading NeMo YAML needs omegaconf")
def test_nemo1_validation_example():
    script = os.path.join(EX, "nemo1", "validate_and_launch.sh")
    ok = sh(script)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "result: OK" in ok.stdout and "memguard check: OK to launch" in ok.stdout
    assert launched(ok, "python /opt/NeMo/examples/nlp/language_modeling/megatron_gpt_pretraining.py --config-path")
    # the stock layout without sequence parallelism and pipelining does not fit: validate says why, no launch
    no = sh(script, "model.sequence_parallel=false", "model.pipeline_model_parallel_size=1")
    assert no.returncode == 1 and "problems (1)" in no.stdout and not launched(no, "python")
    assert "memguard validate exited 1; not launching" in no.stderr
    forced = sh(script, "model.sequence_parallel=false", "model.pipeline_model_parallel_size=1", MEMGUARD_FORCE="1")
    assert forced.returncode == 0 and launched(forced, "python")


def test_bridge_launch_script(tmp_path):
    script = os.path.join(EX, "bridge_pretrain.py")

    def py(*args, **extra):
        return subprocess.run([sys.executable, script, *args], env=env(**extra), capture_output=True, text=True, timeout=120)

    ok = py("--memguard-gpu", "H100-80GB", "model.tensor_model_parallel_size=2", "train.global_batch_size=256",
            WORLD_SIZE="16")
    assert ok.returncode == 0, ok.stderr
    assert "[memguard] Megatron-Bridge pre-flight: mode warn" in ok.stdout and "16 ranks (WORLD_SIZE)" in ok.stdout
    assert "[MEMGUARD_LAUNCH_STUB=echo] pretrain(cfg, forward_step, callbacks=[MemguardCallback(" in ok.stdout
    # the overrides reach the pre-flight: MBS 4 on 2 GPUs does not fit; abort exits 3 before pretrain()
    no = py("--memguard-gpu", "H100-80GB", "--memguard", "abort", "train.micro_batch_size=4", WORLD_SIZE="2")
    assert no.returncode == 3 and "ABORT" in no.stdout and "pretrain(" not in no.stdout
    # MEMGUARD=abort does the same from the environment
    assert py("--memguard-gpu", "H100-80GB", "train.micro_batch_size=4", WORLD_SIZE="2", MEMGUARD="abort").returncode == 3
    # an override file on top of the recipe (Bridge's --config-file)
    override = os.path.join(SHARED_CONFIGS, "megatron-bridge", "llama32_1b_pretrain_override.yaml")
    f = py("--recipe", "llama32_1b", "--config-file", override, "--memguard", "report", "--memguard-gpu", "H100-80GB",
           WORLD_SIZE="8")
    assert f.returncode == 0 and "seq 4096" in f.stdout and "16 layers" in f.stdout
    # without Bridge and without the stub: says what it needs
    need = py(WORLD_SIZE="8", MEMGUARD_LAUNCH_STUB="")
    assert need.returncode == 2 and "needs Megatron-Bridge" in need.stderr


def test_run_pretrain_gpt_script_prints_the_flags():
    out = sh(os.path.join(EX, "megatron", "run_pretrain_gpt.sh"))
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("torchrun --nnodes 2 --nproc-per-node 8 ") and "pretrain_gpt.py" in line
    for flag in ("--memguard abort", "--memguard-threshold 0.85", "--memguard-log-dir memguard-logs",
                 "--memguard-log-interval 10"):
        assert flag in line
    # memguard check reads the script, the hook's flags included (its threshold applies)
    plain = {k: v for k, v in env().items() if k not in ("MEMGUARD_LAUNCH_STUB", "MEMGUARD_CMD")}
    c = subprocess.run([*MEMGUARD.split(), "check", "--json", "--file", os.path.join(EX, "megatron", "run_pretrain_gpt.sh")],
                       env=plain, capture_output=True, text=True, timeout=120)
    doc = json.loads(c.stdout)
    assert c.returncode == 0 and doc["launch"]["world_size"] == 16 and doc["threshold"] == 0.85


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TINY = ("--num-layers 2 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 256 --seq-length 64 "
        "--max-position-embeddings 64 --tokenizer-type NullTokenizer --vocab-size 1000 --micro-batch-size 2 "
        "--global-batch-size 2 --transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion "
        "--no-bias-dropout-fusion --no-bias-gelu-fusion --no-rope-fusion --use-cpu-initialization --distributed-backend gloo "
        "--lr 1e-4 --log-interval 1 --hidden-dropout 0 --attention-dropout 0").split()

DRIVER = textwrap.dedent("""
    import os, runpy, sys
    tests = sys.argv[1]
    sys.path[:0] = [os.path.join(tests, "legacy_standin"), os.path.join(tests, "e2e")]
    import cpu_shims
    cpu_shims.install()
    import torch
    torch.cuda.is_available = lambda: True   # initialize_megatron asserts it
    from megatron_memguard.runtime import LiveBytesSource
    script = sys.argv[2]
    sys.argv = [script] + sys.argv[3:]
    import megatron_memguard.megatron as hook
    src = LiveBytesSource()
    hook.set_memory_source(src)
    # Megatron's report_memory reads torch.cuda's allocator statistics: the CPU live bytes here
    torch.cuda.memory_allocated = torch.cuda.memory_reserved = lambda *a, **k: src.current
    torch.cuda.max_memory_allocated = torch.cuda.max_memory_reserved = lambda *a, **k: src.peak
    runpy.run_path(script, run_name="__main__")
    """)


@pytest.mark.skipif(__import__("importlib").util.find_spec("megatron.training") is not None,
                    reason="a real megatron.training is installed; this driver uses the legacy-era stand-in")
@pytest.mark.skipif(__import__("importlib").util.find_spec("megatron.core") is None, reason="needs megatron-core")
def test_pretrain_gpt_example_with_the_one_line(tmp_path):
    """examples/megatron/pretrain_gpt.py against the legacy-era stand-in of megatron.training on CPU: --memguard abort
    exits 3 before anything is allocated; --memguard warn trains and writes the JSONL."""
    script = os.path.join(EX, "megatron", "pretrain_gpt.py")
    e = env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
            OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    run = lambda *a: subprocess.run([sys.executable, "-c", DRIVER, HERE, script, *TINY, *a], env=e,  # noqa: E731
                                    capture_output=True, text=True, timeout=600)
    ab = run("--train-iters", "2", "--memguard", "abort", "--memguard-gpu-memory", "1MiB")
    assert ab.returncode == 3, ab.stdout[-3000:] + ab.stderr[-3000:]
    assert "[memguard] ABORT" in ab.stdout
    ok = run("--train-iters", "2", "--memguard", "warn", "--memguard-gpu-memory", "80GiB", "--memguard-log-dir",
             str(tmp_path), "--memguard-log-interval", "1")
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert "[memguard] verdict: FITS" in ok.stdout
    recs = [json.loads(line) for line in open(tmp_path / "memguard-rank00000.jsonl")]
    assert [r["event"] for r in recs] == ["start", "sample", "sample", "summary"]
    assert recs[0]["predicted"]["device"] == "cpu" and recs[1]["actual"]["max_allocated"] > 0
    # the example's own output is a Megatron log memguard report reads: argument table and report_memory lines
    (tmp_path / "stdout.log").write_text(ok.stdout)
    rep = subprocess.run([sys.executable, "-m", "megatron_memguard.cli.main", "report", str(tmp_path / "stdout.log"),
                          "--device", "cpu", "--megatron-version", "0.16", "--json"], capture_output=True, text=True,
                         env=e, cwd=ROOT)
    doc = json.loads(rep.stdout)
    assert [(r["rank"], r["pp_rank"], r["samples"]) for r in doc["ranks"]] == [(0, 0, 2)], rep.stderr
    assert doc["ranks"][0]["predicted_peak_allocated"] == recs[1]["predicted"]["peak_allocated"]
