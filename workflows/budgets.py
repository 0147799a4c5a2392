"""How large each thing the workflow writes may grow: one place, well under Temporal's limits.

Temporal refuses any payload over 2 MiB (the workflow task then fails and retries forever) and
terminates a run past 50 MB or 50,000 events of history. Each budget below is enforced where
the thing is produced; docs/contract.md lists them for users.
"""

from __future__ import annotations

from typing import Any

KIB = 1024
MIB = 1024 * KIB

# Temporal's own limit for one payload, and what we allow ourselves for the largest ones.
TEMPORAL_PAYLOAD_LIMIT = 2 * MIB
CARRY_BUDGET = 1 * MIB  # the state a run carries into continue-as-new
CARRY_CONTINUE_AT = 512 * KIB  # continue as new before the carried state gets near its budget
# A continue-as-new writes what the run carries twice (its last event, the next run's first):
# once the server suggests it, a run continues when its history is CARRY_AMORTIZE times that,
# so carrying costs at most a quarter of what a run writes however long it goes and however
# much it carries (a long plan). By Temporal's warning marks a run continues whatever it
# carries (its hard limits are 51,200 events and 50 MB).
CARRY_AMORTIZE = 8
CONTINUE_AT_EVENTS = 10_240
CONTINUE_AT_BYTES = 10 * MIB
RESULT_BUDGET = 1 * MIB  # RunOutcome
REQUEST_BUDGET = 768 * KIB  # a start input (goal and playbook): it is carried into every continue-as-new
QUERY_BUDGET = 1 * MIB  # each query answer
DETAILS_CHARS = 8 * KIB  # the Web UI's current details (markdown)

# The audit timeline the workflow keeps (every record also goes to the audit sink).
TIMELINE_HEAD = 20  # the first records, kept for the run's start (policy hash, first plan)
TIMELINE_WINDOW = 500  # records kept in all; older ones (after the head) are in the sink only
# What continue-as-new carries of the timeline: the head and the latest records (the sink has
# the rest), so each continue-as-new writes the same bytes however long the run has been going.
CARRY_TIMELINE_TAIL = 20
REASON_CHARS = 600  # one record's reason
# Refused events of one rule from one actor beyond this many are counted, not recorded.
REFUSALS_RECORDED = 3
REFUSAL_KEYS = 64  # distinct (rule, actor) counters; more actors are counted under "*"

REVISIONS_KEPT = 20  # revisions a run keeps in its state (snapshot.revisions); the timeline has all
# Decisions one sender may have queued for the policy check at once; more are refused unjudged
# (rule queue_full), so a flood costs the run no policy activity each and cannot keep its inbox
# from emptying (it continues as new only with an empty inbox).
QUEUED_PER_SENDER = 8
DECISIONS_WINDOW = 256  # decision ids remembered for duplicate detection (plus a digest of all)
# decide Updates one execution takes before it continues as new (Temporal: 2,000 per run).
UPDATES_CONTINUE_AT = 1_500

# Planner traffic.
PROPOSAL_BYTES = 256 * KIB  # a proposal larger than this is refused at the activity boundary
FEEDBACK_PROBLEMS = 5  # validation problems reported per round (paths and rules only)
FEEDBACK_CHARS = 2000
ANSWER_CHARS = 8000

# Executed steps carried in full (with observations) for the planner's context; older steps
# keep only their id, tool, outcome and digest.
EXECUTED_WINDOW = 20
EXECUTED_OBSERVATION_CHARS = 32 * KIB


def continue_due(*, history_bytes: int, history_events: int, carry_bytes: float) -> bool:
    """The server suggests continue-as-new: is it worth what it writes yet?"""
    return (
        history_bytes >= CARRY_AMORTIZE * carry_bytes
        or history_events >= CONTINUE_AT_EVENTS
        or history_bytes >= CONTINUE_AT_BYTES
    )


def continue_wanted(*, history_bytes: int, history_events: int, deferred_to: int | None) -> bool:
    """A suggested continue-as-new the run put off until its history is ``deferred_to`` bytes
    (None: not put off): is it there yet, or at Temporal's warning marks?"""
    # Put off until its history is CARRY_AMORTIZE times what it carried then: due as before.
    return deferred_to is None or continue_due(
        history_bytes=history_bytes, history_events=history_events, carry_bytes=deferred_to / CARRY_AMORTIZE
    )


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    tail = f"… (+{len(text) - limit} chars)"
    return text[: max(limit - len(tail), 0)] + tail


# The read steps a view shows what they found (the latest), and what it keeps of each: a few
# fields, each value and the whole bounded, so a view stays small whatever a tool returns.
FOUND_STEPS = 6
FOUND_FIELDS = 8
FOUND_VALUE_CHARS = 120
FOUND_STEP_CHARS = 400


def bounded_fields(values: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The fields of ``values`` a tool's summary fields name (all of them, in order, when none is
    there), one level of nesting as ``a.b``; scalars only, strings clipped, at most FOUND_FIELDS
    and FOUND_STEP_CHARS in all. Pure: the same answer for the same result on every replay."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items() if not isinstance(v, (dict, list))})
        elif not isinstance(value, list):
            flat[key] = value
    chosen = [n for n in names if n in flat] or list(flat)
    out: dict[str, Any] = {}
    used = 0
    for name in chosen[:FOUND_FIELDS]:
        value = flat[name]
        if isinstance(value, str):
            value = clip(value, FOUND_VALUE_CHARS)
        key = clip(str(name), 64)
        used += len(key) + len(str(value))
        if used > FOUND_STEP_CHARS:
            break
        out[key] = value
    return out
