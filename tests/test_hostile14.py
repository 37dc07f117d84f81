"""Regressions of issue hostile14 (benchmarks/hostile_input.py's hostile14 group): inputs the thirteenth round left
broken, hanging or silently misread. Each is the smallest input of its class, with what the real tool does and what
memguard does now."""
from __future__ import annotations

import json

import pytest

from fuzz_util import YAML_SEEDS, run_memguard
from test_readers_bridge import FLAT

S = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
     "--micro-batch-size 1 --global-batch-size 16 --tokenizer-type NullTokenizer --vocab-size 1000 --bf16")
RUN = "torchrun --nproc-per-node 8 pretrain_gpt.py "
SEEDS = {n: (t, o) for n, t, o in YAML_SEEDS}


def one_error(o, text: str, prefix: str = "memguard: error: ") -> None:
    assert not o.problems, o.describe()
    lines = [line for line in o.err.splitlines() if line.strip()]
    assert o.code == 2 and len(lines) == 1, (o.code, o.err)
    assert lines[0] == prefix + text, lines[0]


@pytest.mark.parametrize("key, what", [("1", "an integer"), ("true", "a bool"), ("on", "a bool"), ("1.5", "a number"),
                                       ("null", "null")])
def test_a_yaml_key_that_is_not_a_name(key, what):
    # YAML 1.1 reads `1:`, `true:` / `on:`, `1.5:`, `null:` as keys of those types. A NeMo 1 model key of them was an
    # internal error (TypeError: "model." + 1), a Bridge top-level one too (len(True)); Bridge's own instantiate stops
    # on them ("keywords must be strings"). The error names the file, line and column of the key
    nemo, opts = SEEDS["nemo1_llama.yaml"]
    line = nemo[:nemo.index("model:\n")].count("\n") + 2     # the key goes on the line after `model:`
    o = run_memguard(["validate", "c.yaml", *opts], {"c.yaml": nemo.replace("model:\n", f"model:\n  {key}: 4\n", 1)})
    one_error(o, f"c.yaml:{line}:3: YAML error: the key '{key}' reads as {what}, not a name (a config's keys are field "
                 f"names; quote it if it is one: '{key}':)", prefix="memguard validate: error: ")
    o = run_memguard(["estimate", "--config", "c.yaml", "--gpus", "8"], {"c.yaml": f"{key}: 4\n" + FLAT})
    one_error(o, f"c.yaml:1:1: YAML error: the key '{key}' reads as {what}, not a name (a config's keys are field names; "
                 f"quote it if it is one: '{key}':)")


BRIDGE = ["estimate", "--config", "c.yaml", "--gpus", "16", "--set", "mixed_precision=bf16_with_fp8_delayed_scaling_mixed",
          "--set", "model.fp8_dot_product_attention=true", "--set", "model.context_parallel_size=2"]


@pytest.mark.parametrize("value, text", [
    ("P2P", "unknown communication type 'P2P' (Transformer Engine takes p2p, all_gather, a2a, a2a+p2p)"),
    ("[P2P, p2p, p2p, p2p]", "unknown communication type 'P2P' (Transformer Engine takes p2p, all_gather, a2a, a2a+p2p)"),
    ("[null, p2p, p2p, p2p]", "unknown communication type None (Transformer Engine takes p2p, all_gather, a2a, a2a+p2p)"),
    ("allgather", "unknown communication type 'allgather' (Transformer Engine takes p2p, all_gather, a2a, a2a+p2p) "
                  "(write all_gather)"),
    ("[p2p, all_gather]", "gives 2 communication types for 4 layers (megatron-core's TransformerConfig asserts one per "
                          "layer, or a single type)"),
])
def test_fp8_attention_cp_comm_type_names_the_rule(value, text):
    # Transformer Engine's attn_forward_func_with_cp raises "Unsupported communication type" on any other word and
    # TransformerConfig asserts one type per layer (4 here). With FP8 attention memguard refused these as "one
    # communication type per layer ... is not modelled yet"; BF16 attention gave the rule already
    one_error(run_memguard([*BRIDGE, "--set", f"model.cp_comm_type={value}"], {"c.yaml": FLAT}), f"model.cp_comm_type: {text}")


def test_fp8_attention_per_layer_types_are_estimated():
    # (refused before: "one communication type per layer ... is not modelled yet"); each layer's kind now carries its
    # own type (megatron-core transformer_layer.py: cp_comm_type[layer_number - 1]; tests/test_fp8_attention.py
    # test_per_layer_comm_types_*), and the layout says which
    o = run_memguard([*BRIDGE, "--set", "model.cp_comm_type=[p2p, all_gather, p2p, p2p]", "--json"], {"c.yaml": FLAT})
    assert o.code == 0 and not o.problems, o.describe()
    assert json.loads(o.out)["layout"]["cp_comm_layers"] == "p2p,all_gather,p2p,p2p"


def _layers(script: str) -> int:
    o = run_memguard(["estimate", "--config", "run.sh", "--json"], {"run.sh": script})
    assert o.code == 0 and not o.problems, o.describe()
    return json.loads(o.out)["layout"]["num_layers"]


def test_array_and_string_appends_are_read():
    # bash: ARGS+=(...) appends to the array, A+=" ..." to the string; memguard dropped both lines, and the later
    # --num-layers 8 (argparse keeps the last) was read as 4
    assert _layers(f"ARGS=({S})\nARGS+=(--num-layers 8)\n{RUN}\"${{ARGS[@]}}\"\n") == 8
    assert _layers(f"A=\"{S}\"\nA+=\" --num-layers 8\"\n{RUN}$A\n") == 8
    assert _layers(f"export A=\"{S}\"\nexport A+=\" --num-layers 8\"\n{RUN}$A\n") == 8
    assert _layers(f"B+=(--num-layers 8)\n{RUN}{S} ${{B[@]}}\n") == 8
    # on an array, += word appends to element 0: "--num-layers0" (not a flag) and a stray "8"
    assert _layers(f"A=(--num-layers 8)\nA+=0\n{RUN}{S} ${{A[@]}}\n") == 4
    # the assignment alone still reads as before
    assert _layers(f"ARGS=({S})\n{RUN}\"${{ARGS[@]}}\"\n") == 4


@pytest.mark.parametrize("line", ['A=("${A[@]}" "${A[@]}")', "A=(${A[@]} ${A[@]})"])
def test_a_doubling_array_stops_at_the_word_bound(line):
    # 30 doublings: 2**30 words. Each word was one step of the reader's loop (16 s of CPU and still running after 60 s);
    # now they are added at once and a command of more than 100,000 words is refused (Megatron-LM's scripts: hundreds)
    script = "A=(x)\n" + (line + "\n") * 30 + RUN + S + "\n"
    o = run_memguard(["estimate", "--config", "run.sh"], {"run.sh": script}, cpu_limit=2.0)
    # (line 18: the 17th doubling makes 2**17 = 131,072 words; hostile15 added the line)
    one_error(o, "run.sh: line 18: cannot parse the array A: the command has more than 100,000 words")


def test_stray_arguments_are_one_note():
    # 470,000 stray words (a 950 kB launch line) printed 470,000 notes and took 2.9 s of CPU; 20 give one note
    o = run_memguard(["estimate", "--config", "run.sh", "--json"], {"run.sh": RUN + S + " x y" * 10 + "\n"})
    notes = [n for n in json.loads(o.out)["notes"] if "stray" in n]
    assert notes == ["ignored 20 stray arguments 'x', 'y', ... (20 in all) (not after a flag that takes a value)"]
    o = run_memguard(["estimate", "--config", "run.sh", "--json"], {"run.sh": RUN + S + " x\n"})
    assert [n for n in json.loads(o.out)["notes"] if "stray" in n] == [
        "ignored stray argument 'x' (not after a flag that takes a value)"]
    o = run_memguard(["estimate", "--config", "run.sh"], {"run.sh": RUN + S + " x" * 470_000 + "\n"}, cpu_limit=2.0)
    assert o.code == 2 and not o.problems, o.describe()
    assert o.err.startswith("memguard: error: run.sh: line 1: cannot parse 'torchrun --nproc-per-node 8 pretrain_gpt.py ")
    assert o.err.rstrip().endswith(": the command has more than 100,000 words (940311 characters)"), o.err[-200:]
