"""Reading one raw setting: the typed accessors every resolve section uses, and the error list.

A bad value is recorded (with the flag or key the user wrote) and the default taken, so that the
sections after it still run and ``memguard validate`` lists every problem at once.
"""
from __future__ import annotations

from typing import Any, Mapping

from packaging.version import Version

from ..config import RawConfig
from ..errors import ConfigError
from ..numbers import bound_reason, python_scalar, shown, to_float, to_int, upper_bound

_DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16", "bfloat16": "bf16",
                "fp16": "fp16", "float16": "fp16", "half": "fp16", "fp8": "fp8", "uint8": "fp8"}


# options whose value readers may give as a structure: Bridge's nested-list layout, a userbuffers config or a
# heterogeneous block config written inline
_DOCUMENTS = {"pipeline_model_parallel_layout", "tp_comm_overlap_cfg", "heterogeneous_layers_config_encoded_json"}


def _plain(v: Any) -> bool:
    """One value: not a container, and hashable (an enum member validate_args made is one)."""
    if isinstance(v, (list, tuple, dict, set, frozenset)):
        return False
    try:
        hash(v)
    except TypeError:
        return False
    return True


def _kind(dest: str) -> str | None:
    """How Megatron's option for ``dest`` takes its value: "value" (one plain str / int / float; not a list
    expression such as --moe-layer-freq), "list" (nargs), or None (a switch, or not a Megatron option)."""
    from ..readers.megatron_flags import flag_table
    for spec in flag_table().values():
        if spec[0] == dest:
            if spec[1] == "value":
                return "value" if len(spec) > 2 and spec[2] in ("str", "int", "float") else None
            return "list" if spec[1] == "list" else None
    return None


class Context:
    """What sections need besides the raw arguments and the flat names resolved so far: the Megatron
    version and the caller's overrides."""

    def __init__(self, version: Version, world_size: int | None, vocab_size: int | None):
        self.version = version
        self.legacy = version < Version("0.18")   # NullTokenizer's extra EOD token, TE cross entropy
        self.world_size = world_size
        self.vocab_size = vocab_size


class Stop(Exception):
    """A section cannot go on (a required value is missing or broken); its error is already recorded."""


class _Watched(dict):
    """The raw arguments, reporting the first read of a value memguard cannot know (``RawConfig.unevaluated``: a launch
    script's ``$(nproc)``) as one error and stopping there: only a setting a rule needs is an error."""

    def __init__(self, args: Mapping[str, Any], unevaluated: Mapping[str, str], stop: Any):
        super().__init__(args)
        self.unevaluated = dict(unevaluated)
        self.stop = stop

    def get(self, dest: Any, default: Any = None) -> Any:
        if dest in self.unevaluated:
            self.stop(dest)
        return super().get(dest, default)

    def __getitem__(self, dest: Any) -> Any:
        if dest in self.unevaluated:
            self.stop(dest)
        return super().__getitem__(dest)

    def __setitem__(self, dest: Any, value: Any) -> None:
        self.unevaluated.pop(dest, None)      # (a value a section derived replaces the text)
        super().__setitem__(dest, value)


class Args:
    """The raw arguments of one config (flat Megatron dests), with the errors and notes found so far."""

    def __init__(self, raw: RawConfig):
        self.raw = raw
        self.a: dict[str, Any] = _Watched(raw.args, raw.unevaluated, self._unevaluated) if raw.unevaluated \
            else dict(raw.args)
        self.errors: list[ConfigError] = []
        self.notes: list[str] = list(raw.warnings)

    def _unevaluated(self, dest: str) -> None:
        from ..readers.megatron_flags import unevaluated_fix
        self.fail(dest, f"is {self.raw.unevaluated[dest]}", unevaluated_fix(self.key(dest)))
        raise Stop

    def given(self, dest: str) -> bool:
        # (presence only: a --save $(pwd)/ckpt is given whatever the program prints)
        return dict.get(self.a, dest) is not None

    def get(self, dest: str, default: Any = None) -> Any:
        v = self.a.get(dest)
        if v is None:
            return default
        if not isinstance(v, (str, int, float)):
            # (a reader of Python objects, e.g. Megatron's namespace or a Bridge dict, passes any object on: the
            # layout keeps only what Megatron's option would hold, and it is hashed)
            kind = _kind(dest)
            if kind == "value" and dest not in _DOCUMENTS and not _plain(v):
                self.a[dest] = None
                self.fail(dest, f"must be a single value, got {shown(v)}")
                return default
            if kind == "list" and (not isinstance(v, (list, tuple)) or not all(_plain(x) for x in v)):
                self.a[dest] = None
                self.fail(dest, f"must be a list of values, got {shown(v)}")
                return default
        return v

    def key(self, dest: str) -> str:
        return self.raw.key(dest)

    def fail(self, dest: str, rule: str, fix: str | None = None, *, fails_later: str | None = None) -> None:
        """Record a broken rule; ``fails_later``: where Megatron stops on it after validate_args accepted it."""
        self.errors.append(ConfigError(self.key(dest) if dest else "", rule, fix, fails_later=fails_later))

    def int_arg(self, dest: str, default: int | None = None, required: bool = False, minimum: int = 1) -> int | None:
        v = self.a.get(dest)
        if v is None:
            if required:
                self.fail(dest, "is required")
                return None
            return default
        try:
            return to_int(v, self.key(dest), minimum, upper_bound(dest), bound_reason(dest))
        except ConfigError as e:
            self.errors.append(e)
            return default

    def bool_arg(self, dest: str, default: bool) -> bool:
        v = self.a.get(dest)
        if v is None:
            return default
        if isinstance(v, str):
            word = v.strip().lower()
            if word in ("1", "true", "yes", "on"):
                return True
            if word in ("0", "false", "no", "off", ""):
                return False
            self.fail(dest, f"must be true or false, got {v!r}")
            return default
        v = python_scalar(v)
        if isinstance(v, bool):
            return v
        if isinstance(v, (int, float)) and v in (0, 1):
            return bool(v)
        if not isinstance(v, (int, float, Mapping, list, tuple, set, frozenset)) and type(v).__module__ != "numpy":
            try:   # (another object in Megatron's namespace: its truth, unless it has none)
                return bool(v)
            except Exception:  # noqa: BLE001 - any __bool__ that raises is a value of the wrong kind
                pass
        # (bool() of a mapping, a list or 0.5 is True: a Bridge / YAML value of the wrong kind taken as on)
        self.fail(dest, f"must be true or false, got {shown(v)}")
        return default

    def float_arg(self, dest: str, default: float) -> float:
        v = self.a.get(dest)
        if v is None:
            return default
        try:
            return to_float(v, self.key(dest))
        except ConfigError as e:
            self.errors.append(e)
            return default

    def dtype_arg(self, dest: str, default: str) -> str:
        v = self.a.get(dest)
        if v is None:
            return default
        name = str(v).replace("torch.", "").lower()
        if name not in _DTYPE_NAMES:
            self.fail(dest, f"unknown dtype {v!r}; use fp32, bf16, fp16 or fp8")
            return default
        return _DTYPE_NAMES[name]
