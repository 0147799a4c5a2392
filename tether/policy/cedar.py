"""Cedar: who may do what, as Cedar policies judged by the Cedar engine (docs/policy.md, "Cedar").

Four parts, each a pure function of its inputs (no clock, no randomness; the policy files are
read by the callers), each in its own module and importable from this one:

- **the words** (``tether/policy/cedar_text.py``): the schema and its actions, Cedar literals, and
  the scanning of a text (statements, annotations, the sizes a parser survives);
- **the export** (``tether/policy/cedar_export.py``): a tenant's TOML rules as equivalent Cedar
  policies (``tether policy export``), each with an ``@id`` (``TENANT.RULE``, what records and
  ``tether policy explain`` name) and a ``@rule`` (the refusal rule the TOML engine names);
- **the engine** (``tether/policy/cedar_engine.py``): the world of a decision (``tether.cedarschema``),
  built from the same inputs the TOML rules (``workflows/policy.py``) take: the tenant's people and
  roles, the run's requester, the roles its pending request asks for, who approved and who revised
  it; a step's tool, what the catalog declares about it and the run's sums per amount; the parsed
  policy sets, and Cedar's verdicts on that world;
- **the checks** (here): a policy set validated against the schema, each problem with its file
  and line; a tenant's own Cedar files read and checked.

Amounts are Cedar decimals (four places): a run's sum is rounded up and a limit's ``max`` down, so
a fifth decimal can only make a step need approval, never spare it one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cedarpy

# The parts, at this module's path (what the policy modules, the CLI, the bench and the tests import).
from tether.policy.cedar_engine import (  # noqa: F401
    _BASES,
    _ERRORED,
    _PEOPLE,
    _TENANT_KEYS,
    _TEXT_DIGESTS,
    POLICY_ERROR,
    POLICY_SETS,
    SUBSET_MAX_POLICIES,
    Judgement,
    Lru,
    Policies,
    _skeleton,
    action_name,
    judge_person,
    judge_request,
    judge_requests,
    judge_steps,
    parsed,
    person_entity,
    person_request,
    plan_auto_approved,
    policies_for,
    run_entities,
    step_entities,
    step_requests,
    tenant_key,
)
from tether.policy.cedar_export import export_document, export_tenant  # noqa: F401
from tether.policy.cedar_text import (  # noqa: F401
    ACTION_GROUPS,
    ACTIONS,
    MAX_NESTING,
    MAX_POLICY_BYTES,
    NOT_PERMITTED,
    NS,
    PERSON_ACTIONS,
    RULE_ORDER,
    SCHEMA_PATH,
    STEP_ACTIONS,
    _statements,
    policy_annotations,
    cedar_string,
    decimal_text,
    schema,
    schema_text,
    size_problem,
)
from workflows.contract import PlanStep, ToolCatalog, ToolEffect, ToolInfo
from workflows.policy_file import TenantPolicy

# What this module holds and what it imports from its parts, for the modules that import it.
__all__ = [
    "ACTIONS",
    "ACTION_GROUPS",
    "CedarFileError",
    "Judgement",
    "Lru",
    "MAX_NESTING",
    "MAX_POLICY_BYTES",
    "NOT_PERMITTED",
    "NS",
    "PERSON_ACTIONS",
    "POLICY_ERROR",
    "POLICY_SETS",
    "Policies",
    "RULE_ORDER",
    "SCHEMA_PATH",
    "STEP_ACTIONS",
    "SUBSET_MAX_POLICIES",
    "_BASES",
    "_ERRORED",
    "_PEOPLE",
    "_TENANT_KEYS",
    "_TEXT_DIGESTS",
    "_skeleton",
    "_statements",
    "action_name",
    "policy_annotations",
    "cedar_problems",
    "cedar_string",
    "check_text",
    "decimal_text",
    "export_document",
    "export_tenant",
    "judge_person",
    "judge_request",
    "judge_requests",
    "judge_steps",
    "parsed",
    "person_entity",
    "person_request",
    "plan_auto_approved",
    "policies_for",
    "policies_of",
    "read_tenant_cedar",
    "run_entities",
    "schema",
    "schema_text",
    "size_problem",
    "step_entities",
    "step_requests",
    "tenant_files",
    "tenant_key",
]


# ----------------------------------------------------------------------------- checks


def cedar_problems(text: str, source: str) -> list[str]:
    """Everything wrong with a Cedar policy text, one line each with the file and line: a
    text beyond the sizes a parser survives, a syntax error, and what the schema refuses (an
    unknown attribute, a type error, an action that does not exist); ``@id`` annotations used
    twice (records name policies by them)."""
    why = size_problem(text, source)
    if why is not None:
        return [why]
    statements = _statements(text)
    try:
        parsed = Policies.from_text(text)
    except ValueError as e:
        for line, statement in statements:
            try:
                cedarpy.PolicySet.from_str(statement)
            except ValueError as inner:
                return [f"{source}: line {line}: {inner}"]
        return [f"{source}: {e}"]
    problems = []
    result = cedarpy.validate_policies(text, schema())
    for error in result.errors:
        index = int(error.policy_id.removeprefix("policy")) if error.policy_id.startswith("policy") else -1
        at = statements[index][0] if 0 <= index < len(statements) else None
        message = error.error.removeprefix(f"for policy `{error.policy_id}`, ")
        name = parsed.ids.get(error.policy_id, error.policy_id)
        problems.append(f"{source}: {f'line {at}, ' if at else ''}policy {name}: {message}")
    seen: dict[str, int] = {}
    for index, (pid, ident) in enumerate(parsed.ids.items()):
        line = statements[index][0] if index < len(statements) else 0
        if ident != pid and ident in seen:
            problems.append(f"{source}: line {line}: @id({ident}) is also the id of the policy on line "
                            f"{seen[ident]}: records name policies by id, so give each its own")
        seen.setdefault(ident, line)
    if not problems:
        problems = _evaluation_problems(parsed, statements, source)
    return list(dict.fromkeys(problems))


# Inputs a condition meets at run time, for what the schema's validator cannot tell: a condition
# that errors (a Long overflow, a decimal out of range) on some of them. Such a policy refuses
# every request it errors on (POLICY_ERROR): `validate` names it before it is live.
_PROBE_STAGES = (0, 1, 2, 3, 10, 1000)
_PROBE_AMOUNTS = (0, 1, 5000, 1_000_000, 10**12)
_PERSON_ACTIONS = ("approve", "approve_steps", "reject", "revise", "hand_off", "cancel", "compensate")


def _evaluation_problems(parsed: Policies, statements: list[tuple[int, str]], source: str) -> list[str]:
    tenant = TenantPolicy(approvers=None)
    probe = ToolCatalog(tools=[ToolInfo(name="probe", effect=ToolEffect.UNSAFE, requires_approval=True, args_schema={})])
    found: dict[str, tuple[str, str]] = {}  # policy id -> (what went wrong, on which sample)

    def judge(requests: list[dict[str, Any]], entities: list[dict[str, Any]], sample: str) -> None:
        for j in judge_requests(parsed, requests, entities, tenant):
            for error in j.errors:
                if (m := _ERRORED.match(str(error))) is not None and m[1] not in found:
                    found[m[1]] = (str(error)[m.end():].lstrip(": ")[:200], f"{action_name(j.request)} {sample}")

    for risk in ("normal", "high"):
        for stage in _PROBE_STAGES:
            entities = run_entities("probe", tenant, person="probe-a", requested_by="probe-b", roles=("approver",),
                                    risk=risk, stage=stage)
            judge([person_request(a, "probe-a") for a in _PERSON_ACTIONS], entities, f"(risk {risk}, stage {stage})")
        for amount in _PROBE_AMOUNTS:
            steps = [PlanStep(tool_call_id="probe-1", tool="probe", args={"amount": amount})]
            judge(step_requests(("auto_approve", "execute_write"), 1), step_entities("probe", steps, probe, risk=risk),
                  f"(risk {risk}, an amount of {amount})")
    problems = []
    for pid, (what, sample) in sorted(found.items(), key=lambda item: item[0]):
        index = int(pid.removeprefix("policy")) if pid.removeprefix("policy").isdigit() else -1
        line = statements[index][0] if 0 <= index < len(statements) else None
        problems.append(f"{source}: {f'line {line}, ' if line else ''}policy {parsed.ids.get(pid, pid)}: its condition "
                        f"errors at evaluation ({what}) on {sample}: a policy that errors refuses what it applies to "
                        f"(policy_error); guard the condition")
    return problems


class CedarFileError(ValueError):
    """A tenant's Cedar files with problems, one line each (file, line, problem)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def tenant_files(tenant: TenantPolicy, base: Path) -> list[Path]:
    return [(base / rel) for rel in tenant.cedar or []]


def read_tenant_cedar(name: str, tenant: TenantPolicy, base: Path) -> str:
    """A tenant's own Cedar files (``cedar = [...]``, relative to the policy file's folder) as one
    policy text, checked against the schema; raises :class:`CedarFileError` naming each problem."""
    texts, problems = [], []
    for path in tenant_files(tenant, base):
        try:
            text = path.read_text()
        except OSError as e:
            problems.append(f"{path}: cannot read it ({e.strerror}): key tenants.{name}.cedar names it")
            continue
        problems += cedar_problems(text, str(path))
        texts.append(text)
    if problems:
        raise CedarFileError(problems)
    combined = "\n".join(texts)
    if not combined.strip():
        raise CedarFileError([f"tenants.{name}.cedar: its files hold no policy: every decision would be refused"])
    return combined


def policies_of(name: str, tenant: TenantPolicy, cedar_text: str | None) -> Policies:
    """The policies deciding for a tenant: its own Cedar files' (read by the caller), else its
    TOML rules exported."""
    if cedar_text is not None:
        return parsed(cedar_text)
    return policies_for(name, tenant)


def check_text(text: str, source: str) -> tuple[list[str], str]:
    """A Cedar file's text checked against the schema: its problems (file, line, problem) and,
    when there are none, what was checked (``tether policy validate FILE.cedar``)."""
    return cedar_problems(text, source), f"{len(_statements(text))} Cedar policies, valid against the schema"
