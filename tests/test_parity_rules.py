"""Megatron's start-up rules the parity fuzz (tests/test_parity_megatron_019.py) found memguard lacked: each
command line of parity_space.FOUND is refused with one line naming the flag, in the Megatron eras that have
the rule (the source of each rule is in the table); 0.19-only rules leave a 0.16 estimate alone. The 3.12
suite checks that the real megatron.training 0.19.2 rejects the same command lines."""
import pytest

from parity_space import FOUND


@pytest.mark.parametrize("found", FOUND, ids=[f.source.split(":")[0][-40:] + f" {f.key}" for f in FOUND])
@pytest.mark.parametrize("era", ["0.16", "0.19"])
def test_memguard_refuses_what_megatron_refuses(found, era):
    from megatron_memguard import layout_from_flags
    from megatron_memguard.errors import ConfigError, ConfigErrors
    case = found.case()
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
