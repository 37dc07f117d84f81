"""Numbers from users, read in one place: finite, integral where Megatron wants an int, and within a
range that can describe a real training job; and any value shown back in an error, cut to a readable length.

Megatron's argparse takes ``type=int`` and ``type=float`` values of any size; memguard computes with
them, so it refuses what no job can have: ``inf`` / ``nan`` / ``1e400`` as a count, a layer count that
no model comes near, a 5000-digit batch size. Each bound names its reason (docs/assumptions.md,
"Bounds on sizes"). The rule of every refusal names the bound, the key is the user's spelling.
"""
from __future__ import annotations

import math
import re
from typing import Any

from .errors import BadValueError

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# How much of a value an error shows: enough to recognise it, never a 3 MB line.
SHOWN_CHARS = 60
# Longer digit strings are not converted at all (Python refuses > 4300 digits, and no bound needs more).
_MAX_INT_DIGITS = 40

# Upper bounds of the Megatron settings (argument ``dest`` names) memguard computes with. Every other
# integer setting it reads is bounded by INT32_MAX: a tensor dimension, a token or sample count per
# step beyond 2**31 - 1 describes no job that fits on GPUs (a 2**31-wide hidden size is 2**62 bytes per
# bf16 weight matrix), and memguard's arithmetic stays exact in floats below it.
BOUNDS: dict[str, tuple[int, str]] = {
    # DeepNet (Wang et al. 2022, arXiv 2203.00555) trained the deepest published Transformer, 1,000
    # layers; memguard lists each layer's parameters, so its work grows with the layer count.
    "num_layers": (10_000, "10 x the deepest published Transformer (DeepNet, 1,000 layers)"),
    "decoder_num_layers": (10_000, "10 x the deepest published Transformer (DeepNet, 1,000 layers)"),
    "encoder_num_layers": (10_000, "10 x the deepest published Transformer (DeepNet, 1,000 layers)"),
    # The pipeline schedule is simulated rank by rank (work grows with PP^2); published runs use PP <= 64
    # (Narayanan et al. 2021, arXiv 2104.04473, Table 1).
    "pipeline_model_parallel_size": (1_024, "16 x the largest published pipeline (PP 64, Narayanan et al. 2021)"),
    # memguard lists every local expert's parameters (DeepSeek-V3 routes over 256 experts).
    "num_experts": (65_536, "256 x the routed experts of DeepSeek-V3 (256)"),
    # The MTP block lives whole on the last stage and memguard lists each depth's parameters; DeepSeek-V3
    # trains one depth (arXiv 2412.19437, section 2.2).
    "mtp_num_layers": (100, "100 x DeepSeek-V3's one MTP depth; each depth is a whole layer on the last stage"),
    # The interleaved schedule is simulated over a few micro-batch groups (work grows with the group size).
    "microbatch_group_size_per_vp_stage": (65_536, "memguard simulates the interleaved schedule group by group"),
}
# The number of GPUs of one job (2**20 = 1,048,576): an order of magnitude above the largest clusters built.
MAX_WORLD_SIZE = 2**20
WORLD_SIZE_WHY = "10 x the largest GPU clusters built"


def upper_bound(dest: str) -> int:
    """The largest value memguard accepts for the Megatron setting ``dest``."""
    return BOUNDS.get(dest, (INT32_MAX, ""))[0]


def bound_reason(dest: str) -> str:
    return BOUNDS.get(dest, (INT32_MAX, ""))[1]


def python_scalar(value: Any) -> Any:
    """A NumPy scalar (``np.int64(16)``, ``np.float32``, ``np.bool_``, a 0-d array: what code that computes a
    setting leaves in Megatron's namespace or a config object) as the Python number it holds, also as the
    items of a list or tuple (one level); any other value as it is. Never imports NumPy."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        try:
            return value.item()
        except Exception:   # (a NumPy object the check below refuses by name)
            return value
    if isinstance(value, (list, tuple)) and any(type(v).__module__ == "numpy" for v in value):
        return type(value)(python_scalar(v) if type(v).__module__ == "numpy" else v for v in value)
    return value


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``value`` as an error shows it: strings quoted, huge numbers in scientific notation, anything
    longer than ``limit`` cut with an ellipsis and its length (``'aaaa...aaaa' (3145728 characters)``)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        digits = _digits(value)
        if digits <= 20:
            return str(value)
        if digits < 300:
            return f"{float(value):.3e}"
        return f"a {digits}-digit number"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return cut(repr(value), limit, len(value))
    try:
        text = repr(value)
    except (ValueError, RecursionError):   # an int over Python's digit limit inside a list, a deep structure
        return f"a {type(value).__name__}"
    return cut(text, limit)


def cut(text: str, limit: int = SHOWN_CHARS, length: int | None = None) -> str:
    """``text`` if it has at most ``limit`` characters, else its ends around ``...`` and its length."""
    if len(text) <= limit:
        return text
    keep = max(8, (limit - 10) // 2)
    return f"{text[:keep]}...{text[-keep:]} ({len(text) if length is None else length} characters)"


def _digits(n: int) -> int:
    """Decimal digits of ``n`` without converting it to a string (Python refuses > 4300 digits)."""
    n = abs(n)
    if n < 10**18:
        return len(str(n))
    d = int(n.bit_length() * 0.30102999566398120)
    return d + (n >= 10**d)


_INT_TEXT = re.compile(r"[-+]?\d+")
_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?(inf|infinity|nan)", re.I)


def number_from_text(text: str) -> int | float | None:
    """The number a user wrote (``12``, ``1e3``, ``4.0``, ``inf``), None if it is not one. Integers too
    long to convert come back as ``inf`` with their sign (every bound refuses them)."""
    t = text.strip().replace("_", "") if len(text) < 10_000 else text.strip()
    if _INT_TEXT.fullmatch(t):
        if len(t.lstrip("+-")) > _MAX_INT_DIGITS:
            return -math.inf if t.startswith("-") else math.inf
        return int(t)
    if len(t) <= 400 and _FLOAT_TEXT.fullmatch(t):
        return float(t)
    return None


def to_int(value: Any, key: str, minimum: int | None = 1, maximum: int | None = INT32_MAX, why: str = "") -> int:
    """``value`` (an int, an integral float, or text of one) as an int in [minimum, maximum]; a
    BadValueError naming ``key`` and the rule otherwise. ``why``: the reason for ``maximum``."""
    n = integral(value, key)
    if maximum is None:
        maximum, why = INT64_MAX, why or "a 64-bit integer"
    if minimum is not None and n < minimum:
        raise BadValueError(key, f"must be >= {minimum}, got {shown(n)}")
    if maximum is not None and n > maximum:
        raise BadValueError(key, f"must be <= {maximum}" + (f" ({why})" if why else "") + f", got {_shown_orig(value, n)}")
    return n


def integral(value: Any, key: str) -> int:
    """``value`` (an int, an integral float, or text of one) as an exact int, unbounded; a number
    written out too large for a float (``1e400``, 5000 digits) comes back as +-(INT64_MAX + 1)."""
    num: Any = value
    if isinstance(value, str):
        num = number_from_text(value)
    if isinstance(num, bool) or not isinstance(num, (int, float)):
        raise BadValueError(key, f"must be an integer, got {shown(value)}")
    if isinstance(num, float):
        if math.isnan(num):
            raise BadValueError(key, f"must be an integer, got {shown(value)}")
        if math.isinf(num):
            if _is_big_literal(value):       # a number too large to hold: out of every range
                return INT64_MAX + 1 if num > 0 else -INT64_MAX - 2
            raise BadValueError(key, f"must be an integer, got {shown(value)}")
        if not num.is_integer():
            raise BadValueError(key, f"must be an integer, got {shown(value)}")
        return int(num)
    return num


def _is_big_literal(value: Any) -> bool:
    """A finite number written out that overflowed a float (``1e400``, 5000 digits), not ``inf``."""
    return isinstance(value, str) and not re.search(r"inf|nan", value, re.I)


def _shown_orig(value: Any, n: int) -> str:
    return shown(value) if isinstance(value, str) else shown(n)


def to_float(value: Any, key: str, minimum: float | None = None, maximum: float | None = None) -> float:
    """``value`` as a finite float in [minimum, maximum] (BadValueError naming ``key`` otherwise)."""
    num: Any = number_from_text(value) if isinstance(value, str) else value
    if isinstance(num, bool) or not isinstance(num, (int, float)):
        raise BadValueError(key, f"must be a number, got {shown(value)}")
    try:
        f = float(num)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise BadValueError(key, f"must be a finite number, got {shown(value)}")
    if minimum is not None and f < minimum:
        raise BadValueError(key, f"must be >= {minimum}, got {shown(value)}")
    if maximum is not None and f > maximum:
        raise BadValueError(key, f"must be <= {maximum}, got {shown(value)}")
    return f
