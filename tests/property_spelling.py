"""The same job in other spellings, for the metamorphic properties (tests/test_properties_equivalence.py and the files
that reuse its spellings): everything an estimate says per stage as one comparable value, a flag dropped from a
command line, the job as a Megatron-Bridge run_config.yaml, and a written config read back through memguard's
readers. Pure: the estimator and the readers only (no framework), so a property file using them stays
framework-free (tests/framework_free.py)."""
from __future__ import annotations

from megatron_memguard import estimate

from property_space import Spec


def _numbers(est) -> list[tuple]:
    """Everything an estimate says per stage: its terms (allocated, reserved, device), levels, phase."""
    return [(s.pp_rank, s.num_layers, s.parameters, s.persistent_bytes, s.peak_allocated_bytes,
             s.peak_reserved_bytes, s.device_total_bytes, s.peak_phase, s.in_flight,
             tuple((t.name, t.bytes, str(t.level)) for t in s.terms)) for s in est.stages]


def _drop(flags: list[str], *names: str, values: int = 1) -> list[str]:
    """The command line without each flag of ``names`` and the ``values`` values after it."""
    out, skip = [], 0
    for f in flags:
        if skip:
            skip -= 1
            continue
        if f in names:
            skip = values
            continue
        out.append(f)
    return out


_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}


def bridge_run_config(s: Spec) -> dict:
    """The job as a Megatron-Bridge ConfigContainer dump (flat GPTModelProvider fields, Bridge 0.6.2), with
    the fields whose Bridge default differs from Megatron-LM's argument default written out (the fusions,
    the attention mask, vocabulary padding: docs/readers.md)."""
    m = dict(num_layers=s.layers, hidden_size=s.hidden, ffn_hidden_size=s.ffn, num_attention_heads=s.heads,
             kv_channels=s.kv_channels, num_query_groups=s.groups or s.heads, seq_length=s.seq,
             max_position_embeddings=s.seq, vocab_size=s.vocab, should_pad_vocab=True, make_vocab_size_divisible_by=128,
             tensor_model_parallel_size=s.tp, pipeline_model_parallel_size=s.pp, context_parallel_size=s.cp,
             virtual_pipeline_model_parallel_size=s.vpp, num_layers_in_first_pipeline_stage=s.first,
             num_layers_in_last_pipeline_stage=s.last, sequence_parallel=s.sp, gated_linear_unit=s.swiglu,
             activation_func={"_target_": "torch.nn.functional." + ("silu" if s.swiglu else "gelu"), "_call_": False},
             normalization="RMSNorm" if s.rmsnorm else "LayerNorm", add_bias_linear=s.bias,
             position_embedding_type="rope" if s.rope else "learned_absolute",
             share_embeddings_and_output_weights=not s.untied, hidden_dropout=s.dropout, attention_dropout=s.dropout,
             fp32_residual_connection=s.fp32_residual, distribute_saved_activations=s.distribute_saved,
             transformer_impl=s.impl, attention_backend=s.backend, bias_activation_fusion=s.swiglu or s.bias,
             bias_dropout_fusion=True, apply_rope_fusion=True, cross_entropy_loss_fusion=False,
             masked_softmax_fusion=True, gradient_accumulation_fusion=True,
             bf16=s.precision == "bf16", fp16=s.precision == "fp16",
             params_dtype={"_target_": _DTYPE[s.precision], "_call_": False})
    if s.recompute:
        m["recompute_granularity"] = s.recompute[0]
        if s.recompute[0] == "selective":
            m["recompute_modules"] = list(s.recompute[1])
        else:
            m["recompute_method"], m["recompute_num_layers"] = s.recompute[1], s.recompute[2]
    doc = {"_target_": "megatron.bridge.training.config.ConfigContainer", "model": m,
           "train": {"micro_batch_size": s.mbs, "global_batch_size": s.mbs * s.dp * s.microbatches},
           "dataset": {"seq_length": s.seq, "create_attention_mask": True, "skip_getting_attention_mask_from_dataset": False},
           "optimizer": {"optimizer": s.optimizer, "use_distributed_optimizer": s.dist_opt},
           "ddp": {"use_distributed_optimizer": s.dist_opt, "num_distributed_optimizer_instances": s.instances,
                   "overlap_grad_reduce": s.overlap_grad_reduce, "grad_reduce_in_fp32": s.precision != "fp16"},
           "tokenizer": {"tokenizer_type": "NullTokenizer", "vocab_size": s.vocab}}
    if s.precision != "fp32":
        doc["mixed_precision"] = s.precision + "_mixed"
    return doc


def _read(tmp_path_factory, doc: dict, name: str, world: int):
    import yaml
    from megatron_memguard import resolve
    from megatron_memguard.readers.detect import read_config_file
    p = tmp_path_factory.mktemp("cfg") / name
    p.write_text(yaml.safe_dump(doc))
    return estimate(resolve(read_config_file(str(p)), world_size=world, megatron_version="0.19"))
