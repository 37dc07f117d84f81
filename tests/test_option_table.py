"""Every option of Megatron's argument parser is modelled, refused by name, or memory-neutral with a reason.

The option table is megatron-core 0.19.2's ``megatron/training/arguments.py`` (``add_megatron_arguments``):
read off the real parser where it is installed (Python 3.12, tests/run.sh), and from the copy memguard ships
in data/megatron_flags.json everywhere else (the real-parser test checks the copy is complete).

* modelled: ``resolve`` reads the dest (a string constant in its source outside the refusal table);
* refused by name: a row of resolve's not-modelled table (or its named-note table);
* memory-neutral: data/memory_neutral_flags.json, ``neutral`` (dest -> why it changes no GPU memory) or
  ``gated`` (dest -> the switch it only acts with; that switch must itself be refused, checked by running
  resolve with it).

A new Megatron option that is none of these fails here: decide what it does to memory.
"""
from __future__ import annotations

import ast
import json
from functools import lru_cache
from pathlib import Path

import pytest

from conftest import container_era

from megatron_memguard.config import RawConfig
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.resolve import resolve

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "megatron_memguard"
TABLE = json.loads((PKG / "data" / "memory_neutral_flags.json").read_text())
REFUSAL_TABLES = ("_NOT_MODELLED", "_WARN_ONLY")


def _stored_dests() -> set[str]:
    flags = json.loads((PKG / "data" / "megatron_flags.json").read_text())["flags"]
    return {v[0] for v in flags.values()}


def _resolve_sources() -> list[Path]:
    package = PKG / "resolve"
    return sorted(package.glob("*.py")) if package.is_dir() else [PKG / "resolve.py"]


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


@lru_cache(maxsize=1)
def _read_and_refused() -> tuple[frozenset[str], frozenset[str]]:
    """(dests resolve reads, dests resolve refuses or names in a note), from its source."""
    read: set[str] = set()
    refused: set[str] = set()
    for path in _resolve_sources():
        tree = ast.parse(path.read_text())
        if path.name == "refusals.py":
            refused |= _strings(tree)
            continue
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id in REFUSAL_TABLES for t in targets):
                refused |= _strings(node)
            else:
                read |= _strings(node)
    return frozenset(read), frozenset(refused)


def _unclassified(dests: set[str]) -> list[str]:
    read, refused = _read_and_refused()
    known = read | refused | set(TABLE["neutral"]) | set(TABLE["gated"])
    return sorted(dests - known)


def test_every_option_of_the_stored_table_is_decided():
    missing = _unclassified(_stored_dests())
    assert not missing, ("Megatron options that memguard neither reads, refuses, nor lists as memory-neutral "
                         f"(data/memory_neutral_flags.json): {missing}")


def test_entries_are_options_and_have_reasons():
    dests = _stored_dests()
    for section in ("neutral", "gated"):
        stale = sorted(set(TABLE[section]) - dests)
        assert not stale, f"{section}: not options of Megatron 0.19.2: {stale}"
    assert all(len(why) > 20 for why in TABLE["neutral"].values())
    assert all(len(v["why"]) > 20 and v["when"] for v in TABLE["gated"].values())


def test_neutral_entries_are_not_refused():
    # a refused option is not memory-neutral (one read for a rule check may be: --check-for-nan-in-loss-and-grad)
    _, refused = _read_and_refused()
    both = sorted(set(TABLE["neutral"]) & refused)
    assert not both, f"listed as memory-neutral but refused by resolve: {both}"


# A small valid dense job (TP 2 with SP, 8 GPUs) to switch each gate on; no linear biases, so that the MoE
# gates keep ETP = TP = 2 legal (TransformerConfig: biases in MoE layers need ETP 1).
BASE = dict(add_bias_linear=False, num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128, max_position_embeddings=128,
            micro_batch_size=1, global_batch_size=8, tensor_model_parallel_size=2, sequence_parallel=True,
            bf16=True, tokenizer_type="NullTokenizer", vocab_size=1000, position_embedding_type="rope")


def _gate_outcome(gate: dict) -> str:
    """'refused', 'named' (a note names it), or 'accepted' (memguard models the gate now)."""
    # Megatron-FSDP wants the fsdp_dtensor checkpoint format (core 0.19.2 validate_args)
    need = {"ckpt_format": "fsdp_dtensor"} if gate.get("use_megatron_fsdp") else {}
    if gate.get("hybrid_layer_pattern") or gate.get("hybrid_override_pattern"):
        # MambaMixer's asserts on the base job's hidden size 64 (heads 2 x 64 / 32 = 4, groups 2, TP 2)
        need = {"mamba_head_dim": 32, "mamba_num_groups": 2}
    if gate.get("experimental_attention_variant") == "dsa":
        # DSA sits on MLA and needs its indexer's shape and unfused rope (resolve/dsa.py)
        need = {"multi_latent_attention": True, "dsa_indexer_n_heads": 2, "dsa_indexer_head_dim": 64,
                "dsa_indexer_topk": 16, "apply_rope_fusion": False}
    if gate.get("moe_paged_stash"):
        # TransformerConfig (core 0.19.2): the stash needs a per-rank expert capacity (resolve/moe.py)
        need = {"moe_expert_rank_capacity_factor": 1.5}
    raw = RawConfig(args={**BASE, **need, **gate}, world_size=8)
    # upcycling starts only in megatron/training 0.16 (0.17 to 0.19 raise a TypeError at start-up: resolve/moe.py)
    version = "0.16" if gate.get("moe_use_upcycling") else None
    try:
        layout = resolve(raw, megatron_version=version)
    except NotModelledError:
        return "refused"
    except (ConfigError, ConfigErrors) as e:
        if any(isinstance(x, NotModelledError) for x in getattr(e, "errors", [e])):
            return "refused"
        raise AssertionError(f"the gate {gate} does not resolve on the base job: {e}") from None
    flag = "--" + next(iter(gate)).replace("_", "-")
    return "named" if any(flag in n for n in layout.notes) else "accepted"


def test_gated_options_wait_behind_a_refused_switch():
    read, refused = _read_and_refused()
    gates: dict[str, tuple[dict, list[str]]] = {}
    for dest, entry in TABLE["gated"].items():
        key = json.dumps(entry["when"], sort_keys=True)
        gates.setdefault(key, (entry["when"], []))[1].append(dest)
    silently_ignored = {}
    for gate, dests in gates.values():
        if _gate_outcome(gate) == "accepted":
            # the feature is modelled now: each of its options must be read, refused by name, or moved to
            # "neutral" with a reason
            left = sorted(d for d in dests if d not in read | refused)
            if left:
                silently_ignored[json.dumps(gate)] = left
    assert not silently_ignored, f"modelled features whose options memguard does not read: {silently_ignored}"


# Options the walk found changing memory with nothing modelling them (issue 17): refused, or estimated with a note.
WALK_REFUSED = {"hybrid_context_parallel": True,
                "spec": ["local"], "yaml_cfg": "run.yaml", "logits_load_dir": "/x",
                "te_precision_config_file": "p.yaml"}
WALK_NOTED = {"clone_scatter_output_in_embedding": False, "disable_jit_fuser": True, "create_all_gather_group": True,
              "ddp_num_buckets": 4}


@pytest.mark.parametrize("dest, value", sorted(WALK_REFUSED.items()))
def test_walk_findings_are_refused(dest, value):
    assert _gate_outcome({dest: value}) == "refused"


@pytest.mark.parametrize("dest, value", sorted(WALK_NOTED.items()))
def test_walk_findings_are_named_in_a_note(dest, value):
    assert _gate_outcome({dest: value}) == "named"


# Options of an older release's parser that 0.19.2's (the stored table) no longer has, with the switch they act
# under (megatron-core 0.18.2 arguments.py: the RL rollout batching, resolved in validate_args only with
# --perform-rl-step, which memguard refuses)
_RL = {"perform_rl_step": True}
DROPPED_SINCE = {(0, 18): {"rl_generation_batch_size": _RL, "rl_num_parallel_generation_batches": _RL,
                           "rl_num_parallel_generations": _RL, "rl_parallel_generation_tasks": _RL}}


def _installed_minor() -> tuple[int, int] | None:
    from conftest import megatron_core_version
    v = megatron_core_version()
    return tuple(v[:2]) if v else None


def _megatron_parser(monkeypatch):
    """megatron/training's own argument parser (the installed release's add_megatron_arguments)."""
    import argparse
    import warnings

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")   # (restored after: later tests read the environment)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training.arguments import add_megatron_arguments
        return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


@pytest.mark.megatron_training
@pytest.mark.skipif(not container_era(), reason="needs Python 3.12 with megatron-core >= 0.18 (megatron.training); "
                    "tests/run.sh runs these in .venv312")
def test_the_real_parser(monkeypatch):
    parser = _megatron_parser(monkeypatch)
    # (memguard's own --memguard* options are there when the hook was imported earlier in the session)
    dests = {a.dest for a in parser._actions if a.dest != "help" and not a.dest.startswith("memguard")}
    # the stored copy memguard's readers use is this parser's table (extensions such as kitchen add
    # options only when installed)
    dropped = DROPPED_SINCE.get(_installed_minor(), {})
    assert not sorted(dests - _stored_dests() - {d for d in dests if d.startswith("kitchen")} - set(dropped))
    for dest, gate in dropped.items():   # what an older parser has besides 0.19.2's table waits behind a refusal
        assert dest in dests and _gate_outcome(gate) == "refused", dest
    missing = _unclassified(dests - set(dropped))
    assert not missing, f"Megatron options memguard neither reads, refuses, nor lists as memory-neutral: {missing}"


@pytest.mark.megatron_training
@pytest.mark.skipif(not container_era(), reason="needs Python 3.12 with megatron-core >= 0.18 (megatron.training); "
                    "tests/run.sh runs these in .venv312")
def test_every_optimizer_choice_is_modelled(monkeypatch):
    # arguments.py --optimizer choices (0.19.2: adam, sgd, muon, dist_muon, lion, soap, adaptive_muon)
    import argparse
    import warnings

    from megatron_memguard.resolve.refusals import OPTIMIZERS

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")   # (restored after: later tests read the environment)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training.arguments import add_megatron_arguments
        parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    choices = next(a.choices for a in parser._actions if a.dest == "optimizer")
    assert set(choices) == set(OPTIMIZERS)


@pytest.mark.megatron_training
@pytest.mark.skipif(not container_era(), reason="needs Python 3.12 with megatron-core >= 0.18 (megatron.training); "
                    "tests/run.sh runs these in .venv312")
def test_memory_flag_choices_are_megatrons(monkeypatch):
    # the choices memguard's flag reader enforces for the flags of memory features are those of Megatron's own parser
    from megatron_memguard.readers.megatron_flags import _CHOICES

    parser = _megatron_parser(monkeypatch)
    from importlib.metadata import version
    real = {s: a.choices for a in parser._actions for s in a.option_strings if a.choices}
    # memguard's table is the newest release's (0.19.2); an older one (0.18.2 in tests/run_releases.sh) offers a
    # subset of its choices (e.g. no ncclep backend, no quantile_balancing), whose extras its parser refuses itself
    newest = version("megatron-core").startswith("0.19.")
    differ = {flag: (sorted(mine), sorted(real.get(flag) or ())) for flag, mine in _CHOICES.items()
              if (set(mine) != set(real.get(flag) or ()) if newest else not set(real.get(flag) or ()) <= set(mine))}
    assert not differ, differ
    # every flag of the table has choices in Megatron's parser; an older release may lack a newer flag altogether
    # (--dsa-kernel-backend came in 0.19: megatron_flag_releases.json), which its parser then refuses
    present = {s for a in parser._actions for s in a.option_strings}
    missing = [flag for flag in _CHOICES if not real.get(flag) and (newest or flag in present)]
    assert not missing, missing
