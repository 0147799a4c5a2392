"""A run that was only started, as a hostile test plays one: an ``AgentRun`` started on a task
queue of its own with ``AgentRunState=AWAITING_APPROVAL`` and the tenant of its choosing, and
a plain Temporal worker (no Tether code, no key) that answers its ``snapshot`` and ``timeline``
queries with whatever it likes and keeps every decision sent to it (``received``)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from temporalio import workflow
from temporalio.client import Client
from temporalio.common import RawValue, SearchAttributePair, TypedSearchAttributes
from temporalio.worker import Worker

from workflows.published import STATE_ATTRIBUTE, TENANT_ATTRIBUTE


@workflow.defn(name="AgentRun", sandboxed=False)
class RogueRun:
    """Answers what it was told to at its start; keeps what it is sent."""

    def __init__(self) -> None:
        self.answer: dict[str, Any] = {}
        self.view: dict[str, Any] | None = None
        self.got: list[Any] = []

    @workflow.run
    async def run(self, answer: dict[str, Any]) -> None:
        # ``__view__``: what it answers the ``view`` query with (a real run's signed view it
        # copied); without one it does not answer that query.
        self.view = answer.pop("__view__", None)
        self.answer = answer
        await workflow.wait_condition(lambda: False)

    @workflow.query(name="view")
    def view_query(self) -> dict[str, Any]:
        if self.view is None:
            raise RuntimeError("no such query here")
        return self.view

    @workflow.query(name="snapshot")
    def snapshot(self) -> dict[str, Any]:
        return self.answer

    @workflow.query(name="timeline")
    def timeline(self) -> list[Any]:
        return []

    @workflow.query(name="received")
    def received(self) -> list[Any]:
        return self.got

    @workflow.update(name="decide")
    def decide(self, decision: dict[str, Any]) -> dict[str, Any]:
        self.got.append(decision)
        return {"decision_id": decision.get("decision_id", ""), "outcome": "transition", "state": "APPROVED",
                "reason": f"approved by {decision.get('approver')}"}

    @workflow.signal(dynamic=True)
    def any_signal(self, name: str, args: Sequence[RawValue]) -> None:
        self.got.append({"signal": name})


@dataclass
class Rogue:
    run_id: str
    client: Client

    async def received(self) -> list[Any]:
        return await self.client.get_workflow_handle(self.run_id).query("received")


@asynccontextmanager
async def rogue_run(
    client: Client, answer: dict[str, Any], *, tenant: str, run_id: str | None = None, view: dict[str, Any] | None = None
) -> AsyncIterator[Rogue]:
    """Start the rogue's run (``answer`` is its ``snapshot``; its run_id is set to the run's) and
    serve it until the block ends, then end it."""
    run_id = run_id or f"urgent-refund-{uuid.uuid4().hex[:8]}"
    queue = f"rogue-{uuid.uuid4().hex[:8]}"
    answer = {**answer, "run_id": run_id, "tenant": tenant}
    if view is not None:
        answer["__view__"] = view
    async with Worker(client, task_queue=queue, workflows=[RogueRun]):
        handle = await client.start_workflow(
            "AgentRun", answer, id=run_id, task_queue=queue,
            search_attributes=TypedSearchAttributes([
                SearchAttributePair(STATE_ATTRIBUTE, "AWAITING_APPROVAL"), SearchAttributePair(TENANT_ATTRIBUTE, tenant),
            ]),
        )
        # Served: it answers its queries from here on.
        for _ in range(200):
            try:
                await handle.query("snapshot")
                break
            except Exception:  # noqa: BLE001 (not picked up yet)
                await asyncio.sleep(0.05)
        try:
            yield Rogue(run_id, client)
        finally:
            await handle.terminate("test over")
