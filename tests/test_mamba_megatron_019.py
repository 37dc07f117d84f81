"""Hybrid Mamba flags as megatron-core 0.19.2's own parser and validate_args leave them (Python 3.12, the real
megatron.training), read by memguard's hook: validate_args copies the deprecated --hybrid-override-pattern into
hybrid_layer_pattern (both stay set), takes the layer count from the pattern and the virtual pipeline size from
its '|' segments; the layout memguard resolves from that namespace is the one it resolves from the flags."""
from conftest import CONTAINER_ERA, validated_by_megatron

pytestmark = CONTAINER_ERA
HYBRID = ("--num-layers 3 --hidden-size 256 --num-attention-heads 4 --seq-length 512 --max-position-embeddings 512 "
          "--micro-batch-size 2 --global-batch-size 32 --bf16 --tensor-model-parallel-size 2 --sequence-parallel "
          "--pipeline-model-parallel-size 2 --hybrid-override-pattern M*|M-|MM|-- --mamba-head-dim 32 "
          "--mamba-num-groups 2 --mamba-state-dim 16 --position-embedding-type none --disable-bias-linear "
          "--lr 1e-4 --train-iters 10 --mock-data --tokenizer-type NullTokenizer --vocab-size 50257").split()


def test_hybrid_namespace_of_validate_args_resolves_like_the_flags(monkeypatch, capsys):
    from megatron_memguard import layout_from_flags
    hook, args = validated_by_megatron(monkeypatch, "pretrain_mamba.py", HYBRID)
    out = capsys.readouterr().out
    assert args.hybrid_layer_pattern == args.hybrid_override_pattern == "M*|M-|MM|--"
    assert args.num_layers == 8 and args.virtual_pipeline_model_parallel_size == 2
    L = hook.STATE.decision.layout
    flags = layout_from_flags(HYBRID, world_size=8, megatron_version=L.megatron_version)
    assert L.hybrid_layer_pattern == flags.hybrid_layer_pattern == "M*|M-|MM|--"
    assert L.parallel == flags.parallel and L.vpp == 2 and L.num_layers == 8
    assert [(c.first_layer, c.num_layers) for c in L.chunks] == [(c.first_layer, c.num_layers) for c in flags.chunks]
    assert "layer_activations" in out


MTP = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 512 --max-position-embeddings 512 "
       "--micro-batch-size 1 --global-batch-size 32 --bf16 --hybrid-layer-pattern M*M- --mtp-hybrid-override-pattern *- "
       "--mtp-num-layers 2 --mtp-use-repeated-layer --mamba-head-dim 32 --mamba-num-groups 2 --mamba-state-dim 16 "
       "--position-embedding-type none --disable-bias-linear --lr 1e-4 --train-iters 10 --mock-data "
       "--tokenizer-type NullTokenizer --vocab-size 50257").split()


def test_hybrid_mtp_namespace_of_validate_args_resolves_like_the_flags(monkeypatch, capsys):
    # validate_args turns the legacy --mtp-hybrid-override-pattern into the unified '/' pattern (and clears it)
    from megatron_memguard import layout_from_flags
    from megatron_memguard.estimator.params import total_parameters
    hook, args = validated_by_megatron(monkeypatch, "pretrain_mamba.py", MTP)
    capsys.readouterr()
    assert args.hybrid_layer_pattern == "M*M-/*-/*-" and args.mtp_num_layers == 2
    assert args.mtp_hybrid_override_pattern is None
    L = hook.STATE.decision.layout
    flags = layout_from_flags(MTP, world_size=8, megatron_version=L.megatron_version)
    assert (L.hybrid_layer_pattern, L.hybrid_mtp_pattern, L.mtp_num_layers, L.mtp_use_repeated_layer) == (
        flags.hybrid_layer_pattern, flags.hybrid_mtp_pattern, flags.mtp_num_layers, True) == ("M*M-", "*-", 2, True)
    assert total_parameters(L) == total_parameters(flags)
