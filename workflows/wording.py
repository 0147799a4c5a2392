"""How a step reads to the person asked to approve it: money as amount and currency, effects in
plain words. Pure, so the run's risk summary (records, webhooks, the Web UI) and every client
(CLI, inbox) say it the same way; text from outside goes through workflows/display.py."""

from __future__ import annotations

from typing import Any

from workflows.display import escape_text
from workflows.contract import Compensation, CompensationCall, ToolEffect

# The JSON Schema annotation a tool puts on an amount argument (examples/billing/tools.py):
# ``{"x-money": {"currency": "EUR", "minor_units": 2}}``, or ``"currency_arg": NAME`` when
# another argument of the call holds the currency code.
MONEY_KEYWORD = "x-money"


def money(value: Any, schema: dict[str, Any] | None, args: dict[str, Any]) -> str | None:
    """An amount argument as a person reads it (``600.00 EUR``), from the tool's schema; None
    when the schema declares no money there or the value is not a whole number of minor units.
    The same for a field of a read's result (``schema`` from the tool's result schema, ``args``
    the result: a ``currency_arg`` names a field of it)."""
    declared = (schema or {}).get(MONEY_KEYWORD)
    if not isinstance(declared, dict) or isinstance(value, bool) or not isinstance(value, int):
        return None
    currency = declared.get("currency")
    if isinstance(declared.get("currency_arg"), str):
        currency = args.get(declared["currency_arg"])
    units = declared.get("minor_units", 2)
    if not isinstance(currency, str) or not isinstance(units, int) or isinstance(units, bool) or not 0 <= units <= 6:
        return None
    whole, part = divmod(abs(value), 10**units)
    amount = f"{'-' if value < 0 else ''}{whole}" + (f".{part:0{units}d}" if units else "")
    return f"{amount} {escape_text(currency, 8)}"


def effect_words(info: Any, undo: Any = False) -> str:
    """What a step does to the world, in plain words: ``read-only``, ``can be undone by
    void_refund``, ``cannot be undone``. ``undo``: the step's compensation as the plan hash covers
    it (None: none; False: judged by the tool's declaration)."""
    if info is None:
        return "unknown tool (treated as a write that cannot be undone)"
    if info.effect == ToolEffect.READ_ONLY:
        words = "read-only"
    else:
        comp = info.compensate if undo is False else undo
        words = f"can be undone by {escape_text(comp.tool, 64)}" if isinstance(comp, Compensation) else "cannot be undone"
    if info.effect == ToolEffect.UNSAFE:
        words += "; unsafe: never re-run"  # at most once: an attempt that may have applied is never repeated
    return words + ("; may destroy data" if info.destructive else "")


def tool_words(info: Any) -> str:
    """What a tool says it does, as approvers read it: its description's (docstring's) first
    line, raw (escaped where it is shown); empty for an unknown tool or none written."""
    described = info.description if info is not None else ""
    return next((line.strip() for line in described.splitlines() if line.strip()), "")


def arg_words(name: str, value: Any, schema: dict[str, Any] | None, args: dict[str, Any]) -> str | None:
    """Money as a person reads it, with the raw value beside it; None: not money."""
    shown = money(value, ((schema or {}).get("properties") or {}).get(name), args)
    return None if shown is None else f"{shown} ({value})"


def standing(call: CompensationCall) -> str:
    """Where one ok write stands, in the words every view uses: kept, undone, may have applied."""
    if call.tool is None:
        return "kept (no recovery path)"
    return {"ok": "undone", "unknown": "may have applied", "failed": "kept (its undo failed, not applied)"}.get(
        call.status, "kept"
    )


def write_standing(call: CompensationCall) -> str:
    """One ok write as a line of text: where it stands (``standing``), by which undo, and which
    run did it (or started it, its outcome unknown) and when."""
    tool = escape_text(call.tool, 64) if call.tool else ""
    by = f" by run {escape_text(call.undone_by, 200)}" if call.undone_by else ""
    at = f" at {call.undone_at.isoformat(timespec='seconds')}" if call.undone_at else ""
    if call.tool is None:
        return f"kept; no recovery path ({escape_text(call.error or '', 200)})"
    if call.status == "ok":
        return f"undone ({tool}{by}{at})"
    if call.status == "unknown":
        return f"may have applied: undo {tool} started{by}{at}, outcome unknown"
    if call.status == "failed":
        return f"kept; undo {tool} failed (not applied)"
    return f"kept; undo: {tool}"
