"""memguard against the GPU memory Megatron-LM's CI measured on its MoE functional tests
(shared/groundtruth/megatron-functional-moe-dev.jsonl, the 42 records with empty quality_flags).

Target (issue 16): per platform, at least 90% within +-5% of the measured peak allocated and a median
absolute error of at most 3%, on the records whose only feature beyond the dense core is MoE (records that
also use Megatron-FSDP, FP8, CUDA graphs or Muon are those issues' to score); what memguard does not model
(Megatron-FSDP with experts) is refused by name.
"""
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from accuracy_megatron_ci import evaluate, load_records  # noqa: E402
from shared_data import MOE_RECORDS  # noqa: E402

ROWS = [evaluate(r) for r in load_records(MOE_RECORDS)]
# Features other issues model (Megatron-FSDP, FP8, CUDA graphs, Muon, activation offloading): their records
# are scored by those issues' tests (offloading with the EP overlap: tests/test_ep_overlap.py); the MoE
# targets below hold on the records whose only feature beyond the dense core is MoE.
OTHER_FEATURES = ("--use-megatron-fsdp", "--fp8-format", "--cuda-graph-impl", "muon", "--fine-grained-activation-offloading")


def _moe_only(r) -> bool:
    return not any(f in r.flags for f in OTHER_FEATURES)


def test_moe_records_meet_the_peak_targets_per_platform():
    assert len(ROWS) == 42
    for platform in ("H100", "A100", "GB200"):
        rows = [r for r in ROWS if r.platform == platform and r.peak_err is not None and _moe_only(r)]
        errs = [abs(r.peak_err) for r in rows]
        assert len(rows) >= 9, platform
        assert sum(e <= 0.05 for e in errs) / len(rows) >= 0.90, (platform, errs)
        assert statistics.median(errs) <= 0.03, (platform, statistics.median(errs))


def test_moe_records_steady_state_after_the_step():
    # all but 4 estimated records within 3%: the three --overlap-moe-expert-parallel-comm records hold
    # ~55 MiB more after the step than memguard counts (not identified: the overlap's extra streams?) and
    # one 4-GPU GB200 record ~47 MiB less
    errs = [abs(r.steady_err) for r in ROWS if r.steady_err is not None and _moe_only(r)]
    assert sum(e <= 0.03 for e in errs) / len(errs) >= 0.85
    assert statistics.median(errs) <= 0.01


def test_only_other_features_are_refused_and_by_name():
    refused = [r for r in ROWS if r.error]
    assert all("not modelled yet" in r.error for r in refused)
    # MoE itself, expert parallelism and the expert all-to-all overlap are modelled
    assert not any(k in r.error for r in refused for k in ("--num-experts", "--expert-model-parallel-size"))
    # the overlap is modelled with pipeline parallelism too (the combined 1F1B schedule)
    assert not any("--overlap-moe-expert-parallel-comm" in r.error for r in refused)
    assert len(refused) <= 9
    # no record is refused for MoE itself once the other features are modelled; TE's operation fuser is
    # modelled (tests/test_op_fuser.py scores its record)
    assert not any("--use-transformer-engine-op-fuser" in r.error for r in refused)
    assert all(any(k in r.error for k in ("--overlap-moe-expert-parallel-comm", "--fp8", "--use-megatron-fsdp"))
               for r in refused), [r.error for r in refused]
