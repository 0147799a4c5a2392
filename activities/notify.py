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
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from temporalio import activity

from activities.policy import PolicyStore
from workflows.display import escape_text, markdown_text
from workflows.models import Notification, NotificationResult, Webhook

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 5.0  # seconds per POST
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
    base = os.environ.get(WEB_UI_ENV, DEFAULT_WEB_UI).rstrip("/")
    return f"{base}/namespaces/{event.namespace}/workflows/{event.run_id}"


def body(event: Notification) -> dict:
    """The JSON posted: ids, state, the escaped summary, expiry, how to approve, a link."""
    url = link(event)
    expires = event.expires_at.isoformat() if event.expires_at else None
    parts = [f"*{event.event.replace('_', ' ')}*: run {markdown_text(event.run_id, 200)} ({markdown_text(event.tenant, 128)}) is {event.state}"]
    if event.summary:
        parts.append(markdown_text(event.summary, 1000))
    if expires:
        parts.append(f"expires {expires}")
    if event.approve_command:
        parts.append(f"approve: {markdown_text(event.approve_command, 500)}")
    parts.append(url)
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
        "link": url,
    }


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
        for name in event.webhooks:
            if name in delivered:
                continue
            hook = hooks.get(name)
            if hook is None:
                dead[name] = "not_configured"
                continue
            try:
                secret = self._secret(hook)
            except OSError as e:
                dead[name] = f"secret_unreadable ({type(e).__name__})"
                continue
            why = await asyncio.to_thread(_post, hook.url, payload, secret, event.event_id)
            if why is None:
                delivered.append(name)
                activity.heartbeat(delivered)
            else:
                dead[name] = why
                log.warning("notify %s: webhook %s failed (%s), attempt %d", event.event_id, name, why, info.attempt)
        retryable = {n: w for n, w in dead.items() if w != "not_configured"}
        if retryable and info.attempt < event.max_attempts:
            raise RuntimeError(f"webhook(s) not reached: {', '.join(f'{n} ({w})' for n, w in retryable.items())}")
        return NotificationResult(delivered=delivered, dead=dead)


def _post(url: str, payload: bytes, secret: bytes | None, event_id: str) -> str | None:
    """POST once; None when the webhook took it (2xx), else why not (status or error type)."""
    headers = {"Content-Type": "application/json", "X-Tether-Event-Id": event_id}
    if secret is not None:
        timestamp = int(time.time())
        headers["X-Tether-Request-Timestamp"] = str(timestamp)
        headers["X-Tether-Signature"] = sign(secret, timestamp, payload)
    request = urllib.request.Request(url, data=payload, method="POST", headers=headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=REQUEST_TIMEOUT) as response:
            return None if 200 <= response.status < 300 else f"http_{response.status}"
    except urllib.error.HTTPError as e:
        return f"http_{e.code}"
    except (urllib.error.URLError, OSError) as e:
        return type(getattr(e, "reason", e)).__name__
