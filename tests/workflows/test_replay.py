"""Replay the recorded histories of the main paths (tests/histories/*.json, written by
`make record-histories`) against the current workflow code. A change that would break runs
already in flight (a new activity, a reordered timer, a removed signal) fails here."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory

from tests.histories.incompatible import ReorderedAgentRun
from workflows.agent_run import AgentRun
from tests.helpers.replay import replayer

HERE = Path(__file__).resolve().parents[1] / "histories"
# This build's histories (make record-histories). A build replays only the histories it started:
# runs an earlier build started drain on that build (docs/changing-workflows.md).
HISTORIES = sorted(HERE.glob("*.json"))
# The previous build's (published.PREVIOUS_BUILD, whose activity ids came from a random draw and
# the task's clock): runs it started replay on this build with the ids they made.
PREVIOUS = sorted((HERE / "previous").glob("*.json"))
# The previous build's runs started after its tether-history-ids patch (ids from the seed).
PREVIOUS_SEEDED = sorted((HERE / "previous" / "history-ids").glob("*.json"))
PATHS = {"approve", "reject", "expiry", "replan", "retry", "handoff", "cancel", "continue_as_new", "continued", "decide"}


def load(path: Path) -> WorkflowHistory:
    # The recorded run's own workflow id: seals and attestations bind it (continued.json is the
    # run history-continue_as_new continued into).
    workflow_id = "history-continue_as_new" if path.stem == "continued" else f"history-{path.stem}"
    return WorkflowHistory.from_json(workflow_id, path.read_text())


def test_every_main_path_is_recorded() -> None:
    assert PATHS | {"revise", "partial", "decide_refused", "compensated"} <= {p.stem for p in HISTORIES}
    assert not [p for p in HERE.iterdir() if p.is_dir() and p.name.startswith("v")], "older builds' histories are retired"
    # A shape this build added has no previous-build recording (queue_full: the tether-queue-cap
    # patch, which a run of either build writes where it first refuses a decision so).
    assert {p.stem for p in HISTORIES} <= {p.stem for p in PREVIOUS} | {"plan_judged", "queue_full"}, "the previous build's stay beside them"


@pytest.mark.parametrize("path", HISTORIES + PREVIOUS + PREVIOUS_SEEDED, ids=[p.stem for p in HISTORIES]
                         + [f"previous-{p.stem}" for p in PREVIOUS] + [f"previous-seeded-{p.stem}" for p in PREVIOUS_SEEDED])
async def test_history_replays_on_the_current_code(path: Path) -> None:
    result = await replayer().replay_workflow(load(path), raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{path.name} no longer replays: {result.replay_failure}"


async def test_an_incompatible_change_fails_replay() -> None:
    result = await replayer(ReorderedAgentRun).replay_workflow(load(HISTORIES[0]), raise_on_replay_failure=False)
    assert result.replay_failure is not None
    assert "nondetermin" in str(result.replay_failure).lower()


async def test_a_history_without_its_build_marker_fails_the_task_not_the_run() -> None:
    """An earlier build's history (no marker of this build): the task fails, saying so."""
    import json

    raw = json.loads(load(HISTORIES[0]).to_json())
    raw["events"] = [e for e in raw["events"] if "markerRecordedEventAttributes" not in e]
    history = WorkflowHistory.from_json("older-build", json.dumps(raw))
    result = await replayer().replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is not None and "older_build" in str(result.replay_failure)


def test_the_build_id_is_compatibility_data() -> None:
    """Every run this build starts names it in its one marker: renaming it is a new build."""
    from workflows.published import BUILD

    assert BUILD == "tether-build-10"


def test_no_history_holds_a_local_activity() -> None:
    """sdk-core hands a local activity's result over at another point live than on replay when
    a query was answered meanwhile (docs/known-issues.md): this build records none."""
    for path in HISTORIES:
        assert "core_local_activity" not in path.read_text(), path.name
