"""``memguard plan --explain [LAYOUT]``: every cost term of the step-time model, two layouts side by side.

Without LAYOUT: the planner's choice (#1) and the runner-up (#2). With LAYOUT: that layout next to the
choice (or next to the runner-up when it is the choice), so a user sees which terms make the difference.

LAYOUT is the compact spelling the planner prints (``Candidate.name``):
``tp=8,pp=4,vpp=5,cp=1,mbs=1,recompute=none`` with optional ``sp=on|off``, ``dist-opt=on|off``,
``first=N,last=N`` (uneven first/last pipeline stages), ``segments=M-M*|M-M*`` (a hybrid pattern's '|'
split). Missing keys take TP=PP=VPP=CP=MBS=1, no
recomputation, SP on when TP > 1 (and TP divides seq / CP), the distributed optimizer on, and the pipeline split the search
would choose.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..estimator import Estimate
from ..knobs import KNOBS
from ..layout import Layout
from ..units import format_bytes
from .search import Planner
from .space import Candidate, Constraints, make_candidate
from .timing import StepTime, rank_list

# The planner's names of the knobs (megatron_memguard/knobs.py), plus spellings people type for dist_opt.
_INT_KEYS = {k.short: k.short for k in KNOBS if k.short and k.kind == "int"}
_BOOL_KEYS = {**{k.short: k.short for k in KNOBS if k.short and k.kind == "bool"}, "dist-opt": "dist_opt", "distopt": "dist_opt"}
_ON = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}


def parse_layout_spec(text: str) -> dict[str, Any]:
    """``tp=8,pp=4,...`` -> keyword arguments of :func:`make_candidate`."""
    out: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        if "=" not in part:
            raise ConfigError("--explain", f"{part!r} is not key=value; write e.g. tp=8,pp=4,vpp=5,cp=1,mbs=1,recompute=none")
        k, v = part.split("=", 1)
        k = k.lower()
        name = _INT_KEYS.get(k) or _BOOL_KEYS.get(k) or ("recompute" if k == "rc" else k)
        if name in seen:   # (the last one won silently: tp=1,tp=2 explained TP 2)
            raise ConfigError("--explain", f"{name} is given twice ({seen[name]!r} and {part!r})")
        seen[name] = part
        if k in _INT_KEYS:
            try:
                iv = int(v)
            except ValueError:
                raise ConfigError("--explain", f"{k} must be an integer, got {v!r}") from None
            if iv < 1 and k not in ("first", "last"):
                raise ConfigError("--explain", f"{k} must be >= 1, got {iv}")
            out[_INT_KEYS[k]] = iv
        elif k in _BOOL_KEYS:
            if v.lower() not in _ON:
                raise ConfigError("--explain", f"{k} must be on or off, got {v!r}")
            out[_BOOL_KEYS[k]] = _ON[v.lower()]
        elif k in ("recompute", "rc"):
            out["recompute"] = v.lower()
        elif k == "fsdp":
            out["fsdp"] = None if v.lower() in ("off", "none") else v.lower()
        elif k == "layout":             # --pipeline-model-parallel-layout (as the planner names it: no commas)
            out["layout"] = v
        elif k == "segments":           # a hybrid pattern with '|' between its pipeline segments
            out["segments"] = v
        elif k == "account":            # embedding, loss or embedding+loss slots in the pipeline split
            words = set(v.lower().split("+"))
            if not words <= {"embedding", "loss"}:
                raise ConfigError("--explain", f"account must be embedding, loss or embedding+loss, got {v!r}")
            out.update(acc_emb="embedding" in words, acc_loss="loss" in words)
        elif k == "fp8":
            recipes = ("off", "delayed", "tensorwise", "blockwise", "mxfp8")
            if v.lower() not in recipes:
                raise ConfigError("--explain", f"fp8 must be one of {', '.join(recipes)}, got {v!r}")
            out["fp8"] = v.lower()
        else:
            raise ConfigError("--explain", f"unknown key {k!r}; use tp, pp, vpp, cp, mbs, recompute, sp, dist-opt, first, "
                                           "last, account, layout, segments, fsdp, fp8, ep, etp")
    return out


@dataclass(frozen=True)
class Explanation:
    candidate: Candidate
    layout: Layout
    estimate: Estimate
    time: StepTime
    role: str = ""                 # how the layout came: "asked", "#1 (chosen)", "#2 (runner-up)"

    def to_dict(self) -> dict[str, Any]:
        t, est = self.time, self.estimate
        return {
            "schema": "memguard.plan.explain/1",
            "name": self.candidate.name,
            "role": self.role,
            "layout": self.layout.to_dict(),
            "step_time_s": t.seconds,
            "step_time_terms": t.term_seconds,
            "term_details": {x.name: x.detail for x in t.terms},
            "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu,
            "mfu": t.mfu,
            "model_flops_per_token": t.model_flops_per_token,
            "slowest_stage": t.critical_stage,
            "verdict": est.verdict,
            "critical_stage": est.critical_stage,
            "peak_device_bytes": est.peak_device_bytes,
            "stage_device_bytes": [s.device_total_bytes for s in est.stages],
        }


def explain(planner: Planner, spec: str, role: str = "asked") -> Explanation:
    kw = parse_layout_spec(spec)
    c = make_candidate(planner.shape, planner.cluster, planner.gbs, **kw)
    layout = planner.layout(c)      # Megatron's rules (raises naming the flag)
    est = planner.estimate(layout)
    return Explanation(c, layout, est, planner.timer.explain(c), role)


def compare(planner: Planner, spec: str | None, constraints: Constraints | None = None,
            rule: str = "time") -> list[Explanation]:
    """What ``--explain`` shows: the asked layout next to the planner's choice (or, when it is the
    choice, the runner-up); with no layout asked, the choice (#1) next to the runner-up (#2). One
    entry when nothing else fits."""
    ranked = planner.plan(constraints, top=2, rule=rule).entries
    tagged = [Explanation(e.candidate, e.layout, e.estimate, planner.timer.explain(e.candidate),
                          "#1 (chosen)" if e.rank == 1 else "#2 (runner-up)") for e in ranked]
    if spec is None:
        if not tagged:
            raise ConfigError("--explain", "no layout fits, so there is no chosen layout to explain; "
                                           "give one, e.g. --explain tp=8,pp=4,vpp=5,cp=1,mbs=1,recompute=none")
        return tagged
    asked = explain(planner, spec)
    for i, x in enumerate(tagged):
        if x.candidate == asked.candidate:          # asked for #1 (or #2): compare with the other
            return [dataclasses.replace(asked, role="asked = " + x.role)] + [y for y in tagged if y is not x]
    return [asked] + tagged[:1]


def comparison_dict(xs: list[Explanation]) -> dict[str, Any]:
    """The JSON of ``--explain``: the first layout's explanation at the top level (schema
    memguard.plan.explain/1), the other under ``compared_with``, and per-term differences."""
    doc = xs[0].to_dict()
    if len(xs) > 1:
        other = xs[1].to_dict()
        doc["compared_with"] = other
        doc["term_differences_s"] = {k: other["step_time_terms"][k] - v for k, v in doc["step_time_terms"].items()}
    return doc


def tie_note(planner: Planner, xs: list[Explanation]) -> str:
    """Why the chosen layout is ranked before a runner-up the model predicts faster: the tie window."""
    roles = [x.role.removeprefix("asked = ") for x in xs]
    if len(xs) < 2 or "#1 (chosen)" not in roles or "#2 (runner-up)" not in roles:
        return ""
    one, two = xs[roles.index("#1 (chosen)")], xs[roles.index("#2 (runner-up)")]
    if one.time.seconds <= two.time.seconds:
        return ""
    c1, c2 = one.candidate, two.candidate
    return (f"the chosen layout is predicted {one.time.seconds / two.time.seconds - 1:.1%} slower than the runner-up: "
            f"within the tie window ({planner.tie_window:.0%}), layouts are ranked by Fujii et al.'s order "
            f"(TP x CP x PP {c1.model_parallel} vs {c2.model_parallel}, MBS {c1.mbs} vs {c2.mbs}; "
            f"docs/planner.md section 4)")


def render_explanation(planner: Planner, xs: list[Explanation] | Explanation) -> str:
    if isinstance(xs, Explanation):
        xs = [xs]
    cl, s = planner.cluster, planner.shape
    a = xs[0]
    names = "ABCD"
    out = ["memguard plan --explain" + (f" {a.candidate.name}" if a.role.startswith("asked") else ""),
           f"cluster: {cl.gpus} x {cl.gpu.name} ({cl.gpus_per_node} per node), seq {s.seq_length}, GBS {planner.gbs}"]
    for tag, x in zip(names, xs):
        c = x.candidate
        out.append(f"{tag}: {x.role + ': ' if x.role else ''}{c.label} ({c.name}), {c.m} micro-batches per step, "
                   f"layers per stage " + "/".join(str(n) for n in c.stage_layers))
        if c.pp > 1 and x.time.stage_seconds:
            # each rank's forward + backward of one micro-batch: the slowest paces the pipeline (section 2.9)
            out.append(f"   one micro-batch per rank, ms: {rank_list(list(x.time.stage_seconds))}; slowest rank "
                       f"{x.time.critical_stage}")
    out.append("")
    width = max(len(term.name) for term in a.time.terms)
    head = f"  {'term':<{width}}  " + "  ".join(f"{tag + ': seconds':>12}  {'share':>6}" for tag in names[:len(xs)])
    if len(xs) > 1:
        head += f"  {'B - A':>10}"
    out.append(head)
    rows = list(zip(*(x.time.terms for x in xs)))
    for terms in rows:
        line = f"  {terms[0].name:<{width}}  " + "  ".join(
            f"{t.seconds:10.4f} s  {t.seconds / x.time.seconds if x.time.seconds else 0.0:6.1%}"
            for t, x in zip(terms, xs))
        if len(xs) > 1:
            line += f"  {terms[1].seconds - terms[0].seconds:+10.4f}"
        out.append(line)
    line = f"  {'= step':<{width}}  " + "  ".join(f"{x.time.seconds:10.4f} s  {1.0:6.1%}" for x in xs)
    if len(xs) > 1:
        line += f"  {xs[1].time.seconds - a.time.seconds:+10.4f}"
    out.append(line + "  sum of the terms above")
    tie = tie_note(planner, xs)
    if tie:
        out.append(tie)
    out.append("")
    mm = s.matmul_params() + s.vocab * s.hidden
    if s.kinds:
        from .hybrid import kind_name
        kinds = ", ".join(f"{n} {kind_name(k)}" for k, n in zip(s.kind_set, s.kinds_in(0, s.num_layers)))
        mixers = {k.mixer for k in s.kind_set}
        scans = " / ".join(x for m, x in (("mamba", "the Mamba layers' SSD scans"), ("gdn", "the GDN layers' delta-rule "
                                          "kernels")) if m in mixers)
        out.append(f"model FLOPs {a.time.model_flops_per_token / 1e9:,.2f} GFLOP/token = 6 x {mm / 1e9:,.3f}B matmul "
                   f"weights + 12 x {s.heads * (s.qk_dim + s.v_dim) // 2} x {s.seq_length} per attention layer"
                   + (f" + {scans} (forward and backward, linear in the sequence)" if scans else "")
                   + f"; layers: {kinds}; peak {cl.gpu.bf16_flops / 1e12:,.0f} TFLOP/s")
    else:
        out.append(f"model FLOPs {a.time.model_flops_per_token / 1e9:,.2f} GFLOP/token = 6 x {mm / 1e9:,.3f}B matmul "
                   f"weights + 12 x {s.num_layers - s.gdn_layers} layers x {s.heads * (s.qk_dim + s.v_dim) // 2} x "
                   f"{s.seq_length} attention" + (f" + {s.gdn_layers} gated delta net layers' delta-rule kernels "
                                                  "(forward and backward, linear in the sequence)" if s.gdn_layers else "")
                   + f"; peak {cl.gpu.bf16_flops / 1e12:,.0f} TFLOP/s")
    for tag, x in zip(names, xs):
        t, est = x.time, x.estimate
        mem = est.gpu_memory_bytes
        stages = ", ".join(f"pp{st.pp_rank} {format_bytes(st.device_total_bytes)}" for st in est.stages)
        out.append(f"{tag}: throughput {t.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {t.mfu:.1%}; memory: {est.verdict} - "
                   f"critical stage pp{est.critical_stage} needs {format_bytes(est.peak_device_bytes)} = "
                   f"{est.peak_device_bytes / mem:.0%} of {format_bytes(mem)} (threshold {est.threshold:.0%}); "
                   f"stages: {stages}")
    out.append("")
    out.append("how each term is computed:")
    for terms in rows:
        out.append(f"  {terms[0].name}")
        if len({t.detail for t in terms}) == 1:
            out.append(f"    {', '.join(names[:len(terms)])}: {terms[0].detail}")
            continue
        for tag, t in zip(names, terms):
            out.append(f"    {tag}: {t.detail}")
    return "\n".join(out)
