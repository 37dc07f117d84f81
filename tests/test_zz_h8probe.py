import os, types, traceback
import pytest
from tests.test_bridge_real import recipes, _finalized  # noqa
FIELDS = """train profiling validation logger dist rng scheduler checkpoint tokenizer rerun_state_machine logger.log_interval rng.seed checkpoint.fully_parallel_save logger.log_throughput train.manual_gc_interval""".split()

def test_probe(recipes, monkeypatch):
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides
    from megatron.bridge.training.config import runtime_config_update
    import torch, transformer_engine.pytorch.optimizers as te_optimizers
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: types.SimpleNamespace(major=9, minor=0, name="NVIDIA H100 80GB HBM3"))
    monkeypatch.setenv("WORLD_SIZE", "8")
    out = []
    for val in ("null",):
      for f in FIELDS:
        sec, name = (f.split(".") + [None])[:2]
        try:
            cfg = recipes.llama32_1b_pretrain_config()
            if sec == "mixed_precision":
                from megatron.bridge.training.mixed_precision import get_mixed_precision_config
                cfg.mixed_precision = get_mixed_precision_config(cfg.mixed_precision) if isinstance(cfg.mixed_precision, str) else cfg.mixed_precision
            if sec == "comm_overlap" and cfg.comm_overlap is None:
                from megatron.bridge.training.comm_overlap import CommOverlapConfig
                cfg.comm_overlap = CommOverlapConfig(tp_comm_overlap=False)
            cfg = process_config_with_overrides(cfg, cli_overrides=[f"{f}={val}"])
            got = getattr(getattr(cfg, sec), name) if name else getattr(cfg, sec)
            env = dict(os.environ)
            try:
                runtime_config_update(cfg)
            finally:
                os.environ.clear(); os.environ.update(env)
            after = getattr(getattr(cfg, sec), name) if name else getattr(cfg, sec)
            # what the training would compute from it
            extra = ""
            if sec == "ddp": extra = f" model.bf16={cfg.model.bf16}"
            out.append(f"{val} {f}: loaded={got!r} after_validate={after!r}{extra}")
        except BaseException as e:
            out.append(f"{val} {f}: ERROR {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
    open("/tmp/h8probe/out.txt", "w").write("\n".join(out) + "\n")
