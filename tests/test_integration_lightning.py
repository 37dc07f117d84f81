"""megatron_memguard.lightning: a real Lightning Trainer on CPU (a tiny model, the live-bytes CPU source), the
layout read from a NeMo 2-like strategy / model config / data module, abort before configure_model, and
what happens without Lightning."""
import csv
import dataclasses
import glob
import json
import os
import subprocess
import sys
import textwrap
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest

pl = pytest.importorskip("lightning.pytorch")
torch = pytest.importorskip("torch")

from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.strategies import SingleDeviceStrategy  # noqa: E402

from megatron_memguard import estimate, layout_from_flags, lookup_gpu  # noqa: E402
from megatron_memguard.lightning import MemguardCallback, PreflightAbort, raw_config  # noqa: E402
from megatron_memguard.resolve import resolve  # noqa: E402

from e2e.recording import RecordingSource  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
nn = torch.nn


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("SLURM_", "MEMGUARD")) or k in ("WORLD_SIZE", "RANK"):
            monkeypatch.delenv(k)


class TinyGPT(pl.LightningModule):
    """A GPT-shaped toy whose ``config`` has NeMo 2 GPTConfig attribute names; built in configure_model, as
    NeMo 2's GPTModel is."""

    def __init__(self, **shape):
        super().__init__()
        self.config = types.SimpleNamespace(
            num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, seq_length=32, vocab_size=256,
            share_embeddings_and_output_weights=False, normalization="LayerNorm", add_bias_linear=True,
            position_embedding_type="learned_absolute", hidden_dropout=0.0, attention_dropout=0.0,
            transformer_impl="local", max_position_embeddings=32)
        vars(self.config).update(shape)
        self.configured = False
        self.net = None

    def configure_model(self):
        if self.net is not None:
            return
        self.configured = True
        c = self.config
        torch.manual_seed(0)
        self.net = nn.ModuleDict({
            "emb": nn.Embedding(c.vocab_size, c.hidden_size),
            "layers": nn.ModuleList(nn.Sequential(nn.LayerNorm(c.hidden_size), nn.Linear(c.hidden_size, c.ffn_hidden_size),
                                                  nn.GELU(), nn.Linear(c.ffn_hidden_size, c.hidden_size))
                                    for _ in range(c.num_layers)),
            "out": nn.Linear(c.hidden_size, c.vocab_size, bias=False)})

    def training_step(self, batch, batch_idx):
        x = self.net["emb"](batch)
        for layer in self.net["layers"]:
            x = x + layer(x)
        return nn.functional.cross_entropy(self.net["out"](x).view(-1, self.config.vocab_size), batch.view(-1))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class TokenData(pl.LightningDataModule):
    """NeMo 2 data modules carry micro_batch_size, global_batch_size and seq_length."""
    micro_batch_size = 2
    global_batch_size = 2
    seq_length = 32

    def train_dataloader(self):
        data = torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(data, batch_size=self.micro_batch_size)


class MegatronLikeStrategy(SingleDeviceStrategy):
    """A single-device strategy with NeMo 2 MegatronStrategy's attribute names (all sizes 1 on one CPU)."""
    tensor_model_parallel_size = 1
    pipeline_model_parallel_size = 1
    virtual_pipeline_model_parallel_size = None
    context_parallel_size = 1
    sequence_parallel = False
    ddp_config = types.SimpleNamespace(use_distributed_optimizer=False, grad_reduce_in_fp32=True, overlap_grad_reduce=False)


def make_trainer(tmp_path, cb, steps=3):
    return pl.Trainer(max_steps=steps, accelerator="cpu", strategy=MegatronLikeStrategy(device="cpu"),
                      logger=CSVLogger(str(tmp_path / "csv"), name="run"), enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, precision="32-true", callbacks=[cb],
                      log_every_n_steps=1)


def test_real_trainer_on_cpu_logs_the_sources_readings_and_the_estimators_prediction(tmp_path):
    src = RecordingSource()
    lines = []
    cb = MemguardCallback(source=src, log_dir=str(tmp_path / "logs"), gpu_memory="1GiB", emit=lines.append)
    model = TinyGPT()
    trainer = make_trainer(tmp_path, cb)
    trainer.fit(model, datamodule=TokenData())
    recs = [json.loads(line) for line in open(tmp_path / "logs" / "memguard-rank00000.jsonl")]
    assert [r["event"] for r in recs] == ["start", "sample", "sample", "sample", "summary"]
    # every reading the source handed out is in the file, unchanged, at Lightning's optimizer steps
    assert [r["actual"] for r in recs[:4]] == src.readings[:4]
    assert [r["iteration"] for r in recs[1:4]] == [1, 2, 3]
    assert recs[-1]["max"]["max_allocated"] == max(r["max_allocated"] for r in src.readings)
    # physical: after a step the rank holds fp32 parameters, gradients and Adam's two moments (16 B each)
    params = sum(p.numel() for p in model.parameters())
    for r in recs[1:4]:
        assert 16 * params <= r["actual"]["allocated"] <= 16 * params * 1.05 + 2**20
        assert r["actual"]["max_allocated"] >= r["actual"]["allocated"]
    # the layout read from the strategy, the model config and the data module
    L = cb.result.layout
    assert (L.world_size, L.tp, L.pp, L.cp, L.dp) == (1, 1, 1, 1, 1)
    assert (L.num_layers, L.hidden_size, L.ffn_hidden_size, L.num_attention_heads) == (2, 64, 256, 4)
    assert (L.micro_batch_size, L.global_batch_size, L.seq_length, L.params_dtype) == (2, 2, 32, "fp32")
    assert L.padded_vocab_size == 256 and not L.use_distributed_optimizer
    # the prediction is the estimator's for that layout, on the source's device
    cpu = estimate(L, device="cpu", gpu_memory=2**30, threshold=0.8)
    assert recs[0]["predicted"]["device"] == "cpu" and recs[0]["predicted"]["pp_rank"] == 0
    assert recs[0]["predicted"]["peak_allocated"] == cpu.stages[0].peak_allocated_bytes
    assert recs[0]["predicted"]["breakdown"] == cpu.stages[0].breakdown
    for r in recs[1:4]:
        assert r["predicted"]["peak_allocated"] == cpu.stages[0].peak_allocated_bytes
        assert r["ratio"]["max_allocated"] == pytest.approx(r["actual"]["max_allocated"] / cpu.stages[0].peak_allocated_bytes,
                                                            abs=1e-4)
    assert recs[0]["context"]["framework"] == "lightning" and recs[0]["context"]["strategy"] == "MegatronLikeStrategy"
    # the pre-flight's verdict line and rank 0's per-stage lines
    assert "[memguard] Lightning pre-flight: mode warn" in lines[0] and "verdict: FITS" in lines[0]
    assert any(line.startswith("[memguard] iteration 3 pp0: max allocated") for line in lines)
    # the trainer's logger got the same numbers
    rows = list(csv.DictReader(open(glob.glob(str(tmp_path / "csv" / "run" / "*" / "metrics.csv"))[0])))
    logged = {int(r["step"]): float(r["memguard/max-allocated-bytes"]) for r in rows if r.get("memguard/max-allocated-bytes")}
    assert logged == {r["iteration"]: float(r["actual"]["max_allocated"]) for r in recs[1:4]}


def test_abort_stops_before_configure_model(tmp_path):
    model = TinyGPT(num_layers=64, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16)
    lines = []
    cb = MemguardCallback(mode="abort", source=RecordingSource(), gpu_memory="1GiB", emit=lines.append)
    with pytest.raises(PreflightAbort) as e:
        make_trainer(tmp_path, cb).fit(model, datamodule=TokenData())
    assert e.value.code == 3 and not model.configured and model.net is None
    assert "ABORT" in lines[0] and "aborting on every rank" in lines[0]


def test_interval_follows_log_every_n_steps_and_off_does_nothing(tmp_path):
    cb = MemguardCallback(source=RecordingSource(), log_dir=str(tmp_path / "a"), gpu_memory="1GiB", emit=lambda s: None)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", strategy=MegatronLikeStrategy(device="cpu"), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         precision="32-true", callbacks=[cb], log_every_n_steps=2)
    trainer.fit(TinyGPT(), datamodule=TokenData())
    recs = [json.loads(line) for line in open(tmp_path / "a" / "memguard-rank00000.jsonl")]
    assert [r["iteration"] for r in recs if r["event"] == "sample"] == [2, 4]
    off = MemguardCallback(mode="off", source=RecordingSource(), log_dir=str(tmp_path / "b"))
    make_trainer(tmp_path, off, steps=1).fit(TinyGPT(), datamodule=TokenData())
    assert not os.path.exists(tmp_path / "b") and off.monitor is None


# --------------------------------------------------------------------------------------------------
# Reading a NeMo 2 layout (MegatronStrategy, GPTConfig, MegatronMixedPrecision, optimizer, data module)
# --------------------------------------------------------------------------------------------------
@dataclass
class GPTConfig:                      # NeMo 2's llm.GPTConfig field names (megatron-core TransformerConfig)
    num_layers: int = 32
    hidden_size: int = 4096
    ffn_hidden_size: int = 14336
    num_attention_heads: int = 32
    num_query_groups: int = 8
    seq_length: int = 8192
    vocab_size: Optional[int] = None
    share_embeddings_and_output_weights: bool = False
    normalization: str = "RMSNorm"
    gated_linear_unit: bool = True
    activation_func: Callable = torch.nn.functional.silu
    add_bias_linear: bool = False
    position_embedding_type: str = "rope"
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    recompute_granularity: Optional[str] = "full"
    recompute_method: Optional[str] = "uniform"
    recompute_num_layers: Optional[int] = 1
    make_vocab_size_divisible_by: int = 128


@dataclass
class DtypeConfig:
    params_dtype: Any = torch.bfloat16
    grad_reduce_in_fp32: bool = True
    fp8: Optional[str] = None


@dataclass
class OptimizerConfig:
    optimizer: str = "adam"
    use_distributed_optimizer: bool = True
    bf16: bool = True


def test_reads_a_nemo2_megatron_strategy_layout():
    strategy = types.SimpleNamespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=4,
                                     virtual_pipeline_model_parallel_size=2, context_parallel_size=2, sequence_parallel=True,
                                     expert_model_parallel_size=1,
                                     ddp_config=types.SimpleNamespace(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                                                      overlap_grad_reduce=True, overlap_param_gather=True))
    trainer = types.SimpleNamespace(strategy=strategy, num_devices=8, num_nodes=8, world_size=64, precision="bf16-mixed",
                                    precision_plugin=types.SimpleNamespace(dtype_config=DtypeConfig()),
                                    datamodule=types.SimpleNamespace(micro_batch_size=1, global_batch_size=256, seq_length=8192))
    module = types.SimpleNamespace(config=GPTConfig(), tokenizer=types.SimpleNamespace(vocab_size=128256),
                                   optim=types.SimpleNamespace(config=OptimizerConfig()))
    raw = raw_config(trainer, module)
    assert raw.origin["tensor_model_parallel_size"] == "trainer.strategy.tensor_model_parallel_size"
    L = resolve(raw, world_size=64)
    flags = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
             "--num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope "
             "--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
             "--hidden-dropout 0 --attention-dropout 0 --tokenizer-type HuggingFaceTokenizer --vocab-size 128256 --bf16 "
             "--micro-batch-size 1 --global-batch-size 256 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 "
             "--num-virtual-stages-per-pipeline-rank 2 --context-parallel-size 2 --sequence-parallel "
             "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --recompute-granularity full "
             "--recompute-method uniform --recompute-num-layers 1").split()
    M = layout_from_flags(flags, world_size=64)
    for f in ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
              "context_parallel_size", "data_parallel_size", "sequence_parallel", "use_distributed_optimizer", "num_layers",
              "hidden_size", "ffn_hidden_size", "num_query_groups", "swiglu", "micro_batch_size", "global_batch_size",
              "seq_length", "params_dtype", "recompute_granularity", "recompute_method", "recompute_num_layers",
              "untie_embeddings_and_output_weights", "padded_vocab_size"):
        assert getattr(L, f) == getattr(M, f), f
    # no .config on the module: said clearly, training goes on
    lines = []
    cb = MemguardCallback(emit=lines.append, gpu_memory="80GiB")
    cb.setup(trainer, types.SimpleNamespace(), "fit")
    assert cb.result.action == "unsupported" and "no .config" in lines[0] and "model_config=" in lines[0]


def test_without_lightning_the_callback_says_what_it_needs():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("lightning", "pytorch_lightning"):
                    raise ImportError("blocked for the test: " + name)
                return None
        sys.meta_path.insert(0, Block())
        import megatron_memguard.lightning as ml
        print(ml.lightning_available())
        try:
            ml.MemguardCallback()
        except ImportError as e:
            print("ImportError:", e)
        """)
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "False"
    assert lines[1].startswith("ImportError: megatron_memguard.lightning.MemguardCallback needs Lightning (pip install lightning")


def test_one_sample_per_optimizer_step_and_none_before_the_first():
    from megatron_memguard.runtime import CallbackSink, MemoryMonitor, Reading, StaticSource
    records = []
    cb = MemguardCallback(emit=lambda s: None)
    cb.monitor = MemoryMonitor(StaticSource(Reading(allocated=1, max_allocated=2)), None, interval=1,
                               sinks=[CallbackSink(records.append)], emit=lambda s: None)
    # gradient accumulation over 2 batches: global_step is 0 until the first optimizer step
    for step in (0, 0, 1, 1, 2, 2):
        cb.on_train_batch_end(types.SimpleNamespace(global_step=step), None, None, None, 0)
    assert [r["iteration"] for r in records if r["event"] == "sample"] == [1, 2]


# --------------------------------------------------------------------------------------------------
# NeMo 2 precision: MegatronMixedPrecision("bf16-mixed") with the model config's params_dtype left at fp32
# --------------------------------------------------------------------------------------------------
@dataclass
class NemoDtypeConfig:               # NeMo 2.5.3 mixed_precision.py DtypeConfig (the fields memguard reads)
    fp32: bool = False
    fp16: bool = False
    bf16: bool = False
    params_dtype: Any = None
    pipeline_dtype: Any = None
    autocast_dtype: Any = None
    grad_reduce_in_fp32: bool = True
    fp8: Optional[str] = None


class MegatronMixedPrecision(pl.plugins.precision.Precision):
    """Stand-in for NeMo 2.5.3's nemo.lightning.pytorch.plugins.mixed_precision.MegatronMixedPrecision: its
    __init__ maps the precision string to a DtypeConfig exactly as NeMo's does (bf16 for 'bf16' / 'bf16-mixed',
    fp16 for 'fp16' / 'fp16-mixed' / '16' / '16-mixed', params_dtype defaulting to fp32) and sets the
    ``precision`` Lightning reports. The real one does not import here: nemo.lightning needs fiddle, absl,
    libcst, hydra, onnx and more on top of NeMo."""

    def __init__(self, precision, params_dtype=None, grad_reduce_in_fp32=True, fp8=None):
        precision = str(precision)
        dtype = torch.bfloat16 if precision in ("bf16", "bf16-mixed") else torch.float32
        self.dtype_config = NemoDtypeConfig(
            fp32=precision in ("fp32", "32"), fp16=precision in ("fp16", "fp16-mixed", "16", "16-mixed"),
            bf16=precision in ("bf16", "bf16-mixed"), params_dtype=params_dtype or torch.float32, pipeline_dtype=dtype,
            autocast_dtype=dtype, grad_reduce_in_fp32=grad_reduce_in_fp32, fp8=fp8)
        super().__init__()
        self.precision = "16-mixed" if self.dtype_config.fp16 else "bf16-mixed" if self.dtype_config.bf16 else "32-true"


def update_config_with_dtype_overrides(dtype_config, config):
    """NeMo 2.5.3 mixed_precision.py: every DtypeConfig field the config has is overwritten (MegatronStrategy.connect
    does this to the model config before any callback's setup)."""
    for f in dataclasses.fields(dtype_config):
        if hasattr(config, f.name):
            setattr(config, f.name, getattr(dtype_config, f.name))
    return config


@dataclass
class Llama31Config8B(GPTConfig):     # NeMo 2's class, TransformerConfig's precision defaults left alone
    seq_length: int = 8192
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    params_dtype: Any = torch.float32
    bf16: bool = False
    fp16: bool = False


def nemo2_layout(precision):
    plugin = MegatronMixedPrecision(precision=precision)
    config = update_config_with_dtype_overrides(plugin.dtype_config, Llama31Config8B())
    assert config.params_dtype == torch.float32            # NeMo leaves params_dtype at fp32 ...
    strategy = types.SimpleNamespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, context_parallel_size=1,
                                     sequence_parallel=True,
                                     ddp_config=types.SimpleNamespace(use_distributed_optimizer=True, grad_reduce_in_fp32=False))
    trainer = types.SimpleNamespace(strategy=strategy, num_devices=8, num_nodes=1, world_size=8, precision=plugin.precision,
                                    precision_plugin=plugin,
                                    datamodule=types.SimpleNamespace(micro_batch_size=1, global_batch_size=64, seq_length=8192))
    module = types.SimpleNamespace(config=config, tokenizer=types.SimpleNamespace(vocab_size=128256),
                                   optim=types.SimpleNamespace(config=OptimizerConfig(bf16=precision != "32")))
    return resolve(raw_config(trainer, module), world_size=8)


def test_nemo2_bf16_mixed_trains_bf16_parameters_whatever_params_dtype_says():
    L, L32 = nemo2_layout("bf16-mixed"), nemo2_layout("32")
    # ... but Float16Module casts the parameters to bf16 (convert_module): the same job as Megatron-LM's --bf16 with
    # fp32 gradient buffers (DtypeConfig.grad_reduce_in_fp32 defaults to True and overrides the DDP config's False)
    flags = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
             "--num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope "
             "--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
             "--hidden-dropout 0 --attention-dropout 0 --tokenizer-type HuggingFaceTokenizer --vocab-size 128256 "
             "--micro-batch-size 1 --global-batch-size 64 --use-distributed-optimizer --bf16 "
             "--tensor-model-parallel-size 2 --sequence-parallel "
             "--cross-entropy-loss-fusion --no-create-attention-mask-in-dataloader").split()   # GPTConfig's / the mock data's
    M = layout_from_flags(flags, world_size=8)
    assert L.params_dtype == M.params_dtype == "bf16" and L32.params_dtype == "fp32"
    E, F, E32 = (estimate(x, gpu=lookup_gpu("H100-80GB")) for x in (L, M, L32))
    assert E.stages[0].breakdown == F.stages[0].breakdown
    # 2 bytes per parameter instead of 4. Per TP2 rank: 32 layers x ((4096 x 6144 qkv + 4096 x 4096 proj + 4096 x 28672
    # fc1 + 14336 x 4096 fc2) / 2 + 2 x 4096 norms) + 2 x 128256 x 4096 / 2 (embedding, untied output) + 4096 final norm
    per_rank = 32 * ((4096 * 6144 + 4096 * 4096 + 4096 * 28672 + 14336 * 4096) // 2 + 2 * 4096) + 128256 * 4096 + 4096
    assert per_rank == 4015263744
    assert E.stages[0].breakdown["parameters"] == 2 * per_rank and E32.stages[0].breakdown["parameters"] == 4 * per_rank
    # on 8 H100s: bf16 fits (78%), the fp32 reading would not (104%)
    assert E.verdict == "fits" and E32.verdict == "will not fit"
