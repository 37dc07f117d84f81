"""Hand checks of what an MoE layer saves, against the referee's dump at the peak.

    python -m benchmarks.referee.moe_check [benchmarks/results/referee-moe-measured.json] [--config NAME]

For every MoE configuration and rank, take the forwards whose MoE layers are whole at the peak
(forward_phases: the peak's own forward, the layers before the one the peak is inside, the later
micro-batches of a backward peak, the last micro-batch of the combined 1F1B schedule), and for each such
MoE layer sum the live storages the layer's modules made in that forward (labels `` L<n>.<module>``
from moe_probe.py). Compare each module's bytes with the formula of what megatron-core 0.16.1 saves
(derived in MOE-NOTES.md), evaluated with the layer's real routing (T tokens in, N rows to the local
experts, from the run's routing records). Prints one row per (config, rank, layer, module), the (config, rank)
pairs it cannot check and why (none on the stored grid), and the totals; exits 1 when any module differs
from its formula.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

_DT = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
MODULES = ("router", "dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "experts",
           "shared_experts", "combine_preprocess", "token_combine", "combine_postprocess")


def formula(s: Dict[str, Any], rec: Dict[str, Any]) -> Dict[str, int]:
    """Bytes one MoE layer keeps per module after its forward (saved for backward or held by the
    dispatcher until the layer's next forward), megatron-core 0.16.1, local spec (SequentialMLP),
    bf16. `rec`: the layer's routing record (T, N, probs dtype). Only the modules the formulas speak
    of are keys; a key with 0 is a claim that the module keeps nothing (checked like any other)."""
    T, N = rec["tokens"], rec["expert_input_rows"]
    p = _DT[rec["probs_dtype"]]  # router dtype: --moe-router-dtype, else the activation dtype
    k, E = s["moe_router_topk"], s["num_experts"]
    ep, etp, tp = s["expert_model_parallel_size"], s["expert_tensor_parallel_size"], s["tensor_model_parallel_size"]
    El = E // ep
    h, F = s["hidden_size"], s["moe_ffn_hidden_size"] // etp
    a = 2  # bf16 activations
    alltoall = s.get("moe_token_dispatcher_type", "allgather") == "alltoall"
    fused = bool(s.get("bias_activation_fusion"))
    drop_pad = bool(s.get("moe_pad_expert_input_to_capacity"))
    out: Dict[str, int] = {}

    def add(module: str, nbytes: int) -> None:
        out[module] = out.get(module, 0) + nbytes

    combined = bool(s.get("overlap_moe_expert_parallel_comm"))
    if (s.get("recompute_granularity") == "selective" and "moe" in (s.get("recompute_modules") or [])
            and not combined):
        # (the combined 1F1B schedule calls the layer's parts, never MoELayer.forward, where the checkpoint is)
        # MoELayer.forward under tensor_parallel.checkpoint (moe_layer.py 0.16.1): the checkpoint keeps only
        # its input (the pre-MLP norm output, counted with the norms); what stays is what the dispatcher
        # keeps as attributes until the layer's next forward, made by the checkpointed forward
        if alltoall:
            # MoEAlltoAllTokenDispatcher.dispatch_preprocess: self.probs [T,E] (router dtype; with a capacity
            # factor probs * mask, the same size) and self.routing_map [T,E] bool, made under the router's
            # label; self.reversed_local_input_permutation_mapping, permute's int64 indices: [T·k], with
            # drop_and_pad [E·C] = N / ETP
            add("router", p * T * E + T * E)
            add("dispatch_preprocess", 8 * (N // etp if drop_pad else T * k))
        else:
            # not in the grid: MoEAllGatherTokenDispatcher.dispatch_postprocess keeps self.local_map
            # [T·ETP·EP, E_l] bool, self.local_probs [N] (router dtype) and the int64 mapping [N]
            add("dispatch_postprocess", T * etp * ep * El + p * N + 8 * N)
        return out

    if s.get("moe_router_pre_softmax"):
        # softmax over all experts first (fp32 output saved), then topk (int64 indices saved)
        add("router", 4 * T * E + 8 * T * k)
    else:
        # topk int64 indices [T,k] (shared with scatter's index) + fp32 softmax of the top-k
        add("router", 8 * T * k + 4 * T * k)
    if s.get("moe_input_jitter_eps") is not None:
        # TopKRouter.apply_input_jitter (router.py): input * Uniform(1-eps, 1+eps).rsample(input.shape),
        # low/high in the input's dtype. rsample = low + rand * (high - low): the `add` is the noise
        # [T,h], saved by the product (the input needs a gradient); the product [T,h] is the gating's
        # input, which RouterGatingLinearFunction saves as it comes (moe_utils.py: save_for_backward(inp)
        # before any cast to the router dtype). Both in the activation dtype: 2·a·T·h
        add("router", 2 * a * T * h)
    if s.get("moe_aux_loss_coeff"):
        # compute_routing_scores_for_aux_loss: fp32 softmax over all experts (saved by the sum), the
        # int64 tokens per expert [E] (saved by the mul), the fp32 loss scalar (MoEAuxLossAutoScaler)
        add("router", 4 * T * E + 8 * E + 4)
    if s.get("moe_z_loss_coeff") is not None:
        # logsumexp saves its input (the logits) and output [T], the scalar z-loss: router dtype
        add("router", p * T * E + p * T + p)
    if alltoall:
        # held by MoEAlltoAllTokenDispatcher until the layer's next forward: self.probs [T,E] (router
        # dtype) and self.routing_map [T,E] bool (with a capacity factor: probs * mask and the mask,
        # the same sizes)
        add("router", p * T * E + T * E)
        if drop_pad:
            # permute with drop_and_pad: int64 indices [E, C] (index_select of the tokens) and the
            # int64 flat indices of the probs [E·C] (index_select of probs.T); the transposed probs are
            # not saved; + the int64 [E·ETP] chunk sizes (host memory on a GPU, counted here)
            add("dispatch_preprocess", 16 * (N // etp) + 8 * E * etp)  # C·E rows = N / ETP
        else:
            # permute (0.16.1): masked_select saves its input probs.T.contiguous() [E,T] and the bool
            # mask [E,T]; index_select saves the int64 token indices [T·k]
            add("dispatch_preprocess", p * T * E + T * E + 8 * T * k)
        # the expert input and its probs: after sort_chunks (E_l > 1) a fresh copy, else the
        # all-to-all / all-gather output itself
        add("dispatch_postprocess" if (El > 1 or etp > 1) else "token_dispatch", a * N * h + p * N)
        if combined:
            # --overlap-moe-expert-parallel-comm (combined 1F1B, fine_grained_callables.py 0.16.1):
            # submodule_dispatch_forward passes node.detach(dispatched_probs) on, and ScheduleNode.detach
            # keeps the original, the all-to-all's probs output [N], in node.before_detached until the
            # node's backward. (The all-to-all's token output, the mlp node's input, is freed by free_input:
            # resize_(0) after the node's forward; the permuted tokens and probs likewise by moe_dispatch.)
            add("token_dispatch", p * N)
    else:
        # allgather: local_map [T·ETP·EP, E_l] bool (held), its transpose (saved by masked_select),
        # local_probs transposed [E_l, T·ETP·EP] (masked_select's input), int64 sorted indices [N],
        # the permuted tokens [N,h] and probs [N]
        G = T * etp * ep
        add("dispatch_postprocess", 2 * G * El + p * G * El + 8 * N + a * N * h + p * N)
    if fused:
        # WeightedSwiGLUFunction saves fc1's output [N, 2F]; fc2 saves the activation output [N, F]
        add("experts", a * N * (2 * F + F))
    else:
        # unfused GLU per expert: fc1 output [n,2F], silu(x1) [n,F], x2 + glu_linear_offset [n,F], the
        # product [n,F], the product times probs [n,F] (fc2's input)
        add("experts", a * N * (2 * F + 4 * F))
    Fs = s.get("moe_shared_expert_intermediate_size")
    if Fs:
        for module, nbytes in _shared_experts(s, T, h, Fs // tp, tp, a, fused).items():
            add(module, nbytes)
    return out


def _shared_experts(s: Dict[str, Any], T: int, h: int, Fs: int, tp: int, a: int, fused: bool) -> Dict[str, int]:
    """The shared experts' saved bytes, by the module label they are made under (Fs: F_s / TP)."""
    sp = bool(s.get("sequence_parallel")) and tp > 1
    Ts = T * tp if sp else T  # fc1's output covers the gathered sequence
    gate = bool(s.get("moe_shared_expert_gate"))
    if s.get("moe_shared_expert_overlap"):
        # --moe-shared-expert-overlap (alltoall only: TransformerConfig; MoEAlltoAllTokenDispatcher,
        # token_dispatcher.py 0.16.1): the dispatcher runs SharedExpertMLP's pieces (shared_experts.py), so
        # the bytes carry the dispatcher's labels and MoELayer.shared_experts_compute runs nothing
        # (TransformerConfig refuses `shared_experts` recompute with the overlap).
        out = {"shared_experts": 0, "dispatch_preprocess": 0, "dispatch_postprocess": 0}
        # dispatch_preprocess -> pre_forward_comm: with SP, gather_from_sequence_parallel_region makes a new
        # [T·TP, h] tensor (cached_fc1_input); fc1 runs with explicit_expert_comm (no gather of its own) and
        # saves that gathered input. Without SP, copy_to_tensor_model_parallel_region returns the input itself.
        if sp:
            out["dispatch_preprocess"] += a * Ts * h
        # dispatch_postprocess -> linear_fc1_forward_and_act: fc1's output [Ts, 2Fs]; its own unfused GLU is
        # silu(x0) * x1 on chunk views (no glu_linear_offset add, unlike MLP.forward): silu's output [Ts, Fs]
        # and the product [Ts, Fs] (fc2's input, saved by fc2 in combine_postprocess). Fused: bias_swiglu_impl
        # saves fc1's output, fc2 its input
        out["dispatch_postprocess"] += a * Ts * (3 * Fs if fused else 4 * Fs)
        if gate:
            # not in the grid: pre_forward_comm's sigmoid(x·w_gate) [T,1] (dispatch_preprocess) and
            # get_output's product, which saves post_forward_comm's output [T,h] (combine_postprocess)
            out["dispatch_preprocess"] += a * T
            out["combine_postprocess"] = a * T * h
        return out
    if s.get("recompute_granularity") == "selective" and "shared_experts" in (s.get("recompute_modules") or []):
        # MoELayer.shared_experts_compute (moe_layer.py 0.16.1): tensor_parallel.checkpoint(self.shared_experts,
        # False, hidden_states) keeps only its input, the pre-MLP norm output (counted with the norms); the
        # gate runs inside the checkpoint too
        return {"shared_experts": 0}
    # MLP.forward (mlp.py): fused, SwiGLUFunction saves fc1's output [Ts, 2Fs], fc2 its input [Ts, Fs];
    # unfused: fc1 output, silu(x1), x2 + glu_linear_offset, the product (fc2's input): 5·Fs per token.
    # With SP, ColumnParallelLinear saves its local input and gathers again in backward
    nbytes = a * Ts * (3 * Fs if fused else 5 * Fs)
    if gate:
        # output * sigmoid(x·w_gate): the shared output [T,h] and the gate [T,1]
        nbytes += a * T * h + a * T
    return {"shared_experts": nbytes}


def measured(rank: Dict[str, Any], phase: str, layer: int) -> Tuple[Dict[str, int], List[Dict[str, Any]]]:
    got = {m: 0 for m in MODULES}
    rows = []
    for g in rank["peak_all_storages"]:
        for m in MODULES:
            if g["phase"] == f"{phase} L{layer}.{m}":
                got[m] += g["bytes"]
                rows.append(g)
    return got, rows


def config_skip(c: Dict[str, Any]) -> Optional[str]:
    """Why no module row of configuration `c` can be checked against the formulas (None: it can)."""
    s = c["settings"]
    if s.get("overlap_moe_expert_parallel_comm") and s.get("pipeline_model_parallel_size", 1) > 1:
        return "combined 1F1B with PP > 1: where the peak falls in the schedule is not derived"
    if (s.get("overlap_moe_expert_parallel_comm")
            and s["num_experts"] == s["expert_model_parallel_size"] and s["expert_tensor_parallel_size"] == 1):
        return ("combined 1F1B with one local expert: the experts' input is the all-to-all output, which "
                "free_input resizes to 0; not derived")
    return None


def forward_phases(s: Dict[str, Any], r: Dict[str, Any]) -> List[Tuple[str, int]]:
    """(forward phase, first layer not to check) of rank `r`: the MoE layers that hold all they saved at
    the peak. Peak between layers of a forward: every layer of that forward. Peak inside layer n of a
    forward (`itI fwd mbJ Ln.module`): the layers before n (layer n's transients are live too, its
    later modules have not run). Peak in the backward of micro-batch K (`itI bwd mbK`): every layer of
    the later micro-batches of the iteration whose forward ran (their labels are in the peak dump): 1F1B
    runs the backwards in micro-batch order, so none of theirs has started. A backward of an interleaved
    schedule: none. The combined 1F1B schedule (--overlap-moe-expert-parallel-comm, PP = 1) labels the
    whole iteration `itI schedule`: its peak is at the last micro-batch's loss (MOE-NOTES.md), after
    the other micro-batches' layers ran their backward (interleaved with that forward), so the layers
    of the last forward (the last routing record of each layer) are whole."""
    words, every = r["peak_phase"].split(), 1 << 30
    if words[1:] == ["schedule"] and s.get("overlap_moe_expert_parallel_comm"):
        return [(r["peak_phase"], every)]
    inside = [w for w in words[2:] if w.startswith("L") and "." in w]
    if words[1] == "fwd":
        fwd = " ".join(words[:3 if words[2].startswith("mb") else 4])
        return [(fwd, int(inside[0][1:].split(".")[0]) if inside else every)]
    if words[1] != "bwd" or len(words) != 3 or not words[2].startswith("mb"):
        return []
    k = int(words[2][2:])
    held = {g["phase"].split()[2] for g in r["peak_all_storages"]
            if g["phase"].startswith(f"{words[0]} fwd mb") and " L" in g["phase"]}
    return [(f"{words[0]} fwd {mb}", every) for mb in sorted(held, key=lambda m: int(m[2:])) if int(mb[2:]) > k]


def rank_skip(s: Dict[str, Any], r: Dict[str, Any]) -> Optional[str]:
    """Why no module row of rank `r` (settings `s`) can be checked (None: it can)."""
    phases = dict(forward_phases(s, r))
    if any(rec["phase"] in phases and rec["layer"] < phases[rec["phase"]] for rec in r["routing"]):
        return None
    if " L" in r["peak_phase"]:
        return "peak inside the first MoE layer of a forward: its transients are live too (MOE-NOTES.md)"
    if " bwd " in r["peak_phase"]:
        return "peak in a backward with no later micro-batch's forward held"
    return f"peak phase {r['peak_phase']!r}: no forward whose MoE layers are whole is known"


def skipped(result: Dict[str, Any], only: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """Every (config, rank) of the run that check() cannot compare, and why."""
    out = []
    for c in result["configs"]:
        if c.get("status") != "ok" or (only and c["name"] not in only):
            continue
        why = config_skip(c)
        for r in c["ranks"]:
            reason = why or rank_skip(c["settings"], r)
            if reason:
                out.append({"config": c["name"], "rank": r["rank"], "reason": reason})
    return out


def check(result: Dict[str, Any], only: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """One row per (config, rank, MoE layer, module) the formulas speak of or the run measured."""
    out = []
    for c in result["configs"]:
        if c.get("status") != "ok" or (only and c["name"] not in only) or config_skip(c):
            continue
        for r in c["ranks"]:
            phases = dict(forward_phases(c["settings"], r))
            last = {(rec["phase"], rec["layer"]): rec for rec in r["routing"]}  # one per forward but combined 1F1B's
            for (phase, layer), rec in last.items():
                if phase not in phases or layer >= phases[phase]:
                    continue
                want = formula(c["settings"], rec)
                got, _ = measured(r, phase, rec["layer"])
                for m in MODULES:
                    if m in want or got[m]:
                        out.append({"config": c["name"], "rank": r["rank"], "phase": phase,
                                    "layer": rec["layer"], "module": m,
                                    "T": rec["tokens"], "N": rec["expert_input_rows"],
                                    "measured": got[m], "formula": want.get(m, 0)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", default="benchmarks/results/referee-moe-measured.json")
    p.add_argument("--config", nargs="*", default=())
    a = p.parse_args(argv)
    with open(a.path) as f:
        result = json.load(f)
    rows = check(result, a.config)
    bad = [r for r in rows if r["measured"] != r["formula"]]
    for r in rows:
        flag = "" if r["measured"] == r["formula"] else "   <-- differs"
        print(f"{r['config']:<30} r{r['rank']} {r['phase']} L{r['layer']} {r['module']:<20} "
              f"T={r['T']:<5} N={r['N']:<5} measured {r['measured']:>10,}  formula {r['formula']:>10,}{flag}")
    skips = skipped(result, a.config)
    for r in skips:
        print(f"{r['config']:<30} r{r['rank']} not checked: {r['reason']}")
    print(f"{len(rows)} module rows, {len(rows) - len(bad)} exact, {len(bad)} differ; "
          f"{len(skips)} (config, rank) pairs not checked")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
