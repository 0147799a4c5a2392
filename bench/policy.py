"""Policy decisions per second and their latency: the TOML rules against Cedar.

    python -m bench.policy [--decisions 5000] [--policy examples/billing/policy.toml] [--tenant default]

No Temporal: the decisions themselves, as the policy activity makes them, on one thread. The
same seeded random decisions for each engine (tests/test_cedar.py's generator): a person's
decision (approve, reject, revise: ``approver_refusal`` against ``cedar.judge_person``, entities
built and judged each time), the activity's whole judgement (Cedar, and the TOML wording of a
refusal), and a 3-step plan's pre-write check (``review_plan`` against Cedar's ``auto_approve``
and ``execute_write`` on every step).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from activities import cedar
from activities.policy import judge_decision, judge_writes, parse_policy
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


def timed(work: Callable[[int], object], n: int) -> tuple[float, float, float]:
    """Decisions per second, p50 and p99 in microseconds, over ``n`` calls (``work(i)``)."""
    for i in range(min(n, 200)):  # warm: caches, the parsed policy set
        work(i)
    took = []
    start = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        work(i)
        took.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    took.sort()
    return n / total, statistics.median(took) * 1e6, took[min(n - 1, int(n * 0.99))] * 1e6


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

    def toml_writes(i: int) -> object:
        review = policy.review_plan(Plan(steps=plans[i], plan_hash=""), CATALOG, tenant)
        return review.needs_approval, [policy.tool_refusal(tenant, s.tool) for s in plans[i]]

    rows = []
    n = args.decisions
    for label, work in [
        ("decision: TOML rules", toml_decision),
        ("decision: Cedar", cedar_decision),
        ("decision: the activity's (Cedar + wording)", lambda i: judge_decision(tenant, policies, checks[i])),
        ("pre-write check, 3 steps: TOML rules", toml_writes),
        ("pre-write check, 3 steps: Cedar", lambda i: judge_writes(tenant, policies, authority[i], args.tenant)),
    ]:
        rate, p50, p99 = timed(work, n)
        rows.append([label, n, f"{rate:,.0f}", f"{p50:.0f}", f"{p99:.0f}"])
    print(f"policy decisions, tenant {args.tenant} of {args.policy}; {machine_line()}")
    print(table(["decision", "n", "per second", "p50 µs", "p99 µs"], rows))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
