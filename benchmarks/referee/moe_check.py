"""Hand checks of what an MoE layer saves, against the referee's dump at the peak.

    python -m benchmarks.referee.moe_check [benchmarks/results/referee-moe-measured.json] [--config NAME]

For every MoE configuration and rank, take the micro-batch whose forward holds the peak, and for each
MoE layer sum the live storages the layer's modules made in that forward (labels `` L<n>.<module>``
from moe_probe.py). Compare each module's bytes with the formula of what megatron-core 0.16.1 saves
(derived in MOE-NOTES.md), evaluated with the layer's real routing (T tokens in, N rows to the local
experts, from the run's routing records). Prints one row per (config, rank, layer, module) and the
totals; exits 1 when any module differs from its formula.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Tuple

_DT = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
MODULES = ("router", "dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "experts",
           "shared_experts", "combine_preprocess", "token_combine", "combine_postprocess")


def formula(s: Dict[str, Any], rec: Dict[str, Any]) -> Dict[str, int]:
    """Bytes one MoE layer keeps per module after its forward (saved for backward or held by the
    dispatcher until the layer's next forward), megatron-core 0.16.1, local spec (SequentialMLP),
    bf16, no recompute. `rec`: the layer's routing record (T, N, probs dtype)."""
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
    out = {m: 0 for m in MODULES}

    if s.get("moe_router_pre_softmax"):
        # softmax over all experts first (fp32 output saved), then topk (int64 indices saved)
        out["router"] = 4 * T * E + 8 * T * k
    else:
        # topk int64 indices [T,k] (shared with scatter's index) + fp32 softmax of the top-k
        out["router"] = 8 * T * k + 4 * T * k
    if s.get("moe_aux_loss_coeff"):
        # compute_routing_scores_for_aux_loss: fp32 softmax over all experts (saved by the sum), the
        # int64 tokens per expert [E] (saved by the mul), the fp32 loss scalar (MoEAuxLossAutoScaler)
        out["router"] += 4 * T * E + 8 * E + 4
    if s.get("moe_z_loss_coeff") is not None:
        # logsumexp saves its input (the logits) and output [T], the scalar z-loss: router dtype
        out["router"] += p * T * E + p * T + p
    if alltoall:
        # held by MoEAlltoAllTokenDispatcher until the layer's next forward: self.probs [T,E] (router
        # dtype) and self.routing_map [T,E] bool (with a capacity factor: probs * mask and the mask,
        # the same sizes)
        out["router"] += p * T * E + T * E
        if drop_pad:
            # permute with drop_and_pad: int64 indices [E, C] (index_select of the tokens) and the
            # int64 flat indices of the probs [E·C] (index_select of probs.T); the transposed probs are
            # not saved; + the int64 [E·ETP] chunk sizes (host memory on a GPU, counted here)
            out["dispatch_preprocess"] = 16 * (N // etp) + 8 * E * etp  # C·E rows = N / ETP
        else:
            # permute (0.16.1): masked_select saves its input probs.T.contiguous() [E,T] and the bool
            # mask [E,T]; index_select saves the int64 token indices [T·k]
            out["dispatch_preprocess"] = p * T * E + T * E + 8 * T * k
        # the expert input and its probs: after sort_chunks (E_l > 1) a fresh copy, else the
        # all-to-all / all-gather output itself
        where = "dispatch_postprocess" if (El > 1 or etp > 1) else "token_dispatch"
        out[where] += a * N * h + p * N
    else:
        # allgather: local_map [T·ETP·EP, E_l] bool (held), its transpose (saved by masked_select),
        # local_probs transposed [E_l, T·ETP·EP] (masked_select's input), int64 sorted indices [N],
        # the permuted tokens [N,h] and probs [N]
        G = T * etp * ep
        out["dispatch_postprocess"] = 2 * G * El + p * G * El + 8 * N + a * N * h + p * N
    if fused:
        # WeightedSwiGLUFunction saves fc1's output [N, 2F]; fc2 saves the activation output [N, F]
        out["experts"] = a * N * (2 * F + F)
    else:
        # unfused GLU per expert: fc1 output [n,2F], silu(x1) [n,F], x2 + glu_linear_offset [n,F], the
        # product [n,F], the product times probs [n,F] (fc2's input)
        out["experts"] = a * N * (2 * F + 4 * F)
    Fs = s.get("moe_shared_expert_intermediate_size")
    if Fs:
        Fs //= tp
        Ts = T * tp if s.get("sequence_parallel") else T  # fc1 output covers the gathered sequence
        # fused: SwiGLUFunction saves fc1's output [Ts, 2Fs], fc2 its input [Ts, Fs]; unfused: fc1
        # output, silu(x1), x2 + glu_linear_offset, the product (fc2's input): 5·Fs per token
        out["shared_experts"] = a * Ts * (3 * Fs if fused else 5 * Fs)
        if s.get("moe_shared_expert_gate"):
            # output * sigmoid(x·w_gate): the shared output [T,h] and the gate [T,1]
            out["shared_experts"] += a * T * h + a * T
    return out


def measured(rank: Dict[str, Any], phase: str, layer: int) -> Tuple[Dict[str, int], List[Dict[str, Any]]]:
    got = {m: 0 for m in MODULES}
    rows = []
    for g in rank["peak_all_storages"]:
        for m in MODULES:
            if g["phase"] == f"{phase} L{layer}.{m}":
                got[m] += g["bytes"]
                rows.append(g)
    return got, rows


def check(result: Dict[str, Any], only: List[str] = ()) -> List[Dict[str, Any]]:
    out = []
    for c in result["configs"]:
        if c.get("status") != "ok" or (only and c["name"] not in only):
            continue
        s = c["settings"]
        if s.get("recompute_granularity") == "selective" and "moe" in (s.get("recompute_modules") or []):
            continue  # the whole MoE layer is recomputed: nothing of 1.5-1.9 stays saved
        if s.get("overlap_moe_expert_parallel_comm"):
            continue  # combined 1F1B bypasses schedules.forward_step: no per-micro-batch phase labels
        for r in c["ranks"]:
            if " L" in r["peak_phase"]:
                continue  # the peak is inside a layer: its transients are live too (see MOE-NOTES.md)
            phase = " ".join(r["peak_phase"].split()[:3 if r["peak_phase"].split()[2].startswith("mb") else 4])
            for rec in r["routing"]:
                if rec["phase"] != phase:
                    continue
                want = formula(s, rec)
                got, _ = measured(r, phase, rec["layer"])
                for m in MODULES:
                    if want[m] or got[m]:
                        out.append({"config": c["name"], "rank": r["rank"], "layer": rec["layer"], "module": m,
                                    "T": rec["tokens"], "N": rec["expert_input_rows"],
                                    "measured": got[m], "formula": want[m]})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", default="benchmarks/results/referee-moe-measured.json")
    p.add_argument("--config", nargs="*", default=())
    a = p.parse_args(argv)
    with open(a.path) as f:
        rows = check(json.load(f), a.config)
    bad = [r for r in rows if r["measured"] != r["formula"]]
    for r in rows:
        flag = "" if r["measured"] == r["formula"] else "   <-- differs"
        print(f"{r['config']:<30} r{r['rank']} L{r['layer']} {r['module']:<20} T={r['T']:<5} N={r['N']:<5} "
              f"measured {r['measured']:>10,}  formula {r['formula']:>10,}{flag}")
    print(f"{len(rows)} module rows, {len(rows) - len(bad)} exact, {len(bad)} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
