"""Notifications: a real local HTTP receiver that checks the signature the way a Slack app
checks Slack's, refuses replays, and a webhook that answers 500 forever."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest
import urllib.error
import urllib.request
from temporalio.testing import WorkflowEnvironment

from activities.notify import verify
from examples.fake_openai import call, tool_calls
from tests.helpers.fake_model import fake_model
from tether.policy.files import PolicyStore
from tether.client import run_outcome
from tests.helpers.billing import Billing
from tests.helpers.runs import approval_for, make_request, running_worker, start_run
from tests.helpers.waiting import wait_for_state
from tests.helpers.invariants import check_timeline, tools_by_call
from tests.helpers.replay import replays
from workflows.contract import DecideResult
from workflows.run_state import RunSnapshot
from workflows.states import RunState

S = RunState
SECRET = "s3cret-signing-key"
READ = {"tool": "get_order", "args": {"order_id": "A-1002"}}
REFUND = {"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 7000, "reason": "late <b>parcel</b>"}}


class Receiver:
    """Accepts a POST only with a fresh timestamp, a valid signature and a body not seen before."""

    def __init__(self, status: int | None = None) -> None:
        self.events: list[dict] = []
        self.raw: list[tuple[bytes, dict[str, str]]] = []
        self.refused: list[str] = []
        self.hits = 0
        self.answered = 0
        # Once ``hold()`` is called, each POST is kept unanswered until ``release()``.
        self._open = threading.Event()
        self._open.set()
        seen: set[str] = set()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.hits += 1
                outer._open.wait()
                if status is not None:
                    return self._answer(status)
                ts = self.headers.get("X-Tether-Request-Timestamp", "")
                sig = self.headers.get("X-Tether-Signature", "")
                if not verify(SECRET.encode(), ts, body, sig, now=time.time()):
                    outer.refused.append("bad_signature")
                    return self._answer(401)
                if sig in seen:
                    outer.refused.append("replay")
                    return self._answer(409)
                seen.add(sig)
                outer.raw.append((body, dict(self.headers)))
                outer.events.append(json.loads(body))
                self._answer(200)

            def _answer(self, code: int) -> None:
                outer.answered += 1
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receivers() -> Iterator[tuple[Receiver, Receiver]]:
    good, dead = Receiver(), Receiver(status=500)
    yield good, dead
    good.close()
    dead.close()


def post(url: str, body: bytes, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, data=body, method="POST", headers=headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_events_are_signed_replays_refused_and_a_dead_webhook_does_not_hold_the_run(
    ts_env: WorkflowEnvironment, billing: Billing, tmp_path: Path, receivers: tuple[Receiver, Receiver]
) -> None:
    await signed_events_and_a_dead_webhook(ts_env, tmp_path, receivers, "time-skipping")


async def test_a_dead_webhook_does_not_hold_the_run_in_real_time(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path, receivers: tuple[Receiver, Receiver]
) -> None:
    # On the dev server the webhook's backoff takes real time: the steps still do not wait.
    await signed_events_and_a_dead_webhook(dev_env, tmp_path, receivers, "dev server")


async def signed_events_and_a_dead_webhook(
    ts_env: WorkflowEnvironment, tmp_path: Path, receivers: tuple[Receiver, Receiver], server: str
) -> None:
    good, dead = receivers
    # Every delivery to the dead webhook stays unanswered until the run's steps are done: they
    # cannot have waited for it.
    dead.hold()
    (tmp_path / "ops.secret").write_text(f"  {SECRET}\n")
    policy = tmp_path / "policy.toml"
    policy.write_text(
        '[tenants.default]\n[tenants.default.approvers]\nbob = { roles = ["approver"] }\n'
        f'[notify.webhooks.ops]\nurl = "{good.url}"\nevents = ["awaiting_approval", "revised"]\nsecret_file = "ops.secret"\n'
        f'[notify.webhooks.pager]\nurl = "{dead.url}"\nevents = ["awaiting_approval"]\n'
    )
    async with running_worker(ts_env.client, policy=PolicyStore.from_env(str(policy))) as worker:
        goal = "Refund A-1002: late <parcel> \x1b[2J & more"
        handle = await start_run(ts_env.client, worker, make_request([READ, REFUND], goal=goal))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await until(lambda: good.events)
        event = good.events[0]
        # The why beside the what, in the signed body: the goal (escaped), who asked, and each
        # write with its money and its effect in words.
        assert event["goal"] == "Refund A-1002: late <parcel> \\x1b[2J & more", event["goal"]
        assert (event["requested_by"], event["requester_verified"], event["root"]) == ("alice", False, None)
        assert "goal: Refund A-1002: late &lt;parcel&gt; \\x1b[2J &amp; more" in event["text"], event["text"]
        assert "asked by alice (claimed)" in event["text"] and "\x1b" not in event["text"]
        assert "issue_refund (can be undone by void_refund" in event["summary"], event["summary"]
        # What each planned tool says it does (the lookup has not run: nothing found yet).
        assert event["tools"]["issue_refund"] == "Refund (part of) an order to the customer's payment method.", event["tools"]
        assert "issue_refund does: Refund (part of) an order" in event["text"] and event["found"] == []
        pending = snap.pending_approval
        assert event["event"] == "awaiting_approval" and event["run_id"] == handle.id
        assert (event["tenant"], event["state"], event["plan_hash"], event["request_id"]) == (
            "default", "AWAITING_APPROVAL", pending.plan_hash, pending.request_id
        )
        assert event["expires_at"] == pending.expires_at.isoformat()
        assert event["approve_command"] == f"tether approve {handle.id} --by NAME --plan-hash {pending.plan_hash[:12]}"
        assert event["link"].endswith(f"/workflows/{handle.id}") and event["link"] in event["text"]
        # Values only as the tools' declared summary fields (order, amount): never the reason text.
        assert "amount_cents=70.00 EUR (7000)" in event["summary"] and "parcel</b>" not in json.dumps(event)
        assert event["text"].startswith("*awaiting approval*: run ")

        # The very same request again (a replay) and a forged one: the receiver refuses both.
        body, headers = good.raw[0]
        sent = {k: v for k, v in headers.items() if k.lower().startswith("x-tether") or k == "Content-Type"}
        assert post(good.url, body, sent) == 409
        assert post(good.url, body.replace(b"AWAITING", b"APPROVED_"), sent) == 401
        assert good.refused == ["replay", "bad_signature"]

        # The dead webhook's delivery is held meanwhile; the run does not wait for it.
        decided = time.monotonic()
        verdict = await handle.execute_update(
            "decide", {"kind": "approve", **approval_for(snap, "bob").model_dump(exclude_none=True)},
            result_type=DecideResult,
        )
        assert verdict.state == S.APPROVED
        done = await wait_for_state(handle, "COMPLETED")
        ran = time.monotonic() - decided
        assert done.step == 2 and dead.hits >= 1 and dead.answered == 0, (
            f"the steps waited for the webhook ({dead.hits} deliveries, {dead.answered} answered)")
        # Answered now (500, or the attempt's own deadline had passed): the run's result comes
        # once the notification has been retried with backoff and given up.
        dead.release()
        outcome = await run_outcome(handle)
        ended = time.monotonic() - decided
        await replays(handle)  # the notify activities started alongside the run replay too
    print(f"\n[{server}] approve -> COMPLETED {ran:.2f}s, -> result {ended:.2f}s")
    assert dead.hits == 4, "retried with backoff, then given up"
    [failed] = [r for r in outcome.timeline if r.kind == "notify_failed"]
    assert failed.rule == "awaiting_approval" and ("pager (http_500)" in failed.reason or "pager (timeout)" in failed.reason), failed.reason
    assert len(good.events) == 1, "one delivery per event, however often the other webhook was retried"
    check_timeline(outcome.timeline, tools_by_call(outcome))


async def test_the_request_says_what_the_lookup_found_and_what_each_tool_does(
    ts_env: WorkflowEnvironment, billing: Billing, tmp_path: Path, receivers: tuple[Receiver, Receiver],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model looks order A-1002 up (a read: it runs before anyone is asked), then proposes a
    refund. The approval request's event says what the lookup found as the Web UI's details do
    (the fields the tool names and its money, in words: never the customer's email, which stays in
    the signed view) and what each planned tool says it does."""
    good, _ = receivers
    (tmp_path / "ops.secret").write_text(SECRET)
    policy = tmp_path / "policy.toml"
    policy.write_text(
        '[tenants.default]\n[tenants.default.approvers]\nbob = { roles = ["approver"] }\n'
        f'[notify.webhooks.ops]\nurl = "{good.url}"\nevents = ["awaiting_approval"]\nsecret_file = "ops.secret"\n'
    )
    with fake_model(monkeypatch) as fake:
        fake.script(
            tool_calls(call("get_order", {"order_id": "A-1002"})),
            tool_calls(call("issue_refund", {"order_id": "A-1002", "amount_cents": 7000, "reason": "late <b>parcel</b>"})),
        )
        async with running_worker(ts_env.client, policy=PolicyStore.from_env(str(policy))) as worker:
            handle = await start_run(ts_env.client, worker, make_request([], planner="model", goal="Refund A-1002"))
            await wait_for_state(handle, "AWAITING_APPROVAL")
            await until(lambda: good.events)
    [event] = good.events
    assert event["event"] == "awaiting_approval"
    assert event["found"] == [{"tool": "get_order", "args": {}, "fields": {"total_cents": "12000"},
                               "money": {"total_cents": "120.00 EUR"}}], event["found"]
    assert "get_order found: total_cents 120.00 EUR (12000)" in event["text"], event["text"]
    assert "grace@example.com" not in json.dumps(event)
    assert event["tools"] == {"issue_refund": "Refund (part of) an order to the customer's payment method."}, event["tools"]
    assert "issue_refund does: Refund (part of) an order to the customer's payment method." in event["text"], event["text"]


async def test_an_escalation_stage_tells_its_webhooks_and_the_expiry_is_told_last(
    ts_env: WorkflowEnvironment, billing: Billing, tmp_path: Path, receivers: tuple[Receiver, Receiver]
) -> None:
    good, _ = receivers
    (tmp_path / "ops.secret").write_text(SECRET)
    policy = tmp_path / "policy.toml"
    policy.write_text(
        '[tenants.default]\n[tenants.default.approval_ttl_seconds]\nnormal = 10800\n'
        '[tenants.default.escalation]\nnormal = [{ after = "1h", notify = ["ops"] }, { after = "3h", notify = ["ops"] }]\n'
        # ops takes expiries itself; escalations only because the stage names it.
        f'[notify.webhooks.ops]\nurl = "{good.url}"\nevents = ["expired"]\nsecret_file = "ops.secret"\n'
    )
    async with running_worker(ts_env.client, policy=PolicyStore.from_env(str(policy))) as worker:
        handle = await start_run(ts_env.client, worker, make_request([READ, REFUND]))
        outcome = await run_outcome(handle)  # time skips: 1 h escalation, 3 h expiry
    assert outcome.state == S.EXPIRED
    await until(lambda: len(good.events) >= 2)
    assert [e["event"] for e in good.events] == ["escalated", "expired"], "the 3 h stage is the expiry's: dropped"
    escalated, expired = good.events
    assert escalated["state"] == "AWAITING_APPROVAL" and "stage 1/1" in escalated["reason"]
    assert escalated["approve_command"] and escalated["expires_at"]
    assert expired["state"] == "EXPIRED" and expired["approve_command"] is None
    assert escalated["event_id"] != expired["event_id"]
    check_timeline(outcome.timeline, tools_by_call(outcome))


def test_what_a_request_says_it_found_and_each_tools_words_reach_the_receiver_escaped() -> None:
    """Every text in ``found`` and ``tools`` is someone's (a tool's result, its author's words, or
    whoever answered the workflow task that scheduled the notification): the body escapes each,
    and ``text`` shows none as Slack markup."""
    from activities.notify import body
    from workflows.contract import ReadFound
    from workflows.wire import Notification

    hostile = "<!here> \x1b[2J\u202e"
    event = Notification(
        event_id="r:1:3", event="awaiting_approval", webhooks=["ops"], run_id="r", tenant="default",
        state="AWAITING_APPROVAL",
        found=[ReadFound(tool=f"get{hostile}", args={f"id{hostile}": hostile}, fields={"total": 5, "note": hostile},
                         money={"total": f"5 {hostile}"})],
        tools={f"refund{hostile}": f"Refunds.{hostile}"},
    )
    sent = body(event)
    flat = json.dumps(sent, ensure_ascii=False)
    for raw in ("\x1b", "\u202e"):
        assert raw not in flat, flat
    assert "<!here>" not in sent["text"] and "&lt;!here&gt;" in sent["text"], sent["text"]
    [found] = sent["found"]
    assert found["money"] == {"total": "5 <!here> \\x1b[2J\\u202e"}, found
    assert found["fields"] == {"total": "5", "note": '"<!here> \\x1b[2J\\u202e"'}, found
    assert sent["tools"] == {"refund<!here> \\x1b[2J\\u202e": "Refunds.<!here> \\x1b[2J\\u202e"}, sent["tools"]
