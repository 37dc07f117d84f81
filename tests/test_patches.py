"""patches/: the one line applies to pretrain_gpt.py of either era and lands at module level, after the
copyright comment and the module docstring (so ``__doc__`` stays the docstring)."""
import ast
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = "import megatron_memguard.megatron"

# The head of pretrain_gpt.py in each era (megatron.md section 6.1: the imports, then __main__).
LEGACY = '''# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.
"""Pretrain and SFT GPT."""

from functools import partial

from megatron.core.enums import ModelType
from megatron.training import get_args, get_timers, inprocess_restart, pretrain, print_rank_0

if __name__ == "__main__":
    pretrain(None, partial(print), ModelType.encoder_or_decoder, None, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
'''
# core_v0.14: the same two header lines with the older docstring.
V014 = '''# Copyright (c) 2023, NVIDIA CORPORATION.  All rights reserved.
"""Pretrain GPT."""

import datetime
import os
import torch

from functools import partial

if __name__ == "__main__":
    pretrain(None, partial(print))
'''
CONTAINER = '''# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.
"""Pretrain and SFT GPT."""

from megatron.core.enums import ModelType
from megatron.training import get_args, inprocess_restart, pretrain, print_rank_0, set_startup_timestamps
from megatron.training.arguments import parse_and_validate_args

if __name__ == "__main__":
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
'''


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("patch, source", [("pretrain_gpt.legacy.patch", LEGACY),
                                           ("pretrain_gpt.legacy.patch", V014),
                                           ("pretrain_gpt.config-container.patch", CONTAINER)])
def test_patch_applies_and_imports_at_module_level(tmp_path, patch, source):
    (tmp_path / "pretrain_gpt.py").write_text(source)
    subprocess.run(["git", "apply", "--unidiff-zero", os.path.join(ROOT, "patches", patch)], cwd=tmp_path, check=True)
    text = (tmp_path / "pretrain_gpt.py").read_text()
    assert text.count(LINE) == 1
    tree = ast.parse(text)
    before = ast.parse(source)
    assert ast.get_docstring(tree) == ast.get_docstring(before) and ast.get_docstring(tree).endswith("GPT.")
    assert text.splitlines()[0] == source.splitlines()[0].rstrip() and text.startswith("# Copyright")
    first = tree.body[1]   # right after the docstring, before every other statement
    assert isinstance(first, ast.Import) and first.names[0].name == "megatron_memguard.megatron"
    main = next(n for n in tree.body if isinstance(n, ast.If))
    assert first.lineno < main.lineno  # imported before __main__ runs
    # the rest of the file is unchanged
    assert text.replace(text.splitlines()[2] + "\n", "", 1) == source
