"""The drop-in Megatron-LM hook: ``import megatron_memguard.megatron`` in ``pretrain_gpt.py``.

Importing this package installs the hook (once; importing again does nothing): Megatron's parser
gains the ``--memguard*`` flags (also read from ``MEMGUARD_*``), the arguments are checked against
GPU memory inside ``validate_args`` before anything is allocated (report / warn / abort / autotune),
and while training runs each rank compares its actual peak memory with its own stage's prediction.
See docs/hook.md. Works with both Megatron eras (core <= 0.17: ``pretrain()`` parses the arguments;
core >= 0.18: ``pretrain_gpt.py`` calls ``parse_and_validate_args`` itself).

    import megatron_memguard.megatron  # noqa: F401  (the one line)

``install()`` / ``uninstall()`` are exposed for tests and for scripts that import Megatron's
modules under other names; ``set_memory_source()`` plugs another memory source (e.g. the CPU
``LiveBytesSource``) into the runtime monitor.
"""
from .flags import FLAGS, MODES, Settings, add_arguments, settings_from_args
from .hook import STATE, detect_era, install, set_memory_source, uninstall, wrapped_targets
from .preflight import ABORT_EXIT_CODE, Decision, MemguardAbort, decide

__all__ = [
    "ABORT_EXIT_CODE", "Decision", "FLAGS", "MODES", "MemguardAbort", "STATE", "Settings", "add_arguments", "decide",
    "detect_era", "install", "set_memory_source", "settings_from_args", "uninstall", "wrapped_targets",
]


def _install_at_import() -> None:
    """The one line in pretrain_gpt.py must never stop training: a memguard bug while wrapping Megatron's functions is
    reported once and the run goes on (unchecked where the wrapping failed)."""
    try:
        install(quiet=False)
    except Exception as e:
        STATE.error("installing the hook", e)


_install_at_import()
