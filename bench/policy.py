"""Policy decisions per second and their latency: the TOML rules against Cedar, cached and not.

    python -m bench.policy [--decisions 5000] [--policy examples/billing/policy.toml] [--tenant default]

No Temporal: the decisions themselves, as the policy activity makes them, on one thread. The
same seeded random decisions for each engine (tests/activities/test_cedar.py's generator): a person's
decision (approve, reject, revise: ``approver_refusal`` against ``cedar.judge_person``), the
activity's whole judgement (the tenant's policies looked up, Cedar, and the TOML wording of a
refusal), and a 3-step plan's pre-write check (``review_plan`` against the activity's
``judge_writes``: Cedar's ``auto_approve`` and ``execute_write`` on every step).

Every request is a new one: no answer is remembered. What is cached is what does not change
between decisions (tether/policy/cedar.py): the parsed policy set per policy hash, a tenant's people
and a plan's runtime, parsed once per version of the tenant's rules; each decision's own entities
(its run, its steps) are built and parsed each time. The "uncached" rows are the path before that:
the policy text parsed, and the entities built and parsed whole, on every call.

Wall-clock p50/p99 are what a caller waits, preemption by other processes included; CPU p50/p99
(the thread's own time) are what the decision costs, and hold still on a busy machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tether.policy import cedar
from activities.policy_checks import judge_decision, judge_writes
from tether.policy.files import parse_policy
from bench.common import machine_line, table
from workflows import policy
from workflows.contract import ApprovalDecision, Plan, PlanStep, ToolCatalog, ToolEffect, ToolInfo
from workflows.wire import AuthorityCheck, DecisionCheck

CATALOG = ToolCatalog(tools=[
    ToolInfo(name="get_order", effect=ToolEffect.READ_ONLY, requires_approval=False, args_schema={}, timeout_seconds=10, max_retries=1),
    ToolInfo(name="issue_refund", effect=ToolEffect.IDEMPOTENT, requires_approval=True, args_schema={}, timeout_seconds=10, max_retries=1),
    ToolInfo(name="send_email", effect=ToolEffect.UNSAFE, requires_approval=True, args_schema={}, timeout_seconds=10, max_retries=1),
])


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.policy", description=__doc__.splitlines()[0])
    p.add_argument("--decisions", type=int, default=5000, help="decisions per engine and kind")
    p.add_argument("--policy", default="examples/billing/policy.toml")
    p.add_argument("--tenant", default="default")
    p.add_argument("--seed", type=int, default=32)
    return p.parse_args(argv)


def timed(work: Callable[[int], object], n: int) -> tuple[float, float, float, float, float]:
    """Decisions per second, then p50 and p99 in microseconds of wall clock and of the thread's
    CPU time, over ``n`` calls (``work(i)``) after a warm-up."""
    for i in range(min(n, 200)):  # warm: the interpreter's and the caches' first touches
        work(i)
    took, cpu = [], []
    start = time.perf_counter()
    for i in range(n):
        t, c = time.perf_counter_ns(), time.thread_time_ns()
        work(i)
        cpu.append(time.thread_time_ns() - c)
        took.append(time.perf_counter_ns() - t)
    total = time.perf_counter() - start
    took.sort()
    cpu.sort()
    p99 = min(n - 1, int(n * 0.99))
    return n / total, statistics.median(took) / 1e3, took[p99] / 1e3, statistics.median(cpu) / 1e3, cpu[p99] / 1e3


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    tenant = parse_policy(Path(args.policy).read_text(), args.policy).tenants[args.tenant]
    policies = cedar.policies_for(args.tenant, tenant)
    rng = random.Random(args.seed)
    people = sorted(set(tenant.approvers or {}) | {"alice", "bob"}) + ["mallory", "a1ice"]
    roles = sorted({r for a in (tenant.approvers or {}).values() for r in a.roles} | {"approver"})
    kinds = ["approve", "reject", "revise"]
    checks = [
        DecisionCheck(
            tenant=args.tenant, workflow_id="bench", kind=rng.choice(kinds),
            decision=ApprovalDecision(decision_id=f"d{i}", approver=rng.choice(people), plan_hash="h"),
            requested_by=rng.choice(people), roles=rng.sample(roles, 1),
            already_approved=rng.sample(people, rng.randint(0, 1)), editors=rng.sample(people, rng.randint(0, 1)),
        )
        for i in range(args.decisions)
    ]
    plans = [
        [PlanStep(tool_call_id=f"s{j}", tool=rng.choice(["get_order", "issue_refund", "send_email"]),
                  args={"amount_cents": rng.choice([1000, 4999, 5001, 60000])}) for j in range(3)]
        for _ in range(args.decisions)
    ]
    authority = [
        AuthorityCheck(tenant=args.tenant, approvals=[], tools=[s.tool for s in steps], roles=[], approvals_required=0,
                       steps=steps, catalog=CATALOG)
        for steps in plans
    ]

    def toml_decision(i: int) -> object:
        c = checks[i]
        return policy.approver_refusal(tenant, approver=c.decision.approver, requested_by=c.requested_by, kind=c.kind,
                                       roles=c.roles, already_approved=c.already_approved, editors=c.editors)

    def cedar_decision(i: int) -> object:
        c = checks[i]
        return cedar.judge_person(policies, args.tenant, tenant, action=c.kind, person=c.decision.approver,
                                  requested_by=c.requested_by, roles=c.roles, already_approved=c.already_approved,
                                  editors=c.editors)

    def cedar_decision_uncached(i: int) -> object:
        c = checks[i]
        parsed = cedar.Policies.from_text(cedar.export_tenant(args.tenant, tenant))
        entities = cedar.run_entities(args.tenant, tenant, person=c.decision.approver, requested_by=c.requested_by,
                                      roles=c.roles, already_approved=c.already_approved, editors=c.editors)
        return cedar.judge_request(parsed, cedar.person_request(c.kind, c.decision.approver), entities, tenant)

    def activity_decision(i: int) -> object:
        return judge_decision(tenant, cedar.policies_of(args.tenant, tenant, None), checks[i])

    def cedar_writes_uncached(i: int) -> object:
        steps = authority[i].steps
        parsed = cedar.Policies.from_text(cedar.export_tenant(args.tenant, tenant))
        review = policy.review_plan(Plan(steps=steps, plan_hash=""), CATALOG, tenant)
        writes = [k for k, s in enumerate(steps, start=1) if (info := CATALOG.get(s.tool)) is None or info.effect != ToolEffect.READ_ONLY]
        requests = cedar.step_requests(["execute_write", "auto_approve"], len(steps), writes)
        return cedar.judge_requests(parsed, requests, cedar.step_entities(args.tenant, steps, CATALOG, risk=review.risk), tenant)

    def cedar_writes(i: int) -> object:
        return judge_writes(tenant, cedar.policies_of(args.tenant, tenant, None), authority[i], args.tenant)

    def toml_writes(i: int) -> object:
        review = policy.review_plan(Plan(steps=plans[i], plan_hash=""), CATALOG, tenant)
        return review.needs_approval, [policy.tool_refusal(tenant, s.tool) for s in plans[i]]

    rows = []
    n = args.decisions
    for label, work in [
        ("decision: TOML rules", toml_decision),
        ("decision: Cedar, uncached", cedar_decision_uncached),
        ("decision: Cedar", cedar_decision),
        ("decision: the activity's (lookup, Cedar, wording)", activity_decision),
        ("pre-write check, 3 steps: TOML rules", toml_writes),
        ("pre-write check, 3 steps: Cedar, uncached", cedar_writes_uncached),
        ("pre-write check, 3 steps: the activity's (Cedar)", cedar_writes),
    ]:
        rate, p50, p99, cpu50, cpu99 = timed(work, n)
        rows.append([label, n, f"{rate:,.0f}", f"{p50:.0f}", f"{p99:.0f}", f"{cpu50:.0f}", f"{cpu99:.0f}"])
    print(f"policy decisions, tenant {args.tenant} of {args.policy}; {machine_line()}")
    print(table(["decision", "n", "per second", "p50 µs", "p99 µs", "CPU p50 µs", "CPU p99 µs"], rows))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
