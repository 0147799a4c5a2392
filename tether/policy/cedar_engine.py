"""The engine: parsed policy sets (kept by content), the world of a decision (its entities and
request, ``tether.cedarschema``) built from the inputs the TOML rules take, and Cedar's verdicts
on them (``judge_person``, ``judge_steps``; ``judge_request`` for what-if), each a
:class:`Judgement`. Amounts are Cedar decimals (four places): a run's sum is rounded up, so a
fifth decimal can only make a step need approval, never spare it one."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import cedarpy
from cedarpy import pst

from tether.policy.cedar_export import export_tenant
from tether.policy.cedar_text import (
    ACTION_GROUPS,
    ACTIONS,
    MAX_POLICY_BYTES,
    NOT_PERMITTED,
    NS,
    RULE_ORDER,
    _action,
    _statements,
    _uid,
    policy_annotations,
    decimal_text,
    size_problem,
)
from workflows.contract import PlanStep, ToolCatalog, ToolEffect
from workflows.identity import skeleton
from workflows.policy import spend
from workflows.policy_file import TenantPolicy

# ----------------------------------------------------------------------------- policy sets


@dataclass(frozen=True)
class Policies:
    """A parsed policy set and, per policy, its ``@id`` and ``@rule``."""

    text: str
    policy_set: cedarpy.PolicySet = field(repr=False)
    ids: dict[str, str] = field(default_factory=dict)  # positional id -> @id (or itself)
    rules: dict[str, str] = field(default_factory=dict)  # positional id -> @rule (or @id)
    # Per set of actions, the policies that can apply to them (``for_actions``).
    _subsets: dict[frozenset[str], cedarpy.PolicySet] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_text(cls, text: str) -> Policies:
        """Parsed once the text is within the sizes a parser survives (``size_problem``); ids and
        rules read from the text itself, with no recursive decode of its JSON form (a valid deny
        list of a few hundred ``||`` terms is deeper than Python's recursion limit)."""
        why = size_problem(text, "the policy text")
        if why is not None:
            raise ValueError(why)
        policy_set = cedarpy.PolicySet.from_str(text)
        ids: dict[str, str] = {}
        rules: dict[str, str] = {}
        for index, (_, statement) in enumerate(_statements(text)):
            pid, notes = f"policy{index}", policy_annotations(statement)
            ids[pid] = notes.get("id") or pid
            rules[pid] = notes.get("rule") or ids[pid]
        return cls(text=text, policy_set=policy_set, ids=ids, rules=rules)

    def for_actions(self, actions: Collection[str]) -> cedarpy.PolicySet:
        """The policies whose action scope admits one of ``actions`` (the schema's, or an action
        group of one), under their own ids: the engine answers a request of those actions on
        them as on the whole set (Cedar checks the scope before the conditions, so a policy whose
        scope excludes the request is neither satisfied nor in error), and evaluates fewer. Made
        once per set of actions. The whole set for an action the schema does not have, for a set
        of more than SUBSET_MAX_POLICIES (making the subsets would cost more than they save), and
        when its nodes cannot be read (templates, or deeper than the engine converts)."""
        key = frozenset(actions)
        if not key <= _ACTION_NAMES or len(self.ids) > SUBSET_MAX_POLICIES:
            return self.policy_set
        subset = self._subsets.get(key)
        if subset is None:
            subset = self.policy_set
            try:
                nodes = self.policy_set.to_pst()
            except ValueError:
                nodes = None
            if nodes is not None and not nodes.templates and not nodes.template_links:
                keep = {pid: node for pid, node in nodes.static_policies.items()
                        if any(_admits(node.action, name) for name in key)}
                subset = cedarpy.PolicySet.from_pst(pst.PolicySet(templates={}, static_policies=keep, template_links=()))
            self._subsets[key] = subset  # at most one per set of the schema's actions
        return subset


# Up to this many policies, a request is judged by those its action can meet (``for_actions``):
# making a subset takes some milliseconds per 10 policies, once per set of actions.
SUBSET_MAX_POLICIES = 64
_ACTION_NAMES = frozenset(ACTIONS)
_ACTION_TYPE = pst.EntityType(basename="Action", namespace=(NS,))


def _groups(name: str) -> set[str]:
    """An action and the groups it is in (the schema's ``in``, given to the engine as
    ``ACTION_GROUPS``)."""
    found, todo = {name}, [name]
    while todo:
        current = todo.pop()
        for group in ACTION_GROUPS:
            if group["uid"]["id"] == current:
                for parent in group["parents"]:
                    if parent["id"] not in found:
                        found.add(parent["id"])
                        todo.append(parent["id"])
    return found


def _admits(scope: object, name: str) -> bool:
    """Can a policy of this action ``scope`` apply to a request of action ``name``? Whatever it
    cannot tell (a scope of a kind it does not know) it admits."""
    if isinstance(scope, pst.ActionEq):
        return scope.entity.type == _ACTION_TYPE and scope.entity.id == name
    if isinstance(scope, pst.ActionIn):
        groups = _groups(name)
        return any(uid.type == _ACTION_TYPE and uid.id in groups for uid in scope.entities)
    return True


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Lru(Generic[K, V]):
    """A bounded map, the least recently used entry out first, safe across the worker's threads.
    Its keys are contents (a policy's hash, an entity set's exact JSON): a changed policy is a new
    key, so no entry goes stale and none expires by time."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K, make: Callable[[], V]) -> V:
        """The value of ``key``; made when absent (outside the lock: a parse takes a while, and two
        threads making one value at once each get an equal one)."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = make()
        self.put(key, value)
        return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


# Parsed policy sets by content: a tenant's TOML rules by their hash (exported), a Cedar text by
# its sha256. A worker holds a few (a tenant each, the shadow, a version being rolled out).
POLICY_SETS: Lru[str, Policies] = Lru(64)
# A Cedar text's sha256 by the text (a str keeps its hash: the store hands over one object per
# version of the file, so a decision does not hash a large text again).
_TEXT_DIGESTS: Lru[str, str] = Lru(64)
# A tenant's content hash by the identity of its TenantPolicy. The store reads a new one for each
# version of the file and never changes one in place, so a decision does not serialize the rules
# again; the weak reference tells a live object from another one at a freed one's address.
_TENANT_KEYS: Lru[tuple[str, int], tuple[weakref.ref[TenantPolicy], str]] = Lru(256)


def _sha256(*parts: str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def tenant_key(name: str, tenant: TenantPolicy) -> str:
    """The content hash of a tenant's rules (its name and its settings)."""
    ident = (name, id(tenant))
    ref, digest = _TENANT_KEYS.get(ident, lambda: (weakref.ref(tenant), _sha256(name, tenant.model_dump_json())))
    if ref() is not tenant:  # the one hashed is gone; this one took its address
        ref, digest = weakref.ref(tenant), _sha256(name, tenant.model_dump_json())
        _TENANT_KEYS.put(ident, (ref, digest))
    return digest


def policies_for(name: str, tenant: TenantPolicy) -> Policies:
    """The exported policies of a tenant, parsed once per version of its rules."""
    return POLICY_SETS.get("toml:" + tenant_key(name, tenant), lambda: Policies.from_text(export_tenant(name, tenant)))


def parsed(text: str) -> Policies:
    """A Cedar policy text, parsed once per content (``Policies.from_text``'s bounds first)."""
    if len(text) > MAX_POLICY_BYTES:  # refused by the bounds, and never kept as a key
        return Policies.from_text(text)
    digest = _TEXT_DIGESTS.get(text, lambda: _sha256(text))
    return POLICY_SETS.get("cedar:" + digest, lambda: Policies.from_text(text))


# ----------------------------------------------------------------------------- the world


@dataclass(frozen=True)
class Judgement:
    """One Cedar decision: allowed or not, the ids of the policies that decided it (the permits
    that allowed it, the forbids that refused it; none: nothing permitted it), the refusal
    rule, and the entities and request it was judged on (what `tether policy explain` prints)."""

    allowed: bool
    policies: tuple[str, ...]
    rule: str | None
    request: dict[str, Any] = field(default_factory=dict, compare=False)
    entities: tuple[dict[str, Any], ...] = field(default=(), compare=False)
    errors: tuple[str, ...] = field(default=(), compare=False)


# A name's skeleton (UTS #39) is a pure function of it, asked for on every decision.
_skeleton = functools.lru_cache(maxsize=4096)(skeleton)


def person_entity(name: str, tenant_name: str, tenant: TenantPolicy) -> dict[str, Any]:
    """A person as the tenant's policy file lists them: member, and holder of their roles."""
    parents: list[dict[str, str]] = []
    if tenant.approvers is None:
        parents.append(_uid("Tenant", tenant_name))  # no approvers listed: anyone is a member
    elif (member := tenant.approvers.get(name)) is not None:
        parents.append(_uid("Tenant", tenant_name))
        parents += [_uid("Role", r) for r in member.roles]
    return {"uid": _uid("Person", name), "attrs": {"skeleton": _skeleton(name)}, "parents": parents}


def _run_entity(
    tenant_name: str,
    *,
    requested_by: str,
    roles: Collection[str] = (),
    already_approved: Collection[str] = (),
    editors: Collection[str] = (),
    risk: str = "normal",
    stage: int = 0,
) -> dict[str, Any]:
    return {
        "uid": _uid("Run", "run"),
        "attrs": {
            "tenant": {"__entity": _uid("Tenant", tenant_name)},
            "requester": {"__entity": _uid("Person", requested_by)},
            "risk": risk,
            "stage": stage,
            "roles": [{"__entity": _uid("Role", r)} for r in sorted(set(roles))],
            "approved_by": sorted({_skeleton(a) for a in already_approved}),
            "revised_by": sorted({_skeleton(e) for e in editors}),
        },
        "parents": [],
    }


def run_entities(tenant_name: str, tenant: TenantPolicy, *, person: str, requested_by: str, **run: Any) -> list[dict[str, Any]]:
    """The entities of a person's decision on a run: the person, the requester and the run
    (``run``: roles, already_approved, editors, risk, stage of its pending request)."""
    people = [person_entity(name, tenant_name, tenant) for name in dict.fromkeys((person, requested_by))]
    return [*people, _run_entity(tenant_name, requested_by=requested_by, **run)]


# The parts of a decision's entities that recur, by content: a person as a tenant lists them (by
# the tenant's hash and the name) with its JSON, and the engine's parsed handle of a decision's
# recurring part (its people; a plan and the runtime), to which each request's own entities (its
# run; its steps) are added. Only those are parsed per decision.
_PEOPLE: Lru[tuple[str, str], tuple[dict[str, Any], str]] = Lru(4096)
_BASES: Lru[str, cedarpy.Entities] = Lru(1024)
_ACTION_GROUPS_JSON = json.dumps(list(ACTION_GROUPS))


def _person(tenant_name: str, tenant: TenantPolicy, key: str, name: str) -> tuple[dict[str, Any], str]:
    def make() -> tuple[dict[str, Any], str]:
        entity = person_entity(name, tenant_name, tenant)
        return entity, json.dumps(entity)

    return _PEOPLE.get((key, name), make)


def _entities(recurring: list[str], own: list[dict[str, Any]]) -> cedarpy.Entities:
    """The engine's entities: the ``recurring`` ones (JSON) with the action groups, parsed once per
    content, and the request's ``own`` added to them."""
    text = "[" + ", ".join([*recurring, _ACTION_GROUPS_JSON[1:-1]]) + "]"
    return _BASES.get(text, lambda: cedarpy.Entities.from_json_str(text)).with_added_json_str(json.dumps(own))


def judge_request(policies: Policies, request: dict[str, Any], entities: list[dict[str, Any]],
                  tenant: object | None) -> Judgement:
    """A request judged on these entities (a logged one again, under another policy: what-if)."""
    return judge_requests(policies, [request], entities, tenant)[0]


def action_name(request: dict[str, Any]) -> str:
    """``approve`` of ``Tether::Action::"approve"``."""
    return str(request.get("action", "")).rsplit("::", 1)[-1].strip('"')


def judge_requests(policies: Policies, requests: list[dict[str, Any]], entities: list[dict[str, Any]],
                   tenant: object | None) -> list[Judgement]:
    """Requests judged on one set of entities, parsed whole, by the whole policy set, in one call
    into the engine (nothing cached: what-if, and the reference tests hold the cached path to). The
    entities are this module's own (``run_entities``, ``step_entities``), which tests check against
    the schema; the policies were checked against it when they were loaded."""
    handle = cedarpy.Entities.from_json_str(json.dumps([*entities, *ACTION_GROUPS]))
    return _judge(policies, requests, entities, handle, tenant, whole=True)


def _engine_request(request: dict[str, Any]) -> dict[str, Any]:
    """A request in the form the engine reads fastest, meaning the same: the action as a uid (no
    Cedar text to parse), the context as JSON."""
    out = dict(request)
    action = request.get("action")
    if isinstance(action, str) and action == _action(name := action_name(request)):
        out["action"] = {"type": f"{NS}::Action", "id": name}
    context = out.get("context")
    if isinstance(context, dict):
        out["context"] = json.dumps(context) if context else "{}"
    return out


def _judge(policies: Policies, requests: list[dict[str, Any]], entities: list[dict[str, Any]],
           handle: cedarpy.Entities, tenant: object | None, whole: bool = False) -> list[Judgement]:
    """Requests judged on the parsed ``handle`` of ``entities`` (what the judgement records), by
    the policies that can apply to their actions (``whole``: by every policy)."""
    engine = [_engine_request(r) for r in requests]
    named = [r["action"]["id"] for r in engine if isinstance(r.get("action"), dict)]
    policy_set = policies.for_actions(named) if len(named) == len(engine) and not whole else policies.policy_set
    results = cedarpy.is_authorized_batch(engine, policy_set, handle)
    out = []
    recorded = tuple(entities)
    for request, result in zip(requests, results, strict=True):
        reasons = list(result.diagnostics.reasons)
        ids = tuple(sorted(policies.ids.get(r, r) for r in reasons))
        rule = None
        if not result.allowed:
            named = [policies.rules.get(r, r) for r in reasons]
            named.sort(key=lambda r: (RULE_ORDER.index(r) if r in RULE_ORDER else len(RULE_ORDER), r))
            rule = named[0] if named else (
                "tenant" if tenant is None else NOT_PERMITTED.get(action_name(request), "not_permitted")
            )
        errors = tuple(result.diagnostics.errors)
        allowed = result.allowed
        if errors and allowed:
            # Cedar skips a policy that errors (an erroring forbid would let the request through):
            # an evaluation error in any policy that applies is a refusal, naming that policy
            # (already refused: by the policies that refused it).
            erring = tuple(sorted({policies.ids.get(m[1], m[1]) for e in errors if (m := _ERRORED.match(str(e)))}))
            allowed, rule, ids = False, POLICY_ERROR, erring or ids
        out.append(Judgement(
            allowed=allowed, policies=ids, rule=rule, request=request, entities=recorded, errors=errors,
        ))
    return out


# The rule of a refusal by a policy that errored at evaluation (fail closed).
POLICY_ERROR = "policy_error"
# How the engine names a policy that errored: "error while evaluating policy `policy3`: ...".
_ERRORED = re.compile(r"^error while evaluating policy `([^`]*)`")


def _denied_tenant(request: dict[str, Any]) -> Judgement:
    return Judgement(allowed=False, policies=(), rule="tenant", request=request)


def person_request(action: str, person: str) -> dict[str, Any]:
    """The request of a person's ``action`` on the run (as judgements record it)."""
    return {"principal": _uid("Person", person), "action": _action(action), "resource": _uid("Run", "run"), "context": {}}


def judge_person(
    policies: Policies | None,
    tenant_name: str,
    tenant: TenantPolicy | None,
    *,
    action: str,
    person: str,
    requested_by: str,
    **run: Any,
) -> Judgement:
    """May ``person`` take ``action`` (approve, approve_steps, reject, revise, hand_off, cancel,
    compensate) on the run? The same inputs as ``workflows.policy.approver_refusal``; ``run``:
    what :func:`run_entities` takes about the pending request (roles, already_approved, editors,
    risk, stage). The entities are :func:`run_entities`', the people's parsed once per tenant
    version (tests/activities/test_cedar.py holds this equal to judging them whole)."""
    request = person_request(action, person)
    if tenant is None or policies is None:
        return _denied_tenant(request)
    key = tenant_key(tenant_name, tenant)
    people = [_person(tenant_name, tenant, key, name) for name in dict.fromkeys((person, requested_by))]
    run_entity = _run_entity(tenant_name, requested_by=requested_by, **run)
    entities = [*(entity for entity, _ in people), run_entity]
    return _judge(policies, [request], entities, _entities([text for _, text in people], [run_entity]), tenant)[0]


def step_entities(
    tenant_name: str,
    steps: Sequence[PlanStep],
    catalog: ToolCatalog,
    *,
    spent: dict[str, float] | None = None,
    risk: str = "none",
    undo: Sequence[object | None] | None = None,
    plan_hash: str = "",
) -> list[dict[str, Any]]:
    """The entities of the runtime's decisions on a plan's steps: a Plan, the Runtime and one
    Step each, tagged with the run's sums (done and planned) of its tool's numeric arguments."""
    totals = dict(spent or {})
    for step in steps:
        spend(totals, step.tool, step.args)
    plan = {"uid": _uid("Plan", "plan"), "attrs": {"hash": plan_hash, "steps": len(steps)}, "parents": []}
    entities: list[dict[str, Any]] = [plan, {"uid": _uid("Runtime", "tether"), "attrs": {}, "parents": []}]
    for i, step in enumerate(steps, start=1):
        info = catalog.get(step.tool)
        prefix = f"{step.tool}."
        tags = {
            key[len(prefix):]: {"__extn": {"fn": "decimal", "arg": decimal_text(total)}}
            for key, total in totals.items() if key.startswith(prefix)
        }
        entities.append({
            "uid": _uid("Step", str(i)),
            "attrs": {
                "tenant": {"__entity": _uid("Tenant", tenant_name)},
                "tool": step.tool,
                "known": info is not None,
                "effect": info.effect.value if info is not None else ToolEffect.UNSAFE.value,
                "requires_approval": info.requires_approval if info is not None else True,
                "destructive": info.destructive if info is not None else True,
                "undo": bool(undo is not None and undo[i - 1] is not None),
                "risk": risk,
            },
            "parents": [_uid("Plan", "plan")],
            "tags": tags,
        })
    return entities


def step_requests(actions: Sequence[str], steps: int, writes: Collection[int] | None = None) -> list[dict[str, Any]]:
    """The runtime's ``actions`` on steps 1..``steps`` (``execute_write`` only on the ``writes``
    when given), each action's in plan order."""
    return [
        {"principal": _uid("Runtime", "tether"), "action": _action(action), "resource": _uid("Step", str(i)), "context": {}}
        for action in actions
        for i in range(1, steps + 1)
        if action != "execute_write" or writes is None or i in writes
    ]


def judge_steps(
    policies: Policies | None,
    tenant_name: str,
    tenant: TenantPolicy | None,
    *,
    actions: Sequence[str],
    steps: Sequence[PlanStep],
    catalog: ToolCatalog,
    spent: dict[str, float] | None = None,
    risk: str = "none",
    undo: Sequence[object | None] | None = None,
    writes: Collection[int] | None = None,
) -> list[Judgement]:
    """The runtime's ``actions`` (auto_approve, execute_write) on each step: for each action,
    each step in plan order (``execute_write`` only on the ``writes``, 1-based, when given),
    judged in one call; the plan and the runtime parsed once per plan length."""
    requests = step_requests(actions, len(steps), writes)
    if tenant is None or policies is None:
        return [_denied_tenant(r) for r in requests]
    if not requests:
        return []
    entities = step_entities(tenant_name, steps, catalog, spent=spent, risk=risk, undo=undo)
    handle = _entities([json.dumps(e) for e in entities[:2]], entities[2:])
    return _judge(policies, requests, entities, handle, tenant)


def plan_auto_approved(judgements: Sequence[Judgement]) -> bool:
    """A plan runs without a person when Cedar auto-approves every one of its steps."""
    return all(j.allowed for j in judgements)
