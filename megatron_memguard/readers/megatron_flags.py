"""Megatron command-line flags, spelled as ``megatron/training/arguments.py`` spells them.

The option table (``data/megatron_flags.json``) is read off the real parser of megatron-core 0.19.2:
it tells, for each of Megatron's ~840 option strings, its ``dest`` and whether a value follows. That
lets memguard skip every flag that does not matter for memory (``--lr 3e-4``, ``--data-path a b c``)
without misreading the next token. Accepted beyond argparse: ``--flag=value``, underscores in flag
names (``--num_layers``), and ``--no-FLAG`` to switch off a store-true ``--FLAG``.
"""
from __future__ import annotations

import json
import re
import unicodedata
from functools import lru_cache
from importlib import resources
from typing import Any, Iterable, Mapping

from ..config import RawConfig, memory_env
from ..errors import ConfigError
from ..numbers import INT64_MAX, cut, integral, shown

# Flags of older Megatron releases that the 0.19 parser no longer has, but that change what memguard reads.
_LEGACY_FLAGS = {
    "--hybrid-override-pattern": ["hybrid_layer_pattern", "value", "str"],
    "--num-experts": ["num_experts", "value", "int"],
    # megatron-core 0.16.1: the legacy GroupedMLP (one weight per fc for all local experts), gone in 0.19.
    "--moe-use-legacy-grouped-gemm": ["moe_use_legacy_grouped_gemm", "true"],
    # Model Optimizer knowledge distillation (Megatron-LM's modelopt integration): a teacher model too.
    "--export-kd-teacher-load": ["export_kd_teacher_load", "value", "str"],
    "--export-kd-cfg": ["export_kd_cfg", "value", "str"],
}
# Value types the JSON table cannot hold (Megatron's own type functions).
_TYPES = {"--moe-layer-freq": "moe_freq"}
# nargs='+' in 0.19 (one value in 0.16.1); validate_args turns a one-element list into the value.
_UNWRAP_SINGLE = frozenset({"moe_router_load_balancing_type", "moe_aux_loss_coeff"})
# The ``choices`` of Megatron's argparse (megatron/training/arguments.py, megatron-core 0.19.2) for the
# flags of memory features: Megatron refuses any other value at start-up, even when the feature is off.
_CHOICES = {
    "--fp8-format": ("e4m3", "hybrid"),
    "--fp8-recipe": ("tensorwise", "delayed", "mxfp8", "blockwise", "custom"),
    "--fp8-amax-compute-algo": ("most_recent", "max"),
    "--fp4-format": ("e2m1",),
    "--fp4-recipe": ("nvfp4", "custom"),
    "--moe-router-score-function": ("softmax", "sigmoid", "sqrtsoftplus"),
    "--moe-router-dtype": ("fp32", "fp64"),
    "--moe-token-dispatcher-type": ("allgather", "alltoall", "flex"),
    "--moe-flex-dispatcher-backend": ("deepep", "hybridep", "ncclep"),
    "--moe-token-drop-policy": ("probs", "position"),
    "--moe-router-load-balancing-type": ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn",
                                         "quantile_balancing", "none"),
    "--cuda-graph-impl": ("none", "local", "transformer_engine", "full_iteration"),
    "--softmax-type": ("vanilla", "off-by-one", "learnable"),     # (TransformerConfig's Literal; it picks TE's kernel)
    "--symmetric-ar-type": ("two_shot", "one_shot", "multimem_all_reduce"),
    "--data-parallel-sharding-strategy": ("no_shard", "optim", "optim_grads", "optim_grads_params"),
    "--outer-dp-sharding-strategy": ("no_shard", "optim"),
    "--main-grads-dtype": ("fp32", "bf16"),
    "--main-params-dtype": ("fp32", "fp16"),
    "--exp-avg-dtype": ("fp32", "fp16", "bf16", "fp8"),
    "--exp-avg-sq-dtype": ("fp32", "fp16", "bf16", "fp8"),
    "--megatron-fsdp-main-params-dtype": ("fp32", "bf16", "fp16", "auto"),
    "--megatron-fsdp-main-grads-dtype": ("fp32", "bf16", "fp16", "auto"),
    "--megatron-fsdp-grad-comm-dtype": ("fp32", "fp16", "bf16", "auto"),
    "--muon-scalar-optimizer": ("adam", "lion"),
    "--muon-tp-mode": ("blockwise", "duplicated", "distributed"),
    "--muon-scale-mode": ("spectral", "unit_rms_norm", "shape_scaling"),
    "--muon-fp32-matmul-prec": ("low", "medium", "high"),    # ('low' then fails in torch: resolve/muon.py)
    "--optimizer": ("adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"),
    # TransformerConfig's Literals, made argparse choices by ArgumentGroupFactory (training/argument_utils.py)
    "--experimental-attention-variant": ("gated_delta_net", "dsa"),
    "--dsa-kernel-backend": ("none", "tilelang", "cudnn"),
}
# digits beyond int()'s limit on a string's length (sys.get_int_max_str_digits, 4300): argparse refuses them too,
# memguard names the bound of the setting instead
_LONG_DIGITS = re.compile(r"\s*[+-]?[0-9][0-9_]{4000,}\s*")


def unevaluated_fix(flag: str) -> str:
    """How to give memguard a value a launch script computes with a program (resolve/args.py's error too); ``flag`` is
    a Megatron flag, or the key of a NeMo / Bridge ``KEY=VALUE`` override on the launch line."""
    if not flag.startswith("-"):
        return (f"write the value into the script, or give it to memguard: memguard check --file SCRIPT --set "
                f"{flag}=VALUE overrides the script's")
    return (f"write the value into the script, or give it after memguard's --: memguard estimate --config SCRIPT -- "
            f"{flag} VALUE overrides the script's")


def unevaluated_overrides(tokens: Iterable[str], kept: Mapping[str, int]) -> dict[str, str]:
    """The NeMo / Bridge ``KEY=VALUE`` overrides of a launch line whose value holds a command substitution or an
    arithmetic expansion memguard kept as written (``kept``: construct -> line): key (as the readers name it in
    ``RawConfig.origin``, without Hydra's ``+`` / ``++``) -> what the value is and where. A later override of the key
    (memguard's own ``--set``) replaces the text, as it replaces the value."""
    from ._common import is_override_token
    out: dict[str, str] = {}
    seen: dict[str, str | None] = {}     # (a launch line repeating one value 30,000 times reads it once)
    for tok in tokens:
        tok = str(tok)
        if not is_override_token(tok) or "=" not in tok:
            continue
        key, value = tok.split("=", 1)
        if value not in seen:
            seen[value] = _unevaluated(value, kept)
        what = seen[value]
        out.pop(key.lstrip("+"), None)
        if what:
            out[key.lstrip("+")] = what
    return out

_PLACEHOLDER = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")
_UNSET_REF = re.compile(r"\$(?:\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z_][A-Za-z0-9_]*)")   # a whole word: $VAR, ${VAR}


@lru_cache(maxsize=1)
def flag_table() -> dict[str, list]:
    text = resources.files("megatron_memguard").joinpath("data/megatron_flags.json").read_text()
    table = json.loads(text)["flags"]
    for k, v in _LEGACY_FLAGS.items():
        table.setdefault(k, v)
    for k, typ in _TYPES.items():
        table[k] = [*table[k][:2], typ]
    return table


def _refuse_unicode_dash(tok: str, table: Mapping[str, Any]) -> None:
    """A Megatron flag written with a typographic dash (an em dash or a minus sign, pasted from a document):
    Megatron's argparse takes it for a stray argument and exits, so it is refused here too, by name."""
    head = tok[:2]
    if not head or head[0].isascii() or unicodedata.category(head[0]) != "Pd" and head[0] not in "\u2212\ufe63\uff0d":
        return
    body = tok.lstrip("-\u2010\u2011\u2012\u2013\u2014\u2015\u2212\ufe58\ufe63\uff0d").split("=", 1)[0]
    flag = "--" + body.replace("_", "-")
    if body and flag in table:
        raise ConfigError(cut(tok), f"starts with {unicodedata.name(head[0], 'a dash').lower()} (U+{ord(head[0]):04X}), "
                          "not '--': Megatron's argparse does not recognise it and exits", f"write {flag}")


def _is_flag(tok: str) -> bool:
    return tok.startswith("--") and len(tok) > 2


def _choice(value: Any, name: str, tok: str) -> Any:
    """``value`` if Megatron's argparse takes it for the flag ``name`` (written ``tok``), else the error
    argparse would stop at (placeholders are left for the resolver)."""
    allowed = _CHOICES.get(name)
    if allowed is not None and isinstance(value, str) and value not in allowed and not has_placeholder(value):
        raise ConfigError(tok, f"must be one of {', '.join(allowed)} (Megatron's choices), got {shown(value)}")
    return value


def _convert(value: str, typ: str | None, flag: str) -> Any:
    if typ in ("int", "float") and has_placeholder(value):
        raise ConfigError(flag, f"has the unresolved placeholder {shown(value)}; set it in the environment or edit the value")
    if typ == "moe_freq":
        if has_placeholder(value):
            raise ConfigError(flag, f"has the unresolved placeholder {shown(value)}; set it in the environment or edit the value")
        from .moe_freq import parse_moe_layer_freq
        return parse_moe_layer_freq(value, flag)
    if typ == "int":
        # Megatron's argparse reads the flag with type=int (megatron/training/arguments.py, core 0.19.2 and
        # 0.16.1): int() refuses '4.0', '1e3' and '1e-400' at start-up, so memguard does too. One beyond 64 bits
        # (or beyond int()'s digit limit) stays text: resolve() refuses it with the bound of its setting when
        # memguard computes with it (memory-neutral flags are not checked).
        if not _LONG_DIGITS.fullmatch(value):
            try:
                int(value)
            except ValueError:
                raise ConfigError(flag, f"must be an integer, got {shown(value)} (Megatron's argparse reads it "
                                  "with type=int: digits only)") from None
        n = integral(value, flag)
        return n if abs(n) <= INT64_MAX else value
    if typ == "float":
        try:
            return float(value)
        except ValueError:
            raise ConfigError(flag, f"expects a number, got {shown(value)}") from None
    if value.startswith("AttnBackend."):
        return value.split(".", 1)[1]
    return value


def parse_megatron_flags(
    argv: Iterable[str],
    env: Mapping[str, str] | None = None,
    source: str = "megatron flags",
    expand: bool = True,
    refuse_overrides: bool = False,
    kept: Mapping[str, int] | None = None,
) -> RawConfig:
    """Read Megatron flags into a RawConfig. ``env`` fills ``${VAR}`` placeholders where given, unless
    ``expand`` is False: the flags of a launch command, which the shell reader expanded already (bash
    expands once; a value is not expanded again). With ``refuse_overrides`` (the CLI's flags after ``--``)
    a stray ``KEY=VALUE`` token is an error: the user meant an override, which Megatron flags do not take.
    ``kept``: a launch script's command substitutions / arithmetic expansions kept as written, with their lines; a flag
    whose value holds one is taken as text and listed in ``RawConfig.unevaluated`` (an error only where a rule reads it:
    bash runs ``--seed $(date +%s)``'s program, and memguard needs no seed)."""
    table = flag_table()
    toks = [str(t) for t in argv]
    args: dict[str, Any] = {}
    origin: dict[str, str] = {}
    warnings: list[str] = []
    unknown: list[str] = []
    strays: list[str] = []
    unevaluated: dict[str, str] = {}
    i = 0
    while i < len(toks):
        tok = toks[i]
        i += 1
        if not _is_flag(tok):
            _refuse_unicode_dash(tok, table)
            if refuse_overrides:
                from ._common import is_override_token
                if is_override_token(tok):
                    raise ConfigError(cut(tok), "a KEY=VALUE override applies to a NeMo / Megatron-Bridge / NeMo 2 YAML "
                                      "(--config FILE) or a Bridge recipe (--model RECIPE), not to Megatron flags",
                                      "give the Megatron flag instead, e.g. --micro-batch-size 2")
            strays.append(tok)
            continue
        inline = None
        if "=" in tok:
            tok, inline = tok.split("=", 1)
        name = "--" + tok[2:].replace("_", "-")
        spec = table.get(name) or table.get(tok)
        negate = False
        if spec is None and name.startswith("--no-"):
            pos = table.get("--" + name[5:])
            if pos is not None and pos[1] == "true":
                spec, negate = pos, True
        if spec is None:
            # Unknown to Megatron 0.19: take what follows as its values so we do not misread them.
            unknown.append(tok)
            if inline is None:
                while i < len(toks) and not _is_flag(toks[i]):
                    i += 1
            continue
        dest, kind = spec[0], spec[1]
        typ = spec[2] if len(spec) > 2 else None
        if kind in ("true", "false", "boolopt"):
            # What the bare flag stores; ``--flag=false`` stores the opposite.
            val = not name.startswith("--no-") if kind == "boolopt" else kind == "true"
            if inline is not None:
                word = inline.strip().lower()
                if word not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                    raise ConfigError(tok, f"is a switch: write {tok} or {tok}=false, not {tok}={inline}")
                val = val if word in ("1", "true", "yes", "on") else not val
            args[dest] = (not val) if negate else val
        elif kind == "value":
            if inline is None:
                if i >= len(toks) or (_is_flag(toks[i]) and not _is_number(toks[i])):
                    raise ConfigError(tok, "expects a value")
                inline = toks[i]
                i += 1
            shell = _unevaluated(inline, kept)
            if shell:
                args[dest], unevaluated[dest] = inline, shell
            else:
                args[dest] = _choice(_convert(_substitute(inline, env if expand else None, tok), typ, tok), name, tok)
        else:  # list
            vals = [] if inline is None else [inline]
            while inline is None and i < len(toks) and not _is_flag(toks[i]):
                vals.append(toks[i])
                i += 1
            shell = next(filter(None, (_unevaluated(v, kept) for v in vals)), None)
            if shell:
                args[dest], unevaluated[dest] = vals, shell
                origin[dest] = tok
                continue
            args[dest] = [_choice(_convert(_substitute(v, env if expand else None, tok), typ, tok), name, tok)
                          for v in vals]
            if dest in _UNWRAP_SINGLE and len(args[dest]) == 1:
                args[dest] = args[dest][0]
        origin[dest] = tok
    # an unset $VAR of a launch script stays as written: bash would expand it to nothing (one note, apart)
    unset = [w for w in strays if _UNSET_REF.fullmatch(str(w))]
    if unset:
        strays = [w for w in strays if not _UNSET_REF.fullmatch(str(w))]
        warnings.append(f"{_first(unset, shown)} not set in the script or its environment: read as nothing, as bash "
                        "expands an unset variable (set it to check what it adds)")
    # one note each, the first few named (a launch line of 470,000 stray words printed 470,000 notes)
    if len(strays) == 1:
        warnings.append(f"ignored stray argument {shown(strays[0])} (not after a flag that takes a value)")
    elif strays:
        warnings.append(f"ignored {len(strays)} stray arguments {_first(strays, shown)} (not after a flag that takes "
                        "a value)")
    if unknown:
        warnings.append("not Megatron flags (as of core 0.19), ignored: " + _first(unknown, cut, " "))
    if args.get("yaml_cfg"):
        if "yaml_cfg" in unevaluated:
            raise ConfigError(origin["yaml_cfg"], f"is {unevaluated['yaml_cfg']}", unevaluated_fix(origin["yaml_cfg"]))
        return _read_yaml_cfg(str(args["yaml_cfg"]), [origin[d] for d in args if d != "yaml_cfg"], env, warnings)
    return RawConfig(args=args, origin=origin, source=source, warnings=tuple(warnings), env=memory_env(env),
                     megatron_command_line=True, unevaluated=unevaluated)


def _unevaluated(value: str, kept: Mapping[str, int] | None) -> str | None:
    """What the shell text in a launch script's flag value is and where (``kept``: construct -> line), None when the
    value holds none (or the flags are not a launch script's)."""
    if kept is None or ("$(" not in value and "`" not in value):
        return None
    from .shell import kept_construct
    c = kept_construct(value)
    if c is None:
        return None
    line = kept.get(c)
    where = f" (line {line})" if line else ""
    if c.startswith("$((") and "$(" not in c[3:] and "`" not in c:
        return f"{shown(c)}{where}, an arithmetic expansion memguard does not evaluate (++, =, ?:, a comma or base#)"
    return f"{shown(c)}{where}, a command substitution: bash runs the program when the job starts, memguard does not"


def _first(items: list[str], show, sep: str = ", ", n: int = 10) -> str:
    """``items`` shown; past ``n`` of them, the first ``n`` distinct ones and how many there are in all."""
    if len(items) <= n:
        return sep.join(show(x) for x in items)
    distinct = list(dict.fromkeys(items))
    return sep.join(show(x) for x in distinct[:n]) + f"{sep}... ({len(items):,} in all)"


def _read_yaml_cfg(path: str, other_flags: list[str], env: Mapping[str, str] | None, warnings: list[str]) -> RawConfig:
    """``--yaml-cfg FILE``: Megatron's parse_args replaces every argument by the file's (megatron/training/
    arguments.py, 0.19.2); the path is taken as memguard's working directory sees it."""
    from ..errors import ReaderError
    from ..files import load_yaml, read_text
    from .megatron_yaml_cfg import read_yaml_cfg

    try:
        doc = load_yaml(read_text(path), path)
        raw = read_yaml_cfg(doc, path, env=env, ignored_flags=other_flags)
    except ReaderError as e:
        raise ReaderError(f"--yaml-cfg: {e}") from None
    return RawConfig(args=raw.args, origin=raw.origin, source=raw.source, warnings=tuple(warnings) + raw.warnings,
                     problems=raw.problems, env=raw.env)


def _is_number(tok: str) -> bool:
    try:
        float(tok)
        return True
    except ValueError:
        return False


def _substitute(value: str, env: Mapping[str, str] | None, flag: str) -> str:
    """Fill ``${VAR}`` from ``env``; leave unresolved placeholders for the resolver to judge."""
    if "$" not in value or not env:
        return value
    return _PLACEHOLDER.sub(lambda m: str(env.get(m.group(1), m.group(0))), value)


def has_placeholder(value: Any) -> bool:
    return isinstance(value, str) and bool(_PLACEHOLDER.search(value))


def flags_from_mapping(mapping: Mapping[str, Any]) -> list[str]:
    """A YAML mapping of flags (``--num-layers: 12``, ``--bf16: true``) as a command line."""
    argv: list[str] = []
    for k, v in mapping.items():
        flag = str(k) if str(k).startswith("-") else "--" + str(k)
        if v is True:
            argv.append(flag)
        elif v is False or v is None:
            continue
        elif isinstance(v, (list, tuple)) and (flag_table().get(flag) or [None, None, None])[2:] == ["moe_freq"]:
            # a YAML list for --moe-layer-freq: the pattern, written as Megatron's list expression
            argv.extend([flag, "[" + ",".join(str(x) for x in v) + "]"])
        elif isinstance(v, (list, tuple)):
            argv.append(flag)
            argv.extend(str(x) for x in v)
        elif (isinstance(v, str) and len(v) > 1 and v[0] == "[" and v[-1] == "]"
              and (flag_table().get(flag) or [None, None])[1] == "list"):
            # a list written as one YAML string, as Megatron's functional tests do ("[2 2]"); flags that
            # take one value (--moe-layer-freq "[1,0,1]", a Python expression) keep it whole
            argv.append(flag)
            argv.extend(x.strip("'\"") for x in re.split(r"[\s,]+", v[1:-1]) if x.strip("'\""))
        elif isinstance(v, str) and (flag_table().get(flag) or [None, None])[1] == "list" and len(v.split()) > 1:
            # a list written as plain words ("core_attn mlp"): the CI launcher joins MODEL_ARGS into one
            # command line that the shell splits into words, so each word is one value of the nargs flag
            argv.append(flag)
            argv.extend(v.split())
        else:
            argv.extend([flag, str(v)])
    return argv
