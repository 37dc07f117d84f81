"""memguard's own failures during training: counted, reported once per process, never raised.

Used by the runtime monitor, the Megatron hook and the Bridge / Lightning callbacks alike, so that a
bug in memguard costs one line of output and never a training run.
"""
from __future__ import annotations

import sys
import traceback
from typing import Callable


class ErrorReporter:
    """Call with (where, exception): counts it and prints the first one."""

    def __init__(self, emit_error: Callable[[str], None] | None = None, prefix: str = "[memguard]"):
        self.emit_error = emit_error or (lambda s: print(s, file=sys.stderr, flush=True))
        self.prefix = prefix
        self.errors = 0
        self.logged = False

    def __call__(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        if self.logged:
            return
        self.logged = True
        try:
            text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            self.emit_error(f"{self.prefix} internal error in {where} ({text}); training continues without it, "
                            "further memguard errors are counted silently")
        except Exception:
            pass
