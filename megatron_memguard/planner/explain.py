"""``memguard plan --explain LAYOUT``: every cost term of the step-time model for one layout.

LAYOUT is the compact spelling the planner prints (``Candidate.name``):
``tp=8,pp=4,vpp=5,cp=1,mbs=1,recompute=none`` with optional ``sp=on|off``, ``dist-opt=on|off``,
``first=N,last=N`` (uneven first/last pipeline stages). Missing keys take TP=PP=VPP=CP=MBS=1, no
recomputation, SP on when TP > 1 (and TP divides seq / CP), the distributed optimizer on, and the pipeline split the search
would choose.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..estimator import Estimate
from ..layout import Layout
from ..units import format_bytes
from .search import Planner
from .space import Candidate, make_candidate
from .timing import StepTime

_INT_KEYS = {"tp": "tp", "pp": "pp", "vpp": "vpp", "cp": "cp", "mbs": "mbs", "first": "first", "last": "last"}
_BOOL_KEYS = {"sp": "sp", "dist-opt": "dist_opt", "dist_opt": "dist_opt", "distopt": "dist_opt"}
_ON = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}


def parse_layout_spec(text: str) -> dict[str, Any]:
    """``tp=8,pp=4,...`` -> keyword arguments of :func:`make_candidate`."""
    out: dict[str, Any] = {}
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        if "=" not in part:
            raise ConfigError("--explain", f"{part!r} is not key=value; write e.g. tp=8,pp=4,vpp=5,cp=1,mbs=1,recompute=none")
        k, v = part.split("=", 1)
        k = k.lower()
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
        else:
            raise ConfigError("--explain", f"unknown key {k!r}; use tp, pp, vpp, cp, mbs, recompute, sp, dist-opt, first, last")
    return out


@dataclass(frozen=True)
class Explanation:
    candidate: Candidate
    layout: Layout
    estimate: Estimate
    time: StepTime

    def to_dict(self) -> dict[str, Any]:
        t, est = self.time, self.estimate
        return {
            "schema": "memguard.plan.explain/1",
            "name": self.candidate.name,
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


def explain(planner: Planner, spec: str) -> Explanation:
    kw = parse_layout_spec(spec)
    c = make_candidate(planner.shape, planner.cluster, planner.gbs, **kw)
    layout = planner.layout(c)      # Megatron's rules (raises naming the flag)
    est = planner.estimate(layout)
    return Explanation(c, layout, est, planner.timer.explain(c))


def render_explanation(planner: Planner, x: Explanation) -> str:
    c, t, est = x.candidate, x.time, x.estimate
    cl, s = planner.cluster, planner.shape
    out = [f"memguard plan --explain {c.name}",
           f"cluster: {cl.gpus} x {cl.gpu.name} ({cl.gpus_per_node} per node), seq {s.seq_length}, "
           f"GBS {planner.gbs}",
           f"layout:  {c.label}, {c.m} micro-batches per step, layers per stage "
           + "/".join(str(n) for n in c.stage_layers), ""]
    width = max(len(term.name) for term in t.terms)
    for term in t.terms:
        share = term.seconds / t.seconds if t.seconds else 0.0
        out.append(f"  {term.name:<{width}}  {term.seconds:10.4f} s  {share:6.1%}  {term.detail}")
    out.append(f"  {'= step':<{width}}  {t.seconds:10.4f} s  100.0%  sum of the terms above")
    out.append("")
    mm = s.num_layers * s.layer_matmul_params() + s.vocab * s.hidden
    out.append(f"throughput: {t.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {t.mfu:.1%} (model FLOPs "
               f"{t.model_flops_per_token / 1e9:,.2f} GFLOP/token = 6 x {mm / 1e9:,.3f}B matmul weights + 12 x "
               f"{s.num_layers} layers x {s.heads * (s.qk_dim + s.v_dim) // 2} x {s.seq_length} attention; peak "
               f"{cl.gpu.bf16_flops / 1e12:,.0f} TFLOP/s)")
    mem = est.gpu_memory_bytes
    stages = ", ".join(f"pp{st.pp_rank} {format_bytes(st.device_total_bytes)}" for st in est.stages)
    out.append(f"memory: {est.verdict} - critical stage pp{est.critical_stage} needs "
               f"{format_bytes(est.peak_device_bytes)} = {est.peak_device_bytes / mem:.0%} of {format_bytes(mem)} "
               f"(threshold {est.threshold:.0%}); stages: {stages}")
    return "\n".join(out)
