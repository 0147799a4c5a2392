"""Plans from the command line: ``--step N KEY=VALUE`` edits, a steps file or playbook, and what a
revision changes, shown to the person making it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tether.cli.base import client, contract, pydantic


def parse_edits(edits: Sequence[Sequence[str]]) -> list[tuple[int, str, Any]]:
    """``--step N KEY=VALUE ...`` as (step, key, value); a value that is JSON is taken as JSON
    (``1000``, ``true``, ``"1000"``), anything else as text."""
    out: list[tuple[int, str, Any]] = []
    for edit in edits:
        if len(edit) < 2 or not edit[0].isdigit() or int(edit[0]) < 1:
            raise client.UsageError("--step: expected a step number (1, 2, ...) and KEY=VALUE pairs, e.g. --step 2 amount_cents=1000")
        for pair in edit[1:]:
            key, sep, text = pair.partition("=")
            if not sep or not key:
                raise client.UsageError(f"--step: {pair[:60]!r} is not KEY=VALUE")
            try:
                value: Any = json.loads(text)
            except json.JSONDecodeError:
                value = text
            out.append((int(edit[0]), key, value))
    return out


def load_steps_file(path: Path, what: str = "steps file", model: type[pydantic.BaseModel] | None = None) -> list[Any]:
    """A JSON list of ``{tool, args}`` steps (or ``{"steps": [...]}``), each validated as
    ``model``: a playbook, or (by default) the whole revised plan of ``tether revise --steps-file``."""
    model = model or contract.RevisedStep
    try:
        raw = json.loads(path.read_text())
    except (FileNotFoundError, IsADirectoryError):
        raise client.UsageError(f"{what if what.endswith(' file') else what + ' file'} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise client.UsageError(f"{what} {path} is not valid JSON: {getattr(e, 'msg', e)}") from None
    raw = raw.get("steps") if isinstance(raw, dict) else raw
    if not isinstance(raw, list):
        raise client.UsageError(f"{what} {path} must be a JSON list of {{\"tool\", \"args\"}} steps")
    try:
        return [model.model_validate(s) for s in raw]
    except pydantic.ValidationError as e:
        raise client.invalid(f"{what} {path}", e) from None


def revision_diff(plan: contract.Plan, steps: Sequence[dict[str, Any]]) -> list[str]:
    """What a revision changes, for the person making it: RFC 6902 operations with their values
    (escaped), e.g. ``replace /1/args/amount_cents: 9000 -> 1000``. Never recorded."""
    from workflows.display import escape_text, show_value
    from workflows.revision import patch

    old = [{"tool": s.tool, "args": s.args} for s in plan.steps]
    lines = []
    for op in patch(plan.steps, [contract.RevisedStep.model_validate(s) for s in steps]):
        path = op["path"]
        if op["op"] == "replace":
            before = _pointer(old, path)
            lines.append(f"replace {escape_text(path, 200)}: {show_value(before, 200)} -> {show_value(op['value'], 200)}")
        elif op["op"] == "remove":
            lines.append(f"remove {escape_text(path, 200)}: {show_value(_pointer(old, path), 200)}")
        else:
            lines.append(f"{op['op']} {escape_text(path, 200)}: {show_value(op.get('value', op.get('from')), 200)}")
    return lines


def _pointer(document: Any, path: str) -> Any:
    import jsonpointer

    try:
        return jsonpointer.resolve_pointer(document, path)
    except jsonpointer.JsonPointerException:
        return None
