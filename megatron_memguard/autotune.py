"""Find a micro-batch size and pipeline size (and, if allowed, activation recomputation) that fit.

Framework-free: works on a ``RawConfig`` (what the user wrote, under Megatron's argument names)
through ``resolve`` and ``estimate``, so the Megatron hook, the CLI and NeMo / Megatron-Bridge
integrations share one search.

Rules (the ones Megatron checks later, some of them only after memory is allocated):
* the global batch size stays what it is; when the user left it to default (``MBS x DP``) it is
  pinned to that value, because a new MBS or DP would otherwise change it silently;
* ``GBS % (MBS x DP) == 0`` for the new DP (also every step of ``--rampup-batch-size`` and an
  explicit ``--eval-global-batch-size`` / ``--eval-micro-batch-size``);
* ``world % (TP x PP x CP) == 0``; layers divide into the new stages (or the uneven first/last
  counts leave an even split of the middle stages); the virtual-pipeline rules; the interleaved
  schedule's micro-batch grouping rule (``PP <= group <= num_microbatches``, last group 0 or >= PP);
  all of these are ``resolve``'s checks, so a candidate that breaks one is rejected with its message;
* mixture of experts: ``world % (ETP x EP x PP) == 0`` for the new PP (``initialize_model_parallel``
  checks it after ``validate_args``, so a dry run of validate_args would not catch it); no full
  recomputation with ``--moe-layer-recompute`` or ``--overlap-moe-expert-parallel-comm``, and the
  latter needs virtual pipeline stages when PP > 1 (``TransformerConfig.__post_init__``, also after
  validate_args); EP and ETP themselves are never changed;
* PP is never changed when ``--pipeline-model-parallel-layout`` gives an explicit layout, nor when the
  checkpoint to load cannot be resharded across pipeline stages (``--ckpt-format torch``,
  ``--non-persistent-ckpt-type local``), nor with ``--step-batch-size-schedule`` (MBS neither).

Order of preference (Fujii et al. 2024, arXiv 2411.06465: model parallelism costs more than a smaller
micro-batch): without recomputation before with it (only with ``allow_recompute``: the selective rungs of
recompute_ladder.py, weakest first, then full uniform recomputation); then the least
pipeline parallelism; then the largest micro-batch size. The first candidate whose critical stage
stays within ``threshold`` of GPU memory wins. A layout that is only "tight" (over the threshold, within
GPU memory) is never chosen: when no candidate stays within the threshold the result is
``impossible``, with the nearest layouts (lowest peak first) and what would make one fit: activation
recomputation when it was not allowed, or more GPUs (the same search on 2, 4 and 8 times as many, the
global batch size kept). The search is a pure function of its inputs, so every rank of a job reaches
the same decision without communicating.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .config import RawConfig
from .divisors import divisors
from .errors import ConfigError, ConfigErrors, MemguardError
from .estimator import Estimate, SiteConstants, estimate
from .gpus import GpuSpec
from .layout import Layout
from .numbers import to_int
from .resolve import resolve
from .recompute_ladder import Rung, ladder
from .units import format_bytes

# The strongest recomputation level the search may add (only with allow_recompute), after the selective
# ladder of recompute_ladder.py.
_FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
_RESHARD_BLOCKERS = (
    ("ckpt_format", lambda v: v == "torch", "the legacy 'torch' checkpoint format cannot be resharded across pipeline stages"),
    ("non_persistent_ckpt_type", lambda v: v == "local", "local non-persistent checkpoints cannot be resharded across pipeline stages"),
)


@dataclass(frozen=True)
class Candidate:
    """One layout the search tried and could estimate."""

    changes: Mapping[str, Any]      # argument updates relative to the input (Megatron dest names)
    layout: Layout
    estimate: Estimate

    @property
    def micro_batch_size(self) -> int:
        return self.layout.micro_batch_size

    @property
    def pipeline_model_parallel_size(self) -> int:
        return self.layout.pipeline_model_parallel_size

    @property
    def fraction(self) -> float | None:
        mem = self.estimate.gpu_memory_bytes
        return self.estimate.peak_device_bytes / mem if mem else None

    def describe(self) -> str:
        return describe_layout_choice(self.layout)


@dataclass(frozen=True)
class AutotuneResult:
    status: str                      # "fits" (nothing to do) | "changed" | "impossible" (nothing within the threshold)
    original: Estimate
    chosen: Candidate | None         # None when status is "fits" or "impossible"
    changes: Mapping[str, tuple[Any, Any]] = field(default_factory=dict)  # dest -> (old, new)
    reasons: tuple[str, ...] = ()    # why, in sentences
    considered: int = 0              # candidates estimated
    rejected: tuple[tuple[str, str], ...] = ()  # (candidate, rule it breaks)
    nearest: tuple[Candidate, ...] = ()  # "impossible": the valid candidates with the lowest peaks, lowest first
    hints: tuple[str, ...] = ()      # "impossible": what would make a layout fit (recomputation, more GPUs)

    @property
    def updates(self) -> dict[str, Any]:
        """The argument updates to apply (dest -> new value)."""
        return {k: new for k, (_, new) in self.changes.items()}

    @property
    def final_estimate(self) -> Estimate:
        return self.chosen.estimate if self.chosen is not None else self.original

    def summary(self) -> str:
        """One paragraph for logs: what changed and why, or why nothing could."""
        lines = list(self.reasons)
        if self.rejected:
            counts: dict[str, int] = {}
            for _, why in self.rejected:
                counts[why] = counts.get(why, 0) + 1
            top = sorted(counts.items(), key=lambda kv: -kv[1])[:4]
            lines.append(f"{len(self.rejected)} candidate(s) broke a rule Megatron checks: "
                         + "; ".join(f"{why} ({n}x)" for why, n in top))
        return "\n".join(lines)


def describe_layout_choice(L: Layout) -> str:
    rec = L.recompute_granularity or "no recompute"
    if L.recompute_granularity == "full":
        rec = f"full recompute ({L.recompute_method} {L.recompute_num_layers})"
    elif L.recompute_granularity == "selective":
        rec = f"selective recompute ({', '.join(L.recompute_modules)})"
    vpp = f" VPP{L.vpp}" if L.vpp > 1 else ""
    return f"MBS {L.micro_batch_size}, PP {L.pp}{vpp} (DP {L.dp}), {rec}"


def _pct(est: Estimate) -> str:
    mem = est.gpu_memory_bytes
    return f"{est.peak_device_bytes / mem:.0%}" if mem else "?"


def _expert_sizes(raw: RawConfig, tp: int) -> tuple[int, int] | None:
    """(EP, ETP) of an MoE model as Megatron resolves them (ETP defaults to TP); None for a dense model or
    values resolve() will refuse anyway."""
    a = raw.args
    try:
        if not a.get("num_experts") or int(a["num_experts"]) <= 0:
            return None
        ep = int(a.get("expert_model_parallel_size") or 1)
        etp = int(a.get("expert_tensor_parallel_size") or tp)
    except (TypeError, ValueError, OverflowError):
        return None
    return (ep, etp) if ep >= 1 and etp >= 1 else None


def _moe_full_recompute_blocker(raw: RawConfig) -> str | None:
    """Why full recomputation cannot be added to this MoE run (TransformerConfig.__post_init__), or None."""
    if raw.args.get("moe_layer_recompute"):
        return f"{raw.key('moe_layer_recompute')} cannot be combined with full recomputation"
    if raw.args.get("overlap_moe_expert_parallel_comm"):
        return f"{raw.key('overlap_moe_expert_parallel_comm')} cannot be combined with full recomputation"
    return None


def _recompute_levels(L: Layout, allow: bool, rungs: tuple[Rung, ...] = ()) -> list[dict[str, Any]]:
    """No change, then the selective ladder's rungs (recompute_ladder.py), then full uniform recomputation."""
    levels: list[dict[str, Any]] = [{}]
    if not allow:
        return levels
    if L.recompute_granularity in (None, "selective"):
        levels += [r.updates() for r in rungs]
        levels.append(dict(_FULL))
    elif L.recompute_granularity == "full" and (L.recompute_method != "uniform" or (L.recompute_num_layers or 1) > 1):
        levels.append(dict(_FULL))
    return levels


def _level_label(level: Mapping[str, Any]) -> str:
    if level.get("recompute_granularity") == "selective":
        return f"selective recompute of {', '.join(level['recompute_modules'])}"
    return f"{level['recompute_granularity']} recompute"


def _stage_peaks(raw: RawConfig, L0: Layout, megatron_version: str | None, vocab_size: int | None,
                 est_kw: Mapping[str, Any], alias_off: Mapping[str, Any]) -> Callable[[dict[str, Any]], tuple[int, ...] | str]:
    """For the ladder: each stage's device peak with some recompute updates at the original layout, or the
    rule the updated arguments break."""
    def peaks(updates: dict[str, Any]) -> tuple[int, ...] | str:
        if updates:
            try:
                L = resolve(raw.with_args(**updates, **alias_off), world_size=L0.world_size,
                            megatron_version=megatron_version, vocab_size=vocab_size)
            except ConfigErrors as e:
                return e.errors[0].rule
            except ConfigError as e:
                return e.rule
            except MemguardError as e:
                return str(e)
        else:
            L = L0
        return tuple(s.device_total_bytes for s in estimate(L, **est_kw).stages)
    return peaks


_MBS_SCAN = 1024   # micro-batch sizes up to this are all tried (and the non-dividing ones listed as rejected)


def _ramp(raw: RawConfig) -> tuple[int, int] | None:
    """(start, increment) of --rampup-batch-size, None without a usable one."""
    ramp = raw.args.get("rampup_batch_size")
    if not ramp:
        return None
    try:
        start, inc = int(ramp[0]), int(ramp[1])
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return (start, inc) if inc > 0 else None


def _extra_batch_rules(raw: RawConfig, gbs: int, mbs: int, dp: int) -> str | None:
    """Batch rules resolve() does not check: ramp-up steps and explicit eval batch sizes."""
    ramp = _ramp(raw)
    if ramp is not None:
        # the steps start, start + inc, ... <= GBS: all divisible by k iff start is and, when there is a
        # second step, inc is (closed form: a ramp may have millions of steps)
        start, inc = ramp
        k = mbs * dp
        bad = start if start % k else start + inc if (inc % k and start + inc <= gbs) else None
        if bad is not None and bad <= gbs:
            return f"--rampup-batch-size step {bad} is not divisible by MBS x DP = {k}"
    a = raw.args
    eval_gbs = a.get("eval_global_batch_size")
    eval_mbs = a.get("eval_micro_batch_size")
    if eval_gbs is not None or eval_mbs is not None:
        try:
            eg = to_int(eval_gbs, raw.key("eval_global_batch_size")) if eval_gbs is not None else gbs
            em = to_int(eval_mbs, raw.key("eval_micro_batch_size")) if eval_mbs is not None else mbs
        except ConfigError as e:
            return str(e)
        if eg % (em * dp):
            return f"--eval-global-batch-size {eg} is not divisible by eval MBS x DP = {em}*{dp}"
    return None


def autotune(
    raw: RawConfig,
    *,
    world_size: int | None = None,
    megatron_version: str | None = None,
    vocab_size: int | None = None,
    gpu: GpuSpec | None = None,
    gpu_memory: int | None = None,
    threshold: float = 0.8,
    profile: str = "auto",
    allow_recompute: bool = False,
    allow_pp: bool = True,
    accept: Callable[[Mapping[str, Any]], str | None] | None = None,
    original: Estimate | None = None,
    site: SiteConstants | None = None,
    _hints: bool = True,
) -> AutotuneResult:
    """Search MBS downwards and PP upwards (recompute only with ``allow_recompute``) for a layout that fits.

    ``accept(updates)`` may veto a winning candidate (return the reason, e.g. from a dry run of the
    framework's own validation); the search then continues with the next one. Raises ConfigError(s)
    when the input itself breaks a rule, MemguardError when GPU memory is unknown.
    """
    L0 = original.layout if original is not None else resolve(raw, world_size=world_size, megatron_version=megatron_version,
                                                                vocab_size=vocab_size)
    if site is None and original is not None:
        site = original.site                    # candidates are estimated with the same site constants
    est_kw = dict(profile=profile, gpu=gpu, gpu_memory=gpu_memory, threshold=threshold, site=site)
    E0 = original if original is not None else estimate(L0, **est_kw)
    if not E0.gpu_memory_bytes:
        raise MemguardError("autotune needs the GPU memory (give --memguard-gpu-memory or a GPU)")
    if E0.verdict == "fits":
        return AutotuneResult("fits", E0, None, reasons=(f"{describe_layout_choice(L0)} fits: critical stage "
                                                         f"pp{E0.critical_stage} needs {_pct(E0)} of GPU memory",))
    world = L0.world_size
    mbs0, pp0, gbs0 = L0.micro_batch_size, L0.pp, L0.global_batch_size
    gbs_defaulted = raw.args.get("global_batch_size") is None
    notes: list[str] = []

    # Which knobs may move.
    if raw.args.get("step_batch_size_schedule"):
        return AutotuneResult("impossible", E0, None, reasons=(
            "--step-batch-size-schedule: every scheduled global batch size would have to be re-checked; "
            "autotune leaves micro-batch and pipeline sizes alone",))
    pp_fixed = None
    if L0.pipeline_model_parallel_layout:
        pp_fixed = f"{raw.key('pipeline_model_parallel_layout')} encodes PP {pp0} explicitly"
    elif not allow_pp:
        pp_fixed = "pipeline size changes are disabled"
    elif raw.args.get("load") is not None or raw.args.get("pretrained_checkpoint") is not None:
        for dest, pred, why in _RESHARD_BLOCKERS:
            if pred(raw.args.get(dest)):
                pp_fixed = f"{raw.key(dest)}: {why}"
    tp, cp = L0.tp, L0.cp
    if pp_fixed:
        pps = [pp0]
        notes.append(f"pipeline size kept at {pp0}: {pp_fixed}")
    else:
        # the pipeline sizes that divide the GPUs left by TP and CP (from the factorisation, not a scan)
        pps = [p for p in divisors(world // (tp * cp)) if pp0 <= p <= L0.num_layers]
    # micro-batch sizes downwards; only those dividing GBS / DP can pass the batch rule, the others are
    # counted as one rejection each (a scan from a micro-batch size of 10**9 would not end)
    mbss = list(range(mbs0, 0, -1)) if mbs0 <= _MBS_SCAN else sorted({mbs0, *(d for d in divisors(gbs0) if d <= mbs0)},
                                                                         reverse=True)
    experts = _expert_sizes(raw, tp)
    if experts is not None:
        ep, etp = experts
        bad = [p for p in pps if world % (etp * ep * p)]
        if bad:
            # initialize_model_parallel builds the expert grid ETP x EP x EDP x PP over the same world
            pps = [p for p in pps if p not in bad]
            notes.append(f"pipeline size{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} not tried: "
                         f"{world} GPUs do not divide into expert tensor parallel {etp} x expert parallel {ep} x PP")
    alias_off = {"recompute_activations": False} if raw.args.get("recompute_activations") else {}
    # the ladder's rungs go in after the no-change level, built only when that level finds nothing (it costs
    # a few dozen estimates)
    rungs: tuple[Rung, ...] = ()
    ladder_due = allow_recompute and L0.recompute_granularity in (None, "selective")
    levels = _recompute_levels(L0, allow_recompute)
    full_blocker = _moe_full_recompute_blocker(raw) if experts is not None else None
    if full_blocker and any(lv.get("recompute_granularity") == "full" for lv in levels):
        levels = [lv for lv in levels if lv.get("recompute_granularity") != "full"]
        notes.append(f"full recomputation not tried: {full_blocker}")
    if not allow_recompute and L0.recompute_granularity != "full":
        notes.append("activation recomputation not tried (allow it with --memguard-allow-recompute)")

    rejected: list[tuple[str, str]] = []
    considered = 0
    tried: list[Candidate] = []
    best: Candidate | None = None
    gbs_pin = {"global_batch_size": gbs0} if gbs_defaulted else {}

    i = 0
    while i < len(levels):
        level = levels[i]
        i += 1
        for pp in pps:
            dp = world // (tp * pp * cp)
            for mbs in mbss:
                updates: dict[str, Any] = {}
                if mbs != mbs0:
                    updates["micro_batch_size"] = mbs
                if pp != pp0:
                    updates["pipeline_model_parallel_size"] = pp
                if level:
                    updates.update(level)
                    updates.update(alias_off)
                if updates:
                    updates.update(gbs_pin)
                label = f"MBS {mbs}, PP {pp}" + (f", {_level_label(level)}" if level else "")
                if gbs0 % (mbs * dp):
                    rejected.append((label, f"GBS {gbs0} is not divisible by MBS x DP"))
                    continue
                why = _extra_batch_rules(raw, gbs0, mbs, dp)
                if why is None and pp > 1 and raw.args.get("overlap_param_gather_with_optimizer_step"):
                    vpp_given = any(raw.args.get(k) for k in ("num_layers_per_virtual_pipeline_stage",
                                                              "num_virtual_stages_per_pipeline_rank"))
                    if not vpp_given:
                        why = "--overlap-param-gather-with-optimizer-step with PP > 1 needs virtual pipeline stages"
                if why is None and pp > 1 and experts is not None and raw.args.get("overlap_moe_expert_parallel_comm"):
                    vpp_given = any(raw.args.get(k) for k in ("num_layers_per_virtual_pipeline_stage",
                                                              "num_virtual_stages_per_pipeline_rank",
                                                              "virtual_pipeline_model_parallel_size"))
                    if not vpp_given:
                        # TransformerConfig.__post_init__: "If enabling EP A2A overlap, virtual_pipeline_model_parallel_size
                        # must be specified when pipeline_model_parallel_size > 1"
                        why = "--overlap-moe-expert-parallel-comm with PP > 1 needs virtual pipeline stages"
                if why:
                    rejected.append((label, why))
                    continue
                if not updates:
                    L, E = L0, E0
                else:
                    try:
                        L = resolve(raw.with_args(**updates), world_size=world_size or L0.world_size,
                                    megatron_version=megatron_version, vocab_size=vocab_size)
                    except ConfigErrors as e:
                        rejected.append((label, str(e.errors[0])))
                        continue
                    except MemguardError as e:  # ConfigError, NotModelledError, ...
                        rejected.append((label, str(e)))
                        continue
                    E = estimate(L, **est_kw)
                considered += 1
                cand = Candidate(updates, L, E)
                if E.verdict == "fits":
                    veto = accept(updates) if (accept is not None and updates) else None
                    if veto:
                        rejected.append((label, veto))
                        continue
                    best = cand
                    break
                tried.append(cand)
            if best is not None:
                break
        if best is not None:
            break
        if ladder_due and not level:
            ladder_due = False
            rungs, ladder_notes = ladder(L0, _stage_peaks(raw, L0, megatron_version, vocab_size, est_kw, alias_off))
            notes.extend(ladder_notes)
            levels[i:i] = [r.updates() for r in rungs]

    head = (f"{describe_layout_choice(L0)}: needs {format_bytes(E0.peak_device_bytes)} = {_pct(E0)} of "
            f"{format_bytes(E0.gpu_memory_bytes)} on stage pp{E0.critical_stage} (threshold {threshold:.0%}); "
            f"largest term {E0.critical.dominant_term.name} {format_bytes(E0.critical.dominant_term.bytes)}")
    if best is None:
        nearest = tuple(sorted(tried, key=lambda c: c.estimate.peak_device_bytes)[:3])
        hints: tuple[str, ...] = ()
        if _hints:
            hints = _what_would_fit(raw, L0, gbs0, megatron_version, vocab_size, est_kw, allow_recompute, allow_pp)
        lines = [head, *notes, f"none of {considered} valid candidates stays within the {threshold:.0%} threshold "
                 "(a tight layout is not started)"]
        if nearest:
            lines.append("nearest: " + "; ".join(f"{c.describe()} {format_bytes(c.estimate.peak_device_bytes)} = "
                                                 f"{_pct(c.estimate)}" for c in nearest))
        lines += [f"would fit {h}" for h in hints]
        return AutotuneResult("impossible", E0, None, reasons=tuple(lines), considered=considered,
                              rejected=tuple(rejected), nearest=nearest, hints=hints)
    chosen, status = best, "changed"
    changes: dict[str, tuple[Any, Any]] = {}
    old = {"micro_batch_size": mbs0, "pipeline_model_parallel_size": pp0, "global_batch_size": raw.args.get("global_batch_size"),
           "recompute_granularity": L0.recompute_granularity, "recompute_method": L0.recompute_method,
           "recompute_num_layers": L0.recompute_num_layers, "recompute_activations": raw.args.get("recompute_activations"),
           "recompute_modules": raw.args.get("recompute_modules")}
    for k, v in chosen.changes.items():
        if old.get(k, raw.args.get(k)) != v:
            changes[k] = (old.get(k, raw.args.get(k)), v)
    E = chosen.estimate
    L = chosen.layout
    reasons = [head]
    if "micro_batch_size" in changes:
        reasons.append(f"micro-batch size {mbs0} -> {L.micro_batch_size}: activations scale with the micro-batch "
                       f"({L.num_microbatches} micro-batches per step instead of {L0.num_microbatches})")
    if "pipeline_model_parallel_size" in changes:
        edp = ""
        if experts is not None:
            ep, etp = experts
            edp = f", expert DP {world // (etp * ep * pp0)} -> {world // (etp * ep * L.pp)}"
        reasons.append(f"pipeline-model-parallel size {pp0} -> {L.pp}: each stage holds fewer layers and a smaller share of "
                       f"the model state (DP {L0.dp} -> {L.dp}{edp})")
    if "recompute_granularity" in changes or "recompute_modules" in changes:
        what = (f" ({L.recompute_method}, {L.recompute_num_layers} layer per block)" if L.recompute_granularity == "full" else
                f" of {', '.join(L.recompute_modules)}" if L.recompute_granularity == "selective" else "")
        reasons.append(f"activation recomputation -> {L.recompute_granularity}{what}: activations are recomputed in the "
                       "backward pass instead of kept")
        if L.recompute_granularity == "selective" and rungs:
            reasons.append("recompute ladder (least extra forward work per byte freed first): " + "; ".join(
                f"+{r.added} frees {format_bytes(r.saved_bytes)} for {r.flops_per_token / 1e9:.3g} GFLOP/token"
                for r in rungs) + ("; then full" if any(lv.get("recompute_granularity") == "full" for lv in levels) else ""))
    if "global_batch_size" in changes:
        reasons.append(f"global batch size pinned at {gbs0}: it defaulted to MBS x DP, which the new layout would change")
    reasons.extend(notes)
    reasons.append(f"chosen: {describe_layout_choice(L)}: needs {format_bytes(E.peak_device_bytes)} = {_pct(E)} on stage "
                   f"pp{E.critical_stage} (within the threshold); least model parallelism first, then the largest micro-batch ({considered} candidates estimated)")
    return AutotuneResult(status, E0, chosen, changes, tuple(reasons), considered, tuple(rejected))



def _what_would_fit(raw: RawConfig, L0: Layout, gbs: int, megatron_version: str | None, vocab_size: int | None,
                    est_kw: Mapping[str, Any], allow_recompute: bool, allow_pp: bool) -> tuple[str, ...]:
    """What would make a layout fit when nothing within the knobs does: activation recomputation (when it
    was not allowed) on these GPUs, else the same search on 2, 4 or 8 times as many GPUs, the global batch
    size kept, else (recomputation not allowed) more GPUs with recomputation."""
    def fitting(world: int, recompute: bool) -> Candidate | None:
        try:
            r = autotune(raw.with_args(global_batch_size=gbs), world_size=world, megatron_version=megatron_version,
                         vocab_size=vocab_size, allow_recompute=recompute, allow_pp=allow_pp, _hints=False, **est_kw)
        except MemguardError:  # the layout breaks a rule at that world size
            return None
        if r.status == "fits":
            return Candidate({}, r.original.layout, r.original)
        return r.chosen

    def said(c: Candidate) -> str:
        return f"{c.describe()}, {format_bytes(c.estimate.peak_device_bytes)} = {_pct(c.estimate)}"

    out: list[str] = []
    if not allow_recompute:
        c = fitting(L0.world_size, True)
        if c is not None:
            out.append(f"with activation recomputation (--memguard-allow-recompute): {said(c)}")
    for k in (2, 4, 8):
        c = fitting(L0.world_size * k, allow_recompute)
        if c is not None:
            out.append(f"on {L0.world_size * k} GPUs ({k}x as many): {said(c)}")
            break
    if not out and not allow_recompute:
        # neither alone is enough: both together (more GPUs and recomputation)
        for k in (2, 4, 8):
            c = fitting(L0.world_size * k, True)
            if c is not None:
                out.append(f"on {L0.world_size * k} GPUs ({k}x as many) with activation recomputation "
                           f"(--memguard-allow-recompute): {said(c)}")
                break
    return tuple(out)
