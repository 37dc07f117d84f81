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
    if len(parts) > 1 and "norm" in parts[-2]:
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
    legacy = Version(str(L.megatron_version)) < Version("0.19")
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
