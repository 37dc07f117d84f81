"""memguard calibrate finds the GPU of a run in its own files before assuming H100-80GB.

The log text is what the tools print (tests/megatron_logs.py names each format's source): nvidia-smi's table
(drivers 515 and 550) and ``-L`` list, Lightning's Tensor Core hint, Megatron's GPU sniff test, memguard's
pre-flight line and PyTorch's out-of-memory message. The GPU table's numbers are gpus.py's (torch
``total_memory``: A100-80GB 79.35 GiB, H100-80GB 79.11 GiB, A100-40GB 39.59 GiB)."""
import json

import pytest

from megatron_logs import NVIDIA_SMI_515, NVIDIA_SMI_550, lightning_tensor_cores, oom_message
from megatron_memguard import estimate, layout_from_flags, lookup_gpu
from megatron_memguard.calibrate.gpu_evidence import Evidence, fits_memory, fits_name, from_mention, infer_gpu, settle
from megatron_memguard.calibrate.runs import read_runs
from megatron_memguard.errors import MemguardError
from megatron_memguard.report.device_mentions import device_mention
from megatron_memguard.report.megatron_log import read_megatron_logs
from megatron_memguard.runtime import MemoryMonitor, Prediction, Reading, StaticSource
from megatron_memguard.runtime.sinks import JsonlSink
from test_calibrate import LAYOUTS, _cli, _flags, write_runs

MiB, GiB = 2**20, 2**30


def _fits(line):
    m = device_mention(line, "out.log", 7)
    return None if m is None else sorted(from_mention(m).fits)


def test_device_names_as_tools_print_them():
    # torch.cuda.get_device_name() of the parts: 'NVIDIA A100-SXM4-80GB', 'NVIDIA H100 80GB HBM3', 'NVIDIA H100 NVL'
    assert _fits("GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5c7b0d2a-9e1f-4c3b-8a2d-1f0e9d8c7b6a)") == ["A100-80GB"]
    assert _fits("GPU 3: NVIDIA A100-SXM4-40GB (UUID: GPU-0f3e2d1c-4b5a-6978-8a9b-0c1d2e3f4a5b)") == ["A100-40GB"]
    assert _fits("[default0]:" + lightning_tensor_cores("NVIDIA H100 80GB HBM3")) == ["H100-80GB"]
    assert _fits(lightning_tensor_cores("NVIDIA H100 NVL")) == ["H100-94GB"]
    # megatron-core 0.19.2 training/gpu_sniff_test.py: logger.info(f"CUDA device: {torch.cuda.get_device_name()}")
    assert _fits("CUDA device: NVIDIA GB200") == ["GB200"]
    assert _fits("torch.cuda.get_device_name(0) = 'AMD Instinct MI300X'") == ["MI300X"]
    # memguard's own line where it read the device (megatron/preflight.py _settings_line; the callbacks add a label)
    assert _fits("[memguard] mode warn, threshold 90%, H100-80GB 79.11 GiB (torch.cuda.get_device_properties(0))") == \
        ["H100-80GB"]
    assert _fits("[memguard] Lightning pre-flight: mode warn, threshold 90%, GPU 39.59 GiB (NVML device 2); 8 ranks") == \
        ["A100-40GB"]
    assert device_mention("[memguard] mode warn, threshold 90%, H100-80GB 79.11 GiB (gpu=H100-80GB)", "x", 1) is None
    # a GH200 is not an H200, a B200 not a GB200; no size in the name: every entry of the model
    assert _fits("CUDA device: NVIDIA GH200 480GB") == []
    assert _fits("CUDA device: NVIDIA B200") == ["B200"]
    assert _fits("CUDA device: NVIDIA H100 PCIe") == ["H100-80GB", "H100-94GB"]
    # lines that name no GPU
    for line in ("device_name = None", "device name: cuda:0", "the CUDA device: is busy", "| GPU  Name  Persistence-M|"):
        assert device_mention(line, "x", 1) is None, line


def test_nvidia_smi_tables_give_name_and_board_memory(tmp_path):
    f = tmp_path / "out.log"
    f.write_text("\n".join(["+ srun nvidia-smi", NVIDIA_SMI_550, NVIDIA_SMI_515.format(board=40960), ""]))
    log = read_megatron_logs([str(f)])
    got = [(d.name, d.total_bytes, d.line) for d in log.devices]
    # one row per GPU, the memory from the row below it (MiB on the board)
    assert got == [("NVIDIA H100 80GB HBM3", 81559 * MiB, 9), ("NVIDIA H100 80GB HBM3", 81559 * MiB, 13),
                   ("NVIDIA A100-SXM...", 40960 * MiB, 24)]
    # the cut name says A100, the board's 40960 MiB which one (39.59 GiB = 40540 MiB for PyTorch: 1.0% below)
    assert sorted(from_mention(log.devices[2]).fits) == ["A100-40GB"]
    assert sorted(Evidence.of("NVIDIA A100-SXM...", 81920 * MiB, "").fits) == ["A100-80GB"]


def test_memory_alone_names_a_gpu_only_where_no_other_is_near():
    # PyTorch's OOM capacity (format_size, 2 decimals of GiB): 79.11 GiB fits H100-80GB and A100-80GB (0.3% apart)
    assert {g for g in ("A100-80GB", "H100-80GB", "H100-94GB") if fits_memory(int(79.11 * GiB), lookup_gpu(g))} == \
        {"A100-80GB", "H100-80GB"}
    assert [g for g in ("A100-40GB", "A100-80GB") if fits_memory(int(39.59 * GiB), lookup_gpu(g))] == ["A100-40GB"]
    # B200 (178.36 GiB) and GB200 (184.0 GiB) lie 3.1% apart: each figure names one
    assert [g for g in ("B200", "GB200") if fits_memory(int(178.36 * GiB), lookup_gpu(g))] == ["B200"]
    assert fits_name("NVIDIA A100-SXM4-80GB", lookup_gpu("A100-80GB")) and not fits_name("NVIDIA A100-SXM4-80GB",
                                                                                           lookup_gpu("A100-40GB"))


def _add(path, *lines):
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


def test_runs_take_the_gpu_their_logs_name(tmp_path):
    root = write_runs(tmp_path / "runs", layouts=LAYOUTS[:3])
    _add(root / "run0" / "stdout.log", NVIDIA_SMI_515.format(board=81920))
    _add(root / "run1" / "stdout.log", "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5c7b0d2a-9e1f-4c3b-8a2d-1f0e9d8c7b6a)")
    runs = read_runs([str(root)])
    # run2 names nothing: it takes the GPU the other two name, not H100
    assert [r.gpu.name for r in runs] == ["A100-80GB"] * 3
    assert any(n.startswith("GPU A100-80GB, from nvidia-smi 'NVIDIA A100-SXM...', 80.00 GiB on the board") for n in runs[0].notes)
    assert runs[2].notes == ["GPU not recorded in some runs: A100-80GB, as the other runs' files name it"]


def test_an_oom_capacity_alone(tmp_path):
    root = write_runs(tmp_path / "runs", layouts=LAYOUTS[:1])
    log = root / "run0" / "stdout.log"
    _add(log, "[default3]:" + oom_message(2 * GiB, int(79.11 * GiB), 1 * GiB, 78 * GiB, 70 * GiB, 77 * GiB))
    n = len(log.read_text().splitlines())       # the message is the last line
    (r,) = read_runs([str(root)])
    # near 79 GiB: A100-80GB or H100-80GB; H100-80GB is one of them, so it stays, and the note says why
    assert r.gpu.name == "H100-80GB"
    assert r.notes == [f"GPU not recorded: out-of-memory message: total capacity 79.11 GiB ({log}:{n}) fits A100-80GB or "
                       "H100-80GB; H100-80GB assumed (--gpu names it)"]
    _add(log, "CUDA device: NVIDIA A100-SXM4-80GB")
    assert read_runs([str(root)])[0].gpu.name == "A100-80GB"     # with a name, one entry


def test_conflicts_are_errors_naming_the_files(tmp_path):
    root = write_runs(tmp_path / "runs", layouts=LAYOUTS[:1])
    d = root / "run0"
    _add(d / "stdout.log", NVIDIA_SMI_550)
    (d / "stderr.log").write_text(oom_message(2 * GiB, int(39.59 * GiB), GiB, 38 * GiB, 30 * GiB, 37 * GiB) + "\n")
    with pytest.raises(MemguardError, match=r"the files disagree on the GPU: nvidia-smi 'NVIDIA H100 80GB HBM3', "
                       r"79.65 GiB on the board \(.*stdout.log:\d+\) is H100-80GB, out-of-memory message: total capacity "
                       r"39.59 GiB \(.*stderr.log:1\) is A100-40GB"):
        read_runs([str(root)])
    (d / "stderr.log").unlink()
    with pytest.raises(MemguardError, match=r"--gpu A100-80GB conflicts with the run's own files: nvidia-smi 'NVIDIA H100 "
                       r"80GB HBM3'.* is H100-80GB"):
        read_runs([str(root)], gpu=lookup_gpu("A100-80GB"))
    assert read_runs([str(root)], gpu=lookup_gpu("H100-80GB"))[0].gpu.name == "H100-80GB"
    _add(d / "stdout.log", "GPU 0: Tesla V100-SXM2-32GB (UUID: GPU-0f3e2d1c-4b5a-6978-8a9b-0c1d2e3f4a5b)")
    with pytest.raises(MemguardError, match="'Tesla V100-SXM2-32GB' .*: a GPU memguard's table does not have"):
        read_runs([str(root)])


def test_runs_on_two_gpus_are_refused_naming_both(tmp_path):
    root = write_runs(tmp_path / "runs", layouts=LAYOUTS[:2])
    _add(root / "run0" / "stdout.log", NVIDIA_SMI_550)
    _add(root / "run1" / "stdout.log", "CUDA device: NVIDIA A100-SXM4-80GB")
    with pytest.raises(MemguardError, match=r"the runs' files name A100-80GB \(GPU A100-80GB, from device name .*run1"
                       r"/stdout.log.*\) and H100-80GB \(GPU H100-80GB, from nvidia-smi .*run0/stdout.log.*one GPU type"):
        read_runs([str(root)])


def test_a_name_that_leaves_two_entries_without_the_fallback_is_refused():
    ev = [Evidence.of("NVIDIA A100-SXM...", None, "nvidia-smi 'NVIDIA A100-SXM...' (x:1)")]
    f = infer_gpu("run", ev, None)
    assert f.gpu is None and f.fits == {"A100-40GB", "A100-80GB"}
    with pytest.raises(MemguardError, match="fits A100-40GB or A100-80GB, not one GPU; give --gpu"):
        settle({"run": f}, None)
    # another run that names its GPU settles it; --gpu does too
    named = infer_gpu("other", [Evidence.of("NVIDIA A100-SXM4-40GB", None, "nvidia-smi -L (y:1)")], None)
    assert settle({"run": f, "other": named}, None)["run"] == (
        lookup_gpu("A100-40GB"), "GPU A100-40GB: nvidia-smi 'NVIDIA A100-SXM...' (x:1) fits A100-40GB or A100-80GB, "
        "and the other runs' files name A100-40GB")
    assert settle({"run": infer_gpu("run", ev, lookup_gpu("A100-40GB"))}, lookup_gpu("A100-40GB")) == \
        {"run": (lookup_gpu("A100-40GB"), "")}


def test_an_oom_capacity_fits_the_gpu_another_run_names(tmp_path):
    root = write_runs(tmp_path / "runs", layouts=LAYOUTS[:2])
    _add(root / "run0" / "stdout.log", oom_message(2 * GiB, int(79.35 * GiB), GiB, 78 * GiB, 70 * GiB, 77 * GiB))
    _add(root / "run1" / "stdout.log", "CUDA device: NVIDIA A100-SXM4-80GB")
    runs = read_runs([str(root)])
    # 79.35 GiB fits A100-80GB and H100-80GB: the other run's name settles it (no H100 assumed, no two-GPU error)
    assert [r.gpu.name for r in runs] == ["A100-80GB", "A100-80GB"]
    assert runs[0].notes[0].startswith("GPU A100-80GB: out-of-memory message: total capacity 79.35 GiB")


class _Described(StaticSource):
    def __init__(self, reading, device):
        super().__init__(reading)
        self._device = device

    def describe(self):
        if isinstance(self._device, Exception):
            raise self._device
        return self._device


def _jsonl_run(d, device, decision_gpu):
    L = layout_from_flags(_flags(1, 1, 1, []), world_size=8)
    st = estimate(L, gpu=lookup_gpu("A100-80GB"), dp_rank=0).stages[0]
    src = _Described(Reading(allocated=st.persistent_bytes, max_allocated=st.peak_allocated_bytes,
                             reserved=st.peak_reserved_bytes, max_reserved=st.peak_reserved_bytes), device)
    m = MemoryMonitor(src, Prediction.from_stage(st), rank=0, interval=1, sinks=[JsonlSink(JsonlSink.path_for(str(d), 0))],
                      context={"layout": L.to_dict(), "decision": {"gpu": decision_gpu}, "dp_rank": 0})
    m.start()
    m.step(1)
    m.finish()
    return m


def test_the_monitor_records_the_device_and_calibrate_reads_it(tmp_path):
    # what CudaMemorySource.describe() returns on an A100 80GB (torch.cuda.get_device_properties: name, total_memory)
    m = _jsonl_run(tmp_path / "a", {"name": "NVIDIA A100-SXM4-80GB", "total_memory": 85_198_045_184, "index": 0}, "H100-80GB")
    start = json.loads((tmp_path / "a" / "memguard-rank00000.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["gpu_device"]["name"] == "NVIDIA A100-SXM4-80GB" and m.errors == 0
    (r,) = read_runs([str(tmp_path / "a")])
    # the measured device wins over the GPU the pre-flight was told (gpu="H100-80GB")
    assert r.gpu.name == "A100-80GB" and r.notes[0].startswith("GPU A100-80GB, from the JSONL's device of rank 0")
    # a source that cannot tell, or fails to: no device in the record, no error, the decision's GPU as before
    m = _jsonl_run(tmp_path / "b", RuntimeError("no NVML"), "A100-40GB")
    start = json.loads((tmp_path / "b" / "memguard-rank00000.jsonl").read_text().splitlines()[0])
    assert "gpu_device" not in start and m.errors == 0
    assert read_runs([str(tmp_path / "b")])[0].gpu.name == "A100-40GB"


def test_cuda_source_describes_its_device(monkeypatch):
    torch = pytest.importorskip("torch")
    from megatron_memguard.runtime.sources import CudaMemorySource

    class Props:
        name, total_memory = "NVIDIA H100 80GB HBM3", 84_942_979_072
    seen = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: seen.append(d) or Props)
    assert CudaMemorySource().describe() == {"name": "NVIDIA H100 80GB HBM3", "total_memory": 84_942_979_072, "index": 5}
    assert seen == [5]


def test_cli_states_the_gpu_it_read(tmp_path):
    root = write_runs(tmp_path / "runs")
    for d in sorted(root.iterdir()):
        _add(d / "stdout.log", "[default0]:" + lightning_tensor_cores("NVIDIA A100-SXM4-80GB"))
    out = tmp_path / "site.yaml"
    r = _cli(str(root), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "A100-80GB; from Megatron log" in r.stdout and "note: GPU A100-80GB, from Lightning 'NVIDIA A100-SXM4-80GB'" in r.stdout
    assert "gpu: A100-80GB" in out.read_text()
    (root / "run0" / "stdout.log").write_text((root / "run0" / "stdout.log").read_text()
                                              + lightning_tensor_cores("NVIDIA H100 80GB HBM3") + "\n")
    r = _cli(str(root))
    assert r.returncode == 2 and "the files disagree on the GPU" in r.stderr and "run0" in r.stderr
