"""Section: the vocabulary and its padding (the tokenizer build in set_global_variables)."""
from __future__ import annotations

from typing import Any, Mapping

from ..tokenizers import GPT2_BPE, known_vocab_size, pad_vocab
from .args import Args, Context, Stop


def vocab(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    legacy, vocab_override = ctx.legacy, ctx.vocab_size
    padded = a.int_arg("padded_vocab_size")
    tokenizer = a.get("tokenizer_type")
    size = None
    divisible = a.int_arg("make_vocab_size_divisible_by", 128)
    if padded is None:
        given = vocab_override or a.int_arg("vocab_size")
        if tokenizer == "NullTokenizer":
            if given is None:
                a.fail("vocab_size", "is required with --tokenizer-type NullTokenizer")
                raise Stop
            # NullTokenizer counted one extra EOD token up to core 0.17 (Megatron commit c9dfe34798).
            size = given + 1 if legacy else given
        elif tokenizer in (None, "GPT2BPETokenizer") and a.get("tokenizer_model") is None:
            size = given if (tokenizer is None and vocab_override) else GPT2_BPE
            if tokenizer is None and not vocab_override:
                a.notes.append("no --tokenizer-type: pretrain_gpt.py's default GPT2BPETokenizer (50257 tokens)")
        else:
            size = known_vocab_size(a.get("tokenizer_model")) or known_vocab_size(tokenizer) or given
            if size is None:
                a.fail("vocab_size", f"unknown vocabulary for tokenizer {a.get('tokenizer_model') or tokenizer!r}",
                       "give --vocab-size N")
                raise Stop
        padded = pad_vocab(size, divisible, kw["tensor_model_parallel_size"]) if a.bool_arg("pad_vocab_size", True) else size
    return dict(vocab_size=size, padded_vocab_size=padded, make_vocab_size_divisible_by=divisible, tokenizer_type=tokenizer)
