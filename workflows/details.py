"""The Web UI's "Current Details" of a run (markdown): pure, so it is tested without a server.

The final or current state comes first. What a requester, model, tool or signal sender wrote
(goal, names, reasons, argument values, ids) goes through workflows/display.py: prose with
`markdown_text` (markdown and HTML inert), values and commands only inside code spans
(`markdown_code`). Names, effects, ids, the plan hash and the tools' declared summary fields
only: never other tool arguments or results, which may hold personal data.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

from workflows.display import markdown_code as code
from workflows.display import markdown_text as text
from workflows.display import approve_command, shell_word, show_value
from workflows import wording
from workflows.contract import Compensation, Plan, ToolCatalog, run_catalog
from workflows.run_state import RunData, RunRequest, found_steps, shown_openly
from workflows.states import RunState

S = RunState
PLAN_LINES = 30


def _utc(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


SUMMARY_GOAL_CHARS = 120
DETAILS_GOAL_CHARS = 500


def start_summary(request: RunRequest) -> str:
    """The Web UI's summary of a run, set by its start (a line in the list)."""
    return f"{text(request.goal, SUMMARY_GOAL_CHARS)} · tenant {text(request.tenant)}"


def start_details(request: RunRequest) -> str:
    """The start's details, shown under the summary: what it does not say (the goal again only
    where the summary had to cut it)."""
    goal = text(request.goal, DETAILS_GOAL_CHARS)
    head = f"**Goal:** {goal}\n\n" if goal != text(request.goal, SUMMARY_GOAL_CHARS) else ""
    return f"{head}**requested by** {code(request.requested_by)} · **planner** {code(request.planner)}"


def run_details(
    data: RunData, request: RunRequest, *, workflow_id: str, continued: bool, audit_error: str | None = None
) -> str:
    """``audit_error``: why the run cannot write to its audit sink (it starts nothing new meanwhile).

    Never raises: the details are computed in the workflow before every wait, so an exception
    here would fail every workflow task and wedge the run. A shape the renderer does not handle
    shows the state and says the details could not be drawn."""
    try:
        return _details(data, request, workflow_id=workflow_id, continued=continued, audit_error=audit_error)
    except Exception as err:  # noqa: BLE001 - any renderer bug must not wedge the run
        lc = data.lifecycle
        return (
            f"**State:** `{lc.state.value}` (version {lc.state_version})\n\n"
            f"Details could not be drawn ({type(err).__name__}): "
            + code(f"tether status {shell_word(workflow_id)}", 200)
            + " shows the run."
        )


# The plan's step lines, drawn once per plan and per catalog entries they show (the details are
# drawn before every activity; only the done marks move): keyed by everything a line shows.
_PLAN_STEPS: dict[tuple[object, ...], list[str]] = {}
_PLAN_STEPS_KEPT = 256


def _plan_steps(plan: Plan, catalog: ToolCatalog) -> list[str]:
    steps = plan.steps[:PLAN_LINES]
    infos = [catalog.get(step.tool) for step in steps]
    # The plan hash covers the steps' tools and arguments and the undos; the catalog entries
    # give the effect and the summary fields.
    key = (plan.plan_hash, plan.version, plan.undo is None,
           tuple((i.effect.value, i.destructive, i.compensate.tool if i.compensate else None, tuple(i.summary_fields), i.description,
                  tuple(repr(((i.args_schema.get("properties") or {}).get(k) or {}).get(wording.MONEY_KEYWORD))
                        for k in i.summary_fields)) if i else None for i in infos))
    found = _PLAN_STEPS.get(key) if plan.plan_hash else None
    if found is not None:
        return found
    lines = []
    for i, (step, info) in enumerate(zip(steps, infos), start=1):
        effect = info.effect.value if info else "?"
        # The declared summary fields, each value only inside a code span; money in words with
        # the raw value beside it (``75.50 EUR (7550)``), as the CLI and the inbox say it.
        schema = info.args_schema if info else {}
        fields = [
            f"{text(k, 40)} {code(wording.arg_words(k, step.args[k], schema, step.args) or show_value(step.args[k], 200))}"
            for k in (info.summary_fields if info else [])
            if k in step.args
        ]
        # The undo the plan hash covers, for each write (plans hashed before recovery: none);
        # False: no undo judged here (a read, or a plan hashed before recovery).
        undo: Compensation | None | bool = False
        if plan.undo is not None and info is not None and info.effect.value != "read_only":
            undo = comp = plan.undo[i - 1] if i - 1 < len(plan.undo) else None
            fields.append(f"undo {code(comp.tool, 64)}" if comp else "no recovery path")
        # What it does in plain words (unsafe: never re-run), as every other surface says it.
        words = text(wording.effect_words(info, undo)) if info is not None and info.effect.value != "read_only" else ""
        # What the tool says it does (its docstring's first line), which approvers read.
        said = wording.tool_words(info)
        lines.append(f"{i}. {code(step.tool, 80)} · {effect}" + (f" ({words})" if words else "")
                     + "".join(f" · {f}" for f in fields) + (f" — {text(said, 160)}" if said else ""))
    if len(_PLAN_STEPS) >= _PLAN_STEPS_KEPT:
        _PLAN_STEPS.clear()
    _PLAN_STEPS[key] = lines
    return lines


def _found_lines(data: RunData, catalog: ToolCatalog, workflow_id: str) -> list[str]:
    """What the read steps found, for the person deciding, as a surface outside the signed view
    shows it (``shown_openly``: the fields the tool names and its money, each value in a code
    span). The details are shown as they are, never through the payload codec: other result
    fields (a customer's email) stay in the signed view, read by `tether status` and the inbox;
    the line says so."""
    lines = []
    for found in found_steps(data.executed, catalog):
        f = shown_openly(found, catalog.get(found.tool))
        args = ", ".join(f"{text(k, 40)} {code(show_value(v, 120))}" for k, v in f.args.items())
        # Money in words beside the raw value, as the plan's lines show an argument's.
        shown = " · ".join(f"{text(k, 40)} {code(show_value(v, 120) if k not in f.money else f'{f.money[k]} ({show_value(v, 120)})')}"
                           for k, v in f.fields.items())
        rest = len(found.fields) - len(f.fields)
        more = (f"{'; ' if shown else ''}{rest} more field(s): {code(f'tether status {shell_word(workflow_id)}', 300)}"
                if rest else "")
        lines.append(f"- {code(f.tool, 64)}" + (f" ({args})" if args else "") + f" found: {shown}{more}")
    return ["", "**What the run found:**", "", *lines] if lines else []


def _details(data: RunData, request: RunRequest, *, workflow_id: str, continued: bool, audit_error: str | None) -> str:
    lc = data.lifecycle
    lines = [f"**State:** `{lc.state.value}` (version {lc.state_version})"]
    if lc.terminal:
        final = next((r for r in reversed(lc.timeline) if r.kind == "transition"), None)
        if final is not None:
            lines[0] += f" — {text(final.reason, 300)} ({code(final.actor, 80)})"
    requester = code(request.requested_by, 80) + (" (signed)" if data.requester_verified else " (claimed)")
    lines += [
        "",
        f"**Tenant** {code(request.tenant, 80)} · **requested by** {requester} · "
        f"{data.steps_executed} step(s) executed · {data.retries} retries",
    ]
    waiting = data.pending_approval is not None and lc.state == S.AWAITING_APPROVAL
    if continued or waiting:
        # A continued run has no static summary of its own (continue-as-new cannot set one); a
        # run waiting on a person shows why beside what, where that person reads it.
        lines += ["", f"**Goal:** {text(request.goal, 300)}"]
    grant = request.grant
    if grant is not None:  # a child acts for its tree's requester: on whose behalf, and for what
        lines += ["", f"**On behalf of** root run {code(grant.root, 256)} · **child of** {code(grant.parent, 256)}: "
                  f"{text(grant.parent_goal, 300)}"]
    if data.approved_by:
        lines += ["", "**Approved by** " + ", ".join(code(a, 80) for a in data.approved_by)]
    if data.last_error:
        lines += ["", f"**Last error:** {text(data.last_error, 200)}"]
    if audit_error:
        lines += ["", f"**Audit sink:** {text(audit_error, 400)} — nothing new starts until it writes"]
    if data.policy_problem:
        lines += ["", f"**Policy file:** {text(data.policy_problem, 400)}"]
    if lc.refusals:
        lines += ["", f"**Refused events:** {sum(lc.refusals.values())} (see snapshot.refusals)"]
    plan, catalog = data.plan, run_catalog(data.catalog)
    if waiting:
        lines += _found_lines(data, catalog, workflow_id)
    if plan is not None and not lc.terminal:
        lines += ["", f"**Plan** v{plan.version} {code(plan.plan_hash)}", ""]
        if data.revisions:  # who revised it last, and the paths changed (values are in the steps)
            last = data.revisions[-1]
            lines[-1:-1] = [
                f"**Revised** {len(data.revisions)} time(s), last by {code(last.editor, 128)}"
                + (" (partial approval)" if last.partial else "")
                + f": {code(', '.join(last.changed), 300)}"
            ]
        for i, line in enumerate(_plan_steps(plan, catalog), start=1):
            lines.append(line + (" ✓ done" if i <= data.next_step else ""))
        if len(plan.steps) > PLAN_LINES:
            lines.append(f"… and {len(plan.steps) - PLAN_LINES} more step(s)")
    if request.compensate_run is not None:
        lines += ["", f"**Compensates run** {code(request.compensate_run, 256)}"]
    if data.compensations and (lc.state == S.COMPENSATING or lc.terminal):
        # Each write and where it stands: kept, undone, may have applied (workflows/wording.py).
        title = "**Putting things back** (newest first):" if lc.state == S.COMPENSATING else "**Writes** (newest first):"
        lines += ["", title, ""]
        for c in list(reversed(data.compensations))[:PLAN_LINES]:
            lines.append(f"- {code(c.of, 80)} {code(c.of_tool, 64)} → "
                         + (f"{code(c.tool, 64)} · " if c.tool else "") + wording.standing(c))
        if lc.terminal and request.compensate_run is None and any(c.tool and c.status != "ok" for c in data.compensations):
            lines.append(f"\nLater undos: {code(f'tether status {shell_word(workflow_id)}', 300)} says which run did them.")
    pending = data.pending_approval
    if pending is not None and lc.state == S.AWAITING_APPROVAL:
        signal_input = json.dumps(
            {"decision_id": "<unique id>", "approver": "NAME", "plan_hash": pending.plan_hash,
             "request_id": pending.request_id}
        )
        tether = ".venv/bin/" + approve_command(workflow_id, pending.plan_hash)
        temporal = (
            f"temporal workflow signal --workflow-id {shell_word(workflow_id)} --name approve "
            f"--input {shell_word(signal_input)}"
        )
        lines += [
            "",
            f"**Waiting for approval** (request {code(pending.request_id)}) until **{_utc(pending.expires_at)}**"
            + (f" — risk **{text(pending.risk, 20)}**" if pending.risk != "normal" else ""),
            "",
            f"**Approvals:** {len(pending.approvals)} of {pending.approvals_required}"
            + (f" · roles {', '.join(code(r, 40) for r in pending.roles)}" if pending.roles else "")
            + (" · so far " + ", ".join(code(a.approver, 80) for a in pending.approvals) if pending.approvals else "")
            + (f" · escalation stage {pending.stage} of {len(pending.escalation)}" if pending.escalation else ""),
            "",
            "**Approve with:**",
            "",
            f"{code(tether)} (add `--key PATH` where approvals are signed)",
            "",
            "or:",
            "",
            code(temporal),
            "",
            "or here: **More Actions → Send a Signal → approve**, with the `--input` JSON as data.",
        ]
    if data.answer and lc.terminal:
        lines += ["", f"**Answer:** {text(data.answer, 500)}"]
    return "\n".join(lines)
