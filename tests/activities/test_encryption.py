"""Payload encryption, end to end on the dev server.

One refund run goes through ``client.connect`` with ``TETHER_ENCRYPTION_KEY_FILE`` set (one
refund attempt fails, so a failure is in history too). Then:

- the raw history (read straight from the frontend, no codec) holds ciphertext for the input,
  every activity input and result, the signals, the failure message and the result, and no
  plaintext of the goal, the email address, the comment or the error;
- search attributes stay plain and hold only the run state and the tenant id;
- the Replayer replays the history with the codec;
- the codec server (a real process) decodes it for the Web UI's origin with the token, and
  refuses other origins, a missing or wrong token;
- after a key rotation (new key on top, old key kept) the old run still decodes, new data uses
  the new key, and without the old key it does not decode.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from google.protobuf import json_format
from temporalio.api.common.v1 import Payload, WorkflowExecution
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import History
from temporalio.api.workflowservice.v1 import GetWorkflowExecutionHistoryRequest
from temporalio.client import Client
from worker import create_replayer

import tether.client as tether_client
from tether.store.codec import (
    ENCODING,
    KEY_FILE_ENV,
    EncryptionCodec,
    KeyFileError,
    Keyring,
    data_converter,
    new_key_line,
)
from tether.client import run_outcome
from tests.helpers.ports import free_port
from tests.helpers.billing import Billing
from tests.helpers.runs import approval_for, make_request, running_worker, start_run
from tests.helpers.waiting import wait_for_state
from workflows.agent_run import AgentRun
from workflows.published import SEARCH_ATTRIBUTES
from workflows.run_state import RunOutcome
from workflows.states import RunState

ROOT = Path(__file__).resolve().parents[2]
UI_ORIGIN = "http://localhost:8233"
TOKEN = "s3cret-codec-token"
# The failure type (error code, e.g. "injected_fault") stays plain like every error code: only
# messages and stack traces are payloads.
SECRETS = [b"Refund order A-1001", b"ada@example.com", b"damaged on arrival", b"checked-xyzzy", b"injected 503"]
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class Keys:
    v1: Path  # k1 only: the run is written with it
    rotated: Path  # k2 (active), k1 (decrypt only)
    only_new: Path  # k2 only: old runs no longer decode


@dataclass
class EncryptedRun:
    client: Client
    run_id: str
    history: History


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    d = tmp_path_factory.mktemp("keys")
    k1, k2 = new_key_line("k1"), new_key_line("k2")
    (d / "v1.keys").write_text(f"# first key\n{k1}\n")
    (d / "rotated.keys").write_text(f"{k2}\n{k1}  # retired: decrypt only\n")
    (d / "k2.keys").write_text(k2 + "\n")
    return Keys(d / "v1.keys", d / "rotated.keys", d / "k2.keys")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def encrypted_run(dev_env, billing_service: Billing, keys: Keys) -> AsyncIterator[EncryptedRun]:
    previous = os.environ.get(KEY_FILE_ENV)
    os.environ[KEY_FILE_ENV] = str(keys.v1)
    try:
        client = await tether_client.connect(
            target_host=dev_env.client.service_client.config.target_host,
            namespace=dev_env.client.namespace,
        )
    finally:
        if previous is None:
            os.environ.pop(KEY_FILE_ENV)
        else:
            os.environ[KEY_FILE_ENV] = previous
    assert isinstance(client.data_converter.payload_codec, EncryptionCodec)
    billing_service.fail_next("refunds", 1)
    async with running_worker(client) as w:
        handle = await start_run(client, w, make_request(tenant="acme"))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert snap.pending_approval is not None  # queries decode through the codec too
        await handle.signal(
            "approve",
            approval_for(snap, "bob", comment="checked-xyzzy"),
        )
        outcome = await run_outcome(handle)
        assert outcome.state == RunState.COMPLETED, outcome.timeline
        assert outcome.steps[-1].tool == "send_email" and outcome.steps[-1].status == "ok"
    raw = await client.workflow_service.get_workflow_execution_history(
        GetWorkflowExecutionHistoryRequest(
            namespace=client.namespace, execution=WorkflowExecution(workflow_id=handle.id)
        )
    )
    yield EncryptedRun(client=client, run_id=handle.id, history=raw.history)


def _encrypted(payload: Payload, key_id: str = "k1") -> bool:
    return (
        payload.metadata.get("encoding") == ENCODING
        and payload.metadata.get("encryption-key-id") == key_id.encode()
    )


def _events(history: History, kind: int) -> list[Any]:
    return [e for e in history.events if e.event_type == kind]


async def test_history_holds_ciphertext(encrypted_run: EncryptedRun) -> None:
    history = encrypted_run.history
    blob = history.SerializeToString()
    for secret in SECRETS:
        assert secret not in blob, secret

    (started,) = _events(history, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED)
    attrs = started.workflow_execution_started_event_attributes
    assert attrs.input.payloads and all(_encrypted(p) for p in attrs.input.payloads)

    scheduled = _events(history, EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED)
    tool_calls = [
        e for e in scheduled if e.activity_task_scheduled_event_attributes.activity_type.name == "execute_tool"
    ]
    assert len(tool_calls) == 5  # 4 tools + one retry
    for e in scheduled:  # tool calls, planner, catalog, policy checks: every activity input
        assert all(_encrypted(p) for p in e.activity_task_scheduled_event_attributes.input.payloads)
    completed = _events(history, EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED)
    assert len(completed) == len(scheduled) - 1  # all but the failed attempt
    for e in completed:
        assert all(_encrypted(p) for p in e.activity_task_completed_event_attributes.result.payloads)

    (signaled,) = _events(history, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)
    assert signaled.workflow_execution_signaled_event_attributes.signal_name == "approve"
    assert all(_encrypted(p) for p in signaled.workflow_execution_signaled_event_attributes.input.payloads)

    (failed,) = _events(history, EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED)
    failure = failed.activity_task_failed_event_attributes.failure
    assert failure.message == "Encoded failure" and not failure.stack_trace
    assert _encrypted(failure.encoded_attributes)

    (done,) = _events(history, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED)
    assert all(_encrypted(p) for p in done.workflow_execution_completed_event_attributes.result.payloads)

    # Search attributes are never encrypted: they hold only the state and the tenant id.
    indexed = [attrs.search_attributes.indexed_fields] + [
        e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
        for e in _events(history, EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES)
    ]
    # Plus Temporal's own TemporalChangeVersion, which workflow.patched() maintains.
    names = {key.name for key in SEARCH_ATTRIBUTES} | {"TemporalChangeVersion"}
    states = {s.value for s in RunState}
    for fields in indexed:
        assert set(fields) <= names
        for name, payload in fields.items():
            assert payload.metadata.get("encoding") == b"json/plain"
            value = json.loads(payload.data)
            if name != "TemporalChangeVersion":
                assert value in (states if name == "AgentRunState" else {"acme"}), (name, value)


async def test_replayer_replays_with_the_codec(encrypted_run: EncryptedRun) -> None:
    handle = encrypted_run.client.get_workflow_handle(encrypted_run.run_id)
    history = await handle.fetch_history()
    replayer = create_replayer(data_converter=encrypted_run.client.data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert result.replay_failure is None


def _call(url: str, method: str, body: dict | None = None, headers: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with _opener.open(req, timeout=5) as r:
            raw = r.read()
            return r.status, dict(r.headers), json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, dict(e.headers), json.loads(raw) if raw else None


@pytest.fixture(scope="module")
def codec_server(keys: Keys, tmp_path_factory: pytest.TempPathFactory):
    token_file = tmp_path_factory.mktemp("codec") / "token"
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != KEY_FILE_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether.store.codec", "--port", str(port), "--key-file", str(keys.rotated),
         "--origin", UI_ORIGIN, "--token-file", str(token_file)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while True:
        try:
            if _call(url + "/health", "GET")[0] == 200:
                break
        except OSError:
            pass
        assert proc.poll() is None, "codec server exited"
        assert time.monotonic() < deadline, "codec server did not start"
        time.sleep(0.1)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_codec_server_decodes_for_the_ui_only(encrypted_run: EncryptedRun, codec_server: str) -> None:
    (started,) = _events(encrypted_run.history, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED)
    body = json_format.MessageToDict(started.workflow_execution_started_event_attributes.input)
    ui = {"Origin": UI_ORIGIN, "X-Namespace": "default", "Authorization": f"Bearer {TOKEN}"}

    # The browser's preflight, then the call itself.
    status, headers, _ = _call(
        codec_server + "/decode", "OPTIONS",
        headers={"Origin": UI_ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type,x-namespace"},
    )
    assert status == 204 and headers["Access-Control-Allow-Origin"] == UI_ORIGIN
    assert "authorization" in headers["Access-Control-Allow-Headers"].lower()
    assert "x-namespace" in headers["Access-Control-Allow-Headers"].lower()

    status, headers, decoded = _call(codec_server + "/decode", "POST", body, ui)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == UI_ORIGIN
    (payload,) = decoded["payloads"]
    assert base64.b64decode(payload["metadata"]["encoding"]) == b"json/plain"
    request = json.loads(base64.b64decode(payload["data"]))
    assert request["goal"] == "Refund order A-1001" and request["tenant"] == "acme"

    # Other origins, a missing or a wrong token: refused, nothing decoded.
    for headers_sent, expected in [
        ({**ui, "Origin": "http://evil.example"}, 403),
        ({k: v for k, v in ui.items() if k != "Authorization"}, 401),
        ({**ui, "Authorization": "Bearer wrong"}, 401),
    ]:
        status, headers, reply = _call(codec_server + "/decode", "POST", body, headers_sent)
        assert status == expected, headers_sent
        assert "payloads" not in (reply or {})
    status, headers, _ = _call(
        codec_server + "/decode", "OPTIONS",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert status == 403 and "Access-Control-Allow-Origin" not in headers

    # /encode uses the active (newest) key; /decode reads it back.
    plain = {"payloads": [{"metadata": {"encoding": base64.b64encode(b"json/plain").decode()},
                           "data": base64.b64encode(b'"hello"').decode()}]}
    status, _, encoded = _call(codec_server + "/encode", "POST", plain, ui)
    assert status == 200
    assert base64.b64decode(encoded["payloads"][0]["metadata"]["encryption-key-id"]) == b"k2"
    status, _, back = _call(codec_server + "/decode", "POST", encoded, ui)
    assert status == 200 and back == plain


async def test_rotated_key_still_decrypts_old_runs(encrypted_run: EncryptedRun, keys: Keys) -> None:
    rotated = data_converter(EncryptionCodec(Keyring.load(keys.rotated)))
    client = Client(
        encrypted_run.client.service_client,
        namespace=encrypted_run.client.namespace,
        data_converter=rotated,
    )
    # The result itself (no worker runs here to answer the steps and timeline queries).
    outcome = await client.get_workflow_handle(encrypted_run.run_id, result_type=RunOutcome).result()
    assert outcome.state == RunState.COMPLETED and outcome.steps_executed == 4
    # New data is written with the new key.
    (fresh,) = await rotated.encode(["new"])
    assert _encrypted(fresh, "k2")
    # Without the retired key the old run cannot be read: keep retired keys while histories exist.
    (started,) = _events(encrypted_run.history, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED)
    only_new = EncryptionCodec(Keyring.load(keys.only_new))
    with pytest.raises(ValueError, match="k1"):
        await only_new.decode(list(started.workflow_execution_started_event_attributes.input.payloads))


def test_key_file_errors_are_explicit(tmp_path: Path) -> None:
    for text, message in [
        ("", "holds no key"),
        ("k1:not-base64!", "not base64"),
        ("k1:" + base64.b64encode(b"short").decode(), "32"),
        ("no separator", "KEY_ID:BASE64KEY"),
        (new_key_line("k1") + "\n" + new_key_line("k1"), "twice"),
    ]:
        with pytest.raises(KeyFileError, match=message):
            Keyring.parse(text)
    with pytest.raises(KeyFileError, match="cannot read"):
        Keyring.load(tmp_path / "missing.keys")
    out = subprocess.run(
        [sys.executable, "-m", "tether.store.codec", "genkey", "--if-missing", str(tmp_path / "new.keys")],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )
    assert out.stdout == ""
    assert oct((tmp_path / "new.keys").stat().st_mode & 0o777) == "0o600"
    assert len(Keyring.load(tmp_path / "new.keys").keys) == 1
