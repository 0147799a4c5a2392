"""The outbox: records someone is to be told about become notifications for the webhooks
that take them; webhooks no retry reached are put on the record.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from workflows.budgets import clip
from workflows.display import approve_command
from workflows.run_model import RunModel, notify_event
from workflows.run_state import shown_openly
from workflows.states import Refs
from workflows.wording import tool_words
from workflows.wire import Notification, NotificationResult

GOAL_CHARS = 600  # of a goal in an event (a requester's text: bounded; the body escapes it)
TOOL_WORDS_CHARS = 300  # of what a tool says it does (its author's text)


class Outbox(RunModel):
    """What the run tells webhooks about, and what it could not tell them."""

    def take_notifications(self, namespace: str = "default") -> list[Notification]:
        """The events to post now, each to the webhooks that take it (the policy snapshot's
        subscriptions, and an escalation stage's own), built from ids and the risk summary.
        An approval request already decided by the time the run waits is not announced."""
        outbox, self.outbox = self.outbox, []
        hooks = self.data.policy.webhooks if self.data.policy else {}
        pending = self.data.pending_approval
        out: list[Notification] = []
        for record, named in outbox:
            event = notify_event(record)
            if event is None:
                continue
            if event == "awaiting_approval" and (pending is None or pending.request_id != (record.refs.request_id or "")):
                continue  # decided in the same step (a partial approval): nothing waits
            names = [n for n, events in hooks.items() if event in events]
            names += [n for n in named if n not in names]
            if not names:
                continue
            waiting = pending if pending is not None and pending.request_id == (record.refs.request_id or "") else None
            out.append(
                Notification(
                    event_id=f"{self.workflow_id}:{self.data.first_run_id}:{record.seq}",
                    event=event,
                    webhooks=names,
                    run_id=self.workflow_id,
                    namespace=namespace,
                    tenant=self.request.tenant,
                    state=record.to_state.value,
                    plan_hash=record.refs.plan_hash,
                    request_id=record.refs.request_id,
                    summary=waiting.summary if waiting else "",
                    expires_at=waiting.expires_at if waiting else None,
                    approve_command=approve_command(self.workflow_id, waiting.plan_hash) if waiting else None,
                    reason=record.reason,
                    **(self._why() if waiting else {}),
                )
            )
        return out

    def _why(self) -> dict[str, Any]:
        """Why the run asks, for an approval request's event: the goal, who asked and, for a
        child, on whose behalf (its grant names the root; the requester is the root's); what its
        reads found (as the Web UI's details show it) and what each planned tool says it does."""
        grant = self.request.grant
        found = [shown_openly(f, self.catalog.get(f.tool)) for f in self.reads_found()]
        planned = dict.fromkeys(s.tool for s in self.data.plan.steps) if self.data.plan else {}
        return {
            "found": found,
            "tools": {name: clip(said, TOOL_WORDS_CHARS) for name in planned if (said := tool_words(self.catalog.get(name)))},
            "goal": clip(self.request.goal, GOAL_CHARS),
            "requested_by": self.request.requested_by,
            "requester_verified": self.data.requester_verified,
            "parent": grant.parent if grant else None,
            "parent_goal": clip(grant.parent_goal, GOAL_CHARS) if grant else "",
            "root": grant.root if grant else None,
        }

    def notification_done(self, note: Notification, result: NotificationResult, at: datetime) -> None:
        """Webhooks no retry reached are on the record (the run did not wait for them)."""
        if not result.dead:
            return
        dead = ", ".join(f"{name} ({why})" for name, why in sorted(result.dead.items()))
        self.on_record(
            self.data.lifecycle.notify_failed(
                at=at,
                reason=f"notification {note.event} (event {note.event_id.rsplit(':', 1)[-1]}) not delivered to: {dead}",
                event=note.event,
                refs=Refs(plan_hash=note.plan_hash, request_id=note.request_id),
            )
        )
