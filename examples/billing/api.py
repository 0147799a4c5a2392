"""The billing example service's HTTP client, for tool modules (no tools here: importing it
registers nothing). The URL comes from ``BILLING_URL`` (default ``http://127.0.0.1:8765``)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

from tether.tools.sdk import ToolError

HTTP_TIMEOUT_SECONDS = 10.0


def billing_url() -> str:
    return os.environ.get("BILLING_URL", "http://127.0.0.1:8765").rstrip("/")


# Talk to 127.0.0.1 directly even when the environment sets an HTTP proxy.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def call(
    method: str,
    path: str,
    body: dict | None = None,
    headers: dict | None = None,
    *,
    timeout: float = HTTP_TIMEOUT_SECONDS,
) -> Any:
    """One HTTP call; maps failures to permanent (4xx) or retryable (5xx, network) errors.

    ``timeout``: pass ``ctx.seconds_left()``; at 0 the call is not sent at all.
    """
    if timeout <= 0:
        raise ToolError(f"{method} {path}: not sent, the attempt's deadline has passed", code="deadline_exceeded")
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        billing_url() + path,
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with _opener.open(request, timeout=min(timeout, HTTP_TIMEOUT_SECONDS)) as response:
            return json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            detail = json.loads(e.read() or b"{}")
        except json.JSONDecodeError:
            detail = {}
        code = detail.get("error") or f"http_{e.code}"
        message = f"{method} {path} -> {e.code} {detail.get('message', e.reason)}"
        # 408 and 429 are the client errors worth retrying; every other 4xx is our input.
        permanent = 400 <= e.code < 500 and e.code not in (408, 429)
        raise ToolError(message, code=code, permanent=permanent) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        reason = getattr(e, "reason", e)
        raise ToolError(
            f"{method} {path}: billing service unreachable at {billing_url()} ({reason})",
            code="unreachable",
        ) from None


