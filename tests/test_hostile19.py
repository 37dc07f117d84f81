"""Regressions of issue hostile19 (benchmarks/hostile_input.py's hostile19 group). Part 1: the launch-script reader's
work on the slowest inputs of ``--quick`` (950 kB of ``${A:-x}`` or of ``$(``), counted in steps rather than timed.
Each is the smallest input of its class."""
from __future__ import annotations

import pytest

from megatron_memguard.readers import shell


class _Counting:
    """A compiled pattern whose match() calls are counted (the reader's loops take one step per match)."""

    def __init__(self, pattern):
        self.pattern, self.calls = pattern, 0

    def match(self, *a):
        self.calls += 1
        return self.pattern.match(*a)


def _count_method(monkeypatch, name: str) -> list[int]:
    calls = [0]
    orig = getattr(shell._Words, name)

    def counted(self, *a, **k):
        calls[0] += 1
        return orig(self, *a, **k)
    monkeypatch.setattr(shell._Words, name, counted)
    return calls


@pytest.mark.parametrize("vars_, expected", [({}, "x"), ({"A": "y"}, "y"), ({"A": ""}, "x")])
def test_a_word_of_braced_defaults_is_read_without_a_brace_scan_or_a_nested_pass_per_reference(monkeypatch, vars_,
                                                                                             expected):
    # bash: ${A:-x} is x when A is unset or empty, else A's value; 10,000 of them in a row make one word of 10,000 of
    # those. The reader scanned for each one's closing brace and read each 'x' in a nested pass of its loop (the 950 kB
    # case of hostile_input.py: 1.4-1.95 s of CPU); a ${NAME:-word} whose word has no quote, expansion or brace is now
    # read in one match (the first, which starts the word, still in the scan that knows a word's start)
    matching, loops = _count_method(monkeypatch, "_matching"), _count_method(monkeypatch, "_loop")
    assert shell.words("${A:-x}" * 10_000, dict(vars_)) == [expected * 10_000]
    assert matching[0] == 0 and loops[0] <= 2, (matching, loops)


def test_the_default_word_nesting_bound_still_holds_for_a_plain_innermost_word():
    # (the one-match path applies below MAX_NESTING only: 33 levels were refused before and still are)
    with pytest.raises(ValueError, match="nested deeper than 32 levels"):
        shell.words("w" + "${A:-" * 33 + "x" + "}" * 33, {})
    assert shell.words("w" + "${A:-" * 32 + "x" + "}" * 32, {}) == ["wx"]


def test_a_default_word_starting_a_command_word_is_still_scanned_as_the_word_start():
    # '#' starts a comment only at a word's start; a word built from ${A:-...} alone keeps going through the scan that
    # knows that (memguard reads '${A:-#x}' at a word start as before; after 'w' it is text)
    assert shell.words("w${A:-#x}", {}) == ["w#x"]
    assert shell.words("X=${A:-x} cmd ${B:=v} $B", {}) == ["X=x", "cmd", "v", "v"]


def test_logical_lines_reads_a_run_of_unclosed_parentheses_in_one_step(monkeypatch):
    counted = _Counting(shell._LINE_RUN)
    monkeypatch.setattr(shell, "_LINE_RUN", counted)
    # 10,000 unclosed '$(' then a newline: inside the open parentheses bash reads on (the newline is a space), so the
    # text is one logical line of those 20,000 characters; the loop took a step per character
    assert shell.logical_lines("$(" * 10_000 + "\n") == ["$(" * 10_000]
    assert counted.calls <= 3, counted.calls


def test_logical_lines_counts_parentheses_inside_a_run_as_it_did_per_character():
    # 'a=(x y' opens an array that spans lines (the newline a space); ') b' closes it; one stray ')' is no close
    starts: list[int] = []
    assert shell.logical_lines("a=(x y\nz) b\nc ) d\ne\n", starts) == ["a=(x y z) b", "c ) d", "e"]
    assert starts == [1, 3, 4]


@pytest.mark.parametrize("line, expected", [
    ("$(" * 10_000, ["$(" * 10_000]),
    ("echo ${A:-x}" + "${A:-x}" * 5_000 + "; b 2>&1 | c", ["echo ${A:-x}" + "${A:-x}" * 5_000, "b", "c"]),
])
def test_simple_commands_reads_runs_of_substitutions_in_one_step(monkeypatch, line, expected):
    # a '$(' left open makes the rest of the line its text (nothing separates inside it); whole ${...} are plain text
    runs = {name: _Counting(getattr(shell, name)) for name in ("_COMMAND_RUN", "_SUB_RUN")}
    for name, c in runs.items():
        monkeypatch.setattr(shell, name, c)
    assert shell.simple_commands(line) == expected
    assert sum(c.calls for c in runs.values()) <= 12, {n: c.calls for n, c in runs.items()}


def test_simple_commands_still_drops_the_digits_of_a_redirection():
    # bash: '2>&1' redirects fd 2; 'x12>f' is the word 'x' with fd 12 redirected (the digits right before the operator)
    assert shell.simple_commands("run x12>f --a 1 2>&1 | tee log") == ["run x --a 1", "tee log"]


# -- part 2: the hostile19 round ---------------------------------------------------------------------------------------
def test_calibrate_refuses_a_run_named_twice_before_reading_any(monkeypatch):
    # one log named 1,000 times: each was read, resolved and its GPU inferred before calibrate() found the names alike
    # (5,000 names: over 60 s); the names are compared first now, and the count of each name in one pass
    from fuzz_util import MEGATRON_LOG, run_memguard
    from megatron_memguard.calibrate import runs
    reads = [0]
    orig = runs._megatron_run

    def counted(*a, **k):
        reads[0] += 1
        return orig(*a, **k)
    monkeypatch.setattr(runs, "_megatron_run", counted)
    o = run_memguard(["calibrate", "a.log", *["r.log"] * 1_000, "--gpu", "H100-80GB"], {"r.log": MEGATRON_LOG,
                                                                                         "a.log": MEGATRON_LOG})
    assert o.code == 2 and not o.problems, o.describe()
    assert o.err.strip() == "memguard: error: two runs have the same name: r.log", o.err
    assert reads[0] == 0
    o = run_memguard(["calibrate", "d", "d"], {"d/r.log": MEGATRON_LOG})
    assert o.err.strip() == "memguard: error: two runs have the same name: d" and reads[0] == 0, o.err


def test_arithmetic_of_many_terms_is_tokenised_without_copying_the_rest_per_token(monkeypatch):
    # $((1+1+...+1)) of 450,001 terms in 900 kB: the tokenizer copied the rest of the text for each token (14 s of
    # CPU); it stops at memguard's bound of 10,000 terms, read as far as the term past the bound
    from megatron_memguard.readers import shell_arith
    counted = _Counting(shell_arith._TOKEN)
    monkeypatch.setattr(shell_arith, "_TOKEN", counted)
    with pytest.raises(shell_arith.ArithmeticUnfollowed, match="more than 10,000 terms"):
        shell_arith.evaluate("1+" * 450_000 + "1", {})
    assert counted.calls == 10_001, counted.calls
    # (bash: 2,001 ones summed is 2,001; its 4,001 terms are within the bound)
    assert shell_arith.evaluate("+".join(["1"] * 2_001), {}) == 2_001


@pytest.mark.parametrize("expr, value", [
    # C's precedence and left associativity (bash(1), ARITHMETIC EVALUATION), worked by hand
    ("1 + 2 * 3", 7), ("10 - 4 - 3", 3), ("2 ** 3 ** 2", 512), ("100 / 10 / 5", 2), ("1 << 2 + 1", 8),
    ("7 & 3 | 8", 11), ("1 || 0 && 0", 1), ("-7 / 2", -3), ("-7 % 3", -1), ("(1 + 2) * 3", 9), ("2 < 3 == 1", 1),
    ("!0 + ~0", 0), ("GPUS * NODES", 16), ("$GPUS * ${NODES} / 4", 4),
])
def test_arithmetic_keeps_bashs_precedence(expr, value):
    # (the evaluator climbs precedences now, one call per operand: it took a call per level, ten, per number, and
    # 150,000 $((1)) on a line 2.6-2.8 s of CPU)
    from megatron_memguard.readers.shell_arith import evaluate
    assert evaluate(expr, {"GPUS": "8", "NODES": "2"}) == value

