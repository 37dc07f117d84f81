"""MoE flags as megatron-core 0.19.2's own parser and validate_args leave them (Python 3.12, the real
megatron.training), read by memguard's hook: the layout memguard resolves from the namespace is the one
it resolves from the same flags, and the hook's pre-allocation report names the MoE terms."""
from conftest import CONTAINER_ERA, validated_by_megatron


pytestmark = CONTAINER_ERA
MOE = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
       "--micro-batch-size 4 --global-batch-size 32 --bf16 --tensor-model-parallel-size 2 --sequence-parallel "
       "--expert-model-parallel-size 2 --num-experts 8 --moe-router-topk 2 --moe-layer-freq ([0]*1+[1]*3) "
       "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-aux-loss-coeff 1e-2 --disable-bias-linear "
       "--lr 1e-4 --train-iters 10 --mock-data --tokenizer-type NullTokenizer --vocab-size 50257").split()


def test_moe_namespace_of_validate_args_resolves_like_the_flags(monkeypatch, capsys):
    from megatron_memguard import layout_from_flags
    hook, args = validated_by_megatron(monkeypatch, "pretrain_gpt.py", MOE)
    out = capsys.readouterr().out
    # validate_args turned --moe-layer-freq into a list and set ETP = TP; the hook read the arguments it got
    assert args.moe_layer_freq == [0, 1, 1, 1] and args.expert_tensor_parallel_size == 2
    L = hook.STATE.decision.layout
    flags = layout_from_flags(MOE, world_size=8, megatron_version=L.megatron_version)
    assert L.moe == flags.moe and L.parallel == flags.parallel
    assert (L.moe.ep, L.moe.etp, L.moe.num_moe_layers, L.moe.moe_ffn_hidden_size) == (2, 2, 3, 2048)
    assert "moe_layer_activations" in out and "te_grouped_gemm_workspaces" in out and "MoE routing" in out
