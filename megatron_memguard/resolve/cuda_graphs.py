"""Section: CUDA graphs (``--cuda-graph-impl``, ``--cuda-graph-modules`` / ``--cuda-graph-scope``, the
deprecated ``--enable-cuda-graph`` / ``--external-cuda-graph``), with TransformerConfig.__post_init__'s rules
(megatron-core 0.16.1 and 0.19.2; 0.19 adds the ``full_iteration`` implementation and renames the scope to
modules, keeping ``--cuda-graph-scope`` as a deprecated alias)."""
from __future__ import annotations

from typing import Any, Mapping

from packaging.version import Version

from .args import Args, Context

MODULES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")


def _modules(a: Args) -> tuple[str, str | None, list[str]]:
    """(the dest the user gave, or None; its module names): 0.19's --cuda-graph-modules, the deprecated
    --cuda-graph-scope (dest cuda_graph_scope_deprecated on 0.19's parser, cuda_graph_scope in 0.16 and in
    TransformerConfig, which NeMo 2 / Bridge configs spell)."""
    given = [d for d in ("cuda_graph_modules", "cuda_graph_scope", "cuda_graph_scope_deprecated")
             if a.get(d) not in (None, "", [], "full")]
    if len(given) > 1:
        a.fail(given[1], "cannot be set together with --cuda-graph-modules (TransformerConfig)")
    if not given:
        return None, []
    dest = given[0]
    v = a.get(dest)
    # a list, or text as YAML and launch scripts write it ("[attn mlp]", "attn,mlp")
    # (validate_args turns them into CudaGraphModule members, which the hook's namespace may carry)
    items = v if isinstance(v, (list, tuple)) else [v]
    text = " ".join(str(getattr(x, "name", x)) for x in items)
    names = [n.split(".")[-1] for n in text.replace("[", " ").replace("]", " ").replace(",", " ").split()]
    names = [str(n).split(".")[-1] for n in names]      # CudaGraphModule.attn -> attn
    if "full" in names:
        if names != ["full"]:
            a.fail(dest, "full cannot be combined with other modules")
        return dest, []
    return dest, names


def cuda_graphs(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    impl = str(a.get("cuda_graph_impl", "none"))
    enable, external = a.bool_arg("enable_cuda_graph", False), a.bool_arg("external_cuda_graph", False)
    if enable or external:
        dest = "enable_cuda_graph" if enable else "external_cuda_graph"
        if impl != "none":
            a.fail(dest, "cannot be combined with --cuda-graph-impl (TransformerConfig)")
        if enable and external:
            a.fail("external_cuda_graph", "cannot be combined with --enable-cuda-graph")
        impl = "local" if enable else "transformer_engine"
    dest, names = _modules(a)
    # --cuda-graph-impl full_iteration and core/transformer/cuda_graph_config.py's migration of the deprecated
    # scope value: in the 0.18.2 wheel as in 0.19.2; 0.17.1 has local + --cuda-graph-scope full_iteration only
    new = ctx.version >= Version("0.18")
    known = ("none", "local", "transformer_engine") + (("full_iteration",) if new else ())
    if impl == "full_iteration" and not new:
        a.fail("cuda_graph_impl", "full_iteration needs megatron-core 0.18",
               "use --cuda-graph-impl local --cuda-graph-scope full_iteration")
        return dict(cuda_graph_impl="none", cuda_graph_modules=())
    if impl not in known:
        a.fail("cuda_graph_impl", f"must be one of {', '.join(known)}, got {impl!r}")
        return dict(cuda_graph_impl="none", cuda_graph_modules=())
    if "full_iteration" in names:
        # 0.16: local + scope full_iteration is the full-iteration graph; 0.19 migrates the deprecated
        # value to --cuda-graph-impl full_iteration (cuda_graph_config.py)
        if names != ["full_iteration"]:
            a.fail(dest, "full_iteration cannot be combined with other modules")
        if impl == "transformer_engine":
            a.fail(dest, "full_iteration needs --cuda-graph-impl local (the TE implementation graphs layers)")
        if impl == "none" and not new:
            names = []
        else:
            impl, names = "full_iteration", []
    for n in names:
        if n not in MODULES:
            a.fail(dest, f"unknown module {n!r}; known: {', '.join(MODULES)}")
    if impl == "none":
        return dict(cuda_graph_impl="none", cuda_graph_modules=())
    if impl == "full_iteration" and names:
        a.fail(dest, "must be empty with --cuda-graph-impl full_iteration")
    if impl == "full_iteration" and new and a.bool_arg("check_for_nan_in_loss_and_grad", True):
        # validate_args; Megatron-Bridge 0.6.2's ConfigContainer.validate asserts the same on its
        # rerun_state_machine.check_for_nan_in_loss (the key a Bridge reader names)
        key = a.key("check_for_nan_in_loss_and_grad").split(" ")[0]
        off = ("--no-check-for-nan-in-loss-and-grad (validate_args)" if key.startswith("--") else
               f"{key}=false (Megatron-Bridge's ConfigContainer.validate)")
        a.fail("cuda_graph_impl", f"full_iteration needs {off}")
    if impl == "full_iteration" and (a.int_arg("eval_iters", 100, minimum=None) or 0) > 0:
        a.notes.append(f"{a.key('cuda_graph_impl')} full_iteration: once validation ran, its graph keeps a second set of "
                       "static batch copies (not counted; --eval-iters 0 runs none)")
    if impl == "local" and ({"moe_router", "moe_preprocess"} & set(names)):
        names = sorted(set(names) | {"moe_router", "moe_preprocess"}, key=MODULES.index)  # local graphs both
    if "moe" in names and "moe_router" in names:
        a.fail(dest, "must not contain both moe and moe_router")
    if "moe_preprocess" in names and "moe_router" not in names:
        a.fail(dest, "moe_preprocess needs moe_router")
    if not (kw.get("num_experts") or kw.get("moe")) and ({"moe", "moe_router"} & set(names)):
        a.fail(dest, "moe and moe_router graphs need a mixture-of-experts model")
    if a.int_arg("cpu_offloading_num_layers", 0, minimum=0) and impl != "full_iteration":
        a.fail("cpu_offloading_num_layers", "does not work with CUDA graphs other than full_iteration (TransformerConfig)")
    if kw.get("recompute_granularity") == "full" and impl != "full_iteration":
        a.fail("recompute_granularity", "full recompute works only with the full-iteration CUDA graph (TransformerConfig)")
    if kw.get("moe") is not None and names:
        _moe_graphs(a, kw["moe"], dest or "cuda_graph_modules", names)
    if kw.get("fine_grained_activation_offloading") and ctx.version >= Version("0.19"):
        impl_dest = ("cuda_graph_impl" if str(a.get("cuda_graph_impl", "none")) != "none"
                     else "enable_cuda_graph" if enable else "external_cuda_graph")
        _offload_graphs(a, impl, dest or impl_dest, names, set(kw.get("offload_modules") or ()))
    _repeated_mtp_layer(a, kw, impl, names)
    _ep_overlap_graphs(a, kw, ctx, impl, dest, names)
    out: dict[str, Any] = dict(cuda_graph_impl=impl, cuda_graph_modules=tuple(names))
    if (kw.get("use_megatron_fsdp") and impl != "none" and new and not a.given("megatron_fsdp_cuda_graph_mode")
            and a.key("use_megatron_fsdp" if a.given("use_megatron_fsdp") else "use_custom_fsdp").startswith("--")):
        # training.py get_megatron_ddp_config (core 0.18.2 and 0.19.2): Megatron-FSDP runs in its CUDA-graph-safe mode
        # whenever --cuda-graph-impl is not none (resolve/fsdp.py _gradient_modes)
        out["megatron_fsdp_cuda_graph_mode"] = True
        if impl == "full_iteration" and not a.given("fsdp_all_gather_in_start_param_sync"):
            # and under the full-iteration graph, no all-gather in start_param_sync (the optimizer step's)
            out["fsdp_all_gather_in_start_param_sync"] = False
    return out


def _ep_overlap_graphs(a: Args, kw: Mapping[str, Any], ctx: Context, impl: str, dest: str | None,
                       names: list[str]) -> None:
    """CUDA graphs under --overlap-moe-expert-parallel-comm, TransformerConfig.__post_init__: the
    transformer_engine graphs without the moe or mlp module (core 0.16.1 to 0.19.2), and in 0.16.1 and 0.17.1 no
    other implementation ("CUDA graph scope on moe and mlp is not supported with overlap_moe_expert_parallel_comm")."""
    moe = kw.get("moe")
    if impl == "none" or moe is None or not moe.overlap_moe_expert_parallel_comm:
        return
    if impl != "transformer_engine" and ctx.version < Version("0.18"):
        key = "cuda_graph_impl" if a.given("cuda_graph_impl") else "enable_cuda_graph"
        a.fail(key, f"must be transformer_engine under --overlap-moe-expert-parallel-comm in megatron-core "
                    f"{ctx.version.major}.{ctx.version.minor} (TransformerConfig), got {impl}")
    elif impl == "transformer_engine" and {"moe", "mlp"} & set(names):
        a.fail(dest or "cuda_graph_modules", "must not contain moe or mlp under --overlap-moe-expert-parallel-comm "
               "(TransformerConfig)")


def _repeated_mtp_layer(a: Args, kw: Mapping[str, Any], impl: str, names: list[str]) -> None:
    """--mtp-use-repeated-layer (core 0.17+): one MTP layer called at each of the D depths of a micro-batch.
    The local graphs (CudaGraphManager.get_cudagraph_runner, transformer/cuda_graphs.py 0.17.1 to 0.19.2) give a
    call a runner that is FWD_READY, and a runner whose forward was recorded waits for its backward (BWD_READY):
    the D calls take D runners with their own static buffers, as D layers would (estimated so); the full-iteration
    graph captures the D calls as they run eagerly. Transformer Engine's graphs (TECudaGraphHelper) make one
    graphed callable per entry of mtp.layers, one here, and every call replays
    ``cuda_graphs[current_microbatch % len]`` (transformer/module.py): the D depths of a micro-batch replay the
    same graph, sharing its static outputs and saved tensors, so the earlier depths' backward reads the last depth's
    tensors. Megatron does not guard it: a rule error when the MTP layer is graphed (_layer_is_graphable: every layer
    without --cuda-graph-modules, else attn, the MoE modules on an MoE layer, mlp on a dense one)."""
    d = kw.get("mtp_num_layers") or 0
    if not kw.get("mtp_use_repeated_layer") or d < 2 or impl == "none":
        return
    moe = kw.get("moe")
    # the MTP layer takes the last decoder layer's spec, or the MoE spec on an empty chunk (resolve/mtp.py)
    kinds = {bool(moe is not None and moe.moe_layer_pattern and moe.moe_layer_pattern[-1])}
    if kw.get("mtp_moe_on_empty_chunk"):
        kinds.add(True)
    # (a hybrid depth's mtp_model_layer is a HybridStack, a MegatronModule the helper does not graph)
    graphed = not kw.get("hybrid_mtp_pattern") and (
        not names or "attn" in names
        or any(set(names) & ({"moe", "moe_router", "moe_preprocess"} if k else {"mlp"}) for k in kinds))
    if impl == "transformer_engine" and not graphed:
        return
    if impl == "transformer_engine":
        # TE 2.20.2 graph.py make_graphed_callables: Graphed.forward copies the call's inputs into the graph's static
        # inputs, replays the forward graph and returns its static outputs detached (the same storage); its backward
        # replays the backward graph on the tensors the last forward replay left in the graph's pool. The second
        # depth's replay so overwrites the first depth's output (still saved by the eager final norm after it) and
        # saved activations: every depth's backward but the last runs on the last depth's tensors. Megatron neither
        # guards nor errors (core 0.17.1 to 0.19.2): a rule error rather than an estimate of a wrong run
        dest = "cuda_graph_impl" if a.given("cuda_graph_impl") else "external_cuda_graph"
        a.fail("mtp_use_repeated_layer", f"does not work with {a.key(dest)} transformer_engine when the MTP layer is "
               f"graphed: TECudaGraphHelper captures the one layer once per micro-batch and its {d} depths replay "
               "that graph (cuda_graphs[current_microbatch % len], transformer/module.py), each replay overwriting the "
               "graph's static outputs and saved activations (Transformer Engine's Graphed.forward), so every depth's "
               "backward but the last runs on the last depth's tensors (wrong gradients, no error)",
               f"use --cuda-graph-impl local, leave the MTP layer's parts out of {a.key('cuda_graph_modules')}, or "
               f"drop {a.key('mtp_use_repeated_layer')}")
        return
    what = ("the full-iteration graph captures each of its calls" if impl == "full_iteration" else
            f"the local graphs give its {d} calls a runner each, as {d} layers")
    a.notes.append(f"{a.key('mtp_use_repeated_layer')}: {what}")


def _moe_graphs(a: Args, moe: Any, dest: str, names: list[str]) -> None:
    """TransformerConfig.__post_init__ (transformer_config.py, 0.16.1 lines 1757-1771, 0.19.2 lines
    2497-2511): an mlp graph needs a dense layer (--moe-layer-freq 1 or a list without 0 leaves none), and the
    moe graph needs static shapes: drop-and-pad routing."""
    freq = a.get("moe_layer_freq", 1)
    try:
        every_layer_moe = int(str(freq)) == 1
    except ValueError:
        every_layer_moe = all(moe.moe_layer_pattern)
    if "mlp" in names and every_layer_moe:
        a.fail(dest, "mlp graphs need dense layers, and --moe-layer-freq makes every layer MoE")
    if "moe" in names and not (moe.moe_expert_capacity_factor is not None and moe.moe_pad_expert_input_to_capacity):
        a.fail(dest, "the moe graph needs drop-and-pad routing", "give --moe-expert-capacity-factor and "
               "--moe-pad-expert-input-to-capacity, or graph moe_router instead")
    elif ("moe_preprocess" in names and moe.moe_token_dispatcher_type == "alltoall"
          and moe.moe_expert_capacity_factor is not None and not moe.moe_pad_expert_input_to_capacity):
        a.fail(dest, "the moe_preprocess graph does not work with the alltoall dispatcher's capacity factor "
               "without padding (its preprocess synchronises with the host)")


# what a local (Megatron's own) CUDA graph lets fine-grained activation offloading move
LOCAL_GRAPH_OFFLOADS = ("expert_fc1", "moe_act", "fused_group_mlp")


def _offload_graphs(a: Args, impl: str, dest: str, names: list[str], offload: set[str]) -> None:
    """Fine-grained activation offloading under CUDA graphs, TransformerConfig.__post_init__
    (transformer_config.py 0.19.2 lines 2596-2621; core 0.16.1 has none of these rules): the local graphs
    only around partially graphed MoE layers offloading expert_fc1 / moe_act / fused_group_mlp, and never
    the moe graph."""
    if impl == "none":
        return
    if impl == "local":
        other = sorted(offload - set(LOCAL_GRAPH_OFFLOADS))
        if other:
            a.fail("offload_modules", f"with --cuda-graph-impl local only {', '.join(LOCAL_GRAPH_OFFLOADS)} can be "
                   f"offloaded, got {', '.join(other)}")
        elif not names:
            a.fail(dest, "local CUDA graphs of whole layers do not work with fine-grained activation offloading",
                   "name the graphed modules with --cuda-graph-modules")
    if "moe" in names:
        a.fail(dest, "the moe graph does not work with fine-grained activation offloading")
