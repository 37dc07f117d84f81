"""Flags an older megatron-core's parser does not have: ``--megatron-version X`` refuses them by name, with the
release that added them, as that release's argparse would stop ("unrecognized arguments"). The releases come
from the real parsers (megatron/training/arguments.py of megatron-core 0.17.1, 0.18.2, 0.19.2, read by
scripts/gen_flag_releases.py); tests/test_megatron_releases.py checks the same flags against the installed one."""
import pytest

from megatron_memguard import layout_from_flags
from megatron_memguard.cli.main import main
from megatron_memguard.errors import ConfigError, ConfigErrors
from megatron_memguard.resolve.releases import flag_added_in

BASE = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
        "--micro-batch-size 1 --global-batch-size 8 --vocab-size 1024 --bf16").split()

# A few real flags: (flag and its value, release that added it). --freeze-all-layers and
# --megatron-fsdp-max-pool-double-buffer are in 0.19.2's parser, not 0.18.2's; --use-transformer-engine-op-fuser,
# --muon-nesterov and --moe-paged-stash in 0.18.2's, not 0.17.1's; --fp4-param-gather is in all three.
FLAGS = [(["--freeze-all-layers"], "0.19"), (["--megatron-fsdp-max-pool-double-buffer"], "0.19"),
         (["--use-transformer-engine-op-fuser"], "0.18"), (["--muon-nesterov"], "0.18"), (["--moe-paged-stash"], "0.18")]


def test_the_table_names_the_releases():
    added = flag_added_in()
    assert {flags[0]: added[flags[0]] for flags, _ in FLAGS} == {flags[0]: since for flags, since in FLAGS}
    assert "--fp4-param-gather" not in added and "--tensor-model-parallel-size" not in added


@pytest.mark.parametrize("cmd", ["estimate", "check", "plan", "validate"])
@pytest.mark.parametrize("flags, since", FLAGS)
@pytest.mark.parametrize("version", ["0.16", "0.17", "0.18"])
def test_cli_refuses_a_flag_newer_than_the_release(cmd, flags, since, version, capsys):
    if since <= version:
        return
    head = {"estimate": ["--world-size", "1"], "plan": ["--gpus", "1"], "validate": ["--world-size", "1"],
            "check": []}[cmd]
    tail = ["torchrun", "--nproc-per-node", "1", "pretrain_gpt.py"] if cmd == "check" else []
    rc = main([cmd, *head, "--megatron-version", version, "--", *tail, *BASE, *flags])
    out = capsys.readouterr()
    text = out.err + out.out
    assert rc == (1 if cmd == "validate" else 2), text      # validate lists problems and exits 1
    assert f"{flags[0]}: is not a flag of megatron-core {version} (added in {since})" in text
    assert "Traceback" not in text


def test_newer_release_takes_them_and_no_version_means_019():
    layout_from_flags(BASE + ["--use-transformer-engine-op-fuser"], world_size=1, megatron_version="0.18")
    layout_from_flags(BASE + ["--freeze-all-layers"], world_size=1)
    # --no-FLAG, memguard's off-switch of a store-true flag, belongs to the flag's release; so does --flag=value
    with pytest.raises((ConfigError, ConfigErrors), match="--no-moe-paged-stash: is not a flag of megatron-core 0.17"):
        layout_from_flags(BASE + ["--no-moe-paged-stash"], world_size=1, megatron_version="0.17.1")
    with pytest.raises((ConfigError, ConfigErrors), match="--moe-paged-stash-page-size: is not a flag"):
        layout_from_flags(BASE + ["--moe-paged-stash-page-size=64"], world_size=1, megatron_version="0.17.1")

