"""Input files, read in one place: a size limit, limits on YAML nesting and alias expansion, and every
parser error as one line ``FILE:LINE:COL: what is wrong``.

Training configs and launch scripts are a few KiB (the largest reference config, NeMo's
megatron_gpt_config.yaml, is 20 KiB with 440 values); the limits are far above that and keep a
hostile file (a 100,000-deep ``[[[[``, a kilobyte of aliases that expands to millions of values, a
5000-digit number) from crashing or stalling memguard (docs/assumptions.md, "Bounds on inputs").
"""
from __future__ import annotations

import errno
import json
import os
import select
import stat
import time
from typing import IO, Any, Callable, Hashable, TypeVar

import yaml
import yaml.parser
import yaml.scanner
from yaml.composer import Composer, ComposerError
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.events import AliasEvent
from yaml.parser import Parser as _PyParserBase
from yaml.reader import Reader
from yaml.resolver import Resolver
from yaml.scanner import Scanner

from .errors import ReaderError

MAX_FILE_BYTES = 2**20          # 1 MiB: 50 x the largest reference config
MAX_DEPTH = 64                  # nesting levels of mappings and lists (real configs: under 10)
MAX_VALUES = 10_000             # values of a document after alias expansion (real configs: under 500)
_MAX_INT_DIGITS = 40            # longer integers stay text (so that the bound on their key names them)

T = TypeVar("T")


class _PyParser(Reader, Scanner, _PyParserBase):
    """PyYAML's pure-Python parser: slower than libyaml's, with no nesting limit of its own."""

    def __init__(self, stream: str):
        Reader.__init__(self, stream)
        Scanner.__init__(self)
        _PyParserBase.__init__(self)


try:  # libyaml's parser when PyYAML has it (several times faster); the composer stays in Python
    from yaml.cyaml import CParser as _FastParser
except ImportError:  # pragma: no cover - PyYAML without libyaml
    _FastParser = _PyParser


class _BoundedConstructor(SafeConstructor):
    def construct_yaml_int(self, node):  # type: ignore[override]
        digits = str(node.value).replace("_", "").lstrip("+-")
        if len(digits) > _MAX_INT_DIGITS:
            return str(node.value)    # out of every range: resolve() refuses it under its key
        return super().construct_yaml_int(node)


    def construct_mapping(self, node, deep=False):  # type: ignore[override]
        # every key memguard's readers look up is a name; YAML reads `1:`, `true:` (and `on:`), `1.5:`, `~:` as a
        # number, a bool or null, which no reader expects (an internal error before) and no framework takes as a
        # field name (Bridge's instantiate: "keywords must be strings"; a functional test's MODEL_ARGS key becomes
        # a stray argv word)
        mapping = super().construct_mapping(node, deep=deep)
        for key_node, _ in node.value:
            key = self.construct_object(key_node)
            if not isinstance(key, str):
                what = {bool: "a bool", int: "an integer", float: "a number", type(None): "null"}.get(type(key), "not text")
                raise ConstructorError(None, None, f"the key {key_node.value!r} reads as {what}, not a name (a config's "
                                       f"keys are field names; quote it if it is one: '{key_node.value}':)",
                                       key_node.start_mark)
        return mapping


_BoundedConstructor.add_constructor("tag:yaml.org,2002:int", _BoundedConstructor.construct_yaml_int)


class _BoundedLoader(Composer, _BoundedConstructor, Resolver):
    """PyYAML's safe loader with a composer that refuses deep nesting and alias expansion beyond the
    limits (PyYAML's own recurses until Python's stack runs out, and libyaml's crashes)."""

    _parser: Any = _PyParser

    def __init__(self, stream: str):
        self._parser.__init__(self, stream)
        Composer.__init__(self)
        _BoundedConstructor.__init__(self)
        Resolver.__init__(self)
        self._depth = 0
        self._values = 0
        self._size: dict[int, int] = {}
        self._open: list[str] = []       # anchors whose node is being composed

    def compose_node(self, parent, index):  # type: ignore[override]
        event = self.peek_event()
        if isinstance(event, AliasEvent):
            if event.anchor in self._open:  # &a [*a]: a structure that contains itself has no end to walk
                raise ComposerError(None, None, f"alias *{event.anchor} is inside its own anchor (a recursive value)",
                                    event.start_mark)
            node = super().compose_node(parent, index)
            self._count(self._size.get(id(node), 1), event.start_mark)
            return node
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", event.start_mark)
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            self._open.append(anchor)
        start = self._values
        node = super().compose_node(parent, index)
        if anchor is not None:
            self._open.pop()
        self._depth -= 1
        self._count(1, event.start_mark)
        self._size[id(node)] = self._values - start
        return node

    def _count(self, n: int, mark) -> None:
        self._values += n
        if self._values > MAX_VALUES:
            raise ComposerError(None, None, f"more than {MAX_VALUES:,} values (after expanding aliases); "
                                "memguard reads training configs up to that size", mark)


class _Loader(_BoundedLoader, _FastParser):
    _parser = _FastParser


class _PyLoader(_BoundedLoader, _PyParser):
    # libyaml >= 0.2.5 (PyYAML 6.0.3 wheels on) stops at 1000 open brackets while it scans ahead, before
    # the composer sees level MAX_DEPTH + 1: the pure-Python scanner gives the composer's own error
    _parser = _PyParser


def _compose(loader_class: type, text: str) -> Any:
    loader = loader_class(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_text(path: str, limit: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of ``path``; ReaderError (one line, naming the file) when it cannot be read,
    is larger than ``limit`` bytes or is not UTF-8."""
    return decode(read_bytes(path, limit), path, limit)


PIPE_WAIT = 5.0   # seconds a named pipe / terminal may stay silent (process substitution writes at once)


def read_bytes(path: str, limit: int = MAX_FILE_BYTES) -> bytes:
    """At most ``limit + 1`` bytes of ``path``, without blocking: a named pipe nobody writes to, or a
    terminal, would stop memguard forever at ``open`` or ``read`` (a FIFO given as --config); such a
    file is read as long as data comes within PIPE_WAIT seconds. ReaderError naming the file otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ReaderError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ReaderError(f"{path}: is a directory, not a file") from None
    except OSError as e:
        raise ReaderError(f"{path}: cannot read ({e.strerror or e})") from None
    except ValueError:   # no file name holds a NUL character (os.open refuses it before the system does)
        raise ReaderError(f"{path!r}: not a file name (it holds a NUL character)") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):      # os.open opens a directory; read() would fail with EISDIR
            raise ReaderError(f"{path}: is a directory, not a file")
        if stat.S_ISREG(mode):
            os.set_blocking(fd, True)
            with os.fdopen(fd, "rb", closefd=False) as fh:
                return fh.read(limit + 1)
        return _read_stream(fd, path, limit)
    except OSError as e:
        raise ReaderError(f"{path}: cannot read ({e.strerror or e})") from None
    finally:
        os.close(fd)


def _read_stream(fd: int, path: str, limit: int) -> bytes:
    """A pipe, FIFO, terminal or character device (/dev/zero): read while data comes, up to ``limit + 1``."""
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        ready, _, _ = select.select([fd], [], [], PIPE_WAIT)
        if not ready:
            what = "named pipe" if stat.S_ISFIFO(os.fstat(fd).st_mode) else "device"
            raise ReaderError(f"{path}: a {what} with nothing written to it for {PIPE_WAIT:g} s; give a regular file")
        try:
            chunk = os.read(fd, min(65536, limit + 1 - size))
        except BlockingIOError:     # woken without data (another reader took it)
            continue
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def open_output(path: str, *, append: bool = False, binary: bool = False, block: bool = True) -> IO:
    """``path`` opened for writing (created, truncated unless ``append``) without waiting for a reader: a
    named pipe nobody reads would stop ``open`` forever, so it is an OSError (ENXIO) instead.
    ``block=False`` keeps writes to a pipe non-blocking (the runtime monitor: a full pipe is a failed
    write the monitor reports, never a stalled training step); regular files are unaffected."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | (os.O_APPEND if append else os.O_TRUNC) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise OSError(e.errno, "a named pipe that nobody reads", path) from None
        raise
    if block or stat.S_ISREG(os.fstat(fd).st_mode):
        os.set_blocking(fd, True)
    mode = ("a" if append else "w") + ("b" if binary else "")
    return os.fdopen(fd, mode) if binary else os.fdopen(fd, mode, encoding="utf-8")


def open_pipe_early(path: str, *, binary: bool = False) -> IO | None:
    """``path`` opened for writing now when it is a named pipe (else None: a regular file is opened when its content
    is ready, so a failed run leaves it untouched). A pipe nobody reads is refused at once (OSError ENXIO) instead
    of after the report is rendered; one with a reader is held open, since closing it would end the reader."""
    try:
        if not stat.S_ISFIFO(os.stat(path).st_mode):
            return None
    except (OSError, ValueError):
        return None
    return open_output(path, binary=binary)


def decode(data: bytes, where: str, limit: int = MAX_FILE_BYTES) -> str:
    """``data`` (at most ``limit`` bytes) as UTF-8 text; ReaderError naming ``where`` otherwise."""
    if len(data) > limit:
        raise ReaderError(f"{where}: larger than {_size(limit)}; memguard reads configs and launch scripts up to that size")
    if data.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):   # (UTF-32's mark starts as UTF-16's)
        raise ReaderError(f"{where}: UTF-32 text (a byte-order mark {' '.join(f'0x{b:02x}' for b in data[:4])}); "
                          "save it as UTF-8")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):   # Windows editors' "Unicode"
        raise ReaderError(f"{where}: UTF-16 text (a byte-order mark 0x{data[0]:02x} 0x{data[1]:02x}); save it as UTF-8")
    head = data[:64] if len(data) % 2 == 0 else b""
    if len(head) >= 4 and b"\x00" in head:
        # UTF-16 without a mark (Python's 'utf-16-le', iconv): ASCII text with a NUL after (or before) every character;
        # YAML's "unacceptable character #x0000" or JSON's "Expecting value" do not say what the file is
        for zeros, other, order in ((head[1::2], head[0::2], "little"), (head[0::2], head[1::2], "big")):
            if not zeros.strip(b"\x00") and b"\x00" not in other:
                raise ReaderError(f"{where}: UTF-16 text without a byte-order mark ({order}-endian: a NUL byte beside "
                                  "every character); save it as UTF-8")
    try:
        return data.decode("utf-8").removeprefix("\ufeff")    # a UTF-8 byte-order mark (JSON's parser refuses it)
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ReaderError(f"{where}:{line}:{col}: not UTF-8 text (byte 0x{data[e.start]:02x}); is this a config file?") from None


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n % 2**20 == 0 else f"{n:,} bytes"


def load_yaml(text: str, where: str) -> Any:
    """A YAML document (safe types only) within the nesting and size limits; ReaderError
    ``where:LINE:COL: YAML syntax error: ...`` otherwise."""
    try:
        try:
            return _compose(_Loader, text)
        except yaml.YAMLError as e:
            if "maximum nesting depth" not in str(getattr(e, "problem", "")) or _Loader._parser is _PyParser:
                raise
            # the levels up to libyaml's stop hold level MAX_DEPTH + 1: compose that much in Python
            mark = getattr(e, "problem_mark", None)
            return _compose(_PyLoader, text if mark is None else text[:mark.index + 1])
    except yaml.YAMLError as e:
        raise ReaderError(yaml_error(e, where)) from None
    except (ValueError, TypeError, OverflowError) as e:  # a constructor refusing a value (a bad date, base64)
        raise ReaderError(f"{where}: YAML value error: {e}") from None


def yaml_error(e: yaml.YAMLError, where: str) -> str:
    """PyYAML's error (several lines) as one: ``where:LINE:COL: YAML syntax error: problem (context)``."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    pos = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None else where
    problem = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    cmark = getattr(e, "context_mark", None)
    if context and cmark is not None and cmark is not mark:
        context = f"{context} at {cmark.line + 1}:{cmark.column + 1}"
    what = "YAML syntax error" if isinstance(e, (yaml.scanner.ScannerError, yaml.parser.ParserError)) else "YAML error"
    return f"{pos}: {what}: {problem}" + (f" ({context})" if context else "")


def json_int(text: str) -> int | str:
    """``json.loads``' ``parse_int``: integers longer than 40 digits stay text (Python refuses more than
    4300 digits, and such a number is out of every range memguard checks)."""
    if len(text) <= _MAX_INT_DIGITS:     # (the common case, first: a run log holds millions of integers)
        return int(text)
    return text if len(text.lstrip("-")) > _MAX_INT_DIGITS else int(text)


def load_json(text: str, where: str) -> Any:
    """A JSON document within the nesting and size limits; ReaderError ``where:LINE:COL: JSON syntax
    error: ...`` otherwise. Integers longer than 40 digits stay text (out of every range)."""
    try:
        doc = json.loads(text, parse_int=json_int)
    except json.JSONDecodeError as e:
        raise ReaderError(f"{where}:{e.lineno}:{e.colno}: JSON syntax error: {e.msg}") from None
    except RecursionError:
        raise ReaderError(f"{where}: JSON nested deeper than {MAX_DEPTH} levels") from None
    check_shape(doc, where)
    return doc


def check_shape(doc: Any, where: str) -> None:
    """Refuse a parsed document nested deeper than MAX_DEPTH or holding more than MAX_VALUES values
    (shared sub-documents counted once per use, as a reader walking them sees them)."""
    size: dict[int, int] = {}
    total = _measure(doc, size, 1, where)
    if total > MAX_VALUES:
        raise ReaderError(f"{where}: more than {MAX_VALUES:,} values; memguard reads training configs up to that size")


def _measure(node: Any, size: dict[int, int], depth: int, where: str) -> int:
    if not isinstance(node, (dict, list)):
        return 1
    if id(node) in size:
        return size[id(node)]
    if depth > MAX_DEPTH:
        raise ReaderError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    items = list(node.keys()) + list(node.values()) if isinstance(node, dict) else node
    n = 1
    for x in items:
        n += _measure(x, size, depth + 1, where)
        if n > MAX_VALUES:
            break
    size[id(node)] = n
    return n


_READ_CACHE: dict[tuple, tuple[bool, Any]] = {}
_READ_CACHE_SIZE = 16
_RACY_NS = 50_000_000   # a file changed this close to its read may change again unseen (mtime ticks are coarse)


def read_once(load: Callable[..., T], path: str, *extra: Hashable) -> T:
    """``load(path, *extra)``, once per version of the file (its path, absolute path, inode, modification time and
    size), its ReaderError kept too: memguard plan resolves a config for every candidate layout (1,122 for a small
    MoE model on 8 GPUs), and a file a config names (--tp-comm-overlap-cfg, --heterogeneous-layers-config-path) was
    read and parsed again each time (a hostile one took 0.16 s a read: 3 minutes). ``load`` is a module-level
    function (part of the key) whose result the callers only read. A read within 50 ms of the file's last change
    is not kept: another write in the same clock tick, of the same size, would look like the same version."""
    try:
        st = os.stat(path)
    except OSError:     # (load names the problem; nothing to cache)
        return load(path, *extra)
    # (taken before the read, which may take long; a modification time in the future is no race: a write resets it)
    racy = abs(time.time_ns() - st.st_mtime_ns) <= _RACY_NS
    key = (load, path, os.path.abspath(path), st.st_ino, st.st_mtime_ns, st.st_size, extra)
    hit = _READ_CACHE.get(key)
    if hit is None:
        try:
            hit = True, load(path, *extra)
        except ReaderError as e:
            hit = False, e
        if not racy:
            if len(_READ_CACHE) >= _READ_CACHE_SIZE:
                del _READ_CACHE[next(iter(_READ_CACHE))]    # (the oldest entry)
            _READ_CACHE[key] = hit
    ok, value = hit
    if not ok:
        raise value.with_traceback(None)    # (a fresh traceback: the one error object is raised per candidate)
    return value
