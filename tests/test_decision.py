"""One pre-flight result type and one abort exception for the Megatron hook and the Bridge / Lightning
integrations (docs/hook.md, docs/integrations.md: exit code 3 on every rank, modes, threshold 0.8)."""
import pytest

from megatron_memguard import _integration, decision
from megatron_memguard.errors import ConfigError


def test_one_abort_for_every_integration():
    from megatron_memguard.bridge import PreflightAbort as BridgeAbort
    from megatron_memguard.lightning import PreflightAbort as LightningAbort
    from megatron_memguard.megatron import MemguardAbort
    assert MemguardAbort is BridgeAbort is LightningAbort is decision.MemguardAbort
    d = decision.Decision(mode="abort", action="abort")
    with pytest.raises(SystemExit) as e:
        raise LightningAbort("stop", d)
    assert e.value.code == 3 and e.value.decision is d and e.value.result is d


def test_one_result_type():
    from megatron_memguard.bridge import PreflightResult
    from megatron_memguard.megatron import Decision
    assert PreflightResult is Decision is decision.Decision
    d = Decision(mode="warn", action="skipped")
    assert d.verdict is None and not d.fits
    # the run log's context.decision keeps the keys each integration wrote (docs/hook.md, docs/integrations.md)
    assert list(d.to_dict()) == ["mode", "action", "updates", "gpu", "gpu_memory", "gpu_memory_source", "megatron_version",
                                 "reason", "verdict", "critical_stage", "predicted_device_total"]
    assert list(Decision(mode="warn", action="skipped", taken_by="preflight").to_dict()) == [
        "mode", "action", "verdict", "reason", "world_size", "world_size_from", "gpu", "gpu_memory", "gpu_memory_source",
        "critical_stage", "predicted_device_total", "source"]


def test_modes_and_threshold_defined_once():
    from megatron_memguard.megatron import MODES
    from megatron_memguard.megatron.flags import DEFAULT_THRESHOLD
    assert MODES == ("off", "report", "warn", "abort", "autotune")
    assert _integration.MODES == MODES[:4]   # autotune rewrites Megatron's arguments: the hook's only
    assert DEFAULT_THRESHOLD == _integration.DEFAULT_THRESHOLD == 0.8
    assert _integration.threshold_from(None, {}) == 0.8 and _integration.mode_from(None, {}) == "warn"
    with pytest.raises(ConfigError, match="autotune is the Megatron hook's"):
        _integration.mode_from("autotune", {})


def test_expert_grid_rule_with_the_world_from_the_environment_or_unknown():
    # initialize_model_parallel (parallel_state.py, 0.16.1 and 0.19.2): the world must divide into ETP x EP x PP; the
    # pre-flight reads the world from args.world_size or, failing that, the environment's WORLD_SIZE (a string)
    from megatron_memguard.decision import expert_grid_failure
    args = {"num_experts": 8, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
            "expert_model_parallel_size": 4}.get
    assert "world size 6 is not divisible by expert tensor parallel 1 x expert parallel 4" in expert_grid_failure(args, "6")
    assert expert_grid_failure(args, "8") is None and expert_grid_failure(args, 8) is None
    # an unknown world is nothing to check (not a world of 1, into which 4 expert-parallel ranks do not divide)
    assert expert_grid_failure(args, None) is None and expert_grid_failure(args, "") is None
    assert "world size 6" in expert_grid_failure(args, 6)
