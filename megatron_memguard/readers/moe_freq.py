"""``--moe-layer-freq``: which decoder layers are mixture-of-experts layers, read as Megatron reads it.

Megatron's ``moe_freq_type`` (``megatron/training/arguments.py``, 0.16.1 and 0.19.2) takes an int ``N``
(layer ``i``, 0-based, is MoE iff ``i % N == 0``), the same int as text, or text holding ``[`` that it
``eval``s after checking that only ``, digits [ ] ( ) + *`` occur in it (``"([0]*3+[1]*58)"``: three
dense layers, then 58 MoE layers). memguard never calls ``eval``: the expression is walked as a tree of
list literals, ints, ``+`` and ``*`` with a cap on the list length, so a hostile ``[1]*10**12`` or a
deeply nested expression is an error naming the flag, not an exhausted machine.
"""
from __future__ import annotations

import ast
import re
from typing import Any, Union

from ..errors import ConfigError
from ..numbers import shown

# Megatron's own character check (_eval_pattern): anything else is a ValueError there.
_ALLOWED = re.compile(r"[^,\d\[\]\(\)\+\*]")
# No model has more layers than this; a longer list is a typo or an attack.
MAX_PATTERN_LENGTH = 100_000
MAX_TEXT = 20_000

LayerFreq = Union[int, list]


def parse_moe_layer_freq(value: Any, key: str = "--moe-layer-freq") -> LayerFreq:
    """An int, or a list of 0/1 per layer (1 = MoE), from what a flag or config file holds.

    Lists and tuples from YAML/JSON configs are taken as the per-layer pattern they already are."""
    if isinstance(value, bool):
        raise ConfigError(key, f"expects an int or a list expression such as ([0]*3+[1]*58), got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)):
        return _check_pattern([_element(v, key) for v in value], key)
    text = str(value).strip()
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(key, f"expects an int or a list expression such as ([0]*3+[1]*58), got {shown(text)}") from None
    if len(text) > MAX_TEXT:
        raise ConfigError(key, f"the list expression is {len(text)} characters long (at most {MAX_TEXT})")
    if _ALLOWED.search(text):
        # Megatron: "Invalid pattern" (spaces are not allowed either)
        raise ConfigError(key, f"may hold only digits , [ ] ( ) + * (Megatron's rule), got {shown(text)}")
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ConfigError(key, f"is not a valid list expression: {shown(text)}") from None
    try:
        result = _evaluate(tree, key)
    except RecursionError:
        raise ConfigError(key, f"the list expression nests too deeply: {shown(text)}") from None
    if not isinstance(result, list):
        # gpt_layer_specs accepts an int or a list only ("Invalid moe_layer_freq")
        raise ConfigError(key, f"the expression must give a list of 0/1 per layer, got {shown(text)}")
    return _check_pattern(result, key)


def _element(v: Any, key: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        try:
            v = int(str(v).strip())
        except ValueError:
            raise ConfigError(key, f"the layer pattern holds {shown(v)}; each entry is 0 (dense) or 1 (MoE)") from None
    return v


def _check_pattern(pattern: list, key: str) -> list:
    if not pattern:
        raise ConfigError(key, "the layer pattern is empty; give one 0/1 entry per layer")
    bad = next((v for v in pattern if v not in (0, 1) or isinstance(v, bool)), None)
    if bad is not None:
        # get_gpt_decoder_layer_specs raises for anything but 0 (dense) and 1 (MoE)
        raise ConfigError(key, f"the layer pattern holds {shown(bad)}; each entry is 0 (dense) or 1 (MoE)")
    return list(pattern)


def _evaluate(node: ast.AST, key: str) -> Any:
    """Python's semantics for the few node kinds the allowed characters can spell."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        if node.value > MAX_PATTERN_LENGTH:
            raise ConfigError(key, f"the layer pattern holds {shown(node.value)}, beyond any layer count")
        return node.value
    if isinstance(node, ast.List):
        items = [_evaluate(e, key) for e in node.elts]
        if any(isinstance(i, (list, tuple)) for i in items):
            raise ConfigError(key, "the layer pattern must be a flat list of 0/1 (a list inside a list)")
        return _capped(items, key)
    if isinstance(node, ast.Tuple):
        return tuple(_evaluate(e, key) for e in node.elts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        a, b = _evaluate(node.left, key), _evaluate(node.right, key)
        if isinstance(node.op, ast.Add):
            if type(a) is not type(b):
                raise ConfigError(key, "the list expression adds a list and a number")
            return _capped(a + b, key) if isinstance(a, list) else _small(a + b, key)
        if isinstance(a, int) and isinstance(b, int):
            return _small(a * b, key)
        seq, times = (a, b) if isinstance(b, int) else (b, a)
        if not isinstance(times, int) or not isinstance(seq, (list, tuple)):
            raise ConfigError(key, "the list expression multiplies two lists")
        if len(seq) * max(times, 0) > MAX_PATTERN_LENGTH:
            raise ConfigError(key, f"the layer pattern would be longer than {MAX_PATTERN_LENGTH:,} layers")
        return seq * times
    raise ConfigError(key, "is not a list expression of 0/1, + and *")


def _capped(items: Any, key: str) -> Any:
    if len(items) > MAX_PATTERN_LENGTH:
        raise ConfigError(key, f"the layer pattern would be longer than {MAX_PATTERN_LENGTH:,} layers")
    return items


def _small(n: int, key: str) -> int:
    if abs(n) > MAX_PATTERN_LENGTH:
        raise ConfigError(key, f"the layer pattern holds {shown(n)}, beyond any layer count")
    return n


def moe_layers(freq: LayerFreq, num_layers: int) -> list[bool]:
    """Whether each of the ``num_layers`` decoder layers (0-based, global) is an MoE layer, as
    megatron-core's ``get_gpt_decoder_layer_specs`` decides it: ``i % N == 0`` for an int, the list
    entry for a pattern (its length must be ``num_layers``: resolve checks that against the flag)."""
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"moe_layer_freq must be at least 1, got {freq}")
        return [i % freq == 0 for i in range(num_layers)]
    return [v == 1 for v in freq]
