"""Regressions of issue hostile4: the surfaces added since hostile3 (the per-release flag table and
--megatron-version, DDP's fp32 accumulation patterns, MoE fields of config.json and Bridge overrides, the
hook's namespace with odd types, Megatron logs' argument table, site profiles, plan --top). Each is the
smallest input that broke the promise (a hang, an internal error, a wrong value taken silently), with what
memguard does now: one error line naming the key and the rule, or an estimate equal to the plain input's."""
from __future__ import annotations

import copy
import fractions
import json
import os

import pytest

from benchmarks.shared_data import CONFIGS
from fuzz_util import SMALL, run_memguard
from megatron_memguard.estimator.ddp_extras import fp32_local_accumulation_numel
from megatron_memguard.readers.megatron_flags import parse_megatron_flags
from megatron_memguard.resolve import resolve

HERE = os.path.dirname(os.path.abspath(__file__))
PATTERNS = "--ddp-param-name-patterns-for-fp32-local-accumulation"
BF16_GRADS = [*SMALL, "--grad-reduce-in-bf16"]      # (the patterns need 16-bit gradients)


def one_error(o, *needles: str) -> str:
    assert not o.problems, o.describe()
    lines = [line for line in o.err.splitlines() if line.strip()]
    assert o.code == 2 and len(lines) == 1 and lines[0].startswith("memguard"), o.err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _set(argv: list[str], flag: str, value: str) -> list[str]:
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


# --- DDP's fp32 local accumulation patterns ----------------------------------------------------------------
@pytest.mark.parametrize("patterns, needle", [
    ([f"*x{i}*" for i in range(100_000)], "got 100,000 of up to 8"),      # ran for minutes: every name x pattern
    (["[" * 100_000 + "a"], "got 1 of up to 100,001"),                     # fnmatch's translation is quadratic in '['
])
def test_fp32_patterns_are_bounded(patterns, needle):
    o = run_memguard(["estimate", "--world-size", "8", "--", *BF16_GRADS, PATTERNS, *patterns], cpu_limit=3.0)
    one_error(o, f"{PATTERNS}: takes at most 100 patterns of at most 200 characters", needle)


def test_fp32_patterns_that_tell_layers_apart_are_bounded_by_the_names_they_test():
    # 10,000 layers x 12 names x 100 patterns with digits: 12 s of fnmatch; now refused before testing
    argv = _set(_set(BF16_GRADS, "--num-layers", "10000"), "--pipeline-model-parallel-size", "1")
    o = run_memguard(["estimate", "--world-size", "8", "--", *argv, PATTERNS, *[f"*x{i}*" for i in range(100)]],
                     cpu_limit=3.0)
    one_error(o, f"{PATTERNS}: 100 patterns, with digits, '?' or '['", "make 12,000,000 tests; memguard accepts at most "
              "1,000,000")


def _layout(*extra: str):
    return resolve(parse_megatron_flags([*BF16_GRADS, *extra]), world_size=8)


def test_fp32_patterns_by_hand():
    # SMALL: 4 layers on PP 2, hidden 256, FFN 4 x 256 = 1024 (no SwiGLU), TP 2: linear_fc1's weight on one
    # rank is 1024 / 2 x 256 = 131,072 elements; '*layers.1.mlp.linear_fc1.weight' names local layer 1 of each
    # stage (DDP's names count layers within the chunk), so one weight per stage
    L = _layout(PATTERNS, "*layers.1.mlp.linear_fc1.weight")
    assert [fp32_local_accumulation_numel(L, pp) for pp in (0, 1)] == [131_072, 131_072]
    # without digits the pattern is tested once per layer kind: both layers of each stage
    L = _layout(PATTERNS, "*mlp.linear_fc?.weight")
    fc2 = 256 * 1024 // 2
    assert [fp32_local_accumulation_numel(L, pp) for pp in (0, 1)] == [2 * (131_072 + fc2)] * 2
    # the word embedding (vocab 1000 padded to a multiple of 128 x TP 2 = 1024, 512 rows per rank) on stage 0 only
    L = _layout(PATTERNS, "*word_embeddings*")
    assert [fp32_local_accumulation_numel(L, pp) for pp in (0, 1)] == [512 * 256, 0]


# --- --megatron-version -------------------------------------------------------------------------------------
MOE = [*SMALL, "--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--sequence-parallel",
       "--disable-bias-linear", "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]


def _estimate_json(version: str, flags=MOE):
    o = run_memguard(["estimate", "--json", "--world-size", "8", "--megatron-version", version, "--", *flags])
    assert not o.problems and o.code in (0, 1), o.describe()
    return json.loads(o.out)


def test_a_prerelease_has_its_releases_rules():
    # packaging orders 0.18.0rc0 before 0.18, so the sections comparing Versions read it as 0.17 and those comparing
    # (major, minor) as 0.18. NullTokenizer counts one extra EOD token before core 0.18 (Megatron commit c9dfe34798):
    # vocabulary 1024 pads to a multiple of 128 x TP 2 = 256 as 1024 from 0.18 and as 1025 -> 1280 before
    flags = _set(SMALL, "--vocab-size", "1024")
    padded = {v: _estimate_json(v, flags)["layout"]["padded_vocab_size"]
              for v in ("0.17", "0.18.0rc0", "0.18", "0.18.1.dev0+g1234", "0.18.2.post1")}
    assert padded == {"0.17": 1280, "0.18.0rc0": 1024, "0.18": 1024, "0.18.1.dev0+g1234": 1024, "0.18.2.post1": 1024}


@pytest.mark.parametrize("version, needle", [("1!0.16", "no megatron-core release has an epoch"),
                                             ("", "cannot read Megatron version ''")])
def test_versions_that_name_no_release(version, needle):
    o = run_memguard(["estimate", "--world-size", "8", "--megatron-version", version, "--", *SMALL])
    one_error(o, "--megatron-version: ", needle)


def test_versions_outside_the_releases_read_say_whose_rules_apply():
    for version, rules in (("0.15", "0.16"), ("0.20.1", "0.19")):
        notes = _estimate_json(version, SMALL)["notes"]
        assert any(f"its rules and defaults are {rules}'s" in n for n in notes), notes


# --- Hugging Face config.json and Bridge overrides ------------------------------------------------------------
def _hf(name: str, **changes) -> str:
    with open(os.path.join(HERE, "data", "hf", name), encoding="utf-8") as f:
        doc = json.load(f)
    doc.update(changes)
    return json.dumps(doc)


@pytest.mark.parametrize("name, key", [("mixtral-8x7b.json", "num_experts_per_tok"), ("qwen3-30b-a3b.json", "moe_intermediate_size"),
                                       ("deepseek-v3.json", "kv_lora_rank"), ("deepseek-v3.json", "q_lora_rank")])
def test_a_json_object_where_config_json_holds_a_number(name, key):
    # the readers skip a mapping (a NeMo / Bridge object spec): top-k 2 and Qwen3's expert width 6144 were taken
    # from the defaults, DeepSeek-V3's q_lora_rank {} meant no query LoRA (+7.8 B parameters), all silently
    o = run_memguard(["estimate", "--model", "config.json", "--world-size", "64", "--", "--micro-batch-size", "1",
                      "--seq-length", "4096", "--global-batch-size", "64"], {"config.json": _hf(name, **{key: {"a": 1}})})
    one_error(o, f"{key}: expects a number, got a JSON object")


def test_qwen_moe_errors_name_num_experts():
    # the error named Mixtral's key, num_local_experts, which a Qwen config.json does not have
    o = run_memguard(["estimate", "--model", "config.json", "--world-size", "64", "--", "--micro-batch-size", "1",
                      "--seq-length", "4096", "--global-batch-size", "64"], {"config.json": _hf("qwen3-30b-a3b.json",
                                                                                                num_experts=10**9)})
    assert not o.problems and o.code == 2, o.describe()
    assert o.err.startswith("memguard: error: num_experts: must be <= 65536"), o.err


@pytest.mark.parametrize("override, needle", [
    ("model.moe_layer_freq={a: 1}", "model.moe_layer_freq: expects an int or a list expression"),    # was estimated
    ("model.moe_latent_size={}", "model.moe_latent_size: must be a single value, got {}"),            # was estimated
    ("model=1", "model: is the model section; it takes model.FIELD=VALUE overrides, not the value 1"),  # --num-layers...
    ("model.num_layers.x=4", "model.num_layers (recipe qwen3_30b_a3b): must be an integer, got {'x': 4}"),
])
def test_bridge_overrides_of_the_wrong_kind(override, needle):
    o = run_memguard(["estimate", "--model", "qwen3_30b_a3b", "--gpus", "64", "--set",
                      "model.moe_flex_dispatcher_backend=deepep", "--set", override])
    assert not o.problems and o.code == 2, o.describe()
    assert needle in o.err.splitlines()[0], o.err


@pytest.mark.parametrize("override, dest, on", [
    ("model.share_embeddings_and_output_weights=maybe", "untie_embeddings_and_output_weights", False),
    ("model.bias_activation_fusion=maybe", "bias_activation_fusion", True),
    ("model.moe_grouped_gemm={a: 1}", "moe_grouped_gemm", True),
])
def test_bridge_model_flags_of_another_kind_take_their_truth(override, dest, on):
    # hostile-releases made these errors; Megatron-Bridge 0.6.2 sets the value on the provider unchecked and its code
    # tests the value's truth (issue bridge17; tests/test_bridge_real.py holds it against the real Bridge): 'maybe' and
    # a mapping are on, with a warning naming the key
    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge
    from megatron_memguard.resolve import resolve

    raw = read_bridge({}, "recipe qwen3_30b_a3b", parse_overrides(["model.moe_flex_dispatcher_backend=deepep", override]),
                      recipe="qwen3_30b_a3b")
    L = resolve(raw, world_size=64)
    got = L.moe.moe_grouped_gemm if dest == "moe_grouped_gemm" else getattr(L, dest)
    assert got is on
    key = override.split("=")[0]
    assert any(w.startswith(f"{key}: ") and "Megatron-Bridge 0.6.2 sets it unchecked" in w for w in raw.warnings)


def test_a_key_below_a_value_in_a_nemo_override():
    # the value was replaced by a section holding the key: the model's layer count was dropped
    path = os.path.join(CONFIGS, "nemo1", "megatron_llama_config.yaml")
    if not os.path.exists(path):
        pytest.skip("needs ../shared/configs")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    o = run_memguard(["validate", "c.yaml", "trainer.devices=8", "model.num_layers.x=4"], {"c.yaml": text})
    one_error(o, "model.num_layers.x: model.num_layers is the value 32, not a section with keys")


def test_run_recipe_with_an_empty_recipe_name():
    # the error asked for '--mode pretrain after --model None'
    o = run_memguard(["check", "--", "torchrun", "--nproc-per-node", "8", "scripts/training/run_recipe.py", "--recipe", ""])
    assert not o.problems and o.code == 2, o.describe()
    assert "--recipe: run_recipe.py needs a name, got ''" in o.err


# --- the Megatron hook ---------------------------------------------------------------------------------------
def _moe_namespace(**changes):
    from mutate_util import hook_namespaces
    ns = copy.deepcopy(hook_namespaces()["legacy 0.16"])
    for k, v in {**dict(num_experts=8, moe_router_topk=2, expert_model_parallel_size=2, sequence_parallel=True,
                        add_bias_linear=False, moe_token_dispatcher_type="alltoall"), **changes}.items():
        setattr(ns, k, v)
    return ns


@pytest.mark.parametrize("field, value", [("expert_model_parallel_size", fractions.Fraction(1, 2)),
                                          ("expert_tensor_parallel_size", 0.5)])
def test_hook_expert_sizes_that_are_no_whole_number(field, value):
    # int(0.5) = 0: the expert-grid check divided by zero, an internal error instead of the key's own
    from mutate_util import run_hook
    o = run_hook(_moe_namespace(**{field: value}))
    assert o.problems(mutated_settings=False) == [] and o.carried_on and o.action == "unsupported", o
    assert f"--{field.replace('_', '-')}: must be an integer" in o.emitted[0]


def test_hook_switch_holding_an_array():
    # bool() of a NumPy array raises: an internal error; now refused by key and training goes on
    np = pytest.importorskip("numpy")
    from mutate_util import run_hook
    o = run_hook(_moe_namespace(moe_grouped_gemm=np.array([1, 2])))
    assert o.problems(mutated_settings=False) == [] and o.carried_on and o.action == "unsupported", o
    assert "--moe-grouped-gemm: must be true or false, got array([1, 2])" in o.emitted[0]


# --- Megatron logs, site profiles, plan ------------------------------------------------------------------------
@pytest.mark.parametrize("line", ["a . " + " " * 65_000 + "b", " " * 65_000 + "x", "-" * 65_000 + " arguments --"])
def test_argument_table_lines_are_read_in_linear_time(line):
    # '(.*?)\s*$', '^\s*...\s+' and '-{8,} arguments' were quadratic: 10 such 64 KiB lines ran for minutes
    from fuzz_util import MEGATRON_LOG
    head = "------------------------ arguments ------------------------\n"
    o = run_memguard(["report", "train.log"], {"train.log": head + (line + "\n") * 10 + MEGATRON_LOG}, cpu_limit=2.0)
    assert not o.problems and o.code in (1, 2), o.describe()


def test_site_profile_version_that_is_no_version():
    # 5000 digits did not convert and were read as 'not newer'
    text = "schema: memguard.site/1\nmemguard_version: '" + "9" * 5000 + "'\nconstants: {}\n"
    o = run_memguard(["estimate", "--site-profile", "s.yaml", "--world-size", "8", "--", *SMALL], {"s.yaml": text})
    one_error(o, "--site-profile s.yaml: memguard_version: cannot read version")


def test_plan_top_is_bounded():
    # --top 10**9 estimated every candidate of the space in full (minutes)
    o = run_memguard(["plan", "--gpus", "64", "--seq-length", "4096", "--global-batch-size", "256", "--model",
                      "mixtral-8x7b", "--top", "1000000000"], cpu_limit=2.0)
    one_error(o, "--top: must be from 1 to 50", "got 1,000,000,000")
