"""Run-level metrics, emitted from the workflow through ``workflow.metric_meter()``.

Two hooks, called by ``AgentRun`` right after the lifecycle records something:

- :func:`on_transition` (for every transition record): ``tether_runs_started`` when a run leaves
  RECEIVED (once per run: a continued-as-new run carries its state, it never re-enters
  RECEIVED), ``tether_runs_ended{state}`` on a terminal state, and
  ``tether_approval_wait_seconds{outcome}`` when a run leaves AWAITING_APPROVAL (workflow time
  from entering to leaving, so a replan-on-expiry or a handoff counts too).
- :func:`on_notification` (for every notification the run sent): ``tether_notifications{event,
  outcome}`` with outcome ``delivered`` or ``dead`` (no retry reached the webhook).
- :func:`on_refusal` (for every refused record): ``tether_decisions_refused{kind, rule}``.
  ``kind`` is the reason's first word when it is a signal or update this run takes
  (:data:`KINDS`: approve, reject, revise, handoff, decide, cancel), else "other" (an unknown signal's name is
  the sender's choice); ``rule`` is the record's own ``rule`` when the runtime named one, else
  looked up from the words after "refused: " in :data:`REFUSAL_RULES`; either way one of
  :data:`RULES` or "other". Labels stay a small, fixed set.

The meter is Temporal's replay-safe one: nothing is recorded while a worker replays history,
so a restarted worker never counts a run twice. Labels are the meter's defaults (namespace,
task_queue, workflow_type) plus the ones above: never tenants, run ids or reasons' free text.
"""

from __future__ import annotations

from datetime import datetime

from temporalio import workflow

from workflows.states import TERMINAL, Lifecycle, RunState, TransitionRecord

RUNS_STARTED = "tether_runs_started"
RUNS_ENDED = "tether_runs_ended"
APPROVAL_WAIT = "tether_approval_wait_seconds"
DECISIONS_REFUSED = "tether_decisions_refused"
NOTIFICATIONS = "tether_notifications"

# Leading words of a refusal reason (after "<kind> refused: ") -> rule label. The reasons come
# from workflows/policy.py and AgentRun; a test checks every policy reason maps to a rule.
REFUSAL_RULES: tuple[tuple[str, str], ...] = (
    ("duplicate decision_id", "duplicate_decision"),
    ("run is ", "not_awaiting_approval"),
    ("plan hash ", "stale_plan_hash"),
    ("stale plan hash", "stale_plan_hash"),  # the words of records an earlier build wrote
    ("approval expired", "approval_expired"),
    ("approver is empty", "empty_approver"),
    ("another decision", "decision_already_accepted"),
    ("run already ended", "run_ended"),
    ("a handoff is already pending", "handoff_pending"),
)


# The label sets are fixed: a sender chooses signal names (and could choose a label value per
# signal), so ``kind`` is one of the names this run takes, and ``rule`` one of the rules the
# runtime names; anything else counts as "other". tests/activities/test_metrics.py checks that every rule
# the code names is here.
KINDS = frozenset({"approve", "reject", "revise", "handoff", "decide", "cancel"})
RULES = frozenset(
    {rule for _, rule in REFUSAL_RULES}
    | {
        "approval_needed", "approver_revoked", "bad_signature", "capability_invalid", "signature_stale", "distinct_approvers", "flood",
        "four_eyes", "look_alike_name", "malformed_signal", "role", "signature_required", "signer_not_trusted",
        "stale_request",
        "tenant", "tenant_membership", "tool_withdrawn", "unknown_signal",
        # revisions and partial approvals (issue 22)
        "editor_approval", "invalid_revision", "invalid_steps",
        # declared recovery (issue 24)
        "recovery_required", "no_recovery_path", "not_approved", "not_compensable", "nothing_to_compensate",
        "unknown_run", "still_running",
        # a decide Update the execution has no room for (refused before history, never counted)
        "continuing_as_new",
        # a cancel request the run judges (issue 43)
        "cancel_pending", "policy_check_failed",
        # a sender's decisions past QUEUED_PER_SENDER, refused unjudged (issue 55)
        "queue_full",
    }
)


def refusal_rule(reason: str) -> tuple[str, str]:
    """(kind, rule) of a refusal reason such as ``"approve refused: stale plan hash ..."``."""
    head, sep, detail = reason.partition(" refused: ")
    kind = head.strip().split(" ")[-1] if sep and head.strip() else "other"
    kind = kind if kind in KINDS else "other"
    detail = detail if sep else reason
    for prefix, rule in REFUSAL_RULES:
        if detail.startswith(prefix):
            return kind, rule
    return kind, "other"


def on_transition(lifecycle: Lifecycle, record: TransitionRecord) -> None:
    meter = workflow.metric_meter()
    if record.from_state == RunState.RECEIVED:
        meter.create_counter(RUNS_STARTED, "Runs that left RECEIVED", "1").add(1)
    if record.to_state in TERMINAL:
        meter.create_counter(RUNS_ENDED, "Runs that reached a terminal state", "1").add(
            1, {"state": record.to_state.value}
        )
    if record.from_state == RunState.AWAITING_APPROVAL:
        entered = _entered_awaiting_approval(lifecycle, record)
        if entered is not None:
            waited = max((record.at - entered).total_seconds(), 0.0)
            meter.create_histogram_float(
                APPROVAL_WAIT, "Time a plan waited for a human decision", "s"
            ).record(waited, {"outcome": record.to_state.value})


def refusal_labels(record: TransitionRecord) -> dict[str, str]:
    """The ``kind`` and ``rule`` labels of a refused record: always from the fixed sets."""
    kind, derived = refusal_rule(record.reason)
    # The record's own rule when the runtime named one; else the one its reason's words give.
    named = getattr(record, "rule", None)
    rule = named if named and named != "other" else derived
    return {"kind": kind, "rule": rule if rule in RULES else "other"}


def on_refusal(record: TransitionRecord) -> None:
    workflow.metric_meter().create_counter(
        DECISIONS_REFUSED, "Signals the runtime turned down, by rule", "1"
    ).add(1, refusal_labels(record))


def _entered_awaiting_approval(lifecycle: Lifecycle, record: TransitionRecord) -> datetime | None:
    for earlier in reversed(lifecycle.timeline):
        if earlier is record or earlier.kind != "transition":
            continue
        if earlier.to_state == RunState.AWAITING_APPROVAL:
            return earlier.at
    return None


def on_notification(event: str, delivered: int, dead: int) -> None:
    """``tether_notifications{event, outcome}``: webhooks reached, and those no retry reached."""
    counter = workflow.metric_meter().create_counter(NOTIFICATIONS, "Webhook deliveries of run events", "1")
    if delivered:
        counter.add(delivered, {"event": event, "outcome": "delivered"})
    if dead:
        counter.add(dead, {"event": event, "outcome": "dead"})
