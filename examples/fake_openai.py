"""A local OpenAI-compatible endpoint that answers from a script: the model planner without a model.

    python -m examples.fake_openai --script examples/agents/refund.model-script.json --port 8089
    TETHER_MODEL=fake OPENAI_BASE_URL=http://127.0.0.1:8089/v1 python worker.py ...

A real HTTP server on 127.0.0.1 that serves ``POST /v1/chat/completions`` from a script of
responses, in order, and records every request it got (path, headers, JSON body). The planner
talks to it through the real ``openai`` client, over real HTTP: nothing is patched. When the
script runs out it answers 400 (``script_exhausted``), so a run that asks more than was
scripted fails fast with a clear reason instead of hanging in retries.

The script file is a JSON list, one reply per model call: ``{"text": "..."}`` (a final answer),
``{"tool_calls": [{"name": "get_order", "args": {...}}, ...]}`` (a plan), or
``{"error": 429, "message": "..."}``. Or, instead of a script, ``respond``: a function of each
request (``Recorded``) returning its reply, for a model that answers from the conversation it
is sent (examples/agentdojo/model.py); it answers the script's replies when it returns None.
In tests:

    with FakeOpenAI() as fake:
        fake.script(tool_calls(call("get_order", {"order_id": "A-1001"})), text("Done."))
        ... OPENAI_BASE_URL=fake.base_url ...
        fake.requests[1].body["messages"]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable


@dataclass
class Reply:
    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]  # names in lower case
    body: Any
    at: float

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.body.get("messages", []) if isinstance(self.body, dict) else []

    @property
    def tools(self) -> list[dict[str, Any]]:
        return self.body.get("tools", []) if isinstance(self.body, dict) else []


def usage(prompt: int = 100, completion: int = 20) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def call(name: str, args: dict[str, Any] | str, call_id: str | None = None) -> dict[str, Any]:
    """One tool call; ``args`` as a dict is JSON-encoded, as a string it is sent verbatim."""
    return {
        "id": call_id or f"call_{uuid.uuid4().hex[:12]}",
        "type": "function",
        "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
    }


def _completion(message: dict[str, Any], finish: str, tokens: dict[str, int] | None) -> Reply:
    return Reply(
        200,
        {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "fake-model",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": tokens or usage(),
        },
    )


def tool_calls(*calls: dict[str, Any], tokens: dict[str, int] | None = None) -> Reply:
    return _completion({"role": "assistant", "content": None, "tool_calls": list(calls)}, "tool_calls", tokens)


def text(content: str, tokens: dict[str, int] | None = None) -> Reply:
    return _completion({"role": "assistant", "content": content}, "stop", tokens)


def error(status: int, message: str, *, code: str | None = None, headers: dict[str, str] | None = None) -> Reply:
    return Reply(
        status,
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}},
        headers or {},
    )


class FakeOpenAI:
    def __init__(self, port: int = 0, respond: Callable[[Recorded], Reply | None] | None = None,
                 record: bool = True) -> None:
        self._respond = respond
        self._keep = record  # False: ``requests`` stays empty (a bench's thousands of calls)
        self._replies: deque[Reply] = deque()
        self._lock = threading.Lock()
        self.requests: list[Recorded] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body: Any = json.loads(raw or b"null")
                except json.JSONDecodeError:
                    body = raw.decode(errors="replace")
                recorded = Recorded("POST", self.path, {k.lower(): v for k, v in self.headers.items()}, body, time.monotonic())
                fake._record(recorded)
                if self.path.rstrip("/") != "/v1/chat/completions":
                    reply = error(404, f"no route {self.path}")
                else:
                    reply = (fake._respond(recorded) if fake._respond else None) or fake._next()
                self._send(reply)

            def do_GET(self) -> None:  # noqa: N802
                fake._record(Recorded("GET", self.path, {k.lower(): v for k, v in self.headers.items()}, None, time.monotonic()))
                self._send(error(404, f"no route {self.path}"))

            def _send(self, reply: Reply) -> None:
                data = json.dumps(reply.body).encode()
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def script(self, *replies: Reply) -> None:
        with self._lock:
            self._replies.extend(replies)

    @property
    def remaining(self) -> int:
        with self._lock:
            return len(self._replies)

    @property
    def completions(self) -> list[Recorded]:
        return [r for r in self.requests if r.path.rstrip("/") == "/v1/chat/completions"]

    def _record(self, request: Recorded) -> None:
        if not self._keep:
            return
        with self._lock:
            self.requests.append(request)

    def _next(self) -> Reply:
        with self._lock:
            if self._replies:
                return self._replies.popleft()
        return error(400, "fake server: no scripted response left", code="script_exhausted")

    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def load_script(path: Path) -> list[Reply]:
    """A script file (see the module's docstring) as replies; ValueError names the bad entry."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read script {path}: {e}") from None
    if not isinstance(entries, list):
        raise ValueError(f"script {path}: a JSON list of replies, e.g. [{{\"text\": \"Done.\"}}]")
    replies = []
    for i, entry in enumerate(entries, 1):
        if isinstance(entry, dict) and isinstance(entry.get("text"), str):
            replies.append(text(entry["text"]))
        elif isinstance(entry, dict) and isinstance(entry.get("tool_calls"), list) and entry["tool_calls"] and all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in entry["tool_calls"]
        ):
            replies.append(tool_calls(*(call(c["name"], c.get("args", {})) for c in entry["tool_calls"])))
        elif isinstance(entry, dict) and isinstance(entry.get("error"), int):
            replies.append(error(entry["error"], str(entry.get("message", "scripted error"))))
        else:
            raise ValueError(
                f"script {path}, reply {i}: give {{\"text\": ...}}, {{\"tool_calls\": [{{\"name\": ..., "
                f"\"args\": {{...}}}}]}} or {{\"error\": STATUS, \"message\": ...}}"
            )
    return replies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.fake_openai", description=__doc__.splitlines()[0])
    parser.add_argument("--script", required=True, type=Path, help="JSON list of replies, one per model call")
    parser.add_argument("--port", type=int, default=8089, help="port on 127.0.0.1 (default 8089; 0: any free one)")
    args = parser.parse_args(argv)
    try:
        replies = load_script(args.script)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with FakeOpenAI(args.port) as fake:
        fake.script(*replies)
        print(f"fake OpenAI endpoint on {fake.base_url} with {len(replies)} scripted replies: "
              f"OPENAI_BASE_URL={fake.base_url} TETHER_MODEL=fake", flush=True)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
