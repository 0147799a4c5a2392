"""What the inbox asks of every request before a route sees it: its security headers, a body
size cap, the loopback host for the dev sign-in, and same-origin posts.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

SECURITY_HEADERS = {
    # No inline script or style anywhere: only the inbox's own static files.
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
    "Cross-Origin-Opener-Policy": "same-origin",
}
# A decision is a few fields and a comment of at most 2,000 characters.
MAX_BODY_BYTES = 64 * 1024


class BodyLimit:
    """Refuse a request body over ``limit`` bytes (413) before the app reads it: by its
    Content-Length at once, and by counting as it streams in (chunked, or a lying length), when
    the app is told the client went away and whatever it answers is dropped."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.limit:
            await self._refuse(send)
            return
        seen, started, refused = 0, False, False

        async def counted() -> Message:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                refused = True
                if not started:
                    await self._refuse(send)
                return {"type": "http.disconnect"}
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out: the app's own answer is dropped
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except Exception:
            if not refused:
                raise

    async def _refuse(self, send: Send) -> None:
        response = JSONResponse({"error": "too_large", "detail": f"request body over {self.limit} bytes"}, 413,
                                headers={"Connection": "close"})
        await response({"type": "http"}, None, send)  # type: ignore[arg-type]


def loopback_host(request: Request) -> bool:
    host = request.headers.get("host", "")
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return name.lower() in ("127.0.0.1", "localhost")


def same_origin(request: Request) -> bool:
    """A post from a page of another site is refused (CSRF tokens are the second line).

    Browsers say where a request comes from in ``Sec-Fetch-Site``; ``Origin`` is ``null`` for
    our own form posts (Referrer-Policy no-referrer), so only a named other origin refuses.
    Scripts send neither.
    """
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return True
    return urlsplit(origin).netloc == request.headers.get("host", "")
