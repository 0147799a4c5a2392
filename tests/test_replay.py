"""Replay the recorded histories of the main paths (tests/histories/*.json, written by
`make record-histories`) against the current workflow code. A change that would break runs
already in flight (a new activity, a reordered timer, a removed signal) fails here."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from tests.histories.incompatible import ReorderedAgentRun
from workflows.agent_run import AgentRun

HERE = Path(__file__).resolve().parent / "histories"
# This version's histories (make record-histories), and the previous versions' (v1/: the first
# release; v2/: before the trust chain, the per-execution audit, decisions and Failed endings;
# v3/: before recovery, the settled continue-as-new and tether-lean's one marker per run;
# v4/: before the start listed a run as PLANNING and continue-as-new waited until it is worth
# what it writes): runs they started may still be in flight when this version's workers take over.
HISTORIES = sorted(HERE.glob("*.json")) + [p for v in ("v4", "v3", "v2", "v1") for p in sorted((HERE / v).glob("*.json"))]
PATHS = {"approve", "reject", "expiry", "replan", "retry", "handoff", "cancel", "continue_as_new", "continued", "decide"}


def load(path: Path) -> WorkflowHistory:
    return WorkflowHistory.from_json(f"history-{path.stem}", path.read_text())


def test_every_main_path_is_recorded() -> None:
    assert PATHS | {"revise", "partial", "decide_refused", "compensated"} <= {p.stem for p in HERE.glob("*.json")}
    assert PATHS | {"revise", "partial", "decide_refused", "compensated"} <= {p.stem for p in (HERE / "v4").glob("*.json")}
    assert PATHS | {"revise", "partial", "decide_refused"} <= {p.stem for p in (HERE / "v3").glob("*.json")}
    assert PATHS <= {p.stem for p in (HERE / "v2").glob("*.json")}
    assert PATHS - {"continued", "decide"} <= {p.stem for p in (HERE / "v1").glob("*.json")}


@pytest.mark.parametrize("path", HISTORIES, ids=[f"{p.parent.name}/{p.stem}" for p in HISTORIES])
async def test_history_replays_on_the_current_code(path: Path) -> None:
    replayer = Replayer(workflows=[AgentRun], data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(load(path), raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{path.name} no longer replays: {result.replay_failure}"


async def test_an_incompatible_change_fails_replay() -> None:
    replayer = Replayer(workflows=[ReorderedAgentRun], data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(load(HISTORIES[0]), raise_on_replay_failure=False)
    assert result.replay_failure is not None
    assert "nondetermin" in str(result.replay_failure).lower()


def test_patch_ids_are_compatibility_data() -> None:
    """Recorded histories name these ids in their markers: renaming one makes runs in flight
    take the other branch on replay. tether-lean (issue 21) stands for every older one."""
    from workflows import agent_run as a

    assert [a.PATCH_V2, a.TRUST_CHAIN, a.PATCH_RECORD, a.PATCH_RECOVERY, a.FAILED_STATUS, a.REVISIONS,
            a.ESCALATION, a.NOTIFY, a.CANCEL_REACHES_TOOL, a.CAN_SETTLE, a.PATCH_LEAN] == [
        "tether-v2", "tether-trust-chain", "tether-record", "tether-recovery", "failed-status",
        "tether-revisions", "tether-escalation", "tether-notify", "cancel-reaches-tool", "tether-can-settle",
        "tether-lean",
    ]


def test_no_patch_marker_follows_a_local_activity_in_one_workflow_task() -> None:
    """sdk-core: a patch marker right after a local activity's result, in one workflow task,
    fails replay when a query was answered in between. This version's histories decide every
    patch where no local activity just resolved (tether-can-amortized included)."""
    import base64
    import json

    seen = set()
    for path in sorted(HERE.glob("*.json")):
        events = json.loads(path.read_text())["events"]
        for before, event in zip(events, events[1:]):
            marker = event.get("markerRecordedEventAttributes")
            if not marker or marker.get("markerName") != "core_patch":
                continue
            seen.add(json.loads(base64.b64decode(marker["details"]["patch-data"]["payloads"][0]["data"]))["id"])
            previous = before.get("markerRecordedEventAttributes")
            same_task = previous and previous.get("workflowTaskCompletedEventId") == marker.get("workflowTaskCompletedEventId")
            assert not (same_task and previous.get("markerName") == "core_local_activity"), (path.name, event["eventId"])
    assert {"tether-lean", "tether-can-amortized"} <= seen
