"""The replay conformance harness (issue 55): a run's history replayed up to each of its workflow
tasks, each way a worker can come to rebuild it, must give the commands, the ids and the
published view the run recorded.

For every workflow task ``k`` of a history, the history is cut right after the task's
``WorkflowTaskStarted`` (as a worker handed that task sees it) and replayed with Temporal's
Replayer in three ways:

- ``cold``: as recorded. This is a worker with ``max_cached_workflows=0`` (every task rebuilds the
  run from the start) and a fresh worker handed task ``k`` as its first. Every activity and child
  id the replay schedules, and every view it publishes, must equal the recorded ones, the
  current task's commands included (Temporal compares only the tasks before it, and never a
  memo's content).
- ``clock``: the same, with the task's clock moved (its ``WorkflowTaskStarted`` time plus a
  millisecond). A worker answering a query by rebuilding the run can see another time for the task
  than the worker that ran it did (issue 55's `audit_append.4`): no id may change with it.
- ``reset``: a reset to task ``k``, as ``temporal workflow reset`` writes it (the task failed with
  cause RESET_WORKFLOW and a new run id, a new task scheduled and started). The copied prefix
  must replay as the original (the same ids), and every id the redone task asks with must be one
  no execution of the original used (but where the task came with a signal or an Update of its
  own: docs/architecture.md "Ids").

The fourth way, a worker killed inside an activity and replaced, with the run queried at once,
needs real processes: tests/chaos/test_query_after_kill.py; and the suite's own runs with the
workflow cache off: `make test-replay`. The live runs of every shape on a cache-off worker,
queried all along: tests/workflows/test_replay_conformance.py.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temporalio import workflow
from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHistory
from temporalio.worker import (
    Interceptor,
    StartActivityInput,
    StartChildWorkflowInput,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
    WorkflowOutboundInterceptor,
)

from workflows.published import VIEW_MEMO

WAYS = ("cold", "clock", "reset")
RESET_RUN_ID = "00000000-0000-4000-8000-000000000055"  # the reset run the ``reset`` way makes


@dataclass
class Sent:
    """What one replay asked of Temporal, in order."""

    activities: list[str] = field(default_factory=list)
    children: list[str] = field(default_factory=list)
    views: list[bytes] = field(default_factory=list)


_SENT: list[Sent] = []  # the replay under way (the Replayer runs one workflow at a time here)


class _Outbound(WorkflowOutboundInterceptor):
    def start_activity(self, input: StartActivityInput) -> Any:
        if _SENT:
            _SENT[-1].activities.append(input.activity_id or "")
        return super().start_activity(input)

    async def start_child_workflow(self, input: StartChildWorkflowInput) -> Any:
        if _SENT:
            _SENT[-1].children.append(input.id)
        return await super().start_child_workflow(input)


class _Inbound(WorkflowInboundInterceptor):
    def init(self, outbound: WorkflowOutboundInterceptor) -> None:
        super().init(_Outbound(outbound))


class Recording(Interceptor):
    """Records the ids each replay schedules (activities, children)."""

    def workflow_interceptor_class(self, input: WorkflowInterceptorClassInput) -> type[WorkflowInboundInterceptor]:
        return _Inbound


@contextlib.contextmanager
def recording() -> Iterator[Sent]:
    """Collect what the replay inside sends, views (memo upserts) included."""
    sent = Sent()
    _SENT.append(sent)
    original = workflow.upsert_memo

    def upsert_memo(updates: Any) -> None:
        if VIEW_MEMO in updates:
            from temporalio.contrib.pydantic import pydantic_data_converter

            sent.views.append(pydantic_data_converter.payload_converter.to_payloads([updates[VIEW_MEMO]])[0].data)
        original(updates)

    workflow.upsert_memo = upsert_memo  # type: ignore[assignment]
    try:
        yield sent
    finally:
        workflow.upsert_memo = original  # type: ignore[assignment]
        _SENT.remove(sent)


def _raw(history: WorkflowHistory) -> list[HistoryEvent]:
    return list(history.events)


def _ours(activity_id: str) -> str:
    """An id the workflow chose; "" for one the SDK numbered (a read-only tool call's)."""
    return "" if activity_id.isdigit() else activity_id


def ours_from_the_start(history: WorkflowHistory) -> bool:
    """Whether the run made its ids from history (this build started it: its marker, BUILD): a
    run the previous build started made them from the task's clock, and replays them so (its
    first task, done again by this build, would make this build's)."""
    from workflows.published import BUILD

    for event in history.events:
        if event.HasField("marker_recorded_event_attributes"):
            data = event.marker_recorded_event_attributes.details["patch-data"].payloads
            if data and f'"{BUILD}"' in data[0].data.decode(errors="replace"):
                return True
    return False


def task_starts(history: WorkflowHistory) -> list[int]:
    """Indices of the ``WorkflowTaskStarted`` events of the tasks that completed."""
    events = _raw(history)
    starts = []
    for i, event in enumerate(events):
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED and i + 1 < len(events) \
                and events[i + 1].event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
            starts.append(i)
    return starts


@dataclass
class Expected:
    """What the run recorded up to and including task ``k``'s commands."""

    activities: list[str]
    children: list[str]
    views: list[bytes]
    every_activity: set[str]  # every activity id of the whole history
    every_child: set[str]


def recorded(history: WorkflowHistory, start: int) -> Expected:
    events = _raw(history)
    acts, kids, views = [], [], []
    # Task k's commands follow its completion, up to the next task's schedule (or the end).
    end = next((i for i in range(start + 2, len(events))
                if events[i].event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED), len(events))
    every_act, every_kid = set(), set()
    for i, e in enumerate(events):
        if e.HasField("activity_task_scheduled_event_attributes"):
            every_act.add(_ours(e.activity_task_scheduled_event_attributes.activity_id))
            if i < end:
                acts.append(_ours(e.activity_task_scheduled_event_attributes.activity_id))
        elif e.HasField("start_child_workflow_execution_initiated_event_attributes"):
            every_kid.add(e.start_child_workflow_execution_initiated_event_attributes.workflow_id)
            if i < end:
                kids.append(e.start_child_workflow_execution_initiated_event_attributes.workflow_id)
        elif e.HasField("workflow_properties_modified_event_attributes") and i < end:
            fields = e.workflow_properties_modified_event_attributes.upserted_memo.fields
            if VIEW_MEMO in fields:
                views.append(fields[VIEW_MEMO].data)
    return Expected(acts, kids, views, every_act, every_kid)


def _admits_update(history: WorkflowHistory, start: int) -> bool:
    events = _raw(history)
    for e in events[start + 2:]:
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED:
            return False
        if e.HasField("workflow_execution_update_accepted_event_attributes"):
            return True
    return False


def _signalled(history: WorkflowHistory, start: int) -> bool:
    """Whether the task at ``start`` came with a signal or an Update of its own. temporalio applies
    those before an activation's other jobs, the reset's new random seed among them: what their
    code schedules first in a redone task asks under the original's seed (docs/architecture.md
    "Ids" names this exception)."""
    events = _raw(history)
    scheduled = events[start].workflow_task_started_event_attributes.scheduled_event_id
    previous = max((i for i, e in enumerate(events[:start])
                    if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED), default=0)
    return _admits_update(history, start) or any(
        e.HasField("workflow_execution_signaled_event_attributes") for e in events[previous:start]
        if e.event_id < scheduled or e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)


def recorded_before(history: WorkflowHistory, start: int) -> list[str]:
    """The activity ids the tasks before the one at ``start`` scheduled."""
    return [_ours(e.activity_task_scheduled_event_attributes.activity_id) for e in _raw(history)[: start - 1]
            if e.HasField("activity_task_scheduled_event_attributes")]


def cut(history: WorkflowHistory, start: int, way: str) -> WorkflowHistory:
    """The history up to task ``k`` (its ``WorkflowTaskStarted`` at index ``start``), one way."""
    events = [HistoryEvent.FromString(e.SerializeToString()) for e in _raw(history)[: start + 1]]
    if way == "clock":
        moved = events[-1].event_time
        moved.nanos = (moved.nanos + 1_000_000) % 1_000_000_000
        if moved.nanos < 1_000_000:
            moved.seconds += 1
    elif way == "reset":
        started = events[-1]
        scheduled = next(e for e in events if e.event_id == started.workflow_task_started_event_attributes.scheduled_event_id)
        next_id = started.event_id + 1
        failed = HistoryEvent(event_id=next_id, event_type=EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED)
        failed.event_time.CopyFrom(started.event_time)
        attrs = failed.workflow_task_failed_event_attributes
        attrs.scheduled_event_id = scheduled.event_id
        attrs.started_event_id = started.event_id
        attrs.cause = WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_RESET_WORKFLOW
        attrs.base_run_id = "base"
        attrs.new_run_id = RESET_RUN_ID
        attrs.identity = "conformance-reset"
        again = HistoryEvent(event_id=next_id + 1, event_type=EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED)
        again.event_time.CopyFrom(started.event_time)
        again.workflow_task_scheduled_event_attributes.CopyFrom(scheduled.workflow_task_scheduled_event_attributes)
        restarted = HistoryEvent(event_id=next_id + 2, event_type=EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED)
        restarted.event_time.CopyFrom(started.event_time)
        restarted.event_time.seconds += 5  # done again later, as a reset's task is
        restarted.workflow_task_started_event_attributes.CopyFrom(started.workflow_task_started_event_attributes)
        restarted.workflow_task_started_event_attributes.scheduled_event_id = next_id + 1
        events += [failed, again, restarted]
    elif way != "cold":
        raise ValueError(f"no way {way!r}: one of {WAYS}")
    raw = json.loads(history.to_json())
    from google.protobuf.json_format import MessageToDict

    raw["events"] = [MessageToDict(e) for e in events]
    return WorkflowHistory.from_json(history.workflow_id, json.dumps(raw))


async def conform(replayer: Any, history: WorkflowHistory, start: int, way: str) -> list[str]:
    """Replay ``history`` up to the task at ``start`` one way; what differs from the record
    (empty: it conforms)."""
    with recording() as sent:
        result = await replayer.replay_workflow(cut(history, start, way), raise_on_replay_failure=False)
    problems = []
    if result.replay_failure is not None:
        problems.append(f"replay failed: {result.replay_failure}")
    want = recorded(history, start)
    if _admits_update(history, start):
        # An Update the task took reaches a worker with the task, not in the history before it:
        # a replay of the history up to it cannot hold it. The task's commands are compared by
        # the next task's replay (Temporal checks them there, and so does this harness).
        before = recorded_before(history, start)
        events = _raw(history)
        scheduled = events[start].workflow_task_started_event_attributes.scheduled_event_id
        views = [e.workflow_properties_modified_event_attributes.upserted_memo.fields[VIEW_MEMO].data
                 for e in events if e.event_id < scheduled and e.HasField("workflow_properties_modified_event_attributes")
                 and VIEW_MEMO in e.workflow_properties_modified_event_attributes.upserted_memo.fields]
        want = Expected(before, want.children[:len(sent.children)], views, want.every_activity, want.every_child)
        sent.activities, sent.views = sent.activities[: len(before)], sent.views[: len(views)]
    if way in ("cold", "clock"):
        if sent.activities != want.activities:
            problems.append(f"activity ids {sent.activities[len(want.activities) - 3:]} != recorded "
                            f"{want.activities[-3:]}")
        if sent.children != want.children:
            problems.append(f"child ids {sent.children} != recorded {want.children}")
        if way == "cold" and sent.views != want.views:
            problems.append(f"published views differ ({len(sent.views)} against {len(want.views)} recorded)")
        if way == "clock" and len(sent.views) != len(want.views):
            problems.append(f"{len(sent.views)} views published against {len(want.views)} recorded")
    else:
        # The copied prefix (tasks before k) replays as recorded; the redone task asks anew.
        prefix = recorded_before(history, start)
        if sent.activities[: len(prefix)] != prefix:
            problems.append("the reset run's copied prefix scheduled other activity ids")
        # A write's attempt is named by its tool call (tc-...), the same in every execution by
        # design: the effect ledger keys on it, and the capability minted for the attempt binds
        # its answer to the run id. Every other id is this execution's.
        reused = [a for a in sent.activities[len(prefix):] if a and not a.startswith("tc-") and a in want.every_activity]
        if reused and not _signalled(history, start):
            problems.append(f"the reset run asks with ids the original used: {reused}")
    return problems


def recording_replayer(keys: Any = None) -> Any:
    """A replayer holding the recordings' key ring (or ``keys``), its workflow code watched by
    ``Recording``."""
    from tether.store.keys import KeyRing
    from tests.histories.record import RING
    from worker import create_replayer

    return create_replayer(keys=keys or KeyRing.from_env(str(RING)), interceptors=[Recording()])


def load_recorded(path: Path) -> WorkflowHistory:
    """A recorded history (tests/histories), under the workflow id it was recorded with."""
    workflow_id = "history-continue_as_new" if path.stem == "continued" else f"history-{path.stem}"
    return WorkflowHistory.from_json(workflow_id, path.read_text())
