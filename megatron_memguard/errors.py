"""Errors memguard raises for bad input. Each names the flag or key at fault and the rule it breaks."""
from __future__ import annotations

import re

# Words longer than this in an error message (a pasted value, a run-away path) are cut.
MAX_WORD = 160
MAX_MESSAGE = 1000
_LONG_WORD = re.compile(r"\S{%d,}" % (MAX_WORD + 1))


def _cut(text: str, keep: int) -> str:
    return f"{text[:keep]}...{text[-keep:]} ({len(text)} characters)"


def one_line(text: str) -> str:
    """``text`` as one line of a readable length: line breaks become spaces, a word longer than
    MAX_WORD characters and a message longer than MAX_MESSAGE are cut in the middle."""
    text = str(text)
    if "\n" in text or "\r" in text:
        text = " ".join(part.strip() for part in text.splitlines() if part.strip())
    text = text.strip()
    if len(text) > MAX_WORD:
        text = _LONG_WORD.sub(lambda m: _cut(m.group(0), 50), text)
    if len(text) > MAX_MESSAGE:
        text = _cut(text, MAX_MESSAGE // 2 - 30)
    return text


# Where Megatron stops when Transformer Engine finds no attention backend for a layer (validate_args does not
# apply TE's filters): DotProductAttention.forward, TE 2.11 / 2.20.2 pytorch/attention/dot_product_attention
NO_TE_BACKEND = ("at the first forward step (Transformer Engine's DotProductAttention raises \"No dot product "
                 "attention backend is available\")")

# the interleaved schedule's micro-batch group rule: validate_args does not check it, the schedule raises at the first
# training step (megatron-core pipeline_parallel/schedules.py, forward_backward_pipelining_with_interleaving)
INTERLEAVED_GROUPS = "at the first training step (the interleaved pipeline schedule raises on its micro-batch groups)"


class MemguardError(Exception):
    """Base class: a problem with the user's input that memguard reports in one line."""

    # Where Megatron itself stops on this input after its argument validation accepted it ("at the first
    # forward step (...)"), when memguard knows; None: memguard's own refusal, the run may go on.
    megatron_fails_later: str | None = None

    def __init__(self, *args: object):
        if len(args) == 1 and isinstance(args[0], str):
            args = (one_line(args[0]),)
        super().__init__(*args)


class ConfigError(MemguardError):
    """A setting breaks a rule that Megatron (or memguard) enforces.

    ``key`` is the flag or key path as the user wrote it (``--tensor-model-parallel-size``,
    ``model.tensor_model_parallel_size``); ``rule`` says what must hold; ``fix`` optionally
    suggests a change. ``fails_later`` says where Megatron stops on it although validate_args lets it
    through (model build, first forward step), for the hook's message; it does not change the text.
    """

    def __init__(self, key: str, rule: str, fix: str | None = None, *, fails_later: str | None = None):
        self.megatron_fails_later = fails_later
        self.key = one_line(key)
        self.rule = one_line(rule)
        self.fix = one_line(fix) if fix else fix
        msg = f"{self.key}: {self.rule}" if key else self.rule
        if fix:
            msg += f" ({self.fix})"
        super().__init__(msg)


class BadValueError(ConfigError):
    """A value memguard cannot compute with: not a number where one is needed, not finite, not an
    integer, or beyond memguard's bounds (numbers.py). The input cannot be read, rather than a layout
    that breaks one of Megatron's rules."""


class ConfigErrors(MemguardError):
    """Several ConfigErrors found at once (the validator reports all of them)."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = list(errors)
        super().__init__("; ".join(str(e) for e in self.errors))

    @property
    def megatron_fails_later(self) -> str | None:  # type: ignore[override]
        """The first of the errors Megatron stops on later (one is enough to stop the run)."""
        return next((e.megatron_fails_later for e in self.errors if e.megatron_fails_later), None)


class NotModelledError(MemguardError):
    """A setting changes memory in a way memguard does not model yet: refuse rather than guess."""

    def __init__(self, key: str, what: str, fix: str | None = None):
        self.key = key
        self.what = what
        self.fix = fix
        super().__init__(f"{key}: {what} is not modelled yet; memguard will not guess its memory"
                         + (f" ({fix})" if fix else ""))


class ReaderError(MemguardError):
    """An input file or command line could not be read (syntax, unknown format, missing value)."""
