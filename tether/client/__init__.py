"""Drive Tether from a program: connect to Temporal, start runs, decide, hand off, cancel, inspect.

The ``tether`` CLI, the inbox, the demo, the benchmarks and the tests all go through these
functions; none of them needs argparse. Each returns a pydantic model or raises
:class:`TetherError`: its class says what went wrong (``Refused``, ``UsageError``, ``Pending``,
``NoWorker``, ``Unreachable``) and is the CLI's exit code (``code``: 0 OK, 1 REFUSED, 2 USAGE,
3 PENDING; ``tether.connection`` says what each means, and where the connection's settings come from).

    from tether.client import DecisionInput, connect, decide, start_run, wait_settled
    from workflows.models import RunRequest

    client = await connect()
    handle = await start_run(client, RunRequest(...), run_id="run-1")
    status = await wait_settled(client, "run-1", timeout=60)
    verdict = await decide(client, "run-1", "approve", DecisionInput(by="bob"))

One module a job, each importing only those above it in this list: ``errors`` (what went wrong,
as a TetherError), ``workers`` (is a worker serving; what to say when none is), ``signing``
(keys and signatures), ``shown`` (what a person is shown), ``sink`` (the audit sink and effect
ledger, as a client reads them), ``reads`` (one run's status, queries and outcome),
``audit_trail`` (every execution's records), ``listing`` (runs from visibility, builds),
``deployments`` (Worker Deployment versions), ``decisions`` (approve, reject, revise, hand off),
``operations`` (start, cancel, compensate). This face names the public API of them all, and
what programs use from ``tether.connection`` and ``tether.runs``. A repair, and a forced
hand-off's reset, are the worker's side (``tether.repair``): the CLI hands them in.
"""

from __future__ import annotations

from tether.connection import (
    DEFAULT_TASK_QUEUE, DEPLOYMENT_ENV, MCP_TASK_QUEUE, OK, PENDING, QUERY_TIMEOUT, REFUSED, USAGE, NoWorker, Pending,
    Refused, TetherError, Unreachable, UsageError,
    checkout_stack, connect, connect_config, deployment_name, exit_process, rpc_error, task_queue, timed_out,
)
from tether.pollers import HEARTBEAT_FRESH, POLLER_FRESH, PROBE_TIMEOUT, served_tools
from tether.runs import RepairResult, StuckTask, ViewUnverified, public_keys, published_view, stuck_task

from tether.client.errors import JudgementLogUnreadable, invalid
from tether.client.workers import (
    TAKE_SECONDS, has_worker, no_answer, no_worker_message,
    require_worker, start_worker_hint, unserved_message, untaken_message, untaken_seconds, worker_serving,
)
from tether.client.signing import ensure_keys, keygen, load_private_key, sign, sign_request
from tether.client.shown import (
    ArgView, StepView, age, approval_offer_problem, approvals_needed, freshness, plan_summary, shown_arg,
    step_views, write_args,
)
from tether.client.sink import ledger_standing, undo_standing
from tether.client.reads import (
    TREE_NODES, ChildSpend, RunStatus, closed_note, read_run, root_of, run_goal, run_outcome, snapshot, status, timeline,
    tree_spend, unserved, wait_settled,
)
from tether.client.audit_trail import AuditBranch, AuditTrail, audit_trail, full_timeline
from tether.client.listing import DESCRIBE_CONCURRENCY, RunSummary, build_order, drain, list_query, list_runs, run_build
from tether.client.deployments import DeployedVersion, DeploymentStatus, deployment_status
from tether.client.decisions import (
    CONTINUING_RETRY, DecisionInput, HASH_PREFIX, PENDING_QUERY_SECONDS, TASK_FAILING_RETRY, VERDICT_TIMEOUT,
    Verdict, build_decision, decide, held_request, pending_request, plan_to_run, resolve_plan_hash, revise,
    revised_steps,
)
from tether.client.handoffs import ForcedReset, handoff
from tether.client.operations import (
    cancel, cancel_tree, compensate, compensate_refusal, compensate_tree, handoff_tree, snapshot_or_listed, compensation_id, compensation_judged, person_name, planner_refusal,
    policy_file, policy_tenant, start_run, tenant_refusal,
)

__all__ = [
    "ArgView",
    "AuditBranch",
    "AuditTrail",
    "CONTINUING_RETRY",
    "ChildSpend",
    "DEFAULT_TASK_QUEUE",
    "DEPLOYMENT_ENV",
    "DESCRIBE_CONCURRENCY",
    "DecisionInput",
    "DeployedVersion",
    "DeploymentStatus",
    "ForcedReset",
    "HASH_PREFIX",
    "HEARTBEAT_FRESH",
    "JudgementLogUnreadable",
    "MCP_TASK_QUEUE",
    "NoWorker",
    "OK",
    "PENDING",
    "PENDING_QUERY_SECONDS",
    "POLLER_FRESH",
    "PROBE_TIMEOUT",
    "Pending",
    "QUERY_TIMEOUT",
    "REFUSED",
    "Refused",
    "RepairResult",
    "RunStatus",
    "RunSummary",
    "StepView",
    "StuckTask",
    "TAKE_SECONDS",
    "TASK_FAILING_RETRY",
    "TREE_NODES",
    "TetherError",
    "USAGE",
    "Unreachable",
    "UsageError",
    "VERDICT_TIMEOUT",
    "Verdict",
    "ViewUnverified",
    "age",
    "approval_offer_problem",
    "approvals_needed",
    "audit_trail",
    "build_decision",
    "build_order",
    "cancel",
    "cancel_tree",
    "checkout_stack",
    "closed_note",
    "compensate",
    "compensate_refusal",
    "compensate_tree",
    "compensation_id",
    "compensation_judged",
    "connect",
    "connect_config",
    "decide",
    "deployment_name",
    "deployment_status",
    "drain",
    "ensure_keys",
    "exit_process",
    "freshness",
    "full_timeline",
    "handoff",
    "handoff_tree",
    "has_worker",
    "held_request",
    "invalid",
    "keygen",
    "ledger_standing",
    "list_query",
    "list_runs",
    "load_private_key",
    "no_answer",
    "no_worker_message",
    "pending_request",
    "person_name",
    "plan_summary",
    "plan_to_run",
    "planner_refusal",
    "policy_file",
    "policy_tenant",
    "public_keys",
    "published_view",
    "read_run",
    "require_worker",
    "resolve_plan_hash",
    "revise",
    "revised_steps",
    "root_of",
    "rpc_error",
    "run_build",
    "run_goal",
    "run_outcome",
    "served_tools",
    "shown_arg",
    "sign",
    "sign_request",
    "snapshot",
    "snapshot_or_listed",
    "start_run",
    "start_worker_hint",
    "status",
    "step_views",
    "stuck_task",
    "task_queue",
    "tenant_refusal",
    "timed_out",
    "timeline",
    "tree_spend",
    "undo_standing",
    "unserved",
    "unserved_message",
    "untaken_message",
    "untaken_seconds",
    "wait_settled",
    "worker_serving",
    "write_args",
]
