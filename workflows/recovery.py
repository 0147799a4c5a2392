"""Declared recovery: building a write's compensating call from its declaration, as data.

A tool declares how its effect is undone (:class:`workflows.models.Compensation`): the
compensating tool and its arguments as JSON pointers (RFC 6901) into the original call's
arguments and result. This module resolves them. Pure and deterministic: no Temporal, no I/O;
the engine calls it when a write succeeds, tests call it directly. A pointer that finds nothing
is a clear failure (the write then has no recovery path, on the record), never a guess.
"""

from __future__ import annotations

import json
from typing import Any

from workflows.contract import Compensation, CompensationCall

UNDO_KEY_SUFFIX = ":undo"


class PointerError(ValueError):
    """A JSON pointer that does not resolve, with where it stopped."""


def resolve_pointer(document: Any, pointer: str) -> Any:
    """The value ``pointer`` (RFC 6901) names in ``document``; PointerError if there is none."""
    if pointer == "":
        return document
    if not pointer.startswith("/"):
        raise PointerError(f"{pointer!r} is not a JSON pointer (it must start with '/')")
    value = document
    walked = ""
    for raw in pointer[1:].split("/"):
        token = raw.replace("~1", "/").replace("~0", "~")
        walked += "/" + raw
        if isinstance(value, dict):
            if token not in value:
                raise PointerError(f"{walked}: no such key")
            value = value[token]
        elif isinstance(value, list):
            if not (token.isdigit() and (token == "0" or not token.startswith("0"))) or int(token) >= len(value):
                raise PointerError(f"{walked}: no such index (the array has {len(value)} item(s))")
            value = value[int(token)]
        else:
            raise PointerError(f"{walked}: {type(value).__name__} has no members")
    return value


def undo_key(idempotency_key: str) -> str:
    """The compensation's idempotency key, derived from the original call's: stable across
    retries, worker crashes and a later compensation run, so the undo is applied at most once
    where the target dedupes."""
    return idempotency_key + UNDO_KEY_SUFFIX


def result_document(observation: str, truncated: bool) -> tuple[Any, str | None]:
    """The original call's result, parsed from its bounded observation, or why it cannot be."""
    if truncated:
        return None, "the result was truncated before it reached the workflow"
    try:
        return json.loads(observation), None
    except json.JSONDecodeError:
        return None, "the result is not JSON"


def compensation_call(
    declared: Compensation | None,
    *,
    of: str,
    of_tool: str,
    args: dict[str, Any],
    result: Any,
    result_problem: str | None,
    idempotency_key: str,
    plan_hash: str,
    approved_by: list[str],
) -> CompensationCall:
    """The undo of one ok write. Every pointer must resolve; otherwise the call has no tool and
    ``error`` names the pointer that failed."""
    base = CompensationCall(
        of=of,
        of_tool=of_tool,
        idempotency_key=undo_key(idempotency_key),
        plan_hash=plan_hash,
        approved_by=list(approved_by),
    )
    if declared is None:
        return base.model_copy(update={"error": "no recovery path declared"})
    document = {"args": args, "result": result}
    built: dict[str, Any] = {}
    for name, pointer in sorted(declared.args.items()):
        if pointer.startswith("/result") and result_problem is not None:
            return base.model_copy(update={"error": f"argument {name} ({pointer}): {result_problem}"})
        try:
            built[name] = resolve_pointer(document, pointer)
        except PointerError as e:
            return base.model_copy(update={"error": f"argument {name}: pointer {e}"})
    return base.model_copy(update={"tool": declared.tool, "args": built})
