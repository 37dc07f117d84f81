"""The referee retries a run once when its loopback transport failed (a port taken between _free_port and the
rank's listen), whatever torch's spelling of the error."""
import pytest

from benchmarks.referee import run


@pytest.mark.parametrize("message", [
    # torch 2.13 / 2.14 TCPStore (c10d socket.cpp), as a CI run of tests/test_referee_ci.py[pp2_mb1] hit it
    "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
    "port: 39603, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use",
    "RuntimeError: Address already in use",
])
def test_a_port_taken_by_another_job_is_retried_once(monkeypatch, message):
    calls = []

    def once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise run.RefereeError(f"referee run rank 0 failed (world size 2)\n--- rank 0 traceback ---\n{message}")
        return [{"rank": 0}]

    monkeypatch.setattr(run, "unsupported_reason", lambda cores: None)
    monkeypatch.setattr(run, "_run_once", once)
    assert run.run_referee({}, 2) == [{"rank": 0}]
    assert len(calls) == 2


def test_a_rank_that_failed_for_its_own_reason_is_not_retried(monkeypatch):
    calls = []

    def once(*args):
        calls.append(args)
        raise run.RefereeError("rank 0: AssertionError: address already in use", root_cause_known=True)

    monkeypatch.setattr(run, "unsupported_reason", lambda cores: None)
    monkeypatch.setattr(run, "_run_once", once)
    with pytest.raises(run.RefereeError):
        run.run_referee({}, 2)
    assert len(calls) == 1
