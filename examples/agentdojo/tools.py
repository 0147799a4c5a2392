"""Every function of AgentDojo's four v1 suites as a Tether tool (load with
``--tools examples.agentdojo.tools``).

Each tool takes AgentDojo's own argument model for the function (its description is the
function's docstring, as AgentDojo shows it to a model) and sends the call to the run's
environment in the service (examples/agentdojo/service.py), keyed by the run and the tool call's
idempotency key. Effects, summary fields and undos: examples/agentdojo/catalog.py.

The tool's result is what AgentDojo's runtime gives a model: the function's return value as
YAML (``output``), or the function's error (``error``), which the model reads and goes on, as in
AgentDojo; ``id`` is the id of what a write created (the undo's argument).
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from tether.tools.sdk import REGISTRY, ToolContext, ToolError, tool
from examples.agentdojo.api import call
from examples.agentdojo.catalog import SUMMARY_FIELDS, UNDO, effect_of, functions


def _answer(found: dict[str, Any]) -> dict[str, Any]:
    answer = {"output": found.get("output", "")}
    for key in ("error", "id"):
        if key in found:
            answer[key] = found[key]
    return answer


def _find(ctx: ToolContext) -> dict[str, Any] | None:
    """The call this tool call's key already applied, if any (a reconcilable tool's lookup)."""
    path = f"/runs/{urllib.parse.quote(ctx.run_id, safe='')}/calls?" + urllib.parse.urlencode({"key": ctx.idempotency_key})
    found = call("GET", path, timeout=ctx.seconds_left()).get("calls") or []
    return _answer(found[0]) if found else None


def _make(name: str, fn: Any) -> Any:
    effect = effect_of(name)

    def body(args: Any, ctx: ToolContext) -> dict[str, Any]:
        path = f"/runs/{urllib.parse.quote(ctx.run_id, safe='')}/calls"
        try:
            found = call("POST", path, {"function": name, "args": args.model_dump(mode="json")},
                         headers={"Idempotency-Key": ctx.idempotency_key}, timeout=ctx.seconds_left())
        except ToolError as e:
            # A reconcilable write already applied under this key (a reset run asks again with
            # the same key, as a first attempt): the first call's answer, found by its key.
            if e.code != "duplicate_key":
                raise
            earlier = _find(ctx)
            if earlier is None:
                raise
            return earlier
        return _answer(found)

    body.__name__ = name
    body.__qualname__ = name
    body.__doc__ = fn.description
    body.__annotations__ = {"args": fn.parameters, "ctx": ToolContext, "return": dict}
    # 10 s: one HTTP call to a local service that applies one in-memory function; a worker that
    # dies mid-call is then known gone within seconds (heartbeats every 4 s).
    spec = tool(effect=effect, timeout=10, max_retries=4, summary_fields=SUMMARY_FIELDS.get(name, ()),
                compensate=UNDO.get(name))(body)
    if effect == "reconcilable":
        spec.lookup(_find)
    return spec


# Each tool a name of this module too, as a decorated function would be: a worker loading the
# module sees what it declares (tether.tools.sdk.load_tool_modules).
for _name, _fn in functions().items():
    globals()[_name] = REGISTRY.get(_name) or _make(_name, _fn)
