"""``import megatron_memguard`` loads neither torch nor megatron and patches nothing."""
import subprocess
import sys


def test_import_is_pure():
    code = ("import sys, builtins; before = set(sys.modules); import megatron_memguard; "
            "import megatron_memguard.estimator, megatron_memguard.resolve, megatron_memguard.cli.main; import megatron_memguard.autotune, megatron_memguard.runtime; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'transformer_engine', 'omegaconf')]; "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_readers_import_no_torch_nemo_or_megatron():
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import sys; from megatron_memguard.cli.main import main; "
            f"main(['validate', {os.path.join(here, 'data/configs/nemo-launcher/llama_llama3_1_70b.yaml')!r}]); "
            f"main(['estimate', '--config', {os.path.join(here, 'data/configs/megatron-bridge/llama32_1b_pretrain_override.yaml')!r}, "
            "'--model', 'llama32_1b', '--gpus', '8']); "
            f"main(['estimate', '--config', {os.path.join(here, 'data/configs/nemo2/context_model.yaml')!r}, '--gpus', '8', '--', '--micro-batch-size', '1']); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'nemo', 'transformer_engine', 'fiddle', 'hydra')]; "
            "print('BAD=' + ','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.path.dirname(here))
    assert "BAD=\n" in out.stdout or out.stdout.rstrip().endswith("BAD="), out.stdout[-500:] + out.stderr[-2000:]


def test_hook_import_without_megatron_training_is_harmless():
    """Where megatron.training is absent the hook says so once and patches nothing."""
    code = ("import megatron_memguard.megatron as h; print(h.STATE.era, len(h.wrapped_targets()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    try:
        import importlib.util
        real = importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        real = False
    if not real:
        assert out.stdout.split() == ["None", "0"]
        assert "megatron.training is not importable here; the hook is inactive" in out.stderr
    else:
        assert out.stdout.split()[0] in ("config-container", "legacy")
