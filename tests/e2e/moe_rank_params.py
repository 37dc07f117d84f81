"""Parameters each model-parallel rank of a GPT MoE model holds, as real megatron-core builds them.

    python tests/e2e/moe_rank_params.py '[{"num_layers": 4, "hidden_size": 64, ...}, ...]'

One process (CPU, the referee's shims, a one-rank gloo group) builds, for every job in the list and every
(pipeline rank, virtual stage, TP rank, EP rank, ETP rank) the job names, the GPTModel chunk megatron-core
builds there (local spec: MoE layers by ``get_gpt_decoder_block_spec``'s ``moe_layer_freq`` pattern, the
decoder's layers by ``get_num_layers_to_build`` / ``get_transformer_layer_offset`` or the
``PipelineParallelLayerLayout``, MTP by ``get_gpt_mtp_block_spec`` / ``mtp_on_this_rank``). The
model-parallel sizes and ranks are set in parallel_state (its ``set_*`` overrides and stand-in groups that
answer only ``size()`` and ``rank()``): building a model runs no collective, so the weights are the shapes
of that rank. Prints, per job, one record per rank: the layer numbers of its decoder layers and which are
MoE, whether it holds MTP, and its parameters summed by megatron-core's own tags (``allreduce`` False: a
routed expert's; ``tensor_model_parallel``: split over TP / ETP; ``shared_embedding``: the tied copy).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class _Group:
    """A process group that only knows its size and this rank's place in it (what a model build asks)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _set_ranks(job: dict, pp_rank: int, vp: int | None, tp_rank: int, ep_rank: int, etp_rank: int) -> None:
    from megatron.core import parallel_state as ps
    tp, pp, ep, etp = job["tp"], job["pp"], job["ep"], job["etp"]
    ps.set_tensor_model_parallel_world_size(tp)
    ps.set_tensor_model_parallel_rank(tp_rank)
    ps.set_pipeline_model_parallel_world_size(pp)
    ps.set_pipeline_model_parallel_rank(pp_rank)
    ps.set_expert_model_parallel_world_size(ep)
    ps.set_expert_model_parallel_rank(ep_rank)
    ps.set_expert_tensor_parallel_world_size(etp)
    ps.set_expert_tensor_parallel_rank(etp_rank)
    ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = job.get("vpp")
    ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = vp
    ps._TENSOR_MODEL_PARALLEL_GROUP = _Group(tp, tp_rank)
    ps._PIPELINE_MODEL_PARALLEL_GROUP = _Group(pp, pp_rank)
    ps._EXPERT_MODEL_PARALLEL_GROUP = _Group(ep, ep_rank)
    ps._EXPERT_TENSOR_PARALLEL_GROUP = _Group(etp, etp_rank)
    ps._EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP = _Group(ep * etp, ep_rank * etp + etp_rank)
    ps._TENSOR_AND_CONTEXT_PARALLEL_GROUP = _Group(tp, tp_rank)
    ps._MODEL_PARALLEL_GROUP = _Group(tp * pp, pp_rank * tp + tp_rank)


def _config(job: dict):
    import torch
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
    kw = dict(
        num_layers=job["num_layers"], hidden_size=job["hidden_size"], num_attention_heads=job["heads"],
        kv_channels=job.get("kv_channels"), num_query_groups=job.get("groups"), ffn_hidden_size=job["ffn"],
        add_bias_linear=job["bias"], gated_linear_unit=job["glu"], normalization=job["norm"],
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=job["tp"], pipeline_model_parallel_size=job["pp"],
        virtual_pipeline_model_parallel_size=job.get("vpp"), sequence_parallel=job["tp"] > 1,
        expert_model_parallel_size=job["ep"], expert_tensor_parallel_size=job["etp"],
        num_moe_experts=job["experts"], moe_ffn_hidden_size=job["moe_ffn"], moe_router_topk=job["topk"],
        moe_layer_freq=job["freq"], moe_shared_expert_intermediate_size=job.get("shared_ffn") or None,
        moe_shared_expert_gate=job.get("shared_gate", False),
        moe_router_enable_expert_bias=job.get("expert_bias", False),
        moe_router_score_function="sigmoid" if job.get("expert_bias") else "softmax",
        moe_router_pre_softmax=job["topk"] == 1, moe_token_dispatcher_type="alltoall",
        num_layers_in_first_pipeline_stage=job.get("first"), num_layers_in_last_pipeline_stage=job.get("last"),
        account_for_embedding_in_pipeline_split=job.get("acc_emb", False),
        account_for_loss_in_pipeline_split=job.get("acc_loss", False),
        pipeline_model_parallel_layout=job.get("layout"), mtp_num_layers=job.get("mtp") or None,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )
    if job.get("latent"):
        kw["moe_latent_size"] = job["latent"]
    if job.get("legacy_grouped"):
        # the legacy GroupedMLP (core 0.16.1; no such TransformerConfig field from 0.17): the local spec's
        # grouped experts (LocalSpecProvider.grouped_mlp_modules) are GroupedMLP whenever --moe-grouped-gemm
        kw.update(moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True)
    if job.get("mtp_repeated"):
        kw["mtp_use_repeated_layer"] = True     # core 0.17+ (no such TransformerConfig field in 0.16.1)
    if job.get("het"):
        # a heterogeneous layer config (the blocks' JSON path): megatron-core's HeterogeneousTransformerConfig, whose
        # get_config_for_layer TransformerBlock asks for each layer of the MoE block spec
        from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig
        return HeterogeneousTransformerConfig(heterogeneous_layers_config_path=job["het"], **kw)
    if job.get("mla"):
        m = job["mla"]
        return MLATransformerConfig(multi_latent_attention=True, q_lora_rank=m["q_lora"], kv_lora_rank=m["kv_lora"],
                                    qk_head_dim=m["qk"], qk_pos_emb_head_dim=m["pe"], v_head_dim=m["v"],
                                    rope_type="rope", **kw)
    return TransformerConfig(**kw)


def _no_te_classes() -> None:
    """Without TE, MLASelfAttention's isinstance checks need classes that nothing is an instance of."""
    import megatron.core.transformer.multi_latent_attention as mla
    for name in ("TELinear", "TEColumnParallelLinear"):
        if not isinstance(getattr(mla, name, None), type):
            setattr(mla, name, type(name, (), {}))


def _te_duplicated_linear():
    """A stand-in for the TE spec's down projections (gpt_layer_specs.py get_gpt_layer_with_transformer_engine_spec:
    linear_q_down_proj / linear_kv_down_proj = backend.linear() = TELinear, both eras). MLASelfAttention passes
    TELinear parallel_mode="duplicated" (multi_latent_attention.py), and TELinear then builds the whole
    [out, in] weight on every TP rank (tp_size = 1) and marks it allreduce and, under SP, sequence_parallel
    (megatron/core/extensions/transformer_engine.py TELinear.__init__, 0.16.1 and 0.19.2). Without TE on CPU
    this module allocates just that, so megatron-core's own MLASelfAttention decides the mode and the sizes."""
    import torch

    class TEDuplicatedLinear(torch.nn.Module):
        def __init__(self, input_size, output_size, *, config, parallel_mode=None, bias=False, **kwargs):
            super().__init__()
            assert parallel_mode == "duplicated", parallel_mode
            self.weight = torch.nn.Parameter(torch.empty(output_size, input_size))
            params = [self.weight]
            if bias:
                self.bias = torch.nn.Parameter(torch.empty(output_size))
                params.append(self.bias)
            for p in params:
                setattr(p, "allreduce", True)
                setattr(p, "sequence_parallel", config.sequence_parallel)

    return TEDuplicatedLinear


def _te_down_projections(spec) -> None:
    """The TE spec's down projections in a local-spec MLA layer (the rest of the layer has the same parameters in
    both specs: column-parallel up projections, row-parallel linear_proj, the latent norms' sizes)."""
    import megatron.core.transformer.multi_latent_attention as mla
    if not getattr(mla, "_memguard_te_linear", None):
        mla._memguard_te_linear = _te_duplicated_linear()
    mla.TELinear = mla._memguard_te_linear
    sub = spec.submodules.self_attention.submodules
    if getattr(sub, "linear_q_down_proj", None) is not None:
        sub.linear_q_down_proj = mla.TELinear
    sub.linear_kv_down_proj = mla.TELinear


def _no_core_attention(spec) -> None:
    """megatron-core 0.16.1's local DotProductAttention takes no k_channels (MLA's query/key head dim); the
    core attention holds no parameters, so a stand-in without any leaves the count unchanged."""
    import torch

    class NoParamsAttention(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()

    spec.submodules.self_attention.submodules.core_attention = NoParamsAttention


def _builder():
    """megatron-core 0.19.2's GPT builder (megatron/training/models/gpt.py: mtp_block_spec and the
    _te_or_local_layer_spec it takes for a chunk without decoder layers); None where megatron.training has no GPT
    builder (0.16.1 has no megatron.training, 0.18.2's megatron/training/models no gpt.py)."""
    try:
        from megatron.training.models import gpt as builder
    except Exception:
        return None
    return builder if hasattr(builder, "mtp_block_spec") and hasattr(builder, "_te_or_local_layer_spec") else None


class _ModelConfig:
    """What the builder's spec functions read of a GPTModelConfig: its TransformerConfig."""

    def __init__(self, transformer) -> None:
        self.transformer = transformer


def _local(config, make):
    """``make()`` with the config's transformer_impl "local": the builder's branch for the local spec this
    harness builds (TransformerConfig's default is transformer_engine)."""
    impl = config.transformer_impl
    config.transformer_impl = "local"
    try:
        return make()
    finally:
        config.transformer_impl = impl


def build_rank(job: dict, pp_rank: int, vp: int | None, tp_rank: int, ep_rank: int, etp_rank: int) -> dict:
    _set_ranks(job, pp_rank, vp, tp_rank, ep_rank, etp_rank)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec, get_gpt_decoder_layer_specs,
                                                            get_gpt_mtp_block_spec)
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank
    config = _config(job)
    if job.get("legacy_grouped"):
        # GroupedMLP.__init__ asserts the grouped_gemm library (a CUDA extension) before it allocates its two
        # weights; the build itself calls none of its kernels
        from megatron.core.transformer.moe import grouped_gemm_util as gg
        gg.assert_grouped_gemm_is_available = lambda: None
    if job.get("latent"):
        # MoELayer builds its latent projections as TELinear parallel_mode="duplicated" and asserts TE (core 0.16.1
        # and 0.19.2 moe_layer.py): without TE on CPU the same stand-in as MLA's down projections
        import megatron.core.transformer.moe.moe_layer as moe_layer
        import megatron.core.transformer.multi_latent_attention as mla
        if not getattr(mla, "_memguard_te_linear", None):
            mla._memguard_te_linear = _te_duplicated_linear()
        moe_layer.HAVE_TE, moe_layer.TELinear = True, mla._memguard_te_linear
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=job["norm"],
                                       vp_stage=vp, pp_rank=pp_rank)
    if job.get("mla"):
        _no_te_classes()
        for spec in block.layer_specs:
            _no_core_attention(spec)
            if job["mla"].get("te_down"):
                _te_down_projections(spec)
    mtp_spec = None
    import inspect
    if "layout" in inspect.signature(mtp_on_this_rank).parameters:      # core 0.19: (layout, mtp_num_layers, ...)
        mtp_here = mtp_on_this_rank(config.pipeline_model_parallel_layout, config.mtp_num_layers,
                                    ignore_virtual=False, vp_stage=vp)
    else:                                                               # core 0.16: (config, ...)
        mtp_here = mtp_on_this_rank(config, ignore_virtual=False, vp_stage=vp)
    builder = _builder()
    if job.get("mtp") and mtp_here and builder is not None and not job.get("mla"):
        # core 0.19.2: pretrain_gpt.py's model is built by megatron/training/models/gpt.py; its own mtp_block_spec
        # (the MLA jobs below need the CPU stand-ins in the spec it picks, so they follow its rule instead)
        mtp_spec = _local(config, lambda: builder.mtp_block_spec(_ModelConfig(config), block, vp_stage=vp))
    elif job.get("mtp") and mtp_here:
        if builder is not None and not block.layer_specs:
            # core 0.19.2 builds pretrain_gpt.py's model with megatron/training/models/gpt.py, whose mtp_block_spec
            # takes _te_or_local_layer_spec (the MoE layer spec) when this chunk's block spec has no layers
            last = _local(config, lambda: builder._te_or_local_layer_spec(_ModelConfig(config), vp))
        else:
            # MTP layers take the spec of the model's last decoder layer (gpt_builders.py; the 0.19.2 builder
            # when the chunk has decoder layers)
            last = get_gpt_decoder_layer_specs(config, False, job["norm"])[-1]
        if job.get("mla"):
            _no_core_attention(last)
            if job["mla"].get("te_down"):
                _te_down_projections(last)
        mtp_spec = get_gpt_mtp_block_spec(config, last, use_transformer_engine=False, vp_stage=vp, pp_rank=pp_rank)
    pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
    post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
    model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=job["vocab"],
                     max_sequence_length=job["seq"], pre_process=pre, post_process=post,
                     position_embedding_type="rope", share_embeddings_and_output_weights=not job["untied"],
                     mtp_block_spec=mtp_spec, vp_stage=vp)
    # routed experts by name (MoELayer.experts); megatron-core's allreduce=False marks the ones its DDP puts
    # in the expert buffer (reduced over the expert-data-parallel group: only with EP > 1 or ETP > 1)
    tags = {"expert": 0, "tp_split": 0, "replicated": 0, "shared_embedding": 0, "expert_buffer": 0}
    expert_tp, expert_tensors = {}, 0
    for name, p in model.named_parameters():
        n = p.numel()
        if not getattr(p, "allreduce", True):
            tags["expert_buffer"] += n
        if getattr(p, "shared_embedding", False) and not pre:
            # the tied output copy of a later stage, or the embedding copy of a standalone MTP stage (mtp_process
            # and not pre_process: language_module.py setup_embeddings_and_output_layer)
            tags["shared_embedding"] += n
        elif name == "output_layer.weight" and mtp_spec is not None and not pre and not job["untied"]:
            # tied, MTP on a later stage: the MTP's embedding copy is the tied weight and the output layer's
            # own weight is allocated (skip_weight_param_allocation only on the first stage) but unused
            # (shared_embedding_or_output_weight returns the embedding's: gpt_model.py, core 0.16.1)
            tags["shared_embedding"] += n
        elif ".mlp.experts." in name:
            tags["expert"] += n
            expert_tensors += 1
            key = "split" if getattr(p, "tensor_model_parallel", False) else "whole"
            expert_tp[key] = expert_tp.get(key, 0) + n
        elif getattr(p, "tensor_model_parallel", False):
            tags["tp_split"] += n
        else:
            tags["replicated"] += n
    # the routers' buffers that are not parameters (expert_bias, token counts): fp32, 4 bytes per element
    router_buffers = sum(4 * b.numel() for name, b in model.named_buffers()
                         if name.rsplit(".", 1)[-1] in ("expert_bias", "local_tokens_per_expert",
                                                        "global_tokens_per_expert"))
    layers = [(layer.layer_number - 1, isinstance(layer.mlp, MoELayer)) for layer in model.decoder.layers]
    rec = {"rank": [pp_rank, vp, tp_rank, ep_rank, etp_rank],
           "params": sum(n for k, n in tags.items() if k != "expert_buffer"), "tags": tags, "expert_tp": expert_tp,
           "layers": layers, "router_buffers": router_buffers, "expert_tensors": expert_tensors,
           "mtp": mtp_spec is not None and bool(getattr(model, "mtp_process", False))}
    if job.get("ddp"):
        rec["ddp"] = ddp_buffers(config, model, job["ddp"], pp_rank)
    return rec


def ddp_buffers(config, model, ddp: dict, pp_rank: int) -> list[dict]:
    """megatron-core's own DistributedDataParallel over the built chunk with the distributed optimizer, its
    data-parallel groups stand-ins of the sizes ``ddp`` names (dp_cp, expert dp: what _ParamAndGradBuffer reads of
    them is size() and rank()): per buffer (dense, then expert) its padded and unpadded numel and, for every rank
    of its group, the elements of real parameters the distributed optimizer's shard of that rank holds
    (DistributedOptimizer._build_model_gbuf_range, bucket by bucket)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.process_groups_config import ProcessGroupCollection
    inst = ddp.get("instances", 1)
    dp_cp, edp = _Group(ddp["dp_cp"], 0), _Group(ddp["edp"], 0)
    groups = dict(dp=dp_cp, dp_cp=dp_cp, expt_dp=edp, tp=_Group(config.tensor_model_parallel_size, 0),
                  pp=_Group(config.pipeline_model_parallel_size, pp_rank), ep=_Group(config.expert_model_parallel_size, 0))
    if inst > 1:
        # several optimizer instances: each shards over its part of DP x CP and of expert DP (initialize_model_parallel)
        groups.update(intra_dp_cp=_Group(ddp["dp_cp"] // inst, 0), intra_expt_dp=_Group(ddp["edp"] // inst, 0),
                      inter_dist_opt=_Group(inst, 0))
    pg = ProcessGroupCollection(**groups)
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=ddp.get("overlap", False),
                                        grad_reduce_in_fp32=True, num_distributed_optimizer_instances=inst)
    wrapped = DistributedDataParallel(config=config, ddp_config=cfg, module=model, pg_collection=pg)
    out = []
    for kind, buffers in (("dense", wrapped.buffers), ("expert", wrapped.expert_parallel_buffers)):
        for buf in buffers:
            group = buf.data_parallel_group
            owned = []
            for r in range(group.size()):
                group._rank = r
                owned.append(sum(v["param"].size for b in range(len(buf.buckets))
                                 for v in DistributedOptimizer._build_model_gbuf_range(buf, b)["param_map"].values()))
            group._rank = 0
            out.append({"kind": kind, "numel": buf.numel, "unpadded": buf.numel_unpadded, "owned": owned})
    return out


def build_job(job: dict) -> list[dict]:
    if job.get("layout"):
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
        job = dict(job, layout=PipelineParallelLayerLayout(job["layout"], job["pp"]))
    return [build_rank(job, *r) for r in job["ranks"]]


def _start() -> None:
    import warnings
    warnings.filterwarnings("ignore")
    from single_rank import start   # beside this script (sys.path[0])
    start()


if __name__ == "__main__":
    _start()
    if sys.argv[1:] == ["--serve"]:
        # one job per line on stdin, its records (or the error) as one line on stdout: a test draws many
        # jobs and pays megatron-core's import once; the first line names megatron-core's version
        from megatron.core import package_info
        print("@@" + json.dumps({"version": package_info.__version__}), flush=True)
        for line in sys.stdin:
            try:
                reply = {"ranks": build_job(json.loads(line))}
            except Exception as e:          # the test shows megatron-core's own message
                reply = {"error": f"{type(e).__name__}: {e}"}
            # marked: megatron-core prints notices on stdout (core 0.19.2: "GPTModel IS DEPRECATED")
            print("@@" + json.dumps(reply), flush=True)
    else:
        print(json.dumps([build_job(job) for job in json.loads(sys.argv[1])]))
