"""CUDA graphs (``--cuda-graph-impl``, ``--cuda-graph-modules`` / ``--cuda-graph-scope``): the memory
they pin.

Three implementations (megatron/core/transformer/cuda_graphs.py, megatron/core/full_cuda_graph.py;
core 0.16.1 selects the full-iteration graph with ``--cuda-graph-impl local --cuda-graph-scope
full_iteration``, 0.19.2 also accepts ``--cuda-graph-impl full_iteration``):

* ``transformer_engine`` (``TECudaGraphHelper``): the graphable layers of this rank (decoder and MTP)
  x micro-batches are captured with TE's ``make_graphed_callables``; one micro-batch when PP = 1,
  else ``get_num_microbatches()``, but static inputs are built by ``_get_sample_arguments``, which
  reuses the buffers of micro-batches whose backward is done, so there are about as many sets as
  micro-batches in flight on this rank. A layer's static inputs are its hidden states (bf16) and, when
  its attention is graphed, a bool causal mask ``[b, 1, s/CP, s]``. With TE >= 2.7 static outputs and
  grad inputs are weak-referenced once their backward is captured (``_reuse_graph_input_output_buffers``):
  what stays per (graphed layer, micro-batch slot) is the static input and the static grad-output.
* ``local`` (``CudaGraphManager``): one runner per graphed module, reused across micro-batches when
  PP = 1; with PP > 1 a new runner (static buffers) per micro-batch of the recording iteration.
* ``full_iteration`` (``FullCudaGraphWrapper``): the whole forward-backward is one graph; its
  ``StaticBufferLoader`` reads all ``num_microbatches`` batches up front into static CUDA buffers,
  for training and (once validation ran) again for validation.

Every capture goes to a private memory pool. Blocks freed inside a capture stay reserved by the pool
(the caching allocator cannot hand them to eager code): the working memory of the largest graphed
region for per-layer graphs, and for a full-iteration graph the forward-backward working set, which
the optimizer step can then no longer reuse.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

IMPLS = ("none", "local", "transformer_engine", "full_iteration")
MODULES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")


@dataclass(frozen=True)
class CudaGraphSpec:
    """The flat Megatron settings the graphs' memory depends on (names as in ``arguments.py``)."""

    cuda_graph_impl: str = "none"
    cuda_graph_modules: tuple[str, ...] = ()    # empty: the whole layer
    pipeline_model_parallel_size: int = 1
    num_microbatches: int = 1
    micro_batch_size: int = 1
    seq_length: int = 1
    hidden_size: int = 1
    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    activation_bytes: int = 2
    create_attention_mask_in_dataloader: bool = True

    @property
    def impl(self) -> str:
        """0.16.1 spells the full-iteration graph as local + scope full_iteration."""
        if self.cuda_graph_impl == "local" and "full_iteration" in self.cuda_graph_modules:
            return "full_iteration"
        return self.cuda_graph_impl

    @property
    def rows(self) -> int:
        rows = self.seq_length * self.micro_batch_size // self.context_parallel_size
        return rows // self.tensor_model_parallel_size if self.sequence_parallel else rows


def regions_per_layer(spec: CudaGraphSpec, moe_layer: bool = False) -> int:
    """Graphed callables one layer contributes (0 or 1): every layer without ``--cuda-graph-modules``;
    with modules, a layer with graphed attention (``attn``) or a graphed MLP part (``mlp`` on a dense
    layer; ``moe``, ``moe_router`` on an MoE layer) -- ``_layer_is_graphable`` in cuda_graphs.py. The
    layer is one callable whatever part of it is captured."""
    if spec.impl not in ("local", "transformer_engine"):
        return 0
    mods = set(spec.cuda_graph_modules)
    if not mods or "attn" in mods:
        return 1
    return int(bool(mods & ({"moe", "moe_router"} if moe_layer else {"mlp"})))


def kind_graphed(spec: CudaGraphSpec, mixer: str, mlp: str) -> bool:
    """Whether a layer of one kind (``partition.LayerKind``'s mixer and MLP) is one graphed callable: a hybrid
    model's layers by their own kind (``_layer_is_graphable``, cuda_graphs.py; the same in megatron-core 0.16.1,
    0.17.1, 0.18.2 and 0.19.2): every layer without modules; with modules a MambaLayer ('M') when ``mamba`` is
    listed, a TransformerLayer whose attention is not an IdentityOp ('*') when ``attn`` is, an MoE layer ('E')
    with ``moe`` / ``moe_router`` / ``moe_preprocess``, a layer whose MLP is a dense ``MLP`` ('-') with ``mlp``.
    (The local implementation's MambaLayer.create_mcore_cudagraph_manager asks the same of a Mamba layer.)"""
    if spec.impl not in ("local", "transformer_engine"):
        return False
    mods = set(spec.cuda_graph_modules)
    if not mods:
        return True
    if mixer == "mamba":
        return "mamba" in mods
    if "attn" in mods and mixer != "none":
        return True
    if mlp == "moe":
        return bool(mods & {"moe", "moe_router", "moe_preprocess"})
    return mlp == "dense" and "mlp" in mods


def heterogeneous_kind_graphed(spec: CudaGraphSpec, mixer: str, mlp: str, noop_mlp_spec: bool) -> bool:
    """Whether a heterogeneous layer (``--heterogeneous-layers-config-path``: attention / none / linear, dense[:FFN] /
    none / linear) is graphed per layer. Transformer Engine's helper (``_layer_is_graphable``, cuda_graphs.py
    0.16.1 and 0.19.2) checks the built modules: ``attn`` takes a layer whose self_attention is not an IdentityOp
    (a linear replacement is), ``mlp`` one whose MLP is an ``MLP`` (not a linear replacement). The local
    implementation (TransformerLayer.create_mcore_cudagraph_manager, 0.16.1 to 0.19.2) compares the submodule
    *spec* with the IdentityOp class: the heterogeneous spec gives a no-op attention ``ModuleSpec(IdentityOp)``, so
    under ``attn`` every layer gets a manager (which runs the whole layer), and under ``mlp`` every layer but a
    no-op MLP's from 0.18 on (``IdentityOp`` itself there; ``ModuleSpec(IdentityOp)`` before: ``noop_mlp_spec``).
    Without modules every layer is graphed."""
    if spec.impl not in ("local", "transformer_engine"):
        return False
    mods = set(spec.cuda_graph_modules)
    if not mods:
        return True
    dense = mlp.split(":", 1)[0] == "dense"
    if spec.impl == "transformer_engine":
        return ("attn" in mods and mixer != "none") or ("mlp" in mods and dense)
    return "attn" in mods or ("mlp" in mods and (mlp != "none" or noop_mlp_spec))


def kind_masked(spec: CudaGraphSpec, mixer: str) -> bool:
    """Whether a graphed layer of this mixer gets the static causal mask (TE implementation):
    TransformerLayer.get_layer_static_inputs adds it when its self-attention is not an IdentityOp and attention
    is graphed; a MambaLayer's static inputs are the hidden states only (GraphableMegatronModule's)."""
    return (spec.impl == "transformer_engine" and mixer not in ("none", "mamba")
            and (not spec.cuda_graph_modules or "attn" in spec.cuda_graph_modules))


def attention_graphed(spec: CudaGraphSpec) -> bool:
    return spec.impl in ("local", "transformer_engine") and (not spec.cuda_graph_modules
                                                             or "attn" in spec.cuda_graph_modules)


def sample_slots(spec: CudaGraphSpec, in_flight: int, chunks: int = 1) -> float:
    """Sets of static buffers per graphed layer: one with PP = 1 (graphs are reused across
    micro-batches); with PP > 1 the TE helper keeps one per micro-batch of the layer's chunk in flight
    (it reuses finished ones: ``in_flight`` counts (micro-batch, chunk) forwards held on the rank, so a
    chunk holds ``in_flight / chunks`` on average), the local implementation one per micro-batch of the
    recording iteration."""
    if spec.pipeline_model_parallel_size == 1:
        return 1
    if spec.impl == "local":
        return spec.num_microbatches
    return max(1.0, min(in_flight, spec.num_microbatches * chunks) / chunks)


def static_io_bytes(spec: CudaGraphSpec, dense_layers: int, moe_layers: int = 0, in_flight: int = 1,
                    chunks: int = 1) -> int:
    """``cuda_graph_static_io``: per graphed layer and sample set, the static input
    (``get_layer_static_inputs``: hidden states ``[rows, b, h]``, always bf16), its grad-output buffer, and
    with graphed attention the static causal mask ``[b, 1, s/CP, s]`` (bool) that
    ``TransformerLayer.get_layer_static_inputs`` builds. (Static outputs and grad inputs are released after
    capture with TE >= 2.7; the activations the graphs save live in the pool, where eager code would have
    kept them anyway, so they stay in the layer terms.)"""
    layers = dense_layers * regions_per_layer(spec, False) + moe_layers * regions_per_layer(spec, True)
    per_layer = 2 * spec.rows * spec.hidden_size * 2
    if attention_graphed(spec) and spec.impl == "transformer_engine":
        s_cp = spec.seq_length // spec.context_parallel_size
        per_layer += spec.micro_batch_size * s_cp * spec.seq_length
    return int(layers * sample_slots(spec, in_flight, chunks) * per_layer)


def hybrid_static_io_bytes(spec: CudaGraphSpec, kinds: Sequence[tuple[str, str, int]], in_flight: int = 1,
                           chunks: int = 1, graphed_kind: Callable[[CudaGraphSpec, str, str], bool] | None = None
                           ) -> tuple[int, int, int]:
    """``cuda_graph_static_io`` of a hybrid (or heterogeneous) stage, layer kind by layer kind (``kinds``: (mixer, MLP,
    layers); ``graphed_kind``: which kinds are graphed, kind_graphed by default): (bytes, graphed layers, of which with
    the causal mask). Every graphed layer keeps its static input and grad-output ``[rows, b, h]`` bf16 per sample
    set; only graphed attention layers ('*', and a heterogeneous linear replacement) the mask as well."""
    is_graphed = graphed_kind or kind_graphed
    graphed = sum(k for mixer, mlp, k in kinds if is_graphed(spec, mixer, mlp))
    masked = sum(k for mixer, mlp, k in kinds if is_graphed(spec, mixer, mlp) and kind_masked(spec, mixer))
    s_cp = spec.seq_length // spec.context_parallel_size
    per_set = graphed * 2 * spec.rows * spec.hidden_size * 2 + masked * spec.micro_batch_size * s_cp * spec.seq_length
    return int(sample_slots(spec, in_flight, chunks) * per_set), graphed, masked


def batch_bytes(spec: CudaGraphSpec) -> int:
    """One micro-batch as pretrain_gpt's get_batch hands it out: tokens, labels and position ids
    (int64), the loss mask (fp32) and, with --create-attention-mask-in-dataloader, the bool
    ``[b, 1, s, s]`` mask."""
    b, s = spec.micro_batch_size, spec.seq_length
    n = b * s * (8 + 8 + 8 + 4)
    if spec.create_attention_mask_in_dataloader:
        n += b * s * s
    return n


def full_iteration_static_inputs(spec: CudaGraphSpec, with_validation: bool = False) -> int:
    """``StaticBufferLoader``: every micro-batch of the iteration is read into static CUDA buffers
    before the replay, once for training and once more for validation graphs."""
    if spec.impl != "full_iteration":
        return 0
    return spec.num_microbatches * batch_bytes(spec) * (2 if with_validation else 1)


def pool_bytes(spec: CudaGraphSpec, region_transient: int, step_transient: int = 0) -> int:
    """``cuda_graph_pool``: memory the private pool keeps reserved beyond live tensors.

    Per-layer graphs are captured one after another into one pool, so its free blocks are the
    largest working memory of one graphed region (``region_transient``: the larger of its forward
    and backward transients). A full-iteration graph keeps the forward-backward working set, so the
    optimizer step's temporaries (``step_transient``) come on top instead of reusing it.
    """
    if spec.impl in ("local", "transformer_engine"):
        return region_transient
    if spec.impl == "full_iteration":
        return step_transient
    return 0


def layer_graphed(L) -> Callable[[CudaGraphSpec, str, str], bool]:
    """The graphed-kind test of a Layout's layers: heterogeneous_kind_graphed for a heterogeneous config, else
    kind_graphed."""
    if not getattr(L, "heterogeneous_layers", None):
        return kind_graphed
    from packaging.version import Version
    old = Version(L.megatron_version) < Version("0.18")
    return lambda spec, mixer, mlp: heterogeneous_kind_graphed(spec, mixer, mlp, old)


def spec_of(L) -> CudaGraphSpec:
    """The CUDA-graph spec of a Layout (flat Megatron names; none when the layout has no graphs)."""
    return CudaGraphSpec(
        cuda_graph_impl=getattr(L, "cuda_graph_impl", "none") or "none",
        cuda_graph_modules=tuple(getattr(L, "cuda_graph_modules", ()) or ()),
        pipeline_model_parallel_size=L.pipeline_model_parallel_size, num_microbatches=L.num_microbatches,
        micro_batch_size=L.micro_batch_size, seq_length=L.seq_length, hidden_size=L.hidden_size,
        tensor_model_parallel_size=L.tensor_model_parallel_size, context_parallel_size=L.context_parallel_size,
        sequence_parallel=L.sequence_parallel, activation_bytes=L.act_bytes,
        create_attention_mask_in_dataloader=L.create_attention_mask_in_dataloader)


def stage_terms(L, dense_layers: int, moe_layers: int, in_flight: int, region_transient: int,
                step_transient: int = 0, chunks: int = 1,
                kinds: Sequence[tuple[str, str, int]] | None = None) -> list[tuple[str, int, str, str, str]]:
    """(name, bytes, group, level, detail) of the graph terms of one pipeline stage. ``kinds``: a hybrid stage's
    layers as (mixer, MLP, count), graphed kind by kind (then ``dense_layers`` / ``moe_layers`` are not read)."""
    spec = spec_of(L)
    if spec.impl == "none":
        return []
    out = []
    if kinds is not None and spec.impl != "full_iteration":
        io, graphed, masked = hybrid_static_io_bytes(spec, kinds, in_flight, chunks, layer_graphed(L))
        if io:
            det = (f"{graphed} graphed layers x {sample_slots(spec, in_flight, chunks):g} sample set(s) x static input "
                   f"and grad-output [{spec.rows}, {spec.hidden_size}] bf16"
                   + (f" + causal mask of {masked} attention layers" if masked else "") + f" ({spec.impl})")
            out.append(("cuda_graph_static_io", io, "transients", "allocated", det))
        pool = pool_bytes(spec, region_transient, step_transient) if graphed else 0
        if pool:
            out.append(("cuda_graph_pool", pool, "allocator", "reserved",
                        "working memory the graphs' private pool keeps reserved: the largest graphed layer's "
                        "(assumption, docs/assumptions.md)"))
        return out
    io = static_io_bytes(spec, dense_layers, moe_layers, in_flight, chunks) + full_iteration_static_inputs(spec)
    if io:
        if spec.impl == "full_iteration":
            det = f"{spec.num_microbatches} micro-batches read into static buffers (StaticBufferLoader)"
        else:
            regions = dense_layers * regions_per_layer(spec, False) + moe_layers * regions_per_layer(spec, True)
            det = (f"{regions} graphed layers x {sample_slots(spec, in_flight, chunks):g} sample set(s) x static input "
                   f"and grad-output [{spec.rows}, {spec.hidden_size}] bf16"
                   + (" + causal mask" if attention_graphed(spec) and spec.impl == "transformer_engine" else "")
                   + f" ({spec.impl})")
        out.append(("cuda_graph_static_io", io, "transients", "allocated", det))
    pool = pool_bytes(spec, region_transient, step_transient)
    if pool:
        out.append(("cuda_graph_pool", pool, "allocator", "reserved",
                    "working memory the graphs' private pool keeps reserved (assumption, docs/assumptions.md)"))
    return out
