"""The pure rules behind issue 13: an attempt's clock, what a failed attempt says about its
effect, and the outcome fields' JSON compatibility."""

from __future__ import annotations

from workflows import retries
from workflows.contract import ExecutedStep, ToolEffect
from workflows.states import Refs


def test_effect_outcome_of_a_failed_attempt() -> None:
    outcome = retries.failure_outcome
    assert outcome(ToolEffect.READ_ONLY, permanent=False) == "failed"  # a read applies nothing
    for effect in (ToolEffect.IDEMPOTENT, ToolEffect.RECONCILABLE, ToolEffect.UNSAFE):
        assert outcome(effect, permanent=False) == "unknown"
        assert outcome(effect, permanent=True) == "failed"  # the tool refused: known not applied
        assert outcome(effect, permanent=False, started=False) == "failed"  # no worker ran it


def test_attempt_clock_derives_from_the_declared_timeout() -> None:
    t = retries.tool_timeouts(3.0)
    assert (t.run, t.grace, t.heartbeat, t.start_to_close) == (3.0, 1.5, 2.0, 4.5)
    t = retries.tool_timeouts(600.0)
    assert (t.grace, t.heartbeat) == (30.0, 30.0)  # both capped
    # The next attempt waits for what the last one sent to land; after a heartbeat timeout (the
    # worker may only be cut off), for as long as a whole attempt may last.
    assert retries.settle_seconds(t, "injected_fault") == t.grace
    assert retries.settle_seconds(t, "timeout_heartbeat") == t.start_to_close


def test_executed_steps_recorded_before_outcome_existed_still_load() -> None:
    # Carried-over state and recorded histories hold steps without ``outcome``: it reads as status.
    old = {"tool_call_id": "tc-1", "tool": "send_email", "args": {}, "status": "failed"}
    assert ExecutedStep.model_validate(old).outcome == "failed"
    assert ExecutedStep.model_validate({**old, "status": "ok"}).outcome == "ok"
    new = ExecutedStep.model_validate({**old, "outcome": "unknown"})
    assert (new.status, new.outcome) == ("failed", "unknown")
    assert new.model_dump()["outcome"] == "unknown"
    assert Refs.model_validate({"tool_call_id": "tc-1"}).outcome is None
