"""Wall time of a cold ``memguard`` process (new interpreter, as a user runs it), shared by the speed benchmarks."""
from __future__ import annotations

import os
import subprocess
import time
from typing import Sequence


def cold_process_seconds(cmd: Sequence[str], runs: int, cwd: str) -> list[float]:
    """Run ``cmd`` once to let the interpreter write its .pyc files, then ``runs`` times timed; a failing run
    raises (its time would mean nothing)."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run(cmd, capture_output=True, env=env, cwd=cwd, check=True)
    walls = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(cmd, capture_output=True, env=env, cwd=cwd, check=True)
        walls.append(time.perf_counter() - t)
    return walls
