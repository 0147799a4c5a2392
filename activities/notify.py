"""Telling people a run needs them: the ``notify`` activity posts one event to webhooks.

Each webhook is named in the policy file (``[notify.webhooks.NAME]``: ``url``, ``events``,
``secret_file`` relative to the policy file, its content stripped). The body is JSON with a
Slack-compatible ``text`` field; with a secret, requests are signed the way Slack signs its own:

    X-Tether-Request-Timestamp: <unix seconds>
    X-Tether-Signature: v0=<hex HMAC-SHA256 over "v0:<timestamp>:<body>" with the secret>

so a receiver can refuse forgeries and replays (a stale timestamp, a body seen before). Every
request of one event carries the same ``X-Tether-Event-Id`` (the idempotency key): attempts are
retried with backoff and a receiver dedupes on it. A webhook already reached is not posted to
again (heartbeat details); on the last attempt the activity returns the webhooks still failing
instead of raising, so the run records them and goes on.

A delivery cannot slow anything else down: it is async I/O on the worker's event loop (host
names resolved on a small pool of its own, never the pool tools and the audit sink share), with
one total deadline for connecting, sending and reading the status and headers, however slowly
a receiver answers. Only a 2xx counts; a redirect is a failed delivery and is not followed.
Header values are percent-encoded outside printable ASCII (an id with CR/LF stays one header).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import re
import socket
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from temporalio import activity

from tether.policy.files import PolicyStore
from workflows.contract import ReadFound
from workflows.display import escape_text, show_value
from workflows.policy_file import Webhook
from workflows.wire import Notification, NotificationResult

log = logging.getLogger(__name__)

# Seconds one delivery may take in all: resolving, connecting, sending, the status and headers.
DELIVERY_DEADLINE = 5.0
MAX_RESPONSE_HEAD = 16 * 1024  # bytes of status line and headers read at most
# Host name lookups (getaddrinfo blocks): bounded, and apart from the default pool.
_RESOLVER = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tether-notify-dns")
# Printable ASCII but `%`: header values keep these, everything else is percent-encoded.
_HEADER_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")
# The Web UI the event's link points at (the worker's view of it).
WEB_UI_ENV = "TETHER_WEB_UI"
DEFAULT_WEB_UI = "http://localhost:8233"


def sign(secret: bytes, timestamp: int, body: bytes) -> str:
    """The signature header's value for ``body`` sent at ``timestamp``."""
    base = b"v0:" + str(timestamp).encode() + b":" + body
    return "v0=" + hmac.new(secret, base, hashlib.sha256).hexdigest()


def verify(secret: bytes, timestamp: str, body: bytes, signature: str, *, now: float, tolerance: float = 300) -> bool:
    """What a receiver checks (tests use it as one): a fresh timestamp and a matching signature."""
    try:
        fresh = abs(now - int(timestamp)) <= tolerance
    except ValueError:
        return False
    return fresh and hmac.compare_digest(sign(secret, int(timestamp), body), signature)


def link(event: Notification) -> str:
    """The run in the Web UI; its ids percent-encoded (a run id is anyone's text)."""
    base = os.environ.get(WEB_UI_ENV, DEFAULT_WEB_UI).rstrip("/")
    return f"{base}/namespaces/{quote(event.namespace, safe='')}/workflows/{quote(event.run_id, safe='')}"


def slack_text(value: object, limit: int | None = None) -> str:
    """Text for a Slack-compatible ``text`` field: escaped for a person (escape_text), then
    ``&``, ``<`` and ``>`` as Slack's entities, so no value can open link or mention markup."""
    return slack_entities(escape_text(value, limit))


def slack_entities(escaped: str) -> str:
    """Text already escaped for a person, with ``&``, ``<`` and ``>`` as Slack's entities."""
    return escaped.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def body(event: Notification) -> dict[str, Any]:
    """The JSON posted: ids, state, why (goal, who asked, on whose behalf, what the reads found
    and what each planned tool says it does) and what (the escaped risk summary: each write,
    money in words, effect in words), expiry, how to approve, a link."""
    url = link(event)
    expires = event.expires_at.isoformat() if event.expires_at else None
    parts = [f"*{event.event.replace('_', ' ')}*: run {slack_text(event.run_id, 200)} ({slack_text(event.tenant, 128)}) is {event.state}"]
    if event.goal:
        parts.append(f"goal: {slack_text(event.goal, 600)}")
    if event.requested_by:
        parts.append(f"asked by {asked_by(event)}")
    if event.summary:
        parts.append(slack_text(event.summary, 1000))
    parts.extend(f"{slack_text(name, 64)} does: {slack_text(said, 300)}" for name, said in event.tools.items())
    parts.extend(f"{slack_text(f.tool, 64)} found: {slack_entities(found_words(f))}" for f in event.found)
    if expires:
        parts.append(f"expires {expires}")
    if event.approve_command:
        parts.append(f"approve: {slack_text(event.approve_command, 500)}")
    parts.append(f"<{url}|open the run>")
    return {
        "text": " — ".join(parts),
        "event": event.event,
        "event_id": event.event_id,
        "run_id": event.run_id,
        "tenant": event.tenant,
        "state": event.state,
        "plan_hash": event.plan_hash,
        "request_id": event.request_id,
        "summary": escape_text(event.summary, 2000),
        "reason": escape_text(event.reason, 600),
        "expires_at": expires,
        "approve_command": event.approve_command,
        "goal": escape_text(event.goal, 600),
        "requested_by": escape_text(event.requested_by, 128),
        "requester_verified": event.requester_verified,
        "parent": event.parent,
        "parent_goal": escape_text(event.parent_goal, 600),
        "root": event.root,
        "found": [
            {
                "tool": escape_text(f.tool, 64),
                "args": {escape_text(k, 64): show_value(v, 120) for k, v in f.args.items()},
                "fields": {escape_text(k, 64): show_value(v, 120) for k, v in f.fields.items()},
                "money": {escape_text(k, 64): escape_text(v, 64) for k, v in f.money.items()},
            }
            for f in event.found
        ],
        "tools": {escape_text(name, 64): escape_text(said, 300) for name, said in event.tools.items()},
        "link": url,
    }


def found_words(found: ReadFound) -> str:
    """What a read found, as one escaped line: its arguments, then each field, money in words
    beside the raw value (``total_cents 49.99 EUR (4999)``, as the Web UI's details say it)."""
    args = ", ".join(f"{escape_text(k, 64)} {show_value(v, 120)}" for k, v in found.args.items())
    fields = ", ".join(
        f"{escape_text(k, 64)} {escape_text(found.money[k], 64)} ({show_value(v, 120)})" if k in found.money
        else f"{escape_text(k, 64)} {show_value(v, 120)}"
        for k, v in found.fields.items()
    )
    return (f"({args}) " if args else "") + (fields or "nothing shown here (tether status shows what it found)")


def asked_by(event: Notification) -> str:
    """Who asked (signed or claimed) and, for a child run, on whose behalf; for ``text``."""
    who = f"{slack_text(event.requested_by, 128)} ({'signed' if event.requester_verified else 'claimed'})"
    if event.root:
        who += f" on behalf of root run {slack_text(event.root, 200)}"
    if event.parent:
        who += f", for parent {slack_text(event.parent, 200)}: {slack_text(event.parent_goal, 300)}"
    return who


class NotifyActivities:
    def __init__(self, store: PolicyStore) -> None:
        self.store = store

    def _webhooks(self) -> dict[str, Webhook]:
        document, _ = self.store.load()
        return dict(document.notify.webhooks) if document else {}

    def _secret(self, hook: Webhook) -> bytes | None:
        if hook.secret_file is None:
            return None
        base = self.store.path.parent if self.store.path else Path.cwd()
        return (base / hook.secret_file).read_text().strip().encode()

    @activity.defn(name="notify")
    async def notify(self, event: Notification) -> NotificationResult:
        info = activity.info()
        details = info.heartbeat_details
        delivered: list[str] = list(details[0]) if details else []
        hooks = self._webhooks()
        payload = json.dumps(body(event), sort_keys=True).encode()
        dead: dict[str, str] = {}
        sends: dict[str, tuple[str, bytes | None]] = {}
        for name in event.webhooks:
            if name in delivered:
                continue
            hook = hooks.get(name)
            if hook is None:
                dead[name] = "not_configured"
                continue
            try:
                sends[name] = (hook.url, self._secret(hook))
            except OSError as e:
                dead[name] = f"secret_unreadable ({type(e).__name__})"
        # Side by side: each delivery has its own deadline, so the attempt takes one deadline.
        results = await asyncio.gather(*(deliver(url, payload, secret, event.event_id) for url, secret in sends.values()))
        for name, why in zip(sends, results):
            if why is None:
                delivered.append(name)
            else:
                dead[name] = why
                log.warning("notify %s: webhook %s failed (%s), attempt %d", event.event_id, name, why, info.attempt)
        if any(name in delivered for name in sends):
            activity.heartbeat(delivered)
        retryable = {n: w for n, w in dead.items() if w != "not_configured"}
        if retryable and info.attempt < event.max_attempts:
            raise RuntimeError(f"webhook(s) not reached: {', '.join(f'{n} ({w})' for n, w in retryable.items())}")
        return NotificationResult(delivered=delivered, dead=dead)


def header_value(value: str) -> str:
    """A header value as sent: printable ASCII as is, anything else (CR, LF, non-ASCII) and
    ``%`` percent-encoded, so no value can end its header or start another."""
    return quote(value, safe=_HEADER_SAFE)


async def deliver(url: str, payload: bytes, secret: bytes | None, event_id: str, *,
                  deadline: float = DELIVERY_DEADLINE) -> str | None:
    """POST once, within ``deadline`` seconds in all; None when the webhook took it (2xx),
    else why not (``http_302``, ``timeout``, the error's type)."""
    headers = {"Content-Type": "application/json", "X-Tether-Event-Id": header_value(event_id)}
    if secret is not None:
        timestamp = int(time.time())
        headers["X-Tether-Request-Timestamp"] = str(timestamp)
        headers["X-Tether-Signature"] = sign(secret, timestamp, payload)
    try:
        return await asyncio.wait_for(_post(url, payload, headers), deadline)
    except asyncio.TimeoutError:
        return "timeout"
    except (OSError, ssl.SSLError, UnicodeError, ValueError) as e:
        return type(e).__name__


async def _post(url: str, payload: bytes, headers: dict[str, str]) -> str | None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "unsupported_url"
    tls = parts.scheme == "https"
    host = parts.hostname.encode("idna").decode("ascii")
    port = parts.port or (443 if tls else 80)
    loop = asyncio.get_running_loop()
    found = await loop.run_in_executor(_RESOLVER, socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
    family, kind, proto, _, address = found[0]
    reader, writer = await asyncio.open_connection(
        str(address[0]), int(address[1]), family=family, proto=proto,
        ssl=ssl.create_default_context() if tls else None, server_hostname=host if tls else None,
        limit=MAX_RESPONSE_HEAD,
    )
    try:
        authority = f"[{host}]" if ":" in host else host
        if parts.port:
            authority += f":{parts.port}"
        target = quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~") + (f"?{parts.query}" if parts.query else "")
        lines = [f"POST {target} HTTP/1.1", f"Host: {authority}", "User-Agent: tether-notify",
                 f"Content-Length: {len(payload)}", "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + payload)
        await writer.drain()
        while True:
            status = await reader.readline()
            matched = re.match(rb"HTTP/1\.[01] (\d{3})[ \r\n]", status)
            if not matched:
                return "bad_response"
            code = int(matched.group(1))
            read = len(status)
            # The response is the webhook's answer once its headers are complete.
            while (line := await reader.readline()) not in (b"\r\n", b"\n"):
                read += len(line)
                if not line or read > MAX_RESPONSE_HEAD:
                    return "bad_response"
            if code >= 200:
                return None if code < 300 else f"http_{code}"
    finally:
        writer.close()
