"""Which models megatron/training 0.18 and 0.19 build for --moe-use-upcycling, on CPU (builder mode: 0.19 only).

    python tests/e2e/upcycling_models.py [save-dense|builder|provider] FLAG ...

One process, a one-rank gloo group. The command line is parsed and validated by the real
parse_and_validate_args. ``save-dense`` builds a dense model as core_v0.19's pretrain_gpt.py does and saves it with
the real save_checkpoint (the checkpoint to upcycle). ``builder`` runs setup_model_and_optimizer as pretrain_gpt.py
does (gpt_config_from_args -> PretrainConfigContainer.model, so _build_model_wrapper builds through
GPTModelBuilder), ``provider`` with a model provider and no model config (_build_model_wrapper calls get_model).
upcycling_utils.load_and_upcycle_model is wrapped to record the MoE model and the model built "for upcycling", then
runs for real when --load is given; checkpoint_exists / save_checkpoint of the upcycled model are stubbed. Prints one
JSON line: the parameters of each model (and how many are routed experts'), and the error that stops start-up with
the megatron function it came from.
"""
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

import cpu_shims  # noqa: E402
import torch  # noqa: E402

cpu_shims.install()
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.set_device = lambda *a, **k: None
torch.optim.Optimizer._accelerator_graph_capture_health_check = lambda self: None


def _counts(chunks) -> dict:
    total = experts = 0
    for m in chunks:
        for name, p in m.named_parameters():
            total += p.numel()
            if ".experts." in name:
                experts += p.numel()
    return {"parameters": total, "expert_parameters": experts}


def main() -> None:
    mode, flags = sys.argv[1], sys.argv[2:]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29731")
    from megatron.core import parallel_state as ps
    from megatron.core.enums import ModelType
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training import argument_utils, training
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import get_args

    if mode != "save-dense":   # (a directory that exists, removed at exit: nothing is saved in it, save is stubbed)
        save_dir = tempfile.TemporaryDirectory(prefix="memguard-upcycle-save-")
        flags = [*flags, "--save", save_dir.name]
    sys.argv = ["pretrain_gpt.py", *flags]
    parse_and_validate_args(extra_args_provider=None, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    args = get_args()
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(expert_model_parallel_size=args.expert_model_parallel_size)

    seen = {}

    def provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
        # what core_v0.19's model_provider does without a model config: the TransformerConfig from get_args()
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        cfg = argument_utils.core_transformer_config_from_args(get_args())
        a = get_args()
        return GPTModel(config=cfg, transformer_layer_spec=get_gpt_decoder_block_spec(cfg, use_transformer_engine=False),
                        vocab_size=a.padded_vocab_size, max_sequence_length=a.max_position_embeddings,
                        pre_process=pre_process, post_process=post_process,
                        share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
                        position_embedding_type=a.position_embedding_type, vp_stage=vp_stage)

    real_upcycle = training.upcycling_utils.load_and_upcycle_model

    def load_and_upcycle_model(load_fn, moe_model, dense_model, load_kwargs):
        seen["moe_model"] = _counts(moe_model)
        seen["dense_model"] = _counts(training.unwrap_model(dense_model))
        seen["dense_model_ddp_wrapped"] = type(dense_model[0]).__name__
        if args.load is None:
            return None, 0
        out = real_upcycle(load_fn, moe_model, dense_model, load_kwargs=load_kwargs)   # the real load and upcycle
        seen["upcycled"] = True
        return out

    training.upcycling_utils.load_and_upcycle_model = load_and_upcycle_model
    training.checkpoint_exists = lambda path: False
    if mode != "save-dense":
        training.save_checkpoint = lambda *a, **k: None
    # 0.18's setup_model_and_optimizer takes only a model provider (its first argument) and has no model builder:
    # gpt_config_from_args and the cfg_container / pg_collection keywords arrived in 0.19
    builder_era = hasattr(argument_utils, "gpt_config_from_args")

    def setup_from_provider():
        if builder_era:
            return training.setup_model_and_optimizer(ModelType.encoder_or_decoder, provider, pg_collection=pgc)
        return training.setup_model_and_optimizer(provider, ModelType.encoder_or_decoder)

    if mode == "builder" and not builder_era:
        print(json.dumps({"skipped": "no gpt_config_from_args in this megatron.training"}))
        return
    if mode == "save-dense":   # a dense checkpoint to upcycle from (the real save_checkpoint)
        def run():
            if builder_era:
                container = argument_utils.pretrain_cfg_container_from_args(
                    args, argument_utils.gpt_config_from_args(args))
                model, opt, sched = training.setup_model_and_optimizer(
                    ModelType.encoder_or_decoder, cfg_container=container, pg_collection=pgc)
            else:
                model, opt, sched = setup_from_provider()
            seen["dense_checkpoint"] = _counts(training.unwrap_model(model))
            training.save_checkpoint(1, model, None, None, 0)
    elif mode == "builder":
        model_cfg = argument_utils.gpt_config_from_args(args)
        container = argument_utils.pretrain_cfg_container_from_args(args, model_cfg)
        run = lambda: training.setup_model_and_optimizer(ModelType.encoder_or_decoder, cfg_container=container,
                                                         pg_collection=pgc)
    else:
        run = setup_from_provider
    # what pretrain passes (training.py 0.19.2: ProcessGroupCollection.use_mpu_process_groups())
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    try:
        run()
    except Exception as e:   # what stops the run, and where: the last frame of megatron's own code
        import traceback
        tb = [f for f in traceback.extract_tb(e.__traceback__) if "/megatron/" in f.filename][-1]
        seen["error"] = f"{type(e).__name__}: {e}"
        seen["raised_at"] = f"{tb.filename.split('/megatron/')[-1]}:{tb.name}"
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
