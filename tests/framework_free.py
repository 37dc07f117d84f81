"""Which test files are framework-free: they prove the same thing in every venv, so tests/run.sh runs them once.

A test file is framework-free when nothing it can import (the file's imports anywhere in it, at module level or in
a function, followed through tests/ helpers, benchmarks/ and megatron_memguard/, module by module) is other than the
standard library, this project and the pure-Python packages both main venvs install at the same constraint
(ALLOWED_THIRD_PARTY), and when no module in that closure starts a process, imports by a computed name or probes
the environment (the interpreter's version, installed packages, which megatron.training era: PROBES). Such a file
runs the same code on the same inputs under .venv (3.11) and .venv312, so the 3.12 run skips it
(MEMGUARD_SKIP_FRAMEWORK_FREE=1, tests/conftest.py) and loses no check. Anything the scan cannot follow counts as
framework, so a file is only ever run in more venvs than it needs, never fewer. Read from the source with ast: no
module is imported. tests/test_framework_free.py checks the rule on files written for it and on known suite files.
"""
from __future__ import annotations

import ast
import functools
import os
import sys
from dataclasses import dataclass
from typing import Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
CONFTEST = os.path.join(TESTS, "conftest.py")

# Pure-Python packages both main venvs install with the same constraint (pyproject's test extra; tests/run.sh's
# .venv312 line): the same release in each, so a file using them behaves alike. matplotlib, lightning and the
# frameworks are not here: .venv312 lacks the first two, and torch / megatron-core differ by design.
ALLOWED_THIRD_PARTY = frozenset({"pytest", "_pytest", "hypothesis", "yaml", "omegaconf", "packaging"})
# Optional extras the project imports only where a user asks for them (the plot extra: matplotlib, imported by
# megatron_memguard/report/plots.py for --plot and the report's plots), which .venv312 lacks. A reading by module cannot
# tell the CLI's --plot from the rest of the CLI, so a file that reaches them only through megatron_memguard/ counts as
# framework-free and runs, in every venv, with them hidden (hidden_extras, tests/conftest.py): the same code as in a
# venv without them. A test or helper that imports one itself is not framework-free.
OPTIONAL_EXTRAS = frozenset({"matplotlib"})
PACKAGE = os.path.join(ROOT, "megatron_memguard")
# Standard-library modules that start processes (what such a process imports is out of the scan's sight).
PROCESS_MODULES = frozenset({"subprocess", "multiprocessing", "concurrent", "pty", "runpy"})
# Names whose use makes a file's outcome depend on the venv: process start-up (os.system, os.fork, the interpreter
# path), imports by a computed name, the interpreter's version, installed-package lookups, and tests/conftest.py's
# helpers that read which megatron.training is installed (and the markers that select on it).
PROBES = frozenset({
    "system", "popen", "fork", "forkpty", "execv", "execve", "execl", "execle", "execlp", "execvp", "execvpe",
    "spawnl", "spawnv", "spawnve", "posix_spawn", "executable",
    "find_spec", "version_info", "hexversion", "pkg_resources", "importlib_metadata",
    "container_era", "megatron_training_era", "legacy_training", "megatron_core_version", "CONTAINER_ERA",
    "validated_by_megatron", "LEGACY_STANDIN", "run_as_written",
})
# tests/conftest.py's markers of tests that need one venv's framework (``pytest.mark.NAME``)
FRAMEWORK_MARKS = frozenset({"megatron_training", "legacy_standin", "bridge"})
# calls that import the module their argument names (pytest.importorskip skips where it is missing: the module
# then decides, as an import does)
_IMPORT_CALLS = frozenset({"import_module", "__import__", "importorskip"})
# importlib's submodules that read what is installed (importlib.metadata.version, importlib.util.find_spec)
_IMPORTLIB_PROBES = frozenset({"importlib.metadata", "importlib.util"})
_STDLIB = frozenset(sys.stdlib_module_names) - PROCESS_MODULES


@functools.lru_cache(maxsize=None)
def _module_file(name: str) -> str | None:
    """The source file of a project module by dotted name (tests/ helpers are top-level modules), or None."""
    parts = name.split(".")
    for base in (ROOT, TESTS):
        stem = os.path.join(base, *parts)
        for path in (stem + ".py", os.path.join(stem, "__init__.py")):
            if os.path.isfile(path):
                return path
    return None


def _module_name(path: str) -> tuple[str, bool]:
    """(dotted name, is a package) of a project file, for resolving its relative imports."""
    rel = os.path.relpath(path, TESTS if os.path.dirname(path) == TESTS else ROOT)
    parts = rel[:-3].split(os.sep)
    is_pkg = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_pkg else parts), is_pkg


def _called(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _imported_by_call(arg: ast.expr) -> list[str] | None:
    """The modules ``import_module(arg)`` can import: the named one, or every module of the project package an
    f-string names (``f"megatron_memguard.cli.{cmd}"``); None when that cannot be told from the source."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        prefix = str(arg.values[0].value)
        pkg = prefix[:-1] if prefix.endswith(".") else None
        init = _module_file(pkg) if pkg else None
        if init and init.endswith("__init__.py"):
            return [f"{pkg}.{f[:-3]}" for f in sorted(os.listdir(os.path.dirname(init)))
                    if f.endswith(".py") and f != "__init__.py"]
    return None


def _imports(nodes: Iterable[ast.AST], path: str) -> tuple[set[str], str | None]:
    """Every module name the nodes import (with each parent package and each ``from pkg import name`` that is a
    submodule), and the first probe met (None when none)."""
    own, is_pkg = _module_name(path)
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(node, own, is_pkg)
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)   # (a name that is no module is told apart later)
        elif isinstance(node, ast.Call) and _called(node) in _IMPORT_CALLS and node.args:
            named = _imported_by_call(node.args[0])
            if named is None:
                return found, f"calls {_called(node)} with a computed name"
            found.update(named)
        elif (isinstance(node, ast.Attribute) and node.attr in FRAMEWORK_MARKS and isinstance(node.value, ast.Attribute)
              and node.value.attr == "mark"):
            return found, f"is marked {node.attr}"
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "importlib"
              and f"importlib.{node.attr}" in _IMPORTLIB_PROBES):
            return found, f"uses importlib.{node.attr}"
        elif isinstance(node, ast.Name) and node.id in PROBES:
            return found, f"uses {node.id}"
        elif isinstance(node, ast.Attribute) and node.attr in PROBES:
            return found, f"uses .{node.attr}"
    probes = sorted(m for m in found if m in _IMPORTLIB_PROBES or m.startswith(tuple(p + "." for p in _IMPORTLIB_PROBES)))
    if probes:
        return found, f"imports {probes[0]}"
    with_parents = set()
    for mod in found:
        parts = mod.split(".")
        with_parents.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return with_parents, None


def _from_module(node: ast.ImportFrom, own: str, is_pkg: bool) -> str:
    """The absolute module name of ``from MODULE import ...`` in the module ``own``."""
    if not node.level:
        return node.module or ""
    base = own.split(".")
    base = base[:len(base) - node.level + (1 if is_pkg else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _classify(mods: set[str], probe: str | None, path: str) -> tuple[str | None, tuple[str, ...], frozenset[str]]:
    """(why these imports of the file at ``path`` are not framework-free or None, the project modules among them,
    the optional extras among them that the package imports)."""
    if probe:
        return probe, (), frozenset()
    project, extras = [], set()
    for mod in sorted(mods):
        top = mod.split(".")[0]
        if _module_file(mod):
            project.append(mod)
        elif top in _STDLIB or top in ALLOWED_THIRD_PARTY or top == "__future__":
            continue
        elif _module_file(top):
            continue   # a name inside a project module (`from pkg import function`), not a module
        elif top in OPTIONAL_EXTRAS and path.startswith(PACKAGE + os.sep):
            extras.add(top)
        else:
            return f"imports {mod}", (), frozenset()
    return None, tuple(project), frozenset(extras)


@dataclass(frozen=True)
class _Scan:
    """What one file's source says. ``lazy_*``: a module-level ``__getattr__`` (PEP 562) imports only when one of
    ``lazy_names`` is looked up on the module, which the closure is searched for (``mentions``, ``binds``,
    ``dynamic``) before its imports are followed."""
    reason: str | None
    project: tuple[str, ...]
    extras: frozenset[str] = frozenset()     # the optional extras it imports (OPTIONAL_EXTRAS)
    lazy_names: frozenset[str] = frozenset()
    lazy_reason: str | None = None
    lazy_project: tuple[str, ...] = ()
    lazy_extras: frozenset[str] = frozenset()
    mentions: frozenset[str] = frozenset()   # every identifier, attribute and identifier-like string; "*" for import *
    binds: frozenset[str] = frozenset()      # the modules an import statement binds to a name here
    dynamic: bool = False                    # looks up attributes by a computed name (getattr, vars, dir, __dict__)


_DYNAMIC_CALLS = frozenset({"getattr", "hasattr", "vars", "dir", "getmembers"})


def _lazy_getattr(tree: ast.Module) -> ast.FunctionDef | None:
    """The module-level ``__getattr__`` whose imports run only for the names it names: every name it can return
    is bound by an import in it or written as a string in it (no computed ``getattr`` / ``import_module``)."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            if any(isinstance(n, ast.Call) and _called(n) in _DYNAMIC_CALLS | _IMPORT_CALLS for n in ast.walk(node)):
                return None
            return node
    return None


def _mentions(nodes: Iterable[ast.AST], path: str) -> tuple[frozenset[str], frozenset[str], bool]:
    own, is_pkg = _module_name(path)
    names: set[str] = set()
    binds: set[str] = set()
    dynamic = False
    for node in nodes:
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
            dynamic = dynamic or node.attr in ("__dict__", "__all__")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                binds.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(node, own, is_pkg)
            for a in node.names:
                names.add(a.name)   # ("*" for a star import)
                binds.add(f"{mod}.{a.name}")
        elif isinstance(node, ast.Call) and _called(node) in _DYNAMIC_CALLS:
            dynamic = dynamic or not (len(node.args) > 1 and isinstance(node.args[1], ast.Constant))
    return frozenset(names), frozenset(binds), dynamic


@functools.lru_cache(maxsize=None)
def _own_reason(path: str) -> _Scan:
    """What this one file imports and why it is not framework-free itself (None when it is)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError) as e:
        return _Scan(f"unreadable ({e.__class__.__name__})", ())
    lazy = _lazy_getattr(tree)
    nodes = list(ast.walk(tree))
    if lazy:
        inside = {id(n) for n in ast.walk(lazy)}
        nodes = [n for n in nodes if id(n) not in inside]
    reason, project, extras = _classify(*_imports(nodes, path), path)
    # (the strings of ``__all__`` name what ``import *`` takes, which counts as "*" where it is written)
    exports = {id(n) for node in tree.body if isinstance(node, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets) for n in ast.walk(node.value)}
    mentions, binds, dynamic = _mentions([n for n in nodes if id(n) not in exports] if exports else nodes, path)
    if reason or lazy is None:
        return _Scan(reason, project, extras, mentions=mentions, binds=binds, dynamic=dynamic)
    lazy_nodes = list(ast.walk(lazy))
    lazy_reason, lazy_project, lazy_extras = _classify(*_imports(lazy_nodes, path), path)
    lazy_names = {a.asname or a.name for n in lazy_nodes if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    lazy_names |= {n.value for n in lazy_nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)
                   and n.value.isidentifier()}
    return _Scan(None, project, extras, frozenset(lazy_names), lazy_reason, lazy_project, lazy_extras, mentions, binds,
                 dynamic)


def _asks_for(scan: _Scan, module: str, names: frozenset[str]) -> bool:
    """Whether a file could look up one of a module's lazy names: it writes one of them, imports ``*``, or looks up
    attributes by a computed name in a file that binds the module to a name."""
    return bool(names & scan.mentions) or "*" in scan.mentions or (scan.dynamic and module in scan.binds)


@functools.lru_cache(maxsize=None)
def _closure(path: str) -> tuple[str | None, frozenset[str]]:
    """(why the test file at ``path`` is not framework-free or None, the optional extras its closure imports)."""
    seen: dict[str, _Scan] = {}
    todo = [os.path.abspath(path)]
    opened: set[str] = set()   # modules whose lazy imports are followed
    extras: set[str] = set()
    while todo:
        while todo:
            p = todo.pop()
            if p in seen:
                continue
            scan = seen[p] = _own_reason(p)
            if scan.reason:
                return f"{os.path.relpath(p, ROOT)} {scan.reason}", frozenset()
            extras |= scan.extras
            # tests/conftest.py is imported in every test process anyway: what a file takes from it is a name, and its
            # names that read the installed framework are in PROBES
            todo.extend(f for f in map(_module_file, scan.project) if f != CONFTEST)
        for p, scan in list(seen.items()):
            if p in opened or not scan.lazy_names:
                continue
            module = _module_name(p)[0]
            if any(_asks_for(other, module, scan.lazy_names) for q, other in seen.items() if q != p):
                opened.add(p)
                if scan.lazy_reason:
                    return f"{os.path.relpath(p, ROOT)} {scan.lazy_reason} (for a name its __getattr__ gives)", frozenset()
                extras |= scan.lazy_extras
                todo.extend(f for f in map(_module_file, scan.lazy_project) if f != CONFTEST)
    return None, frozenset(extras)


def framework_reason(path: str) -> str | None:
    """Why the test file at ``path`` is not framework-free (the module and what it does), or None when it is."""
    return _closure(path)[0]


def hidden_extras(path: str) -> frozenset[str]:
    """The optional extras a framework-free file's tests run without (OPTIONAL_EXTRAS its closure imports through
    megatron_memguard/); empty for a file that is not framework-free."""
    reason, extras = _closure(path)
    return frozenset() if reason else extras


def is_framework_free(path: str) -> bool:
    return framework_reason(path) is None
