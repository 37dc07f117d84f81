"""The files a report or a calibration reads: the files given, and in each directory those a chooser picks."""
from __future__ import annotations

import os
from typing import Callable, Sequence

from ..errors import ReaderError


def collect(paths: Sequence[str], in_dir: Callable[[str], list[str]], empty: Callable[[str], str],
            missing: str = "no such file or directory") -> list[str]:
    """Files of ``paths`` in order, each once: a file as given, a directory's ``in_dir(dir)`` (ReaderError
    ``empty(dir)`` when it finds none); a path that does not exist is a ReaderError saying ``missing``."""
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            found = in_dir(p)
            if not found:
                raise ReaderError(empty(p))
            files += found
        elif os.path.isfile(p):
            files.append(p)
        elif os.path.exists(p):
            raise ReaderError(f"{p}: not a directory or a file")
        else:
            raise ReaderError(f"{p}: {missing}")
    seen: set[str] = set()
    unique = []
    for f in files:
        real = os.path.realpath(f)
        if real not in seen:
            seen.add(real)
            unique.append(f)
    return unique
