"""Regenerate megatron_memguard/data/megatron_flag_releases.json (development time, not at runtime).

    python scripts/gen_flag_releases.py /work/venv312-core017/bin/python /work/venv312-core018/bin/python \\
        /work/venv312/bin/python

Each Python given has one megatron-core release with its megatron.training (0.17.1, 0.18.2, 0.19.2: the wheels
ship it from 0.17.0). The script asks each release's own parser (``add_megatron_arguments``) for its option
strings and records, for every option of the newest release, the oldest release from which every release given
has it: what ``--megatron-version X`` refuses when the option is newer than X (argparse of that release stops with
"unrecognized arguments"). Options every release has are left out. megatron-core 0.16.1's wheel has no
megatron.training, so 0.16 is checked against what the oldest release given lacks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

OUT = os.path.join(os.path.dirname(__file__), "..", "megatron_memguard", "data", "megatron_flag_releases.json")
DUMP = r"""
import argparse, json, warnings
warnings.filterwarnings("ignore")
from importlib import metadata
from megatron.training.arguments import add_megatron_arguments
p = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
print(json.dumps({"version": metadata.version("megatron-core"),
                  "options": sorted({o for a in p._actions for o in a.option_strings if o.startswith("--")})}))
"""


def options(python: str) -> tuple[str, set[str]]:
    out = subprocess.run([python, "-c", DUMP], check=True, capture_output=True, text=True).stdout
    d = json.loads(out.strip().splitlines()[-1])
    return d["version"], set(d["options"])


def main(pythons: list[str]) -> None:
    releases = sorted((options(p) for p in pythons), key=lambda r: tuple(int(x) for x in r[0].split(".")[:2]))
    newest = releases[-1][1]
    added: dict[str, str] = {}
    for flag in sorted(newest - {"--help"}):
        since = None
        for version, opts in reversed(releases):
            if flag not in opts:
                break
            since = ".".join(version.split(".")[:2])
        if since != ".".join(releases[0][0].split(".")[:2]):
            added[flag] = since
    doc = {"source": "megatron/training/arguments.py add_megatron_arguments of megatron-core "
                     + ", ".join(v for v, _ in releases) + " (scripts/gen_flag_releases.py)",
           "releases": [v for v, _ in releases], "added": added}
    with open(OUT, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")
    print(f"{OUT}: {len(added)} options newer than {releases[0][0]}")


if __name__ == "__main__":
    main(sys.argv[1:])
