"""Timeline invariants, checked over every timeline the chaos, restart, late-event and hostile
input suites produce.

``check_timeline`` asserts that a run's audit timeline is

1. a legal path through the transition table from RECEIVED (``workflows.states.is_legal_path``),
   with strictly increasing ``state_version`` (each transition bumps it by exactly one);
2. made of refusals that changed nothing: a ``refused`` record stays in the current state and
   carries the current version;
3. approval-gated: no EXECUTING_TOOL for a write step without an accepted approval
   (an APPROVED transition with a decision id) of the *current* plan hash, i.e. the hash of the
   most recent VALIDATED plan; a plan may skip approval (VALIDATED -> EXECUTING_TOOL) only when
   every step it executes is a known read-only tool;
4. settled once: at most one APPROVED per validated plan, and nothing after a terminal state;
5. undone only as approved: every compensation on the record (COMPENSATING -> ...) is bound to
   a plan hash this run approved or auto-ran, unless the run is a compensation run (RECEIVED ->
   COMPENSATING: the approval is on the original's record); COMPENSATED only from COMPENSATING.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from workflows.contract import Plan
from workflows.run_state import RunOutcome
from workflows.states import TERMINAL, RunState, TransitionRecord, is_legal_path

S = RunState

READ_ONLY_TOOLS = frozenset({"get_order", "chaos_get_order"})


def tools_by_call(outcome: RunOutcome | None = None, plans: Iterable[Plan | None] = ()) -> dict[str, str]:
    """tool_call_id -> tool name, from the steps a run executed and any plans seen."""
    names: dict[str, str] = {}
    for plan in plans:
        for step in plan.steps if plan else []:
            names[step.tool_call_id] = step.tool
    for step in outcome.steps if outcome else []:
        names[step.tool_call_id] = step.tool
    return names


def check_timeline(
    records: list[TransitionRecord],
    tools: Mapping[str, str] | None = None,
    read_only: Iterable[str] = READ_ONLY_TOOLS,
) -> None:
    """Raise AssertionError naming the first broken invariant (see the module docstring)."""
    read_only = frozenset(read_only)
    tools = tools or {}
    dump = "\n".join(
        f"  v{r.state_version} {r.kind} {r.from_state.value}->{r.to_state.value} "
        f"{r.actor}: {r.reason[:120]} {r.refs.model_dump(exclude_none=True)}"
        for r in records
    )
    assert is_legal_path(records), f"not a legal path through the table:\n{dump}"

    state, version = S.RECEIVED, 0
    plan_hash: str | None = None  # the current plan: the latest VALIDATED one
    gated = False  # the current plan went through AWAITING_APPROVAL
    approved: str | None = None  # plan hash of the accepted approval of the current plan
    approvals = 0
    covered: set[str] = set()  # plan hashes approved (or auto-run) in this run
    compensation_run = False
    for r in records:
        if r.kind != "transition":
            # Neither changes state: a refusal, or one of several approvals the plan needs.
            assert r.from_state == r.to_state == state, f"a {r.kind} record moved the run: {r}\n{dump}"
            assert r.state_version == version, f"a {r.kind} record bumped state_version: {r}\n{dump}"
            continue
        assert state not in TERMINAL, f"a transition after terminal {state.value}: {r}\n{dump}"
        assert r.state_version == version + 1, f"state_version not strictly +1: {r}\n{dump}"
        to = r.to_state
        if to == S.VALIDATED:
            plan_hash, gated, approved, approvals = r.refs.plan_hash, False, None, 0
            assert plan_hash, f"VALIDATED without a plan hash: {r}\n{dump}"
        elif to in (S.PLANNING, S.VALIDATION_FAILED):
            plan_hash, gated, approved, approvals = None, False, None, 0
        elif to == S.AWAITING_APPROVAL:
            gated = True
            assert r.refs.plan_hash == plan_hash, f"approval asked for another plan: {r}\n{dump}"
        elif to == S.APPROVED:
            approvals += 1
            assert approvals == 1, f"a plan was approved twice: {r}\n{dump}"
            assert r.refs.decision_id, f"APPROVED without a decision id: {r}\n{dump}"
            assert r.actor.startswith("user:"), f"APPROVED by {r.actor}: {r}\n{dump}"
            assert r.refs.plan_hash == plan_hash, (
                f"APPROVED for plan {r.refs.plan_hash} while the current plan is {plan_hash}\n{dump}"
            )
            approved = r.refs.plan_hash
            covered.add(r.refs.plan_hash)
        elif r.from_state == S.COMPENSATING and r.refs.tool_call_id and r.refs.tool_call_id.endswith(":undo"):
            assert compensation_run or r.refs.plan_hash in covered, (
                f"a compensation under plan {r.refs.plan_hash} this run never approved: {r}\n{dump}"
            )
        elif to == S.COMPENSATING and r.from_state == S.RECEIVED:
            compensation_run = True
        elif to == S.EXECUTING_TOOL:
            assert plan_hash is not None, f"EXECUTING_TOOL without a validated plan: {r}\n{dump}"
            assert r.refs.plan_hash == plan_hash, (
                f"EXECUTING_TOOL for plan {r.refs.plan_hash}, current plan is {plan_hash}\n{dump}"
            )
            if gated:
                assert approved == plan_hash, (
                    f"EXECUTING_TOOL without an accepted approval of plan {plan_hash}: {r}\n{dump}"
                )
            else:
                tool = tools.get(r.refs.tool_call_id or "")
                covered.add(plan_hash)
                assert tool in read_only, (
                    f"EXECUTING_TOOL for {r.refs.tool_call_id} ({tool or 'unknown tool'}) without "
                    f"approval: only read-only steps may skip it\n{dump}"
                )
        state, version = to, r.state_version


def check_request_satisfiable(pending, tenant, requested_by: str) -> None:
    """An approval request asks for at least one approval, from roles that enough approvers
    (other than the requester, under four-eyes) hold: the engine never opens one nobody could
    satisfy (issue 18)."""
    if pending is None:
        return
    assert pending.approvals_required >= 1, f"request {pending.request_id} asks for {pending.approvals_required} approvals"
    assert pending.roles, f"request {pending.request_id} asks for no role"
    if tenant is None or tenant.approvers is None:
        return
    able = [
        name for name, a in tenant.approvers.items()
        if set(a.roles) & set(pending.roles) and not (tenant.four_eyes and name == requested_by)
    ]
    assert len(able) >= pending.approvals_required, (
        f"request {pending.request_id} needs {pending.approvals_required} of roles {pending.roles}; only {able} can give it"
    )
