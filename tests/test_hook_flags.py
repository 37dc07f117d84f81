"""The --memguard* flags and MEMGUARD_* variables on a plain argparse parser (no Megatron needed)."""
import argparse

import pytest

from megatron_memguard.errors import ConfigError
from megatron_memguard.megatron.flags import FLAGS, add_arguments, settings_from_args


def parser(environ=None):
    p = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False)
    p.add_argument("--num-layers", type=int)
    return add_arguments(p, environ=environ or {})


def test_defaults():
    ns = parser().parse_args([])
    s = settings_from_args(ns)
    assert (s.mode, s.threshold, s.gpu_memory, s.log_interval, s.log_dir, s.reset_peak, s.allow_recompute) == \
        ("warn", 0.8, None, None, None, False, False)
    assert s.from_flags


def test_flags():
    ns = parser().parse_args(["--memguard", "AUTOTUNE", "--memguard-threshold", "0.9", "--memguard-gpu-memory", "79.1GiB",
                              "--memguard-log-interval", "10", "--memguard-log-dir", "/tmp/x", "--memguard-reset-peak",
                              "--memguard-allow-recompute", "true"])
    s = settings_from_args(ns)
    assert s.mode == "autotune" and s.threshold == 0.9 and s.gpu_memory == int(79.1 * 2**30)
    assert s.log_interval == 10 and s.log_dir == "/tmp/x" and s.reset_peak and s.allow_recompute


def test_environment_and_flag_precedence():
    env = {"MEMGUARD": "abort", "MEMGUARD_THRESHOLD": "0.7", "MEMGUARD_RESET_PEAK": "1", "MEMGUARD_GPU_MEMORY": "40GiB",
           "MEMGUARD_LOG_INTERVAL": "5", "MEMGUARD_LOG_DIR": "/tmp/y", "MEMGUARD_ALLOW_RECOMPUTE": "yes"}
    s = settings_from_args(parser(env).parse_args([]))
    assert (s.mode, s.threshold, s.reset_peak, s.gpu_memory, s.log_interval, s.log_dir, s.allow_recompute) == \
        ("abort", 0.7, True, 40 * 2**30, 5, "/tmp/y", True)
    s = settings_from_args(parser(env).parse_args(["--memguard", "report", "--memguard-reset-peak", "false"]))
    assert s.mode == "report" and s.reset_peak is False


@pytest.mark.parametrize("argv, flag, text", [
    (["--memguard", "sometimes"], "--memguard", "invalid choice: 'sometimes'"),
    (["--memguard-threshold", "2"], "--memguard-threshold", "must be in (0, 1.5]"),
    (["--memguard-threshold", "x"], "--memguard-threshold", "expected a fraction"),
    (["--memguard-gpu-memory", "lots"], "--memguard-gpu-memory", "cannot read size"),
    (["--memguard-log-interval", "0"], "--memguard-log-interval", "must be >= 1"),
    (["--memguard-reset-peak", "maybe"], "--memguard-reset-peak", "expected true or false"),
])
def test_bad_flag_values_are_argparse_errors_naming_the_flag(capsys, argv, flag, text):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"pretrain_gpt.py: error: argument {flag}: " in err and text in err


@pytest.mark.parametrize("var, value, flag", [(f.env, "bogus", f.flag) for f in FLAGS
                                              if f.env not in ("MEMGUARD_LOG_DIR", "MEMGUARD_PROFILE")])
def test_bad_environment_values_name_flag_and_variable(capsys, var, value, flag):
    with pytest.raises(SystemExit) as e:
        parser({var: value}).parse_args([])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and f"(from {var})" in err


def test_flags_added_once_per_parser():
    p = parser()
    add_arguments(p)
    assert sum(1 for a in p._actions if a.dest == "memguard") == 1


def test_settings_from_environment_when_flags_are_missing():
    ns = argparse.Namespace(num_layers=2)
    s = settings_from_args(ns, environ={"MEMGUARD": "off"})
    assert s.mode == "off" and not s.from_flags
    with pytest.raises(ConfigError) as e:
        settings_from_args(ns, environ={"MEMGUARD_THRESHOLD": "-1"})
    assert "MEMGUARD_THRESHOLD" in str(e.value)


def test_help_lists_the_group():
    text = " ".join(parser().format_help().split())
    assert "memguard:" in text and "{off,report,warn,abort,autotune}" in text and "[env MEMGUARD_THRESHOLD]" in text
