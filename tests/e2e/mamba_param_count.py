"""Parameter names and sizes of megatron-core 0.19.2's own HybridModel (0.16.1: MambaModel over MambaStack) (MambaLayer / MambaMixer, attention-only
and MLP-only TransformerLayers, final norm, embedding, output layer) built on CPU, TP = PP = 1.

    python tests/e2e/mamba_param_count.py '{"pattern": "M*M-", "hidden_size": 256, ...}'

prints {name: numel} as JSON (the last line). An optional "config" object adds TransformerConfig fields (with '+'
layers, MLATransformerConfig's: q_lora_rank, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim).

Two stand-ins, because the CPU venv has neither library: ``einops`` (MambaMixer.__init__ only checks that it
imports) and ``mamba_ssm``'s gated RMSNorm, whose parameters are one ``weight`` of the normalised width and no
bias (mamba_ssm 2.2.6 ops/triton/layernorm_gated.py RMSNorm.__init__); its kernels are never called. The
layer spec is the local one (ColumnParallelLinear / RowParallelLinear and separate norms where the TE spec
fuses the norm into in_proj / linear_qkv / linear_fc1): the same numbers of parameters, other names for the norms.
"""
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _stub_libraries() -> None:
    import torch
    from torch import nn

    if "einops" not in sys.modules:
        try:
            import einops  # noqa: F401
        except ImportError:
            m = types.ModuleType("einops")
            m.rearrange = m.repeat = lambda *a, **k: None
            sys.modules["einops"] = m

    class RMSNorm(nn.Module):
        def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
            self.register_parameter("bias", None)

    names = ["mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton", "mamba_ssm.ops.triton.layernorm_gated",
             "mamba_ssm.ops.triton.ssd_combined"]
    for name in names:
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["mamba_ssm.ops.triton.layernorm_gated"].RMSNorm = RMSNorm

    def mamba_chunk_scan_combined(*a, state_dtype=None, **k):
        raise NotImplementedError

    def mamba_split_conv1d_scan_combined(*a, state_dtype=None, **k):
        raise NotImplementedError

    sys.modules["mamba_ssm.ops.triton.ssd_combined"].mamba_chunk_scan_combined = mamba_chunk_scan_combined
    sys.modules["mamba_ssm.ops.triton.ssd_combined"].mamba_split_conv1d_scan_combined = mamba_split_conv1d_scan_combined


def _stub_triton() -> None:
    """megatron-core 0.16.1's mamba_mixer imports inference kernels written in Triton (decorated at import time);
    the CPU venv has no triton: a stand-in whose decorators return what they decorate (no kernel is called)."""
    try:
        import triton  # noqa: F401
        return
    except ImportError:
        pass
    from unittest.mock import MagicMock
    for name in ("triton", "triton.language", "triton.language.extra", "triton.language.extra.libdevice",
                 "triton.runtime", "triton.runtime.autotuner", "triton.backends", "triton.compiler"):
        sys.modules[name] = MagicMock()
    sys.modules["triton"].jit = lambda f=None, **k: f if f is not None else (lambda g: g)
    sys.modules["triton"].autotune = lambda *a, **k: (lambda g: g)
    sys.modules["triton"].heuristics = lambda *a, **k: (lambda g: g)


def _layer_specs() -> dict:
    """The Mamba, attention-only and MLP-only layers' specs both eras take, with megatron-core's local modules
    and torch norms for TE's (the same parameters)."""
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
    return dict(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=WrappedTorchNorm,
            mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
                in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)))),
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                      submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                                                         core_attention=DotProductAttention,
                                                                         linear_proj=RowParallelLinear)))),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                linear_fc2=RowParallelLinear)))))


def _mla_layer_spec() -> dict:
    """'+' (megatron-core 0.19.2 hybrid_layer_specs.py mla_layer): a TransformerLayer with a separate input norm,
    MLASelfAttention with its TE linears (TELinear down-projections, TEColumnParallelLinear up-projections and
    linear_q_proj, TERowParallelLinear linear_proj: here the local column / row-parallel linears, the same parameters
    at TP 1) and IdentityOp latent norms, no MLP."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
    from torch import nn

    class CoreAttention(nn.Module):
        """TEDotProductAttention's place (it has no parameters; the local one does not take MLA's k_channels)."""

        def __init__(self, *a, **k):
            super().__init__()

    return dict(mla_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm,
        self_attention=ModuleSpec(module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=MLASelfAttentionSubmodules(
                                      linear_q_proj=ColumnParallelLinear, linear_q_down_proj=ColumnParallelLinear,
                                      linear_q_up_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear,
                                      linear_kv_up_proj=ColumnParallelLinear, core_attention=CoreAttention,
                                      linear_proj=RowParallelLinear, q_layernorm=IdentityOp,
                                      kv_layernorm=IdentityOp)))))


def _mtp_block_spec() -> dict:
    """The MTP block of a '/' pattern (megatron-core 0.19.2 hybrid_layer_specs.py _hybrid_mtp_block_spec: TE norms
    and TEColumnParallelLinear; here torch norms and the local column-parallel linear, the same parameters): its
    inner HybridStack is built from the model's own layer specs."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (MultiTokenPredictionBlock,
                                                                  MultiTokenPredictionBlockSubmodules,
                                                                  MultiTokenPredictionLayer,
                                                                  MultiTokenPredictionLayerSubmodules)
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    layer = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=WrappedTorchNorm, hnorm=WrappedTorchNorm, eh_proj=ColumnParallelLinear, mtp_model_layer=None,
        layer_norm=WrappedTorchNorm))
    return dict(mtp_block_spec=ModuleSpec(module=MultiTokenPredictionBlock,
                                          submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[layer])))


def _mtp_config(cfg: dict) -> dict:
    """TransformerConfig's MTP fields for a '/' pattern: validate_args sets mtp_num_layers to its depth count."""
    depths = len(cfg["pattern"].split("/")) - 1
    if not depths:
        return {}
    return dict(mtp_num_layers=depths, mtp_use_repeated_layer=bool(cfg.get("repeated")))


def build_016(cfg: dict):
    """megatron-core 0.16.1: MambaModel over MambaStack (the same local stand-ins as build)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.mamba.mamba_model import MambaModel
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig
    import megatron.core.ssm.mamba_block as mb
    mb.TENorm = WrappedTorchNorm
    torch.cuda.current_device = lambda: "cpu"
    spec = ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(**_layer_specs()))
    config = TransformerConfig(
        num_layers=len(cfg["pattern"]), hidden_size=cfg["hidden_size"], num_attention_heads=cfg["heads"],
        num_query_groups=cfg["groups"], ffn_hidden_size=cfg["ffn"], normalization="RMSNorm", add_bias_linear=False,
        activation_func=F.relu, use_cpu_initialization=True, params_dtype=torch.float32,
        mamba_state_dim=cfg["state"], mamba_head_dim=cfg["head_dim"], mamba_num_groups=cfg["mamba_groups"],
        mamba_num_heads=cfg.get("mamba_heads"), hidden_dropout=0.0, attention_dropout=0.0, **cfg.get("config", {}))
    return MambaModel(config=config, mamba_stack_spec=spec, vocab_size=cfg["vocab"],
                      max_sequence_length=cfg["seq"], hybrid_override_pattern=cfg["pattern"],
                      position_embedding_type="none", share_embeddings_and_output_weights=False)


def build(cfg: dict):
    from single_rank import start   # beside this script (sys.path[0])
    start(int(os.environ.get("MASTER_PORT", "29551")))
    _stub_libraries()
    _stub_triton()
    import megatron.core.models
    if not os.path.exists(os.path.join(os.path.dirname(megatron.core.models.__file__), "hybrid")):
        return build_016(cfg)       # megatron-core 0.16.1 (no models/hybrid yet)
    import torch
    import torch.nn.functional as F
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayerSubmodules
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    import megatron.core.models.hybrid.hybrid_block as hb
    hb.TENorm = WrappedTorchNorm        # the final norm (TE's on GPU): one weight of the hidden size either way

    # MambaMixer allocates on torch.cuda.current_device(); on CPU that is the CPU
    torch.cuda.current_device = lambda: "cpu"
    spec = ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        **_layer_specs(), **_mtp_block_spec(), **(_mla_layer_spec() if "+" in cfg["pattern"] else {}),
        # 'E': MoETransformerLayer with its own pre-MLP norm; local experts (SequentialMLP) for TE's grouped ones:
        # the same numbers of parameters per expert
        moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=False)))))
    moe = dict(num_moe_experts=cfg["experts"], moe_router_topk=cfg["topk"], moe_ffn_hidden_size=cfg["moe_ffn"],
               moe_token_dispatcher_type="alltoall") if cfg.get("experts") else {}
    if "+" in cfg["pattern"]:
        # MLASelfAttention reads MLATransformerConfig's fields (validate_args sets multi_latent_attention for '+')
        from megatron.core.transformer.transformer_config import MLATransformerConfig as TransformerConfig  # noqa: F811
        cfg = dict(cfg, groups=cfg["heads"], config=dict(cfg.get("config", {}), multi_latent_attention=True))
    config = TransformerConfig(
        num_layers=len(cfg["pattern"].split("/")[0]), hidden_size=cfg["hidden_size"], num_attention_heads=cfg["heads"],
        num_query_groups=cfg["groups"], ffn_hidden_size=cfg["ffn"], normalization="RMSNorm", add_bias_linear=False,
        activation_func=F.relu, use_cpu_initialization=True, params_dtype=torch.float32, is_hybrid_model=True,
        mamba_state_dim=cfg["state"], mamba_head_dim=cfg["head_dim"], mamba_num_groups=cfg["mamba_groups"],
        mamba_num_heads=cfg.get("mamba_heads"), hidden_dropout=0.0, attention_dropout=0.0, **moe, **_mtp_config(cfg),
        **cfg.get("config", {}))
    return HybridModel(config=config, hybrid_stack_spec=spec, vocab_size=cfg["vocab"],
                       max_sequence_length=cfg["seq"], hybrid_layer_pattern=cfg["pattern"],
                       position_embedding_type="none", share_embeddings_and_output_weights=False)


if __name__ == "__main__":
    model = build(json.loads(sys.argv[1]))
    print(json.dumps({n: p.numel() for n, p in model.named_parameters()}))
