"""Bash's ``$(( ... ))`` arithmetic on the integers of a launch script (``WORLD_SIZE=$((GPUS * NODES))``).

bash(1), "ARITHMETIC EVALUATION": fixed-width signed 64-bit integers with C's operators and precedence; a variable
name stands for its value read as a number, an unset or empty one for 0. memguard evaluates the integer operators
(``+ - * / % **``, shifts, comparisons, bitwise and logical ones, unary ``- + ! ~``, parentheses); anything else
(assignment, ``++``, ``?:``, ``,``, ``base#digits``) raises ArithmeticUnfollowed, and the caller keeps the text as
written. Results wrap as bash's do, so ``$((2**64))`` is 0, and no input makes a number of more than 64 bits.
"""
from __future__ import annotations

import re
from typing import Callable, Mapping

_TOKEN = re.compile(r"\s*(?:(0[xX][0-9a-fA-F]+|\d+)|([A-Za-z_][A-Za-z0-9_]*)|(\*\*|<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%()<>!~&|^]))")
_BITS = 64
MAX_DEPTH = 64   # nested parentheses / unary operators (a script writes a few)


class ArithmeticUnfollowed(ValueError):
    """An expression memguard does not evaluate (or one bash refuses: division by zero, a negative exponent)."""


def _wrap(n: int) -> int:
    n &= (1 << _BITS) - 1
    return n - (1 << _BITS) if n >> (_BITS - 1) else n


# binary operators by precedence, lowest first (bash(1): the C operators)
_LEVELS: list[dict[str, Callable[[int, int], int]]] = [
    {"||": lambda a, b: int(bool(a) or bool(b))},
    {"&&": lambda a, b: int(bool(a) and bool(b))},
    {"|": lambda a, b: a | b},
    {"^": lambda a, b: a ^ b},
    {"&": lambda a, b: a & b},
    {"==": lambda a, b: int(a == b), "!=": lambda a, b: int(a != b)},
    {"<": lambda a, b: int(a < b), ">": lambda a, b: int(a > b), "<=": lambda a, b: int(a <= b),
     ">=": lambda a, b: int(a >= b)},
    {"<<": lambda a, b: a << (b & 63), ">>": lambda a, b: a >> (b & 63)},
    {"+": lambda a, b: a + b, "-": lambda a, b: a - b},
    {"*": lambda a, b: a * b, "/": lambda a, b: _div(a, b), "%": lambda a, b: _mod(a, b)},
]

_DECIMAL = re.compile(r"\s*([1-9][0-9]{0,17}|0)\s*\Z")
_DOLLAR_NAME = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_LEVEL_OF = {op: k for k, ops in enumerate(_LEVELS) for op in ops}
_BLANK_END = re.compile(r"\s*\Z")


def _div(a: int, b: int) -> int:
    if b == 0:
        raise ArithmeticUnfollowed("division by 0")
    q = abs(a) // abs(b)      # C truncates toward zero
    return q if (a < 0) == (b < 0) else -q


def _mod(a: int, b: int) -> int:
    return a - _div(a, b) * b


def evaluate(expr: str, vars: Mapping[str, object]) -> int:
    """The value of ``expr`` (the text between ``$((`` and ``))``, ``$NAME`` already expanded or not)."""
    m = _DECIMAL.match(expr)
    if m:                                 # $((8)): a decimal number below 2**63 is its own value (no wrap, no octal)
        return int(m.group(1))
    toks: list[str] = []
    i = 0
    # $NAME and ${NAME} inside $(( )) are NAME; other $ forms ($1, $(cmd)) are not evaluated
    text = _DOLLAR_NAME.sub(lambda m: m.group(1) or m.group(2), expr) if "$" in expr else expr
    while i < len(text):
        if _BLANK_END.match(text, i):     # (not text[i:].strip(): a copy of the rest per token, 14 s for 900 kB)
            break
        m = _TOKEN.match(text, i)
        if not m or m.end() == i:
            raise ArithmeticUnfollowed(f"cannot read {text[i:i + 20]!r}")
        toks.append(m.group(1) or m.group(2) or m.group(3))
        i = m.end()
        if len(toks) > 10_000:
            raise ArithmeticUnfollowed("more than 10,000 terms")
    pos = 0

    def peek() -> str | None:
        return toks[pos] if pos < len(toks) else None

    def take() -> str:
        nonlocal pos
        pos += 1
        return toks[pos - 1]

    def unary(depth: int) -> int:
        if depth > MAX_DEPTH:
            raise ArithmeticUnfollowed(f"nested deeper than {MAX_DEPTH} levels")
        t = peek()
        if t in ("-", "+", "!", "~"):
            take()
            v = unary(depth + 1)
            return _wrap({"-": -v, "+": v, "!": int(not v), "~": ~v}[t])
        return power(depth)

    def power(depth: int) -> int:
        base = atom(depth)
        if peek() == "**":       # right-associative
            take()
            exp = unary(depth + 1)
            if exp < 0:
                raise ArithmeticUnfollowed("exponent less than 0")
            return _wrap(pow(base, exp, 1 << _BITS))
        return base

    def atom(depth: int) -> int:
        t = peek()
        if t is None:
            raise ArithmeticUnfollowed("an operand is missing")
        take()
        if t == "(":
            v = binary(0, depth + 1)
            if peek() != ")":
                raise ArithmeticUnfollowed("a ')' is missing")
            take()
            return v
        if t[0].isdigit():
            if len(t) > 1 and t[0] == "0" and t[1] not in "xX" and not set(t) <= set("01234567"):
                raise ArithmeticUnfollowed(f"{t} is not an octal number")
            return _wrap(int(t, 16) if t[:2].lower() == "0x" else int(t, 8) if t[0] == "0" and len(t) > 1 else int(t))
        if t[0].isalpha() or t[0] == "_":
            value = vars.get(t)
            if isinstance(value, list):
                value = value[0] if value else ""
            s = "" if value is None else str(value).strip()
            if not s:
                return 0
            if not re.fullmatch(r"[-+]?\d{1,19}", s):
                raise ArithmeticUnfollowed(f"the variable {t} holds {s[:20]!r}, not an integer")
            return _wrap(int(s))
        raise ArithmeticUnfollowed(f"unexpected {t!r}")

    def binary(level: int, depth: int) -> int:
        """The operators of ``level`` and above, left-associative (precedence climbing: one call per operand, not
        one per level, ten per number)."""
        if depth > MAX_DEPTH:
            raise ArithmeticUnfollowed(f"nested deeper than {MAX_DEPTH} levels")
        v = unary(depth)
        while True:
            t = peek()
            at = _LEVEL_OF.get(t) if t is not None else None
            if at is None or at < level:
                return v
            take()
            v = _wrap(_LEVELS[at][t](v, binary(at + 1, depth)))

    if not toks:
        return 0       # $(( )) is 0
    value = binary(0, 0)
    if pos != len(toks):
        raise ArithmeticUnfollowed(f"unexpected {toks[pos]!r}")
    return value
