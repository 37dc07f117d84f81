"""One model chunk on one pipeline rank (what the partitioning hands the estimator)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    """One model chunk on one pipeline rank: a contiguous run of layers (a VPP stage when interleaved)."""

    pp_rank: int
    vpp_rank: int
    first_layer: int        # global index of its first transformer layer
    num_layers: int
    has_embedding: bool     # word (and position) embedding: first stage, first chunk
    has_output: bool        # final norm, output layer and loss: last stage, last chunk
    has_tied_output_copy: bool  # last stage holds a copy of the tied embedding (PP > 1, tied)
    vpp_size: int = 1

    @property
    def label(self) -> str:
        return f"pp{self.pp_rank}" + (f".v{self.vpp_rank}" if self.vpp_size > 1 else "")
