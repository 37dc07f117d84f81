"""FP8 / FP4 settings from every reader, mapped to Megatron's argument names (what resolve reads).

Sources: Megatron-Bridge 0.6.2 training/mixed_precision.py (one function per preset, MixedPrecisionConfig
defaults), NeMo 1 megatron_gpt_config.yaml (model.fp8, fp8_hybrid, fp8_amax_history_len, fp8_params),
NeMo 2 MegatronMixedPrecision's arguments."""
import os
import textwrap

import pytest

from megatron_memguard.readers.detect import read_config_file

from benchmarks.shared_data import CONFIGS
from test_readers_bridge import FLAT


def bridge(tmp_path, mp):
    p = tmp_path / "run_config.yaml"
    p.write_text(textwrap.dedent(FLAT.replace("mixed_precision: bf16_mixed", mp)))
    return read_config_file(str(p))


FP8_KEYS = ("fp8", "fp8_recipe", "fp8_param_gather", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
            "num_layers_at_end_in_bf16", "fp8_amax_history_len", "fp4", "fp4_param_gather",
            "reuse_grad_buf_for_mxfp8_param_ag")


@pytest.mark.parametrize("preset, expect", [
    # bf16_with_fp8_delayed_scaling_mixed: hybrid, delayed, history 1024, fp8_param_gather True
    ("bf16_with_fp8_delayed_scaling_mixed", ("hybrid", "delayed", True, False, 0, 0, 1024, None, False, False)),
    # bf16_with_fp8_current_scaling_mixed: tensorwise, first/last layer BF16 (1 and 1), param gather
    ("bf16_with_fp8_current_scaling_mixed", ("hybrid", "tensorwise", True, True, 1, 1, 1, None, False, False)),
    ("nemotron_h_bf16_with_fp8_current_scaling_mixed", ("hybrid", "tensorwise", True, True, 2, 2, 1, None, False, False)),
    ("nanov2_bf16_with_fp8_current_scaling_mixed", ("hybrid", "blockwise", True, True, 2, 2, 1, None, False, False)),
    # subchannel = blockwise without param gather
    ("bf16_with_fp8_subchannel_scaling_mixed", ("hybrid", "blockwise", False, False, 0, 0, 1, None, False, False)),
    # mxfp8: e4m3, param gather and the shared grad / all-gather buffer
    ("bf16_with_mxfp8_mixed", ("e4m3", "mxfp8", True, False, 0, 0, 1, None, False, True)),
    ("bf16_with_nvfp4_mixed", (None, None, None, None, None, None, None, "e2m1", True, None)),
    ("nemotron_3_ultra_bf16_with_nvfp4_mixed", (None, None, None, True, 0, 16, None, "e2m1", True, None)),
])
def test_bridge_fp8_presets(tmp_path, preset, expect):
    raw = bridge(tmp_path, f"mixed_precision: {preset}")
    got = tuple(raw.args.get(k) for k in FP8_KEYS)
    # FP4 presets: the FP8-only fields are Bridge defaults too; compare what FP4 decides
    if expect[7]:
        assert (raw.args.get("fp8"), raw.args.get("fp4"), raw.args.get("fp4_param_gather"),
                raw.args.get("fp4_recipe")) == (None, "e2m1", True, "nvfp4")
        if expect[3]:
            assert (raw.args["first_last_layers_bf16"], raw.args["num_layers_at_start_in_bf16"],
                    raw.args["num_layers_at_end_in_bf16"]) == expect[3:6]
        return
    assert got == expect
    assert raw.origin["fp8_recipe"] == "mixed_precision"


def test_bridge_mapping_defaults_differ_from_megatron(tmp_path):
    # MixedPrecisionConfig's fp8_recipe default is "tensorwise" (Megatron's --fp8-recipe default: delayed)
    raw = bridge(tmp_path, "mixed_precision:\n  bf16: true\n  params_dtype: bf16\n  fp8: hybrid")
    assert (raw.args["fp8"], raw.args["fp8_recipe"], raw.args["fp8_param_gather"]) == ("hybrid", "tensorwise", False)
    # fp8_param is synchronised with fp8_param_gather (MixedPrecisionConfig.__setattr__)
    raw = bridge(tmp_path, "mixed_precision:\n  bf16: true\n  fp8: e4m3\n  fp8_recipe: blockwise\n  fp8_param: true")
    assert (raw.args["fp8_recipe"], raw.args["fp8_param_gather"]) == ("blockwise", True)
    # bf16_mixed leaves no FP8 field behind
    raw = bridge(tmp_path, "mixed_precision: bf16_mixed")
    assert not any(k in raw.args for k in FP8_KEYS)


def test_bridge_model_fp8_param_maps_to_param_gather(tmp_path):
    text = FLAT.replace("  bf16: true\ntrain", "  bf16: true\n  fp8: hybrid\n  fp8_recipe: delayed\n  fp8_param: true\n"
                        "  disable_parameter_transpose_cache: true\ntrain").replace("mixed_precision: bf16_mixed\n", "")
    p = tmp_path / "run_config.yaml"
    p.write_text(textwrap.dedent(text))
    raw = read_config_file(str(p))
    assert (raw.args["fp8"], raw.args["fp8_recipe"], raw.args["fp8_param_gather"]) == ("hybrid", "delayed", True)
    assert raw.args["disable_parameter_transpose_cache"] is True
    assert raw.origin["fp8_param_gather"] == "model.fp8_param"


def test_nemo1_fp8_keys(tmp_path):
    pytest.importorskip("omegaconf")
    src = open(os.path.join(CONFIGS, "nemo1", "megatron_gpt_config.yaml")).read()
    src = src.replace("  fp8: False # enables", "  fp8: True # enables").replace("transformer_engine: False", "transformer_engine: True")
    p = tmp_path / "megatron_gpt_config.yaml"
    p.write_text(src)
    raw = read_config_file(str(p))
    # fp8_hybrid: True -> hybrid; NeMo 1 has only delayed scaling; the YAML's history 1024 / max
    assert (raw.args["fp8"], raw.args["fp8_recipe"], raw.args["fp8_amax_history_len"],
            raw.args["fp8_amax_compute_algo"]) == ("hybrid", "delayed", 1024, "max")
    assert "fp8_param_gather" not in raw.args
