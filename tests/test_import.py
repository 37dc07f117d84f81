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
