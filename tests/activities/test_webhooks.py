"""A webhook cannot slow anything down: real local HTTP servers (one that answers a header line
every 3 s, one that redirects, one that records what it got) against ``activities.notify`` and,
on the dev server, against runs that notify them while an unrelated run goes on."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from activities.notify import body, deliver
from tether.policy.files import PolicyStore
from tether.client import run_outcome
from tests.helpers.billing import Billing
from tests.helpers.queries import timeline
from tests.helpers.runs import make_request, running_worker, start_run
from tests.helpers.waiting import wait_for_state
from workflows.wire import Notification
from workflows.run_state import RunOutcome

READ = {"tool": "get_order", "args": {"order_id": "A-1002"}}
REFUND = {"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 7000, "reason": "late"}}


class Trickler:
    """Reads a request, answers ``HTTP/1.1 200 OK`` and then one header line every ``every``
    seconds, never ending its headers: a socket timeout per read never trips on it."""

    def __init__(self, every: float = 3.0) -> None:
        self.every = every
        self.opened = 0
        self.open = 0
        self.lock = threading.Condition()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        self.stopping = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with self.lock:
            self.opened += 1
            self.open += 1
            self.lock.notify_all()
        try:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            n = 0
            while not self.stopping.wait(self.every):
                n += 1
                conn.sendall(f"X-Slow-{n}: {n}\r\n".encode())
        except OSError:
            pass  # the client gave up and closed
        finally:
            conn.close()
            with self.lock:
                self.open -= 1

    def wait_open(self, count: int, *, opened: int = 0, timeout: float = 60.0) -> None:
        """Until ``count`` deliveries are held open at once, after ``opened`` in all."""
        with self.lock:
            assert self.lock.wait_for(lambda: self.open >= count and self.opened >= opened, timeout), (
                f"{self.open} of {count} deliveries open, {self.opened} of {opened} made")

    def close(self) -> None:
        self.stopping.set()
        self.sock.close()


class Recorder:
    """Answers every POST with ``status`` (a redirect to ``location`` when given) and records
    each request's headers and body."""

    def __init__(self, status: int = 200, location: str | None = None) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                outer.requests.append((self.command, dict(self.headers), self.rfile.read(length)))
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_POST = do_GET = _any  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers() -> Iterator[tuple[Trickler, Recorder]]:
    trickler, recorder = Trickler(), Recorder()
    yield trickler, recorder
    trickler.close()
    recorder.close()


async def test_one_delivery_has_one_total_deadline_redirects_fail_and_headers_are_encoded(
    servers: tuple[Trickler, Recorder],
) -> None:
    trickler, recorder = servers
    trickler.every = 0.2  # a header line well inside any per-read timeout
    assert await deliver(trickler.url, b"{}", None, "e-1", deadline=1.0) == "timeout"

    # A redirect is a failed delivery; the place it points to is never asked.
    redirect = Recorder(status=302, location=recorder.url)
    try:
        assert await deliver(redirect.url, b"{}", b"secret", "e-2") == "http_302"
        assert len(redirect.requests) == 1 and recorder.requests == []
    finally:
        redirect.close()

    # An id with CR/LF is one header, percent-encoded; no header is injected.
    assert await deliver(recorder.url, b'{"a": 1}', None, "run\r\nX-Injected: yes\u00e9%") is None
    [(method, headers, sent)] = recorder.requests
    assert method == "POST" and sent == b'{"a": 1}'
    assert headers["X-Tether-Event-Id"] == "run%0D%0AX-Injected: yes%C3%A9%25"
    assert "X-Injected" not in headers


def test_slack_text_escapes_markup_and_the_link_is_percent_encoded() -> None:
    event = Notification(
        event_id="e", event="awaiting_approval", webhooks=["ops"], run_id="r<@U1>&x|<!here>", tenant="t&<b>",
        state="AWAITING_APPROVAL", summary="refund <https://evil.example|click> & more",
        approve_command="tether approve 'r<@U1>&x|<!here>' --by NAME",
    )
    sent = body(event)
    text = sent["text"]
    assert "<@U1>" not in text and "<!here>" not in text and "<https://evil" not in text
    assert "r&lt;@U1&gt;&amp;x|&lt;!here&gt;" in text and "(t&amp;&lt;b&gt;)" in text
    assert "refund &lt;https://evil.example|click&gt; &amp; more" in text
    assert sent["link"].endswith("/workflows/r%3C%40U1%3E%26x%7C%3C%21here%3E")
    # The one markup left is the link itself, whose text holds none of the sender's.
    assert text.count("<") == 1 and text.endswith(f"<{sent['link']}|open the run>")


def _policy(tmp_path: Path, url: str) -> PolicyStore:
    policy = tmp_path / "policy.toml"
    policy.write_text(
        '[tenants.default]\n[tenants.default.approvers]\nbob = { roles = ["approver"] }\n'
        f'[notify.webhooks.slow]\nurl = "{url}"\nevents = ["awaiting_approval"]\n'
    )
    return PolicyStore.from_env(str(policy))


async def test_four_runs_notifying_a_trickling_webhook_do_not_slow_an_unrelated_run(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path, servers: tuple[Trickler, Recorder],
) -> None:
    trickler, _ = servers
    async with running_worker(dev_env.client, policy=_policy(tmp_path, trickler.url)) as worker:
        waiting = [await start_run(dev_env.client, worker, make_request([READ, REFUND])) for _ in range(4)]
        # All four deliveries in flight, each held open by the trickling webhook, and each run
        # has tried again already (a delivery that outlived its attempt would still hold a thread).
        await asyncio.to_thread(trickler.wait_open, 4, opened=8)
        read_only = await start_run(dev_env.client, worker, make_request([READ]))
        outcome = await run_outcome(dev_env.client.get_workflow_handle(read_only.id, result_type=RunOutcome))
        assert outcome.state.value == "COMPLETED" and [s.status for s in outcome.steps] == ["ok"]
        moves = [(r.from_state.value, r.to_state.value) for r in outcome.timeline if r.kind == "transition"]
        assert not [m for m in moves if "RETRY_WAIT" in m], moves  # its tool call was never held up
        assert ("EXECUTING_TOOL", "OBSERVING_RESULT") in moves

        # Each delivery ends at its deadline; after its retries the run records the webhook dead.
        first = waiting[0]
        loop = asyncio.get_running_loop()
        give_up = loop.time() + 120
        while not (failed := [r for r in await timeline(first) if r.kind == "notify_failed"]):
            assert loop.time() < give_up, "the trickling webhook kept its delivery alive"
            await asyncio.sleep(0.5)
        assert "slow (timeout)" in failed[0].reason
        for handle in waiting:
            snap = await wait_for_state(handle, "AWAITING_APPROVAL")
            assert snap.approved_by == []
            await handle.cancel()


async def test_a_run_id_with_cr_lf_is_notified(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path, servers: tuple[Trickler, Recorder],
) -> None:
    _, recorder = servers
    async with running_worker(dev_env.client, policy=_policy(tmp_path, recorder.url)) as worker:
        run_id = f"crlf-{time.monotonic_ns()}\r\nX-Injected: yes"
        handle = await start_run(dev_env.client, worker, make_request([READ, REFUND]), run_id=run_id)
        await wait_for_state(handle, "AWAITING_APPROVAL")
        loop = asyncio.get_running_loop()
        give_up = loop.time() + 60
        while not recorder.requests:
            assert loop.time() < give_up, "no notification arrived"
            await asyncio.sleep(0.1)
        _, headers, sent = recorder.requests[0]
        event = json.loads(sent)
        assert event["run_id"] == run_id and "X-Injected" not in headers
        assert headers["X-Tether-Event-Id"].startswith(run_id.split("\r")[0] + "%0D%0AX-Injected: yes")
        await handle.cancel()
