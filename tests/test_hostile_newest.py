"""Regressions of issue hostile8 (benchmarks/hostile_input.py's hostile9 group): hostile input to the newest surfaces
(hybrid MTP patterns, Megatron-Bridge PEFT keys, gigantic Megatron logs). Each is the smallest input that broke the
promise (a hang, unbounded memory, or a setting silently dropped), with what memguard does now."""
from __future__ import annotations

import json

import pytest

from fuzz_util import HYBRID, run_memguard

GiB = 2**30


def one_error(o, text: str) -> str:
    assert not o.problems, o.describe()
    lines = [line for line in o.err.splitlines() if line.strip()]
    assert o.code == 2 and len(lines) == 1, (o.code, o.err)
    assert lines[0] == "memguard: error: " + text, lines[0]
    return lines[0]


# --- hybrid MTP patterns: 100 depths of a 100,000-symbol pattern ran past 60 s -----------------------------------
def test_a_huge_legacy_mtp_pattern_is_refused_at_once():
    # validate_args (0.17.1 to 0.19.2) repeats --mtp-hybrid-override-pattern --mtp-num-layers times: 10**7 MTP layers
    o = run_memguard(["estimate", "--world-size", "8", "--", *HYBRID, "--hybrid-layer-pattern", "M*M-",
                      "--mtp-hybrid-override-pattern", "M" * 100_000, "--mtp-num-layers", "100"], cpu_limit=2.0)
    one_error(o, "--mtp-hybrid-override-pattern: has 100 MTP depth(s) of 100,000 layers; memguard's bound on the layer "
                 "count is 10,000 (10 x the deepest published Transformer (DeepNet, 1,000 layers))")


def test_a_huge_mtp_pattern_after_slashes_is_refused_at_once():
    o = run_memguard(["estimate", "--world-size", "8", "--", *HYBRID, "--hybrid-layer-pattern",
                      "M*M-" + ("/" + "M" * 999) * 20], cpu_limit=2.0)
    one_error(o, "--hybrid-layer-pattern: has 20 MTP depth(s) of 999 layers; memguard's bound on the layer count is "
                 "10,000 (10 x the deepest published Transformer (DeepNet, 1,000 layers))")
    # at the bound: estimated (10 depths of 999 MTP layers, 9,990 <= 10,000)
    o = run_memguard(["estimate", "--world-size", "8", "--", *HYBRID, "--hybrid-layer-pattern",
                      "M*M-" + ("/" + "M" * 999) * 10], cpu_limit=10.0)
    assert not o.problems and o.code in (0, 1), o.describe()


def test_a_huge_mtp_pattern_of_a_bridge_hybrid_recipe_is_refused():
    # Megatron-Bridge 0.6.2 HybridModelProvider.finalize builds the same unified pattern
    o = run_memguard(["estimate", "--model", "nemotronh_8b", "--gpus", "8", "--set",
                      "model.mtp_hybrid_override_pattern=" + "M" * 100_000, "--set", "model.mtp_num_layers=2"],
                     cpu_limit=2.0)
    one_error(o, "model.mtp_hybrid_override_pattern: has 2 MTP depth(s) of 100,000 layers; memguard's bound on the "
                 "layer count is 10,000 (10 x the deepest published Transformer (DeepNet, 1,000 layers))")


# --- Megatron-Bridge PEFT keys ------------------------------------------------------------------------------------
# a Bridge config file (a recipe's PEFT object takes only +peft.FIELD overrides: tests/test_bridge_real.py)
from test_readers_bridge import FLAT  # noqa: E402

LLAMA = ["estimate", "--json", "--config", "c.yaml", "--gpus", "8"]
BASE = ["estimate", "--config", "c.yaml", "--gpus", "8"]


def _run(argv):
    return run_memguard(argv, {"c.yaml": FLAT})


def _peft(o) -> dict:
    assert not o.problems and o.code in (0, 1), o.describe()
    return json.loads(o.out)["layout"]["peft"]


def test_fields_set_on_a_peft_scheme_name_are_read():
    # peft=lora is the recipe's peft_scheme (default_peft_config builds LoRA()); peft.dim=8 then sets that object's
    # dim (Hydra overrides on the built config). memguard dropped it: rank 32, Bridge's default
    assert _peft(_run([*LLAMA, "--set", "peft=lora"]))["dim"] == 32
    lora = _peft(_run([*LLAMA, "--set", "peft=lora", "--set", "peft.dim=8", "--set", "peft.alpha=16"]))
    assert (lora["scheme"], lora["dim"], lora["alpha"]) == ("lora", 8, 16)
    assert _peft(_run([*LLAMA, "--set", "peft=dora", "--set", "peft.dim=8"]))["dim"] == 8
    one_error(_run([*BASE, "--set", "peft=lora", "--set", "peft.dim=x"]), "peft.dim: must be an integer, got 'x'")
    one_error(_run([*BASE, "--set", "peft=lora", "--set", "peft.rank=8"]),
              "peft.rank: not a field of Megatron-Bridge's LoRA: Megatron-Bridge refuses this override")


@pytest.mark.parametrize("value", ["null", "''"])
def test_an_empty_peft_target_modules_is_refused(value):
    # Bridge 0.6.2 peft/module_matcher.py: 'len(self.target_modules or []) > 0' is false: every linear module is
    # wrapped (the output layer too); memguard estimated the four default linears
    one_error(_run([*BASE, "--set", "peft=lora", "--set", f"peft.target_modules={value}"]),
              "peft.target_modules: PEFT with an empty target_modules (Bridge then wraps every linear not excluded) is "
              "not modelled yet; memguard will not guess its memory")


def test_a_peft_target_modules_string_is_refused():
    # 'for pattern in self.target_modules' iterates the string's characters: no module matches
    one_error(_run([*BASE, "--set", "peft=lora", "--set", "peft.target_modules=linear_qkv"]),
              "peft.target_modules: must be a list of module names, got the string 'linear_qkv' (Megatron-Bridge's ModuleMatcher "
              "iterates its characters: no module matches) (peft.target_modules=[linear_qkv])")


# --- gigantic Megatron logs: memory bounded ------------------------------------------------------------------------
def _log(tmp_path, lines):
    from megatron_logs import args_of, print_args
    from fuzz_util import SMALL
    p = tmp_path / "run.log"
    p.write_text("\n".join(print_args(args_of(SMALL, 8)) + lines) + "\n")
    return str(p)


def test_a_rank_past_its_line_bound_keeps_its_peaks_and_last_lines(tmp_path, monkeypatch):
    # a --log-memory-interval 1 run of 10**6 iterations held 590 MB of lines in report (100 MB log); past the bound
    # a rank keeps the lines that raise a peak and its last steady and checkpoint lines
    from megatron_logs import report_memory

    import megatron_memguard.report.megatron_log as ml
    monkeypatch.setattr(ml, "MAX_LINES_PER_RANK", 10)
    lines = [report_memory(0, f"(after {i} iterations)", GiB + i * 2**20, 2 * GiB, 2 * GiB, 2 * GiB) for i in range(1, 101)]
    lines[50] = report_memory(0, "(after 51 iterations)", GiB, 3 * GiB, 2 * GiB, 2 * GiB)   # the peak, past the bound
    lines.insert(60, report_memory(0, "(before save_checkpoint for iteration 60)", GiB, 3 * GiB, 2 * GiB, 2 * GiB))
    log = ml.read_megatron_logs(_log(tmp_path, lines))
    kept = log.rank_lines(0)
    assert [m.iteration for m in kept] == list(range(1, 11)) + [51, 60, 100]
    assert max(m.max_allocated for m in kept) == 3 * GiB and kept[-1].allocated == GiB + 100 * 2**20
    assert any("more than 10 memory lines of a rank" in n for n in log.notes)


def test_memory_lines_of_ranks_past_the_bound_are_not_read(tmp_path, monkeypatch):
    # a log of 10**6 ranks' memory lines took 1.7 GB in report
    from megatron_logs import report_memory

    import megatron_memguard.report.megatron_log as ml
    monkeypatch.setattr(ml, "MAX_RANKS", 4)
    log = ml.read_megatron_logs(_log(tmp_path, [report_memory(r, "(after 10 iterations)", GiB, GiB, GiB, GiB)
                                                for r in range(10)]))
    assert log.ranks == [0, 1, 2, 3] and log.skipped_ranks == 6
    assert "memory lines of more than 4 ranks: those of further ranks are not read (first skipped: rank 4)" in log.notes
