"""Megatron flags a release's parser does not have (``data/megatron_flag_releases.json``, read off the parsers of
megatron-core 0.17.1, 0.18.2 and 0.19.2 by scripts/gen_flag_releases.py).

memguard reads every command line with 0.19.2's option table. Under an older ``--megatron-version`` a flag that
release lacks would stop Megatron's argparse ("unrecognized arguments") before anything is built, so it is
refused, naming the flag and the release that added it. Only Megatron command lines (flags after ``--``, launch
scripts, flag mappings) are checked: a NeMo / Bridge override key is not an argparse flag.
"""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any, Mapping

from packaging.version import Version

from .args import Args, Context, Stop


@lru_cache(maxsize=1)
def flag_added_in() -> Mapping[str, str]:
    """Option string -> the release ("0.18", "0.19") from which every release read has it."""
    text = resources.files("megatron_memguard").joinpath("data/megatron_flag_releases.json").read_text()
    return json.loads(text)["added"]


def _since(token: str) -> str | None:
    name = "--" + token[2:].split("=", 1)[0].replace("_", "-")
    added = flag_added_in()
    if name in added:
        return added[name]
    if name.startswith("--no-"):   # memguard's --no-FLAG for a switch --FLAG: the switch's release
        return added.get("--" + name[5:])
    return None


def release_flags(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """Refuse, all at once as argparse lists them, the flags newer than the release whose rules apply."""
    if not a.raw.megatron_command_line or ctx.version >= Version("0.19"):
        return {}
    release = f"{ctx.version.major}.{ctx.version.minor}"
    broken = False
    for dest, token in a.raw.origin.items():
        if not isinstance(token, str) or not token.startswith("--"):
            continue
        since = _since(token)
        if since is not None and Version(since) > Version(release):
            a.fail(dest, f"is not a flag of megatron-core {release} (added in {since}): its argparse stops with "
                         "\"unrecognized arguments\"", f"drop it, or give --megatron-version {since} or later")
            broken = True
    if broken:
        raise Stop
    return {}
