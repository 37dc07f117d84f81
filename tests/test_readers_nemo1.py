"""NeMo 1 Hydra YAML: interpolation and resolvers, ???, precision spellings, activations, optimizers,
megatron_amp_O2, activations_checkpoint_*, launcher fragments, model_config.yaml, unknown keys."""
import textwrap

import pytest

from megatron_memguard import resolve
from megatron_memguard.errors import ConfigError, NotModelledError, ReaderError
from megatron_memguard.readers.detect import read_config_file

pytest.importorskip("omegaconf")

BASE = """
trainer: {devices: 8, num_nodes: 2, precision: bf16}
model:
  micro_batch_size: 1
  global_batch_size: 32
  tensor_model_parallel_size: 2
  pipeline_model_parallel_size: 1
  encoder_seq_length: 2048
  max_position_embeddings: ${.encoder_seq_length}
  num_layers: 4
  hidden_size: 512
  ffn_hidden_size: ${multiply:4, ${.hidden_size}}
  num_attention_heads: 8
  megatron_amp_O2: true
  tokenizer: {library: megatron, type: GPT2BPETokenizer}
  data:
    seq_length: ${model.encoder_seq_length}
    data_prefix: ???
  optim: {name: fused_adam, lr: 2e-4}
"""


def write(tmp_path, text, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def read(tmp_path, text, overrides=(), name="cfg.yaml"):
    return read_config_file(write(tmp_path, text, name), overrides=list(overrides))


def with_model(extra: str) -> str:
    return BASE + textwrap.indent(textwrap.dedent(extra), "  ")


def test_world_size_and_interpolations(tmp_path):
    raw = read(tmp_path, BASE)
    a = raw.args
    assert raw.world_size == 16 and raw.nodes == 2 and raw.gpus_per_node == 8
    assert a["max_position_embeddings"] == 2048          # relative ${.x}
    assert a["ffn_hidden_size"] == 2048                  # ${multiply:...}
    assert not raw.problems                              # data.seq_length: ${model.encoder_seq_length} (absolute)
    assert raw.origin["ffn_hidden_size"] == "model.ffn_hidden_size"
    L = resolve(raw)
    assert (L.tp, L.dp, L.num_microbatches, L.vocab_size) == (2, 8, 4, 50257)


@pytest.mark.parametrize("expr, value", [
    ("${sum:${.num_layers},-1}", 3), ("${divide_ceil:${.num_layers},3}", 2), ("${divide_floor:${.num_layers},3}", 1),
    ("${multiply:${.num_layers},2}", 8)])
def test_nemo_and_launcher_resolvers(tmp_path, expr, value):
    raw = read(tmp_path, with_model(f"kv_channels: {expr}\n"))
    assert raw.args["kv_channels"] == value


def test_missing_mandatory_value_is_an_error_only_when_needed(tmp_path):
    raw = read(tmp_path, BASE)        # data.data_prefix: ??? is not needed
    assert raw.args["num_layers"] == 4
    with pytest.raises(ReaderError, match=r"model\.num_layers: is \?\?\?"):
        read(tmp_path, BASE.replace("num_layers: 4", "num_layers: ???"))


def test_hydra_defaults_header_is_ignored(tmp_path):
    raw = read(tmp_path, "defaults:\n  - _self_\n  - optional tp_overlap@model.ub_tp_comm_overlap_cfg:\n" + BASE)
    assert raw.args["num_layers"] == 4 and not raw.warnings


@pytest.mark.parametrize("prec, o2, expect", [
    ("bf16", True, {"bf16": True}), ("bf16-mixed", True, {"bf16": True}), ("16", True, {"fp16": True}),
    (16, True, {"fp16": True}), ("16-mixed", True, {"fp16": True}), ("32", True, {}), (32, True, {}),
    ("32-true", True, {}), ("bf16", False, {"autocast_dtype": "bf16"}), ("16-mixed", False, {"autocast_dtype": "fp16"})])
def test_precision_spellings(tmp_path, prec, o2, expect):
    text = BASE.replace("precision: bf16", f"precision: {prec!r}" if isinstance(prec, str) else f"precision: {prec}")
    text = text.replace("megatron_amp_O2: true", f"megatron_amp_O2: {str(o2).lower()}")
    text = text.replace("name: fused_adam", "name: distributed_fused_adam")
    a = read(tmp_path, text).args
    got = {k: a[k] for k in ("bf16", "fp16", "autocast_dtype") if a.get(k)}
    assert got == expect
    L = resolve(read(tmp_path, text))
    assert L.params_dtype == (expect.get("bf16") and "bf16" or expect.get("fp16") and "fp16" or "fp32")


def test_bad_precision_is_a_problem_naming_the_key(tmp_path):
    raw = read(tmp_path, BASE.replace("precision: bf16", "precision: bf17"))
    assert [p.key for p in raw.problems] == ["trainer.precision"]


@pytest.mark.parametrize("act, expect", [
    ("gelu", {}), ("swiglu", {"swiglu": True}), ("fast-swiglu", {"swiglu": True}), ("geglu", {"gated_linear_unit": True}),
    ("reglu", {"gated_linear_unit": True}), ("fast-geglu", {"gated_linear_unit": True}), ("squared-relu", {"squared_relu": True})])
def test_activation_names_ending_in_glu_are_gated(tmp_path, act, expect):
    a = read(tmp_path, with_model(f"activation: {act}\n")).args
    got = {k: a[k] for k in ("swiglu", "gated_linear_unit", "squared_relu") if k in a}
    assert got == expect
    assert resolve(read(tmp_path, with_model(f"activation: {act}\n"))).gated_linear_unit == act.endswith("glu")


@pytest.mark.parametrize("name, dist", [("fused_adam", False), ("adam", False), ("adamw", False),
                                        ("megatron_fused_adam", False), ("distributed_fused_adam", True),
                                        ("mcore_distributed_optim", True)])
def test_optimizer_names_decide_the_distributed_optimizer(tmp_path, name, dist):
    L = resolve(read(tmp_path, BASE.replace("name: fused_adam", f"name: {name}")))
    assert L.use_distributed_optimizer is dist and L.optimizer == "adam"


def test_apex_distributed_adam_bf16_keeps_param_remainders(tmp_path):
    L = resolve(read(tmp_path, BASE.replace("name: fused_adam", "name: distributed_fused_adam")))
    assert L.use_precision_aware_optimizer and L.store_param_remainders and L.main_params_dtype == "fp32"
    # megatron's distributed optimizer (mcore_distributed_optim) keeps a full fp32 copy
    L2 = resolve(read(tmp_path, BASE.replace("name: fused_adam", "name: mcore_distributed_optim")))
    assert not L2.use_precision_aware_optimizer


def test_unknown_optimizer_is_refused(tmp_path):
    with pytest.raises(NotModelledError, match="model.optim.name"):
        resolve(read(tmp_path, BASE.replace("name: fused_adam", "name: novograd")))


def test_grad_sync_dtype(tmp_path):
    text = BASE.replace("name: fused_adam", "name: mcore_distributed_optim, grad_sync_dtype: bf16")
    L = resolve(read(tmp_path, text))
    assert L.grad_reduce_in_bf16 and not L.accumulate_allreduce_grads_in_fp32


def test_o2_fp16_without_distributed_optimizer_is_a_nemo_problem(tmp_path):
    raw = read(tmp_path, BASE.replace("precision: bf16", "precision: 16"))
    assert [p.key for p in raw.problems] == ["model.megatron_amp_O2"]


def test_activations_checkpoint_mapping(tmp_path):
    full = with_model("activations_checkpoint_granularity: full\nactivations_checkpoint_method: uniform\n"
                      "activations_checkpoint_num_layers: 2\n")
    L = resolve(read(tmp_path, full))
    assert (L.recompute_granularity, L.recompute_method, L.recompute_num_layers) == ("full", "uniform", 2)
    raw = read(tmp_path, full)
    assert raw.origin["recompute_method"] == "model.activations_checkpoint_method"
    sel = with_model("activations_checkpoint_granularity: selective\nactivations_checkpoint_method: uniform\n")
    L = resolve(read(tmp_path, sel))   # NeMo tolerates a method with selective; Megatron's flags would not
    assert (L.recompute_granularity, L.recompute_method) == ("selective", None)
    none = with_model("activations_checkpoint_granularity: null\nactivations_checkpoint_method: block\n"
                      "activations_checkpoint_num_layers: 0\n")
    assert resolve(read(tmp_path, none)).recompute_granularity is None


def test_sequence_parallel_is_switched_off_at_tp1_with_a_note(tmp_path):
    text = BASE.replace("tensor_model_parallel_size: 2", "tensor_model_parallel_size: 1")
    raw = read(tmp_path, with_model("sequence_parallel: true\n").replace("tensor_model_parallel_size: 2", "tensor_model_parallel_size: 1"))
    assert raw.args["sequence_parallel"] is False and not raw.problems
    assert any("model.sequence_parallel" in w for w in raw.warnings)
    assert read(tmp_path, text).args.get("sequence_parallel") is None


def test_gqa_kv_channels_and_ties(tmp_path):
    L = resolve(read(tmp_path, with_model("num_query_groups: 2\nkv_channels: 128\nshare_embeddings_and_output_weights: false\n"
                                           "normalization: rmsnorm\nbias: false\nposition_embedding_type: rope\n")))
    assert (L.num_query_groups, L.kv_channels, L.untie_embeddings_and_output_weights, L.normalization,
            L.add_bias_linear, L.position_embedding_type) == (2, 128, True, "RMSNorm", False, "rope")


def test_unknown_keys_warn_but_mcore_fields_pass(tmp_path):
    raw = read(tmp_path, with_model("moe_router_topk: 2\nnum_layers_in_first_pipeline_stage: null\nwat_is_this: 3\n"))
    assert any("model.wat_is_this" in w for w in raw.warnings)
    assert not any("moe_router_topk" in w for w in raw.warnings)
    assert not any("num_layers_in_first_pipeline_stage" in w for w in raw.warnings)


def test_seq_length_conflict_is_a_problem(tmp_path):
    raw = read(tmp_path, BASE.replace("seq_length: ${model.encoder_seq_length}", "seq_length: 4096"))
    assert [p.key for p in raw.problems] == ["model.data.seq_length"]


def test_overrides_apply_before_interpolation(tmp_path):
    raw = read(tmp_path, BASE, overrides=["model.hidden_size=1024", "trainer.num_nodes=4", "model.data.data_prefix=[1,x]"])
    assert raw.args["ffn_hidden_size"] == 4096 and raw.world_size == 32


def test_launcher_fragment_interpolates_parent_keys(tmp_path):
    text = """
    run:
      name: x
      results_dir: ${base_results_dir}/${.name}
    trainer: {devices: 8, num_nodes: 1, precision: bf16}
    exp_manager:
      explicit_log_dir: ${training.run.results_dir}/results
    model:
      micro_batch_size: 1
      global_batch_size: 8
      tensor_model_parallel_size: ${divide_floor:8,4}
      encoder_seq_length: 1024
      num_layers: 2
      hidden_size: 256
      ffn_hidden_size: 1024
      num_attention_heads: 4
      tokenizer:
        library: megatron
        type: GPT2BPETokenizer
        vocab_file: ${data_dir}/bpe/vocab.json
      data:
        seq_length: ${training.model.encoder_seq_length}
    """
    raw = read(tmp_path, text)
    assert raw.args["tensor_model_parallel_size"] == 2 and not raw.problems


def test_unresolvable_needed_key_names_it(tmp_path):
    with pytest.raises(ReaderError, match=r"model\.num_layers: cannot resolve"):
        read(tmp_path, BASE.replace("num_layers: 4", "num_layers: ${cluster.layers}"))


def test_nemo_model_config_yaml(tmp_path):
    text = """
    micro_batch_size: 2
    global_batch_size: 16
    tensor_model_parallel_size: 1
    encoder_seq_length: 1024
    max_position_embeddings: 1024
    num_layers: 2
    hidden_size: 256
    ffn_hidden_size: 1024
    num_attention_heads: 4
    precision: bf16
    megatron_amp_O2: true
    tokenizer: {library: megatron, type: GPT2BPETokenizer}
    optim: {name: distributed_fused_adam}
    """
    raw = read(tmp_path, text, overrides=["model.micro_batch_size=4", "global_batch_size=32"], name="model_config.yaml")
    assert raw.world_size is None and raw.args["bf16"] is True
    assert (raw.args["micro_batch_size"], raw.args["global_batch_size"]) == (4, 32)
    assert raw.origin["micro_batch_size"] == "micro_batch_size"
    L = resolve(raw, world_size=8)
    assert L.dp == 8 and L.use_distributed_optimizer


def test_partial_activation_checkpoints_are_refused(tmp_path):
    text = with_model("activations_checkpoint_granularity: full\nactivations_checkpoint_method: block\n"
                      "activations_checkpoint_num_layers: 1\nnum_micro_batches_with_partial_activation_checkpoints: 2\n")
    with pytest.raises(NotModelledError):
        read(tmp_path, text)


class _FakeOmegaConf:
    """Records which registration API the resolver code picks."""

    def __init__(self, new_api: bool, has_new: bool = True):
        self.calls = []
        self._new = new_api
        if new_api:
            def register_resolver(name, resolver, *, replace=False, use_cache=False, annotation_validation="warn"):
                self.calls.append(("register_resolver", name, annotation_validation))
        else:
            def register_resolver(name, resolver):
                self.calls.append(("legacy_register_resolver", name))
        self.register_resolver = register_resolver
        if has_new:
            self.register_new_resolver = lambda name, fn: self.calls.append(("register_new_resolver", name))

    def has_resolver(self, name):
        return name == "gpu_name"


@pytest.mark.parametrize("new_api, has_new, expect", [
    (True, True, "register_resolver"), (False, True, "register_new_resolver"), (False, False, "legacy_register_resolver")])
def test_resolver_registration_api_by_omegaconf_version(new_api, has_new, expect):
    from megatron_memguard.readers.nemo1 import _register_resolvers

    oc = _FakeOmegaConf(new_api, has_new)
    _register_resolvers(oc)
    assert {c[0] for c in oc.calls} == {expect}
    assert {c[1] for c in oc.calls} == {"multiply", "sum", "divide_ceil", "divide_floor"}  # gpu_name already there


def test_without_omegaconf_the_message_says_how_to_get_it(tmp_path, monkeypatch):
    import megatron_memguard.readers.nemo1 as n1

    monkeypatch.setattr(n1, "omegaconf_module", lambda: None)
    with pytest.raises(ReaderError, match=r"megatron-memguard\[readers\]"):
        read(tmp_path, BASE)
    # Megatron flags and functional-test configs do not need it
    from megatron_memguard import layout_from_flags
    assert layout_from_flags("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
                             "--micro-batch-size 1".split(), world_size=1).num_layers == 2


def test_bad_key_type_reports_key(tmp_path):
    with pytest.raises(ConfigError, match="model.num_layers"):
        resolve(read(tmp_path, BASE.replace("num_layers: 4", "num_layers: four")))


def _nemo_archive(tmp_path):
    """A .nemo checkpoint (a tar) holding a small model_config.yaml."""
    import io
    import tarfile

    cfg = ("micro_batch_size: 1\nglobal_batch_size: 8\nencoder_seq_length: 512\nnum_layers: 2\nhidden_size: 128\n"
           "ffn_hidden_size: 512\nnum_attention_heads: 4\nprecision: bf16\nmegatron_amp_O2: true\n"
           "tokenizer: {library: megatron, type: GPT2BPETokenizer}\noptim: {name: fused_adam}\n").encode()
    p = tmp_path / "model.nemo"
    with tarfile.open(p, "w:") as tar:
        info = tarfile.TarInfo("./model_config.yaml")
        info.size = len(cfg)
        tar.addfile(info, io.BytesIO(cfg))
    return p


def test_nemo_archive(tmp_path):
    raw = read_config_file(str(_nemo_archive(tmp_path)))
    assert raw.args["num_layers"] == 2 and raw.args["bf16"] is True
    assert resolve(raw, world_size=8).dp == 8


def test_nemo_archive_takes_key_value_overrides_after_dashdash(tmp_path, capsys):
    import json

    from megatron_memguard.cli.main import main

    p = _nemo_archive(tmp_path)
    assert main(["estimate", "--config", str(p), "--gpus", "8", "--json", "--", "num_layers=4"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["num_layers"] == 4


def test_ub_tp_comm_overlap_cfg_reaches_the_userbuffers(tmp_path):
    # NeMo's Hydra-loaded model.ub_tp_comm_overlap_cfg (a mapping of TE's ub_cfgs): proj_fprop on ring exchange
    # keeps 2 TP - 1 = 3 chunks of its [s b / TP, h] buffer (TE's CommOverlapP2PBase, TP 2)
    from megatron_memguard.estimator.userbuffers import userbuffers
    text = with_model("sequence_parallel: true\nub_tp_comm_overlap: true\n"
                      "ub_tp_comm_overlap_cfg:\n    proj_fprop:\n      method: ring_exchange\n      num_sm: 1\n")
    raw = read(tmp_path, text)
    L = resolve(raw)
    by = {b.gemm: b for b in userbuffers(L)}
    assert L.kernels.tp_comm_overlap_cfg == ("proj_fprop.method=ring_exchange",)
    full = L.seq_length * L.micro_batch_size * L.hidden_size * 2
    assert by["proj_fprop"].bytes >= full // 2 * 3 and by["qkv_fprop"].bytes >= full
