"""Which Megatron printed an argument table: told from the arguments its parser has.

``_print_args`` prints every attribute of the parsed namespace, defaults included, so an argument a
release added is in every table that release or a later one prints. The marker arguments, checked in
the megatron-core wheels' ``megatron/training/arguments.py`` and ``megatron/core`` config dataclasses
(whose fields 0.17+ turn into flags with ``ArgumentGroupFactory``):

* added in 0.19.0 (absent from 0.17.0 and 0.18.0, present in 0.19.0 and 0.19.2);
* added in 0.18.0 (absent from 0.17.0 and 0.17.1, present in 0.18.0, 0.18.2, 0.19.0, 0.19.2; ``fp4_param_gather``
  is not one: the 0.17.1 wheel's parser has it already);
* ``hybrid_layer_pattern``: absent in 0.16.1 (../shared/reference/megatron.md, the flags table; 0.16.1's
  wheel has no megatron.training to check), present from 0.17.0 on.

memguard's rules differ between < 0.18 and < 0.19 (resolve/), so the release pinned this way is the one
whose rules apply. A table that has only some of one release's markers matches no release: nothing is
assumed from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("0.19", ("freeze_all_layers", "override_ckpt_iteration", "yarn_beta_fast", "dataloader_inter_document_masking",
              "logits_save_dir")),
    ("0.18", ("cuda_graph_modules", "muon_nesterov")),
    ("0.17", ("hybrid_layer_pattern",)),
)
OLDEST = "0.16"
# _print_args prints every argument: hundreds (0.19.2: about 800; 0.17.0's parser alone defines 370 besides
# the TransformerConfig fields). A shorter table is an excerpt, where a missing argument proves nothing.
FULL_TABLE = 200


@dataclass(frozen=True)
class EraGuess:
    version: str | None       # None: the table does not tell
    reason: str


def era_of_table(names: Collection[str], complete: bool = True) -> EraGuess:
    """The Megatron release whose argument table holds ``names`` (the table's argument names; ``complete``:
    the table was read to its end line). An argument that is there proves its release or a later one; one
    that is not there proves an older release only in a whole table."""
    if not names:
        return EraGuess(None, "the log has no argument table")
    names = set(names)
    partial = None
    if not complete:
        partial = "the argument table is cut off"
    elif len(names) < FULL_TABLE:
        partial = f"the argument table has only {len(names)} arguments (Megatron prints all of its several hundred)"
    for n, (version, markers) in enumerate(MARKERS):
        have = [m for m in markers if m in names]
        if len(have) == len(markers) and (n == 0 or partial is None):
            return EraGuess(version, f"its argument table has {', '.join(markers)}, which megatron-core {version} added")
        if partial is not None:
            continue
        if have:
            missing = [m for m in markers if m not in names]
            return EraGuess(None, f"its argument table has {', '.join(have)} but not {', '.join(missing)}, which "
                                  f"megatron-core {version} added together: no release matches")
    if partial is not None:
        return EraGuess(None, f"{partial}, so a missing argument proves nothing")
    markers = [m for _, ms in MARKERS for m in ms]
    return EraGuess(OLDEST, f"its argument table has none of {', '.join(markers)}, which megatron-core 0.17-0.19 "
                            "added")
