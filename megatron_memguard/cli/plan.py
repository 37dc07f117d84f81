"""``memguard plan``: search the 4D layout space, keep the layouts that fit, rank them.

    memguard plan --gpus 128 --gpu H100-80GB --seq-length 8192 --global-batch-size 1024 --model llama3.1-70b -- --bf16
    memguard plan --gpus 64 --seq-length 8192 --global-batch-size 512 -- --num-layers 32 --hidden-size 4096 ...
    memguard plan ... --explain                       # the chosen layout and the runner-up, term by term
    memguard plan ... --explain tp=8,pp=4,vpp=5,cp=1,mbs=1,recompute=none

Exit codes: 0 at least one layout fits, 1 none fits (or the explained layout does not fit), 2 bad input.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import IO, TYPE_CHECKING, Any, Sequence

from ..errors import ConfigError, ConfigErrors

if TYPE_CHECKING:
    from ..gpus import GpuSpec
    from ..planner import Planner
    from ..planner.search import PlanResult
    from ..report.plots import Plot
from .main import (
    EXIT_BAD_INPUT, EXIT_FITS, EXIT_PROBLEM, _Parser, add_target_options, load_raw, positive_int, resolve_world,
    target_gpu, file_name, path_text,
)
from ..time_constants import MAX_NETWORK_GBPS, MIN_EFFICIENCY, MIN_NETWORK_GBPS  # the bounds calibrate shares

DEFAULT_TOP = 5
MAX_TOP = 50
DEFAULT_PLOT_LAYOUTS = 200
_MEMORY_ENV = ("CUBLAS_", "NCCL_", "CUDA_", "NVTE_", "PYTORCH_", "TORCH_", "MEMGUARD_TE_VERSION")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in str(text).replace(" ", "").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects an integer or a comma-separated list of integers, got {text!r}")
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expects positive integers, got {text!r}")
    return tuple(dict.fromkeys(vals))     # (a value listed twice is one candidate: the search runs it once)


def _recompute_list(text: str) -> tuple[str, ...]:
    from ..knobs import RECOMPUTE_LEVELS
    vals = tuple(x.strip().lower() for x in str(text).split(",") if x.strip())
    bad = [v for v in vals if v not in RECOMPUTE_LEVELS]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"expects a comma-separated list of {', '.join(RECOMPUTE_LEVELS)}, got {text!r}")
    return tuple(dict.fromkeys(vals))     # ('selective,' x 2000 searched each layout 2000 times: 3.5 s of CPU)


def build_parser() -> argparse.ArgumentParser:
    from ..planner.search import RULES, TIE_WINDOW
    p = _Parser(prog="memguard plan", description="Search tensor / pipeline / context / data parallel layouts, "
                "keep those the estimator says fit, rank them by a predicted step time.",
                epilog="The model: --model NAME (a preset), --config FILE, or Megatron flags after --.")
    add_target_options(p)
    b = p.add_argument_group("batch")
    b.add_argument("--seq-length", type=positive_int, help="sequence length (default: the model config's)")
    b.add_argument("--global-batch-size", type=positive_int,
                   help="global batch size in sequences (default: the model config's)")
    c = p.add_argument_group("constraints (one value or a comma-separated list)")
    c.add_argument("--tp", type=_int_list, help="allowed tensor-parallel sizes")
    c.add_argument("--pp", type=_int_list, help="allowed pipeline-parallel sizes")
    c.add_argument("--cp", type=_int_list, help="allowed context-parallel sizes")
    c.add_argument("--vpp", type=_int_list, help="allowed virtual stages per pipeline rank (1: none)")
    c.add_argument("--mbs", type=_int_list, help="allowed micro-batch sizes")
    c.add_argument("--max-tp", type=int, help="largest tensor-parallel size")
    c.add_argument("--allow-tp-across-nodes", action="store_true", help="let TP groups span nodes")
    c.add_argument("--no-recompute", action="store_true", help="no activation recomputation")
    c.add_argument("--recompute", type=_recompute_list, help="allowed recomputation: none,selective,full")
    c.add_argument("--dist-opt", dest="dist_opt", action=argparse.BooleanOptionalAction, default=None,
                   help="require (or, with --no-dist-opt, forbid) the distributed optimizer")
    c.add_argument("--sp", dest="sp", action=argparse.BooleanOptionalAction, default=None,
                   help="require (or forbid) sequence parallelism when TP > 1")
    c.add_argument("--no-uneven", action="store_true", help="only even pipeline splits")
    c.add_argument("--fsdp", type=_fsdp_list, default=(), metavar="STRATEGIES",
                   help="also try Megatron-FSDP with these --data-parallel-sharding-strategy values "
                        "(optim_grads_params,optim_grads,optim,no_shard, or all); not tried unless given")
    c.add_argument("--fp8", metavar="RECIPE", choices=("delayed", "tensorwise", "blockwise", "mxfp8"),
                   help="also search FP8 training with this recipe (delayed, tensorwise, blockwise, mxfp8); "
                        "without it the model config's precision is kept")
    c.add_argument("--ep", type=_int_list, help="allowed expert-parallel sizes (MoE; default: divisors of the experts "
                                               "whose EP x ETP group stays in an NVLink domain)")
    c.add_argument("--etp", type=_int_list, help="allowed expert-tensor-parallel sizes (MoE; default: 1 and TP)")
    c.add_argument("--allow-ep-across-nodes", action="store_true",
                   help="let EP x ETP groups span NVLink domains (the all-to-all then crosses the network)")
    k = p.add_argument_group("cluster speeds (the step-time model; defaults: --gpu's row of `memguard gpus`)")
    k.add_argument("--network-gbps", type=float, metavar="GBPS",
                   help="network bandwidth per GPU and direction in Gb/s (400: one NDR NIC per GPU; 100: four "
                        "200 Gb/s HDR ports shared by 8 GPUs)")
    k.add_argument("--gemm-efficiency", type=float, metavar="FRACTION",
                   help="fraction of peak bf16 FLOP/s a large GEMM sustains on your GPUs (measured)")
    k.add_argument("--attention-efficiency", type=float, metavar="FRACTION",
                   help="fraction of peak bf16 FLOP/s fused causal attention sustains at long sequences (measured)")
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=DEFAULT_TOP, help=f"how many layouts to show (default {DEFAULT_TOP})")
    o.add_argument("--rule", choices=RULES, default="time",
                   help="time: predicted step time (default); fujii2024: smallest TP*CP*PP that fits, then largest MBS")
    o.add_argument("--tie-window", type=float, default=TIE_WINDOW, metavar="FRACTION",
                   help=f"time rule: predicted step times within this fraction are ties, ranked by Fujii et al.'s "
                        f"order (least TP*CP*PP, then largest MBS; default {TIE_WINDOW:g}; 0: by time alone)")
    o.add_argument("--json", action="store_true", help="machine-readable output")
    o.add_argument("--explain", metavar="LAYOUT", nargs="?", const="", default=None,
                   help="print each step-time term of the chosen layout and the runner-up side by side; with "
                        "LAYOUT (e.g. tp=8,pp=4,vpp=5,cp=1,mbs=1,recompute=none), of that layout and the chosen one")
    o.add_argument("--plot", metavar="FILE", help="draw predicted throughput against peak memory of the layouts that fit, "
                   "the Pareto front and the chosen layout: FILE.png, FILE.svg or FILE.html (needs matplotlib: "
                   "pip install 'megatron-memguard[plot]')")
    o.add_argument("--plot-layouts", type=_plot_layouts, default=DEFAULT_PLOT_LAYOUTS, metavar="N|all",
                   help=f"how many fitting layouts --plot draws: the N best by the rule (default {DEFAULT_PLOT_LAYOUTS}),"
                        " or all of them (estimates every candidate: seconds to tens of seconds)")
    return p


def _fsdp_list(text: str) -> tuple[str, ...]:
    from ..knobs import FSDP_STRATEGIES
    words = [w.strip().lower() for w in str(text).split(",") if w.strip()]
    if words == ["all"]:
        return FSDP_STRATEGIES
    if not words or any(w not in FSDP_STRATEGIES for w in words):
        raise argparse.ArgumentTypeError(f"expects strategies out of {', '.join(FSDP_STRATEGIES)} or 'all', got {text!r}")
    return tuple(dict.fromkeys(words))


def _plot_layouts(text: str) -> int:
    if str(text).lower() == "all":
        return 0
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a positive integer or 'all', got {text!r}")
    if n < 1:
        raise argparse.ArgumentTypeError(f"expects a positive integer or 'all', got {text!r}")
    return n


def _constraints(ns: argparse.Namespace):
    from ..knobs import knob
    from ..planner.space import Constraints
    recompute = ns.recompute or knob("recompute_granularity").candidates
    if ns.no_recompute:
        if ns.recompute and set(ns.recompute) - {"none"}:
            raise ConfigError("--no-recompute", "contradicts --recompute " + ",".join(ns.recompute))
        recompute = ("none",)
    if ns.max_tp is not None and ns.max_tp < 1:
        raise ConfigError("--max-tp", f"must be >= 1, got {ns.max_tp}")
    return Constraints(
        tp=ns.tp, pp=ns.pp, cp=ns.cp, vpp=ns.vpp, mbs=ns.mbs, max_tp=ns.max_tp,
        allow_tp_across_nodes=ns.allow_tp_across_nodes, recompute=tuple(recompute),
        dist_opt=knob("use_distributed_optimizer").candidates if ns.dist_opt is None else (ns.dist_opt,),
        sp=knob("sequence_parallel").candidates if ns.sp is None else (ns.sp,), uneven=not ns.no_uneven,
        fsdp=tuple(ns.fsdp or ()),
        fp8=("off", ns.fp8) if getattr(ns, "fp8", None) else (None,),
        ep=ns.ep, etp=ns.etp, allow_ep_across_nodes=ns.allow_ep_across_nodes,
    )


def cluster_speeds(gpu: GpuSpec, ns: argparse.Namespace, profile: Any = None,
                   notes: list[str] | None = None) -> GpuSpec:
    """The GPU's row with the speeds of the site profile's ``time:`` section (fitted by ``memguard calibrate`` on
    this GPU type), then those the user gave on the command line (they win)."""
    from ..time_constants import TIME_SPEC, with_speeds
    changes: dict[str, float] = {}
    fitted = dict(getattr(profile, "time", None) or {})
    if fitted:
        if profile.gpu and profile.gpu != gpu.name:
            if notes is not None:
                notes.append(f"the site profile's time constants were fitted on {profile.gpu}; not applied to "
                             f"{gpu.name}'s speeds")
        else:
            changes.update(fitted)
            if notes is not None:
                notes.append("step-time constants from the site profile " + ", ".join(
                    f"{TIME_SPEC[k].flag[2:]} {TIME_SPEC[k].format(v)}" for k, v in fitted.items()
                    if getattr(ns, k, None) is None) + " (memguard calibrate; options given on the command line win)")
    if ns.network_gbps is not None:
        if not ns.network_gbps > 0:
            raise ConfigError("--network-gbps", f"must be > 0 Gb/s per GPU, got {ns.network_gbps}")
        if not MIN_NETWORK_GBPS <= ns.network_gbps <= MAX_NETWORK_GBPS:
            # (inf and 1e308 gave zero network time, 5e-324 step times of 10**300 s)
            raise ConfigError("--network-gbps", f"must be from {MIN_NETWORK_GBPS:g} to {MAX_NETWORK_GBPS:,g} Gb/s per GPU "
                              f"(memguard's bounds: 1 Gb/s Ethernet; 10 x NVLink 5's 7,200 Gb/s per GPU and direction), "
                              f"got {ns.network_gbps!r}")
        changes["network_gbps"] = ns.network_gbps
    for flag, field in (("--gemm-efficiency", "gemm_efficiency"), ("--attention-efficiency", "attention_efficiency")):
        v = getattr(ns, field)
        if v is not None:
            if not 0 < v <= 1:
                raise ConfigError(flag, f"must be a fraction of peak in (0, 1], got {v}")
            if v < MIN_EFFICIENCY:
                # (5e-324 divided by zero; 1e-308 printed 10**300-second steps)
                raise ConfigError(flag, f"must be at least {MIN_EFFICIENCY:g} of peak (memguard's bound: an H100's fp32 "
                                  f"CUDA cores alone reach 6.8% of its bf16 tensor-core peak), got {v!r}")
            changes[field] = v
    return with_speeds(gpu, changes)


def make_planner(ns: argparse.Namespace, flags: list[str]) -> Planner:
    from ..gpus import lookup_gpu
    from ..planner import Cluster, Planner
    from ..site_profile import site_from

    raw = load_raw(ns, flags)  # --model, --config and/or flags
    if raw.problems:  # the config breaks a rule of its own format, refused as estimate and check refuse it
        raise ConfigErrors(list(raw.problems))
    # Keep only the environment that changes memory (cuBLAS / NCCL / CUDA / TE / PyTorch allocator settings, the TE
    # release):
    # the rest of the shell's environment has no business in the layouts the planner prints.
    raw = dataclasses.replace(raw, env={k: v for k, v in raw.env.items() if k.startswith(_MEMORY_ENV)})
    world = resolve_world(ns) or raw.world_size or (
        raw.nodes * raw.gpus_per_node if raw.nodes and raw.gpus_per_node else None)
    if not world:
        raise ConfigError("--gpus", "the number of GPUs is required (--gpus N, or --nnodes and --gpus-per-node)")
    if world < 1:
        raise ConfigError("--gpus", f"must be >= 1, got {world}")
    gpu, mem = target_gpu(ns)
    notes: list[str] = []
    profile = site_from(file_name(getattr(ns, "site_profile", None), "--site-profile"))
    if ns.gpu is None and profile is not None and profile.time and profile.gpu:
        # the profile's step-time constants were fitted on its GPU: plan for that GPU unless --gpu says otherwise
        gpu = lookup_gpu(profile.gpu)
        notes.append(f"no --gpu given: the site profile's GPU, {profile.gpu}, is planned")
    if gpu is None:
        gpu = lookup_gpu("H100-80GB")
        notes.append("no --gpu given: H100-80GB's speeds are used for the step-time model")
    gpu = cluster_speeds(gpu, ns, profile, notes)
    if getattr(ns, "fp8", None):
        from ..estimator.fp8 import Fp8Spec, gpu_violation
        bad = gpu_violation(Fp8Spec(fp8="hybrid", fp8_recipe=ns.fp8), gpu.name)
        if bad:
            raise ConfigError("--fp8", bad)
    gpn = ns.nproc_per_node or raw.gpus_per_node or gpu.gpus_per_node
    if gpn < 1:
        raise ConfigError("--gpus-per-node", f"must be >= 1, got {gpn}")
    domain = gpu.nvlink_domain if (gpu.nvlink_domain > gpu.gpus_per_node and not ns.nproc_per_node) else gpn
    cluster = Cluster(gpus=world, gpus_per_node=min(gpn, world), gpu=gpu, nvlink_domain=min(domain, world),
                      gpu_memory_bytes=mem or gpu.memory_bytes)
    planner = Planner(raw, cluster, seq_length=ns.seq_length, global_batch_size=ns.global_batch_size,
                      threshold=ns.threshold, megatron_version=ns.megatron_version, vocab_size=ns.vocab_size,
                      site=profile.constants if profile is not None else None, tie_window=_tie_window(ns))
    planner.notes[:0] = notes
    if planner.shape.moe is None and (ns.ep or ns.etp or ns.allow_ep_across_nodes):
        planner.notes.append("--ep / --etp / --allow-ep-across-nodes apply to mixture-of-experts models; this model "
                             "has no experts (--num-experts)")
    if planner.shape.moe is not None and "moe_token_dispatcher_type" not in raw.args and not raw.args.get("moe_enable_deepep"):
        # arguments.py (0.16.1, 0.19.2): the default dispatcher; an MoE run with EP usually names its own
        planner.notes.append("--moe-token-dispatcher-type not given: Megatron's default, allgather, is planned (give "
                             "alltoall or flex if the run uses them)")
    if planner.shape.param_bytes == 4:
        planner.notes.append("the model trains in fp32 (no --bf16 / --fp16 in its flags): memory and speed assume that")
    return planner


def _tie_window(ns: argparse.Namespace) -> float:
    from ..planner.search import TIE_WINDOW
    w = getattr(ns, "tie_window", None)
    return TIE_WINDOW if w is None else w


def _stage_peaks(est) -> str:
    vals = [s.device_total_bytes / 2**30 for s in est.stages]
    if len(vals) <= 4:
        return "/".join(f"{v:.1f}" for v in vals)
    return f"{min(vals):.1f}..{max(vals):.1f} ({len(vals)})"


def render_plan(planner: Planner, res: PlanResult) -> str:
    from ..report.text import table
    from ..units import format_bytes
    from ..planner.export import bridge_overrides, flags_to_remove, megatron_flags, nemo2_overrides

    cl, s = res.cluster, res.shape
    mem = cl.gpu_memory_bytes
    out = [f"memguard plan - {cl.gpus} x {cl.gpu.name} ({cl.gpus_per_node} per node, {format_bytes(mem)}), "
           f"threshold {res.threshold:.0%}, rule: {'predicted step time' if res.rule == 'time' else 'Fujii et al. 2024'}"]
    groups = f" / {s.groups} groups" if s.groups != s.heads else ""
    if s.mla:
        groups = f" (MLA, q rank {s.mla[0] or '-'}, kv rank {s.mla[1]})"
    out.append(f"model:  {s.num_layers} layers, hidden {s.hidden}, ffn {s.ffn}, {s.heads} heads{groups}, vocab {s.vocab}; "
               f"seq {s.seq_length}, GBS {res.global_batch_size}")
    if s.moe is not None:
        m = s.moe
        shared = f", shared expert {m.shared_ffn}" if m.shared_ffn else ""
        out.append(f"experts: {m.experts} of width {m.ffn}, top-{m.topk}{shared}, in {m.moe_layers} of {s.num_layers} layers; "
                   f"{m.dispatcher} dispatcher{', grouped GEMM' if m.grouped_gemm else ''}; EP and ETP searched "
                   f"(expert DP = GPUs / (ETP x EP x PP))")
    sd = res.search_dict()
    out.append(f"search: {sd['considered']:,} layouts, {sd['visited']:,} visited "
               + (f"fastest first (ties within {planner.tie_window:.0%}: least TP*CP*PP, then largest MBS)"
                  if res.rule == "time" and planner.tie_window else "fastest first" if res.rule == "time"
                  else "by TP*CP*PP, then MBS") + f": "
               f"{sd['pruned_by_memory_bound']:,} cannot fit (model state + kept activations), "
               f"{sd['rejected_by_megatron_rules']:,} break a Megatron rule, {sd['estimated']:,} estimated, "
               f"{sd['fitting']:,} fit ({res.seconds:.2f} s)")
    out.append("")
    if res.entries:
        rows = []
        for e in res.entries:
            est, t = e.estimate, e.time
            dom = t.dominant
            rows.append([
                str(e.rank), e.candidate.label, _stage_peaks(est),
                f"pp{est.critical_stage} {est.peak_device_bytes / mem:.0%}", est.verdict, f"{t.seconds:.2f} s",
                f"{t.tokens_per_s_per_gpu:,.0f}", f"{t.mfu:.1%}", f"{dom.name} {dom.seconds / t.seconds:.1%}",
            ])
        out.append(table(rows, ["#", "layout", "stage peaks GiB", "critical", "verdict", "step", "tok/s/GPU", "MFU",
                                "dominant cost"], right=(0, 5, 6, 7)))
        best = res.entries[0]
        L = best.layout
        out.append("")
        out.append(f"chosen: #1 {best.candidate.label} ({best.candidate.name}); --explain shows its step-time "
                   f"terms next to the runner-up's")
        out.append("")
        exported = megatron_flags(L, best.experts)
        drop = flags_to_remove(planner.raw, exported)
        # (Megatron cannot switch a store-true flag off: the command must lose these for the planned layout)
        out.append("Megatron flags" + (f" (first remove {', '.join(drop)} from your command):" if drop else ":"))
        out.append("  " + " \\\n  ".join(exported))
        out.append("NeMo 2 (NeMo-Run recipe overrides):")
        out.append("  " + " ".join(nemo2_overrides(L, cl.gpus_per_node, best.experts, raw=planner.raw)))
        out.append("Megatron-Bridge (ConfigContainer overrides):")
        out.append("  " + " ".join(bridge_overrides(L, best.experts, raw=planner.raw)))
    else:
        out.append("no layout fits.")
        for frac, c, est in res.closest:
            out.append(f"  closest: {c.label} ({c.name}): {est.verdict}, pp{est.critical_stage} needs "
                       f"{format_bytes(est.peak_device_bytes)} = {frac:.0%} of {format_bytes(mem)}")
        if not res.closest and res.smallest_bound:
            lb, c = res.smallest_bound
            out.append(f"  every layout's model state and kept activations alone exceed {res.threshold:.0%} of "
                       f"{format_bytes(mem)}; the smallest is {format_bytes(lb)} ({c.label})")
        out.append("  more GPUs, a larger GPU, a smaller micro-batch / global batch, or fewer constraints may help")
    notes = list(res.notes)
    if res.rejected:
        top = "; ".join(f"{why} ({n}x)" for why, n in res.rejected.most_common(3))
        notes.append(f"{sum(res.rejected.values())} candidate(s) broke a rule Megatron checks and were dropped: {top}")
    if notes:
        out.append("")
        out.extend(f"note: {n}" for n in notes)
    return "\n".join(out)


def plan_json(planner: Planner, res: PlanResult) -> dict[str, Any]:
    cl, s = res.cluster, res.shape
    return {
        "schema": "memguard.plan/1",
        "rule": res.rule,
        "tie_window": planner.tie_window if res.rule == "time" else 0.0,
        "gpus": cl.gpus,
        "gpu": cl.gpu.name,
        "gpus_per_node": cl.gpus_per_node,
        "gpu_memory_bytes": cl.gpu_memory_bytes,
        "threshold": res.threshold,
        "seq_length": s.seq_length,
        "global_batch_size": res.global_batch_size,
        "model_flops_per_token": planner.timer.flops_per_token,
        "search": res.search_dict(),
        "layouts": [_layout_json(planner, e, cl.gpus_per_node) for e in res.entries],
        "notes": list(res.notes),
    }


def _layout_json(planner: Planner, entry: Any, gpus_per_node: int) -> dict[str, Any]:
    from ..planner.export import bridge_overrides, flags_to_remove, nemo2_overrides
    d = entry.to_dict(gpus_per_node)
    d["megatron_flags_to_remove"] = flags_to_remove(planner.raw, d["megatron_flags"])
    # the overrides clear what the model's config sets and the layout leaves unset
    d["nemo2_overrides"] = nemo2_overrides(entry.layout, gpus_per_node, entry.experts, raw=planner.raw)
    d["bridge_overrides"] = bridge_overrides(entry.layout, entry.experts, raw=planner.raw)
    return d


def run(own_args: Sequence[str], flags: list[str]) -> int:
    try:
        ns = build_parser().parse_args(list(own_args))
    except SystemExit as e:          # --help (0) or a usage error, already printed (2)
        return int(e.code or 0)
    if not 1 <= ns.top <= MAX_TOP:
        raise ConfigError("--top", f"must be from 1 to {MAX_TOP} (memguard's bound: every layout listed is estimated in "
                                   f"full, a few milliseconds each), got {ns.top:,}")
    fmt, stream = None, None
    file_name(ns.plot, "--plot")
    if ns.plot:  # fail before searching when the file name or matplotlib is wrong
        if ns.explain is not None:
            raise ConfigError("--plot", "draws the ranked layouts; it does not combine with --explain")
        from ..report.plots import open_early, output_format, require_matplotlib
        fmt = output_format(ns.plot)
        stream = open_early(ns.plot, fmt)   # a named pipe: opened now, refused at once if nobody reads it
        require_matplotlib()
    planner = make_planner(ns, flags)
    if ns.explain is not None:
        from ..planner.explain import compare, comparison_dict, render_explanation
        xs = compare(planner, ns.explain or None, _constraints(ns), ns.rule)
        if ns.json:
            print(json.dumps(comparison_dict(xs), indent=2))
        else:
            print(render_explanation(planner, xs))
        return EXIT_FITS if xs[0].estimate.verdict == "fits" else EXIT_PROBLEM
    top = ns.top
    if ns.plot:
        # The ranked search visits layouts best first, so a longer search keeps the same first entries.
        top = max(ns.top, ns.plot_layouts) if ns.plot_layouts else 10**9
    full = planner.plan(_constraints(ns), top=top, rule=ns.rule)
    res = dataclasses.replace(full, entries=full.entries[:ns.top])
    if ns.json:
        print(json.dumps(plan_json(planner, res), indent=2))
    else:
        print(render_plan(planner, res))
    if ns.plot:
        plot_plan(planner, full, ns.plot, fmt, stream)
        print(f"memguard: plot written to {path_text(ns.plot)}", file=sys.stderr)
    return EXIT_FITS if res.entries else EXIT_PROBLEM


def plot_caption(res: PlanResult) -> str:
    """What the plot shows: every fitting layout, or the best of them (the search stopped there)."""
    k = len(res.entries)
    if not k:
        return "no layout fits: nothing to plot"
    if res.visited >= res.considered:
        what = f"all {k} layouts that fit"
    else:
        which = f"the {k} fastest layouts that fit" if res.rule == "time" else \
            f"the first {k} layouts that fit in the Fujii et al. order"
        what = f"{which} (the search stopped there; --plot-layouts all plots every one)"
    return (f"{what}; {res.estimated:,} of {res.considered:,} candidates estimated, "
            f"{res.pruned_by_bound:,} ruled out by the memory bound")


def plot_plan(planner: Planner, res: PlanResult, path: str, fmt: str, stream: IO | None = None) -> Plot:
    """Draw ``res.entries`` (throughput against memory) to ``path``; returns the Plot."""
    from ..report.plots import plan_figure, plan_html, plan_points, write
    cl, s = res.cluster, res.shape
    title = (f"memguard plan: {s.num_layers} layers, hidden {s.hidden} on {cl.gpus} x {cl.gpu.name} - "
             "predicted throughput vs peak memory")
    caption = plot_caption(res)
    plot = plan_figure(plan_points(res.entries), cl.gpu_memory_bytes, res.threshold, title, caption)
    subtitle = render_plan(planner, dataclasses.replace(res, entries=res.entries[:1])).split("\n\n")[0]
    write(plot, path, fmt, lambda p: plan_html(p, title, subtitle), stream=stream)
    return plot


__all__ = ["run", "build_parser", "EXIT_BAD_INPUT"]
