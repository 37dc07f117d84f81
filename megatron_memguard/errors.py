"""Errors memguard raises for bad input. Each names the flag or key at fault and the rule it breaks."""
from __future__ import annotations


class MemguardError(Exception):
    """Base class: a problem with the user's input that memguard reports in one line."""


class ConfigError(MemguardError):
    """A setting breaks a rule that Megatron (or memguard) enforces.

    ``key`` is the flag or key path as the user wrote it (``--tensor-model-parallel-size``,
    ``model.tensor_model_parallel_size``); ``rule`` says what must hold; ``fix`` optionally
    suggests a change.
    """

    def __init__(self, key: str, rule: str, fix: str | None = None):
        self.key = key
        self.rule = rule
        self.fix = fix
        msg = f"{key}: {rule}" if key else rule
        if fix:
            msg += f" ({fix})"
        super().__init__(msg)


class ConfigErrors(MemguardError):
    """Several ConfigErrors found at once (the validator reports all of them)."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = list(errors)
        super().__init__("; ".join(str(e) for e in self.errors))


class NotModelledError(MemguardError):
    """A setting changes memory in a way memguard does not model yet: refuse rather than guess."""

    def __init__(self, key: str, what: str):
        self.key = key
        self.what = what
        super().__init__(f"{key}: {what} is not modelled yet; memguard will not guess its memory")


class ReaderError(MemguardError):
    """An input file or command line could not be read (syntax, unknown format, missing value)."""
