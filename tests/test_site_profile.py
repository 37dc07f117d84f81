"""Site constants (estimator/site.py) and site profile files (site_profile.py): no number changes without a
profile, each constant changes exactly its own term, and bad or foreign profiles are refused by name."""
import json
import os
import subprocess
import sys

import pytest

from conftest import LLAMA31_8B, ROOT
from megatron_memguard import SiteConstants, estimate, layout_from_flags, lookup_gpu
from megatron_memguard.errors import ConfigError
from megatron_memguard.site_profile import dump_site_profile, load_site_profile, parse_site_profile

MiB = 2**20
H100, A100 = lookup_gpu("H100-80GB"), lookup_gpu("A100-80GB")
# TP 2, PP 2, DP 4 on 16 GPUs: NCCL communicators TP, PP and DP-CP
FLAGS = LLAMA31_8B + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
                      "--micro-batch-size", "1", "--use-distributed-optimizer"]


def _layout(env=None):
    return layout_from_flags(FLAGS, world_size=16, env=env)


def _terms(est, stage=0):
    return est.stages[stage].breakdown


def test_default_site_changes_no_number():
    L = _layout()
    a, b = estimate(L, gpu=H100), estimate(L, gpu=H100, site=SiteConstants())
    assert a.to_dict() == b.to_dict()
    assert a.to_dict()["site"] == SiteConstants().to_dict()
    assert not any("site profile" in n for n in a.notes)


def test_each_constant_sets_its_own_term():
    L = _layout()
    base = estimate(L, gpu=H100)
    s = SiteConstants(cuda_context=600 * MiB, nccl_per_communicator=40 * MiB, allocator_fragmentation=0.10,
                      te_workspace=8 * MiB)
    est = estimate(L, gpu=H100, site=s)
    for i, (st, st0) in enumerate(zip(est.stages, base.stages)):
        t, t0 = _terms(est, i), _terms(base, i)
        assert t["cuda_context"] == 600 * MiB
        assert t["nccl_buffers"] == 3 * 40 * MiB                       # TP, PP and DP-CP communicators
        assert t["te_workspace"] == 8 * MiB and t0["te_workspace"] == 32 * MiB + 1024   # TE's Hopper default
        # CUBLAS_WORKSPACE_CONFIG is unset, so cublas keeps PyTorch's Hopper default (the site did not set it)
        assert t["cublas_workspaces"] == t0["cublas_workspaces"] == 2 * 32 * MiB
        assert st.peak_allocated_bytes == st0.peak_allocated_bytes - (32 * MiB + 1024 - 8 * MiB)
        assert t["allocator_fragmentation"] == int(st.peak_allocated_bytes * 0.10)
        assert st.device_total_bytes == st.peak_allocated_bytes + t["allocator_fragmentation"] + 600 * MiB + 120 * MiB
    note = next(n for n in est.notes if n.startswith("site profile: "))
    assert "te_workspace 8.0 MiB (default by GPU)" in note and "cuda_context 600.0 MiB (default 512.0 MiB)" in note


def test_cublas_constant_only_where_the_job_does_not_set_it():
    s = SiteConstants(cublas_workspace=8 * MiB)
    assert _terms(estimate(_layout(), gpu=H100, site=s))["cublas_workspaces"] == 2 * 8 * MiB
    # :4096:8 = 8 x 4 MiB per handle, set by the job: the site's default does not apply
    fixed = _layout(env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    assert _terms(estimate(fixed, gpu=H100, site=s))["cublas_workspaces"] == 2 * 32 * MiB


def test_nccl_constant_scales_with_the_jobs_buffsize():
    s = SiteConstants(nccl_per_communicator=100 * MiB)        # at NCCL's default NCCL_BUFFSIZE (4 MiB)
    L = _layout(env={"NCCL_BUFFSIZE": str(8 * MiB)})
    assert _terms(estimate(L, gpu=A100, site=s))["nccl_buffers"] == 3 * 200 * MiB


def test_constants_are_bounded():
    with pytest.raises(ValueError, match="allocator_fragmentation must be within"):
        SiteConstants(allocator_fragmentation=1.5)
    with pytest.raises(ValueError, match="cuda_context must be within"):
        SiteConstants(cuda_context=10)


def _doc(**constants):
    return {"schema": "memguard.site/1", "memguard_version": "0.1.0.dev0", "gpu": "H100-80GB", "constants": constants}


def test_profile_round_trip(tmp_path):
    text = dump_site_profile({"cuda_context": 547 * MiB, "allocator_fragmentation": 0.071}, name="cluster a",
                             gpu="H100-80GB", fit={"runs": 12})
    p = tmp_path / "site.yaml"
    p.write_text(text)
    prof = load_site_profile(str(p))
    assert prof.constants == SiteConstants(cuda_context=547 * MiB, allocator_fragmentation=0.071)
    assert (prof.name, prof.gpu, prof.fit["runs"]) == ("cluster a", "H100-80GB", 12)
    # sizes may be written with units, fractions as percentages
    prof = parse_site_profile(_doc(nccl_per_communicator="96MiB", allocator_fragmentation="7.5%"))
    assert prof.constants.nccl_per_communicator == 96 * MiB and prof.constants.allocator_fragmentation == 0.075


@pytest.mark.parametrize("doc, key, text", [
    ({**_doc(), "schema": "memguard.site/3"}, "schema", "written by a newer memguard"),   # (/2: the time section)
    ({**_doc(), "memguard_version": "99.0"}, "memguard_version", "newer than this memguard"),
    ({**_doc(), "colour": "blue"}, "colour", "unknown key"),
    (_doc(nvlink_buffers=1), "constants.nvlink_buffers", "unknown site constant"),
    (_doc(cuda_context="lots"), "constants.cuda_context", "expects a size"),
    (_doc(allocator_fragmentation=3), "constants.allocator_fragmentation", "outside the physical bounds"),
    ({"constants": {}}, "schema", "expected 'memguard.site/1'"),
])
def test_bad_profiles_are_refused_by_name(doc, key, text):
    with pytest.raises(ConfigError) as e:
        parse_site_profile(doc, "site.yaml")
    assert e.value.key == f"site.yaml: {key}" and text in str(e.value)


def _cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "megatron_memguard.cli.main", *argv], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})


def test_cli_commands_take_the_profile(tmp_path):
    p = tmp_path / "site.yaml"
    p.write_text(dump_site_profile({"cuda_context": 2048 * MiB}))
    flags = ["--", *FLAGS]
    doc = json.loads(_cli("estimate", "--world-size", "16", "--json", "--site-profile", str(p), *flags).stdout)
    assert all(s["breakdown"]["cuda_context"] == 2048 * MiB for s in doc["stages"])
    assert doc["site"]["cuda_context"] == 2048 * MiB
    # the same through the variable, and in validate / check / plan
    doc = json.loads(_cli("validate", "--world-size", "16", "--json", *flags, env={"MEMGUARD_PROFILE": str(p)}).stdout)
    assert doc["stages"][0]["breakdown"]["cuda_context"] == 2048 * MiB
    launch = ["torchrun", "--nnodes", "2", "--nproc-per-node", "8", "pretrain_gpt.py", *FLAGS, "--memguard-profile", str(p)]
    doc = json.loads(_cli("check", "--json", "--", *launch).stdout)
    assert doc["stages"][0]["breakdown"]["cuda_context"] == 2048 * MiB
    plan = _cli("plan", "--gpus", "16", "--seq-length", "8192", "--global-batch-size", "32", "--top", "1", "--json",
                "--site-profile", str(p), "--model", "llama3.1-8b", "--", "--bf16")
    assert json.loads(plan.stdout)["layouts"][0]["peak_device_bytes"] > 2048 * MiB


def test_cli_bad_profile_is_one_line(tmp_path):
    p = tmp_path / "site.yaml"
    p.write_text("schema: memguard.site/7\n")
    r = _cli("estimate", "--world-size", "16", "--site-profile", str(p), "--", *FLAGS)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"memguard: error: --site-profile {p}: schema: memguard.site/7 was written by a newer")
