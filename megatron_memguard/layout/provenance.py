"""Where a layout comes from: the Megatron version its rules follow, the tokenizer, the environment."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Provenance:
    megatron_version: str
    tokenizer_type: str | None = None
    env: tuple[tuple[str, str], ...] = ()   # the memory-relevant environment variables, sorted

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)
