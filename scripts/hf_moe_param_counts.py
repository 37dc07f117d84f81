"""Regenerate tests/data/moe_reference_counts.json: parameter counts of MoE models as Hugging Face
`transformers` builds them from their config.json (run at development time, not by the tests).

    python scripts/hf_moe_param_counts.py [--check]

Needs `transformers` and torch (the CPU wheel). Every model is built on the meta device
(`with torch.device("meta")`): no weights are allocated or downloaded. The config.json files are the
fixtures under tests/data/hf/ (their sources are listed in SOURCES below and copied into the output).
Per model the output holds the total (``num_parameters``: every parameter of the CausalLM module) and a
split by role (embedding, output layer, attention, dense MLPs, routed experts, shared experts, routers,
norms), so that a test can check each term of memguard's count, not only the sum.

--check recomputes and compares with the committed file instead of writing it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Dict

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
HF_DIR = os.path.join(ROOT, "tests", "data", "hf")
OUT = os.path.join(ROOT, "tests", "data", "moe_reference_counts.json")

_RECALLED = ("written from the published config.json of the Hugging Face hub repository {repo} as recalled "
             "without network access (no download); the fields that decide the parameter count reproduce the "
             "total the model card publishes ({published})")
# fixture file -> (hub repository, published total on the model card / technical report, fields not pinned)
SOURCES: Dict[str, Dict[str, Any]] = {
    "mixtral-8x7b.json": {
        "repo": "mistralai/Mixtral-8x7B-v0.1", "published": "46.7B; issue 16 gives 46,702,792,704",
        "unsure": []},
    "qwen1.5-moe-a2.7b.json": {
        "repo": "Qwen/Qwen1.5-MoE-A2.7B", "published": "14.3B total, 2.7B activated", "unsure": []},
    "qwen2-57b-a14b.json": {
        "repo": "Qwen/Qwen2-57B-A14B", "published": "57B total, 14B activated",
        "unsure": ["max_position_embeddings", "sliding_window", "transformers_version"]},
    "qwen3-30b-a3b.json": {
        "repo": "Qwen/Qwen3-30B-A3B", "published": "30.5B total, 3.3B activated", "unsure": []},
    "qwen3-235b-a22b.json": {
        "repo": "Qwen/Qwen3-235B-A22B", "published": "235B total, 22B activated", "unsure": []},
    "deepseek-v2-lite.json": {
        "repo": "deepseek-ai/DeepSeek-V2-Lite", "published": "15.7B total, 2.4B activated", "unsure": []},
    "deepseek-v2.json": {
        "repo": "deepseek-ai/DeepSeek-V2", "published": "236B total, 21B activated",
        "unsure": ["transformers_version"]},
    "deepseek-v3.json": {
        "repo": "deepseek-ai/DeepSeek-V3", "published": "671B main model + 14B MTP module (685B in the checkpoint)",
        "unsure": []},
}

# Parameter roles by module path (transformers >= 5 names; the per-expert ModuleList names of 4.x too).
_ROLES = [
    ("embedding", r"^model\.embed_tokens\."),
    ("output_layer", r"^lm_head\."),
    ("final_norm", r"^model\.norm\."),
    ("norms", r"^model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\."),
    ("attention", r"^model\.layers\.\d+\.self_attn\."),
    ("routed_experts", r"^model\.layers\.\d+\.(mlp|block_sparse_moe)\.experts\."),
    ("shared_experts", r"^model\.layers\.\d+\.mlp\.shared_experts?\."),
    ("shared_expert_gate", r"^model\.layers\.\d+\.mlp\.shared_expert_gate\."),
    ("router", r"^model\.layers\.\d+\.(mlp|block_sparse_moe)\.gate\."),
    ("dense_mlp", r"^model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\."),
]


def _role(name: str) -> str:
    for role, pat in _ROLES:
        if re.match(pat, name):
            return role
    raise ValueError(f"parameter {name} has no role; extend _ROLES")


def count(path: str) -> Dict[str, Any]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(path) as f:
        cfg = json.load(f)
    build = dict(cfg)
    # the FP8 block-quantization record of DeepSeek-V3 describes the checkpoint's storage, not the
    # architecture; transformers would try to set up an FP8 quantizer (GPU) for it
    build.pop("quantization_config", None)
    build.pop("auto_map", None)  # remote code is not used: transformers' own implementation builds it
    config = AutoConfig.for_model(build.pop("model_type"), **build)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    roles: Dict[str, int] = {}
    moe_layers = set()
    for name, p in model.named_parameters():
        r = _role(name)
        roles[r] = roles.get(r, 0) + p.numel()
        if r in ("routed_experts", "router"):
            moe_layers.add(int(name.split(".")[2]))
    buffers = {n: b.numel() for n, b in model.named_buffers() if "inv_freq" not in n}
    n_layers = cfg["num_hidden_layers"]
    return {
        "model_type": cfg["model_type"],
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "by_role": dict(sorted(roles.items())),
        "num_layers": n_layers,
        "moe_layers": sorted(moe_layers),
        "non_parameter_buffers": sum(buffers.values()),
        "non_parameter_buffer_names": sorted({re.sub(r"\.\d+\.", ".N.", n) for n in buffers}),
        "transformers_class": type(model).__name__,
    }


def generate() -> Dict[str, Any]:
    import torch
    import transformers

    models = {}
    for fname in sorted(os.listdir(HF_DIR)):
        if fname not in SOURCES:
            continue
        src = SOURCES[fname]
        entry = count(os.path.join(HF_DIR, fname))
        entry["config"] = f"tests/data/hf/{fname}"
        entry["source"] = _RECALLED.format(repo=src["repo"], published=src["published"])
        if src["unsure"]:
            entry["fields_not_pinned"] = src["unsure"]
        models[fname[:-len(".json")]] = entry
    return {
        "about": ("Parameter counts of MoE models as transformers builds them on the meta device from the "
                  "config.json fixtures in tests/data/hf/ (regenerate: python scripts/hf_moe_param_counts.py). "
                  "num_parameters counts every parameter of the *ForCausalLM module (embedding and output "
                  "layer included, MTP modules not built by transformers excluded); buffers such as "
                  "DeepSeek-V3's e_score_correction_bias are listed apart."),
        "generated_with": {"transformers": transformers.__version__, "torch": torch.__version__},
        "models": models,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare with the committed file, do not write")
    a = p.parse_args(argv)
    data = generate()
    if a.check:
        with open(OUT) as f:
            old = json.load(f)
        bad = [k for k in data["models"]
               if old["models"].get(k, {}).get("num_parameters") != data["models"][k]["num_parameters"]]
        for k in bad:
            print(f"{k}: committed {old['models'].get(k, {}).get('num_parameters')}, "
                  f"now {data['models'][k]['num_parameters']}")
        return 1 if bad else 0
    with open(OUT, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    for k, v in data["models"].items():
        print(f"{k:<20} {v['num_parameters']:>18,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
