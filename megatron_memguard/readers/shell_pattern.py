"""Bash's pattern operators on a value: ``${X#p}`` / ``${X##p}`` / ``${X%p}`` / ``${X%%p}``, ``${X/p/r}`` /
``${X//p/r}`` / ``${X/#p/r}`` / ``${X/%p/r}`` and the case operators ``${X^}`` / ``${X^^}`` / ``${X,}`` / ``${X,,}`` /
``${X~}`` / ``${X~~}`` (bash(1), "Parameter Expansion" and "Pattern Matching"; GNU bash 5.2).

A pattern is bash's glob without extglob (``*``, ``?``, ``[...]`` with ``!`` / ``^`` and ``[:class:]``), given here as
a list of pieces: ``STAR`` or a one-character matcher. It is matched segment by segment (the fixed pieces between two
stars), not by a backtracking regular expression: ``*a*a*a*b`` on 100,000 ``a`` would take a backtracking engine hours.
The middle segments go to their leftmost place and the last one to its rightmost (longest match) or leftmost (shortest)
place, which is bash's answer; a failed placement fails at every later start too, so a scan stops there. A step
budget bounds the rest (ValueError past it).
"""
from __future__ import annotations

import re
from typing import Callable, Sequence

STAR = "*"
MAX_STEPS = 2_000_000     # characters compared by one expansion (a launch script's values are short)
MAX_OUTPUT = 16 * 2**20   # characters one substitution makes (shell.MAX_EXPANDED: ${B//?/$B} of 100,000 is 10**10)

Piece = object            # STAR or a one-character matcher (a compiled regex of one character)
_CLASSES = {"alpha": "a-zA-Z", "digit": "0-9", "alnum": "a-zA-Z0-9", "upper": "A-Z", "lower": "a-z",
            "space": r" \t\n\r\f\v", "blank": r" \t", "punct": re.escape("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"),
            "xdigit": "0-9A-Fa-f", "word": "a-zA-Z0-9_", "cntrl": r"\x00-\x1f\x7f", "print": r"\x20-\x7e",
            "graph": r"\x21-\x7e"}


def _char(regex: str):
    return re.compile(regex, re.S)


def literal(c: str):
    return _char(re.escape(c))


ANY = _char(".")


def bracket(text: str, i: int) -> tuple[object, int] | None:
    """The ``[...]`` expression at ``text[i] == '['``: (matcher, index after it), None when it is not closed (then
    ``[`` is an ordinary character, as in bash)."""
    j = i + 1
    negate = j < len(text) and text[j] in "!^"
    if negate:
        j += 1
    parts: list[str] = []
    first = True
    while j < len(text):
        c = text[j]
        if c == "]" and not first:
            body = "".join(parts) or r"\x00-\x00"
            return _char(f"[{'^' if negate else ''}{body}]"), j + 1
        first = False
        if c == "[" and text.startswith("[:", j):
            end = text.find(":]", j + 2)
            if end > 0 and text[j + 2:end] in _CLASSES:
                parts.append(_CLASSES[text[j + 2:end]])
                j = end + 2
                continue
        if c == "\\" and j + 1 < len(text):
            parts.append(re.escape(text[j + 1]))
            j += 2
            continue
        if c == "-" and parts and j + 1 < len(text) and text[j + 1] != "]":
            parts.append("-")
            j += 1
            continue
        parts.append(re.escape(c))
        j += 1
    return None


def glob_pieces(text: str) -> list[Piece]:
    """The pieces of an unquoted glob (the value of an unquoted expansion inside a pattern)."""
    out: list[Piece] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "*":
            if not out or out[-1] is not STAR:
                out.append(STAR)
            i += 1
        elif c == "?":
            out.append(ANY)
            i += 1
        elif c == "[" and bracket(text, i) is not None:
            m, i = bracket(text, i)   # type: ignore[misc]
            out.append(m)
        elif c == "\\" and i + 1 < len(text):
            out.append(literal(text[i + 1]))
            i += 2
        else:
            out.append(literal(c))
            i += 1
    return out


class _Budget:
    def __init__(self) -> None:
        self.steps = 0

    def spend(self, n: int) -> None:
        self.steps += n
        if self.steps > MAX_STEPS:
            raise ValueError(f"a pattern expansion compares more than {MAX_STEPS:,} characters; memguard stops there")


def _segments(pieces: Sequence[Piece]) -> tuple[list[list], bool]:
    """The fixed segments between stars, and whether there is a star at all."""
    segs: list[list] = [[]]
    for p in pieces:
        if p is STAR:
            segs.append([])
        else:
            segs[-1].append(p)
    return segs, len(segs) > 1


def _at(s: str, i: int, seg: list, budget: _Budget) -> bool:
    if i + len(seg) > len(s):
        return False
    budget.spend(len(seg))
    return all(m.match(s, i + k) for k, m in enumerate(seg))


def _find(s: str, start: int, stop: int, seg: list, budget: _Budget, last: bool) -> int | None:
    """The first (or ``last``) place >= start where ``seg`` matches and ends by ``stop``."""
    rng = range(stop - len(seg), start - 1, -1) if last else range(start, stop - len(seg) + 1)
    for k in rng:
        if _at(s, k, seg, budget):
            return k
    return None


_FAILED_LATER = -1


def match_at(s: str, i: int, pieces: Sequence[Piece], longest: bool, budget: _Budget, to_end: bool = False) -> int:
    """The end of the longest (or shortest) match of the pattern starting at ``s[i]`` (``to_end``: the one ending at the
    end of ``s``); None-like: -2 when the first segment does not match here, _FAILED_LATER when it does but the rest
    cannot be placed (then no later start matches either)."""
    segs, starred = _segments(pieces)
    n = len(s)
    if not _at(s, i, segs[0], budget):
        return -2
    pos = i + len(segs[0])
    if not starred:
        return pos if not to_end or pos == n else -2
    for seg in segs[1:-1]:
        k = _find(s, pos, n, seg, budget, last=False)
        if k is None:
            return _FAILED_LATER
        pos = k + len(seg)
    tail = segs[-1]
    if to_end or longest:
        k = n - len(tail) if to_end else _find(s, pos, n, tail, budget, last=True)
        if k is None or k < pos or not _at(s, k, tail, budget):
            return _FAILED_LATER
        return k + len(tail)
    k = _find(s, pos, n, tail, budget, last=False)
    return _FAILED_LATER if k is None else k + len(tail)


def _reversed(pieces: Sequence[Piece]) -> list[Piece]:
    return list(reversed(pieces))


def remove(s: str, pieces: Sequence[Piece], op: str) -> str:
    """``${X#p}`` (shortest prefix), ``##`` (longest), ``%`` (shortest suffix), ``%%`` (longest)."""
    budget = _Budget()
    longest = len(op) == 2
    if op[0] == "#":
        end = match_at(s, 0, pieces, longest, budget)
        return s[end:] if end >= 0 else s
    r = s[::-1]           # a suffix of s is a prefix of s reversed, matched by the pattern reversed
    end = match_at(r, 0, _reversed(pieces), longest, budget)
    return s[:len(s) - end] if end >= 0 else s


def replace(s: str, pieces: Sequence[Piece], rep: Callable[[str], str], op: str) -> str:
    """``${X/p/r}`` (first match), ``//`` (every match), ``/#`` (at the start), ``/%`` (at the end); every match is the
    longest at its place. ``rep`` gives the replacement of a matched text (bash 5.2's ``&``)."""
    budget = _Budget()
    n = len(s)
    if not pieces:
        if op == "/#":
            return rep("") + s
        if op == "/%":
            return s + rep("")
        return s                     # an empty pattern replaces nothing
    if op == "/#":
        end = match_at(s, 0, pieces, True, budget)
        return rep(s[:end]) + s[end:] if end >= 0 else s
    if op == "/%":
        r = s[::-1]
        end = match_at(r, 0, _reversed(pieces), True, budget)     # the longest suffix
        return s[:n - end] + rep(s[n - end:]) if end >= 0 else s
    out: list[str] = []
    i = done = size = 0
    while i < n:
        end = match_at(s, i, pieces, True, budget)
        if end == _FAILED_LATER:
            break
        if end < 0:
            i += 1
            continue
        out.append(s[done:i])
        out.append(rep(s[i:end]))
        size += len(out[-1]) + len(out[-2])
        if size > MAX_OUTPUT:
            raise ValueError(f"a pattern substitution makes more than {MAX_OUTPUT // 2**20} MiB; memguard stops there")
        done = i = end if end > i else i + 1
        if op == "/":
            break
    out.append(s[done:])
    return "".join(out)


def _toggle(c: str) -> str:
    return c.lower() if c.isupper() else c.upper()


def _one(f: Callable[[str], str], c: str) -> str:
    d = f(c)
    return d if len(d) == 1 else c      # (bash maps one character to one: 'ß' stays)


def case(s: str, pieces: Sequence[Piece] | None, op: str) -> str:
    """``^`` / ``^^`` upper, ``,`` / ``,,`` lower, ``~`` / ``~~`` toggle: the first character or every one, those that
    match the pattern (each character against it; no pattern: any)."""
    f = {"^": str.upper, ",": str.lower, "~": _toggle}[op[0]]
    budget = _Budget()

    def hit(c: str) -> bool:
        return not pieces or match_at(c, 0, pieces, True, budget, to_end=True) == 1

    if len(op) == 1:
        return _one(f, s[0]) + s[1:] if s and hit(s[0]) else s
    budget.spend(len(s))
    return "".join(_one(f, c) if hit(c) else c for c in s)
