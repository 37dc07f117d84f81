"""--yaml-cfg FILE read as megatron-core 0.19.2's megatron/training/yaml_arguments.py reads it (load_yaml,
validate_yaml, core_transformer_config_from_yaml), through the flag reader and the namespace reader."""
import json
import os
import types

import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError, ReaderError
from megatron_memguard.readers.megatron_flags import parse_megatron_flags
from megatron_memguard.readers.megatron_namespace import raw_from_namespace

HERE = os.path.dirname(os.path.abspath(__file__))
SMALL = os.path.join(HERE, "data", "yaml_cfg", "gpt_small.yaml")

# the same job as tests/data/yaml_cfg/gpt_small.yaml, written as Megatron flags
FLAGS = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel --bf16 "
         "--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --group-query-attention --num-query-groups 4 "
         "--hidden-dropout 0 --attention-dropout 0 --disable-bias-linear --swiglu --no-bias-swiglu-fusion "
         "--normalization RMSNorm --recompute-granularity selective --micro-batch-size 2 --global-batch-size 64 "
         "--seq-length 2048 --max-position-embeddings 2048 --make-vocab-size-divisible-by 128 "
         "--untie-embeddings-and-output-weights --position-embedding-type rope --transformer-impl transformer_engine "
         "--tokenizer-type NullTokenizer --vocab-size 32000 --use-distributed-optimizer --optimizer adam").split()


def _write(tmp_path, text):
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return str(p)


def _doc(**changes):
    import yaml
    with open(SMALL) as fh:
        doc = yaml.safe_load(fh)
    for path, value in changes.items():
        sec, _, key = path.rpartition("__")
        (doc[sec] if sec else doc)[key] = value
    return doc


def test_the_file_replaces_the_flags():
    L = layout_from_flags(["--yaml-cfg", SMALL, "--num-layers", "99"], world_size=8)
    # language_model.num_layers, not the ignored --num-layers 99
    assert (L.num_layers, L.hidden_size, L.num_query_groups, L.tp, L.pp) == (8, 1024, 4, 2, 2)
    # validate_yaml's default for activation_func swiglu: int(4 h 2/3 / 64) 64 = int(2730.7 / 64) 64 = 2688
    assert L.ffn_hidden_size == 2688 and L.gated_linear_unit
    # core_transformer_config_from_yaml: bias_activation_fusion = bias_swiglu_fusion (false in the file)
    assert not L.bias_activation_fusion
    raw = parse_megatron_flags(["--yaml-cfg", SMALL, "--num-layers", "99"])
    assert any("ignores the other flags (--num-layers)" in w for w in raw.warnings)
    assert raw.origin["num_layers"] == "language_model.num_layers"


def test_same_estimate_as_the_flags():
    a = estimate(layout_from_flags(["--yaml-cfg", SMALL], world_size=8))
    b = estimate(layout_from_flags(FLAGS, world_size=8))
    assert [s.peak_allocated_bytes for s in a.stages] == [s.peak_allocated_bytes for s in b.stages]
    assert [s.parameters for s in a.stages] == [s.parameters for s in b.stages]


def test_activation_rules(tmp_path):
    import yaml
    # gelu with biases: core_transformer_config_from_yaml turns bias_activation_fusion off
    doc = _doc(language_model__activation_func="gelu", language_model__add_bias_linear=True,
               language_model__bias_activation_fusion=True, swiglu=False)
    L = layout_from_flags(["--yaml-cfg", _write(tmp_path, yaml.safe_dump(doc))], world_size=8)
    assert not L.swiglu and not L.gated_linear_unit and not L.bias_activation_fusion
    assert L.ffn_hidden_size == 4 * 1024
    # an activation core_transformer_config_from_yaml does not know: a problem naming the key
    raw = parse_megatron_flags(["--yaml-cfg", _write(tmp_path, yaml.safe_dump(_doc(language_model__activation_func="relu")))])
    assert [p.key for p in raw.problems] == ["language_model.activation_func"]


def test_format_errors(tmp_path):
    import yaml
    with pytest.raises(ReaderError, match="--yaml-cfg: .*model_parallel"):
        parse_megatron_flags(["--yaml-cfg", _write(tmp_path, "micro_batch_size: 2\n")])
    with pytest.raises(ReaderError, match="--yaml-cfg"):
        parse_megatron_flags(["--yaml-cfg", str(tmp_path / "missing.yaml")])
    # a name at the top level and in a section: validate_yaml's SimpleNamespace(**a, **b) is a TypeError
    raw = parse_megatron_flags(["--yaml-cfg", _write(tmp_path, yaml.safe_dump(_doc(language_model__seq_length=4096)))])
    assert [p.key for p in raw.problems] == ["language_model.seq_length"]


def _load_yaml_like_megatron(path):
    # load_yaml (yaml_arguments.py, 0.19.2): safe_load, then JSON round trip into nested SimpleNamespaces
    import yaml
    with open(path) as fh:
        ns = json.loads(json.dumps(yaml.safe_load(fh)), object_hook=lambda d: types.SimpleNamespace(**d))
    ns.yaml_cfg = path
    ns.world_size = 8
    return ns


def test_namespace_reader_reads_the_loaded_namespace():
    raw = raw_from_namespace(_load_yaml_like_megatron(SMALL))
    assert raw.args == parse_megatron_flags(["--yaml-cfg", SMALL]).args
    assert raw.world_size == 8


def test_real_load_yaml():
    pytest.importorskip("megatron.training", reason="needs megatron.training (Python 3.12 venv)")
    try:
        from megatron.training.yaml_arguments import load_yaml
    except ImportError as e:   # pragma: no cover - the module needs torch
        pytest.skip(f"megatron.training.yaml_arguments: {e}")
    ns = load_yaml(SMALL)
    ns.world_size = 8
    assert raw_from_namespace(ns).args == parse_megatron_flags(["--yaml-cfg", SMALL]).args


def test_unread_yaml_cfg_still_refused():
    from megatron_memguard.config import RawConfig
    from megatron_memguard.resolve import resolve
    with pytest.raises((NotModelledError, ConfigError, ConfigErrors), match="--yaml-cfg|yaml_cfg"):
        resolve(RawConfig(args={"yaml_cfg": "x.yaml", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                "seq_length": 128, "max_position_embeddings": 128, "micro_batch_size": 1},
                          world_size=1))


def test_config_file_detection():
    from megatron_memguard.readers.detect import read_config_file
    assert read_config_file(SMALL).args == parse_megatron_flags(["--yaml-cfg", SMALL]).args
