"""The AgentDojo service's HTTP client (examples/agentdojo/service.py), for the tools and the
driver. The URL comes from ``AGENTDOJO_URL`` (default ``http://127.0.0.1:8766``)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

from tether.tools.sdk import ToolError

HTTP_TIMEOUT_SECONDS = 30.0


def service_url() -> str:
    return os.environ.get("AGENTDOJO_URL", "http://127.0.0.1:8766").rstrip("/")


# Talk to 127.0.0.1 directly even when the environment sets an HTTP proxy.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def call(method: str, path: str, body: dict | None = None, headers: dict | None = None, *,
         timeout: float = HTTP_TIMEOUT_SECONDS, base: str | None = None) -> Any:
    """One HTTP call; a 4xx is a permanent ToolError (our input), a 5xx or no answer a retryable
    one. ``timeout``: pass ``ctx.seconds_left()``; at 0 nothing is sent."""
    if timeout <= 0:
        raise ToolError(f"{method} {path}: not sent, the attempt's deadline has passed", code="deadline_exceeded")
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request((base or service_url()) + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with _opener.open(request, timeout=min(timeout, HTTP_TIMEOUT_SECONDS)) as response:
            return json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            detail = json.loads(e.read() or b"{}")
        except json.JSONDecodeError:
            detail = {}
        permanent = 400 <= e.code < 500 and e.code not in (408, 429)
        raise ToolError(f"{method} {path} -> {e.code} {detail.get('message', e.reason)}",
                        code=detail.get("error") or f"http_{e.code}", permanent=permanent) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        raise ToolError(f"{method} {path}: AgentDojo service unreachable at {base or service_url()} "
                        f"({getattr(e, 'reason', e)})", code="unreachable") from None
