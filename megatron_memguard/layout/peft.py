"""The PEFT part of a layout: LoRA / DoRA adapters over a frozen base model, as Megatron-Bridge builds them.

Bridge (0.6.2 megatron/bridge/peft/lora.py, dora.py) freezes every base parameter, then wraps each linear
whose name matches ``target_modules`` with an adapter: ``linear_in`` [dim, in] and ``linear_out`` [out, dim]
(LoRA A and B), scaled by alpha / dim, with dropout before (``pre``) or after (``post``) them. DoRA adds a
trainable magnitude vector of the wrapped weight's rows. NeMo 1 (``model.peft``) builds the same adapters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# the linears Bridge's LoRA / DoRA wrap by default (lora.py / dora.py target_modules)
DEFAULT_TARGETS: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# column-parallel targets (the adapter's input is the norm output, not TP-split) vs row-parallel ones
COLUMN_TARGETS = frozenset({"linear_qkv", "linear_fc1"})
ROW_TARGETS = frozenset({"linear_proj", "linear_fc2"})
SCHEME_NAMES = {"lora": "LoRA", "dora": "DoRA"}


@dataclass(frozen=True)
class PeftSpec:
    scheme: str                         # "lora" or "dora"
    dim: int                            # the adapters' rank r
    alpha: float                        # the output is scaled by alpha / dim (no memory effect)
    dropout: float                      # adapter dropout probability
    dropout_position: str               # "pre" (on the adapter input) or "post" (on its output)
    target_modules: tuple[str, ...]     # the wrapped linears of every decoder layer
    # "fused": one adapter per wrapped linear (Bridge, NeMo 1's default 'nemo' variant); "canonical": NeMo 1's
    # unfused adapters, one each for q, k, v of linear_qkv and gate, up of linear_fc1 (estimator/peft.py)
    variant: str = "fused"
    # NeMo 1's layer_selection: the 1-based global layer numbers (TransformerLayer.layer_number) that get adapters;
    # None: every layer
    layers: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"scheme": self.scheme, "dim": self.dim, "alpha": self.alpha, "dropout": self.dropout,
                             "dropout_position": self.dropout_position, "target_modules": list(self.target_modules)}
        if self.variant != "fused":     # (documents of the fused adapters on every layer read as before)
            d["variant"] = self.variant
        if self.layers is not None:
            d["layers"] = list(self.layers)
        return d

    def adapted_layers(self, first_layer: int, num_layers: int) -> int:
        """How many of the global layers ``first_layer .. first_layer + num_layers - 1`` (0-based) get adapters."""
        if self.layers is None:
            return num_layers
        return sum(1 for n in self.layers if first_layer < n <= first_layer + num_layers)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PeftSpec":
        return cls(scheme=str(d["scheme"]), dim=int(d["dim"]), alpha=float(d["alpha"]), dropout=float(d["dropout"]),
                   dropout_position=str(d.get("dropout_position", "pre")),
                   target_modules=tuple(d.get("target_modules") or DEFAULT_TARGETS),
                   variant=str(d.get("variant", "fused")),
                   layers=tuple(int(n) for n in d["layers"]) if d.get("layers") is not None else None)
