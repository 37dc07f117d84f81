"""Vocabulary sizes of tokenizers that configs name without giving a size.

Sizes are the tokenizers' published vocabularies (``len(tokenizer)`` / ``vocab_size`` in their
Hugging Face ``config.json``); Megatron pads them to a multiple of
``make_vocab_size_divisible_by * TP`` afterwards.
"""
from __future__ import annotations

import re

# Megatron's own tokenizers
GPT2_BPE = 50257  # GPT-2 BPE (Radford et al. 2019), what pretrain_gpt.py uses without --tokenizer-type

KNOWN_VOCABS: dict[str, int] = {
    "gpt2": GPT2_BPE,
    "gpt2bpetokenizer": GPT2_BPE,
    "megatron-gpt-345m": GPT2_BPE,
    "bert-large-uncased": 30522,
    "bertwordpiecelowercase": 30522,
    "bertwordpiececase": 28996,
    "llama-2": 32000, "llama2": 32000, "llama2tokenizer": 32000, "meta-llama/llama-2-7b-hf": 32000,
    "mistral": 32000, "mistral-7b": 32000, "mixtral": 32000, "mistralai/mistral-7b-v0.1": 32000,
    "mistral-nemo": 131072, "tekken": 131072,
    "llama-3": 128256, "llama3": 128256, "llama-3.1": 128256, "llama3.1": 128256, "llama-3.2": 128256,
    "llama3.2": 128256, "meta-llama/meta-llama-3-8b": 128256, "meta-llama/meta-llama-3.1-8b": 128256,
    "meta-llama/llama-3.1-8b": 128256, "meta-llama/llama-3.2-1b": 128256, "meta-llama/llama-3.2-3b": 128256,
    "qwen2": 151936, "qwen2.5": 151936, "qwen/qwen2.5-7b": 152064, "qwen3": 151936,
    "nemotron": 256000, "gemma": 256000, "gemma2": 256000,
    # google/gemma-2-{2b,9b,27b} config.json vocab_size (Gemma 2 technical report, arXiv 2408.00118: 256k entries)
    "google/gemma-2-2b": 256000, "google/gemma-2-9b": 256000, "google/gemma-2-27b": 256000,
}


def _norm(name: str) -> str:
    return re.sub(r"\s+", "", name.strip().lower())


def known_vocab_size(name: str | None) -> int | None:
    """Vocabulary of a tokenizer named by type, library id or model path; None when unknown."""
    if not name:
        return None
    k = _norm(str(name))
    if k in KNOWN_VOCABS:
        return KNOWN_VOCABS[k]
    base = k.rsplit("/", 1)[-1]
    for cand in (base, base.replace("meta-", "")):
        if cand in KNOWN_VOCABS:
            return KNOWN_VOCABS[cand]
    # family prefixes: meta-llama/Meta-Llama-3.1-70B -> llama-3.1
    m = re.search(r"llama-?(\d)(?:\.(\d))?", k)
    if m:
        return 32000 if m.group(1) == "2" else 128256 if m.group(1) == "3" else None
    if "mistral" in k or "mixtral" in k:
        return 32000
    if "qwen" in k:
        return 151936
    return None


def pad_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's ``vocab_size_with_padding``: round up to a multiple of ``divisible_by * TP``."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple
