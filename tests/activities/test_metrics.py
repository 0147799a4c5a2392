"""Metrics: the worker's Prometheus endpoint, scraped during real runs on the dev server.

A worker with a Prometheus runtime runs two refund runs (one approved after a stale decision
was refused and one refund attempt failed once, one rejected); the scrape shows Temporal's SDK
metrics and Tether's run-level metrics with exactly the values those runs produce. A second test
starts ``worker.py --metrics-port`` as a process, the way the container does.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from temporalio.contrib.pydantic import pydantic_data_converter

import tether.client as tether_client
from tether.metrics import prometheus_runtime
from tether.policy.files import PolicyStore
from tether.client import run_outcome
from tests.helpers.runs import approval_for, make_request, running_worker, start_run, unique
from tests.helpers.waiting import wait_for_state
from workflows.metrics import KINDS, REFUSAL_RULES, RULES, refusal_labels, refusal_rule
from workflows.contract import ApprovalDecision
from workflows.run_state import RunOutcome
from workflows.states import RunState
from tests.helpers.metrics import scrape, value
from tests.helpers.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_refusal_rules_cover_the_policy_reasons() -> None:
    reasons = {
        "approve refused: duplicate decision_id d-1: already handled": ("approve", "duplicate_decision"),
        "reject refused: run is COMPLETED, not AWAITING_APPROVAL": ("reject", "not_awaiting_approval"),
        "approve refused: stale plan hash 0123456789ab: the pending plan is ba9876543210": (
            "approve",
            "stale_plan_hash",
        ),
        "approve refused: approval expired at 2025-01-01T00:00:00+00:00": ("approve", "approval_expired"),
        "approve refused: approver is empty": ("approve", "empty_approver"),
        "reject refused: another decision for this plan was accepted first": (
            "reject",
            "decision_already_accepted",
        ),
        "handoff refused: run already ended in COMPLETED": ("handoff", "run_ended"),
        "handoff refused: a handoff is already pending": ("handoff", "handoff_pending"),
        "approve refused: something new": ("approve", "other"),
    }
    for reason, expected in reasons.items():
        assert refusal_rule(reason) == expected, reason
    assert {rule for _, rule in REFUSAL_RULES} <= {r for _, r in reasons.values()}


def test_refusal_labels_are_fixed_sets_whatever_the_sender_names() -> None:
    from datetime import datetime, timezone

    from workflows.states import TransitionRecord

    def labels(reason: str, rule: str | None = None) -> dict[str, str]:
        record = TransitionRecord(kind="refused", at=datetime(2026, 1, 1, tzinfo=timezone.utc), actor="x",
                                  from_state=RunState.AWAITING_APPROVAL, to_state=RunState.AWAITING_APPROVAL,
                                  state_version=1, reason=reason, rule=rule)
        return refusal_labels(record)

    # A signal name is the sender's: never a label value.
    assert labels("signal 'evil-1' refused: not a signal this run takes", "unknown_signal") == {
        "kind": "other", "rule": "unknown_signal"}
    assert labels("approve_now refused: malformed payload, x", "malformed_signal") == {
        "kind": "other", "rule": "malformed_signal"}
    assert labels("approve refused: stale plan hash 0123") == {"kind": "approve", "rule": "stale_plan_hash"}
    assert labels("decide refused: x", "four_eyes") == {"kind": "decide", "rule": "four_eyes"}
    assert labels("cancel refused: x", "tenant_membership") == {"kind": "cancel", "rule": "tenant_membership"}
    assert labels("approve refused: x", "a-rule-nobody-named") == {"kind": "approve", "rule": "other"}


def test_every_rule_the_code_names_is_a_known_label() -> None:
    """A new rule= in workflows/ or activities/ must join workflows.metrics.RULES (else it counts
    as "other" on the dashboard)."""
    import ast

    named: set[str] = set()
    for path in [*(ROOT / "workflows").glob("*.py"), *(ROOT / "activities").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "rule" and isinstance(node.value, ast.Constant):
                named.add(node.value.value)
    named.discard(None)
    assert named and named - {"other"} <= RULES, sorted(named - RULES)
    assert KINDS == {"approve", "reject", "revise", "handoff", "decide", "cancel"}


async def test_metrics_endpoint_shows_run_metrics(dev_env, billing) -> None:
    port = free_port()
    client = await tether_client.connect(
        target_host=dev_env.client.service_client.config.target_host,
        namespace=dev_env.client.namespace,
        runtime=prometheus_runtime(f"127.0.0.1:{port}"),
        data_converter=pydantic_data_converter,
    )
    billing.fail_next("refunds", 1)  # one retry of issue_refund
    async with running_worker(client) as w:
        tq = w.task_queue
        approved = await start_run(client, w, make_request())
        snap = await wait_for_state(approved, "AWAITING_APPROVAL")
        assert snap.pending_approval is not None
        await approved.signal(
            "approve",
            ApprovalDecision(decision_id=uuid.uuid4().hex, approver="bob", plan_hash="f" * 64),
        )
        await asyncio.sleep(0.6)  # the approval wait the histogram must show
        await approved.signal(
            "approve",
            approval_for(snap, "bob"),
        )
        assert (await run_outcome(approved)).state == RunState.COMPLETED

        rejected = await start_run(client, w, make_request())
        snap = await wait_for_state(rejected, "AWAITING_APPROVAL")
        assert snap.pending_approval is not None
        # Five signal names a sender made up: counted, but never five new label values.
        for i in range(5):
            await rejected.signal(f"evil-{i}-{uuid.uuid4().hex[:6]}", {"x": i})
        await rejected.signal(
            "reject",
            approval_for(snap, "carol", reason="not this one"),
        )
        outcome: RunOutcome = await run_outcome(rejected)
        assert outcome.state == RunState.REJECTED

        q = {"task_queue": tq}
        # The SDK counts a completion once the worker has reported it, which may be just after the
        # client saw the result: read again for a few seconds until both are in.
        for _ in range(50):
            samples = scrape(port)
            if value(samples, "temporal_workflow_completed", **q) >= 2:
                break
            await asyncio.sleep(0.1)
        # Tether's run-level metrics.
        assert value(samples, "tether_runs_started", **q) == 2
        assert value(samples, "tether_runs_ended", state="COMPLETED", **q) == 1
        assert value(samples, "tether_runs_ended", state="REJECTED", **q) == 1
        assert value(samples, "tether_runs_ended", **q) == 2
        assert value(samples, "tether_approval_wait_seconds_count", outcome="APPROVED", **q) == 1
        assert value(samples, "tether_approval_wait_seconds_count", outcome="REJECTED", **q) == 1
        wait_sum = value(samples, "tether_approval_wait_seconds_sum", outcome="APPROVED", **q)
        assert 0.5 <= wait_sum < 30, wait_sum
        # The human-scale buckets, not latency ones.
        assert any(
            n == "tether_approval_wait_seconds_bucket" and lab.get("le") in ("3600", "3600.0")
            for n, lab, _ in samples
        )
        assert value(samples, "tether_decisions_refused", kind="approve", rule="stale_plan_hash", **q) == 1
        # Past REFUSALS_RECORDED of one rule a flood is counted on the run, not recorded: 3-5.
        unknown = value(samples, "tether_decisions_refused", kind="other", **q)
        assert 3 <= unknown <= 5, unknown
        assert value(samples, "tether_decisions_refused", **q) == 1 + unknown
        refused = [lab for n, lab, _ in samples if n.startswith("tether_decisions_refused")]
        assert {lab["kind"] for lab in refused} <= KINDS | {"other"}
        assert {lab["rule"] for lab in refused} <= RULES | {"other"}
        assert not any("evil" in v for n, lab, _ in samples for v in lab.values())
        # Tool calls and retries by tool and effect (activity side).
        calls = lambda tool, effect, outcome: value(  # noqa: E731
            samples, "tether_tool_calls", tool=tool, effect=effect, outcome=outcome, **q
        )
        assert calls("get_order", "read_only", "ok") == 1
        assert calls("issue_refund", "idempotent", "error") == 1
        assert calls("issue_refund", "idempotent", "ok") == 1
        assert calls("post_ledger_entry", "reconcilable", "ok") == 1
        assert calls("send_email", "unsafe", "ok") == 1
        assert value(samples, "tether_tool_calls", **q) == 5
        assert value(samples, "tether_tool_retries", tool="issue_refund", effect="idempotent", **q) == 1
        assert value(samples, "tether_tool_retries", **q) == 1
        # Temporal's own SDK metrics come from the same endpoint.
        assert value(samples, "temporal_workflow_completed", **q) >= 2
        assert value(samples, "temporal_activity_execution_failed", **q) >= 1


def test_worker_process_serves_metrics(dev_env, billing, tmp_path) -> None:
    port = free_port()
    policy = tmp_path / "fleet.toml"
    policy.write_text('[tenants.default]\ntools = ["get_order", "issue_refund"]\n')
    env = {
        **os.environ,
        "TEMPORAL_ADDRESS": dev_env.client.service_client.config.target_host,
        "TEMPORAL_NAMESPACE": dev_env.client.namespace,
        "TETHER_TASK_QUEUE": unique("tq-metrics"),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("TETHER_ENCRYPTION_KEY_FILE", None)
    proc = subprocess.Popen(
        # no host: loopback
        [sys.executable, "worker.py", "--metrics-port", str(port), "--policy", str(policy)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        line = proc.stdout.readline()
        deadline = time.monotonic() + 20
        while "worker ready" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert "worker ready" in line, line
        assert "payload encryption off" in line and f"http://127.0.0.1:{port}/metrics" in line
        # Which policy it reads, and its hash (the one its runs record): in the line and the metrics.
        digest = PolicyStore(policy).load()[1]
        assert f"; policy {policy} (sha256 {digest});" in line, line
        # The kernel's word: the one socket listening on the port is bound to 127.0.0.1 only.
        listening = [
            fields[1] for fields in (row.split() for row in Path("/proc/net/tcp").read_text().splitlines()[1:])
            if fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port
        ]
        assert listening == [f"0100007F:{port:04X}"], listening
        v6 = Path("/proc/net/tcp6").read_text().splitlines()[1:] if Path("/proc/net/tcp6").exists() else []
        assert not [r for r in v6 if r.split()[3] == "0A" and r.split()[1].endswith(f":{port:04X}")]
        names: set[str] = set()
        for _ in range(50):
            names = {n for n, _, _ in scrape(port)}
            if any(n.startswith("temporal_") for n in names):
                break
            time.sleep(0.1)
        assert any(n.startswith("temporal_") for n in names), sorted(names)
        info = [(labels, v) for n, labels, v in scrape(port) if n == "tether_policy_info"]
        assert [(labels.get("policy"), labels.get("hash"), v) for labels, v in info] == [
            (str(policy), digest, 1.0)], info
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_tracing_interceptor_when_otel_is_installed(dev_env, billing, monkeypatch) -> None:
    """The `otel` extra: Temporal's TracingInterceptor spans client, workflow and activities."""
    import pytest

    sdk_trace = pytest.importorskip("opentelemetry.sdk.trace", reason="needs the otel extra")
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tether.metrics import tracing_interceptors

    assert tracing_interceptors() == [] or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, sdk_trace.TracerProvider):
        provider = sdk_trace.TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setenv("TETHER_OTEL", "1")
    interceptors = tracing_interceptors()
    assert len(interceptors) == 1
    client = await tether_client.connect(
        target_host=dev_env.client.service_client.config.target_host,
        namespace=dev_env.client.namespace,
        interceptors=interceptors,
        data_converter=pydantic_data_converter,
    )
    async with running_worker(client) as w:
        handle = await start_run(
            client, w, make_request([{"tool": "get_order", "args": {"order_id": "A-1001"}}])
        )
        assert (await run_outcome(handle)).state == RunState.COMPLETED
    names = {span.name for span in exporter.get_finished_spans()}
    assert {"StartWorkflow:AgentRun", "RunWorkflow:AgentRun", "RunActivity:execute_tool"} <= names, names
