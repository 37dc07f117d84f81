"""megatron_memguard.bridge: the pre-flight on a ConfigContainer (object with flat or nested model, or its
dict), the training callback through Bridge 0.6.2's own CallbackManager (tests/bridge_standin), the
pretrain() wrapper end to end on CPU, and what happens without Bridge."""
import json
import os
import subprocess
import sys
import textwrap
import types
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import pytest
import yaml

from megatron_memguard import estimate
from megatron_memguard.bridge import PreflightAbort, config_dict, preflight, raw_config
from megatron_memguard.runtime import Reading, StaticSource

from e2e.recording import RecordingSource

torch = pytest.importorskip("torch")
F = torch.nn.functional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STANDIN = os.path.join(HERE, "bridge_standin")


# --------------------------------------------------------------------------------------------------
# A ConfigContainer as Bridge builds it (dataclasses; the field names of Bridge 0.6.2 / megatron-core)
# --------------------------------------------------------------------------------------------------
def default_layer_spec():  # what GPTModelProvider.transformer_layer_spec holds: a function
    return None


@dataclass
class GPTModelProvider:              # the flat layout (Bridge <= 0.6.x)
    num_layers: int = 32
    hidden_size: int = 4096
    ffn_hidden_size: int = 14336
    num_attention_heads: int = 32
    num_query_groups: int = 8
    kv_channels: Optional[int] = None
    seq_length: int = 8192
    vocab_size: int = 128256
    should_pad_vocab: bool = False
    make_vocab_size_divisible_by: int = 128
    share_embeddings_and_output_weights: bool = False
    normalization: str = "RMSNorm"
    gated_linear_unit: bool = True
    activation_func: Callable = F.silu
    add_bias_linear: bool = False
    position_embedding_type: str = "rope"
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    tensor_model_parallel_size: int = 2
    pipeline_model_parallel_size: int = 2
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    sequence_parallel: bool = True
    recompute_granularity: Optional[str] = "selective"
    bf16: bool = True
    params_dtype: Any = torch.bfloat16
    pipeline_dtype: Any = torch.bfloat16
    transformer_layer_spec: Callable = default_layer_spec
    transformer_impl: str = "transformer_engine"
    cross_entropy_loss_fusion: bool = True

    def provide(self):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(self.vocab_size, self.hidden_size),
                                   *[torch.nn.Linear(self.hidden_size, self.hidden_size) for _ in range(self.num_layers)],
                                   torch.nn.Linear(self.hidden_size, self.vocab_size, bias=False))


@dataclass
class TransformerConfig:             # the nested builder layout (Bridge main since mid-2026): model.transformer
    num_layers: int = 32
    hidden_size: int = 4096
    ffn_hidden_size: int = 14336
    num_attention_heads: int = 32
    num_query_groups: int = 8
    normalization: str = "RMSNorm"
    gated_linear_unit: bool = True
    activation_func: str = "silu"
    add_bias_linear: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    tensor_model_parallel_size: int = 2
    pipeline_model_parallel_size: int = 2
    context_parallel_size: int = 1
    sequence_parallel: bool = True
    recompute_granularity: Optional[str] = "selective"
    bf16: bool = True
    params_dtype: Any = torch.bfloat16


@dataclass
class BridgeGPTModelConfig:
    transformer: TransformerConfig = field(default_factory=TransformerConfig)
    seq_length: int = 8192
    vocab_size: int = 128256
    make_vocab_size_divisible_by: int = 128
    share_embeddings_and_output_weights: bool = False
    position_embedding_type: str = "rope"
    transformer_impl: str = "transformer_engine"


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: int = 256
    train_iters: int = 1000


@dataclass
class OptimizerConfig:
    optimizer: str = "adam"
    lr: float = 3e-4
    use_distributed_optimizer: bool = True
    bf16: bool = True
    params_dtype: Any = torch.bfloat16


@dataclass
class DistributedDataParallelConfig:
    grad_reduce_in_fp32: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    use_distributed_optimizer: bool = True


@dataclass
class GPTDatasetConfig:
    seq_length: int = 8192
    random_seed: int = 1234


@dataclass
class TokenizerConfig:
    tokenizer_type: str = "NullTokenizer"
    vocab_size: Optional[int] = None
    use_tokenizer_vocab_size: bool = False


@dataclass
class LoggerConfig:
    log_interval: int = 10
    tensorboard_dir: Optional[str] = None


@dataclass
class ConfigContainer:
    train: TrainingConfig = field(default_factory=TrainingConfig)
    model: Any = field(default_factory=GPTModelProvider)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    ddp: DistributedDataParallelConfig = field(default_factory=DistributedDataParallelConfig)
    dataset: GPTDatasetConfig = field(default_factory=GPTDatasetConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    mixed_precision: Any = "bf16_mixed"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("SLURM_", "MEMGUARD")) or k in ("WORLD_SIZE", "RANK"):
            monkeypatch.delenv(k)


def quiet():
    lines = []
    return lines, lines.append


def test_object_dict_and_yaml_dump_give_the_same_layout():
    cfg = ConfigContainer()
    flat = preflight(cfg, world_size=32, gpu="H100-80GB", emit=quiet()[1])
    assert flat.action in ("fits", "warned") and flat.layout is not None
    L = flat.layout
    assert (L.tp, L.pp, L.cp, L.dp) == (2, 2, 1, 8) and L.sequence_parallel and L.use_distributed_optimizer
    assert L.num_query_groups == 8 and L.swiglu and L.padded_vocab_size == 128256 and L.params_dtype == "bf16"
    assert L.recompute_granularity == "selective" and L.global_batch_size == 256 and L.seq_length == 8192
    # its dict, and that dict dumped to YAML and read back (a run_config.yaml)
    doc = config_dict(cfg)
    assert doc["model"]["activation_func"] == {"_target_": "torch.nn.functional.silu", "_call_": False}
    assert doc["model"]["params_dtype"] == "torch.bfloat16"
    reread = yaml.safe_load(yaml.safe_dump(doc))
    for d in (doc, reread):
        assert preflight(d, world_size=32, gpu="H100-80GB", emit=quiet()[1]).layout == L
    # the nested model.transformer layout
    nested = replace(cfg, model=BridgeGPTModelConfig())
    assert preflight(nested, world_size=32, gpu="H100-80GB", emit=quiet()[1]).layout == L
    # the estimate is memguard estimate's for that layout
    assert flat.estimate.to_dict()["stages"] == estimate(L, gpu=flat.gpu, threshold=0.8).to_dict()["stages"]


def test_site_profile_argument_and_variable(tmp_path, monkeypatch):
    from megatron_memguard.errors import ConfigError
    from megatron_memguard.site_profile import dump_site_profile
    p = tmp_path / "site.yaml"
    p.write_text(dump_site_profile({"cuda_context": 3 * 2**30}))
    r = preflight(ConfigContainer(), world_size=32, gpu="H100-80GB", emit=quiet()[1], site_profile=str(p))
    assert r.estimate.stages[0].breakdown["cuda_context"] == 3 * 2**30
    with pytest.raises(ConfigError, match="^site_profile: cannot read site profile"):
        preflight(ConfigContainer(), world_size=32, gpu="H100-80GB", emit=quiet()[1], site_profile=str(tmp_path / "x.yaml"))
    # MEMGUARD_PROFILE (a site's variable) gone bad: reported, the defaults are used and training goes on
    monkeypatch.setenv("MEMGUARD_PROFILE", str(tmp_path / "missing.yaml"))
    lines, emit = quiet()
    r = preflight(ConfigContainer(), world_size=32, gpu="H100-80GB", emit=emit)
    assert r.estimate.stages[0].breakdown["cuda_context"] != 3 * 2**30
    assert any("error: MEMGUARD_PROFILE: cannot read site profile" in x and "training continues" in x for x in lines)


def test_a_field_set_after_overrides_changes_the_estimate():
    cfg = ConfigContainer()
    a = preflight(cfg, world_size=32, gpu="H100-80GB", emit=quiet()[1])
    cfg.train.micro_batch_size = 4       # as process_config_with_overrides would set train.micro_batch_size=4
    b = preflight(cfg, world_size=32, gpu="H100-80GB", emit=quiet()[1])
    assert b.layout.micro_batch_size == 4 and b.estimate.peak_device_bytes > a.estimate.peak_device_bytes
    r = raw_config(ConfigContainer(), overrides=["model.tensor_model_parallel_size=4"])
    assert r.args["tensor_model_parallel_size"] == 4


def test_modes(capsys):
    cfg = ConfigContainer()
    lines, emit = quiet()
    r = preflight(cfg, world_size=32, gpu="H100-80GB", mode="report", emit=emit)
    assert r.action == "reported" and "pp0" in lines[0] and "pp1" in lines[0] and "Megatron-Bridge pre-flight" in lines[0]
    # 70B-ish: does not fit on 8 GPUs
    big = replace(cfg, model=replace(GPTModelProvider(), num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
                                     num_attention_heads=64, tensor_model_parallel_size=8, pipeline_model_parallel_size=1,
                                     recompute_granularity=None), train=TrainingConfig(micro_batch_size=2, global_batch_size=64))
    lines, emit = quiet()
    r = preflight(big, world_size=8, gpu="H100-80GB", mode="warn", emit=emit)
    assert r.action == "warned" and r.verdict == "will not fit" and "WARNING" in lines[0]
    lines, emit = quiet()
    with pytest.raises(PreflightAbort) as e:
        preflight(big, world_size=8, gpu="H100-80GB", mode="abort", emit=emit)
    assert e.value.code == 3 and e.value.result.action == "abort"
    assert "ABORT" in lines[0] and "aborting on every rank" in lines[0]
    # only rank 0 prints; every rank aborts
    lines, emit = quiet()
    with pytest.raises(PreflightAbort):
        preflight(big, world_size=8, gpu="H100-80GB", mode="abort", emit=emit, environ={"RANK": "3"})
    assert lines == []
    assert preflight(big, world_size=8, mode="off").action == "skipped"
    # the mode from MEMGUARD, as for the Megatron hook
    lines, emit = quiet()
    with pytest.raises(PreflightAbort):
        preflight(big, world_size=8, gpu="H100-80GB", emit=emit, environ={"MEMGUARD": "abort"})
    with pytest.raises(Exception, match="autotune"):
        preflight(big, world_size=8, mode="autotune")


def test_bad_settings_name_the_variable_and_explicit_arguments_win():
    from megatron_memguard.errors import ConfigError
    cfg = ConfigContainer()
    for environ, key in (({"MEMGUARD_THRESHOLD": "lots"}, "MEMGUARD_THRESHOLD"), ({"MEMGUARD_THRESHOLD": "2"}, "MEMGUARD_THRESHOLD"),
                         ({"MEMGUARD": "abortt"}, "MEMGUARD"), ({"MEMGUARD_GPU_MEMORY": "80 parsecs"}, "MEMGUARD_GPU_MEMORY")):
        with pytest.raises(ConfigError) as e:
            preflight(cfg, world_size=32, environ=environ, emit=quiet()[1])
        assert e.value.key == key
    with pytest.raises(ConfigError) as e:
        preflight(cfg, world_size=32, gpu="H100-80GB", threshold=0, emit=quiet()[1])
    assert e.value.key == "threshold" and "(0, 1.5]" in str(e.value)
    # gpu= (and gpu_memory=) win over MEMGUARD_GPU_MEMORY; the variable applies when neither is given
    r = preflight(cfg, world_size=32, gpu="H100-80GB", environ={"MEMGUARD_GPU_MEMORY": "40GiB"}, emit=quiet()[1])
    assert r.gpu_memory == r.gpu.memory_bytes and r.gpu.name == "H100-80GB"
    r = preflight(cfg, world_size=32, gpu_memory="24GiB", environ={"MEMGUARD_GPU_MEMORY": "40GiB"}, emit=quiet()[1])
    assert r.gpu_memory == 24 * 2**30 and r.gpu_memory_source == "gpu_memory"
    r = preflight(cfg, world_size=32, environ={"MEMGUARD_GPU_MEMORY": "40GiB", "MEMGUARD_THRESHOLD": "0.5"}, emit=quiet()[1])
    assert r.gpu_memory == 40 * 2**30 and r.estimate.threshold == 0.5


def test_internal_error_is_reported_and_training_goes_on(monkeypatch):
    import megatron_memguard.estimator as est_mod

    def boom(*a, **k):
        raise ZeroDivisionError("estimator bug")
    monkeypatch.setattr(est_mod, "estimate", boom)
    lines, emit = quiet()
    r = preflight(ConfigContainer(), world_size=32, gpu="H100-80GB", mode="abort", emit=emit)
    assert r.action == "skipped" and r.estimate is None and "estimator bug" in r.reason
    assert len(lines) == 1 and "internal error (ZeroDivisionError: estimator bug); training continues unchecked" in lines[0]
    with pytest.raises(ZeroDivisionError):
        preflight(ConfigContainer(), world_size=32, gpu="H100-80GB", strict=True, emit=emit)


def test_world_size_sources(monkeypatch):
    cfg = ConfigContainer()
    monkeypatch.setenv("WORLD_SIZE", "16")
    r = preflight(cfg, gpu="H100-80GB", emit=quiet()[1])
    assert r.world_size == 16 and r.world_size_from == "WORLD_SIZE" and r.layout.dp == 4
    monkeypatch.delenv("WORLD_SIZE")
    doc = config_dict(cfg)
    doc["data_parallel_size"] = 2          # what runtime_config_update records
    r = preflight(doc, gpu="H100-80GB", emit=quiet()[1])
    assert r.world_size == 8
    # unknown: reported, training goes on; strict raises
    lines, emit = quiet()
    r = preflight(cfg, gpu="H100-80GB", emit=emit)
    assert r.action == "unsupported" and "number of GPUs is unknown" in r.reason and "training continues unchecked" in lines[0]
    with pytest.raises(Exception, match="number of GPUs is unknown"):
        preflight(cfg, gpu="H100-80GB", strict=True)


# --------------------------------------------------------------------------------------------------
# The callback, through Bridge's own CallbackManager (callbacks.py of Bridge 0.6.2)
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def bridge(monkeypatch):
    monkeypatch.syspath_prepend(STANDIN)
    for m in [m for m in sys.modules if m.startswith("megatron.bridge")]:
        monkeypatch.delitem(sys.modules, m)
    import megatron.bridge.training.callbacks as cbs
    import megatron.bridge.training.pretrain as pt
    yield cbs, pt
    for m in [m for m in sys.modules if m.startswith("megatron.bridge")]:
        del sys.modules[m]


class Writer:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))


def fake_parallel_state(pp_rank, pp_size):
    """megatron.core.parallel_state as Bridge leaves it initialized (TP = DP = CP rank 0)."""
    return types.SimpleNamespace(model_parallel_is_initialized=lambda: True, get_pipeline_model_parallel_rank=lambda: pp_rank,
                                 get_pipeline_model_parallel_world_size=lambda: pp_size, get_tensor_model_parallel_rank=lambda: 0,
                                 get_data_parallel_rank=lambda: 0, get_context_parallel_rank=lambda: 0)


def test_optimizer_shard_rank_is_the_rank_in_the_dp_cp_group(monkeypatch):
    """The runtime prediction takes the distributed optimizer's shard of this rank: its index in the
    DP x CP group of one optimizer instance (megatron/core/process_groups_config.py intra_dp_cp_group),
    not the plain DP rank. Global rank 3 of TP1 CP2 DP2 (order tp-cp-dp): DP rank 1, CP rank 1, shard 3."""
    from megatron_memguard._integration import parallel_ranks

    def dp_rank(with_context_parallel=False, partial_data_parallel=False):
        return 3 if with_context_parallel else 1
    mpu = types.SimpleNamespace(**{**vars(fake_parallel_state(0, 1)), "get_data_parallel_rank": dp_rank,
                                   "get_context_parallel_rank": lambda: 1})
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", mpu)
    ranks = parallel_ranks()
    assert (ranks["dp_rank"], ranks["cp_rank"], ranks["optimizer_rank"]) == (1, 1, 3)


def test_callback_samples_every_interval_through_the_callback_manager(bridge, tmp_path, monkeypatch):
    from megatron_memguard.bridge import MemguardCallback
    cbs, pt = bridge
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", fake_parallel_state(1, 2))  # this rank: stage pp1
    cfg = ConfigContainer(logger=LoggerConfig(log_interval=2))
    result = preflight(cfg, world_size=32, gpu="H100-80GB", emit=quiet()[1])
    readings = [Reading(allocated=10 * 2**30 + i, max_allocated=20 * 2**30 + i, reserved=11 * 2**30, max_reserved=21 * 2**30,
                        device_used=23 * 2**30) for i in range(10)]
    cb = MemguardCallback(result, log_dir=str(tmp_path), source=StaticSource(readings), emit=quiet()[1])
    manager = cbs.CallbackManager()
    manager.add(cb)
    assert manager.has_callbacks("on_train_start") and manager.has_callbacks("on_train_step_end")
    writer = Writer()
    state = pt.GlobalState(cfg=cfg, tensorboard_logger=writer)
    ctx = lambda: cbs.CallbackContext(state=state, model=[], user_state=manager.user_state)  # noqa: E731
    manager.fire("on_train_start", ctx())
    for _ in range(5):
        manager.fire("on_train_step_end", ctx())
        state.train_state.step += 1           # Bridge increments after on_train_step_end
    manager.fire("on_train_end", ctx())
    recs = [json.loads(line) for line in open(tmp_path / "memguard-rank00000.jsonl")]
    assert [r["event"] for r in recs] == ["start", "sample", "sample", "summary"]
    assert [r["iteration"] for r in recs[1:3]] == [2, 4]      # cfg.logger.log_interval, Megatron's numbering
    assert recs[0]["actual"] == readings[0].to_dict() and [r["actual"] for r in recs[1:3]] == [readings[1].to_dict(),
                                                                                                readings[2].to_dict()]
    stage1 = result.estimate.stages[1]
    assert stage1.peak_allocated_bytes != result.estimate.stages[0].peak_allocated_bytes
    assert recs[0]["pp_rank"] == 1 and recs[0]["predicted"]["pp_rank"] == 1
    assert recs[0]["predicted"]["peak_allocated"] == stage1.peak_allocated_bytes
    assert recs[0]["predicted"]["breakdown"] == stage1.breakdown
    assert recs[1]["ratio"]["max_allocated"] == pytest.approx(readings[1].max_allocated / stage1.peak_allocated_bytes, abs=1e-4)
    assert recs[0]["context"]["framework"] == "megatron-bridge" and recs[0]["context"]["decision"]["verdict"] == result.verdict
    tags = {t for t, _, s in writer.scalars if s == 2}
    assert "memguard/max-allocated-bytes" in tags and "memguard/predicted-peak-allocated-bytes" in tags
    assert recs[-1]["samples"] == 2 and recs[-1]["errors"] == 0
    # parallel state not initialized: with PP 2 this rank's stage is unknown, so no stage's prediction is taken for it
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", types.SimpleNamespace(model_parallel_is_initialized=lambda: False))
    cb2 = MemguardCallback(result, log_dir=str(tmp_path / "uninit"), source=StaticSource(readings), emit=quiet()[1])
    cb2.on_train_start(ctx())
    cb2.on_train_end(ctx())
    start = json.loads(open(tmp_path / "uninit" / "memguard-rank00000.jsonl").readline())
    assert start["predicted"] is None and "pipeline stage is unknown" in start["context"]["note"]


def tiny_cpu_config():
    """A two-layer fp32 GPT that trains on CPU in a second, without distributed optimizer or mixed precision."""
    tiny = GPTModelProvider(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=4,
                            seq_length=32, vocab_size=256, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                            sequence_parallel=False, recompute_granularity=None, bf16=False, params_dtype=torch.float32,
                            transformer_impl="local")
    return ConfigContainer(model=tiny, train=TrainingConfig(micro_batch_size=2, global_batch_size=2, train_iters=3),
                           optimizer=OptimizerConfig(use_distributed_optimizer=False, bf16=False, params_dtype=torch.float32),
                           ddp=DistributedDataParallelConfig(use_distributed_optimizer=False, overlap_param_gather=False),
                           dataset=GPTDatasetConfig(seq_length=32), logger=LoggerConfig(log_interval=1), mixed_precision=None)


def test_pretrain_wrapper_end_to_end_on_cpu(bridge, tmp_path):
    """megatron_memguard.bridge.pretrain: the pre-flight, then Bridge's pretrain with the callback; a tiny model
    trained on CPU, measured by the live-bytes source."""
    from megatron_memguard import bridge as mb
    cbs, pt = bridge

    cfg = tiny_cpu_config()
    tiny = cfg.model
    src = RecordingSource()             # not started here: the wrapper starts it before the model is built
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))

    def forward_step(model):
        return F.cross_entropy(model(tokens).view(-1, 256), tokens.view(-1))

    lines, emit = quiet()
    state = mb.pretrain(cfg, forward_step, world_size=1, gpu_memory="2GiB", log_dir=str(tmp_path), source=src,
                        tensorboard_logger=Writer())
    assert state.train_state.step == 3
    recs = [json.loads(line) for line in open(tmp_path / "memguard-rank00000.jsonl")]
    assert [r["event"] for r in recs] == ["start", "sample", "sample", "sample", "summary"]
    assert [r["actual"] for r in recs[:4]] == src.readings[:4]
    assert [r["iteration"] for r in recs[1:4]] == [1, 2, 3]
    params = sum(p.numel() for p in tiny.provide().parameters())
    held = recs[3]["actual"]["allocated"]            # fp32 params + grads + Adam's two moments, after a step
    assert 16 * params <= held <= 16 * params * 1.05 + 2**20
    L = mb.preflight(cfg, world_size=1, gpu_memory="2GiB", emit=quiet()[1]).layout
    cpu = estimate(L, device="cpu", gpu_memory=2 * 2**30, threshold=0.8)
    assert recs[0]["predicted"]["device"] == "cpu" and recs[0]["predicted"]["peak_allocated"] == cpu.stages[0].peak_allocated_bytes
    # abort: the model is never built
    built = []
    big = replace(cfg, model=replace(tiny, num_layers=2000, hidden_size=8192, ffn_hidden_size=28672))
    big.model.provide = lambda: built.append(1)
    with pytest.raises(PreflightAbort):
        mb.pretrain(big, forward_step, world_size=1, gpu="H100-80GB", mode="abort", source=RecordingSource())
    assert built == []
    # off: Bridge's pretrain alone, no memguard callback and no log file
    off_dir = tmp_path / "off"
    state = mb.pretrain(cfg, forward_step, world_size=1, gpu_memory="2GiB", log_dir=str(off_dir), mode="off",
                        source=RecordingSource())
    assert state.train_state.step == 3 and not off_dir.exists()


def test_the_callback_starts_the_source_itself_as_the_lightning_callback_does(bridge, tmp_path):
    """MemguardCallback(source=LiveBytesSource()) handed to Bridge's own pretrain, nobody calling source.start():
    the callback starts it at on_train_start and counts the model and optimizer built before that (issue 20)."""
    from megatron_memguard.bridge import MemguardCallback
    cbs, pt = bridge
    cfg = tiny_cpu_config()
    tiny = cfg.model
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    result = preflight(cfg, world_size=1, gpu_memory="2GiB", emit=quiet()[1])
    src = RecordingSource()
    cb = MemguardCallback(result, log_dir=str(tmp_path), source=src, emit=quiet()[1])
    pt.pretrain(cfg, lambda model: F.cross_entropy(model(tokens).view(-1, 256), tokens.view(-1)), callbacks=[cb])
    recs = [json.loads(line) for line in open(tmp_path / "memguard-rank00000.jsonl")]
    assert [r["event"] for r in recs] == ["start", "sample", "sample", "sample", "summary"]
    params = sum(p.numel() for p in tiny.provide().parameters())
    assert recs[0]["actual"]["allocated"] == 4 * params             # the fp32 model, built before the source started
    held = recs[3]["actual"]["allocated"]                           # + gradients and Adam's two moments after a step
    assert 16 * params <= held <= 16 * params * 1.05 + 2**20
    assert src._mode is None                                        # stopped at the end of training


def test_without_bridge_preflight_works_and_the_callback_says_what_it_needs(tmp_path):
    code = textwrap.dedent("""
        import importlib.util, sys
        assert importlib.util.find_spec("megatron.bridge") is None
        import megatron_memguard.bridge as b
        from megatron_memguard.readers.models import recipe_doc
        r = b.preflight(recipe_doc("llama3_8b")[0], world_size=16, gpu="H100-80GB", emit=lambda s: None)
        print("verdict", r.verdict)
        for what in (lambda: b.MemguardCallback(r), lambda: b.pretrain({}, None)):
            try:
                what()
            except ImportError as e:
                print("ImportError:", e)
        print("torch" in sys.modules)
        """)
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] in ("verdict fits", "verdict tight")
    assert lines[1].startswith("ImportError: megatron_memguard.bridge.MemguardCallback needs Megatron-Bridge (pip install megatron-bridge")
    assert lines[2].startswith("ImportError: megatron_memguard.bridge.pretrain needs Megatron-Bridge")
    assert "preflight() works without it" in lines[1]
    assert lines[3] == "False"      # the pre-flight did not import torch


def test_invalid_expert_grid_is_not_called_unchecked(monkeypatch):
    # TP2 PP4 EP4 ETP2 on 16 GPUs: initialize_model_parallel (megatron-core parallel_state.py) needs the world to
    # divide into ETP x EP x PP = 32, so the run stops there; the pre-flight says so instead of "continues"
    doc = config_dict(ConfigContainer())
    doc["model"].update(num_moe_experts=8, moe_ffn_hidden_size=3584, moe_router_topk=2, expert_model_parallel_size=4,
                        expert_tensor_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True,
                        pipeline_model_parallel_size=4, moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall")
    monkeypatch.setenv("WORLD_SIZE", "16")
    lines, emit = quiet()
    r = preflight(doc, gpu="H100-80GB", emit=emit)
    assert r.action == "unsupported" and len(lines) == 1 and "training continues unchecked" not in lines[0]
    assert lines[0].endswith("the run will stop in initialize_model_parallel: world size 16 is not divisible by expert "
                             "tensor parallel 2 x expert parallel 4 x pipeline parallel 4 = 32 (change "
                             "model.expert_model_parallel_size, model.expert_tensor_parallel_size, "
                             "model.pipeline_model_parallel_size)")


def test_an_input_megatron_stops_on_later_is_said_so():
    # MTP under uniform recompute of 2 layers per checkpoint: Bridge builds it, then
    # MultiTokenPredictionLayer._checkpointed_forward (transformer/multi_token_prediction.py, core 0.16.1 / 0.19.2)
    # asserts recompute_num_layers == 1 at the first forward: not "training continues unchecked"; no abort either
    doc = config_dict(ConfigContainer())
    doc["model"].update(mtp_num_layers=1, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    lines, emit = quiet()
    r = preflight(doc, world_size=32, gpu="H100-80GB", mode="abort", emit=emit)
    assert r.action == "unsupported" and len(lines) == 1 and "training continues unchecked" not in lines[0]
    assert lines[0].endswith("the run will stop at the first forward step (MultiTokenPredictionLayer._checkpointed_forward "
                             "asserts) (change model.recompute_num_layers)")
