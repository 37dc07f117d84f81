"""The emerging optimizers (``--optimizer muon``, ``adaptive_muon``, deprecated ``dist_muon``, ``lion``, ``soap``):
optimizer state per parameter.

megatron-core 0.19.2 builds every ``--optimizer`` other than adam and sgd in ``_get_megatron_emerging_optimizer``
(megatron/core/optimizer/__init__.py) from the ``emerging_optimizers`` package (PyPI ``emerging-optimizers``;
0.3.0 read):

* which parameters the emerging optimizer takes: 2-D weights that are not the embedding or output layer
  (``_is_nonlinear_or_embedding`` in optimizer/emerging_optimizers.py, mirrored by
  ``is_managed_by_layer_wise_optimizer``); every other parameter (norms, biases, embedding, output
  layer) falls back through the standard optimizer path to Adam (the registry's
  ``default_param_overrides``), or for the Muon family to ``--muon-scalar-optimizer`` (``adam`` or ``lion``);
* state of a 2-D weight, created by the package's ``_init_group`` on the parameter the optimizer sees (under
  bf16 the fp32 main copy made by ``Float16OptimizerWithFloat16Params``, so 4 B next to the 4 B main param):
  Muon (``OrthogonalizedOptimizer``) one ``momentum_buffer``; ``adaptive_muon`` (``AdaptiveMuon``, megatron's
  default ``adaptive_muon_moment2_method = "adamuon"``) adds a full ``moment2_buffer``; Lion
  (scalar_optimizers/lion.py) one ``exp_avg``; SOAP (soap/soap.py) fp32 ``exp_avg`` and ``exp_avg_sq`` like the
  weight plus the Kronecker factors ``L`` [m, m], ``R`` [n, n] and their eigenbases ``Q_L``, ``Q_R`` (fp32) of an
  [m, n] weight: 8 + 8 (m^2 + n^2) / (m n) B per element, more than Adam for every matrix.
* with ``--use-distributed-optimizer`` (or ``dist_muon``) the layer-wise distributed optimizer gives
  each DP rank whole emerging-optimizer parameters (``LayerWiseDistributedOptimizer``: largest first onto
  the least loaded rank), and the fallback parameters go to a regular DistributedOptimizer (byte-level
  shards). Without it every rank keeps the state of all its parameters.

The momentum dtype follows the parameter the optimizer sees: core 0.16.1's ``muon_init_state_fn``
creates it as ``torch.zeros_like(p.data)`` on the fp32 main copy, and so does emerging-optimizers 0.3.0.

Version differences: 0.16.1 offers adam, sgd, muon, dist_muon; it refuses ``--optimizer muon
--use-distributed-optimizer`` ("muon with dist optimizer is not supported") and shards with ``dist_muon`` by
whole parameters, Adam's included, in a ping-pong order (``ping_pong_shard_numel``); 0.19.2 takes ``muon`` +
``--use-distributed-optimizer``, bin-packs the emerging optimizer's parameters per bucket and shards the
fallback's with a regular DistributedOptimizer.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable

MUON_OPTIMIZERS = ("muon", "adaptive_muon", "dist_muon")
# every --optimizer choice of core 0.19.2 other than adam and sgd (arguments.py; validate_args sends them all to
# _get_megatron_emerging_optimizer)
EMERGING_OPTIMIZERS = MUON_OPTIMIZERS + ("lion", "soap")
SCALAR_OPTIMIZERS = ("adam", "lion")


@dataclass(frozen=True)
class MuonSpec:
    optimizer: str = "muon"
    muon_scalar_optimizer: str = "adam"
    bf16: bool = True
    use_distributed_optimizer: bool = False

    @property
    def layer_wise(self) -> bool:
        return self.optimizer == "dist_muon" or self.use_distributed_optimizer


def takes_muon(shape: tuple[int, ...], embedding_or_output: bool) -> bool:
    """Muon updates 2-D weights other than the embedding and output layer."""
    return len(shape) == 2 and not embedding_or_output


def takes_muon_by_name(name: str) -> bool:
    """The same rule over megatron-core's parameter names (``decoder.layers.0.mlp.linear_fc1.weight``):
    biases and norm weights are 1-D; the word embedding and the output layer are flagged
    ``is_embedding_or_output_parameter`` (LanguageModule.setup_embeddings_and_output_layer). The learned
    position table is 2-D and not flagged, so Muon takes it."""
    parts = name.split(".")
    if parts[-1] != "weight" and not parts[-1].startswith("weight"):     # biases; TE's grouped weight0..N
        return False
    if len(parts) > 1 and ("norm" in parts[-2] or parts[-2] == "conv1d"):
        # a Mamba mixer's causal conv1d weight is 3-D [channels, 1, 4] (an nn.Conv1d up to megatron-core 0.18.2;
        # 0.19's own conv1d_weight fails the first test): not a matrix, so the fallback takes it
        return False
    return not (name.startswith("embedding.word_embeddings") or name.startswith("output_layer"))


def muon_bytes_per_param(spec: MuonSpec) -> dict[str, int]:
    """State bytes per element of a 2-D weight the emerging optimizer takes, by term name (SOAP's Kronecker
    factors, which depend on the weight's shape, are ``soap_factor_bytes``)."""
    out = {"main_parameters": 4 if spec.bf16 else 0}
    if spec.optimizer == "lion":
        out["lion_exp_avg"] = 4                      # Lion._init_group: exp_avg like the parameter
    elif spec.optimizer == "soap":
        out["soap_exp_avg"] = out["soap_exp_avg_sq"] = 4   # SOAP._init_group: dtype=torch.float32
    else:
        out["muon_momentum"] = 4                     # OrthogonalizedOptimizer: momentum_buffer
        if spec.optimizer == "adaptive_muon":
            out["muon_second_moment"] = 4            # AdaptiveMuon "adamuon": moment2_buffer like the parameter
    return out


def soap_factor_bytes(rows: int, cols: int) -> int:
    """SOAP's preconditioner state of one [rows, cols] weight: L [rows, rows] and R [cols, cols]
    (``init_kronecker_factors``: torch.zeros, fp32) and the eigenbases Q_L, Q_R (``torch.eye``, fp32)
    (emerging_optimizers 0.3.0 soap/soap.py ``SOAP._init_group``)."""
    return 2 * 4 * (rows * rows + cols * cols)


def scalar_bytes_per_param(spec: MuonSpec) -> dict[str, int]:
    """State bytes per fallback parameter (norms, biases, embedding, output layer)."""
    out = {"main_parameters": 4 if spec.bf16 else 0, "adam_exp_avg": 4}
    if spec.muon_scalar_optimizer == "adam" or spec.optimizer not in MUON_OPTIMIZERS:
        out["adam_exp_avg_sq"] = 4
    else:
        out = {"main_parameters": out["main_parameters"], "lion_exp_avg": 4}
    return out


def layer_wise_shard_numel(numels: Iterable[int], dp: int) -> int:
    """Largest number of Muon-managed elements one DP rank owns in one bucket under the layer-wise
    distributed optimizer: whole parameters, largest first, each onto the least-loaded rank
    (``LayerWiseDistributedOptimizer._compute_per_buffer_param_layout``, its ``_emit_bucket``; the
    64-element start alignment is ignored, it moves a few hundred bytes). Every shard of the bucket
    is padded to this size in the DDP buffers too."""
    if dp <= 1:
        return sum(numels)
    loads = [0] * dp
    heapq.heapify(loads)
    for n in sorted(numels, reverse=True):
        heapq.heappush(loads, heapq.heappop(loads) + n)
    return max(loads)


def ping_pong_shard_numel(numels: Iterable[int], dp: int) -> int:
    """Largest number of elements one DP x CP rank owns under core 0.16's layer-wise optimizer
    (``dist_muon``; ``LayerWiseDistributedOptimizer.shard_params``): every parameter, Muon's and the
    fallback's, sorted by size (smallest first) and dealt out whole in the order 0..n-1, n-1..0, ...
    (0.16.1 refuses ``--optimizer muon`` with ``--use-distributed-optimizer``.)"""
    if dp <= 1:
        return sum(numels)
    loop = list(range(dp)) + list(range(dp))[::-1]
    loads = [0] * dp
    for i, n in enumerate(sorted(numels)):
        loads[loop[i % len(loop)]] += n
    return max(loads)


def state_split(params: Iterable[tuple[str, int]]) -> tuple[int, int]:
    """(elements Muon updates, elements the scalar optimizer updates) of (name, numel) parameters."""
    muon = scalar = 0
    for name, n in params:
        if takes_muon_by_name(name):
            muon += n
        else:
            scalar += n
    return muon, scalar


@dataclass(frozen=True)
class MuonShares:
    """What one DP x CP rank keeps optimizer state for, in elements."""

    muon_elems: int          # elements of the 2-D weights the emerging optimizer takes (main copy + its state)
    scalar_elems: int        # fallback elements (main copy + Adam/Lion moments)
    muon_buffer_numel: int   # DDP buffer elements of those weights (shard-aligned when layer-wise)
    factor_bytes: int = 0    # SOAP's Kronecker factors and eigenbases of those weights


def is_routed_expert(name: str) -> bool:
    """A routed expert's parameter (sharded over the expert-data-parallel group, not DP x CP)."""
    return ".experts." in name and "shared_experts" not in name


def _triples(params) -> list[tuple[str, int, int]]:
    """(name, numel, cols) from (name, numel) or (name, numel, cols) records (cols 0: shape unknown)."""
    return [(p[0], p[1], p[2] if len(p) > 2 else 0) for p in params]


def _factors(spec: MuonSpec, name: str, numel: int, cols: int) -> int:
    if spec.optimizer != "soap":
        return 0
    if not cols:
        raise ValueError(f"SOAP needs the shape of {name}")  # every recipe gives its matrices' cols
    return soap_factor_bytes(numel // cols, cols)


def _ping_pong_ranks(params: list[tuple[str, int, int]], dp: int) -> list[tuple[int, int]]:
    loop = list(range(dp)) + list(range(dp))[::-1]
    out = [[0, 0] for _ in range(dp)]
    for i, (name, n, _) in enumerate(sorted(params, key=lambda p: p[1])):
        out[loop[i % len(loop)]][0 if takes_muon_by_name(name) else 1] += n
    return [(m, s) for m, s in out]


def _lpt_ranks(spec: MuonSpec, managed: list[tuple[str, int, int]], dp: int) -> list[tuple[int, int]]:
    """(elements, SOAP factor bytes) per rank of one bucket: ``_emit_bucket`` walks the parameters in
    backprop (reverse registration) order, sorts them by numel, largest first (a stable sort), and puts
    each on the first of the least-loaded shards (``min(range(dp_size), key=shard_cursors)``)."""
    loads, factors = [0] * dp, [0] * dp
    heap = [(0, r) for r in range(dp)]          # (load, rank): the least loaded, the lowest rank among equals
    for name, n, cols in sorted(reversed(managed), key=lambda p: -p[1]):
        load, r = heapq.heappop(heap)
        loads[r] = load + n
        factors[r] += _factors(spec, name, n, cols)
        heapq.heappush(heap, (loads[r], r))
    return list(zip(loads, factors))


def _group_shares(spec: MuonSpec, params: list[tuple[str, int, int]], dp: int,
                  legacy: bool) -> tuple[int, int, int, int]:
    managed = [p for p in params if takes_muon_by_name(p[0])]
    m = sum(n for _, n, _ in managed)
    s = sum(n for name, n, _ in params if not takes_muon_by_name(name))
    if not spec.layer_wise or dp <= 1:
        return m, s, m, sum(_factors(spec, *p) for p in managed)
    if legacy:
        bm, bs = max(_ping_pong_ranks(params, dp), key=lambda r: 8 * r[0] + 12 * r[1])
        return bm, bs, m, 0
    per_elem = sum(muon_bytes_per_param(spec).values())
    ranks = _lpt_ranks(spec, managed, dp)
    load, factors = max(ranks, key=lambda r: per_elem * r[0] + r[1])
    return load, -(-s // dp), dp * max(r[0] for r in ranks), factors


def shares(spec: MuonSpec, chunks: Iterable[list[tuple]], dp: int, legacy: bool,
           expert_dp: int | None = None) -> MuonShares:
    """The most loaded rank's shares over a stage's chunks (``chunks``: (name, numel) or (name, numel, cols)
    per parameter per chunk).

    Not distributed: every rank keeps all. Core 0.19 layer-wise: the emerging optimizer's matrices bin-packed
    per chunk (one bucket assumed per chunk: the default bucket holds 40M elements or more), every shard padded
    to the largest in the DDP buffer; the fallback sharded evenly by a regular distributed optimizer.
    Core 0.16 ``dist_muon``: every parameter dealt out ping-pong by size, the rank with the most state
    bytes (8 per Muon element, 12 per Adam element) counted. Routed experts are dealt out over the
    expert-data-parallel group (``expert_dp``; DP x CP when not given), the rest over DP x CP
    (LayerWiseDistributedOptimizer.shard_params: dp_cp and expt_dp lists)."""
    muon = scalar = buffer = factors = 0
    for params in chunks:
        params = _triples(params)
        dense = [p for p in params if not is_routed_expert(p[0])]
        experts = [p for p in params if is_routed_expert(p[0])]
        for group, size in ((dense, dp), (experts, expert_dp or dp)):
            if group:
                m, s, b, f = _group_shares(spec, group, size, legacy)
                muon, scalar, buffer, factors = muon + m, scalar + s, buffer + b, factors + f
    return MuonShares(muon, scalar, buffer, factors)


# ----- the state terms of a stage (replacing Adam's / SGD's when the optimizer is an emerging one) ----------

def spec_of(L) -> MuonSpec:
    return MuonSpec(optimizer=L.optimizer, muon_scalar_optimizer=getattr(L, "muon_scalar_optimizer", "adam"),
                    bf16=L.params_dtype != "fp32", use_distributed_optimizer=L.use_distributed_optimizer)


def stage_state_terms(L, pp_rank: int, terms: tuple) -> tuple:
    """``terms`` (the stage's model-state terms as Adam would have them) with the optimizer part
    replaced: main parameters and state for what this rank's optimizer owns under the emerging optimizer."""
    from packaging.version import Version

    from .params import chunk_params
    from .result import Term
    spec = spec_of(L)
    chunks = [[(p.name, p.numel, p.cols) for p in chunk_params(L, c)] for c in L.stage_chunks(pp_rank)]
    legacy = Version(str(L.megatron_version)) < Version("0.18")   # resolve/muon.py EMERGING_SINCE
    from ..layout import ShardGroup
    expert_group = getattr(ShardGroup, "EXPERT_DP", None)
    expert_dp = L.parallel.shard_size(expert_group) if expert_group is not None else None
    sh = shares(spec, chunks, L.dp_shard_size, legacy, expert_dp)
    how = ("whole parameters per DP x CP rank (" + ("ping-pong by size" if legacy else "bin-packed per chunk")
           + ")") if spec.layer_wise and L.dp_shard_size > 1 else "every parameter on every rank"
    # every term but the Adam/SGD optimizer ones stays (weights, gradient buffers, other features' terms);
    # the emerging optimizer's go where the first replaced one was
    replaced = ("main_parameters", "adam_exp_avg", "adam_exp_avg_sq", "sgd_momentum")
    at = next((i for i, t in enumerate(terms) if t.name in replaced), len(terms))
    kept_before = [t for t in terms[:at] if t.name not in replaced]
    kept_after = [t for t in terms[at:] if t.name not in replaced]
    out = kept_before
    if spec.bf16:
        out.append(Term("main_parameters", 4 * (sh.muon_elems + sh.scalar_elems), "optimizer",
                        detail=f"fp32 master weights; {how}"))
    mats = f"{sh.muon_elems:,} elements of 2-D weights"
    if spec.optimizer == "lion":
        out.append(Term("lion_exp_avg", 4 * sh.muon_elems, "optimizer", detail=f"{mats} x 4 B (--optimizer lion); {how}"))
    elif spec.optimizer == "soap":
        out.append(Term("soap_exp_avg", 4 * sh.muon_elems, "optimizer", detail=f"{mats} x 4 B; {how}"))
        out.append(Term("soap_exp_avg_sq", 4 * sh.muon_elems, "optimizer", detail="fp32 second moment of the same"))
        out.append(Term("soap_preconditioners", sh.factor_bytes, "optimizer",
                        detail="Kronecker factors L, R and eigenbases Q_L, Q_R: 8 (m^2 + n^2) B per [m, n] weight"))
    else:
        out.append(Term("muon_momentum", 4 * sh.muon_elems * (2 if spec.optimizer == "adaptive_muon" else 1), "optimizer",
                        detail=f"{mats} x 4 B"
                        + (" x 2 (momentum and second moment)" if spec.optimizer == "adaptive_muon" else "") + f"; {how}"))
    flag = "--muon-scalar-optimizer" if spec.optimizer in MUON_OPTIMIZERS else "the registry's default"
    if spec.muon_scalar_optimizer == "adam" or spec.optimizer not in MUON_OPTIMIZERS:
        out.append(Term("adam_exp_avg", 4 * sh.scalar_elems, "optimizer",
                        detail=f"{sh.scalar_elems:,} elements of norms, biases, embedding, output layer ({flag} adam)"))
        out.append(Term("adam_exp_avg_sq", 4 * sh.scalar_elems, "optimizer", detail="fp32 second moment of the same"))
    else:
        out.append(Term("lion_exp_avg", 4 * sh.scalar_elems, "optimizer",
                        detail=f"{sh.scalar_elems:,} elements of norms, biases, embedding, output layer (--muon-scalar-optimizer lion)"))
    return tuple(out + kept_after)


# ----- the optimizer step's working set: Newton-Schulz on one matrix at a time ------------------------
#
# OrthogonalizedOptimizer.step (emerging_optimizers 0.3.0, orthogonalized_optimizers/
# orthogonalized_optimizer.py) walks the Muon parameters one by one: momentum.lerp_(grad) in place
# (``--muon-nesterov``: grad.lerp(momentum) makes a copy), then orthogonalize -> scaled_orthogonalize_fn
# (megatron-core 0.19.2 optimizer/emerging_optimizers.py TensorParallelMuon; 0.16.1 optimizer/muon.py has
# the same body) -> newton_schulz (muon_utils.py), then p.add_(orth_grad) in place. Every temporary of one
# parameter is freed before the next, so the step's extra memory is the largest parameter's working set.

NS_TP_MODES = ("blockwise", "duplicated", "distributed")
NS_MATMUL_PRECISIONS = ("medium", "high", "highest")


@dataclass(frozen=True)
class NsSpec:
    """How the step orthogonalises (megatron-core OptimizerConfig defaults: split QKV, blockwise TP,
    ``medium`` fp32 matmul precision, no Nesterov)."""

    split_qkv: bool = True
    tp_mode: str = "blockwise"
    fp32_matmul_prec: str = "medium"
    nesterov: bool = False

    @property
    def bf16_io(self) -> bool:
        # newton_schulz casts X to bf16 when torch's fp32 matmul precision is "medium"
        # (utils.fp32_matmul_precision sets it from --muon-fp32-matmul-prec around orthogonalize)
        return self.fp32_matmul_prec == "medium"


def newton_schulz_peak(numel: int, gram: int, bf16_io: bool) -> int:
    """Peak bytes inside ``newton_schulz`` for an fp32 input of ``numel`` elements whose Gram matrix is
    ``gram`` x ``gram`` (the smaller side; the TP-partitioned one's other side in ``distributed`` mode),
    the input itself not counted, its fp32 output counted:
    F.normalize's fp32 output X (4 B/elem); under ``medium`` precision X.to(bf16) next to it (+2);
    each step A = X X^T and B = addmm(A, A, A) [gram, gram] and the new X next to the old one;
    at the end X.to(float32) next to the bf16 X."""
    e = 2 if bf16_io else 4
    peaks = [4 * numel, 2 * e * numel + 2 * e * gram * gram]
    if bf16_io:
        peaks += [4 * numel + 2 * numel, 2 * numel + 4 * numel]
    return max(peaks)


def orthogonalize_peak(rows: int, cols: int, spec: NsSpec, group: int = 1, partition_dim: int | None = None) -> int:
    """Peak extra bytes of ``scaled_orthogonalize_fn`` on one [rows, cols] fp32 momentum (this rank's shard),
    Nesterov's copy not counted. ``group``: the TP (experts: ETP) group size; ``partition_dim``: 0 for a
    column-parallel weight, 1 for a row-parallel one, None when not split. The scaling
    ``orth * scale * extra_scale`` keeps three fp32 copies of the shard at once (12 B/elem).

    ``blockwise`` (default): each rank orthogonalises its shard alone. ``duplicated``
    (newton_schulz_tp): all-gathers the shards into a list and torch.cat's them (2 x 4 B per element of
    the full matrix) before orthogonalising the full matrix, whose output stays referenced through the
    chunk returned. ``distributed``: the shard alone, the Gram matrix over the unpartitioned side."""
    n = rows * cols
    split = spec.tp_mode != "blockwise" and partition_dim is not None and group > 1
    if not split:
        return max(newton_schulz_peak(n, min(rows, cols), spec.bf16_io), 12 * n)
    if spec.tp_mode == "duplicated":
        full = n * group
        frows, fcols = (rows * group, cols) if partition_dim == 0 else (rows, cols * group)
        return max(8 * full + newton_schulz_peak(full, min(frows, fcols), spec.bf16_io), 4 * full + 8 * n)
    gram = cols if partition_dim == 0 else rows
    return max(newton_schulz_peak(n, gram, spec.bf16_io), 12 * n)


def qkv_orthogonalize_peak(groups: int, split_shapes: tuple[int, ...], cols: int, spec: NsSpec,
                           group: int = 1) -> int:
    """TensorParallelMuon.orthogonalize with ``--muon-split-qkv`` (default) on linear_qkv [groups x
    sum(split_shapes), cols]: grad.view(groups, sum, cols) split along dim 1 and reshaped to 2-D (copies
    when this rank has more than one query group, views otherwise), each part orthogonalised in turn
    (the finished parts kept), then torch.cat of the parts next to them."""
    n = groups * sum(split_shapes) * cols
    copies = 4 * n if groups > 1 else 0
    peak = 8 * n
    done = 0
    for s in split_shapes:
        part = groups * s * cols
        peak = max(peak, copies + 4 * done + orthogonalize_peak(groups * s, cols, spec, group, 0))
        done += part
    return peak


# (a Mamba mixer's in_proj is a TE column-parallel linear, its out_proj a row-parallel one: ssm/mamba_mixer.py 0.19.2)
# (a heterogeneous config's linear replacements, linear_attn / linear_mlp, are column-parallel: linear_replacements.py)
_COLUMN = ("linear_qkv", "linear_fc1", "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj", "in_proj",
           "linear_attn", "linear_mlp")
_ROW = ("linear_proj", "linear_fc2", "out_proj")


def _partition_dim(name: str) -> int | None:
    """TE's _set_tensor_parallel_attributes (megatron-core 0.19.2 extensions/transformer_engine.py):
    partition_dim 0 for column-parallel weights, 1 for row-parallel ones; MLA's down projections and the
    router are not split."""
    last = name.rsplit(".", 1)[-1]
    if last in _COLUMN:
        return 0
    if last in _ROW:
        return 1
    return None


@dataclass(frozen=True)
class NsWorkingSet:
    bytes: int
    matrix: str                # which weight sets it
    shape: tuple[int, int]     # its [out, in] on this rank


def step_working_set(L, pp_rank: int) -> NsWorkingSet:
    """The largest working set of Muon's step among the 2-D weights of this pipeline stage (per rank:
    TP / ETP shards). Under the layer-wise distributed optimizer a rank updates only the matrices it
    owns; the largest of the stage is taken (an upper bound for the others)."""
    from ..partition import MLP_DENSE
    from .params import holds_mtp, layer_linear_shapes
    spec = ns_spec_of(L)
    chunks = L.stage_chunks(pp_rank)
    h = L.hidden_size
    mats: dict[str, tuple[int, int]] = {}
    for c in chunks:
        for kind, _ in c.kind_runs:
            for name, shape in layer_linear_shapes(L, kind).items():
                # (layers of a heterogeneous config share names at different widths: the larger one sets the step)
                if name not in mats or shape[0] * shape[1] > mats[name][0] * mats[name][1]:
                    mats[name] = shape
            if kind.mlp != MLP_DENSE and not kind.mlp.startswith(MLP_DENSE + ":") and L.moe is not None:
                mats["router"] = (L.moe.num_experts, h)
        if c.has_embedding and L.position_embedding_type == "learned_absolute":
            mats["position_embeddings"] = (L.max_position_embeddings, h)
        if holds_mtp(L, c):
            mats["mtp.eh_proj"] = (h // L.tp, 2 * h)
    moe = L.moe
    best = NsWorkingSet(0, "", (0, 0))
    for name, (rows, cols) in mats.items():
        expert = name.startswith("experts.")
        group = (moe.etp if expert and moe is not None else L.tp)
        pdim = _partition_dim(name)
        if name == "linear_qkv" and spec.split_qkv and not getattr(L, "multi_latent_attention", False):
            shapes = qkv_split_shapes(L)
            per = sum(shapes)
            if rows % per == 0:
                b = qkv_orthogonalize_peak(rows // per, shapes, cols, spec, group)
            else:
                b = orthogonalize_peak(rows, cols, spec, group, pdim)
        else:
            b = orthogonalize_peak(rows, cols, spec, group, pdim)
        if spec.nesterov:
            b += 4 * rows * cols          # grad.lerp(momentum) kept through orthogonalize
        if b > best.bytes:
            best = NsWorkingSet(b, name, (rows, cols))
    return best


def qkv_split_shapes(L) -> tuple[int, ...]:
    """megatron-core 0.19.2 optimizer/emerging_optimizers.py _get_qkv_split_shapes: per query group
    [heads/groups x kv_channels, kv_channels, kv_channels] (the query part twice with an output gate)."""
    groups = L.num_query_groups or L.num_attention_heads
    q = L.num_attention_heads // groups * L.kv_channels
    if getattr(L, "attention_output_gate", False):
        return (q, q, L.kv_channels, L.kv_channels)
    return (q, L.kv_channels, L.kv_channels)


def ns_spec_of(L) -> NsSpec:
    return NsSpec(split_qkv=getattr(L, "muon_split_qkv", True), tp_mode=getattr(L, "muon_tp_mode", "blockwise"),
                  fp32_matmul_prec=getattr(L, "muon_fp32_matmul_prec", "medium"),
                  nesterov=getattr(L, "muon_nesterov", False))


def legacy_allgather_bytes(L, pp_rank: int) -> int:
    """megatron-core 0.16.1 ``dist_muon``: after the step LayerWiseDistributedOptimizer.allgather_params
    flattens this rank's parameters (``_flatten_dense_tensors``, a copy) and all-gathers every rank's into
    fresh buffers (``output_list``: the whole group's parameters, its own included), in the model's dtype
    (the shards are taken before the Float16 wrapping); the DP x CP group first, then the
    expert-data-parallel one, each freed before the next. 0.19's parameter layout syncs through the DDP
    buffer instead (no copy). The most loaded rank of the ping-pong deal is taken."""
    from packaging.version import Version

    from .params import chunk_params
    spec = spec_of(L)
    if not spec.layer_wise or Version(str(L.megatron_version)) >= Version("0.18"):   # param_layout.py since 0.18
        return 0
    from ..layout import ShardGroup
    expert_group = getattr(ShardGroup, "EXPERT_DP", None)
    expert_dp = L.parallel.shard_size(expert_group) if expert_group is not None else L.dp_shard_size
    params = [(p.name, p.numel, p.cols) for c in L.stage_chunks(pp_rank) for p in chunk_params(L, c)]
    e = 4 if L.params_dtype == "fp32" else 2
    best = 0
    for group, size in (([p for p in params if not is_routed_expert(p[0])], L.dp_shard_size),
                        ([p for p in params if is_routed_expert(p[0])], expert_dp)):
        if group and size > 1:
            own = max(m + s for m, s in _ping_pong_ranks(group, size))
            best = max(best, e * (own + sum(n for _, n, _ in group)))
    return best


def stage_step_terms(L, pp_rank: int) -> tuple:
    """The step-only terms (not part of the steady state): the Newton-Schulz working set, and with core
    0.16.1's ``dist_muon`` the parameter all-gather that follows the update (whichever is larger: the
    Newton-Schulz temporaries are freed before the all-gather)."""
    from .result import Term
    ws = step_working_set(L, pp_rank)
    gather = legacy_allgather_bytes(L, pp_rank)
    if gather > ws.bytes:
        return (Term("muon_param_allgather", gather, "transients", "allocated",
                     "optimizer step (core 0.16 dist_muon): this rank's parameters flattened and every DP rank's "
                     "gathered into new buffers after the update"),)
    if not ws.bytes:
        return ()
    spec = ns_spec_of(L)
    how = (f"{spec.tp_mode} TP mode, {'bf16' if spec.bf16_io else 'fp32'} Newton-Schulz "
           f"(--muon-fp32-matmul-prec {spec.fp32_matmul_prec})"
           + (", QKV split" if spec.split_qkv else "") + (", Nesterov copy" if spec.nesterov else ""))
    return (Term("muon_newton_schulz", ws.bytes, "transients", "allocated",
                 f"optimizer step: orthogonalising {ws.matrix} {list(ws.shape)} (the largest 2-D weight of the "
                 f"stage, one at a time); {how}"),)
