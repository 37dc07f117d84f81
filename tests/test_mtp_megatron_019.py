"""MTP under full recompute as megatron-core 0.19.2's own parser and validate_args leave it (Python 3.12, the real
megatron.training), read by memguard's hook. validate_args and TransformerConfig accept --recompute-method uniform
with --recompute-num-layers 2 and --mtp-num-layers: the run only stops at its first forward, on
MultiTokenPredictionLayer._checkpointed_forward's ``assert recompute_num_layers == 1`` (multi_token_prediction.py,
0.19.2). The hook reports the same one-line error as the CLI, before anything is allocated; block is accepted by
both and estimated with the MTP layers kept whole."""
import pytest
from conftest import CONTAINER_ERA, validated_by_megatron

pytestmark = CONTAINER_ERA
GPT = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 512 --max-position-embeddings 512 "
       "--micro-batch-size 1 --global-batch-size 32 --bf16 --position-embedding-type rope --mtp-num-layers 1 "
       "--recompute-granularity full --lr 1e-4 --train-iters 10 --mock-data --tokenizer-type NullTokenizer "
       "--vocab-size 50257").split()


def test_uniform_two_layers_passes_validate_args_and_the_hook_names_the_assertion(monkeypatch, capsys):
    hook, args = validated_by_megatron(monkeypatch, "pretrain_gpt.py",
                                       GPT + "--recompute-method uniform --recompute-num-layers 2".split())
    out = capsys.readouterr().out
    assert (args.recompute_method, args.recompute_num_layers, args.mtp_num_layers) == ("uniform", 2, 1)
    d = hook.STATE.decision
    assert d.action == "unsupported" and d.estimate is None
    assert d.reason.startswith("--recompute-num-layers: must be 1 with --mtp-num-layers under --recompute-method "
                               "uniform, got 2")
    assert "recompute_num_layers must be 1 for MTP recompute" in out


@pytest.mark.parametrize("n", [1, 4])
def test_block_passes_both_and_is_estimated(monkeypatch, capsys, n):
    from megatron_memguard import layout_from_flags
    flags = GPT + f"--recompute-method block --recompute-num-layers {n}".split()
    hook, args = validated_by_megatron(monkeypatch, "pretrain_gpt.py", flags)
    d = hook.STATE.decision
    assert d.estimate is not None and d.layout.recompute_method == "block"
    assert d.layout == layout_from_flags(flags, world_size=8, megatron_version=d.layout.megatron_version)
    assert "does not recompute the 1 MTP layer(s)" in " ".join(d.layout.notes)
