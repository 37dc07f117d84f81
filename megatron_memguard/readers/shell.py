"""Words of a shell command as bash makes them: quotes, parameter expansion, field splitting.

One pass over the command's text, as bash does it (bash(1), "EXPANSION"): ``$VAR``, ``${VAR}``,
``${VAR:-word}`` / ``${VAR-word}``, ``${VAR:+word}``, ``${VAR:=word}``, ``${ARR[@]}``, ``${ARR[*]}``,
``${ARR[n]}``, the pattern and case operators ``${VAR#pat}`` / ``${VAR%%pat}`` / ``${VAR/pat/rep}`` / ``${VAR//pat/rep}`` /
``${VAR^^}`` / ``${VAR,,}`` (``shell_pattern``) and the indirections ``${!VAR}`` / ``${!ARR[@]}`` / ``${!PREFIX*}`` are
replaced by their values, and a value is never scanned again: ``A='$A$A'`` holds
the four characters ``$A$A``, and ``A=$A$A`` doubles it once (a re-scanning expander grows it
exponentially). Single quotes keep everything; double quotes keep spaces and expand; an unquoted
value is split into words on whitespace (not in ``NAME=value`` assignments, as in bash). What memguard
cannot evaluate is kept as written: an unset ``$VAR`` (the reader reports it where it matters),
``$(command)`` and backquotes (bash runs a program there; ``words`` lists them so that the reader can name the line
where a flag memguard needs takes one), a ``$((arithmetic))`` it does not follow, and the rarer ``${VAR...}`` operators.

A script's text is cut first into bash's logical lines (continuations, comments, quotes and arrays
spanning lines, here-documents) and simple commands (``;`` ``&&`` ``|``, redirections dropped), and
its ``#SBATCH`` directives give the SLURM_* values the job will see (``launch_command`` uses these).
"""
from __future__ import annotations

import re
import shlex
from typing import Mapping, MutableMapping

from ..errors import ReaderError
from .shell_arith import ArithmeticUnfollowed, evaluate
from .shell_pattern import STAR, bracket, case, glob_pieces, literal, remove, replace

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\[[^\]]*\])?\+?=")
# ${NAME} and ${NAME<op>word} with a word of no quote, expansion, escape or brace: the braced reference most scripts
# write, read in one match (a line of 135,000 of them took a pass of the matching and the special forms each)
_SIMPLE_BRACED = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-+=])([^\\'\"`${}]*))?\}")
_BRACED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\[(@|\*|\d+)\])?(:?[-+=])?")
# ${#X}, ${#A[@]}, ${#}, ${@}, ${1}, and the slices ${X:1:2}, ${A[@]:0:4}, ${@:2} (an offset is an arithmetic expression;
# one starting with '-', '+' or '=' right after the colon is the default operator instead, as in bash)
_SPECIAL = re.compile(r"(#)?(@|\*|#|\d+|[A-Za-z_][A-Za-z0-9_]*)(\[(@|\*|\d+)\])?(?::(?![-+=?])([^:]*)(?::(.*))?)?")
MAX_NESTING = 32   # ${A:-${B:-...}} levels (scripts nest two or three)
MAX_EXPANDED = 16 * 2**20   # characters of one command after expansion (4 x issue 14's 4 MiB re-expansion case)
MAX_WORDS = 100_000   # words of one command after expansion (Megatron-LM's example scripts: a few hundred)
_DECLARATIONS = ("export", "declare", "local", "readonly", "typeset")
# ${X/p/r}, ${X#p}, ${X^^}, ${A[@]/p/r}, ${@#p}, ${!N}, ${!A[@]}, ${!PREFIX*} (bash(1), "Parameter Expansion")
_OPERATED = re.compile(r"(!)?(@|\*|\d+|[A-Za-z_][A-Za-z0-9_]*)(\[(@|\*|\d+)\])?(//|/#|/%|/|##|#|%%|%|\^\^|\^|,,|,|~~|~)?(.*)",
                       re.S)
_INDIRECT = re.compile(r"(@|\*|\d+|[A-Za-z_][A-Za-z0-9_]*)(?:\[(@|\*|\d+)\])?")
_AMP = object()   # bash 5.2's '&' in a replacement: the matched text (patsub_replacement, on by default)
_BLANK = " \t\n"
_PLAIN = re.compile(r"[^\s\\'\"$`#]+")

Vars = MutableMapping[str, object]


def words(text: str, vars: Vars, unknown: list[str] | None = None, kept: list[str] | None = None) -> list[str]:
    """The words of one simple command ``text`` after expansion and quote removal (``NAME=value``
    words included). Raises ValueError for an unterminated quote, as shlex does. ``unknown`` gets the
    ``$@`` / ``$*`` that stand for the script's own arguments (kept as written); ``kept`` the command substitutions
    and arithmetic expansions kept as written (each as it stands in the words)."""
    w = _Words(text, vars)
    out = w.run()
    if unknown is not None:
        unknown.extend(w.unknown)
    if kept is not None:
        kept.extend(w.kept)
    return out


def kept_construct(value: str) -> str | None:
    """The first ``$(...)`` / ``$((...))`` / backquoted text in ``value`` (as ``words`` keeps them), None without one."""
    i = min((k for k in (value.find("$("), value.find("`")) if k >= 0), default=-1)
    if i < 0:
        return None
    if value[i] == "`":
        end = value.find("`", i + 1)
        return value[i:end + 1] if end > 0 else value[i:]
    found: dict = {}
    _match_from(value, i + 1, "(", ")", found)
    end = found.get((value, i + 1))
    return value[i:end] if end else value[i:]


def expand_word(word: str, vars: Mapping[str, object]) -> str:
    """``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` in one word that a shell has split already (no
    quotes to remove, no splitting); unset variables stay as written. ValueError as ``words``."""
    w = _Words(word, dict(vars))
    out: list[str] = []
    i = 0
    while i < len(word):
        j = word.find("$", i)
        if j < 0:
            out.append(word[i:])
            break
        out.append(word[i:j])
        ref = w.reference(j)
        if ref is None:
            out.append("$")
            i = j + 1
            continue
        value, end = ref
        if isinstance(value, _Default):
            value = w.default_value(value)
        text = word[j:end] if value is _UNSET else value if isinstance(value, str) else " ".join(value)
        w.grow(len(text))
        out.append(text)
        i = end
    return "".join(out)


class _Words:
    def __init__(self, text: str, vars: Vars, quoted: bool = False, depth: int = 0, kept: list[str] | None = None):
        if depth > MAX_NESTING:
            raise ValueError(f"parameter expansions nested deeper than {MAX_NESTING} levels")
        self.text = text
        self.vars = vars
        self.quoted = quoted         # the text is the word of ${VAR:-word} inside double quotes
        self.depth = depth           # ${A:-${B:-...}} nesting
        self.matches: dict[tuple[str, int], int | None] = {}   # where each ( or { closes (_matching)
        self.size = 0                # characters of the expanded words so far
        self.words: list[str] = []
        self.cur: list[str] = []
        self.started = False         # a word is being built (possibly empty: "")
        self.assign_ok = True        # only assignments so far: NAME=value words are assignments
        self.in_assign = False       # the current word is an assignment (no field splitting)
        self.unknown: list[str] = []  # "$@" / "$*" of the script's own arguments (unknown to memguard)
        self.kept: list[str] = [] if kept is None else kept   # $(...), `...`, $((...)) kept as written

    # -- building words ----------------------------------------------------------------------------
    def _flush(self) -> None:
        if self.started:
            if len(self.words) >= MAX_WORDS:
                raise ValueError(f"the command has more than {MAX_WORDS:,} words")
            self.words.append("".join(self.cur))
        self.cur = []
        self.started = False
        self.in_assign = False

    def _begin(self, i: int) -> None:
        """A word starts at ``i``: is it an assignment (no splitting of its expansions)?"""
        if self.started:
            return
        first = self.words[0] if self.words else None
        if self.assign_ok and _ASSIGN_WORD.match(self.text, i):
            self.in_assign = True
        elif first in _DECLARATIONS and _ASSIGN_WORD.match(self.text, i):
            self.in_assign = True
        else:
            self.in_assign = False
            self.assign_ok = False

    def grow(self, n: int) -> None:
        """Count ``n`` more characters of expansion (A='$A$A' doubled 40 times: bash would fill the
        memory; memguard stops at MAX_EXPANDED)."""
        self.size += n
        if self.size > MAX_EXPANDED:
            raise ValueError(f"the command expands to more than {MAX_EXPANDED // 2**20} MiB")

    def _add(self, s: str) -> None:
        self.grow(len(s))
        self.cur.append(s)
        self.started = True

    def _fields(self, value: str | list[str], quoted: bool) -> None:
        """Add an expanded value: quoted or in an assignment as it is; otherwise split on blanks."""
        if isinstance(value, list):
            if quoted:  # "${A[@]}": one word per element
                self._words_of(value)
                return
            value = " ".join(value)
        if quoted or self.in_assign:
            self._add(value)
            return
        if not value:
            return
        if value[0] in _BLANK:
            self._flush()
        self._words_of(value.split())
        if value[-1] in _BLANK:
            self._flush()

    def _words_of(self, parts: list[str]) -> None:
        """``parts`` as words, the first joining the word being built and the last left open, the middle ones
        added at once (A=("${A[@]}" "${A[@]}") doubled 25 times is 2**25 words: one Python step each took over 16 s
        of CPU before the MAX_EXPANDED bound stopped it; MAX_WORDS stops it at 100,000)."""
        if not parts:
            return
        if len(self.words) + len(parts) > MAX_WORDS:
            raise ValueError(f"the command has more than {MAX_WORDS:,} words")
        self.grow(sum(map(len, parts)) + len(parts) - 1)
        self.cur.append(parts[0])
        self.started = True
        if len(parts) > 1:
            self._flush()
            self.words.extend(parts[1:-1])
            self.cur, self.started = [parts[-1]], True

    # -- the scan ----------------------------------------------------------------------------------
    def run(self) -> list[str]:
        self._loop()
        self._flush()
        return self.words

    def _loop(self) -> None:
        t, n = self.text, len(self.text)
        i = 0
        while i < n:
            c = t[i]
            if c in _BLANK and not self.quoted:
                self._flush()
                i += 1
                continue
            self._begin(i)
            if c == "#" and not self.started and not self.quoted:
                break                                   # a comment (only at the start of a word)
            m = _PLAIN.match(t, i)
            if m:
                self._add(m.group(0))
                i = m.end()
                continue
            if c == "\\":
                if i + 1 < n and t[i + 1] != "\n":
                    self._add(t[i + 1])
                i += 2
                continue
            if c == "'":
                end = t.find("'", i + 1)
                if end < 0:
                    raise ValueError("No closing quotation")
                self._add(t[i + 1:end])
                i = end + 1
                continue
            if c == '"':
                i = self._double(i + 1)
                continue
            if c == "$":
                i = self._dollar(i, quoted=False)
                continue
            if c == "`":
                i = self._literal_until(i, "`")
                continue
            self._add(c)
            i += 1

    def _double(self, i: int) -> int:
        """Inside double quotes from ``i``; returns the index after the closing quote."""
        t, n = self.text, len(self.text)
        start_len, had_other, empty_array = len(self.cur), False, False
        while i < n:
            c = t[i]
            if c == '"':
                if had_other or not empty_array or len(self.cur) > start_len:
                    self.started = True
                return i + 1
            if c == "\\" and i + 1 < n and t[i + 1] in '$`"\\\n':
                if t[i + 1] != "\n":
                    self._add(t[i + 1])
                had_other = True
                i += 2
                continue
            if c == "$":
                before = (len(self.words), len(self.cur))
                ref = self.reference(i)
                if ref is not None and isinstance(ref[0], list) and not ref[0]:
                    empty_array = True               # "${A[@]}" of an empty array: no word
                    i = ref[1]
                    continue
                i = self._dollar(i, quoted=True)
                had_other = had_other or (len(self.words), len(self.cur)) != before
                continue
            if c == "`":
                i = self._literal_until(i, "`")
                had_other = True
                continue
            self._add(c)
            had_other = True
            i += 1
        raise ValueError("No closing quotation")

    def _literal_until(self, i: int, close: str) -> int:
        end = self.text.find(close, i + 1)
        if end < 0:
            raise ValueError("No closing quotation")
        self._keep(self.text[i:end + 1])
        return end + 1

    def _keep(self, text: str) -> None:
        """A command substitution or arithmetic expansion memguard does not evaluate: kept as written, and listed."""
        self._add(text)
        if len(self.kept) < MAX_WORDS:
            self.kept.append(text)

    def _dollar(self, i: int, quoted: bool) -> int:
        t = self.text
        nxt = t[i + 1:i + 2]
        if nxt == "(":                                  # $(command) kept as written; $((arithmetic)) evaluated
            end = self._matching(t, i + 1, "(", ")")
            if end is not None and t.startswith("$((", i) and t[end - 2:end] == "))" \
                    and self._matching(t, i + 2, "(", ")") == end - 1:
                try:
                    value = evaluate(t[i + 3:end - 2], self.vars)
                except ArithmeticUnfollowed:
                    value = None                        # (kept as written: the reader names the flag it reaches)
                if value is not None:
                    self._fields(str(value), quoted or self.quoted)
                    return end
            if end is None:                             # no closing parenthesis: a plain $ and a (
                # (with every unclosed "$(" right after it: one add for the run, not a pass of the loop per
                # character; the scan above recorded them all)
                j = i + 2
                while t.startswith("$(", j) and self.matches.get((t, j + 1), 0) is None:
                    j += 2
                self._add(t[i:j])
                return j
            self._keep(t[i:end])
            return end
        if nxt == "'" and not quoted:                   # $'...': ANSI-C quoting, kept without its escapes
            end = t.find("'", i + 2)
            if end < 0:
                raise ValueError("No closing quotation")
            self._add(t[i + 2:end])
            return end + 1
        ref = self.reference(i)
        if ref is None:
            self._add("$")
            return i + 1
        value, end = ref
        if value is _UNSET:
            self._add(t[i:end])
        elif isinstance(value, _Default):
            if value.assign:
                self._fields(self.default_value(value), quoted or self.quoted)
            elif self.started and self.depth < MAX_NESTING and (not value.word or _PLAIN.fullmatch(value.word)):
                if value.word:                          # (a plain word inside a word: what the scan below adds)
                    self._add(value.word)
            else:  # the word is part of the command's text: scanned in place (its quotes group words)
                saved = self.text, self.quoted, self.depth
                self.text, self.quoted, self.depth = value.word, quoted or self.quoted, self.depth + 1
                if self.depth > MAX_NESTING:
                    raise ValueError(f"parameter expansions nested deeper than {MAX_NESTING} levels")
                try:
                    self._loop()
                finally:
                    self.text, self.quoted, self.depth = saved
        else:
            self._fields(value, quoted or self.quoted)
        return end

    def reference(self, i: int):
        """The parameter expansion at ``t[i] == '$'``: (value, end) where value is a str, a list
        (``[@]``), a _Default (the word of ``${VAR:-word}`` that applies) or _UNSET (kept as written);
        None when ``$`` starts no expansion."""
        t = self.text
        if t[i + 1:i + 2] == "{":
            m = _SIMPLE_BRACED.match(t, i)
            if m:                                       # ${NAME}, ${NAME:-word}: what the scan below finds, at once
                value = _lookup(self.vars.get(m.group(1)), None)
                op = m.group(2)
                if not op:
                    return value, m.end()
                unset = value is _UNSET or (op.startswith(":") and value == "")
                if op.endswith("+"):
                    return ("" if unset else _Default(m.group(3), None)), m.end()
                if not unset:
                    return value, m.end()
                return _Default(m.group(3), m.group(1) if op.endswith("=") else None), m.end()
            end = self._matching(t, i + 1, "{", "}")
            if end is None:                             # no closing brace: a plain $
                return None
            inner = t[i + 2:end - 1]
            special = self._special_braced(inner)
            if special is not None:
                return special, end
            m = _BRACED.match(inner)
            if not m or (m.end() != len(inner) and not m.group(4)):
                operated = self._operated(inner)       # ${X/a/b}, ${X^^}, ${!N}, ...
                return (_UNSET if operated is None else operated), end    # ${1x}, ${X@Q}: not evaluated
            name, index, op = m.group(1), m.group(3), m.group(4)
            value = _lookup(self.vars.get(name), index)
            if not op:
                return value, end
            word = inner[m.end():]
            unset = value is _UNSET or (op.startswith(":") and value in ("", []))
            if op.endswith("+"):
                return ("" if unset else _Default(word, None)), end
            if not unset:
                return value, end
            return _Default(word, name if op.endswith("=") else None), end
        c = t[i + 1:i + 2]
        if c and c in "@*#" or c.isdigit():
            return self._positional(c), i + 2
        m = _NAME.match(t, i + 1)
        if not m:
            return None
        return _lookup(self.vars.get(m.group(0)), None), m.end()

    def _positional(self, name: str):
        """``$@`` (a list: one word each when quoted), ``$*``, ``$#``, ``$1`` ... of the positional parameters (``set --``,
        a function's arguments); _UNSET when the script's own arguments are meant (memguard does not know them)."""
        args = self.vars.get("@")
        if name == "0" or not isinstance(args, list):
            if name in "@*":
                self.unknown.append("$" + name)
            return _UNSET
        if name == "@":
            return list(args)
        if name == "*":
            return " ".join(args)
        if name == "#":
            return str(len(args))
        k = int(name)
        return args[k - 1] if k <= len(args) else ""

    def _special_braced(self, inner: str):
        """``${#X}``, ``${#A[@]}``, ``${@}`` / ``${N}``, and the slices ``${X:off}``, ``${X:off:len}``, ``${A[@]:off:len}``,
        ``${@:off:len}``; None when ``inner`` is none of them (or an offset is not an integer expression)."""
        m = _SPECIAL.fullmatch(inner)
        if not m:
            return None
        length, name, index, off, count = m.group(1), m.group(2), m.group(4), m.group(5), m.group(6)
        positional = name in ("@", "*", "#") or name.isdigit()
        if positional and index:
            return None
        value = self._positional(name) if positional else _lookup(self.vars.get(name), index)
        if length:
            if off is not None or name == "#":
                return None
            if value is _UNSET:
                return None if positional else "0"     # bash: an unset variable's length is 0
            return str(len(value))
        if off is None:
            return value if name in ("@", "*") or name.isdigit() else None
        if value is _UNSET:
            return None
        try:
            o = evaluate(off, self.vars)
            n = None if count is None else evaluate(count, self.vars)
        except ArithmeticUnfollowed:
            return None
        if name in ("@", "*"):
            if o == 0:
                return None                               # ${@:0} starts with $0, the script's name
            o = o - 1 if o > 0 else o                     # ${@:1} is $1
            value = value if isinstance(value, list) else value.split()
        items = value if isinstance(value, list) else None
        seq = items if items is not None else str(value)
        size = len(seq)
        start = o + size if o < 0 else o
        if start < 0 or start > size:
            return [] if items is not None else ""
        if n is None:
            stop = size
        elif n < 0:
            stop = size + n
            if stop < start:
                return None                               # bash: "substring expression < 0"
        else:
            stop = min(start + n, size)
        part = seq[start:stop]
        if name == "*":
            return " ".join(part)
        return list(part) if items is not None else part

    # -- ${X/p/r}, ${X#p}, ${X^^}, ${!N} ------------------------------------------------------------------------------
    def _operated(self, inner: str):
        """The value of a pattern / case operator or an indirection (``inner``: the text inside ``${ }``); _UNSET for an
        unset variable (kept as written); None when ``inner`` is none of these."""
        m = _OPERATED.fullmatch(inner)
        if not m:
            return None
        bang, name, index, op, rest = m.group(1), m.group(2), m.group(4), m.group(5), m.group(6)
        if op is None:
            if not bang:
                return None
            if rest in ("*", "@") and not index and not name[0].isdigit():     # ${!PREFIX*}: the names it starts
                names = sorted(k for k in self.vars if k.startswith(name) and _NAME.fullmatch(k))
                return names if rest == "@" else " ".join(names)
            if rest:
                return None
        positional = name in ("@", "*") or name.isdigit()
        if positional and index:
            return None
        if bang and index in ("@", "*") and op is None:                          # ${!A[@]}: the array's indices
            v = self.vars.get(name)
            keys = [] if v is None else [str(k) for k in range(len(v))] if isinstance(v, list) else ["0"]
            return keys if index == "@" else " ".join(keys)
        each = index in ("@", "*") or name in ("@", "*")
        value = self._positional("@" if name == "*" else name) if positional else \
            _lookup(self.vars.get(name), "@" if index == "*" else index)
        if bang:
            if value is _UNSET:
                raise ValueError(f"{name}: invalid indirect expansion")
            target = " ".join(value) if isinstance(value, list) else value
            t = _INDIRECT.fullmatch(target)
            if not t:
                raise ValueError(f"{target}: invalid variable name")
            each = t.group(2) in ("@", "*") or t.group(1) in ("@", "*")
            positional = t.group(1) in ("@", "*") or t.group(1).isdigit()
            if positional and t.group(2):
                return None
            value = self._positional("@" if t.group(1) == "*" else t.group(1)) if positional else \
                _lookup(self.vars.get(t.group(1)), "@" if t.group(2) == "*" else t.group(2))
            joined = t.group(1) == "*" or t.group(2) == "*"
        else:
            joined = name == "*" or index == "*"
        if value is _UNSET:
            return _UNSET
        if op is not None:
            f = self._operator(op, rest)
            value = [f(x) for x in value] if isinstance(value, list) else f(value)
        if isinstance(value, list) and (joined or not each):
            return " ".join(value)
        return value

    def _operator(self, op: str, rest: str):
        """The function of one value that ``${X<op><rest>}`` applies."""
        if op[0] in "#%":
            pieces = self._pattern(rest)
            return lambda s: remove(s, pieces, op)
        if op[0] in "^,~":
            pieces = self._pattern(rest) if rest else None
            return lambda s: case(s, pieces, op)
        cut = _split_slash(rest)
        pattern, repl = (rest, None) if cut is None else (rest[:cut], rest[cut + 1:])
        pieces = self._pattern(pattern)
        parts = self._replacement(repl) if repl is not None else []

        def rep(matched: str) -> str:
            return "".join(matched if p is _AMP else p for p in parts)
        return lambda s: replace(s, pieces, rep, op)

    def _sub(self, text: str) -> "_Words":
        return _Words(text, self.vars, quoted=True, depth=self.depth + 1, kept=self.kept)

    def _quoted_end(self, text: str, i: int) -> int:
        """The index of the '"' closing the double quotes opened at ``text[i]``."""
        j = i + 1
        while j < len(text):
            c = text[j]
            if c == "\\":
                j += 2
                continue
            if c == '"':
                return j
            if text.startswith("${", j) or text.startswith("$(", j):
                end = self._matching(text, j + 1, text[j + 1], "}" if text[j + 1] == "{" else ")")
                if end is not None:
                    j = end
                    continue
            j += 1
        raise ValueError("No closing quotation")

    def _expansion(self, text: str, i: int) -> tuple[str | None, int]:
        """The value of the expansion at ``text[i] == '$'`` inside a pattern or replacement, and where it ends; (None,
        ``i + 1``) for a plain '$'; a command substitution is kept as written."""
        if text.startswith("$(", i):
            end = self._matching(text, i + 1, "(", ")")
            if end is not None:
                if text.startswith("$((", i):
                    try:
                        return str(evaluate(text[i + 3:end - 2], self.vars)), end
                    except ArithmeticUnfollowed:
                        pass
                self.kept.append(text[i:end])
                return text[i:end], end
            return None, i + 1
        sub = self._sub(text)
        ref = sub.reference(i)
        if ref is None:
            return None, i + 1
        value, end = ref
        if isinstance(value, _Default):
            value = sub.default_value(value)
        if value is _UNSET:
            return text[i:end], end
        return (" ".join(value) if isinstance(value, list) else value), end

    def _pattern(self, text: str) -> list:
        """The glob pieces of a pattern as bash reads it: quoted and backslashed characters match themselves, an unquoted
        expansion's value is a pattern itself."""
        out: list = []
        i, n = 0, len(text)
        while i < n:
            c = text[i]
            if c == "\\" and i + 1 < n:
                out.append(literal(text[i + 1]))
                i += 2
            elif c == "'":
                end = text.find("'", i + 1)
                if end < 0:
                    raise ValueError("No closing quotation")
                out.extend(literal(x) for x in text[i + 1:end])
                i = end + 1
            elif c == '"':
                end = self._quoted_end(text, i)
                out.extend(literal(x) for x in "".join(self._sub(text[i:end + 1]).run()))
                i = end + 1
            elif c == "$":
                value, i = self._expansion(text, i)
                out.extend([literal("$")] if value is None else glob_pieces(value))
            elif c == "[" and bracket(text, i) is not None:
                piece, i = bracket(text, i)   # type: ignore[misc]
                out.append(piece)
            else:
                out.extend(glob_pieces(c))
                i += 1
            self.grow(0)
        while len(out) > 1 and out[-1] is STAR and out[-2] is STAR:
            out.pop()
        return out

    def _replacement(self, text: str) -> list:
        """A replacement's parts: text, or _AMP for an unquoted '&' (the matched text, bash 5.2)."""
        out: list = []
        i, n = 0, len(text)
        while i < n:
            c = text[i]
            if c == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 2
            elif c == "'":
                end = text.find("'", i + 1)
                if end < 0:
                    raise ValueError("No closing quotation")
                out.append(text[i + 1:end])
                i = end + 1
            elif c == '"':
                end = self._quoted_end(text, i)
                out.append("".join(self._sub(text[i:end + 1]).run()))
                i = end + 1
            elif c == "$":
                value, i = self._expansion(text, i)
                out.append("$" if value is None else value)
            elif c == "&":
                out.append(_AMP)
                i += 1
            else:
                out.append(c)
                i += 1
        return out

    def _matching(self, t: str, i: int, open_: str, close: str) -> int | None:
        """The index after the ``close`` matching ``t[i] == open_``, None if there is none. Every scan's
        results are kept: a line of 100,000 unclosed ``$(`` is read in one pass, not 100,000."""
        key = (t, i)
        if key not in self.matches:
            _match_from(t, i, open_, close, self.matches)
        return self.matches.get(key)

    def default_value(self, d: "_Default") -> str:
        """The word of ``${VAR:-word}`` as one string (``${VAR:=word}`` also assigns it)."""
        value = "".join(_Words(d.word, self.vars, quoted=True, depth=self.depth + 1, kept=self.kept).run())
        if d.assign:
            self.vars[d.assign] = value
        return value


_UNSET = object()


def _split_slash(text: str) -> int | None:
    """Where the pattern of ``${X/pattern/replacement}`` ends: the first '/' not escaped, quoted or inside ``${ }`` /
    ``$( )`` (bash splits there, brackets or not: ``${P/[/]/-}`` is the pattern '[')."""
    i, n, depth = 0, len(text), 0
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c in "'\"" and not depth:
            end = text.find(c, i + 1)
            if end < 0:
                return None
            i = end + 1
            continue
        if c == "$" and text[i + 1:i + 2] in ("{", "("):
            depth += 1
            i += 2
            continue
        if depth and c in "})":
            depth -= 1
        elif depth and c in "{(":
            depth += 1
        elif c == "/" and not depth:
            return i
        i += 1
    return None


class _Default:
    """The word of ``${VAR:-word}``, ``${VAR:=word}`` or ``${VAR:+word}`` that applies."""

    def __init__(self, word: str, assign: str | None):
        self.word = word
        self.assign = assign


def _lookup(value: object, index: str | None):
    if value is None:
        return _UNSET
    if isinstance(value, list):
        if index in ("@",):
            return list(value)
        if index == "*":
            return " ".join(value)
        k = int(index) if index else 0
        return value[k] if k < len(value) else ""
    if index in ("@",):
        return [str(value)]
    if index and index != "*" and int(index) > 0:
        return ""
    return str(value)


def _match_from(t: str, i: int, open_: str, close: str, found: dict) -> None:
    """Scan from ``t[i] == open_``: record in ``found`` the end (index after the matching ``close``) of
    every ``open_`` the scan passes, None for those left open (quotes skipped in ``$( ... )``)."""
    stack: list[int] = []
    n, k = len(t), i
    while k < n:
        c = t[k]
        if c == "\\":
            k += 2
            continue
        if c in "'\"" and open_ == "(":
            end = t.find(c, k + 1)
            if end < 0:
                break
            k = end + 1
            continue
        if c == open_:
            stack.append(k)
        elif c == close and stack:
            found[(t, stack.pop())] = k + 1
            if not stack:
                return
        k += 1
    for j in stack:
        found[(t, j)] = None


# --------------------------------------------------------------------------------------------------
# Script text: logical lines, simple commands, #SBATCH directives (moved from launch_command.py)
# --------------------------------------------------------------------------------------------------
# Runs logical_lines adds whole (counting their parentheses): outside quotes none of \ ' " ` # < and newline; inside
# quotes none that ends them
_LINE_RUN = re.compile(r"[^\\'\"`#<\n]+")
_PARENS = re.compile(r"[()]")
_QUOTED_RUN = {"'": re.compile(r"[^'\n]+"), '"': re.compile(r'[^"\\\n]+'), "`": re.compile(r"[^`\n]+")}
_HEREDOC = re.compile(r"""<<(-?)[ \t]*(?:'([^']*)'|"([^"]*)"|([^\s;&|<>()'"]+))""")


def logical_lines(text: str, starts: list[int] | None = None) -> list[str]:
    """Bash's logical lines: continuations joined, comments dropped, quotes and ``( ... )`` arrays may
    span lines (a newline inside quotes is kept, one inside an array becomes a space), here-document
    bodies (``cat > hosts <<EOF ... EOF``) dropped: they are a command's input, not commands. ``starts``
    gets the number of the physical line each logical line starts on."""
    out: list[str] = []
    buf: list[str] = []
    lineno, start = 1, 0      # the physical line at i; where the logical line being built starts (0: not yet)
    quote: str | None = None
    depth = 0
    heredocs: list[tuple[str, bool]] = []   # (delimiter, <<- strips leading tabs) waiting for the line's end
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if quote:
            m = _QUOTED_RUN[quote].match(text, i)
            if m:                   # (a run of characters that end nothing: one step, not one per character)
                buf.append(m.group(0))
                i = m.end()
                continue
            if c == "\n":
                lineno += 1
            if c == "\\" and quote == '"' and i + 1 < n:
                if text[i + 1] == "\n":   # continuation inside double quotes
                    lineno += 1
                    i += 2
                    continue
                buf.append(text[i:i + 2])
                i += 2
                continue
            buf.append(c)
            if c == quote:
                quote = None
            i += 1
            continue
        m = _LINE_RUN.match(text, i)
        if m:                       # (characters of no meaning to the line's structure but parentheses: one step)
            run = m.group(0)
            if not start and run.strip(" \t\r"):
                start = lineno
            if ")" in run:
                for p in _PARENS.findall(run):
                    if p == "(":
                        depth += 1
                    elif depth:
                        depth -= 1
            else:
                depth += run.count("(")
            buf.append(run)
            i = m.end()
            continue
        if not start and c not in " \t\r\n#" and not text.startswith("\\\n", i):
            start = lineno
        if c == "\\" and i + 1 < n:
            if text[i + 1] == "\n":
                lineno += 1
                i += 2
                continue
            buf.append(text[i:i + 2])
            i += 2
            continue
        if c in "'\"`":
            quote = c
            buf.append(c)
            i += 1
            continue
        if c == "#" and buf and not start:
            start = lineno
        if c == "#" and (not buf or buf[-1][-1:] in (" ", "\t", "\n", ";", "(")):
            while i < n and text[i] != "\n":
                i += 1
            continue
        if text.startswith("<<<", i):      # a here-string: one word of input, no body
            buf.append("<<<")
            i += 3
            continue
        if c == "<" and not depth and text.startswith("<<", i):
            m = _HEREDOC.match(text, i)
            if m:
                heredocs.append((m.group(2) or m.group(3) or m.group(4), bool(m.group(1))))
                buf.append(m.group(0))   # the operator and its word, dropped later as a redirection
                i = m.end()
                continue
        if c == "(":
            depth += 1
        elif c == ")" and depth:
            depth -= 1
        if c == "\n":
            lineno += 1
            if depth:
                buf.append(" ")
            else:
                line = "".join(buf).strip()
                if line:
                    out.append(line)
                    if starts is not None:
                        starts.append(start or lineno - 1)
                buf, start = [], 0
            i += 1
            for delim, strip_tabs in heredocs:
                while i < n:
                    end = text.find("\n", i)
                    end = n if end < 0 else end
                    body = text[i:end].rstrip("\r")
                    i = end + 1
                    lineno += 1
                    if (body.lstrip("\t") if strip_tabs else body) == delim:
                        break
            heredocs = []
            continue
        buf.append(c)
        i += 1
    if quote:
        raise ReaderError(f"unterminated {quote} quote in the launch command")
    line = "".join(buf).strip()
    if line:
        out.append(line)
        if starts is not None:
            starts.append(start or lineno)
    return out


# Runs simple_commands adds whole: outside $( ) / ${ } none of \ ' " ` $ < > & ; | and no digit (a redirection drops
# the digits before it, one by one), a '$' opening nothing and whole $( ) / $(( )) / ${ } with none of \ ' " ` $ ( ) { } in them;
# inside, none of \ ' " ` ) } (counting the $( ( ${ { it opens); in quotes, none that ends them
_COMMAND_RUN = re.compile(r"""(?:[^\\'"`$<>&;|0-9]+|\$(?![({])|\$\{[^\\'"`$(){}]*\}|\$\((?:\([^\\'"`$(){}]*\)|[^\\'"`$(){}]*)\))+""")
_SUB_RUN = re.compile(r"[^\\'\"`)}]+")
_QUOTE_RUN = {"'": re.compile(r"[^']+"), '"': re.compile(r'[^"\\]+'), "`": re.compile(r"[^`]+")}


def simple_commands(line: str) -> list[str]:
    """Split a logical line on unquoted ``;``, ``&&``, ``||``, ``|`` and ``&``; drop redirections
    (``> log 2>&1``, ``|& tee``...). ``$( ... )`` and quotes are kept whole."""
    cmds: list[str] = []
    cur: list[str] = []
    quote: str | None = None
    sub = 0
    i, n = 0, len(line)

    def flush():
        s = "".join(cur).strip()
        if s:
            cmds.append(s)
        cur.clear()

    while i < n:
        m = (_QUOTE_RUN[quote] if quote else _SUB_RUN if sub else _COMMAND_RUN).match(line, i)
        if m:                         # (characters that separate or close nothing: one step for the run)
            run = m.group(0)
            if sub and not quote:
                sub += run.count("(") + run.count("{")
            cur.append(run)
            i = m.end()
            continue
        c = line[i]
        if quote:
            cur.append(c)
            if c == "\\" and quote == '"' and i + 1 < n:
                cur.append(line[i + 1])
                i += 2
                continue
            if c == quote:
                quote = None
            i += 1
            continue
        if c == "\\" and i + 1 < n:
            cur.append(line[i:i + 2])
            i += 2
            continue
        if c in "'\"`":
            quote = c
            cur.append(c)
            i += 1
            continue
        if c == "$" and line[i + 1:i + 2] in ("(", "{"):
            sub += 1                  # (a '&' or ';' inside ${X/a/&} or $(...) separates nothing)
            cur.append(line[i:i + 2])
            i += 2
            continue
        if sub:
            if c in "({":
                sub += 1
            elif c in ")}":
                sub -= 1
            cur.append(c)
            i += 1
            continue
        if c in "<>" or (c == "&" and line[i + 1:i + 2] == ">"):
            # a redirection: drop an attached fd number, the operator and its target word
            while cur and cur[-1].isdigit():
                cur.pop()
            while i < n and line[i] in "<>&|":
                i += 1
            while i < n and line[i] in " \t":
                i += 1
            q = None
            while i < n and (q or line[i] not in " \t;|&"):
                if q is None and line[i] in "'\"":
                    q = line[i]
                elif q == line[i]:
                    q = None
                i += 1
            continue
        if c in ";|&":
            flush()
            while i < n and line[i] in ";|&":
                i += 1
            continue
        cur.append(c)
        i += 1
    flush()
    return cmds


def sbatch_env(text: str) -> dict[str, str]:
    """The SLURM_* values that a job gets from the script's ``#SBATCH`` directives."""
    out: dict[str, str] = {}
    nodes = per_node = ntasks = gpus_per_node = None
    for raw in text.splitlines():
        s = raw.strip()
        if not s.startswith("#SBATCH"):
            continue
        try:
            toks = shlex.split(s[len("#SBATCH"):], comments=True)
        except ValueError:
            continue
        i = 0
        while i < len(toks):
            t = toks[i]
            opt, val = (t.split("=", 1) + [None])[:2] if t.startswith("--") else (t[:2], t[2:] or None)
            if val is None and i + 1 < len(toks) and not toks[i + 1].startswith("-"):
                val = toks[i + 1]
                i += 1
            i += 1
            if opt in ("-N", "--nodes"):
                nodes = str(val).split("-")[-1]
            elif opt == "--ntasks-per-node":
                per_node = val
            elif opt in ("-n", "--ntasks"):
                ntasks = val
            elif opt == "--gpus-per-node":
                gpus_per_node = str(val).split(":")[-1]
    if nodes:
        out["SLURM_NNODES"] = out["SLURM_JOB_NUM_NODES"] = str(nodes)
    if per_node:
        out["SLURM_NTASKS_PER_NODE"] = str(per_node)
    if ntasks:
        out["SLURM_NTASKS"] = out["SLURM_NPROCS"] = str(ntasks)
    elif nodes and per_node and str(nodes).isdigit() and str(per_node).isdigit():
        out["SLURM_NTASKS"] = out["SLURM_NPROCS"] = str(int(nodes) * int(per_node))
    if gpus_per_node:
        out["SLURM_GPUS_PER_NODE"] = str(gpus_per_node)
    return out
