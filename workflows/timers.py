"""A waiting plan's timers: its escalation stages (each widens the roles that may approve and
tells the stage's webhooks) and its expiry (the run ends EXPIRED, or plans again with
``on_expiry=replan``). The approvals phase (``workflows/approvals.py``) waits on them.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from workflows.policy_file import EscalationStage
from workflows.run_model import RunModel, S, require
from workflows.states import Refs


class Timers(RunModel):
    """When a waiting plan's timer fires next, and what it does then."""

    def next_escalation(self) -> datetime | None:
        """When the pending request's next escalation stage is due (None: no stage left)."""
        pending = self.data.pending_approval
        if pending is None or pending.opened_at is None or pending.stage >= len(pending.escalation):
            return None
        return pending.opened_at + timedelta(seconds=pending.escalation[pending.stage].after)

    def next_timer(self, escalate: bool = True) -> tuple[datetime, str]:
        """When the waiting plan's timer fires next, and what for: an escalation stage (where
        ``escalate``: the policy sets stages) inside the window, else the expiry."""
        pending = require(self.data.pending_approval, "no pending approval")
        due = self.next_escalation() if escalate else None
        if due is not None and due < pending.expires_at:
            return due, f"escalation stage {pending.stage + 1}"
        return pending.expires_at, "approval expiry"

    def timer_fired(self, at: datetime, escalate: bool = True) -> None:
        """The timer ``next_timer`` named fired: escalate, or expire. A run that was away past
        several stages takes them one by one; past the expiry, the expiry is the last word."""
        wake, _ = self.next_timer(escalate)
        pending = require(self.data.pending_approval, "no pending approval")  # next_timer required it
        if wake < pending.expires_at and at < pending.expires_at:
            self.escalate(at)
        else:
            self.expire(at)

    def escalate(self, at: datetime) -> EscalationStage:
        """The next escalation stage's timer fired: record it and widen the roles that may
        approve. Returns the stage (the workflow tells its webhooks)."""
        why = "an escalation timer fired with no stage due"
        pending = require(self.data.pending_approval, why)
        due = require(self.next_escalation(), why)
        require(self.state == S.AWAITING_APPROVAL and due <= at < pending.expires_at, why)
        stage = pending.escalation[pending.stage]
        pending.stage += 1
        added = [r for r in stage.roles if r not in pending.roles]
        pending.roles = pending.roles + added
        widened = f"; roles {', '.join(pending.roles)} may approve" if added else ""
        told = f"; notifying {', '.join(stage.notify)}" if stage.notify else ""
        self.on_record(
            self.data.lifecycle.escalate(
                at=at,
                reason=f"escalation stage {pending.stage}/{len(pending.escalation)}: waiting "
                f"{duration_words(stage.after)} for approval{widened}{told}; expires {pending.expires_at.isoformat()}",
                refs=Refs(plan_hash=pending.plan_hash, request_id=pending.request_id or None),
            )
        )
        if self.outbox:
            self.outbox[-1][1].extend(stage.notify)
        return stage

    def expire(self, at: datetime) -> None:
        """The approval timer fired."""
        data = self.data
        why = "the approval timer fired with nothing pending, or before expiry"
        pending = require(data.pending_approval, why)
        require(at >= pending.expires_at, why)
        expired = f"approval expired at {pending.expires_at.isoformat()}"
        refs = Refs(plan_hash=pending.plan_hash)
        if self.limits.on_expiry == "replan":
            self._replan_or_end(S.EXPIRED, at=at, actor="timer", why=expired, end_reason=expired, refs=refs)
        else:
            self.move(S.EXPIRED, at=at, actor="timer", reason=expired, refs=refs)
        data.pending_approval = None


def duration_words(seconds: float) -> str:
    """Seconds as a person writes them in the policy file: 3600 -> "1h", 90 -> "90s"."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
