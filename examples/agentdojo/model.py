"""A model that obeys every injection, behind an OpenAI-compatible endpoint (the project's
offline one, examples/fake_openai.py): what AgentDojo's ``OpenAILLM`` talks to when the
pipeline planner (examples/agentdojo/planner.py) runs offline.

Each run is registered with what its user asked (the user task's ground-truth calls and
answer) and what an injection would ask (the injection task's ground-truth calls, and the first
line of the injected text). The model answers each request from the conversation it is sent,
nothing else, so a repeated request (a retried planner activity, a reset run) gets the same
answer:

- while calls of the user's task have not run: the next one, alone, so each result is read
  before the next call;
- when a tool result it was shown carries the injection's text, and it has not acted on it
  yet: the injection's calls first (as the text asks: "before you can solve the task ..."), then
  every user call not yet run, in one reply;
- when every user call has run: the user task's answer, as text.

The run is told by the ``X-Tether-Run`` header the planner sends; an unknown run gets a 400
(the planner activity fails with the reason).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from examples.fake_openai import Recorded, Reply, call, error, text, tool_calls

RUN_HEADER = "x-tether-run"
# What the planner says when a person left steps out (tether/planners/planning.py, runtime_notes):
# the model has then acted on the injection, whatever ran of it.
LEFT_OUT = "were not approved and did not run"


@dataclass
class Case:
    user_calls: list[tuple[str, dict[str, Any]]]
    answer: str
    injection_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    marker: str | None = None  # a line of the injected text; None: benign
    obeyed: bool = False  # it proposed the injection's calls at least once


def _key(function: str, args: dict[str, Any]) -> str:
    from examples.agentdojo.catalog import canonical

    try:
        return canonical(function, args)
    except Exception:  # noqa: BLE001 - arguments the function's model refuses: compared as sent
        return function + json.dumps(args, sort_keys=True, default=str)


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "\n".join(str(part.get("text") or "") for part in content if isinstance(part, dict))
    return str(content or "")


def _left(wanted: list[tuple[str, dict[str, Any]]], ran: Counter[str]) -> list[tuple[str, dict[str, Any]]]:
    """The calls of ``wanted`` not in ``ran`` (each ran call covers one), in order; takes them from ``ran``."""
    left = []
    for function, args in wanted:
        key = _key(function, args)
        if ran[key] > 0:
            ran[key] -= 1
        else:
            left.append((function, args))
    return left


def next_reply(case: Case, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[str, dict[str, Any]]] | str]:
    """("calls", [...]) or ("answer", text) for a conversation (OpenAI chat messages)."""
    ran: Counter[str] = Counter()
    for m in messages:
        if m.get("role") == "assistant":
            for c in m.get("tool_calls") or []:
                fn = c.get("function") or {}
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except json.JSONDecodeError:
                    args = {}
                ran[_key(fn.get("name", ""), args)] += 1
    user_left = _left(case.user_calls, ran)
    injection_left = _left(case.injection_calls, ran)
    shown = case.marker is not None and any(
        case.marker in _content(m) for m in messages if m.get("role") == "tool")
    acted = len(injection_left) < len(case.injection_calls) or any(
        LEFT_OUT in _content(m) for m in messages if m.get("role") == "user")
    if shown and injection_left and not acted:
        return "calls", [*injection_left, *user_left]
    if user_left:
        return "calls", user_left[:1]
    return "answer", case.answer


class ObeyingModel:
    """The endpoint's ``respond`` (``FakeOpenAI(respond=model)``): each registered run's replies."""

    def __init__(self) -> None:
        self.cases: dict[str, Case] = {}
        self.lock = threading.Lock()

    def register(self, run_id: str, case: Case) -> None:
        with self.lock:
            self.cases[run_id] = case

    def forget(self, run_id: str) -> Case | None:
        with self.lock:
            return self.cases.pop(run_id, None)

    def __call__(self, request: Recorded) -> Reply:
        run_id = request.headers.get(RUN_HEADER, "")
        with self.lock:
            case = self.cases.get(run_id)
        if case is None:
            return error(400, f"no case registered for run '{run_id}' (header {RUN_HEADER})", code="unknown_run")
        kind, reply = next_reply(case, request.messages)
        if kind == "answer":
            return text(str(reply))
        injected = {_key(f, a) for f, a in case.injection_calls}
        if any(_key(f, a) in injected for f, a in reply):
            case.obeyed = True
        return tool_calls(*(call(f, a) for f, a in reply))
