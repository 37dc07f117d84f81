"""Hybrid Mamba flags as megatron-core 0.19.2's own parser and validate_args leave them (Python 3.12, the real
megatron.training), read by memguard's hook: validate_args copies the deprecated --hybrid-override-pattern into
hybrid_layer_pattern (both stay set), takes the layer count from the pattern and the virtual pipeline size from
its '|' segments; the layout memguard resolves from that namespace is the one it resolves from the flags."""
import os
import sys

from conftest import CONTAINER_ERA, H100

pytestmark = CONTAINER_ERA
HYBRID = ("--num-layers 3 --hidden-size 256 --num-attention-heads 4 --seq-length 512 --max-position-embeddings 512 "
          "--micro-batch-size 2 --global-batch-size 32 --bf16 --tensor-model-parallel-size 2 --sequence-parallel "
          "--pipeline-model-parallel-size 2 --hybrid-override-pattern M*|M-|MM|-- --mamba-head-dim 32 "
          "--mamba-num-groups 2 --mamba-state-dim 16 --position-embedding-type none --disable-bias-linear "
          "--lr 1e-4 --train-iters 10 --mock-data --tokenizer-type NullTokenizer --vocab-size 50257").split()


def test_hybrid_namespace_of_validate_args_resolves_like_the_flags(monkeypatch, capsys):
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    import torch
    import megatron_memguard.megatron as hook
    from megatron.training import global_vars
    from megatron.training.arguments import parse_and_validate_args
    from megatron_memguard import layout_from_flags
    assert hook.install(quiet=True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=None: H100)
    for k, v in (("WORLD_SIZE", "8"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(k, v)
    hook.STATE.decision = None
    monkeypatch.setattr(sys, "argv", ["pretrain_mamba.py", *HYBRID, "--memguard", "report"])
    try:
        args = parse_and_validate_args(extra_args_provider=None, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    finally:
        global_vars.unset_global_variables()
    out = capsys.readouterr().out
    assert args.hybrid_layer_pattern == args.hybrid_override_pattern == "M*|M-|MM|--"
    assert args.num_layers == 8 and args.virtual_pipeline_model_parallel_size == 2
    L = hook.STATE.decision.layout
    flags = layout_from_flags(HYBRID, world_size=8, megatron_version=L.megatron_version)
    assert L.hybrid_layer_pattern == flags.hybrid_layer_pattern == "M*|M-|MM|--"
    assert L.parallel == flags.parallel and L.vpp == 2 and L.num_layers == 8
    assert [(c.first_layer, c.num_layers) for c in L.chunks] == [(c.first_layer, c.num_layers) for c in flags.chunks]
    assert "layer_activations" in out
