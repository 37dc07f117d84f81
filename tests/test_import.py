"""``import megatron_memguard`` loads neither torch nor megatron and patches nothing."""
import subprocess
import sys


def test_import_is_pure():
    code = ("import sys, builtins; before = set(sys.modules); import megatron_memguard; "
            "import megatron_memguard.estimator, megatron_memguard.resolve, megatron_memguard.cli.main; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'transformer_engine', 'omegaconf')]; "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
