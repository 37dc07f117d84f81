"""Regressions of issue hostile13 (benchmarks/hostile_input.py's hostile13 group): inputs the twelfth round left
accepted or broke on. Each is the smallest input of its class, with what the real framework does and what memguard
does now."""
from __future__ import annotations

import json
import os

import pytest

from fuzz_util import run_memguard
from test_calibrate import write_runs
from test_planner_gdn import MODEL as GDN
from test_readers_bridge import FLAT

S = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
     "--micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 1000 --bf16").split()
BRIDGE = ["estimate", "--config", "c.yaml", "--gpus", "8"]


def one_error(o, text: str) -> None:
    assert not o.problems, o.describe()
    lines = [line for line in o.err.splitlines() if line.strip()]
    assert o.code == 2 and len(lines) == 1, (o.code, o.err)
    assert lines[0] == "memguard: error: " + text, lines[0]


def _peak(*sets: str) -> tuple[int, int]:
    argv = [*BRIDGE, "--json", *[x for s in sets for x in ("--set", s)]]
    o = run_memguard(argv, {"c.yaml": FLAT})
    assert o.code == 0 and not o.problems, o.describe()
    st = max(json.loads(o.out)["stages"], key=lambda s: s["device_total_bytes"])
    return st["peak_allocated_bytes"], st["device_total_bytes"]


def test_bridge_comm_overlap_bool_fields_take_their_truth_as_bridge_does():
    # CommOverlapConfig (Megatron-Bridge 0.6.2 training/comm_overlap.py) tests these with `is True` only to guard its
    # own checks; _override_user_cfgs then copies any other value into the model config, whose truth turns the
    # feature on (tests/test_bridge_real.py holds it against the real Bridge). hostile13 made 'x' an error; bridge17
    # reads it as Bridge builds it, with a warning naming the key. FLAT has TP 2 with sequence parallelism, where
    # Bridge's check would keep the overlap on too
    o = run_memguard([*BRIDGE, "--set", "comm_overlap.tp_comm_overlap=x"], {"c.yaml": FLAT})
    assert o.code == 0 and not o.problems, o.describe()
    assert "comm_overlap.tp_comm_overlap: 'x' is not true or false; Megatron-Bridge 0.6.2 sets it unchecked" in o.out
    assert _peak("comm_overlap.tp_comm_overlap=x") == _peak("comm_overlap.tp_comm_overlap=true")
    # delay_wgrad_compute 'x' is on: TransformerConfig.__post_init__ (core 0.19.2) then asserts the EP overlap by truth
    one_error(run_memguard([*BRIDGE, "--set", "comm_overlap.delay_wgrad_compute=x"], {"c.yaml": FLAT}),
              "comm_overlap.delay_wgrad_compute: needs --overlap-moe-expert-parallel-comm (which needs experts)")


def test_bridge_bool_words_omegaconf_takes_keep_their_reading():
    # a YAML / Hydra true and the text '1' (Hydra keeps a quoted value a string, whose truth Bridge's code tests) give
    # the same figure
    base = _peak()
    pao = _peak("optimizer.use_precision_aware_optimizer=true")
    assert pao != base and _peak("optimizer.use_precision_aware_optimizer='1'") == pao
    ub = _peak("comm_overlap.tp_comm_overlap=true")
    assert ub[1] > base[1] and _peak("comm_overlap.tp_comm_overlap=1") == ub


@pytest.mark.parametrize("flag, value", [("--linear-num-key-heads", "0"), ("--linear-num-key-heads", "-1"),
                                         ("--linear-num-value-heads", "0"), ("--linear-key-head-dim", "0")])
def test_gdn_head_count_below_one_is_one_error(flag, value):
    # TransformerConfig.__post_init__ (megatron-core 0.19.2) checks linear_num_value_heads % linear_num_key_heads:
    # a key-head count of 0 raises ZeroDivisionError there. memguard said so, then added a second error about the
    # value heads being no multiple of 16 key heads (the default it had put back in place of the 0)
    argv = ["estimate", "--world-size", "8", "--", *GDN, "--seq-length", "1024", "--micro-batch-size", "1", flag, value]
    one_error(run_memguard(argv), f"{flag}: must be >= 1, got {value}")
    plan = ["plan", "--gpus", "8", "--seq-length", "1024", "--global-batch-size", "32", "--", *GDN, flag, value]
    one_error(run_memguard(plan), f"{flag}: must be >= 1, got {value}")


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="Linux only")
@pytest.mark.parametrize("cmd", ["report", "calibrate"])
def test_a_log_that_opens_but_cannot_be_read(cmd, tmp_path):
    # /proc/self/mem opens and fails at the first read (EIO at address 0): memguard stopped with an internal
    # OSError; the same for a rank's JSONL file that fails mid-read (here a link to it)
    one_error(run_memguard([cmd, "/proc/self/mem"]), "/proc/self/mem: cannot read line 1 (Input/output error)")
    os.symlink("/proc/self/mem", tmp_path / "memguard-rank00000.jsonl")
    one_error(run_memguard([cmd, str(tmp_path)]),
              f"{tmp_path}/memguard-rank00000.jsonl: cannot read line 1 (Input/output error)")


@pytest.mark.parametrize("argv, flag", [
    (["estimate", "--world-size", "8", "--plot", "", "--", *S], "--plot"),
    (["plan", "--gpus", "8", "--seq-length", "512", "--global-batch-size", "64", "--plot", "", "--", *S], "--plot"),
    (["estimate", "--world-size", "8", "--site-profile", "", "--", *S], "--site-profile"),
    (["report", ".", "--out", ""], "--out"),
    (["calibrate", ".", "--out", ""], "--out"),
])
def test_an_empty_file_name_is_refused(argv, flag):
    # `--plot ""` drew nothing, `--out ""` wrote nothing and `--site-profile ""` took the defaults, all with exit 0
    # and no word (a shell variable that was never set: --out "$OUT")
    one_error(run_memguard(argv), f"{flag}: is an empty file name (leave {flag} out, or give a file)")


def test_calibrate_out_with_a_nul_or_a_line_break(tmp_path):
    # open() refuses a NUL (ValueError: an internal error before); a line break is legal in a file name, and the
    # 'written to' line printed it raw: two lines, the second not memguard's
    runs = str(write_runs(tmp_path / "runs"))
    one_error(run_memguard(["calibrate", runs, "--gpu", "A100-80GB", "--out", "a\x00b"]),
              "--out: 'a\\x00b' is not a file name (it holds a NUL character)")
    out = str(tmp_path / "a\nb.yaml")
    o = run_memguard(["calibrate", runs, "--gpu", "A100-80GB", "--out", out])
    assert o.code == 0 and not o.problems, o.describe()
    assert o.err.splitlines() == [f"memguard: site profile written to {out!r}"]
    assert os.path.getsize(out) > 0


@pytest.mark.parametrize("field, value, text", [
    ("eval_micro_batch_size", 1.5, "--eval-micro-batch-size: must be an integer, got 1.5"),
    ("linear_num_key_heads", [], "--linear-num-key-heads: must be an integer, got []"),
    ("skip_train", float("nan"), "--skip-train: must be true or false, got nan"),
])
def test_hook_namespace_with_a_wrong_type_at_a_newer_flag(field, value, text):
    # Megatron's argparse makes these int / bool (type=int, store_true); a launcher that sets the namespace in code can
    # leave a float, a list or NaN there. The hook says it cannot estimate, naming the flag, and Megatron's own
    # validation still runs (warn mode)
    from mutate_util import hook_namespaces, run_hook
    ns = hook_namespaces()["legacy 0.16"]
    setattr(ns, field, value)
    if field.startswith("linear_"):
        ns.experimental_attention_variant, ns.linear_attention_freq = "gated_delta_net", 4
    ns.memguard = "warn"
    o = run_hook(ns)
    assert o.carried_on and not o.escaped and not o.errors, o
    assert o.emitted[-1] == f"[memguard] cannot estimate this configuration: {text}; training continues unchecked"


def test_a_run_of_unclosed_command_substitutions_reads_as_written():
    # bash leaves an unclosed "$(" as text; memguard's reader takes a run of them in one step (the 950 kB case of
    # benchmarks/hostile_input.py: 2.43 s of CPU before, under 2 s after), and a closed one inside the run as written
    from megatron_memguard.readers.shell import _Words
    assert _Words("a $($( b $($(x) c", {}).run() == ["a", "$($(", "b", "$($(x)", "c"]
    assert _Words('"$($(" $(', {}).run() == ["$($(", "$("]
    assert _Words("$(" * 1000, {}).run() == ["$(" * 1000]
