"""The closed form of Fujii, Watanabe & Yokota 2024 (arXiv 2411.06465), as the first author implemented it.

Source: ``tools/memory_estimate/memory_consumption_estimator.py`` and
``megatron/training/theoretical_memory_usage.py`` in github:okoge-kaz/Megatron-LM (Oct-Nov 2024), as
reconstructed in shared/reference/paper-2411.06465.md §1.7. First pipeline stage only:

    Phi = [ L*P_layer/p + h*v ] / t        (+ h*v/t + h when p == 1 and the output layer is untied)
    W   = Phi * ((2 + g) + 12/(d*c))       distributed optimizer; Phi * (2 + g + 12) without; g = 4 (fp32 grads) or 2
    A   = L * s*b*h/(t*c) * (12 + 4k/a + 8 h_ffn/h)  +  8 * (s/c)*b*h*p/t  (+ 4*(s/c)*b*h*(1 + v/h)/t when p == 1)

with the author's extra terms when FlashAttention is off (+ 4*b*a*s^2/t per layer, + b*a*s^2/t with
attention dropout; s = seq/c), for hidden dropout (+ 2sbh/t per layer), and for a non-gated MLP. The paper's safety rule is the
80% threshold: estimates at or below 0.8 x GPU memory never ran out of memory in its 454 runs.
"""
from __future__ import annotations

from ..gpus import GpuSpec
from ..layout import Layout
from .result import Estimate, StageEstimate, Term, verdict_for


def fujii_parameters(L: Layout) -> tuple[float, float]:
    """(P_layer, first-stage parameter count Phi) in the paper's factored form."""
    h, a, k, f = L.hidden_size, L.num_attention_heads, L.num_query_groups, L.ffn_hidden_size
    mlp = 2 * h * h * (1.5 * f / h) if L.gated_linear_unit else 2 * h * f
    p_layer = 2 * h * h * (1 + k / a) + mlp + 2 * h
    t, p = L.tp, L.pp
    phi = (L.num_layers * p_layer / p + h * L.padded_vocab_size) / t
    if p == 1 and L.untie_embeddings_and_output_weights:
        phi += h * L.padded_vocab_size / t + h
    return p_layer, phi


def fujii_bytes(L: Layout) -> tuple[float, float]:
    """(weights + gradients + optimizer, activations) in bytes on the first stage."""
    _, phi = fujii_parameters(L)
    g = 4 if L.accumulate_allreduce_grads_in_fp32 else 2
    d, c, t, p = L.dp, L.cp, L.tp, L.pp
    if L.use_distributed_optimizer:
        w = phi * ((2 + g) + 12 / (d * c))
    else:
        w = phi * (2 + g + 12)
    s, b, h = L.seq_length / c, L.micro_batch_size, L.hidden_size
    a, k, f, v = L.num_attention_heads, L.num_query_groups, L.ffn_hidden_size, L.padded_vocab_size
    sbh = s * b * h
    if L.gated_linear_unit:
        per = 12 + 4 * k / a + 8 * f / h
    else:
        per = 12 + 4 * k / a + 4 * f / h  # non-gated MLP: 2sbh + 4sb*h_ffn replace 2sbh + 8sb*h_ffn
    layer = sbh / t * per
    unfused = L.transformer_impl == "local" or L.attention_backend in ("unfused", "local")
    if unfused and L.recompute_granularity != "selective":
        layer += (2 * b * a * s * s + 2 * b * a * s * s + (b * a * s * s if L.attention_dropout > 0 else 0)) / t
    if L.hidden_dropout > 0:
        layer += 2 * sbh / t
    act = L.num_layers * layer + 8 * sbh * p / t
    if p == 1:
        act += 4 * sbh * (1 + v / h) / t
    return w, act


def estimate_fujii2024(layout: Layout, gpu: GpuSpec | None = None, gpu_memory: int | None = None,
                       threshold: float = 0.8) -> Estimate:
    from ..errors import NotModelledError

    if layout.multi_latent_attention:
        # the paper's P_layer and activation closed forms are those of Llama's grouped-query attention
        raise NotModelledError("--profile fujii2024", "multi-latent attention in the paper's closed form")
    # features the paper's closed form has no term for (its first stage is the last one when PP = 1)
    for on, what in ((layout.optimizer not in ("adam", "sgd"), f"the {layout.optimizer} optimizer"),
                     (layout.mtp_num_layers and layout.pp == 1, "multi-token prediction"),
                     (layout.attention_output_gate, "the attention output gate"),
                     (getattr(layout, "post_proj_norms", False),
                      f"Gemma {2 if getattr(layout, 'gemma2_attention', False) else 3}'s post-projection norms"),
                     (getattr(layout, "final_logit_softcapping", 0.0), "Gemma 2's final logit softcapping"),
                     (layout.cuda_graph_impl != "none", "CUDA graphs"),
                     (layout.cpu_offloading_num_layers or layout.fine_grained_activation_offloading,
                      "activation offloading")):
        if on:
            raise NotModelledError("--profile fujii2024", f"{what} in the paper's closed form")
    w, act = fujii_bytes(layout)
    _, phi = fujii_parameters(layout)
    total = int(round(w + act))
    terms = (
        Term("weights_and_optimizer", int(round(w)), "optimizer",
             detail="Phi x ((2 + g) + 12/(d*c)) with the distributed optimizer, Phi x (2 + g + 12) without"),
        Term("activations", int(round(act)), "activations",
             detail="L x sbh/(tc) x (12 + 4k/a + 8h_ffn/h) + 8sbhp/t (+ output layer when p = 1)"),
    )
    chunks = layout.stage_chunks(0)
    stage = StageEstimate(
        pp_rank=0, chunks=chunks, num_layers=sum(c.num_layers for c in chunks), parameters=int(round(phi)),
        persistent_bytes=int(round(w)), peak_allocated_bytes=total, peak_reserved_bytes=total,
        device_total_bytes=total, peak_phase="first stage, p micro-batches in flight (closed form)",
        in_flight=min(layout.pp, layout.num_microbatches), terms=terms,
    )
    mem = gpu_memory if gpu_memory is not None else (gpu.memory_bytes if gpu else None)
    return Estimate(
        layout=layout, profile="fujii2024", device="gpu", gpu=gpu.name if gpu else None, gpu_memory_bytes=mem,
        threshold=threshold, stages=(stage,), verdict=verdict_for(total, mem, threshold), critical_stage=0,
        notes=tuple(layout.notes) + ("fujii2024: the paper's closed form, first pipeline stage only, no overheads",),
    )
