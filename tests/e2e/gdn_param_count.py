"""Parameter names and sizes of megatron-core's own GatedDeltaNet (0.19.2 ssm/gated_delta_net/, 0.16.1
ssm/gated_delta_net.py) built on CPU, TP = 1.

    python tests/e2e/gdn_param_count.py '{"hidden_size": 256, "key_heads": 2, "value_heads": 4, ...}'

prints {name: numel} as JSON (the last line). The CPU venvs have no flash-linear-attention: the module's HAVE_FLA
check is set (its kernels are never called; __init__ only builds parameters), and torch.cuda.current_device, where
__init__ allocates, is the CPU. The linears are megatron-core's local ones (ColumnParallelLinear / RowParallelLinear,
a torch norm for TE's): the same parameters as the TE spec's except the input norm TE fuses into in_proj.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def build(cfg: dict):
    from single_rank import start   # beside this script (sys.path[0])
    start()
    import torch
    import torch.nn.functional as F
    torch.cuda.current_device = lambda: "cpu"
    try:
        import megatron.core.ssm.gated_delta_net.common as common      # 0.19.2
        import megatron.core.ssm.gated_delta_net.gdn as gdn
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
        gdn.chunk_gated_delta_rule = lambda *a, **k: None   # (fla's kernel, taken at import: not called)
    except ImportError:
        import megatron.core.ssm.gated_delta_net as common             # 0.16.1
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    common.HAVE_FLA = True
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig
    config = TransformerConfig(
        num_layers=4, hidden_size=cfg["hidden_size"], num_attention_heads=4, normalization="RMSNorm",
        add_bias_linear=False, activation_func=F.silu, use_cpu_initialization=True, params_dtype=torch.float32,
        perform_initialization=False, experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
        linear_conv_kernel_dim=cfg["conv"], linear_key_head_dim=cfg["key_dim"], linear_value_head_dim=cfg["value_dim"],
        linear_num_key_heads=cfg["key_heads"], linear_num_value_heads=cfg["value_heads"])
    subs = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear)
    return GatedDeltaNet(config, subs, layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


if __name__ == "__main__":
    module = build(json.loads(sys.argv[1]))
    print(json.dumps({n: p.numel() for n, p in module.named_parameters()}))
