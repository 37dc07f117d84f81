"""Section: the pipeline split and the virtual pipeline (validate_args + TransformerConfig.__post_init__
+ the interleaved schedule's micro-batch group rule)."""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import INTERLEAVED_GROUPS, ConfigError
from ..partition import parse_pipeline_layout
from .args import Args, Context, Stop


def pipeline(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    pp, num_layers, num_microbatches = kw["pipeline_model_parallel_size"], kw["num_layers"], kw["num_microbatches"]
    first = a.int_arg("decoder_first_pipeline_num_layers")
    last = a.int_arg("decoder_last_pipeline_num_layers")
    acc_emb = a.bool_arg("account_for_embedding_in_pipeline_split", False)
    acc_loss = a.bool_arg("account_for_loss_in_pipeline_split", False)
    pp_layout = a.get("pipeline_model_parallel_layout")
    if kw.get("hybrid_layer_pattern"):
        pp_layout = kw.get("pipeline_model_parallel_layout")   # a hybrid pattern's '|' segments (resolve/hybrid.py)
    lpv = a.int_arg("num_layers_per_virtual_pipeline_stage")
    vps = a.int_arg("num_virtual_stages_per_pipeline_rank")
    vpp_given = a.int_arg("virtual_pipeline_model_parallel_size")  # NeMo/Bridge readers set it directly
    if sum(x is not None for x in (lpv, vps, pp_layout)) > 1:
        a.fail("num_layers_per_virtual_pipeline_stage",
               "at most one of --num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank "
               "and --pipeline-model-parallel-layout may be given")
    if (first is not None or last is not None) and (acc_emb or acc_loss):
        a.fail("decoder_first_pipeline_num_layers",
               "cannot be combined with --account-for-embedding/loss-in-pipeline-split")
    if pp_layout is not None and (first is not None or last is not None or acc_emb or acc_loss):
        a.fail("pipeline_model_parallel_layout", "cannot be combined with other pipeline split flags")
    vpp: int | None = None
    if pp_layout is not None:
        try:
            stages = parse_pipeline_layout(str(pp_layout), pp, a.key("pipeline_model_parallel_layout"))
        except ConfigError as e:
            a.errors.append(e)
            raise Stop from None
        if sum(st.count("t") for st in stages) != num_layers:
            a.fail("pipeline_model_parallel_layout",
                   f"places {sum(st.count('t') for st in stages)} transformer layers but --num-layers is {num_layers}")
        vpp = len(stages) // pp
    elif lpv is not None or vps is not None or vpp_given is not None:
        if vps is not None or vpp_given is not None:
            vpp = vps if vps is not None else vpp_given
        else:
            if first is not None or last is not None:
                a.fail("num_layers_per_virtual_pipeline_stage",
                       "use --num-virtual-stages-per-pipeline-rank with uneven first/last stages")
            n = num_layers + int(acc_emb) + int(acc_loss)
            if n % pp:
                a.fail("num_layers", f"{n} layers (with embedding/loss slots) is not divisible by pipeline-model-parallel size {pp}")
                raise Stop
            if (n // pp) % lpv:
                a.fail("num_layers_per_virtual_pipeline_stage",
                       f"{lpv} does not divide the {n // pp} layers per pipeline stage")
                raise Stop
            vpp = (n // pp) // lpv
    if vpp == 1:
        vpp = None
    overlap_p2p = a.bool_arg("overlap_p2p_comm", True)
    if vpp is not None and pp == 1 and (lpv is not None or vps is not None or pp_layout is not None):
        # validate_args (arguments.py, 0.19.2 lines 966-975): the interleaved schedule needs PP > 1 (PP > 2
        # without p2p overlap)
        a.fail("pipeline_model_parallel_size", f"must be > 1 for the interleaved schedule ({vpp} virtual pipeline stages)",
               "drop the virtual pipeline stages or raise --pipeline-model-parallel-size")
        raise Stop
    if vpp is not None and pp == 1:
        vpp = None     # (a NeMo / Bridge config's virtual pipeline size at PP 1: Megatron-core builds one chunk)
        a.notes.append("virtual pipeline stages ignored: pipeline-model-parallel size is 1")
    if vpp is not None:
        if not overlap_p2p and pp <= 2:
            a.fail("pipeline_model_parallel_size",
                   "must be > 2 for the interleaved schedule with --no-overlap-p2p-communication")
    else:
        overlap_p2p = False
    if pp_layout is None:
        if first is not None or last is not None:
            rest, stages_left = num_layers, pp
            for v in (first, last):
                if v is not None:
                    rest -= v
                    stages_left -= 1
            if stages_left < 0 or rest < 0 or bool(rest) != bool(stages_left):
                # at PP 1 with both set, TransformerConfig's check (transformer_config.py, 0.19.2) passes by a sign
                # accident (-1 middle stages): Megatron starts a model of other than --num-layers layers
                why = (" (Megatron's own check lets PP 1 through with -1 middle stages, but the model it builds "
                       "does not have --num-layers layers; memguard refuses it)") if pp == 1 else ""
                a.fail("decoder_first_pipeline_num_layers",
                       f"first/last stage layers leave {rest} layers for {max(stages_left, 0)} middle stages{why}")
                raise Stop
            if stages_left and rest % stages_left:
                a.fail("decoder_first_pipeline_num_layers",
                       f"the {rest} middle layers must divide evenly over {stages_left} middle stages")
                raise Stop
            if vpp and not stages_left:
                # TransformerLayer's layer offset (transformer_layer.py, core 0.16.1 and 0.19.2) divides each
                # chunk's middle layers by the middle stages even when there are none: ZeroDivisionError at build
                a.fail("decoder_first_pipeline_num_layers",
                       f"with {a.key('decoder_last_pipeline_num_layers')} at pipeline size {pp} leaves no middle stage, which "
                       "megatron-core's interleaved layer offset divides by (ZeroDivisionError at model build)",
                       "give the split as --pipeline-model-parallel-layout, or set only one of first/last")
                raise Stop
            if vpp:
                for dest, v in (("decoder_first_pipeline_num_layers", first), ("decoder_last_pipeline_num_layers", last)):
                    if v is not None and v % vpp:
                        a.fail(dest, f"{v} must be divisible by the {vpp} virtual stages")
                if stages_left and (rest // stages_left) % vpp:
                    a.fail("num_virtual_stages_per_pipeline_rank",
                           f"the {rest // stages_left} layers per middle stage must divide into {vpp} virtual stages")
        else:
            n = num_layers + int(acc_emb) + int(acc_loss)
            if n % pp:
                a.fail("num_layers", f"{n} layers{' (with embedding/loss slots)' if acc_emb or acc_loss else ''} "
                       f"is not divisible by pipeline-model-parallel size {pp}")
                raise Stop
            if vpp and (n // pp) % vpp:
                a.fail("num_virtual_stages_per_pipeline_rank",
                       f"{vpp} virtual stages do not divide the {n // pp} layers per pipeline stage")
                raise Stop
    group_size = a.int_arg("microbatch_group_size_per_vp_stage")
    if vpp is not None:
        g = group_size or pp
        # (validate_args does not check it: forward_backward_pipelining_with_interleaving raises at the first step,
        # schedules.py 0.19.2 lines 1133-1153, 0.17.1 1027-1047, 0.16.1 996-1016)
        if g > num_microbatches or g < pp:
            a.fail("global_batch_size",
                   f"the interleaved schedule needs PP ({pp}) <= micro-batch group size ({g}) <= number of "
                   f"micro-batches ({num_microbatches} = GBS/(MBS*DP))", "raise the global batch size or lower MBS",
                   fails_later=INTERLEAVED_GROUPS)
        elif 0 < num_microbatches % g < pp:
            a.fail("global_batch_size",
                   f"{num_microbatches} micro-batches leave a last group of {num_microbatches % g} < PP = {pp} "
                   "(Megatron's interleaved schedule refuses it)", fails_later=INTERLEAVED_GROUPS)
    return dict(decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last,
                account_for_embedding_in_pipeline_split=acc_emb, account_for_loss_in_pipeline_split=acc_loss,
                pipeline_model_parallel_layout=str(pp_layout) if pp_layout is not None else None,
                virtual_pipeline_model_parallel_size=vpp, overlap_p2p_comm=overlap_p2p,
                microbatch_group_size_per_vp_stage=(group_size or pp) if vpp else group_size)
