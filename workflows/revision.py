"""What a revision changed in a plan: an RFC 6902 JSON Patch between the two step lists.

The record keeps only each operation and its path (``replace /1/args/amount_cents``): values may be
personal data. A person deciding on a revision sees the whole patch, values included
(``tether status``), rendered through workflows/display.py. Pure: no Temporal, no I/O.
"""

from __future__ import annotations

from typing import Any

import jsonpatch

from workflows.budgets import clip

CHANGED_KEPT = 50  # paths on one record; the rest are counted
PATH_CHARS = 200


def plan_body(steps: list[Any]) -> list[dict[str, Any]]:
    """What a plan hash covers, per step: tool and arguments (``PlanStep`` or ``RevisedStep``)."""
    return [{"tool": s.tool, "args": s.args} for s in steps]


def patch(old: list[Any], new: list[Any]) -> list[dict[str, Any]]:
    """The RFC 6902 operations that turn ``old`` steps into ``new`` ones (values included)."""
    return list(jsonpatch.make_patch(plan_body(old), plan_body(new)))


def changed_paths(ops: list[dict[str, Any]]) -> list[str]:
    """``op path`` per operation, bounded: what goes on the record (never a value)."""
    out = [clip(f"{op['op']} {op['path']}", PATH_CHARS) for op in ops[:CHANGED_KEPT]]
    if len(ops) > CHANGED_KEPT:
        out.append(f"(+{len(ops) - CHANGED_KEPT} more)")
    return out
