"""Megatron's start-up rules the parity fuzz (tests/test_parity_megatron_019.py) found memguard lacked: each
command line of parity_space.FOUND is refused with one line naming the flag, in the Megatron eras that have
the rule (the source of each rule is in the table); 0.19-only rules leave a 0.16 estimate alone. The 3.12
suite checks that the real megatron.training 0.19.2 rejects the same command lines."""
import pytest
from packaging.version import Version

from parity_space import FOUND


@pytest.mark.parametrize("found", FOUND, ids=[f.source.split(":")[0][-40:] + f" {f.key}" for f in FOUND])
@pytest.mark.parametrize("era", ["0.16", "0.19"])
def test_memguard_refuses_what_megatron_refuses(found, era):
    from megatron_memguard import layout_from_flags
    from megatron_memguard.errors import ConfigError, ConfigErrors
    from megatron_memguard.resolve.releases import flag_added_in
    case = found.case()
    newer = [f for f in case.flags if f in flag_added_in() and Version(flag_added_in()[f]) > Version(era)]
    if era not in found.eras and newer:
        # a flag the release's argparse does not have (--cuda-graph-modules: 0.18): refused before any rule
        with pytest.raises((ConfigError, ConfigErrors), match=f"{newer[0]}: is not a flag of megatron-core {era}"):
            layout_from_flags(list(case.flags), world_size=case.world, megatron_version=era)
        return
    if era not in found.eras and found.newer:
        # an option value of a later release (quantile_balancing): refused naming the release that added it
        with pytest.raises((ConfigError, ConfigErrors)) as e:
            layout_from_flags(list(case.flags), world_size=case.world, megatron_version=era)
        assert "needs megatron-core >= " in str(e.value) and "\n" not in str(e.value), str(e.value)
        return
    if era not in found.eras:
        assert layout_from_flags(list(case.flags), world_size=case.world, megatron_version=era).num_layers == 4
        return
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(list(case.flags), world_size=case.world, megatron_version=era)
    text = str(e.value)
    assert text.startswith(found.key) and "\n" not in text, text


def test_layerwise_offloading_with_the_deprecated_moe_layer_recompute_is_refused_as_not_modelled():
    """TransformerConfig.__post_init__ (transformer_config.py 0.19.2 lines 1719 and 1835, 0.16.1 lines 1149 and
    1255) checks --cpu-offloading-num-layers against recomputation before it turns --moe-layer-recompute into
    selective recompute, so Megatron starts the pair: memguard names it not modelled instead of calling it a
    broken rule; with the granularity spelled out Megatron refuses it, and so does memguard."""
    from megatron_memguard import layout_from_flags
    from megatron_memguard.errors import ConfigError, NotModelledError
    from parity_space import BASE
    flags = BASE + ["--cpu-offloading-num-layers", "1", "--moe-layer-recompute"]
    for era in ("0.16", "0.19"):
        with pytest.raises(NotModelledError) as e:
            layout_from_flags(flags, world_size=1, megatron_version=era)
        assert str(e.value).startswith("--cpu-offloading-num-layers")
    with pytest.raises(ConfigError) as e:
        layout_from_flags(flags + ["--recompute-granularity", "selective"], world_size=1)
    assert not isinstance(e.value, NotModelledError) and "cannot be combined with recomputation" in str(e.value)


def _without_max_position(flags):
    i = flags.index("--max-position-embeddings")
    return flags[:i] + flags[i + 2:]


@pytest.mark.parametrize("era", ["0.16", "0.19"])
def test_a_megatron_command_line_without_max_position_embeddings_is_noted(era):
    """validate_args lists --max-position-embeddings among its required arguments (megatron/training/arguments.py:
    0.19.2 line 1274, 0.18.2 line 1265, 0.17.1 line 1087; the parser's default is None), rotary models too: the
    script stops before the model is built (tests/test_parity_megatron_019.py checks 0.19.2 rejects this one).
    memguard estimates as with the flag set to --seq-length and says the run needs it (a note, not an error:
    the estimate is the one of the run with the flag added; refusing would turn away partial command lines)."""
    from megatron_memguard import layout_from_flags
    from parity_space import BASE
    layout = layout_from_flags(_without_max_position(BASE), world_size=1, megatron_version=era)
    assert layout.max_position_embeddings == 512
    assert any(n.startswith("--max-position-embeddings not given: Megatron-LM's validate_args requires it")
               for n in layout.notes), layout.notes


def test_a_model_preset_with_flags_on_top_still_takes_the_sequence_length():
    """A model preset (or a Bridge / NeMo config) is not a Megatron-LM command line: flags on top of it without
    --max-position-embeddings keep the old reading, the position table sized by --seq-length (learned positions:
    max_position_embeddings x hidden parameters, the 512 x 256 words checked here by hand)."""
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    from megatron_memguard.resolve import resolve
    from parity_space import BASE
    shape = parse_megatron_flags(_without_max_position(BASE)[:6])          # layers, hidden, heads: the "preset"
    assert shape.megatron_command_line
    preset = type(shape)(args=dict(shape.args), origin=dict(shape.origin), source="model preset")
    rest = [t for t in _without_max_position(BASE)[6:] if t not in ("--position-embedding-type", "rope")]
    layout = resolve(preset.merged(parse_megatron_flags(rest)), world_size=1)
    assert layout.max_position_embeddings == 512 and layout.position_embedding_type == "learned_absolute"
    assert "--max-position-embeddings not given: taken as --seq-length" in layout.notes


def test_pp1_first_and_last_stage_layers_refused_with_megatrons_sign_accident_named():
    """At PP 1, --decoder-first- and --decoder-last-pipeline-num-layers both given leave -1 middle stages:
    TransformerConfig.__post_init__'s check passes (transformer_config.py, 0.19.2), and the stages build 3 + 3
    layers of a 4-layer model (parity_space._later_rules counts them); memguard refuses and says why."""
    from megatron_memguard import layout_from_flags
    from megatron_memguard.errors import ConfigError, ConfigErrors
    from parity_space import BASE
    flags = BASE + ["--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "3"]
    for era in ("0.16", "0.19"):
        with pytest.raises((ConfigError, ConfigErrors)) as e:
            layout_from_flags(flags, world_size=1, megatron_version=era)
        text = str(e.value)
        assert text.startswith("--decoder-first-pipeline-num-layers") and "-1 middle stages" in text, text
