"""Section: multi-token prediction (``--mtp-num-layers``) with validate_args's rules."""
from __future__ import annotations

from typing import Any, Mapping

from packaging.version import Version

from ..errors import NotModelledError
from ..partition import parse_pipeline_layout
from .args import Args, Context


def mtp(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    depth = a.int_arg("mtp_num_layers", 0, minimum=0) or 0
    layout = kw.get("pipeline_model_parallel_layout")
    if layout is not None:
        # the layout's 'm' entries place the MTP layers (partition.parse_pipeline_layout accepts them in the
        # last stage only); PipelineParallelLayerLayout.validate_layer_layout: their count is --mtp-num-layers
        placed = sum(st.count("m") for st in parse_pipeline_layout(str(layout), kw["pipeline_model_parallel_size"],
                                                                    a.key("pipeline_model_parallel_layout")))
        if placed != depth:
            a.fail("pipeline_model_parallel_layout", f"places {placed} MTP layers ('m') but --mtp-num-layers is {depth}")
    if not depth:
        return dict(mtp_num_layers=0)
    position = kw["position_embedding_type"]
    # validate_args (core 0.19.2, and already 0.17.1 and 0.18.2) asserts rope or none first; the reference reads
    # 0.16.1 as also taking learned_absolute and mrope (docs/assumptions.md)
    allowed = ("rope", "none") if ctx.version >= Version("0.17") else ("learned_absolute", "rope", "mrope", "none")
    if position not in allowed:
        a.fail("mtp_num_layers", f"needs --position-embedding-type {' or '.join(allowed)} (validate_args), "
               f"got {position}")
    for dest, what in (("mtp_use_repeated_layer", "one MTP layer used for every depth"),
                       ("mtp_standalone", "MTP layers on a pipeline stage of their own"),
                       ("mtp_hybrid_override_pattern", "hybrid MTP layers")):
        if a.given(dest) and a.get(dest) not in (False, "false", "False", 0):
            raise NotModelledError(a.key(dest), what)
    return dict(mtp_num_layers=depth)
