"""Issue 17's last refused flags: each is refused by name, with the reason docs/assumptions.md gives (what memory
it adds and why the flags do not fix it). Facts from megatron-core 0.19.2 (files named per case)."""
import pytest

from megatron_memguard import layout_from_flags
from megatron_memguard.errors import NotModelledError

BASE = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
        "--micro-batch-size 4 --global-batch-size 32 --bf16 --position-embedding-type rope").split()

CASES = [
    # (DSA is modelled: tests/test_dsa.py; gated delta net: tests/test_gdn.py)
    # pipeline_parallel/hybrid_cp_schedule.py: a CP group per sub-sample, sized from the data
    (["--hybrid-context-parallel"], "--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank"),
    # core/extensions/kitchen.py only wraps NVIDIA's kitchen package
    (["--use-kitchen-attention"], "--use-kitchen-attention", "not public"),
    # arguments.py --inference-dynamic-batching-buffer-size-gb: the rollout's KV cache on the GPU
    (["--perform-rl-step"], "--perform-rl-step", "KV cache"),
    # distillation/cached_logits_loss.py topk_kl_div: K from the files written with --logits-save-top-k
    (["--logits-load-dir", "/x"], "--logits-load-dir", "top-K"),
    # training.py load_kd_teacher_checkpoint: the teacher's shape comes from its checkpoint
    (["--export-kd-teacher-load", "/x"], "--export-kd-teacher-load", "teacher checkpoint"),
]


@pytest.mark.parametrize("flags, key, reason", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_refused_by_name_with_its_reason(flags, key, reason):
    with pytest.raises(NotModelledError) as e:
        layout_from_flags(BASE + flags, world_size=8)
    assert e.value.key == key
    msg = str(e.value)
    assert msg.startswith(key + ":") and reason in msg and "\n" not in msg


def test_without_the_flags_the_same_layout_is_estimated():
    # the refusals come from the flags, not from the base layout
    layout_from_flags(BASE, world_size=8)
