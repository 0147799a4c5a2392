"""Runs as Temporal's visibility lists them (``list_runs``, ``list_query``, ``RunSummary``; no
worker needed), and the build that started each (``build_order``, ``run_build``, ``drain``).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from datetime import datetime

from pydantic import BaseModel, Field
from temporalio.client import Client
from temporalio.service import RPCError

from workflows.published import BUILD, CHANGE_VERSION_ATTRIBUTE, PREVIOUS_BUILD, STATE_ATTRIBUTE, TENANT_ATTRIBUTE
from workflows.contract import NAME_PATTERN
from workflows.run_state import RunView
from workflows.states import RunState
from tether.connection import TetherError, UsageError
from tether.runs import StuckTask, ViewUnverified, describe as _describe, published_view, stuck_task
from tether.client.reads import closed_note


class RunSummary(BaseModel):
    run_id: str
    state: str | None
    tenant: str | None
    status: str | None
    started: datetime | None
    closed_by_temporal: str | None = None  # as in RunStatus
    published_at: datetime | None = None  # when the run last published its view (None: never)
    view: RunView | None = Field(None, exclude=True)  # what it published (for the inbox; not listed out)
    view_unverified: str | None = None  # its memo holds a view the fleet did not sign for it
    stuck: StuckTask | None = None  # with ``list_runs(stuck=True)``: its workflow task keeps failing
    parent: str | None = None  # a child run's parent, as the server records it (not a claim of the run's)
    task_queue: str | None = None  # the queue its tasks go to (the server's record)


# Describes at once when listing runs stuck: one each, a few at a time.
DESCRIBE_CONCURRENCY = 8


def list_query(state: str | None, tenant: str | None) -> str:
    """The visibility query for runs; inputs are checked first (they are quoted into it)."""
    state = state.upper() if state else state  # `--state awaiting_approval` means the same
    if state and state not in RunState.__members__:
        raise UsageError(f"unknown state {state!r}; one of {', '.join(RunState.__members__)}", field="state")
    if tenant and not re.match(NAME_PATTERN, tenant):
        raise UsageError(f"invalid tenant {tenant!r}", field="tenant")
    clauses = ["WorkflowType = 'AgentRun'"]
    if state:
        clauses.append(f"{STATE_ATTRIBUTE.name} = '{state}'")
    if tenant:
        clauses.append(f"{TENANT_ATTRIBUTE.name} = '{tenant}'")
    return " AND ".join(clauses)


def build_order(build: str) -> int:
    """Where a build marker (``tether-build-N``) stands among builds: N; -1 for anything else
    (a run from before builds had a number)."""
    m = re.fullmatch(r"tether-build-(\d+)", build)
    return int(m.group(1)) if m else -1


def run_build(markers: Sequence[str] | None) -> str | None:
    """The build that started a run, from its TemporalChangeVersion markers (None: none)."""
    builds = [m for m in markers or [] if build_order(m) >= 0]
    return max(builds, key=build_order) if builds else None


async def drain(client: Client, *, limit: int = 1000) -> list[RunSummary]:
    """The open runs started by a build older than this one (by build order: their first task
    wrote an earlier build's marker, or none) that this build does not replay: all but the
    previous build's (PREVIOUS_BUILD). Their build's workers must serve them until this list is
    empty (docs/changing-workflows.md); a newer build's runs are never listed."""
    rows = []
    ours = build_order(BUILD)
    try:
        async for wf in client.list_workflows("WorkflowType = 'AgentRun' AND ExecutionStatus = 'Running'", limit=limit):
            attrs = wf.typed_search_attributes
            started_by = run_build(attrs.get(CHANGE_VERSION_ATTRIBUTE))
            if started_by is not None and (build_order(started_by) >= ours or started_by == PREVIOUS_BUILD):
                continue
            rows.append(RunSummary(
                run_id=wf.id, state=attrs.get(STATE_ATTRIBUTE), tenant=attrs.get(TENANT_ATTRIBUTE),
                status=wf.status.name if wf.status else None, started=wf.start_time,
            ))
    except RPCError as e:
        raise UsageError(f"listing failed: {e.message}") from None
    return rows


async def list_runs(
    client: Client, *, state: str | None = None, tenant: str | None = None, limit: int = 50, stuck: bool = False
) -> list[RunSummary]:
    """Runs from visibility (search attributes and the memo the runs publish; no worker needed).
    ``stuck``: only running runs whose workflow task keeps failing, each with its error (one
    describe per running run)."""
    if limit < 1:
        raise UsageError(f"limit must be at least 1, not {limit}", field="limit")
    query = list_query(state, tenant) + (" AND ExecutionStatus = 'Running'" if stuck else "")
    rows = []
    try:
        async for wf in client.list_workflows(query, limit=limit):
            attrs = wf.typed_search_attributes
            unverified = None
            try:
                view = await published_view(wf)
            except ViewUnverified as e:
                view, unverified = None, str(e)  # listed all the same, its view never shown
            except TetherError:
                view = None  # listed all the same; `tether status` says why it cannot be read
            rows.append(
                RunSummary(
                    run_id=wf.id,
                    state=attrs.get(STATE_ATTRIBUTE),
                    tenant=attrs.get(TENANT_ATTRIBUTE),
                    status=wf.status.name if wf.status else None,
                    started=wf.start_time,
                    closed_by_temporal=closed_note(attrs.get(STATE_ATTRIBUTE), wf.status.name if wf.status else None),
                    published_at=view.published_at if view else None,
                    view=view,
                    view_unverified=unverified,
                    parent=wf.parent_id,
                    task_queue=wf.task_queue,
                )
            )
    except RPCError as e:
        raise UsageError(f"listing failed: {e.message}") from None
    if not stuck:
        return rows
    gate = asyncio.Semaphore(DESCRIBE_CONCURRENCY)

    async def check(row: RunSummary) -> None:
        async with gate:
            try:
                row.stuck = await stuck_task(client, await _describe(client, row.run_id))
            except TetherError:
                row.stuck = None  # it ended (or went) since it was listed

    await asyncio.gather(*(check(r) for r in rows))
    return [r for r in rows if r.stuck is not None]
