"""Section: TP communication overlap (``--tp-comm-overlap`` and its ``--tp-comm-overlap-cfg`` YAML).

Megatron's ``_initialize_tp_communicators`` (megatron/training/initialize.py, core 0.19.2) hands the
YAML to Transformer Engine's ``initialize_ub`` as ``ub_cfgs``: one entry per GEMM (``qkv_fprop`` ...
``fc2_wgrad``). Of each entry only three keys decide the size of the userbuffer TE allocates
(transformer_engine/pytorch/module/base.py, TE 2.11): ``method``, ``is_reduce_scatter`` and
``fp8_buf``; the rest (SMs, CGA size, splits, priorities, atomic GEMM) are scheduling. This section
keeps those three as ``"gemm.key=value"`` words (a frozen, JSON-friendly form); the bytes are
``megatron_memguard.estimator.userbuffers``'s.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import ReaderError
from ..estimator.userbuffers import UB_GEMMS, ub_problems
from ..numbers import shown
from .args import Args, Context

UB_METHODS = ("ring_exchange", "pipeline", "bulk", "external")
# the keys that change a buffer's size (the others only schedule the overlap)
SIZE_KEYS = ("method", "is_reduce_scatter", "fp8_buf")


def _truth(v: Any) -> bool | None:
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        return bool(v)
    if isinstance(v, (list, tuple)):
        # TE tests the value's truth (``cfg.get("fp8_buf", False) and ...``): Megatron-Bridge 0.6.2's
        # PipelineOverlapCfg defaults fp8_buf to the tuple (False,), which is true (a list once dumped to YAML)
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return None


def ub_cfg_words(doc: Any, where: str) -> tuple[tuple[str, ...], list[str]]:
    """The size-deciding settings of a ``ub_cfgs`` document as sorted ``"gemm.key=value"`` words, and the
    problems found (one line each, empty when the document is valid). Pure."""
    if doc is None:
        return (), []
    if not isinstance(doc, Mapping):
        return (), [f"{where}: must be a mapping of GEMM names ({', '.join(UB_GEMMS[:3])}, ...) to settings"]
    words: list[str] = []
    problems: list[str] = []
    for gemm, entry in doc.items():
        if gemm not in UB_GEMMS:
            # initialize_ub only looks up its own twelve names: other keys are never read
            continue
        if entry is None:   # (Megatron-Bridge's dataclass leaves a GEMM it does not configure as None)
            continue
        if not isinstance(entry, Mapping):
            problems.append(f"{where}: {gemm} must be a mapping of settings")
            continue
        for key in SIZE_KEYS:
            if key not in entry or entry[key] is None:
                continue
            v = entry[key]
            if key == "method":
                if v not in UB_METHODS:
                    problems.append(f"{where}: {gemm}.method must be one of {', '.join(UB_METHODS)}, got {shown(v)}")
                    continue
                words.append(f"{gemm}.method={v}")
            else:
                b = _truth(v)
                if b is None:
                    problems.append(f"{where}: {gemm}.{key} must be true or false, got {shown(v)}")
                    continue
                words.append(f"{gemm}.{key}={int(b)}")
    return tuple(sorted(words)), problems


# TransformerConfig.symmetric_ar_type's Literal (core 0.16.1 and 0.19.2)
SYMMETRIC_AR_TYPES = ("two_shot", "one_shot", "multimem_all_reduce")


def tp_overlap(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """``--tp-comm-overlap-cfg``: a YAML file (or, from a reader, the mapping itself); and
    ``--symmetric-ar-type``, TE's symmetric-memory all-reduce of the row-parallel linears."""
    sym = a.get("symmetric_ar_type")
    if sym in ("", "None", "none"):
        sym = None
    if sym is not None and sym not in SYMMETRIC_AR_TYPES:
        a.fail("symmetric_ar_type", f"must be one of {', '.join(SYMMETRIC_AR_TYPES)}, got {shown(sym)}")
        sym = None
    return dict(symmetric_ar_type=sym, tp_comm_overlap_cfg=_ub_cfg(a, kw))


def _load_ub_file(path: str) -> Any:
    from ..files import load_yaml, read_text
    return load_yaml(read_text(path), path)


def _ub_cfg(a: Args, kw: Mapping[str, Any]) -> tuple[str, ...]:
    if not kw.get("tp_comm_overlap"):
        return ()
    cfg = a.get("tp_comm_overlap_cfg")
    if cfg is None or cfg == "":
        return ()
    doc: Any = cfg
    where = a.key("tp_comm_overlap_cfg")
    if isinstance(cfg, str):
        try:
            # once per file version (files.read_once): memguard plan resolves it for every candidate layout
            from ..files import read_once
            doc = read_once(_load_ub_file, cfg)
        except ReaderError as e:
            a.fail("tp_comm_overlap_cfg", f"cannot read the userbuffer configuration: {e}",
                   "give the YAML file Megatron reads, or leave the flag out for Transformer Engine's defaults")
            return ()
    words, problems = ub_cfg_words(doc, where if not isinstance(cfg, str) else cfg)
    for p in problems:
        a.fail("tp_comm_overlap_cfg", p)
    for gemm, rule in ([] if problems else ub_problems(words)):
        a.fail("tp_comm_overlap_cfg", f"{gemm} {rule}")
    return words
