"""Terminal tables: a per-stage summary, the breakdown of the critical stage, the verdict."""
from __future__ import annotations

from typing import Any

import os
import re
import sys
from typing import IO, Sequence

from ..estimator.result import GROUPS, Estimate, StageEstimate
from ..units import format_bytes
from ..partition import mixed_mixers

_COLOURS = {"fits": "32", "tight": "33", "will not fit": "31", "unknown": "0"}


def use_colour(stream: IO[str] | None = None) -> bool:
    stream = stream or sys.stdout
    return hasattr(stream, "isatty") and stream.isatty() and not os.environ.get("NO_COLOR")


def _c(text: str, code: str, colour: bool) -> str:
    return f"\033[{code}m{text}\033[0m" if colour else text


_ANSI = re.compile(r"\033\[[0-9;]*m")


def visible_len(text: str) -> int:
    """Length on the terminal: colour escape codes take no room."""
    return len(_ANSI.sub("", str(text)))


def table(rows: Sequence[Sequence[str]], header: Sequence[str], right: Sequence[int] = ()) -> str:
    """Aligned plain-text table; columns in ``right`` are right-aligned (numbers). Cells may be coloured."""
    widths = [max(visible_len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def pad(v, i):
        fill = " " * (widths[i] - visible_len(v))
        return fill + str(v) if i in right else str(v) + fill

    def fmt(r):
        return "  ".join(pad(v, i) for i, v in enumerate(r)).rstrip()
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)])


def _dsa_only(L: Any) -> bool:
    """Whether every core attention of the model is DSA's (no Transformer Engine attention kernel to name): the GPT
    variant, or a hybrid pattern whose attention layers are all 'D'."""
    pattern = (L.hybrid_layer_pattern or "") + (L.hybrid_mtp_pattern or "")
    return L.experimental_attention_variant == "dsa" and not pattern or "D" in pattern and not set("*+") & set(pattern)


def describe_layout(est: Estimate) -> str:
    L = est.layout
    par = f"TP{L.tp} PP{L.pp}" + (f" (VPP {L.vpp})" if L.vpp > 1 else "") + f" CP{L.cp} DP{L.dp}"
    if L.moe is not None:   # the expert grid: its DP group shards the expert optimizer state
        m = L.moe
        par += f" EP{m.ep} ETP{m.etp} (expert DP {L.world_size // (m.etp * m.ep * L.pp)})"
    rec = L.recompute_granularity or "none"
    if L.recompute_granularity == "full":
        rec += f" {L.recompute_method} {L.recompute_num_layers}"
    elif L.recompute_granularity == "selective":
        rec += " " + ",".join(L.recompute_modules)
    model = (f"{L.num_layers} layers, hidden {L.hidden_size}, ffn {L.ffn_hidden_size}, {L.num_attention_heads} heads"
             + (f" / {L.num_query_groups} groups" if L.num_query_groups != L.num_attention_heads else "")
             + (f" (MLA, q rank {L.q_lora_rank or '-'}, kv rank {L.kv_lora_rank})" if L.multi_latent_attention else "")
             + (f" (DSA indexer {L.dsa_indexer_n_heads} x {L.dsa_indexer_head_dim}, top-k {L.dsa_indexer_topk}"
                + (f", loss {L.dsa_indexer_loss_coeff:g}" if L.dsa_indexer_loss_coeff else "") + ")"
                if L.dsa_indexer_n_heads else "")
             + f", vocab {L.padded_vocab_size}")
    batch = f"seq {L.seq_length}, MBS {L.micro_batch_size}, GBS {L.global_batch_size} ({L.num_microbatches} micro-batches)"
    opts = [par, "SP" if L.sequence_parallel else "no SP", "dist-opt" if L.use_distributed_optimizer else "no dist-opt",
            f"recompute {rec}", L.params_dtype, L.transformer_impl]
    return f"model:  {model}\n{experts_line(L)}{adapters_line(L)}batch:  {batch}\nlayout: {', '.join(opts)}"


def adapters_line(L: Any) -> str:
    """LoRA / DoRA fine-tuning: the scheme, rank and targets, and the whole model's trainable parameters (a count a
    user can check against PEFT's own print-out), as one line ending in a newline; "" without PEFT."""
    if L.peft is None:
        return ""
    from ..estimator.peft import adapter_param_count
    from ..layout.peft import SCHEME_NAMES

    p = L.peft
    return (f"adapters: {SCHEME_NAMES[p.scheme]} rank {p.dim} on {', '.join(p.target_modules)}; "
            f"{adapter_param_count(L):,} trainable parameters\n")


def experts_line(L: Any) -> str:
    """MoE models: the experts and the model's total and active parameters (published figures a user can
    check), as one line ending in a newline; "" for dense models."""
    if L.moe is None:
        return ""
    from ..estimator.params import active_parameters, total_parameters

    m = L.moe
    shared = f", shared expert {m.moe_shared_expert_intermediate_size}" if m.moe_shared_expert_intermediate_size else ""
    return (f"experts: {m.num_experts} routed experts of width {m.moe_ffn_hidden_size}, top-{m.moe_router_topk}{shared}, "
            f"in {m.num_moe_layers} of {L.num_layers} layers, {m.moe_token_dispatcher_type} dispatcher; "
            f"{total_parameters(L) / 1e9:,.2f}B parameters, {active_parameters(L) / 1e9:,.2f}B active per token\n")


def stage_summary(est: Estimate) -> str:
    mem = est.gpu_memory_bytes
    rows = []
    for s in est.stages:
        state = s.group_bytes("weights") + s.group_bytes("gradients") + s.group_bytes("optimizer")
        act = s.group_bytes("activations") + s.group_bytes("logits_loss")
        label = f"pp{s.pp_rank}" + (" *" if s.pp_rank == est.critical_stage and len(est.stages) > 1 else "")
        rows.append([
            label, str(s.num_layers), f"{s.parameters / 1e6:,.1f}M", format_bytes(state), format_bytes(act),
            format_bytes(s.peak_allocated_bytes), format_bytes(s.peak_reserved_bytes), format_bytes(s.device_total_bytes),
            f"{s.device_total_bytes / mem:.0%}" if mem else "-",
        ])
    return table(rows, ["stage", "layers", "params", "model state", "activations", "peak alloc", "peak reserved",
                        "device total", "of GPU"], right=range(1, 9))


def breakdown(s: StageEstimate, detail: bool = False) -> str:
    order = {g: i for i, g in enumerate(GROUPS)}
    lvl = {"allocated": 0, "reserved": 1, "device": 2}
    terms = sorted(s.terms, key=lambda t: (lvl[t.level], order.get(t.group, 99)))
    rows = []
    subtotal = {"allocated": s.peak_allocated_bytes, "reserved": s.peak_reserved_bytes, "device": s.device_total_bytes}
    label = {"allocated": "= peak allocated", "reserved": "= peak reserved", "device": "= device total"}
    cur = "allocated"
    for t in terms:
        if t.level != cur:
            rows.append([label[cur], "", format_bytes(subtotal[cur]), ""])
            cur = t.level
        rows.append(["  " + t.name, t.group, format_bytes(t.bytes), t.detail if detail else ""])
    rows.append([label[cur], "", format_bytes(subtotal[cur]), ""])
    return table(rows, ["term", "group", "bytes", "detail" if detail else ""], right=(2,))


def layer_table(est: Estimate) -> str:
    """What one transformer layer keeps per micro-batch, op by op (the per-layer activation table)."""
    from ..estimator.activations import layer_activations

    L = est.layout
    if est.profile in ("local", "transformer_engine") and est.profile != L.transformer_impl:
        L = L.replace(transformer_impl=est.profile)
    if est.attention is not None:
        L = est.attention.modelled_layout(L)   # the kernel the estimate modelled on this GPU
    if est.gpu and (L.fp8 or L.fp4):
        L = L.replace(fp8_gpu=est.gpu)         # the GPU's FP8 storage, as the estimate sized it (estimator/core.py)
    if L.moe is None and not mixed_mixers(L):
        kinds = [None]
    else:   # one table per kind of layer the model has (dense and MoE layers; a hybrid's Mamba, attention, MLP)
        from ..partition import layer_kinds
        kinds = list(dict.fromkeys(layer_kinds(L)))
    out = []
    for kind in kinds:
        la = layer_activations(L, True, kind)
        rows = [[name, format_bytes(v)] for name, v in la.saved.items()]
        rows.append(["= per layer and micro-batch", format_bytes(la.total)])
        rows.append(["forward working set (peak extra)", format_bytes(max(la.fwd_transient, 0))])
        rows.append(["backward working set (peak extra)", format_bytes(max(la.bwd_transient, 0))])
        what = "one layer" if kind is None else (f"one {kind.mlp} layer" if not mixed_mixers(L) else
                                                 f"one {kind.mixer if kind.mixer != 'none' else kind.mlp} layer")
        out.append(table(rows, [f"saved tensor ({what}, one micro-batch)", "bytes"], right=(1,)))
    return "\n\n".join(out)


def render(est: Estimate, detail: bool = False, colour: bool | None = None, all_stages: bool = False) -> str:
    colour = use_colour() if colour is None else colour
    out = []
    gpu = f"{est.gpu} ({format_bytes(est.gpu_memory_bytes)})" if est.gpu else (
        format_bytes(est.gpu_memory_bytes) if est.gpu_memory_bytes else "no GPU given")
    out.append(f"memguard estimate - {est.layout.world_size} ranks on {gpu}, profile {est.profile}"
               + (", CPU (no GPU-only terms)" if est.device == "cpu" else ""))
    out.append(describe_layout(est))
    out.append("")
    out.append(stage_summary(est))
    out.append("")
    stages = est.stages if all_stages else [est.critical]
    for s in stages:
        out.append(f"pp{s.pp_rank} at its peak: {s.peak_phase}")
        out.append(breakdown(s, detail))
        if s.moe:
            out.append(moe_line(s, est.gpu_memory_bytes, est.threshold))
        if s.startup is not None:
            out.append(startup_line(s))
        if s.eval_step is not None:
            out.append(eval_line(s))
        out.append("")
    if detail and est.profile != "fujii2024":
        if est.attention is not None and not _dsa_only(est.layout):
            out.append(f"attention backend: {est.attention.selected} ({est.attention.why})")
        elif est.attention is not None and est.layout.dsa_kernel_backend == "tilelang":
            out.append("attention backend: DSA TileLang kernels (--dsa-kernel-backend tilelang: fused indexer top-k, "
                       "SparseMLA where its shapes allow, else the PyTorch path)")
        elif est.attention is not None:
            # DSAttention runs its own PyTorch path (--dsa-kernel-backend none), not Transformer Engine's attention
            out.append("attention backend: DSA PyTorch path (--dsa-kernel-backend none)")
        out.append(layer_table(est))
        out.append("")
    out.append(verdict_line(est, colour))
    if est.host_bytes_per_rank:
        out.append(host_line(est))
    if est.notes:
        out.append("")
        out.extend(f"note: {n}" for n in est.notes)
    return "\n".join(out)


def moe_line(s: Any, gpu_memory: int | None = None, threshold: float | None = None) -> str:
    """The MoE routing the estimate assumes, and the stage's peak in the dispatcher's worst case (with
    the GPU: its share of it and what it means for the verdict, docs/terms/moe.md)."""
    m, w = s.moe, s.moe["worst_case"]
    line = (f"MoE routing: balanced, {m['expert_rows_balanced']:,} token rows per MoE layer and micro-batch on this "
            f"rank's experts (the estimate); worst case ({m['routing']}): {m['expert_rows_worst']:,} rows, "
            f"peak allocated {format_bytes(w['peak_allocated_bytes'])}, device total {format_bytes(w['device_total_bytes'])}")
    if gpu_memory and threshold:
        frac = w["device_total_bytes"] / gpu_memory
        line += f" = {frac:.0%} of the GPU" + (
            f", within the {threshold:.0%} threshold: no routing can run this stage out of memory"
            if frac <= threshold else
            f", over the {threshold:.0%} threshold: the stage relies on the router balancing its load"
            + (" (forced biased routing does not: it can run out of memory)"
               if "forced_biased_std" in w else ""))
    return line


def worst_moe_stage(est: Estimate) -> StageEstimate:
    """The MoE stage whose worst-case routing needs the most device memory (the one-line logs show it)."""
    return max((s for s in est.stages if s.moe), key=lambda s: s.moe["worst_case"]["device_total_bytes"])


def host_line(est: Estimate) -> str:
    """Host memory is its own figure: the GPU verdict says nothing about it."""
    rank = max(est.stages, key=lambda s: s.host_bytes)
    parts = ", ".join(f"{t.name} {format_bytes(t.bytes)}" for t in rank.host_terms)
    return (f"host memory: {format_bytes(est.host_bytes_per_rank)} per rank ({parts}); "
            f"{format_bytes(est.host_bytes_per_node)} per node of {est.gpus_per_node} GPUs")


def startup_line(s: Any) -> str:
    """The start-up figure of an upcycling run (estimator/upcycling.py): its total and its allocated terms."""
    u = s.startup
    parts = ", ".join(f"{t['name']} {format_bytes(t['bytes'])}" for t in u["terms"] if t["level"] == "allocated")
    return (f"upcycling start-up: peak allocated {format_bytes(u['peak_allocated_bytes'])}, device total "
            f"{format_bytes(u['device_total_bytes'])} ({parts}); "
            + ("above" if u["device_total_bytes"] > s.device_total_bytes else "below") + " the training peak")


def eval_line(s: Any) -> str:
    """The evaluation step's figure (estimator/eval_step.py): its total and its forward-only terms."""
    e = s.eval_step
    parts = ", ".join(f"{t['name']} {format_bytes(t['bytes'])}" for t in e["terms"] if t["name"].startswith("eval_"))
    return (f"evaluation step (micro-batch {e['micro_batch_size']}, forward only): peak allocated "
            f"{format_bytes(e['peak_allocated_bytes'])}, device total {format_bytes(e['device_total_bytes'])} "
            f"({parts}); " + ("above" if e["device_total_bytes"] > s.device_total_bytes else "below")
            + " the training peak")


def verdict_line(est: Estimate, colour: bool = False) -> str:
    c = est.critical
    dom = max((t for t in c.terms if t.level == "allocated"), key=lambda t: t.bytes)
    v = _c(est.verdict.upper(), _COLOURS.get(est.verdict, "0"), colour)
    need = c.required_device_bytes
    at = ""
    if need > c.device_total_bytes:
        at = (" at the evaluation step" if c.eval_step is not None and need == c.eval_step["device_total_bytes"]
              else " at upcycling start-up")
    if est.gpu_memory_bytes:
        frac = need / est.gpu_memory_bytes
        head = est.gpu_memory_bytes * est.threshold - need
        return (f"verdict: {v} - critical stage pp{c.pp_rank} needs {format_bytes(need)}{at} = {frac:.0%} of "
                f"{format_bytes(est.gpu_memory_bytes)} (threshold {est.threshold:.0%}, headroom {format_bytes(head)}); "
                f"largest term: {dom.name} {format_bytes(dom.bytes)}")
    return (f"verdict: {v} (no GPU memory given) - critical stage pp{c.pp_rank} peaks at "
            f"{format_bytes(c.peak_allocated_bytes)} allocated; largest term: {dom.name} {format_bytes(dom.bytes)}")
