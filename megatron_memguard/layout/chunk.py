"""One model chunk on one pipeline rank: defined next to the partitioning (``megatron_memguard.partition``),
which also gives it the kinds of its layers; re-exported here for the layout's readers."""
from __future__ import annotations

from ..partition import Chunk

__all__ = ["Chunk"]
