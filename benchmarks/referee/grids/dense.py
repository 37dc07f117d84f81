"""The referee's dense grid, as data: each entry a pretrain_gpt.py command line (name, world size, the Megatron flags
exactly as pretrain_gpt.py would take them, whether it belongs to the CI subset), and ``resolve_config``, which turns
the flags into the resolved settings the worker takes with memguard's own reader and rules.

No torch, no megatron, no process: the runner (grid.py) and the tests that read the definitions import this.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

# Flags every configuration shares: the local implementation with all fusions off, dropout 0,
# CPU initialisation, a NullTokenizer vocabulary and mock data, bf16 (unless a config overrides).
COMMON = [
    "--transformer-impl", "local",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
    "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
    "--use-cpu-initialization",
    "--tokenizer-type", "NullTokenizer", "--mock-data",
    "--train-iters", "2", "--lr", "3.0e-4", "--min-lr", "3.0e-5", "--clip-grad", "1.0",
    "--weight-decay", "0.01", "--seed", "1234",
]

# A small GPT: 4 layers, hidden 256, 8 heads, GELU, LayerNorm, learned absolute positions, tied.
BASE = [
    "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
    "--seq-length", "256", "--max-position-embeddings", "256",
    "--micro-batch-size", "2", "--global-batch-size", "4",
    "--vocab-size", "8000", "--make-vocab-size-divisible-by", "128",
    "--bf16",
]

LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights"]


def _cfg(name: str, world_size: int, extra: List[str], ci: bool = False, base=None, note: str = "",
         requires=()):
    flags = list(base if base is not None else BASE)
    # later flags override earlier ones (argparse semantics); `requires`: extra Python modules
    # megatron-core needs for this configuration (the run is marked skipped without them)
    return {"name": name, "world_size": world_size, "flags": COMMON + flags + extra, "ci": ci,
            "note": note, "requires": list(requires)}


GRID: List[Dict[str, Any]] = [
    # --- tensor parallel, sequence parallel
    _cfg("tp1_base", 1, [], ci=True, note="TP1 PP1 DP1, GELU, LayerNorm, tied, 2 micro-batches"),
    _cfg("tp2_nosp", 2, ["--tensor-model-parallel-size", "2"]),
    _cfg("tp2_sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], ci=True),
    _cfg("tp4_nosp", 4, ["--tensor-model-parallel-size", "4"]),
    _cfg("tp4_sp", 4, ["--tensor-model-parallel-size", "4", "--sequence-parallel"]),
    # --- pipeline parallel: more and fewer micro-batches than stages
    _cfg("pp2_mb4", 2, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"], ci=True),
    _cfg("pp2_mb1", 2, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "2"], ci=True,
         note="1 micro-batch < 2 stages"),
    _cfg("pp4_mb8", 4, ["--pipeline-model-parallel-size", "4", "--num-layers", "8",
                        "--global-batch-size", "16"]),
    _cfg("pp4_mb2", 4, ["--pipeline-model-parallel-size", "4", "--num-layers", "8",
                        "--global-batch-size", "4"], note="2 micro-batches < 4 stages"),
    _cfg("llama_pp4_mb2", 4, LLAMA + ["--group-query-attention", "--num-query-groups", "4",
                                      "--pipeline-model-parallel-size", "4", "--num-layers", "8",
                                      "--global-batch-size", "4"],
         note="SwiGLU (unfused GLU) middle stages peak in the backward (issue 13)"),
    _cfg("tp2_sp_pp2", 4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                           "--pipeline-model-parallel-size", "2", "--global-batch-size", "8"],
         note="unfused softmax backward on a TP2 SP first stage"),
    _cfg("pp2_uneven", 2, ["--pipeline-model-parallel-size", "2", "--num-layers", "5",
                           "--decoder-first-pipeline-num-layers", "2", "--global-batch-size", "8"],
         note="uneven split 2+3"),
    # --- pipeline split corners (2026-11-30): the last stage's count, the embedding and loss counted in the split,
    # a layout string, each with and without virtual stages
    _cfg("pp2_last1", 2, ["--pipeline-model-parallel-size", "2", "--num-layers", "5",
                          "--decoder-last-pipeline-num-layers", "1", "--global-batch-size", "8"],
         note="uneven split 4+1 by the last stage's count"),
    _cfg("pp2_acc_emb_loss", 2, ["--pipeline-model-parallel-size", "2", "--num-layers", "6",
                                 "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                                 "--global-batch-size", "8"],
         note="embedding and loss each count as a layer: (6 + 2) / 2 = 4 slots, 3 + 3 layers"),
    _cfg("pp2_layout", 2, ["--pipeline-model-parallel-size", "2", "--num-layers", "5",
                           "--pipeline-model-parallel-layout", "Et|ttttL", "--global-batch-size", "8"],
         note="--pipeline-model-parallel-layout Et|ttttL: 1 + 4 layers"),
    _cfg("vpp_pp2_first2", 2, ["--pipeline-model-parallel-size", "2", "--num-layers", "6",
                               "--decoder-first-pipeline-num-layers", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                               "--global-batch-size", "8"],
         note="uneven with virtual stages: rank 0 holds 1 + 1 layers, rank 1 2 + 2 (the layout Et|tt|t|ttL)"),
    _cfg("vpp_pp4_first2_last2", 4, ["--pipeline-model-parallel-size", "4", "--num-layers", "12",
                                     "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers",
                                     "2", "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "8"],
         note="uneven first and last stages with virtual stages: chunks of 1, 2, 2, 1 layers per rank's virtual stage"),
    _cfg("vpp_pp2_acc_emb_loss", 2, ["--pipeline-model-parallel-size", "2", "--num-layers", "6",
                                     "--account-for-embedding-in-pipeline-split",
                                     "--account-for-loss-in-pipeline-split",
                                     "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "8"],
         note="embedding and loss in the split with 2 virtual stages: rank 0 E+1 then 2 layers, rank 1 2 then 1+L"),
    _cfg("vpp_pp2_group3_mb5", 2, ["--pipeline-model-parallel-size", "2", "--num-layers", "8",
                                   "--num-layers-per-virtual-pipeline-stage", "2",
                                   "--microbatch-group-size-per-virtual-pipeline-stage", "3",
                                   "--global-batch-size", "10"],
         note="5 micro-batches, not a multiple of PP: groups of 3 leave a last group of 2 >= PP (schedules.py)"),
    # interleaved schedule corners (2026-11-30, corners5): without p2p overlap (the steady pair's receive after its
    # backward, no warm-up input kept), micro-batch groups above PP on 4 stages (the first stage's queue of inputs
    # received ahead), and TP 2 with untied output weights at PP 1
    _cfg("vpp_pp4_v2_no_overlap", 4, ["--pipeline-model-parallel-size", "4", "--num-layers", "8",
                                      "--num-layers-per-virtual-pipeline-stage", "1", "--no-overlap-p2p-communication",
                                      "--global-batch-size", "16"],
         note="vpp_pp4_v2 with --no-overlap-p2p-communication"),
    _cfg("vpp_pp4_group6_mb12", 4, ["--pipeline-model-parallel-size", "4", "--num-layers", "8",
                                    "--num-layers-per-virtual-pipeline-stage", "1",
                                    "--microbatch-group-size-per-virtual-pipeline-stage", "6",
                                    "--global-batch-size", "24"],
         note="12 micro-batches in groups of 6 over PP 4: the first stage receives up to 3 inputs ahead"),
    _cfg("untied_tp2", 2, ["--untie-embeddings-and-output-weights", "--tensor-model-parallel-size", "2"],
         note="TP 2 with untied output weights at PP 1"),
    # --- interleaved (virtual) pipeline
    _cfg("vpp_pp2_v2", 2, ["--pipeline-model-parallel-size", "2", "--num-layers", "8",
                           "--num-layers-per-virtual-pipeline-stage", "2",
                           "--global-batch-size", "8"], ci=True),
    _cfg("vpp_pp4_v2", 4, ["--pipeline-model-parallel-size", "4", "--num-layers", "8",
                           "--num-layers-per-virtual-pipeline-stage", "1",
                           "--global-batch-size", "16"]),
    # --- data parallel, distributed optimizer
    _cfg("dp2", 2, ["--global-batch-size", "8"], ci=True),
    _cfg("dp2_distopt", 2, ["--global-batch-size", "8", "--use-distributed-optimizer"], ci=True),
    _cfg("dp2_distopt_overlap", 2, ["--global-batch-size", "8", "--use-distributed-optimizer",
                                    "--overlap-grad-reduce", "--overlap-param-gather"]),
    _cfg("dp4_distopt", 4, ["--global-batch-size", "8", "--use-distributed-optimizer"]),
    _cfg("dp3_distopt_overlap", 3, ["--global-batch-size", "6", "--use-distributed-optimizer",
                                    "--overlap-grad-reduce"],
         note="DP 3, not a power of two: each bucket's end padded to lcm(3, 128) = 384 elements"),
    _cfg("dp2_distopt_rs_fp32", 2, ["--global-batch-size", "8", "--use-distributed-optimizer",
                                    "--ddp-reduce-scatter-with-fp32-accumulation", "--seq-length", "32",
                                    "--max-position-embeddings", "32"],
         note="all-to-all reduce-scatter: the bucket's all-to-all output and the fp32 sum of the shard after the "
              "backward (short sequences: that moment is the peak)"),
    _cfg("dp2_distopt_overlap_rs_fp32", 2, ["--global-batch-size", "8", "--use-distributed-optimizer",
                                            "--overlap-grad-reduce", "--ddp-bucket-size", "1000000",
                                            "--ddp-reduce-scatter-with-fp32-accumulation", "--seq-length", "32",
                                            "--max-position-embeddings", "32"],
         note="overlapped: core 0.16.1 keeps every bucket's all-to-all output until finish_grad_sync"),
    _cfg("dp4_distopt_2inst", 4, ["--global-batch-size", "8", "--use-distributed-optimizer",
                                  "--num-distributed-optimizer-instances", "2"],
         note="optimizer state sharded over DP/2 = 2 ranks", requires=("einops",)),
    # DP x CP = 1: the one rank of the optimizer's group owns the whole stage's state (issue 13)
    _cfg("tp2_dp1_distopt", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                "--use-distributed-optimizer"], note="TP2 DP1, distributed optimizer"),
    _cfg("pp2_dp1_distopt", 2, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                                "--use-distributed-optimizer"], note="PP2 DP1, distributed optimizer"),
    _cfg("tp2_pp2_dp2_sp_distopt", 8, ["--tensor-model-parallel-size", "2",
                                       "--pipeline-model-parallel-size", "2", "--sequence-parallel",
                                       "--use-distributed-optimizer", "--global-batch-size", "16"],
         note="3D: 8 ranks"),
    # --- micro-batch size
    _cfg("mbs1", 1, ["--micro-batch-size", "1", "--global-batch-size", "4"]),
    _cfg("mbs4", 1, ["--micro-batch-size", "4", "--global-batch-size", "8"]),
    # --- recomputation
    _cfg("recomp_selective", 1, ["--recompute-granularity", "selective"], ci=True),
    _cfg("recomp_selective_tp2_sp", 2, ["--recompute-granularity", "selective",
                                        "--tensor-model-parallel-size", "2", "--sequence-parallel"],
         ci=True),
    _cfg("recomp_selective_pp2", 2, ["--recompute-granularity", "selective", "--pipeline-model-parallel-size",
                                     "2", "--global-batch-size", "8"],
         note="recomputed core attention in a first stage's backward peak"),
    _cfg("recomp_full_uniform1", 1, ["--recompute-granularity", "full", "--recompute-method",
                                     "uniform", "--recompute-num-layers", "1"], ci=True),
    _cfg("recomp_full_uniform2", 1, ["--recompute-granularity", "full", "--recompute-method",
                                     "uniform", "--recompute-num-layers", "2"]),
    _cfg("recomp_full_block1", 1, ["--recompute-granularity", "full", "--recompute-method", "block",
                                   "--recompute-num-layers", "1"]),
    _cfg("recomp_full_block1_of4_bwd", 1, ["--recompute-granularity", "full", "--recompute-method", "block",
                                           "--recompute-num-layers", "1", "--vocab-size", "128",
                                           "--global-batch-size", "2"],
         note="block 1 of 4 layers, a small vocabulary: the peak in the backward, the checkpointed layer replayed "
              "after the three layers above it freed their tensors"),
    # full uniform recompute with a small vocabulary: the peak at the top block's replay in the backward, where the
    # replayed first layer's saved input is the checkpoint's kept input (docs/assumptions.md, "replay")
    _cfg("recomp_full_uniform1_bwd", 1, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                         "--recompute-num-layers", "1", "--vocab-size", "128",
                                         "--global-batch-size", "2"],
         note="uniform 1 of 4 layers, a small vocabulary: the peak at the top layer's replay in the backward"),
    _cfg("recomp_full_uniform2_bwd", 1, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                         "--recompute-num-layers", "2", "--vocab-size", "128",
                                         "--global-batch-size", "2"],
         note="uniform blocks of 2 layers, a small vocabulary: the peak at the top block's replay"),
    _cfg("recomp_full_uniform1_tp2_sp_bwd", 2, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                                "--recompute-num-layers", "1", "--vocab-size", "128",
                                                "--global-batch-size", "2", "--tensor-model-parallel-size", "2",
                                                "--sequence-parallel"],
         note="uniform 1 under SP: the checkpoint keeps the rank's sequence shard"),
    _cfg("recomp_full_block1_of4_tp2_sp_bwd", 2, ["--recompute-granularity", "full", "--recompute-method", "block",
                                                  "--recompute-num-layers", "1", "--vocab-size", "128",
                                                  "--global-batch-size", "2", "--tensor-model-parallel-size", "2",
                                                  "--sequence-parallel"],
         note="recomp_full_block1_of4_bwd under TP2 SP: the peak in the top layer's backward, no replay"),
    _cfg("recomp_full_uniform1_distributed_bwd", 2, ["--recompute-granularity", "full", "--recompute-method",
                                                     "uniform", "--recompute-num-layers", "1", "--vocab-size", "128",
                                                     "--global-batch-size", "2", "--tensor-model-parallel-size", "2",
                                                     "--distribute-saved-activations"],
         note="uniform 1, TP2, --distribute-saved-activations: a 1/TP shard kept, gathered at the replay"),
    _cfg("recomp_full_uniform3_of4_bwd", 1, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                             "--recompute-num-layers", "3", "--vocab-size", "128",
                                             "--global-batch-size", "2"],
         note="uniform 3 of 4 layers: a block of 3 and a last block of 1 (core >= 0.17 ends it at the chunk's end; "
              "0.16.1 reads a layer past it, IndexError, and memguard refuses it there): replay_grid on 0.19.2 only"),
    _cfg("recomp_full_block3_of4_bwd", 1, ["--recompute-granularity", "full", "--recompute-method", "block",
                                           "--recompute-num-layers", "3", "--vocab-size", "128",
                                           "--global-batch-size", "2"],
         note="block 3 of 4 layers, a small vocabulary: the peak at the third layer's replay, handed the gradient "
              "of the unrecomputed layer above"),
    _cfg("recomp_full_block2_pp2", 2, ["--recompute-granularity", "full", "--recompute-method",
                                       "block", "--recompute-num-layers", "2",
                                       "--pipeline-model-parallel-size", "2",
                                       "--global-batch-size", "8"], ci=True),
    _cfg("recomp_full_block0", 1, ["--recompute-granularity", "full", "--recompute-method", "block",
                                   "--recompute-num-layers", "0"], note="block with 0 layers: no layer checkpointed"),
    _cfg("recomp_full_uniform1_tp2_sp", 2, ["--recompute-granularity", "full", "--recompute-method",
                                            "uniform", "--recompute-num-layers", "1",
                                            "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    # --- attention variants
    _cfg("gqa", 1, ["--group-query-attention", "--num-query-groups", "2"]),
    _cfg("gqa_tp2", 2, ["--group-query-attention", "--num-query-groups", "2",
                        "--tensor-model-parallel-size", "2"]),
    _cfg("mqa", 1, ["--group-query-attention", "--num-query-groups", "1"]),
    _cfg("gqa2_tp4_sp", 4, ["--group-query-attention", "--num-query-groups", "2", "--tensor-model-parallel-size", "4",
                            "--sequence-parallel"], note="2 KV groups under TP 4: each group replicated on 2 ranks"),
    # one query head per TP rank with fewer key groups than TP ranks (props8): Attention all-gathers the qkv
    # projection and slices its rank's group; the core attention repeats nothing (heads / TP = 1)
    _cfg("mqa_h2_tp2_rope", 2, ["--num-attention-heads", "2", "--group-query-attention", "--num-query-groups", "1",
                                "--tensor-model-parallel-size", "2", "--position-embedding-type", "rope",
                                "--vocab-size", "1000"]),
    _cfg("mqa_h2_tp2_rope_recomp_core", 2, ["--num-attention-heads", "2", "--group-query-attention",
                                            "--num-query-groups", "1", "--tensor-model-parallel-size", "2",
                                            "--position-embedding-type", "rope", "--vocab-size", "1000",
                                            "--recompute-granularity", "selective", "--recompute-modules", "core_attn"]),
    # 2 key groups over TP 4: the gathered projection is twice the rank's group slice (a view of it keeps it whole)
    _cfg("gqa2_h4_tp4_rope", 4, ["--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
                                 "--tensor-model-parallel-size", "4", "--position-embedding-type", "rope",
                                 "--vocab-size", "1000"]),
    _cfg("gqa2_tp4_sp_recomp_core", 4, ["--group-query-attention", "--num-query-groups", "2",
                                        "--tensor-model-parallel-size", "4", "--sequence-parallel", "--vocab-size",
                                        "1000", "--recompute-granularity", "selective", "--recompute-modules",
                                        "core_attn"]),
    _cfg("mqa_tp2_sp", 2, ["--group-query-attention", "--num-query-groups", "1",
                           "--tensor-model-parallel-size", "2", "--sequence-parallel"],
         note="fewer KV groups than TP ranks"),
    # --- MLP / norm / embedding variants
    _cfg("llama_swiglu_rms_rope", 1, LLAMA + ["--group-query-attention", "--num-query-groups", "4"]),
    _cfg("llama_tp2_sp", 2, LLAMA + ["--group-query-attention", "--num-query-groups", "4",
                                     "--tensor-model-parallel-size", "2", "--sequence-parallel"],
         ci=True),
    _cfg("llama_qk_layernorm", 1, LLAMA + ["--qk-layernorm"]),
    _cfg("untied", 1, ["--untie-embeddings-and-output-weights"]),
    _cfg("untied_pp2", 2, ["--untie-embeddings-and-output-weights", "--pipeline-model-parallel-size",
                           "2", "--global-batch-size", "8"]),
    _cfg("vocab50257_tp4_sp", 4, ["--vocab-size", "50257", "--tensor-model-parallel-size", "4",
                                  "--sequence-parallel"], note="GPT-2 vocabulary, padded to 50688"),
    # --- sequence lengths
    _cfg("seq128", 1, ["--seq-length", "128", "--max-position-embeddings", "128",
                       "--micro-batch-size", "4", "--global-batch-size", "8"]),
    _cfg("seq1024", 1, ["--seq-length", "1024", "--max-position-embeddings", "1024",
                        "--micro-batch-size", "1", "--global-batch-size", "2"]),
    _cfg("seq512_tp2_sp_rope", 2, ["--seq-length", "512", "--max-position-embeddings", "512",
                                   "--position-embedding-type", "rope",
                                   "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    _cfg("no_dataloader_mask", 1, ["--no-create-attention-mask-in-dataloader"]),
    # --- precision / optimizer variants
    _cfg("bf16_grads", 1, ["--grad-reduce-in-bf16"], note="bf16 grad buffer: fp32 accumulation off"),
    _cfg("bf16_grads_dp2_distopt", 2, ["--grad-reduce-in-bf16", "--use-distributed-optimizer",
                                       "--global-batch-size", "8"]),
    _cfg("fp16", 1, ["--fp16", "--initial-loss-scale", "4096"], base=[f for f in BASE if f != "--bf16"],
         note="fp16 params and fp16 grad buffer, dynamic loss scaler"),
    _cfg("fp16_lm_ce", 1, ["--fp16", "--initial-loss-scale", "4096", "--fp16-lm-cross-entropy"],
         base=[f for f in BASE if f != "--bf16"],
         note="fp16 with --fp16-lm-cross-entropy, which megatron-core's GPTModel ignores: the same bytes as fp16"),
    _cfg("fp32", 1, [], base=[f for f in BASE if f != "--bf16"]),
    _cfg("sgd", 1, ["--optimizer", "sgd"]),
    _cfg("per_token_loss_pp2", 2, ["--calculate-per-token-loss", "--pipeline-model-parallel-size", "2",
                                   "--global-batch-size", "8"],
         note="--calculate-per-token-loss: the loss scaled by the token count at the step, no tensor kept"),
    # --- the attention output gate (--attention-output-gate): linear_qkv's gate rows, the tensors the gate keeps
    _cfg("gate", 1, ["--attention-output-gate"], note="gate a view of linear_qkv's output (one head per group)"),
    _cfg("gate_gqa_rope", 1, ["--attention-output-gate", "--group-query-attention", "--num-query-groups", "2",
                              "--position-embedding-type", "rope"], note="GQA: the gate a copy"),
    _cfg("gate_tp2_sp", 2, ["--attention-output-gate", "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    _cfg("gate_pp2_mb4", 2, ["--attention-output-gate", "--pipeline-model-parallel-size", "2",
                             "--global-batch-size", "8"], note="backward peaks with the gate's working set"),
    # --- frozen layers (--freeze-all-layers): weights only; the first stage saves nothing for backward
    _cfg("freeze", 1, ["--freeze-all-layers"], note="PP1: no graph, no backward"),
]


# Megatron-core 0.16.1 is what the referee runs: its NullTokenizer counts one extra EOD token.
REFEREE_MEGATRON_VERSION = "0.16.1"


def resolve_config(flags: List[str], world_size: int, megatron_version: str = REFEREE_MEGATRON_VERSION) -> tuple:
    """The grid flags resolved by memguard itself (the same reader and rules `memguard estimate`
    uses): returns (layout, settings for the worker under Megatron's argument names)."""
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    from megatron_memguard.resolve import resolve

    # The flags describe what the worker builds on megatron-core 0.16.1, which ships no argparse (the worker
    # applies e.g. 0.19's --freeze-all-layers itself): not a 0.16 command line, so no release flag check.
    raw = dataclasses.replace(parse_megatron_flags(flags), megatron_command_line=False)
    layout = resolve(raw, world_size=world_size, megatron_version=megatron_version)
    settings = layout.to_dict()
    # Settings the worker needs that do not change memory (so the Layout does not carry them).
    settings["initial_loss_scale"] = raw.args.get("initial_loss_scale", 2 ** 32)
    return layout, settings


def named(grid: List[Dict[str, Any]], only: Optional[List[str]]) -> List[Dict[str, Any]]:
    """The configurations of ``grid`` named in ``only`` (all when it is empty); an unknown name stops the run."""
    if not only:
        return list(grid)
    names = set(only)
    unknown = names - {c["name"] for c in grid}
    if unknown:
        raise SystemExit(f"unknown configuration(s): {sorted(unknown)}")
    return [c for c in grid if c["name"] in names]


def select(ci: bool = False, only: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    return [c for c in named(GRID, only) if c["ci"] or not ci]

