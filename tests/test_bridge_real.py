"""memguard against the real Megatron-Bridge 0.6.2 (tests/run_bridge.sh installs it with its pure-Python
dependencies into .venv312-bridge and runs this file; elsewhere it skips).

Real: Bridge's recipe functions (megatron.bridge.recipes), ConfigContainer, Hydra override processing
(training/utils/omegaconf_utils.py), CallbackManager / CallbackContext, and its scripts/training/run_recipe.py
and recipe_runner.py of v0.6.0 and main, run from ../shared/reference/megatron-bridge-scripts (read there, not
copied). Stood in (tests/bridge_real/): transformer_engine (needs a GPU to install: placeholders so that
Bridge's modules import), run_recipe's forward-step loader (the training step, which does not shape the
config), the two helper modules the scripts import from Bridge's repository
(recipe_metadata, benchmark_parallelism: library recipes only), and the Hugging Face hub: each recipe reads its
model's config.json, written here from memguard's presets (the published config.json values), offline."""
import functools
import importlib.util
import json
import os
import sys

import pytest

from benchmarks.shared_data import BRIDGE_SCRIPTS

HERE = os.path.dirname(os.path.abspath(__file__))
STANDINS = os.path.join(HERE, "bridge_real")

pytestmark = [
    pytest.mark.bridge,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.bridge") is None,
                       reason="needs Megatron-Bridge 0.6.2 (tests/run_bridge.sh)"),
]
WORLD = 16


def _hf_cache(root: str) -> None:
    """config.json of each model a memguard recipe uses, where huggingface_hub looks for it offline: the
    published file itself where tests/data/hf has it (the MoE models), else memguard's preset fields. Also
    under the revision a recipe pins (Qwen3-30B-A3B, Qwen3-8B)."""
    from megatron_memguard.readers.models import model_hf, presets

    for r in presets()["recipes"].values():
        if not r.get("model"):   # a recipe that builds its provider itself (OLMoE) reads no config.json
            continue
        m = presets()["models"][r["model"]]
        whole = os.path.join(HERE, "data", "hf", r["model"] + ".json")
        if os.path.exists(whole):
            with open(whole) as f:
                doc = json.load(f)
        else:
            hf = model_hf(r["model"])
            doc = {**hf, "architectures": [ARCHITECTURES[hf["model_type"]]], "torch_dtype": "bfloat16"}
        for repo in (a for a in m["aliases"] if "/" in a):   # (Llama 3.1: the recipes spell it Meta-Llama-3.1)
            base = os.path.join(root, "hub", "models--" + repo.replace("/", "--"))
            for rev in ("0", *PINNED_REVISIONS.get(repo, ())):
                snap = os.path.join(base, "snapshots", rev)
                os.makedirs(snap, exist_ok=True)
                with open(os.path.join(snap, "config.json"), "w") as f:
                    json.dump(doc, f)
            os.makedirs(os.path.join(base, "refs"), exist_ok=True)
            with open(os.path.join(base, "refs", "main"), "w") as f:
                f.write("0")


    # the Gemma 2 recipes (model: null, the provider bundled) read google/gemma-2-*'s config.json
    for repo, doc in GEMMA2_HF.items():
        base = os.path.join(root, "hub", "models--" + repo.replace("/", "--"))
        os.makedirs(os.path.join(base, "snapshots", "0"), exist_ok=True)
        with open(os.path.join(base, "snapshots", "0", "config.json"), "w") as f:
            json.dump(doc, f)
        os.makedirs(os.path.join(base, "refs"), exist_ok=True)
        with open(os.path.join(base, "refs", "main"), "w") as f:
            f.write("0")


def _gemma2_hf(layers: int, hidden: int, ffn: int, heads: int, groups: int, head_dim: int, scalar: int) -> dict:
    """google/gemma-2-*'s published config.json (Gemma2ForCausalLM, transformers' Gemma2Config keys)."""
    return {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "torch_dtype": "float32",
            "num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": ffn, "num_attention_heads": heads,
            "num_key_value_heads": groups, "head_dim": head_dim, "query_pre_attn_scalar": scalar, "vocab_size": 256000,
            "max_position_embeddings": 8192, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "initializer_range": 0.02,
            "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh", "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1}


GEMMA2_HF = {"google/gemma-2-2b": _gemma2_hf(26, 2304, 9216, 8, 4, 256, 256),
             "google/gemma-2-9b": _gemma2_hf(42, 3584, 14336, 16, 8, 256, 256),
             "google/gemma-2-27b": _gemma2_hf(46, 4608, 36864, 32, 16, 128, 144)}


# revisions recipes pass to AutoBridge.from_hf_pretrained (recipes/qwen/h100/qwen3_moe.py, qwen3.py)
PINNED_REVISIONS = {"Qwen/Qwen3-30B-A3B": ("ad44e777bcd18fa416d9da3bd8f70d33ebb85d39",),
                    "Qwen/Qwen3-8B": ("b968826d9c46dd6066d109eabc6255188de91218",)}
# the `architectures` of each family's published config.json (AutoBridge picks the model bridge by it)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM"}


@pytest.fixture(scope="module")
def recipes(tmp_path_factory, request):
    home = str(tmp_path_factory.mktemp("memguard-hf"))   # (pytest's own tmp tree: removed with its old runs)
    _hf_cache(home)
    with pytest.MonkeyPatch.context() as mp:   # (restored after the module)
        for k, v in (("HF_HOME", home), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")):
            mp.setenv(k, v)
        if any(getattr(item, "originalname", None) in PEFT_SCRIPT_TESTS for item in request.session.items):
            # the PEFT scripts' fork server imports Bridge on the other core while this process does (the
            # server's key has these HF_* values, as the scripts' requests will)
            import build_util
            build_util.start_server(sys.executable, _peft_env(), **PEFT_SERVER)
        for p in (os.path.join(STANDINS, "te_standin"), os.path.join(STANDINS, "scripts_standin")):
            if p not in sys.path:
                sys.path.insert(0, p)
        import megatron.bridge.recipes as r
        yield r


@pytest.fixture(autouse=True)
def _environ_kept():
    """Each test leaves os.environ as it found it: Bridge's apply_environment_variables and runtime_config_update
    set a recipe's env_vars in it directly, past monkeypatch (a variable absent before is not restored by its
    delenv), and a later test's processes would start with them (and the PEFT scripts' fork server key change)."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


def fields(L):
    return {k: v for k, v in L.to_dict().items() if k not in ("notes", "env")}


def recipe_functions():
    from megatron_memguard.readers.models import presets
    return [(key, fn) for key, r in presets()["recipes"].items() for fn in r["functions"]]


# --------------------------------------------------------------------------------------------------
# memguard's recipe table against Bridge's recipe functions; no notes for fields that exist (issue 20, item 5)
# --------------------------------------------------------------------------------------------------
def world_of(key):
    """The recipe's own GPU count (its function name's), else the dense recipes' 16 (8 for the PEFT recipes, whose
    global batch is 8)."""
    from megatron_memguard.readers.models import recipe_gpus
    if key.endswith("_peft"):
        return 8
    return recipe_gpus(key) if recipe_gpus(key) and recipe_gpus(key) > 2 else WORLD


def resolved(raw, world):
    """The Layout, or the refusal (its message without the key path, which names the source)."""
    from megatron_memguard.errors import NotModelledError
    from megatron_memguard.resolve import resolve

    try:
        return fields(resolve(raw, world_size=world))
    except NotModelledError as e:
        return ("not modelled", str(e).split(": ", 1)[1])


@pytest.mark.parametrize("key, function", recipe_functions())
def test_memguards_recipes_are_bridges(recipes, key, function):
    from megatron_memguard.bridge import raw_config
    from megatron_memguard.config import memory_env
    from megatron_memguard.readers.models import read_model

    cfg = getattr(recipes, function)()
    raw = raw_config(cfg)
    assert [w for w in raw.warnings if "not a megatron-core" in w or "not a Megatron-Bridge" in w] == []
    world = world_of(key)
    real, ours = resolved(raw, world), resolved(read_model(key), world)
    assert real == ours
    # the deprecated cuda_graph_scope the recipe function sets ('full' in most H100 recipes): no memory of its own,
    # but with it TransformerConfig asserts cuda_graph_modules empty, which memguard checks on an override
    assert raw.args.get("cuda_graph_scope") == read_model(key).args.get("cuda_graph_scope")
    # the recipe's env_vars (training/config.py apply_environment_variables), the memory-relevant ones
    assert raw.env == read_model(key).env == memory_env({k: str(v) for k, v in cfg.env_vars.items()})
    # no comm_overlap section in memguard's table only where the recipe leaves it None (read_bridge refuses an
    # override that would make one: Bridge cannot start with it)
    from megatron_memguard.readers.models import presets
    if "comm_overlap" not in presets()["recipes"][key].get("config", {}):
        assert cfg.comm_overlap is None
    if isinstance(real, tuple):
        # refused by a dispatcher memguard does not model yet (HybridEP, DeepEP across nodes): the rest of the
        # recipe must still be Bridge's, so compare both with the alltoall dispatcher
        from megatron_memguard.readers._common import parse_overrides
        from megatron_memguard.readers.bridge import read_bridge

        cfg.model.moe_token_dispatcher_type = "alltoall"
        ours_raw = read_bridge({}, f"recipe {key}", parse_overrides(["model.moe_token_dispatcher_type=alltoall"]),
                               recipe=key)
        real, ours = resolved(raw_config(cfg), world), resolved(ours_raw, world)
        assert not isinstance(real, tuple) and real == ours


# --------------------------------------------------------------------------------------------------
# run_recipe.py itself (v0.6.0 and main) against memguard check's reading of the same command line
# --------------------------------------------------------------------------------------------------
def run_recipe_main(version: str, argv: list[str], monkeypatch):
    """The ConfigContainer run_recipe.py's main() hands to run_config (which would train), or its exception."""
    sdir = os.path.join(BRIDGE_SCRIPTS, version)
    for m in ("recipe_runner", "run_recipe"):
        monkeypatch.delitem(sys.modules, m, raising=False)
    monkeypatch.syspath_prepend(sdir)
    spec = importlib.util.spec_from_file_location("run_recipe", os.path.join(sdir, "run_recipe.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    captured = {}
    monkeypatch.setattr(mod, "run_config", lambda **kw: captured.update(kw))
    # the forward-step function (gpt_step imports modelopt's Transformer Engine plugins): no part of the config
    monkeypatch.setattr(mod, "load_forward_step", lambda name, mode=None: name)
    cwd, env = os.getcwd(), dict(os.environ)
    try:
        mod.main(argv)
    finally:  # main() changes directory and applies the recipe's environment variables
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
    return captured["config"]


LAUNCHES = [
    ["--recipe", "llama3_8b_pretrain_config"],
    ["--model", "llama3_8b", "--mode", "pretrain", "--micro_batch_size", "2", "-tp", "2", "model.sequence_parallel=true"],
    ["--recipe", "llama32_1b_pretrain_config", "-sl", "4096", "-gb", "128", "train.global_batch_size=256"],
    ["--recipe", "llama3_8b_pretrain_config", "model.seq_length=4096"],
    ["--recipe", "llama32_3b_pretrain_1gpu_h100_bf16_config", "--dataset", "mock", "-sl", "2048", "--deterministic"],
    ["--recipe", "llama3_8b_pretrain_config", "-pp", "2", "-cp", "1", "-mb", "2", "train.micro_batch_size=4"],
    # mixture of experts (issue 16)
    ["--recipe", "qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config", "-ep", "8", "model.moe_router_dtype=fp32"],
    ["--model", "deepseek_v2_lite", "--mode", "pretrain", "-mb", "2", "-sl", "2048",
     "model.moe_grouped_gemm=false"],
    ["--recipe", "olmoe_7b_pretrain_config", "-tp", "2", "model.sequence_parallel=true", "-ep", "4"],
    # the dense recipes read from Bridge 0.6.2
    ["--recipe", "qwen3_8b_pretrain_config", "-tp", "2", "train.global_batch_size=256"],
    ["--model", "qwen25_7b", "--mode", "pretrain", "-mb", "2", "-sl", "2048"],
    ["--recipe", "llama3_70b_pretrain_deterministic_config", "-pp", "2", "-vp", "5", "-sl", "4096"],
    ["--recipe", "llama31_405b_pretrain_config", "-tp", "8", "-pp", "2", "-vp", "7", "-cp", "1", "-sl", "8192",
     "model.account_for_embedding_in_pipeline_split=false", "model.account_for_loss_in_pipeline_split=false"],
    ["--recipe", "llama3_8b_low_precision_pretrain_config", "-mb", "2"],
    # Gemma 3 (the recipe's own Gemma3ModelProvider)
    ["--recipe", "gemma3_1b_pretrain_config", "-sl", "8192", "-mb", "2", "-gb", "64"],
    # Gemma 2 (AutoBridge's Gemma2ModelProvider from the config.json written above)
    ["--recipe", "gemma2_2b_pretrain_config", "-mb", "1", "-gb", "16"],
    # PEFT recipes: --mode lora / dora picks the recipe's peft_scheme (GBS 16 for the test's 16 GPUs)
    ["--recipe", "llama32_1b_peft_config", "-gb", "16"],
    ["--model", "llama3_8b", "--mode", "dora", "-tp", "2", "-gb", "16"],
    ["--model", "llama32_1b", "--mode", "lora", "--dataset", "squad", "-sl", "2048", "-gb", "32", "-mb", "2"],
    ["--recipe", "llama3_70b_peft_config", "--mode", "dora", "-tp", "4", "-gb", "16", "+peft.dim=4"],
]


@pytest.mark.parametrize("version", ["v0.6.0", "main"])
@pytest.mark.parametrize("argv", LAUNCHES, ids=lambda a: " ".join(a))
def test_run_recipe_gives_what_memguard_check_reads(recipes, monkeypatch, version, argv):
    from megatron_memguard.bridge import raw_config
    from megatron_memguard.readers.run_recipe import read_run_recipe
    from megatron_memguard.resolve import resolve

    cfg = run_recipe_main(version, argv, monkeypatch)
    rr, raw = read_run_recipe(argv)
    real, ours = resolve(raw_config(cfg), world_size=WORLD), resolve(raw, world_size=WORLD)
    assert fields(real) == fields(ours)
    assert real.seq_length == cfg.model.seq_length == cfg.dataset.seq_length
    if "--deterministic" in argv:
        assert dict(ours.env)["CUBLAS_WORKSPACE_CONFIG"] == cfg.env_vars["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


@pytest.mark.parametrize("argv", [
    ["--recipe", "llama3_8b", "model.tensor_model_parallel_size=4"],     # the README's old example
    # a recipe's PEFT object is left out of the override config (callable): Hydra cannot override its fields
    ["--recipe", "llama32_1b_peft_config", "peft.dim=16"],
    ["--model", "llama32_1b", "--mode", "lora", "--dataset", "mock"],
    ["--recipe", "llama3_8b", "--mode", "pretrain"],
    ["--model", "llama3_8b"],
    ["--recipe", "llama3_8b_pretrain_config", "--micro", "8"],
    ["--recipe", "llama3_8b_pretrain_config", "--config-file", "x.yaml"],
    # the recipe's comm_overlap is None: Hydra cannot set a field of it
    ["--recipe", "llama3_8b_pretrain_config", "-tp", "2", "model.sequence_parallel=true", "comm_overlap.tp_comm_overlap=true"],
    # the recipe's mixed_precision is the preset name bf16_mixed: Hydra cannot set a field of a string
    ["--recipe", "llama3_8b_pretrain_config", "mixed_precision.grad_reduce_in_fp32=false"],
], ids=lambda a: " ".join(a))
def test_launches_run_recipe_refuses_are_refused(recipes, monkeypatch, argv):
    from megatron_memguard.errors import MemguardError
    from megatron_memguard.readers.run_recipe import read_run_recipe

    from megatron.bridge.training.utils.omegaconf_utils import OverridesError
    with pytest.raises((ValueError, AttributeError, SystemExit, OverridesError)):
        run_recipe_main("v0.6.0", argv, monkeypatch)
    with pytest.raises(MemguardError):
        read_run_recipe(argv)


# --------------------------------------------------------------------------------------------------
# The callback through Bridge's real CallbackManager, its memory source started by the callback (item 6)
# --------------------------------------------------------------------------------------------------
def test_callback_through_bridges_callback_manager_starts_its_source(recipes, tmp_path):
    import torch
    from megatron.bridge.training.callbacks import CallbackContext, CallbackManager

    from megatron_memguard.bridge import MemguardCallback, preflight
    from megatron_memguard.runtime import LiveBytesSource

    cfg = recipes.llama32_1b_pretrain_config()
    result = preflight(cfg, world_size=1, gpu_memory="80GiB", emit=lambda s: None)
    torch.manual_seed(0)
    model = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))]
    opt = torch.optim.Adam(model[0].parameters())
    src = LiveBytesSource()
    cb = MemguardCallback(result, log_dir=str(tmp_path), interval=1, source=src, emit=lambda s: None)
    manager = CallbackManager()
    manager.add(cb)
    state = type("GlobalState", (), {"cfg": cfg, "train_state": type("TS", (), {"step": 0})(),
                                     "tensorboard_logger": None, "wandb_logger": None})()
    ctx = lambda: CallbackContext(state=state, model=model, user_state=manager.user_state, optimizer=opt)  # noqa: E731
    manager.fire("on_train_start", ctx())
    x = torch.randn(8, 64)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        model[0](x).sum().backward()
        opt.step()
        manager.fire("on_train_step_end", ctx())
        state.train_state.step += 1
    manager.fire("on_train_end", ctx())
    recs = [json.loads(line) for line in open(tmp_path / "memguard-rank00000.jsonl")]
    params = sum(p.numel() for p in model[0].parameters())
    assert recs[0]["event"] == "start" and recs[0]["actual"]["allocated"] == 4 * params
    assert recs[2]["event"] == "sample" and recs[2]["actual"]["allocated"] >= 16 * params   # + grads, Adam moments


# --------------------------------------------------------------------------------------------------
# A run_config.yaml dump of a real MoE ConfigContainer (what Bridge writes with cfg.to_yaml, at every
# checkpoint and to logger.save_config_filepath), read by memguard: each MoE field equals the container's
# --------------------------------------------------------------------------------------------------
DUMPED = ["qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config", "qwen3_235b_a22b_pretrain_config",
          "deepseek_v2_lite_pretrain_config", "deepseek_v2_pretrain_config", "deepseek_v3_pretrain_config",
          "olmoe_7b_pretrain_config"]


@pytest.mark.parametrize("function", DUMPED)
def test_run_config_yaml_dump_gives_the_containers_moe_fields(recipes, tmp_path, function):
    from megatron_memguard.bridge import raw_config
    from megatron_memguard.readers.detect import read_config_file
    from megatron_memguard.readers.models import recipe_for_function
    from megatron_memguard.resolve import resolve

    cfg = getattr(recipes, function)()
    if cfg.model.moe_token_dispatcher_type == "flex" and cfg.model.moe_flex_dispatcher_backend == "hybridep":
        cfg.model.moe_token_dispatcher_type = "alltoall"    # HybridEP is refused; the other fields are the test
    path = tmp_path / "run_config.yaml"
    cfg.to_yaml(str(path))
    raw = read_config_file(str(path))
    assert raw.warnings == raw_config(cfg).warnings
    world = world_of(recipe_for_function(function))
    L = resolve(raw, world_size=world)
    m, c = L.moe, cfg.model
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size) == (c.num_moe_experts, c.moe_router_topk,
                                                                          c.moe_ffn_hidden_size)
    assert m.moe_shared_expert_intermediate_size == c.moe_shared_expert_intermediate_size
    freq = c.moe_layer_freq
    assert list(m.moe_layer_pattern) == ([bool(x) for x in freq] if isinstance(freq, list)
                                         else [i % freq == 0 for i in range(c.num_layers)])
    assert (m.expert_model_parallel_size, m.expert_tensor_parallel_size) == (
        c.expert_model_parallel_size, c.expert_tensor_parallel_size or c.tensor_model_parallel_size)
    assert (m.moe_token_dispatcher_type, m.moe_grouped_gemm, m.moe_permute_fusion, m.moe_router_fusion) == (
        c.moe_token_dispatcher_type, c.moe_grouped_gemm, c.moe_permute_fusion, c.moe_router_fusion)
    assert m.moe_router_dtype == c.moe_router_dtype
    assert m.moe_shared_expert_overlap == c.moe_shared_expert_overlap
    assert (m.moe_router_load_balancing_type, m.moe_aux_loss_coeff, m.moe_router_pre_softmax,
            m.moe_router_score_function, m.moe_router_enable_expert_bias) == (
        c.moe_router_load_balancing_type, c.moe_aux_loss_coeff, c.moe_router_pre_softmax,
        c.moe_router_score_function, c.moe_router_enable_expert_bias)
    assert (L.mtp_num_layers or None) == c.mtp_num_layers
    assert (L.tensor_model_parallel_size, L.pipeline_model_parallel_size, L.context_parallel_size,
            L.sequence_parallel) == (c.tensor_model_parallel_size, c.pipeline_model_parallel_size,
                                     c.context_parallel_size, c.sequence_parallel)
    assert L.recompute_granularity == c.recompute_granularity
    assert (L.num_layers, L.hidden_size, L.multi_latent_attention) == (c.num_layers, c.hidden_size,
                                                                        bool(getattr(c, "multi_latent_attention", False)))
    # the whole resolved layout equals the one from the container object itself
    assert fields(L) == fields(resolve(raw_config(cfg), world_size=world))


def test_preflight_on_a_real_moe_recipe_is_memguard_estimate_of_the_recipe(recipes):
    """The pre-flight a Bridge launch script runs on the real DeepSeek-V2-Lite container gives the same
    estimate as `memguard estimate --model deepseek_v2_lite --gpus 8` run with the job's Transformer Engine
    (MEMGUARD_TE_VERSION: inside a job the pre-flight reads `transformer_engine.__version__`, here the stand-in's)."""
    from megatron_memguard._integration import installed_te_version, with_installed_te
    from megatron_memguard.bridge import preflight
    from megatron_memguard.estimator.core import estimate
    from megatron_memguard.gpus import lookup_gpu
    from megatron_memguard.readers.models import read_model, recipe_notes
    from megatron_memguard.resolve import resolve

    result = preflight(recipes.deepseek_v2_lite_pretrain_config(), world_size=8, gpu="H100-80GB", mode="report",
                       emit=lambda s: None)
    assert installed_te_version()          # (the stand-in's TE release: the attention kernel's choice follows it)
    ours = estimate(resolve(with_installed_te(read_model("deepseek_v2_lite")), world_size=8), gpu=lookup_gpu("H100-80GB"))
    # the same document, but for the notes memguard adds when it knows the recipe by name (data/presets.yaml)
    theirs, ours_d = result.estimate.to_dict(), ours.to_dict()
    named = list(recipe_notes("deepseek_v2_lite"))
    assert named and [n for n in ours_d["notes"] if n not in named] == theirs["notes"]
    for d in (theirs, ours_d, theirs["layout"], ours_d["layout"]):
        d.pop("notes")
    assert theirs == ours_d
    assert result.layout.moe.expert_model_parallel_size == 8


# --------------------------------------------------------------------------------------------------
# data/config_fields.json's ConfigContainer sections against the real Bridge 0.6.2 dataclasses (a stale list
# fails here), and memguard's handling of an unknown key against Bridge's own
# --------------------------------------------------------------------------------------------------
def _real_sections():
    import dataclasses
    import typing

    from megatron.bridge.training.config import ConfigContainer

    hints = typing.get_type_hints(ConfigContainer)
    out = {}
    for f in dataclasses.fields(ConfigContainer):
        classes = [c for c in (typing.get_args(hints[f.name]) or (hints[f.name],)) if dataclasses.is_dataclass(c)]
        if classes and f.name not in ("model", "peft"):
            out[f.name] = (classes, set().union(*({x.name for x in dataclasses.fields(c)} for c in classes)))
    return out


def test_config_fields_sections_are_bridges_configcontainer(recipes):
    import json
    from importlib import resources

    import dataclasses

    from megatron.bridge.training.config import ConfigContainer

    from megatron_memguard.readers._common import bridge_sections, config_fields

    doc = json.loads(resources.files("megatron_memguard").joinpath("data/config_fields.json").read_text())
    assert "megatron-bridge 0.6.2" in doc["versions"]
    ours = bridge_sections()
    real = {s: v for s, v in _real_sections().items() if v[1]}   # (OptimizerConfigOverrideProvider: no fields)
    assert set(ours) == set(real)
    assert {f.name for f in dataclasses.fields(ConfigContainer)} == config_fields()["ConfigContainer"]
    for sec, (classes, fields) in real.items():
        known_classes, known = ours[sec]
        assert {c.__name__ for c in classes} <= known_classes, sec
        assert fields <= known, (sec, sorted(fields - known))
        if known_classes == {c.__name__ for c in classes} and sec not in ("optimizer", "ddp"):
            # one class, no Bridge subclass: exactly its fields (optimizer / ddp: the union with the older
            # megatron-core releases the list reads, checked against the installed one in test_config_fields.py)
            assert known == fields, (sec, sorted(known - fields))


def test_an_unknown_override_key_is_refused_as_bridge_refuses_it(recipes):
    from megatron.bridge.training.utils.omegaconf_utils import OverridesError, process_config_with_overrides

    from megatron_memguard.errors import ConfigError
    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge

    for override in ("train.micro_batchsize=4", "dataset.seq_lenght=4096", "trian.micro_batch_size=4"):
        with pytest.raises(OverridesError):
            process_config_with_overrides(recipes.llama32_1b_pretrain_config(), cli_overrides=[override])
        with pytest.raises(ConfigError, match="did you mean"):
            read_bridge({}, "recipe llama32_1b", parse_overrides([override]), recipe="llama32_1b")



@pytest.mark.parametrize("overrides", [
    ["model.cuda_graph_impl=local"], ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn]"],
    ["model.cuda_graph_impl=local", "model.cuda_graph_scope=full_iteration"], ["model.cuda_graph_impl=full_iteration"],
    ["model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[attn]"],
], ids=" ".join)
def test_a_local_cuda_graph_bridge_refuses_is_a_problem(recipes, overrides):
    """Bridge's validate_cuda_graph_configuration (utils/cuda_graph.py, run by ConfigContainer.validate) on the recipe
    with the overrides applied by Bridge's Hydra processing; memguard's reading of the same overrides has a problem
    naming model.cuda_graph_impl exactly when Bridge raises."""
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides
    from megatron.bridge.utils.cuda_graph import validate_cuda_graph_configuration

    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge

    cfg = process_config_with_overrides(recipes.llama32_1b_pretrain_config(), cli_overrides=overrides)
    try:
        validate_cuda_graph_configuration(cfg.model)
        refused = False
    except ValueError as e:
        refused = "only for full-iteration CUDA graphs" in str(e)
    raw = read_bridge({}, "recipe llama32_1b", parse_overrides(overrides), recipe="llama32_1b")
    # and the recipe's own cuda_graph_scope 'full' (kept by these overrides) beside modules: megatron-core 0.19.2's
    # TransformerConfig.__post_init__ asserts "cuda_graph_scope and cuda_graph_modules cannot be set together"
    together = cfg.model.cuda_graph_scope is not None and cfg.model.cuda_graph_modules not in ("full", None, [])
    assert [p.key for p in raw.problems] == (["model.cuda_graph_impl"] if refused else []) + (
        ["model.cuda_graph_modules"] if together else [])
    assert refused == (overrides[0] == "model.cuda_graph_impl=local" and "full_iteration" not in overrides[-1])


@pytest.mark.parametrize("overrides", [
    ["model.cuda_graph_impl=full_iteration"],
    ["model.cuda_graph_impl=full_iteration", "rerun_state_machine.check_for_nan_in_loss=false"],
    ["model.cuda_graph_impl=local", "model.cuda_graph_scope=full_iteration", "rerun_state_machine.check_for_nan_in_loss=false"],
    ["model.cuda_graph_impl=local", "model.cuda_graph_scope=full_iteration"],
    ["model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=[attn]"],
    ["model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[attn,mlp]"],
    ["model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[attn,mlp]", "model.cuda_graph_scope=null"],
], ids=" ".join)
def test_run_recipes_cuda_graphs_are_what_bridge_finalizes(recipes, monkeypatch, overrides):
    """run_recipe.py with CUDA graph overrides, finalized by Bridge's runtime_config_update (ConfigContainer.validate:
    the full-iteration graph asserts rerun_state_machine.check_for_nan_in_loss is off; megatron-core 0.19's
    cuda_graph_config.py migrates the deprecated cuda_graph_scope to cuda_graph_modules): memguard check's reading
    refuses what Bridge refuses, naming the key Bridge names, and reads the implementation and modules Bridge builds."""
    from megatron_memguard.errors import ConfigError
    from megatron_memguard.resolve import resolve

    cfg, bridge, raw = _llama3_8b_launch(overrides, monkeypatch)
    if bridge is not None and "cuda_graph_scope and cuda_graph_modules cannot be set together" in bridge:
        # (the recipe function sets cuda_graph_scope 'full'; TransformerConfig asserts the modules empty unless it is
        # None): the container's reading and memguard check's (its recipe table carries that 'full') have the problem
        from megatron_memguard.bridge import raw_config
        assert [p.key for p in raw_config(cfg).problems] == ["model.cuda_graph_modules"]
        assert [p.key for p in raw.problems] == ["model.cuda_graph_modules"]
        return
    if bridge is not None:
        assert "check_for_nan_in_loss must be disabled" in bridge
        with pytest.raises(ConfigError, match="rerun_state_machine.check_for_nan_in_loss=false"):
            resolve(raw, world_size=WORLD)
        return
    assert not raw.problems
    L = resolve(raw, world_size=WORLD)
    m = cfg.model
    modules = sorted(getattr(x, "name", x) for x in (m.cuda_graph_modules or []))
    assert (L.cuda_graph_impl, sorted(L.cuda_graph_modules or ())) == (m.cuda_graph_impl, modules)

def test_an_unknown_file_key_is_skipped_with_a_warning_as_bridge_does(recipes, tmp_path, caplog):
    import logging

    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from megatron_memguard.readers.detect import read_config_file

    p = tmp_path / "override.yaml"
    p.write_text("train:\n  micro_batchsize: 4\n  global_batch_size: 64\n")
    with caplog.at_level(logging.WARNING):
        cfg = process_config_with_overrides(recipes.llama32_1b_pretrain_config(), config_filepath=str(p))
    assert cfg.train.global_batch_size == 64 and cfg.train.micro_batch_size != 4
    assert any("micro_batchsize" in r.getMessage() and "Skipping" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING):   # a Hydra +key override: added, then skipped the same way
        cfg2 = process_config_with_overrides(recipes.llama32_1b_pretrain_config(),
                                             cli_overrides=["+train.micro_batchsize=4"])
    assert cfg2.train.micro_batch_size == cfg.train.micro_batch_size
    assert any("micro_batchsize" in r.getMessage() and "Skipping" in r.getMessage() for r in caplog.records)
    raw = read_config_file(str(p), model="llama32_1b")
    assert any(w.startswith("train.micro_batchsize: ") and "did you mean train.micro_batch_size?" in w
               for w in raw.warnings)
    assert raw.args["micro_batch_size"] == cfg.train.micro_batch_size and raw.args["global_batch_size"] == 64


def test_an_unknown_model_key_is_handled_as_bridge_does(recipes, tmp_path, caplog):
    """model.* as the other sections: Bridge 0.6.2 refuses an unknown override key of a recipe's model (Hydra
    struct mode: "Could not override 'model.num_layer'") and skips one from a file with a warning naming the
    provider; memguard refuses the override with a hint and warns for the file. Its known model fields cover
    every field of the provider classes memguard's recipes build (a new field of Bridge's fails here)."""
    import dataclasses
    import logging

    from megatron.bridge.training.utils.omegaconf_utils import OverridesError, process_config_with_overrides

    from megatron_memguard.errors import ConfigError
    from megatron_memguard.readers._common import GEMMA3_FIELDS, parse_overrides
    from megatron_memguard.readers.bridge import GEMMA2_FIELDS
    from megatron_memguard.readers.bridge import _CHECKED_PROVIDERS, model_known_fields, read_bridge
    from megatron_memguard.readers.detect import read_config_file
    from megatron_memguard.readers.models import presets

    for name, r in presets()["recipes"].items():
        model = getattr(recipes, r["functions"][0])().model
        # Gemma3ModelProvider (gemma3_1b): its own fields are the ones memguard reads for Gemma 3 (GEMMA3_FIELDS);
        # an unknown key of a Gemma 3 file is warned about, as for any provider with fields of its own
        own = {"Gemma3ModelProvider": GEMMA3_FIELDS, "Gemma2ModelProvider": GEMMA2_FIELDS}.get(type(model).__name__,
                                                                                              frozenset())
        assert type(model).__name__ in _CHECKED_PROVIDERS or own, name
        assert {f.name for f in dataclasses.fields(model)} <= model_known_fields() | own, name
    with pytest.raises(OverridesError, match="model.num_layer"):
        process_config_with_overrides(recipes.llama32_1b_pretrain_config(), cli_overrides=["model.num_layer=4"])
    with pytest.raises(ConfigError, match=r"^model\.num_layer: .*did you mean model\.num_layers\?"):
        read_bridge({}, "recipe llama32_1b", parse_overrides(["model.num_layer=4"]), recipe="llama32_1b")
    p = tmp_path / "override.yaml"
    p.write_text("model:\n  num_layer: 4\ntrain:\n  global_batch_size: 64\n")
    with caplog.at_level(logging.WARNING):
        cfg = process_config_with_overrides(recipes.llama32_1b_pretrain_config(), config_filepath=str(p))
    assert cfg.model.num_layers == 16
    assert any("num_layer" in r.getMessage() and "Skipping" in r.getMessage() for r in caplog.records)
    raw = read_config_file(str(p), model="llama32_1b")
    assert any(w.startswith("model.num_layer: ") and "did you mean model.num_layers?" in w for w in raw.warnings)
    assert raw.args["num_layers"] == 16


def test_a_real_gemma2_run_config_is_estimated(recipes, tmp_path):
    """Bridge's Gemma2ModelProvider builds gemma2_layer_spec's layers (Gemma2FlexDotProductAttention,
    TERowParallelLinearLayerNorm) and a softcapping Gemma2OutputLayer: its run_config.yaml dump and the container
    object are read with ``gemma2_attention``, ``post_proj_norms`` and the final softcap."""
    import dataclasses

    from megatron.bridge.models.common.te_layers import TERowParallelLinearLayerNorm
    from megatron.bridge.models.gemma import gemma2_provider as g

    from megatron_memguard.bridge import raw_config
    from megatron_memguard.readers.bridge import GEMMA2_FIELDS, model_known_fields
    from megatron_memguard.readers.detect import read_config_file
    from megatron_memguard.resolve import resolve

    cfg = recipes.llama32_1b_pretrain_config()
    cfg.model = g.Gemma2ModelProvider(num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
                                      num_query_groups=2, kv_channels=64, vocab_size=1024,
                                      seq_length=cfg.model.seq_length)
    # what the reading rests on, from Bridge's source: the two softcaps' defaults (50.0 and 30.0), the modules of its
    # layer spec, and the provider's own fields (GEMMA2_FIELDS)
    assert (cfg.model.attn_logit_softcapping, cfg.model.final_logit_softcapping) == (50.0, 30.0)
    spec = g.gemma2_layer_spec(cfg.model)
    assert spec.submodules.self_attention.submodules.core_attention is g.Gemma2FlexDotProductAttention
    assert spec.submodules.self_attention.submodules.linear_proj is TERowParallelLinearLayerNorm
    assert spec.submodules.mlp.submodules.linear_fc2 is TERowParallelLinearLayerNorm
    assert {f.name for f in dataclasses.fields(cfg.model)} - model_known_fields() <= GEMMA2_FIELDS | {
        "window_size", "rotary_base"}
    path = tmp_path / "run_config.yaml"
    cfg.to_yaml(str(path))
    for raw in (read_config_file(str(path)), raw_config(cfg)):
        L = resolve(raw, world_size=8)
        assert (L.gemma2_attention, L.post_proj_norms, L.final_logit_softcapping) == (True, True, 30.0)
    cfg.model.final_logit_softcapping = None   # logit_softcapping: ``if not scale: return logits``
    cfg.to_yaml(str(path))
    assert resolve(read_config_file(str(path)), world_size=8).final_logit_softcapping == 0.0


def test_a_real_gemma3_run_config_is_estimated_and_gemma4_refused_by_name(recipes, tmp_path):
    """Bridge's Gemma3ModelProvider builds a GPT layer whose linear_proj and linear_fc2 carry an RMSNorm on their
    output (TERowParallelLinearLayerNorm) and a rotary embedding of two tables: its run_config.yaml dump and the
    container object are read with both (post_proj_norms, rotary_tables 4) and estimated. Gemma 4's providers build
    layers of their own (and default final_logit_softcapping to 30.0): refused naming Gemma 4, not as Gemma 2's
    softcapping. (The TE stand-in builds no Transformer Engine layer: the model itself is not built here.)"""
    import dataclasses

    from megatron.bridge.models.common.te_layers import TERowParallelLinearLayerNorm
    from megatron.bridge.models.gemma import gemma3_provider as g3
    from megatron.bridge.models.gemma import gemma4_provider as g4

    from megatron_memguard import estimate
    from megatron_memguard.bridge import raw_config
    from megatron_memguard.errors import NotModelledError
    from megatron_memguard.readers._common import GEMMA3_FIELDS
    from megatron_memguard.readers.bridge import model_known_fields
    from megatron_memguard.readers.detect import read_config_file
    from megatron_memguard.resolve import resolve

    cfg = recipes.llama32_1b_pretrain_config()
    shape = dict(num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4, num_query_groups=2,
                 kv_channels=64, vocab_size=1024, seq_length=cfg.model.seq_length)
    cfg.model = g3.Gemma3ModelProvider(**shape)
    # what the estimate rests on, from Bridge's source: the two row-parallel projections of gemma3_layer_spec are
    # the post-norm ones, the provider's spec is that function, and its own fields are the ones memguard reads
    layer = g3.gemma3_layer_spec(cfg.model).submodules
    assert layer.self_attention.submodules.linear_proj is TERowParallelLinearLayerNorm
    assert layer.mlp.submodules.linear_fc2 is TERowParallelLinearLayerNorm
    assert cfg.model.transformer_layer_spec is g3.gemma3_layer_spec
    own = {f.name for f in dataclasses.fields(cfg.model)} - model_known_fields()
    assert own - {"rotary_base", "window_size", "softmax_scale", "scatter_embedding_sequence_parallel"} <= GEMMA3_FIELDS
    path = tmp_path / "run_config.yaml"
    cfg.to_yaml(str(path))
    for read in (lambda: read_config_file(str(path)), lambda: raw_config(cfg)):
        raw = read()
        assert raw.args["post_proj_norms"] is True and raw.args["rotary_tables"] == 4
        assert raw.args["window_size"] == [511, 0]   # Gemma3TEDotProductAttention's local window
        L = resolve(raw, world_size=1)
        assert L.post_proj_norms and L.qk_layernorm and L.normalization == "RMSNorm"
        terms = {t.name for s in estimate(L).stages for t in s.terms}
        assert "rotary_cache" in terms
    for provider in (g4.Gemma4DenseProvider, g4.Gemma4ModelProvider):
        cfg.model = provider(**shape)
        assert cfg.model.final_logit_softcapping == 30.0
        cfg.to_yaml(str(path))
        for read in (lambda: read_config_file(str(path)), lambda: raw_config(cfg)):
            with pytest.raises(NotModelledError, match=r"^model\.(_target_|transformer_layer_spec): Gemma 4's own"):
                read()


# --------------------------------------------------------------------------------------------------
# A recipe's env_vars reach the job as Bridge's apply_environment_variables puts them there (setdefault: the
# launch's own value wins); memguard check of `VAR=value torchrun ... run_recipe.py` reads the same environment
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("launch_env", [{}, {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "PYTORCH_CUDA_ALLOC_CONF": ""}])
def test_recipe_env_vars_are_applied_as_bridge_applies_them(recipes, monkeypatch, capsys, launch_env):
    from megatron.bridge.training.config import apply_environment_variables

    from megatron_memguard.cli.main import main
    from megatron_memguard.config import MEMORY_ENV_VARS, memory_env

    function = "llama3_70b_pretrain_deterministic_config"
    for name in MEMORY_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in launch_env.items():
        monkeypatch.setenv(name, value)
    apply_environment_variables(getattr(recipes, function)())
    real = memory_env(os.environ)
    assert real["CUBLAS_WORKSPACE_CONFIG"] == launch_env.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    prefix = [f"{k}={v}" for k, v in launch_env.items()]
    for name in launch_env:
        monkeypatch.delenv(name)
    code = main(["check", "--json", "--", *prefix, "torchrun", "--nnodes", "4", "--nproc-per-node", "8",
                 "scripts/training/run_recipe.py", "--recipe", function])
    doc = json.loads(capsys.readouterr().out)
    assert code in (0, 1) and doc["layout"]["env"] == real


# --------------------------------------------------------------------------------------------------
# Every recipe memguard names, field by field against what Bridge itself finalizes: the real recipe function, then
# Bridge's runtime_config_update (environment, mixed precision setup, data-parallel size, comm overlap setup,
# validate: training/config.py 0.6.2) and, for NullTokenizer recipes, the tokenizer and vocabulary setup
# (training/setup.py _validate_and_set_vocab_size, gpt_provider.py's padding). memguard's three readings of the
# recipe -- `--model NAME`, `--config` of the run_config.yaml Bridge dumps, preflight() on the object -- must
# all give those values.
# --------------------------------------------------------------------------------------------------
def _finalized(recipes, key, monkeypatch, tmp_path):
    """(the finalized ConfigContainer, its world size, memguard's recipe overrides): a HybridEP recipe (refused by
    name: test_memguards_recipes_are_bridges) is taken with the alltoall dispatcher on both sides."""
    from megatron_memguard.config import MEMORY_ENV_VARS
    from megatron_memguard.readers.models import presets

    world = world_of(key)
    for name in MEMORY_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    for name in ("NCCL_GRAPH_REGISTER", "NCCL_NVLS_ENABLE", "TORCH_NCCL_HIGH_PRIORITY", "NCCL_ALGO"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = getattr(recipes, presets()["recipes"][key]["functions"][0])()
    if cfg.peft is not None:     # (validate asserts one for PEFT, and that it exists; the recipes leave it to the user)
        cfg.checkpoint.pretrained_checkpoint = str(tmp_path / "base-ckpt")
        os.makedirs(cfg.checkpoint.pretrained_checkpoint)
    overrides = []
    if cfg.model.moe_token_dispatcher_type == "flex" and cfg.model.moe_flex_dispatcher_backend == "hybridep":
        cfg.model.moe_token_dispatcher_type = "alltoall"
        overrides = ["model.moe_token_dispatcher_type=alltoall"]
    _runtime_config_update(cfg, monkeypatch)
    return cfg, world, overrides


def _llama3_8b_launch(overrides, monkeypatch, unset_env=()):
    """run_recipe.py's llama3_8b_pretrain_config with ``overrides``, finalized by Bridge (runtime_config_update), and
    memguard's reading of the same launch: (Bridge's config, Bridge's assertion message or None, memguard's raw)."""
    from megatron_memguard.readers.run_recipe import read_run_recipe

    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    cfg = run_recipe_main("v0.6.0", ["--recipe", "llama3_8b_pretrain_config", *overrides], monkeypatch)
    for name in unset_env:
        monkeypatch.delenv(name, raising=False)
    try:
        _runtime_config_update(cfg, monkeypatch)
        bridge = None
    except AssertionError as e:
        bridge = str(e)
    _, raw = read_run_recipe(["--recipe", "llama3_8b_pretrain_config", *overrides])
    return cfg, bridge, raw


def _runtime_config_update(cfg, monkeypatch) -> None:
    """Bridge's runtime_config_update (mixed precision, data-parallel size, ConfigContainer.validate) on ``cfg``."""
    from megatron.bridge.training.config import runtime_config_update

    # Transformer Engine and the GPU are stood in: OptimizerConfig's check that TE's FusedAdam takes the
    # precision-aware arguments (transformer-engine >= 2.x does), and validate_flex_dispatcher_backend's device (an
    # H100, the GPU the recipes are named for)
    import types

    import torch
    import transformer_engine.pytorch.optimizers as te_optimizers

    def fused_adam(params, master_weight_dtype=None, exp_avg_dtype=None, exp_avg_sq_dtype=None,
                   use_decoupled_grad=False):
        raise AssertionError("not built on CPU")

    monkeypatch.setattr(te_optimizers, "FusedAdam", fused_adam, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=0: types.SimpleNamespace(major=9, minor=0, name="NVIDIA H100 80GB HBM3"))
    env = dict(os.environ)
    try:
        runtime_config_update(cfg)
    finally:   # (it applies the recipe's env_vars to this process)
        os.environ.clear()
        os.environ.update(env)


def _bridge_values(cfg) -> dict:
    """What Bridge builds the model and its optimizer with, under memguard's Layout names."""
    m, o, d, t = cfg.model, cfg.optimizer, cfg.ddp, cfg.train
    dtype = {"torch.bfloat16": "bf16", "torch.float32": "fp32", "torch.float16": "fp16"}
    mla = bool(getattr(m, "multi_latent_attention", False))
    v = {
        "tensor_model_parallel_size": m.tensor_model_parallel_size,
        "pipeline_model_parallel_size": m.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": m.virtual_pipeline_model_parallel_size,
        "context_parallel_size": m.context_parallel_size, "sequence_parallel": m.sequence_parallel,
        "data_parallel_size": cfg.data_parallel_size,
        "num_layers": m.num_layers, "hidden_size": m.hidden_size, "ffn_hidden_size": m.ffn_hidden_size,
        "num_attention_heads": m.num_attention_heads, "seq_length": m.seq_length,
        "micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size,
        "untie_embeddings_and_output_weights": not m.share_embeddings_and_output_weights,
        "add_bias_linear": m.add_bias_linear, "add_qkv_bias": m.add_qkv_bias,
        "qk_layernorm": bool(m.qk_layernorm),   # (a value Bridge sets unchecked: the layer spec tests its truth)
        "gated_linear_unit": m.gated_linear_unit, "normalization": m.normalization,
        "multi_latent_attention": mla,
        "recompute_granularity": m.recompute_granularity, "recompute_method": m.recompute_method,
        "recompute_num_layers": m.recompute_num_layers,
        "bf16": m.bf16, "fp16": m.fp16, "params_dtype": dtype[str(m.params_dtype)],
        "transformer_impl": m.transformer_impl, "cross_entropy_loss_fusion": m.cross_entropy_loss_fusion,
        "tp_comm_overlap": m.tp_comm_overlap, "deterministic_mode": m.deterministic_mode,
        "account_for_embedding_in_pipeline_split": m.account_for_embedding_in_pipeline_split,
        "account_for_loss_in_pipeline_split": m.account_for_loss_in_pipeline_split,
        "use_distributed_optimizer": d.use_distributed_optimizer, "overlap_grad_reduce": d.overlap_grad_reduce,
        "overlap_param_gather": d.overlap_param_gather, "optimizer": o.optimizer,
        "use_precision_aware_optimizer": o.use_precision_aware_optimizer,
    }
    if not mla:
        v.update(kv_channels=m.kv_channels, num_query_groups=m.num_query_groups or m.num_attention_heads)
    if o.use_precision_aware_optimizer:
        v.update(main_grads_dtype=dtype[str(o.main_grads_dtype)], exp_avg_dtype=dtype[str(o.exp_avg_dtype)],
                 exp_avg_sq_dtype=dtype[str(o.exp_avg_sq_dtype)])
    # gradients reduced in fp32, else in the parameters' bf16 (DistributedDataParallelConfig.grad_reduce_in_fp32)
    v["grad_reduce_in_bf16"] = m.bf16 and not d.grad_reduce_in_fp32
    if cfg.tokenizer.tokenizer_type == "NullTokenizer":
        from megatron.bridge.training.setup import _validate_and_set_vocab_size
        from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer
        from megatron.bridge.utils.vocab_utils import calculate_padded_vocab_size

        vocab, pad = _validate_and_set_vocab_size(m.vocab_size, build_tokenizer(cfg.tokenizer).vocab_size,
                                                  cfg.tokenizer.use_tokenizer_vocab_size)
        v["padded_vocab_size"] = (calculate_padded_vocab_size(vocab, m.make_vocab_size_divisible_by,
                                                              m.tensor_model_parallel_size) if pad else vocab)
    return v


@pytest.mark.parametrize("key", sorted(__import__("megatron_memguard.readers.models", fromlist=["presets"])
                                       .presets()["recipes"]))
def test_every_recipe_reads_as_bridge_finalizes_it(recipes, monkeypatch, tmp_path, key):
    from megatron_memguard.bridge import preflight
    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge
    from megatron_memguard.readers.detect import read_config_file
    from megatron_memguard.resolve import resolve

    cfg, world, overrides = _finalized(recipes, key, monkeypatch, tmp_path)
    real = _bridge_values(cfg)
    by_name = resolve(read_bridge({}, f"recipe {key}", parse_overrides(overrides), recipe=key), world_size=world)
    path = tmp_path / "run_config.yaml"
    cfg.to_yaml(str(path))
    dumped = resolve(read_config_file(str(path)), world_size=world)
    # (MXFP8 and NVFP4 need Blackwell, whatever the recipe's name says: memguard refuses them on an H100)
    blackwell = (cfg.model.fp8 and cfg.model.fp8_recipe == "mxfp8") or cfg.model.fp4
    pre = preflight(cfg, world_size=world, gpu="B200" if blackwell else "H100-80GB", mode="report", emit=lambda s: None,
                    strict=True).layout
    for L, how in ((by_name, "--model"), (dumped, "--config run_config.yaml"), (pre, "preflight")):
        ours = L.to_dict()
        assert {k: ours[k] for k in real} == real, how
# --- PEFT: Bridge's real adapters vs memguard's count (estimator/peft.py)

def _free_port() -> str:
    """A port no process on this machine holds now (a fixed one collides with a run of another checkout)."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


# the tests that run tests/bridge_real's PEFT scripts (through _real_adapters, _real_peft_model)
PEFT_SCRIPT_TESTS = ("test_peft_adapter_parameters_are_bridges", "test_a_peft_recipes_trainable_parameters_are_bridges",
                     "test_wildcard_targets_wrap_what_bridge_wraps", "test_a_forked_peft_model_build_is_a_new_interpreters",
                     "test_what_bridges_lora_adapters_save_for_backward")
# The fork server of the PEFT scripts (tests/build_util.py): the Transformer Engine stand-in first on its path before
# it imports megatron-core (as the scripts' PYTHONPATH puts it for a new interpreter: megatron-core's TE checks find
# it, which the recipe's TransformerConfig needs) and Bridge's recipes imported once, not in each process.
PEFT_SERVER = dict(server_path=(os.path.join(STANDINS, "te_standin"),), preload=("megatron.bridge.recipes",))


def _peft_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.path.join(STANDINS, "te_standin") + os.pathsep + os.environ.get("PYTHONPATH", "")}


@functools.lru_cache(maxsize=None)
def _real_adapters(tp: int) -> dict:
    """tests/bridge_real/peft_adapters.py on TP ranks: {"params": {scheme: {target: n}}, "saved": {dropout: ...}}
    (saved with TP 1 only). Once per TP for the whole file: each process imports Bridge."""
    import tempfile

    import build_util
    script = os.path.join(STANDINS, "peft_adapters.py")
    env = _peft_env()
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="memguard-peft-") as d:
        logs = [os.path.join(d, f"rank{r}.log") for r in range(tp)]
        # the ranks forked from the PEFT fork server (no import of torch, megatron-core and Bridge each;
        # MEMGUARD_E2E_FORK=0, new interpreters)
        failed = build_util.run_ranks([[sys.executable, script, str(r), str(tp), port] for r in range(tp)], logs,
                                      envs=[env] * tp, cwd=os.getcwd(), timeout=600, **PEFT_SERVER)
        texts = []
        for log in logs:
            with open(log, encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
    assert failed is None, texts[failed if failed and failed > 0 else 0][-2000:]
    return json.loads([line for line in texts[0].splitlines() if line.startswith("{")][-1])


@pytest.mark.parametrize("tp,scheme", [(1, "lora"), (2, "lora"), (2, "dora")])
def test_peft_adapter_parameters_are_bridges(tp, scheme, tmp_path):
    from megatron_memguard import resolve
    from megatron_memguard.estimator.peft import layer_adapter_rows
    from megatron_memguard.readers.detect import read_config_file
    real = _real_adapters(tp)["params"][scheme]
    p = tmp_path / "peft.yaml"
    cls = "dora.DoRA" if scheme == "dora" else "lora.LoRA"
    p.write_text(f"peft:\n  _target_: megatron.bridge.peft.{cls}\n  dim: 32\n")
    L = resolve(read_config_file(str(p), model="llama32_1b",
                                 overrides=[f"model.tensor_model_parallel_size={tp}"]), world_size=8)
    ours: dict = {}
    for name, n, _ in layer_adapter_rows(L):
        ours[name.split(".")[0]] = ours.get(name.split(".")[0], 0) + n
    assert ours == real
    if tp == 1 and scheme == "lora":
        assert sum(real.values()) * 16 == 19_398_656    # Llama-3.2-1B, rank 32, the four default targets


@pytest.mark.parametrize("scheme", ["lora", "dora"])
def test_a_real_peft_recipe_is_read_from_the_object_and_its_dump(recipes, tmp_path, scheme):
    """Bridge's own Llama-3.2-1B PEFT recipe (its LoRA / DoRA object, its run_config.yaml dump): memguard reads the
    adapters Bridge would build, and both ways give one layout."""
    from megatron_memguard.bridge import raw_config
    from megatron_memguard.readers.detect import read_config_file
    from megatron_memguard.resolve import resolve

    cfg = recipes.llama32_1b_peft_config(peft_scheme=scheme)
    path = tmp_path / "run_config.yaml"
    cfg.to_yaml(str(path))
    L = resolve(read_config_file(str(path)), world_size=8)
    p = cfg.peft
    assert (L.peft.scheme, L.peft.dim, L.peft.alpha, L.peft.dropout, L.peft.dropout_position) == (
        scheme, p.dim, p.alpha, p.dropout, p.dropout_position)
    assert L.peft.target_modules == tuple(p.target_modules)
    assert fields(L) == fields(resolve(raw_config(cfg), world_size=8))


def _peft_model_run(fn: str, scheme: str, layers: int, targets: str | None = None) -> dict:
    """tests/bridge_real/peft_model.py: the recipe's model (LAYERS layers) with the recipe's PEFT object applied,
    forked from the PEFT fork server (MEMGUARD_E2E_FORK=0: a new interpreter)."""
    import build_util
    argv = [sys.executable, os.path.join(STANDINS, "peft_model.py"), fn, scheme, str(layers), _free_port()] + (
        [targets] if targets else [])
    p = build_util.run_script(argv, env=_peft_env(), timeout=900, **PEFT_SERVER)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


_real_peft_model = functools.lru_cache(maxsize=None)(_peft_model_run)   # (the fork check reuses a test's build)


@pytest.mark.parametrize("fn, scheme", [("llama32_1b_peft_config", "lora"), ("llama32_1b_peft_config", "dora"),
                                        ("llama3_8b_peft_config", "dora")])
def test_a_peft_recipes_trainable_parameters_are_bridges(recipes, fn, scheme):
    """run_recipe.py --recipe FN --mode SCHEME: Bridge builds the recipe's model (2 of its layers, on CPU) and applies
    the recipe's own LoRA / DoRA object; memguard's trainable parameter count of the launch is that per layer x the
    recipe's layers. By hand: Llama-3.2-1B (37,888 x 32 a layer, DoRA + 23,552), Llama-3-8B rank 8 (69,632 x 8,
    DoRA + 43,008)."""
    from megatron_memguard.estimator.peft import adapter_param_count
    from megatron_memguard.readers.run_recipe import read_run_recipe
    from megatron_memguard.resolve import resolve
    real = _real_peft_model(fn, scheme, 2)
    L = resolve(read_run_recipe(["--recipe", fn, "--mode", scheme])[1], world_size=8)
    assert (L.peft.scheme, L.peft.dim) == (scheme, real["dim"])
    assert len(real["wrapped"]) == 2 * 4
    assert adapter_param_count(L) == real["per_layer"] * L.num_layers
    by_hand = {("llama32_1b_peft_config", "lora"): 37_888 * 32, ("llama32_1b_peft_config", "dora"): 37_888 * 32 + 23_552,
               ("llama3_8b_peft_config", "dora"): 69_632 * 8 + 43_008}
    assert real["per_layer"] == by_hand[(fn, scheme)]


def test_wildcard_targets_wrap_what_bridge_wraps(recipes, tmp_path):
    """'*' patterns in target_modules, matched by Bridge's own ModuleMatcher on the real model: memguard's reading
    wraps the same linears, and refuses by name a pattern Bridge applies to some layers only."""
    from megatron_memguard.errors import NotModelledError
    from megatron_memguard.readers.detect import read_config_file
    from megatron_memguard.resolve import resolve
    real = _real_peft_model("llama32_1b_peft_config", "lora", 12, "*linear_fc*,*.self_attention.linear_qkv,*.layers.1*.linear_proj")
    suffixes = {n.rsplit(".", 1)[-1] for n in real["wrapped"]}
    every = {t for t in suffixes if sum(n.endswith("." + t) for n in real["wrapped"]) == 12}
    assert every == {"linear_fc1", "linear_fc2", "linear_qkv"}
    # linear_proj of layers 1, 10 and 11 only
    assert sorted(n for n in real["wrapped"] if n.endswith("linear_proj")) == [
        f"decoder.layers.{i}.self_attention.linear_proj" for i in (1, 10, 11)]
    def read(targets):
        # (a run_config.yaml's peft: section over the recipe: Bridge takes no peft override on a recipe)
        p = tmp_path / "run_config.yaml"
        p.write_text("peft:\n  _target_: megatron.bridge.peft.lora.LoRA\n  target_modules: " + json.dumps(targets) + "\n")
        return resolve(read_config_file(str(p), model="llama32_1b_peft"), world_size=8)

    assert set(read(["*linear_fc*", "*.self_attention.linear_qkv"]).peft.target_modules) == every
    with pytest.raises(NotModelledError, match="in some layers"):
        read(["*.layers.1*.linear_proj"])


def test_a_forked_peft_model_build_is_a_new_interpreters(recipes, monkeypatch):
    """peft_model.py forked from the PEFT fork server (what the tests above use: Bridge and megatron-core imported
    there, with the TE stand-in) and in a new interpreter (MEMGUARD_E2E_FORK=0) build the same model: every
    parameter's name, shape, dtype and trainability, the counts and the wrapped modules. Llama-3.2-1B DoRA, 2 layers
    (a test above builds it forked): 37,888 x 32 + 23,552 trainable a layer (its docstring)."""
    import build_util

    if not build_util.fork_enabled():
        pytest.skip("MEMGUARD_E2E_FORK=0: both builds would be new interpreters")
    forked = _real_peft_model("llama32_1b_peft_config", "dora", 2)
    monkeypatch.setenv("MEMGUARD_E2E_FORK", "0")
    fresh = _peft_model_run("llama32_1b_peft_config", "dora", 2)
    assert fresh == forked
    trainable = [n for n, shape, dtype, grad in fresh["parameters"] if grad]
    assert len(trainable) == 2 * 4 * 3      # per wrapped linear: DoRA's linear_in, linear_out and weight_magnitude
    assert fresh["trainable"] == 2 * (37_888 * 32 + 23_552)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_what_bridges_lora_adapters_save_for_backward(dropout):
    """Each real adapter's forward (TP 1, 128 tokens, r 32, bf16): with no dropout it keeps its input (the base
    linear's, shared: lora_* items add nothing) and the [tokens, r] intermediate (lora_intermediates); with dropout
    before it, a dropped copy and a mask instead of the input (lora_*_input). The CPU mask is in the input's dtype
    (torch's CPU dropout multiplies by it); CUDA's fused native_dropout keeps a bool one, the 1 byte memguard counts."""
    import tempfile
    from megatron_memguard import resolve
    from megatron_memguard.estimator.activations import layer_activations
    from megatron_memguard.readers.detect import read_config_file
    real = _real_adapters(1)["saved"][str(dropout)]
    e = 2
    for name, m in real.items():
        inter = m["tokens"] * m["r"] * e
        if dropout:
            assert not m["input_kept"] and m["bytes"] == m["tokens"] * m["in"] * (e + e) + inter, name
        else:
            assert m["input_kept"] and m["bytes"] == m["tokens"] * m["in"] * e + inter, name
    # memguard's items for the same layer (Llama-3.2-1B, 64 x 2 tokens, TP 1, no SP)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "peft.yaml")
        with open(path, "w") as f:
            f.write(f"peft:\n  _target_: megatron.bridge.peft.lora.LoRA\n  dim: 32\n  dropout: {dropout}\n")
        L = resolve(read_config_file(path, model="llama32_1b", overrides=[
            "model.tensor_model_parallel_size=1", "model.sequence_parallel=false", "model.context_parallel_size=1",
            "model.seq_length=64", "dataset.seq_length=64", "train.micro_batch_size=2"]), world_size=8)
    saved = layer_activations(L).saved
    assert saved["lora_intermediates"] == sum(m["tokens"] * m["r"] * e for m in real.values())
    for name, m in real.items():
        item = "lora_" + name.split("_", 1)[1] + "_input"
        # (the real CPU mask is e bytes per element, memguard's CUDA one 1)
        assert saved.get(item, 0) == (m["bytes"] - m["tokens"] * m["r"] * e - m["tokens"] * m["in"] * (e - 1)
                                      if dropout else 0), name



# --------------------------------------------------------------------------------------------------
# hybrid MTP: HybridModelProvider.finalize's unified pattern and depth count, as memguard reads the provider
# --------------------------------------------------------------------------------------------------
NH8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"


@pytest.mark.parametrize("model", [
    dict(mtp_hybrid_override_pattern="*-", mtp_num_layers=2, mtp_use_repeated_layer=True),
    dict(hybrid_layer_pattern=NH8B_PATTERN + "/*E", mtp_num_layers=3, mtp_use_repeated_layer=True),
    dict(hybrid_layer_pattern=NH8B_PATTERN + "/*-/*-", mtp_hybrid_override_pattern="MM", mtp_num_layers=3),
], ids=["legacy-field", "own-slash-repeated", "field-replaces-slash"])
def test_hybrid_mtp_reads_as_bridge_finalizes_it(recipes, model):
    from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider

    from megatron_memguard.readers.bridge import read_bridge
    from megatron_memguard.resolve import resolve
    p = HybridModelProvider(num_layers=52, hidden_size=4096, num_attention_heads=32,
                            **{"hybrid_layer_pattern": NH8B_PATTERN, **model})
    p.finalize()
    main, *parts = p.hybrid_layer_pattern.split("/")
    extra = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 512} if "E" in parts[0] else {}
    L = resolve(read_bridge({"model": {**model, **extra}}, "run_config.yaml", [], recipe="nemotronh_8b"), world_size=2)
    assert (L.hybrid_layer_pattern, L.hybrid_mtp_pattern, L.mtp_num_layers) == (main, parts[0], p.mtp_num_layers)


# --- issue hostile8: a null / '???' outside the model section, as Bridge 0.6.2 itself takes it --------------------
@pytest.mark.parametrize("override, bridge", [
    ("train.micro_batch_size=null", "fails"),             # validate: "train.micro_batch_size must be set ..."
    ("dataset.seq_length=null", "fails"),                 # validate: model and dataset sequence lengths differ
    ("scheduler.lr_warmup_iters=null", "fails"),          # validate: None * int
    ("train=null", "fails"),                              # validate: 'NoneType' object has no attribute
    ("train.micro_batch_size='???'", "fails"),            # validate: int % str
    ("optimizer.optimizer=null", "not the default"),      # kept None: get_megatron_optimizer supports no None
    # the recipe's mixed_precision is the preset name bf16_mixed: Hydra refuses any field of it (test below)
    ("mixed_precision.grad_reduce_in_fp32=null", "could not override"),
    ("ddp.num_distributed_optimizer_instances=null", "not the default"),
    ("optimizer.store_param_remainders=null", "not the default"),
    ("ddp.overlap_grad_reduce='???'", "not the default"),  # the text '???' kept (truthy)
    ("ddp.bucket_size=null", "the default"),              # Optional[int] = None
    ("ddp.overlap_param_gather=null", "the default"),     # bool = False: None is false
    ("tokenizer.vocab_size=null", "the default"),         # int = None
    ("profiling=null", "the default"),                    # 'if self.profiling is not None'
])
def test_a_null_outside_the_model_is_refused_where_bridge_does_not_take_the_default(recipes, monkeypatch, override,
                                                                                      bridge):
    import dataclasses
    import types

    import torch
    from megatron.bridge.training.config import runtime_config_update
    from megatron.bridge.training.utils.omegaconf_utils import OverridesError, process_config_with_overrides

    from megatron_memguard.errors import ConfigError
    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=0: types.SimpleNamespace(major=9, minor=0, name="NVIDIA H100 80GB HBM3"))
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = recipes.llama32_1b_pretrain_config()
    path = override.split("=")[0].split(".")
    default = None
    if len(path) == 2 and dataclasses.is_dataclass(getattr(cfg, path[0])):
        default = {f.name: f.default for f in dataclasses.fields(getattr(cfg, path[0]))}[path[1]]
    env = dict(os.environ)
    try:
        cfg = process_config_with_overrides(cfg, cli_overrides=[override])
        runtime_config_update(cfg)
        value = getattr(getattr(cfg, path[0]), path[1]) if len(path) == 2 else getattr(cfg, path[0])
        seen = ("the default" if value is None and default in (None, False, dataclasses.MISSING) or value == default
                else "not the default")
    except OverridesError as e:
        seen = "could not override" if "Could not override" in str(e) else "fails"
    except (AssertionError, TypeError, AttributeError, ValueError):
        seen = "fails"
    finally:
        os.environ.clear()
        os.environ.update(env)
    assert seen == bridge
    if bridge == "the default":
        read_bridge({}, "recipe llama32_1b", parse_overrides([override]), recipe="llama32_1b")
    elif bridge == "could not override":
        with pytest.raises(ConfigError, match=rf"^{'.'.join(path)}: mixed_precision is the preset name 'bf16_mixed'"):
            read_bridge({}, "recipe llama32_1b", parse_overrides([override]), recipe="llama32_1b")
    else:
        with pytest.raises(ConfigError, match=rf"^{'.'.join(path)}: is (null|\?\?\?)"):
            read_bridge({}, "recipe llama32_1b", parse_overrides([override]), recipe="llama32_1b")


def test_a_null_or_string_target_modules_is_what_bridges_module_matcher_makes_of_it(recipes):
    """Bridge 0.6.2 peft/module_matcher.py: a null target_modules (or '') wraps every linear module, the output layer
    too, and a string's characters match no module; memguard estimated both as the four default linears."""
    import torch.nn as nn
    from megatron.bridge.peft.lora import LoRA

    from megatron_memguard.errors import ConfigError, NotModelledError
    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge
    from megatron_memguard.resolve import resolve

    linear = nn.Linear(2, 2)
    every = LoRA(target_modules=None)
    assert every.match(linear, name="output_layer", prefix="") is not None
    assert LoRA(target_modules="").match(linear, name="output_layer", prefix="") is not None
    text = LoRA(target_modules="linear_qkv")
    assert text.match(linear, name="linear_qkv", prefix="decoder.layers.0.self_attention") is None
    four = LoRA()
    assert four.match(linear, name="output_layer", prefix="") is None
    assert four.match(linear, name="linear_qkv", prefix="decoder.layers.0.self_attention") is not None

    import yaml

    from test_readers_bridge import FLAT

    def read(*o):   # (a config file: a recipe's PEFT object takes only +peft.FIELD overrides)
        return resolve(read_bridge(yaml.safe_load(FLAT), "c.yaml", parse_overrides(["peft=lora", *o])), world_size=8)
    assert read().peft.target_modules == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    for v in ("null", "''"):
        with pytest.raises(NotModelledError, match=r"^peft\.target_modules: PEFT with an empty target_modules"):
            read(f"peft.target_modules={v}")
    with pytest.raises(ConfigError, match=r"^peft\.target_modules: must be a list of module names, got the string"):
        read("peft.target_modules=linear_qkv")
    # a scheme name's fields set by overrides are that object's (peft.dim=8 was dropped: rank 32 estimated)
    assert read("peft.dim=8").peft.dim == 8


# --- audit2 item 1: a field override of a mixed_precision preset NAME, as Bridge 0.6.2 takes it -------------------
@pytest.mark.parametrize("override", ["mixed_precision.grad_reduce_in_fp32=false", "mixed_precision.fp8=hybrid",
                                      "+mixed_precision.grad_reduce_in_fp32=false", "~mixed_precision.bf16"])
def test_a_field_of_a_mixed_precision_preset_name_is_refused_as_bridge_refuses_it(recipes, monkeypatch, override):
    """llama32_1b_pretrain_config sets mixed_precision="bf16_mixed" (recipes/common.py): Hydra cannot set or delete a
    field of a string ("Could not override"); with + the section becomes a dict, which runtime_config_update
    cannot finalize (training/config.py: cfg.mixed_precision.finalize()). memguard applied the field to the preset."""
    from megatron.bridge.training.utils.omegaconf_utils import OverridesError, process_config_with_overrides

    from megatron_memguard.errors import ConfigError
    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge

    cfg = recipes.llama32_1b_pretrain_config()
    assert cfg.mixed_precision == "bf16_mixed"
    with pytest.raises((OverridesError, AttributeError)):
        cfg = process_config_with_overrides(cfg, cli_overrides=[override])
        _runtime_config_update(cfg, monkeypatch)
    key = override.lstrip("+~").split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key}: mixed_precision is the preset name 'bf16_mixed'"):
        read_bridge({}, "recipe llama32_1b", parse_overrides([override]), recipe="llama32_1b")


def test_a_field_of_a_recipes_mixed_precision_object_is_set_as_bridge_sets_it(recipes, monkeypatch):
    """qwen3_30b_a3b_pretrain_config builds a MixedPrecisionConfig (grad_reduce_in_fp32=False): Hydra sets its field,
    and setup() copies it into ddp (training/mixed_precision.py 0.6.2)."""
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge

    cfg = recipes.qwen3_30b_a3b_pretrain_config()
    assert not isinstance(cfg.mixed_precision, str) and cfg.mixed_precision.grad_reduce_in_fp32 is False
    cfg = process_config_with_overrides(cfg, cli_overrides=["mixed_precision.grad_reduce_in_fp32=true"])
    assert cfg.mixed_precision.grad_reduce_in_fp32 is True
    raw = read_bridge({}, "recipe qwen3_30b_a3b", parse_overrides(["mixed_precision.grad_reduce_in_fp32=true"]),
                      recipe="qwen3_30b_a3b")
    assert raw.args.get("accumulate_allreduce_grads_in_fp32") is True


# --- audit2 item 3: optimizer CPU offload without the precision-aware optimizer, as Bridge 0.6.2 takes it ----------
def test_optimizer_offload_without_precision_aware_optimizer_is_what_bridge_does(recipes, monkeypatch):
    """Bridge's finalize (runtime_config_update: ConfigContainer.validate) runs no Megatron-LM validate_args and
    accepts optimizer_cpu_offload without use_precision_aware_optimizer; megatron-core's OptimizerConfig then leaves
    use_precision_aware_optimizer_no_fp8_or_ds_fp8 False, so the distributed optimizer keeps fp32 main shards of
    its own under the HybridDeviceOptimizer (optimizer/__init__.py, distrib_optimizer.py 0.19.2). memguard
    estimates that path: the fp32 main shards stay whole on the GPU (as without offload), the moments of the
    offloaded half leave it."""
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from megatron_memguard.estimator.core import estimate
    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge
    from megatron_memguard.resolve import resolve

    overrides = ["optimizer.optimizer_cpu_offload=true", "optimizer.optimizer_offload_fraction=0.5"]
    cfg = process_config_with_overrides(recipes.llama32_1b_pretrain_config(), cli_overrides=overrides)
    _runtime_config_update(cfg, monkeypatch)   # (no assertion: Bridge starts with it)
    assert cfg.optimizer.optimizer_cpu_offload and not cfg.optimizer.use_precision_aware_optimizer
    assert cfg.optimizer.use_precision_aware_optimizer_no_fp8_or_ds_fp8 is False
    assert cfg.optimizer.use_distributed_optimizer

    def terms(extra):
        L = resolve(read_bridge({}, "recipe llama32_1b", parse_overrides(extra), recipe="llama32_1b"), world_size=8)
        return L, {t.name: t.bytes for t in estimate(L).stages[-1].terms}

    L, off = terms(overrides)
    assert L.optimizer_cpu_offload is True and not L.use_precision_aware_optimizer
    _, plain = terms([])
    # the distributed optimizer's fp32 main shards are the same with and without offload; Adam's moments halve
    # (offload_bytes rounds fraction x shard)
    assert off["main_parameters"] == plain["main_parameters"]
    assert off["adam_exp_avg"] == round(plain["adam_exp_avg"] / 4 * 0.5) * 4
    # with the precision-aware optimizer (Megatron-LM's path) Bridge and memguard both go on too
    on = overrides + ["optimizer.use_precision_aware_optimizer=true"]
    raw = read_bridge({}, "recipe llama32_1b", parse_overrides(on), recipe="llama32_1b")
    assert resolve(raw, world_size=8).optimizer_cpu_offload is True


# --------------------------------------------------------------------------------------------------
# Megatron-FSDP and the checkpoint format: ConfigContainer.validate asserts fsdp_dtensor with Megatron-FSDP (and
# Megatron-FSDP with fsdp_dtensor) when the job saves or loads, as every recipe does (recipes/common.py)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, refused", [
    (["ddp.use_megatron_fsdp=true"], True),
    (["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params",
      "checkpoint.ckpt_format=fsdp_dtensor"], False),
    (["ddp.use_megatron_fsdp=true", "checkpoint.save=null", "checkpoint.load=null"], False),
    (["checkpoint.ckpt_format=fsdp_dtensor"], True),
], ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_megatron_fsdp_checkpoint_format_is_refused_as_bridge_refuses_it(recipes, monkeypatch, overrides, refused):
    from megatron_memguard.resolve import resolve

    # (FSDP also asserts CUDA_DEVICE_MAX_CONNECTIONS is not 1, which the launch environment decides)
    cfg, bridge, raw = _llama3_8b_launch(overrides, monkeypatch, unset_env=("CUDA_DEVICE_MAX_CONNECTIONS",))
    assert (bridge is not None) == refused, bridge
    assert [p.key for p in raw.problems] == (["checkpoint.ckpt_format"] if refused else [])
    if refused:
        assert "fsdp_dtensor" in bridge and "checkpoint.ckpt_format=" in str(raw.problems[0])
    else:
        assert resolve(raw, world_size=WORLD).use_megatron_fsdp == cfg.ddp.use_megatron_fsdp


# --------------------------------------------------------------------------------------------------
# run_recipe.py with MoE / FP8 / long-context / CUDA-graph / offload overrides, finalized by Bridge itself
# (runtime_config_update): every memory field memguard check reads equals the container's
# --------------------------------------------------------------------------------------------------
FINALIZED_LAUNCHES = [
    (8, ["--recipe", "qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config", "-tp", "2", "model.sequence_parallel=true", "-ep", "4",
         "model.moe_token_dispatcher_type=alltoall"]),
    (16, ["--recipe", "deepseek_v2_lite_pretrain_config", "model.recompute_granularity=selective",
          "model.recompute_method=null", "model.recompute_num_layers=null", "model.recompute_modules=[moe_act,layernorm]",
          "model.moe_shared_expert_overlap=false", "-ep", "4"]),
    (16, ["--recipe", "olmoe_7b_pretrain_config", "model.moe_grouped_gemm=false", "model.moe_expert_capacity_factor=1.0",
          "model.moe_pad_expert_input_to_capacity=true"]),
    (256, ["--recipe", "deepseek_v3_pretrain_config_32nodes", "model.moe_token_dispatcher_type=alltoall"]),
    (16, ["--recipe", "llama3_8b_pretrain_config", "mixed_precision=bf16_with_fp8_delayed_scaling_mixed"]),
    # a model FP8 field under the recipe's bf16_mixed preset: MixedPrecisionConfig.setup writes fp8 None over it
    (16, ["--recipe", "llama3_8b_pretrain_config", "model.fp8=hybrid", "model.fp8_recipe=tensorwise"]),
    (16, ["--recipe", "llama3_8b_low_precision_pretrain_config", "model.fp8_param=false"]),
    (64, ["--recipe", "llama3_8b_128k_pretrain_config", "-cp", "8", "-tp", "4"]),
    # (the recipe's TE CUDA graphs of the router)
    (16, ["--recipe", "qwen3_30b_a3b_pretrain_config", "model.moe_token_dispatcher_type=alltoall", "-tp", "2",
          "model.sequence_parallel=true", "model.expert_tensor_parallel_size=1", "-ep", "8"]),
    (16, ["--recipe", "llama3_8b_pretrain_config", "optimizer.optimizer_cpu_offload=true",
          "optimizer.optimizer_offload_fraction=0.5", "optimizer.use_precision_aware_optimizer=true"]),
    (16, ["--recipe", "llama3_8b_pretrain_config", "model.cpu_offloading=true", "model.cpu_offloading_num_layers=4"]),
    (32, ["--recipe", "llama3_70b_pretrain_config", "-pp", "4", "-vp", "4", "model.num_layers_in_first_pipeline_stage=16",
          "model.num_layers_in_last_pipeline_stage=24"]),
    # issue bridge17 item 3: recipe families and finalize paths the launches above leave out
    (16, ["--recipe", "llama2_7b_pretrain_config", "-tp", "2", "model.sequence_parallel=true", "-pp", "2", "-vp", "4"]),
    # TransformerConfig.finalize (Bridge models/transformer_config.py) switches sequence parallelism off at TP 1
    (8, ["--recipe", "qwen2_1p5b_pretrain_config", "model.sequence_parallel=true"]),
    (16, ["--recipe", "qwen3_600m_pretrain_config", "model.recompute_granularity=full", "model.recompute_method=block",
          "model.recompute_num_layers=4"]),
    (512, ["--recipe", "llama3_70b_64k_pretrain_config", "-cp", "16", "-mb", "1"]),
    (32, ["--recipe", "llama3_8b_64k_pretrain_config", "-cp", "4", "-tp", "2", "model.sequence_parallel=false"]),
    (256, ["--recipe", "llama31_405b_pretrain_config", "model.virtual_pipeline_model_parallel_size=null"]),
    (16, ["--recipe", "llama3_8b_pretrain_2gpu_h100_fp8mx_config", "-tp", "2", "model.sequence_parallel=true"]),
    (16, ["--recipe", "llama3_8b_pretrain_2gpu_h100_nvfp4_config", "-mb", "2"]),
    (16, ["--recipe", "gemma3_1b_pretrain_1gpu_h100_bf16_config", "-pp", "2", "model.recompute_granularity=selective",
          "model.recompute_modules=[mlp]"]),
    # the recipe's TP communication overlap, which CommOverlapConfig switches off without sequence parallelism
    (4, ["--recipe", "nemotronh_8b_pretrain_config", "model.sequence_parallel=false"]),
    (32, ["--recipe", "qwen25_32b_pretrain_config", "-tp", "4", "-pp", "2", "model.sequence_parallel=true",
          "model.fine_grained_activation_offloading=true", "model.offload_modules=[core_attn]"]),
    (16, ["--recipe", "olmoe_7b_pretrain_config", "model.moe_token_dispatcher_type=allgather", "model.moe_router_dtype=fp32",
          "-ep", "4"]),
    (16, ["--recipe", "llama3_8b_pretrain_config", "mixed_precision=bf16_with_fp8_subchannel_scaling_mixed", "-tp", "2",
          "model.sequence_parallel=true"]),
    (16, ["--recipe", "llama31_8b_pretrain_config", "ddp.use_megatron_fsdp=true", "checkpoint.ckpt_format=fsdp_dtensor",
          "ddp.data_parallel_sharding_strategy=optim_grads_params"]),
    # Llama 2's CommOverlapConfig(tp_comm_overlap=False) turned on; the TP-overlap recipe at TP 1 (switched off)
    (16, ["--recipe", "llama2_7b_pretrain_config", "-tp", "2", "model.sequence_parallel=true",
          "comm_overlap.tp_comm_overlap=true"]),
    (4, ["--recipe", "nemotronh_8b_pretrain_config", "-tp", "1"]),
    (32, ["--recipe", "llama3_70b_16k_pretrain_config", "-tp", "4"]),
    (128, ["--recipe", "deepseek_v2_pretrain_config", "model.moe_token_dispatcher_type=alltoall",
           "model.recompute_granularity=selective", "model.recompute_method=null", "model.recompute_num_layers=null",
           "model.recompute_modules=[mla_up_proj,layernorm]"]),
    (256, ["--recipe", "qwen3_235b_a22b_pretrain_config", "model.moe_token_dispatcher_type=alltoall", "-cp", "1"]),
    # the expert all-to-all overlap with delayed weight gradients (CommOverlapConfig's `is True` checks, then core's)
    (16, ["--recipe", "deepseek_v2_lite_pretrain_config", "comm_overlap.overlap_moe_expert_parallel_comm=true",
          "comm_overlap.delay_wgrad_compute=true", "model.recompute_granularity=null", "model.recompute_method=null",
          "model.recompute_num_layers=null", "model.moe_shared_expert_overlap=false", "-ep", "4"]),
    (16, ["--recipe", "llama3_8b_pretrain_config", "ddp.use_megatron_fsdp=true", "checkpoint.ckpt_format=fsdp_dtensor",
          "ddp.data_parallel_sharding_strategy=optim_grads", "ddp.fsdp_double_buffer=true"]),
    (16, ["--recipe", "olmoe_7b_pretrain_config", "-tp", "2", "model.sequence_parallel=true",
          "model.expert_tensor_parallel_size=2", "-ep", "4"]),
    (256, ["--recipe", "qwen3_235b_a22b_pretrain_config", "model.moe_token_dispatcher_type=alltoall", "-pp", "8"]),
    (16, ["--recipe", "llama3_8b_pretrain_config", "model.cuda_graph_impl=full_iteration",
          "rerun_state_machine.check_for_nan_in_loss=false"]),
    (16, ["--recipe", "qwen3_8b_pretrain_config", "model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=null",
          "model.cuda_graph_modules=[attn,mlp]"]),
    (8, ["--recipe", "qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config", "model.moe_token_dispatcher_type=alltoall",
         "mixed_precision=bf16_with_fp8_current_scaling_mixed", "model.moe_router_padding_for_quantization=true"]),
    (16, ["--recipe", "deepseek_v2_lite_pretrain_config", "mixed_precision=bf16_with_fp8_subchannel_scaling_mixed"]),
    # issue bridge18 item 2: the recipes of memguard's table no launch above took, with overrides of their own
    (1024, ["--recipe", "deepseek_v3_pretrain_config", "model.moe_token_dispatcher_type=alltoall",
            "model.recompute_granularity=selective", "model.recompute_modules=[mla_up_proj,moe_act]", "-gb", "2048"]),
    (32, ["--recipe", "qwen25_72b_pretrain_config", "-vp", "5", "model.sequence_parallel=true"]),
    (64, ["--recipe", "qwen2_72b_pretrain_config", "-pp", "2", "model.recompute_granularity=full",
          "model.recompute_method=uniform", "model.recompute_num_layers=1"]),
    (32, ["--recipe", "qwen3_32b_pretrain_config", "-cp", "2", "model.recompute_granularity=selective",
          "model.recompute_method=null", "model.recompute_num_layers=null"]),
    (8, ["--recipe", "qwen25_7b_pretrain_config", "model.sequence_parallel=true", "-mb", "4",
         "model.cross_entropy_loss_fusion=false"]),
    (16, ["--recipe", "qwen3_14b_pretrain_config", "-tp", "4", "-pp", "2",
          "model.account_for_embedding_in_pipeline_split=true", "model.account_for_loss_in_pipeline_split=true"]),
    (64, ["--recipe", "llama31_70b_pretrain_config", "-cp", "4", "-sl", "32768"]),
    (16, ["--recipe", "qwen2_7b_pretrain_config", "model.sequence_parallel=true", "ddp.overlap_grad_reduce=false"]),
    (32, ["--recipe", "llama3_8b_16k_pretrain_config", "-vp", "4"]),
    (8, ["--recipe", "qwen3_1p7b_pretrain_config", "-mb", "1", "-gb", "64", "model.qk_layernorm=yes"]),
    (4, ["--recipe", "qwen3_8b_pretrain_4gpu_h100_bf16_config", "-tp", "2", "model.sequence_parallel=true"]),
    (512, ["--recipe", "llama31_405b_pretrain_deterministic_config", "-gb", "256"]),
    (8, ["--recipe", "qwen2_500m_pretrain_config", "model.share_embeddings_and_output_weights=false", "-sl", "8192"]),
    # item 1: CommOverlapConfig's `is True` guards (comm_overlap.py:478, 520) skipped by 1 / yes: megatron-core's
    # TransformerConfig.__post_init__ repeats the same checks by truth, so the overlap is on as for true
    (16, ["--recipe", "deepseek_v2_lite_pretrain_config", "comm_overlap.overlap_moe_expert_parallel_comm=1",
          "comm_overlap.delay_wgrad_compute=yes", "model.recompute_granularity=null", "model.recompute_method=null",
          "model.recompute_num_layers=null", "model.moe_shared_expert_overlap=false", "-ep", "4"]),
]


def _bridge_memory_fields(cfg) -> dict:
    """_bridge_values and the MoE, FP8, CUDA-graph, offload, MTP and uneven-stage fields of the finalized container."""
    m, o = cfg.model, cfg.optimizer
    selective = m.recompute_granularity == "selective"
    v = {**_bridge_values(cfg), "fp8": m.fp8, "fp8_recipe": m.fp8_recipe if m.fp8 else None,
         "fp8_param_gather": bool(m.fp8_param) if m.fp8 else None, "fp4": m.fp4,
         "cuda_graph_impl": m.cuda_graph_impl,
         "cuda_graph_modules": sorted(getattr(x, "name", x) for x in (m.cuda_graph_modules or [])),
         "recompute_modules": sorted(m.recompute_modules or []) if selective else None,
         "mtp_num_layers": m.mtp_num_layers or None,
         "decoder_first_pipeline_num_layers": m.num_layers_in_first_pipeline_stage,
         "decoder_last_pipeline_num_layers": m.num_layers_in_last_pipeline_stage,
         "cpu_offloading_num_layers": m.cpu_offloading_num_layers if m.cpu_offloading else 0,
         "optimizer_cpu_offload": o.optimizer_cpu_offload,
         "fine_grained_activation_offloading": bool(m.fine_grained_activation_offloading),
         "offload_modules": sorted(m.offload_modules or []) if m.fine_grained_activation_offloading else [],
         "use_megatron_fsdp": bool(cfg.ddp.use_megatron_fsdp),
         "data_parallel_sharding_strategy": (cfg.ddp.data_parallel_sharding_strategy if cfg.ddp.use_megatron_fsdp
                                             else None),
         "num_microbatches": cfg.train.global_batch_size // (cfg.train.micro_batch_size * cfg.data_parallel_size)}
    if o.optimizer_cpu_offload:
        v["optimizer_offload_fraction"] = o.optimizer_offload_fraction
    if m.num_moe_experts:
        freq = m.moe_layer_freq
        v.update(num_experts=m.num_moe_experts, moe_router_topk=m.moe_router_topk, moe_ffn_hidden_size=m.moe_ffn_hidden_size,
                 moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
                 moe_layer_pattern=[bool(x) for x in freq] if isinstance(freq, list) else
                 [i % freq == 0 for i in range(m.num_layers)],
                 expert_model_parallel_size=m.expert_model_parallel_size,
                 expert_tensor_parallel_size=m.expert_tensor_parallel_size or m.tensor_model_parallel_size,
                 moe_token_dispatcher_type=m.moe_token_dispatcher_type, moe_grouped_gemm=m.moe_grouped_gemm,
                 moe_router_dtype=m.moe_router_dtype, moe_shared_expert_overlap=m.moe_shared_expert_overlap,
                 moe_expert_capacity_factor=m.moe_expert_capacity_factor,
                 moe_pad_expert_input_to_capacity=m.moe_pad_expert_input_to_capacity,
                 overlap_moe_expert_parallel_comm=bool(m.overlap_moe_expert_parallel_comm),
                 delay_wgrad_compute=bool(m.delay_wgrad_compute))
    if cfg.ddp.use_megatron_fsdp:
        v["fsdp_double_buffer"] = bool(cfg.ddp.fsdp_double_buffer)
    return v


def _memguard_memory_fields(L) -> dict:
    d = {**L.to_dict(), **(L.to_dict().get("moe") or {})}
    d.update(fp8=L.fp8, fp8_recipe=L.fp8_recipe if L.fp8 else None, fp8_param_gather=L.fp8_param_gather if L.fp8 else None,
             fp4=L.fp4, cuda_graph_impl=L.cuda_graph_impl, cuda_graph_modules=sorted(L.cuda_graph_modules or ()),
             recompute_modules=sorted(L.recompute_modules or ()) if L.recompute_granularity == "selective" else None,
             mtp_num_layers=L.mtp_num_layers or None, cpu_offloading_num_layers=L.cpu_offloading_num_layers or 0,
             optimizer_cpu_offload=L.optimizer_cpu_offload, optimizer_offload_fraction=L.optimizer_offload_fraction,
             fine_grained_activation_offloading=L.fine_grained_activation_offloading, use_megatron_fsdp=L.use_megatron_fsdp,
             fsdp_double_buffer=L.fsdp_double_buffer,
             overlap_moe_expert_parallel_comm=bool(L.moe and L.moe.overlap_moe_expert_parallel_comm),
             delay_wgrad_compute=bool(L.moe and L.moe.delay_wgrad_compute),
             offload_modules=sorted(L.offload_modules or ()) if L.fine_grained_activation_offloading else [],
             data_parallel_sharding_strategy=L.data_parallel_sharding_strategy if L.use_megatron_fsdp else None)
    return d


@pytest.mark.parametrize("world, argv", FINALIZED_LAUNCHES, ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_run_recipe_overrides_read_as_bridge_finalizes_them(recipes, monkeypatch, world, argv):
    from megatron_memguard.config import MEMORY_ENV_VARS
    from megatron_memguard.readers.run_recipe import read_run_recipe
    from megatron_memguard.resolve import resolve

    for name in MEMORY_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = run_recipe_main("v0.6.0", argv, monkeypatch)
    _runtime_config_update(cfg, monkeypatch)
    real = _bridge_memory_fields(cfg)
    ours = _memguard_memory_fields(resolve(read_run_recipe(argv)[1], world_size=world))
    assert {k: ours.get(k, "missing") for k in real} == real


# --- issue hostile15 item 3: a bool field given a value that is not true / false, as Bridge 0.6.2 takes it ----------
@pytest.mark.parametrize("value", ["true", "false", "1", "0", "2", "0.5", "x", "'false'", "'0'", "no", "off", "yes",
                                   "[1]", "[]", "''", "{a: 1}"])   # (null: hostile8 test above)
@pytest.mark.parametrize("field", ["optimizer.use_precision_aware_optimizer", "optimizer.store_param_remainders"])
def test_a_bool_field_takes_what_bridges_override_path_takes(recipes, field, value):
    """Bridge's override path (training/utils/omegaconf_utils.py) converts the config to a plain DictConfig, applies the
    override with Hydra's grammar and setattr's the result: no type check, and the code reading the field tests its
    truth. hostile13 refused 'x', 2 or 0.5 as OmegaConf's structured config would; Bridge sets them (and the text
    'false' or the word no, which Hydra keeps a string, is true). memguard now reads the same truth, with a warning."""
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge

    sec, name = field.split(".")
    cfg = process_config_with_overrides(recipes.llama32_1b_pretrain_config(), cli_overrides=[f"{field}={value}"])
    bridge = bool(getattr(getattr(cfg, sec), name))
    raw = read_bridge({}, "recipe llama32_1b", parse_overrides([f"{field}={value}"]), recipe="llama32_1b")
    assert bool(raw.args.get(name)) is bridge
    plain = value in ("true", "false")
    assert any(w.startswith(f"{field}: ") and "Megatron-Bridge 0.6.2 sets it unchecked" in w
               for w in raw.warnings) is not plain, raw.warnings


# --- issue bridge17 item 1: a model flag given a value that is not true / false, as Bridge 0.6.2 builds it -----------
# (field, the recipe overrides that make it matter, the Layout field memguard estimates it under)
MODEL_FLAGS = [
    ("model.sequence_parallel", ["model.tensor_model_parallel_size=2"], "sequence_parallel"),
    ("model.gradient_accumulation_fusion", [], "gradient_accumulation_fusion"),
    ("model.qk_layernorm", [], "qk_layernorm"),
    ("model.add_bias_linear", [], "add_bias_linear"),
    ("model.cross_entropy_loss_fusion", [], "cross_entropy_loss_fusion"),
    # (on: 32 layers + the embedding do not split over 2 stages, which Bridge's finalize refuses: memguard must too)
    ("model.account_for_embedding_in_pipeline_split", ["model.pipeline_model_parallel_size=2"],
     "account_for_embedding_in_pipeline_split"),
]


@pytest.mark.parametrize("value", ["true", "false", "1", "0", "2", "yes", "no", "'false'", "x", "[1]", "''"])
@pytest.mark.parametrize("field, extra, dest", MODEL_FLAGS, ids=[f[0] for f in MODEL_FLAGS])
def test_a_model_flag_takes_what_bridge_builds(recipes, monkeypatch, field, extra, dest, value):
    """Bridge's override path setattr's the Hydra value on the provider unchecked (training/utils/omegaconf_utils.py),
    GPTModelProvider.finalize / TransformerConfig.__post_init__ keep it, and the model code tests its truth: '1', 'yes'
    and the text 'false' or the word no are on, 0 and '' off. memguard read 'false' and no as off and refused 2 or x;
    now it reads the truth Bridge builds with, with a warning naming the key."""
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge
    from megatron_memguard.resolve import resolve

    overrides = [*extra, f"{field}={value}"]
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    cfg = process_config_with_overrides(recipes.llama3_8b_pretrain_config(), cli_overrides=overrides)
    raw = read_bridge({}, "recipe llama3_8b", parse_overrides(overrides), recipe="llama3_8b")
    plain = value in ("true", "false")
    assert any(w.startswith(f"{field}: ") and "Megatron-Bridge 0.6.2 sets it unchecked" in w
               for w in raw.warnings) is not plain, raw.warnings
    try:
        _runtime_config_update(cfg, monkeypatch)     # (finalize: the model's __post_init__ runs on the value)
    except ValueError as e:                          # (Bridge refuses the layout the value makes: so does memguard)
        from megatron_memguard.errors import MemguardError
        with pytest.raises(MemguardError):
            resolve(raw, world_size=WORLD)
        assert "divisible" in str(e)
        return
    bridge = bool(getattr(cfg.model, field.split(".")[1]))
    assert getattr(resolve(raw, world_size=WORLD), dest) is bridge
    # preflight() on the container Bridge built (the value as Bridge holds it) reads the same
    from megatron_memguard.bridge import raw_config
    assert getattr(resolve(raw_config(cfg), world_size=WORLD), dest) is bridge


# --- issue bridge17 item 2: comm_overlap flags Bridge tests with `is True` ----------------------------------------------
@pytest.mark.parametrize("tp, sp", [(2, True), (2, False), (1, False)])
@pytest.mark.parametrize("value", ["true", "false", "1", "0", "yes", "''"])
def test_tp_comm_overlap_is_read_as_bridges_is_true_takes_it(recipes, monkeypatch, tp, sp, value):
    """CommOverlapConfig._get_model_comm_overlap_cfgs (Bridge 0.6.2 comm_overlap.py) switches TP communication overlap
    off at TP < 2 or without sequence parallelism only when ``tp_comm_overlap is True``; _override_user_cfgs then
    copies any other value into the model config, whose truth starts the userbuffers (initialize.py). memguard read 1
    as true and switched it off like true. Now: the same on / off where Bridge's check runs, and where a true value
    that is not True skips it, a problem naming the key (Bridge would start the userbuffers without sequence
    parallelism)."""
    from megatron.bridge.training.comm_overlap import CommOverlapConfig

    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge
    from megatron_memguard.resolve import resolve

    overrides = [f"model.tensor_model_parallel_size={tp}", f"model.sequence_parallel={str(sp).lower()}",
                 f"comm_overlap.tp_comm_overlap={value}"]
    # (the Llama 3 8B recipe has no comm_overlap: Llama 2 7B's is CommOverlapConfig(tp_comm_overlap=False))
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    base = recipes.llama2_7b_pretrain_config()
    assert isinstance(base.comm_overlap, CommOverlapConfig)
    cfg = process_config_with_overrides(base, cli_overrides=overrides)
    _runtime_config_update(cfg, monkeypatch)
    bridge = bool(cfg.model.tp_comm_overlap)
    raw = read_bridge({}, "recipe llama2_7b", parse_overrides(overrides), recipe="llama2_7b")
    key = "comm_overlap.tp_comm_overlap"
    if value in ("true", "false") or not bridge or (tp >= 2 and sp):
        assert not raw.problems, raw.problems
        assert resolve(raw, world_size=WORLD).tp_comm_overlap is bridge
        assert any(w.startswith(f"{key}: ") and "sets it unchecked" in w for w in raw.warnings) is (value not in ("true", "false"))
    else:
        # Bridge leaves the overlap on where `true` would be switched off: a problem naming the key, estimate stops
        assert [p.key for p in raw.problems] == [key], raw.problems
        assert "only for a value that `is True`" in str(raw.problems[0])


@pytest.mark.parametrize("field", ["comm_overlap.overlap_grad_reduce", "mixed_precision.grad_reduce_in_fp32"])
@pytest.mark.parametrize("value", ["1", "0", "'false'", "x"])
def test_comm_overlap_and_mixed_precision_flags_take_their_truth(recipes, monkeypatch, tmp_path, field, value):
    """CommOverlapConfig's other flags and MixedPrecisionConfig's are copied into the model / DDP configs unchecked
    (_override_user_cfgs, update_config_with_precision_overrides) and read by truth there. A run_config.yaml whose
    mixed_precision is a mapping (the Llama 2 7B recipe's dump, which has a comm_overlap section) with the value,
    loaded by Bridge as run_recipe.py's --config-file merges it; memguard reads the same file."""
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from megatron_memguard.readers.detect import read_config_file
    from megatron_memguard.resolve import resolve

    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    sec, name = field.split(".")
    base = recipes.llama2_7b_pretrain_config()
    from megatron.bridge.training.mixed_precision import get_mixed_precision_config
    base.mixed_precision = get_mixed_precision_config(base.mixed_precision)   # (a mapping in the dump)
    dump = tmp_path / "run_config.yaml"
    base.to_yaml(str(dump))
    text = dump.read_text()
    import yaml
    doc = yaml.safe_load(text)
    doc[sec][name] = yaml.safe_load(value)
    dump.write_text(yaml.safe_dump(doc))
    over = tmp_path / "over.yaml"
    over.write_text(yaml.safe_dump({sec: {name: yaml.safe_load(value)}}))
    cfg = process_config_with_overrides(base, config_filepath=str(over))
    _runtime_config_update(cfg, monkeypatch)
    raw = read_config_file(str(dump))
    L = resolve(raw, world_size=WORLD)
    if name == "grad_reduce_in_fp32":
        assert L.grad_reduce_in_bf16 is (not bool(cfg.ddp.grad_reduce_in_fp32))
    else:
        assert L.overlap_grad_reduce is bool(cfg.ddp.overlap_grad_reduce)
    assert any(w.startswith(f"{field}: ") and "sets it unchecked" in w for w in raw.warnings), raw.warnings


@pytest.mark.parametrize("value", ["1", "yes", "'false'", "x"])
def test_a_model_precision_flag_the_mixed_precision_preset_overwrites_is_the_presets(recipes, monkeypatch, value):
    """MixedPrecisionConfig.setup (Bridge 0.6.2 training/mixed_precision.py) writes every field it has over the model's:
    model.fp16=x under the recipe's bf16_mixed is fp16 off, as Bridge builds it, without the truth warning."""
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge
    from megatron_memguard.resolve import resolve

    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    cfg = process_config_with_overrides(recipes.llama3_8b_pretrain_config(), cli_overrides=[f"model.fp16={value}"])
    _runtime_config_update(cfg, monkeypatch)
    raw = read_bridge({}, "recipe llama3_8b", parse_overrides([f"model.fp16={value}"]), recipe="llama3_8b")
    L = resolve(raw, world_size=WORLD)
    assert (L.fp16, L.bf16) == (cfg.model.fp16, cfg.model.bf16) == (False, True)
    assert not any(w.startswith("model.fp16: ") for w in raw.warnings), raw.warnings


# --- issue bridge18 item 1: model flags megatron-core compares with a bool (==, is) where the model is built ----------
@pytest.mark.parametrize("value", ["false", "0", "0.0", "''", "[]"])
def test_a_false_add_bias_linear_is_what_bridges_shared_experts_build_takes(recipes, monkeypatch, value):
    """SharedExpertMLP.__init__ (megatron-core 0.19.2 transformer/moe/shared_experts.py:124) asserts
    ``config.add_bias_linear == False``: Bridge's override path sets the value unchecked and finalize keeps it, so on
    DeepSeek-V2-Lite (shared experts) 0 builds (0 == False) but '' or [] stop the build, although their truth is off.
    memguard read every false value as off and estimated; now '' and [] are a problem naming the key."""
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from megatron_memguard.bridge import raw_config
    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge
    from megatron_memguard.resolve import resolve

    override = f"model.add_bias_linear={value}"
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    cfg = process_config_with_overrides(recipes.deepseek_v2_lite_pretrain_config(), cli_overrides=[override])
    _runtime_config_update(cfg, monkeypatch)      # (finalize keeps the value: TransformerConfig tests its truth)
    assert cfg.model.moe_shared_expert_intermediate_size and not cfg.model.add_bias_linear
    try:   # (the assertion is the constructor's first check: submodules are not reached when it fails)
        SharedExpertMLP(cfg.model, submodules=None, gate=False)
        builds = True
    except AssertionError as e:
        assert "bias is not supported in the shared experts" in str(e)
        builds = False
    except Exception:   # noqa: BLE001 - past the assertion, the stand-in submodules stop it
        builds = True
    assert builds is (value in ("false", "0", "0.0"))
    for raw in (read_bridge({}, "recipe deepseek_v2_lite", parse_overrides([override]), recipe="deepseek_v2_lite"),
                raw_config(cfg)):
        assert [p.key for p in raw.problems] == ([] if builds else ["model.add_bias_linear"]), raw.problems
        if builds:
            assert resolve(raw, world_size=WORLD).add_bias_linear is False
        else:
            assert "SharedExpertMLP asserts `add_bias_linear == False`" in str(raw.problems[0])


@pytest.mark.parametrize("value", ["true", "1", "yes", "'false'", "false", "0"])
def test_add_bias_linear_on_the_fused_bias_gelu_path_is_what_bridges_model_runs(recipes, monkeypatch, value):
    """A GeLU MLP without a gated linear unit and with bias_activation_fusion (llama3_8b made so by overrides):
    TransformerConfig.__post_init__ (megatron-core 0.19.2) refuses a false add_bias_linear by truth, and MLP.forward
    (transformer/mlp.py:306) asserts ``add_bias_linear is True``: 1, 'yes' or the text 'false' build, then the first
    training step stops. memguard estimated all of them; now a false value is refused under model.bias_activation_fusion
    and a true value that is not True is a problem naming model.add_bias_linear. MLP.forward runs on the finalized
    config with linears that hand back their input and the bias the config asks for (no parallel state on CPU)."""
    import types

    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.mlp import MLP
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from megatron_memguard.errors import ConfigError
    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge
    from megatron_memguard.resolve import resolve

    overrides = ["model.activation_func=gelu", "model.gated_linear_unit=false", "model.bias_activation_fusion=true",
                 f"model.add_bias_linear={value}"]
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    cfg = process_config_with_overrides(recipes.llama3_8b_pretrain_config(), cli_overrides=overrides)
    raw = read_bridge({}, "recipe llama3_8b", parse_overrides(overrides), recipe="llama3_8b")
    try:
        _runtime_config_update(cfg, monkeypatch)
    except ValueError as e:      # (TransformerConfig: the fused bias-GeLU without biases)
        assert "add_bias_linear must also be True" in str(e) and value in ("false", "0")
        with pytest.raises(ConfigError, match=r"^model\.bias_activation_fusion: the fused bias-GeLU needs biases"):
            resolve(raw, world_size=WORLD)
        return
    assert cfg.model.activation_func is F.gelu and cfg.model.add_bias_linear

    class Linear(torch.nn.Module):
        def __init__(self, bias):
            super().__init__()
            self.bias = bias

        def forward(self, x):
            return x, self.bias

    mlp = types.SimpleNamespace(config=cfg.model, activation_func=cfg.model.activation_func,
                                linear_fc1=Linear(torch.zeros(8)), linear_fc2=Linear(None))
    try:
        MLP.forward(mlp, torch.randn(2, 1, 8))
        steps = True
    except AssertionError:
        steps = False
    assert steps is (value == "true")
    assert [p.key for p in raw.problems] == ([] if steps else ["model.add_bias_linear"]), raw.problems
    if steps:
        assert resolve(raw, world_size=WORLD).add_bias_linear is True
    else:
        assert "MLP.forward asserts `add_bias_linear is True`" in str(raw.problems[0])


@pytest.mark.parametrize("mtp", ["2", "null"])
def test_an_mtp_count_the_recipes_layout_does_not_place_is_refused_as_bridge_refuses_it(recipes, monkeypatch, mtp):
    """deepseek_v3_pretrain_config's pipeline_model_parallel_layout places one MTP layer ('m'): Bridge's finalize asserts
    the layout's count is mtp_num_layers (2, or none for null); memguard refuses the layout by its key."""
    from megatron_memguard.errors import ConfigError
    from megatron_memguard.readers.run_recipe import read_run_recipe
    from megatron_memguard.resolve import resolve

    argv = ["--recipe", "deepseek_v3_pretrain_config", "model.moe_token_dispatcher_type=alltoall", f"model.mtp_num_layers={mtp}"]
    monkeypatch.setenv("WORLD_SIZE", "1024")
    cfg = run_recipe_main("v0.6.0", argv, monkeypatch)
    with pytest.raises(AssertionError, match="Number of mtp layers in layout must match mtp_num_layers"):
        _runtime_config_update(cfg, monkeypatch)
    with pytest.raises(ConfigError, match=r"^model\.pipeline_model_parallel_layout \(recipe deepseek_v3\): places 1 MTP"):
        resolve(read_run_recipe(argv)[1], world_size=1024)


def test_every_pretraining_recipe_bridge_ships_is_read_or_refused_by_name_with_the_reason(recipes):
    """Each pretraining recipe function megatron.bridge.recipes 0.6.2 exports: memguard's table reads it (those are
    finalized field by field above), or --recipe / --model refuse it by name with the reason (unmodelled_recipes in
    data/presets.yaml); none falls to the bare 'not a recipe memguard has'. A function Bridge adds fails here."""
    import inspect

    from megatron_memguard.errors import NotModelledError
    from megatron_memguard.readers.models import read_model, recipe_for_function
    from megatron_memguard.readers.run_recipe import read_run_recipe

    functions = sorted(n for n in dir(recipes) if "_pretrain" in n and inspect.isfunction(getattr(recipes, n)))
    read, refused = [], []
    for fn in functions:
        if recipe_for_function(fn):
            read_run_recipe(["--recipe", fn])
            read.append(fn)
            continue
        for call, key in ((lambda: read_run_recipe(["--recipe", fn]), f"--recipe {fn}"), (lambda: read_model(fn), "--model")):
            with pytest.raises(NotModelledError, match=rf"^{key}: the Megatron-Bridge recipe '{fn}' \(.+; its run_config"):
                call()
        refused.append(fn)
    # every pretraining function of memguard's table is one Bridge ships (92 in 0.6.2; its 12 PEFT ones: tests above)
    from megatron_memguard.readers.models import presets
    table = {fn for r in presets()["recipes"].values() for fn in r["functions"]}
    assert set(read) == {fn for fn in table if "_pretrain" in fn} and len(read) == 92
    assert len(refused) == len(functions) - 92 > 0


@pytest.mark.parametrize("dispatcher", [None, "alltoall"])
@pytest.mark.parametrize("value", ["true", "1", "yes", "false"])
def test_variable_seq_lengths_is_true_is_refused_where_bridges_finalize_refuses_it(recipes, monkeypatch, value,
                                                                                     dispatcher):
    """TransformerConfig.__post_init__ (megatron-core 0.19.2) raises for ``variable_seq_lengths is True`` with the
    allgather token dispatcher, the default of a dense recipe too; 1 or 'yes' pass (and are on). memguard estimated
    true; now it is a problem naming the key, as Bridge's finalize stops."""
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge

    overrides = [f"model.variable_seq_lengths={value}"] + ([f"model.moe_token_dispatcher_type={dispatcher}"]
                                                             if dispatcher else [])
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    cfg = process_config_with_overrides(recipes.llama3_8b_pretrain_config(), cli_overrides=overrides)
    try:
        _runtime_config_update(cfg, monkeypatch)
        stops = False
    except ValueError as e:
        assert "does not support variable sequence length" in str(e)
        stops = True
    assert stops is (value == "true" and dispatcher is None)
    raw = read_bridge({}, "recipe llama3_8b", parse_overrides(overrides), recipe="llama3_8b")
    assert [p.key for p in raw.problems] == (["model.variable_seq_lengths"] if stops else []), raw.problems


@pytest.mark.parametrize("layout", [None, "Et*5|(tttt|)*13tttt|mL"])
@pytest.mark.parametrize("value", ["false", "0", "''"])
def test_qk_l2_norm_on_an_mtp_stage_without_decoder_layers_is_what_bridge_builds(recipes, monkeypatch, value, layout):
    """DeepSeek-V3 (MLA, one MTP layer): Bridge's mtp_block_spec (models/gpt_provider.py) re-derives the decoder layer
    specs with ``qk_l2_norm=config.qk_l2_norm`` when the MTP's stage builds no decoder layer (the layout's last stage
    'mL'), and megatron-core 0.19.2's MLA layer spec asserts ``qk_l2_norm is False``: 0 or '' stop that build, false
    does not; with the recipe's own layout (a decoder layer beside the MTP) every false value builds. The MTP spec is
    built as on the last of the 16 pipeline ranks (parallel_state's rank queries stood in: no process group on CPU)."""
    from megatron.bridge.models.gpt_provider import mtp_block_spec
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides
    from megatron.core import parallel_state

    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge

    overrides = [f"model.qk_l2_norm={value}", "model.moe_token_dispatcher_type=alltoall"] + (
        [f"model.pipeline_model_parallel_layout='{layout}'"] if layout else [])
    monkeypatch.setenv("WORLD_SIZE", "1024")
    cfg = process_config_with_overrides(recipes.deepseek_v3_pretrain_config(), cli_overrides=overrides)
    _runtime_config_update(cfg, monkeypatch)
    assert cfg.model.pipeline_model_parallel_size == 16 and cfg.model.mtp_num_layers == 1
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda *a, **k: 15)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda *a, **k: 16)
    try:
        mtp_block_spec(cfg.model, vp_stage=None)
        builds = True
    except AssertionError as e:
        assert "qk_l2_norm is not supported with MLA" in str(e)
        builds = False
    assert builds is (value == "false" or layout is None)
    raw = read_bridge({}, "recipe deepseek_v3", parse_overrides(overrides), recipe="deepseek_v3")
    assert [p.key for p in raw.problems] == ([] if builds else ["model.qk_l2_norm"]), raw.problems
