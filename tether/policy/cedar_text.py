"""Cedar's words: the schema and its actions, literals (strings, decimals, entity uids) and the
scanning of a Cedar text (its statements, annotations, and the sizes a parser survives), shared by
the export (``tether/policy/cedar_export.py``), the engine (``tether/policy/cedar_engine.py``) and the
checks (``tether/policy/cedar.py``). Pure functions of their inputs."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from decimal import ROUND_CEILING, Decimal, InvalidOperation
from pathlib import Path
from typing import TypedDict

import cedarpy

SCHEMA_PATH = Path(__file__).with_name("tether.cedarschema")
NS = "Tether"

# The actions of the schema, by who takes them.
PERSON_ACTIONS = ("approve", "approve_steps", "reject", "revise", "hand_off", "cancel", "compensate")
STEP_ACTIONS = ("auto_approve", "execute_write")
ACTIONS = PERSON_ACTIONS + STEP_ACTIONS
# The action groups of the schema, as entities: without the schema per call, the engine learns
# from these that an approve_steps is an approve.
class EntityRef(TypedDict):
    type: str
    id: str


class ActionGroup(TypedDict):
    """An action's entity in Cedar's JSON form, with the groups it is ``in``."""

    uid: EntityRef
    attrs: dict[str, str]
    parents: list[EntityRef]


ACTION_GROUPS: tuple[ActionGroup, ...] = (
    {"uid": {"type": f"{NS}::Action", "id": "approve_steps"}, "attrs": {}, "parents": [{"type": f"{NS}::Action", "id": "approve"}]},
)
# When several forbid policies decide one request, the refusal names the rule the TOML engine
# checks first (workflows/policy.approver_refusal's order); a tenant's own rules come after.
RULE_ORDER = (
    "tenant", "four_eyes", "editor_approval", "tenant_membership", "role", "distinct_approvers",
    "tool_withdrawn", "high_risk",
)
# A denial no forbid policy named: nothing permitted it.
NOT_PERMITTED = {"auto_approve": "approval_needed", "execute_write": "not_permitted"}

_DECIMAL_MAX = Decimal("922337203685477.5807")
_FOUR_PLACES = Decimal("0.0001")


@functools.cache
def schema_text() -> str:
    return SCHEMA_PATH.read_text()


@functools.cache
def schema() -> cedarpy.Schema:
    return cedarpy.Schema.from_str(schema_text())


# ----------------------------------------------------------------------------- literals


def cedar_string(text: str) -> str:
    """A Cedar string literal: quotes, backslashes and control characters escaped."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{{{ord(ch):x}}}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def decimal_text(value: float | int, *, rounding: str = ROUND_CEILING) -> str:
    """A number as Cedar's decimal takes it: four places at most (rounded ``rounding``), clamped
    to the decimal's range."""
    try:
        d = Decimal(repr(value) if isinstance(value, float) else value).quantize(_FOUR_PLACES, rounding=rounding)
    except InvalidOperation:
        d = _DECIMAL_MAX if value > 0 else -_DECIMAL_MAX
    d = max(min(d, _DECIMAL_MAX), -_DECIMAL_MAX)
    text = format(d.normalize(), "f")
    return text if "." in text else text + ".0"


def _uid(kind: str, ident: str) -> dict[str, str]:
    return {"type": f"{NS}::{kind}", "id": ident}


def _euid(kind: str, ident: str) -> str:
    return f"{NS}::{kind}::{cedar_string(ident)}"


def _action(name: str) -> str:
    return f'{NS}::Action::"{name}"'


def _actions(names: Iterable[str]) -> str:
    return "[" + ", ".join(_action(n) for n in names) + "]"



# ----------------------------------------------------------------------------- scanning a text


def _code(text: str) -> Iterator[tuple[int, str, int]]:
    """(index, character, line) of each character of a Cedar text outside its comments; a string
    literal is one item, its opening quote (what it holds is never code)."""
    line, i = 1, 0
    while i < len(text):
        ch = text[i]
        if text.startswith("//", i):
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
            continue
        yield i, ch, line
        if ch == "\n":
            line += 1
        elif ch == '"':
            i += 1
            while i < len(text) and text[i] != '"':
                line += text[i] == "\n"
                i += 2 if text[i] == "\\" else 1
        i += 1


def _statements(text: str) -> list[tuple[int, str]]:
    """The policies of a Cedar text, each with the line (1-based) it starts on: split at each
    ``;`` outside strings and comments (a policy ends there and nowhere else)."""
    out: list[tuple[int, str]] = []
    start: int | None = None
    start_line = 1
    for i, ch, line in _code(text):
        if start is None and not ch.isspace():
            start, start_line = i, line
        if ch == ";" and start is not None:
            out.append((start_line, text[start : i + 1]))
            start = None
    if start is not None:
        out.append((start_line, text[start:]))
    return out


# The Cedar parser recurses on nesting: some hundreds of levels of ( [ { overflow its stack and
# kill the process that reads the file (a segfault: `validate`, every worker, the inbox). Bounded
# here, before any parser sees a text; policies people write nest a handful of levels.
MAX_NESTING = 64
MAX_POLICY_BYTES = 1024 * 1024
_ANNOTATION = re.compile(r'\s*(?://[^\n]*\n\s*)*@(\w+)\s*\(\s*"((?:[^"\\]|\\.)*)"\s*\)')


def size_problem(text: str, source: str) -> str | None:
    """Why ``text`` is beyond what Tether lets a Cedar parser see (None: within): over
    MAX_POLICY_BYTES, or nested deeper than MAX_NESTING (outside strings and comments)."""
    size = len(text.encode())
    if size > MAX_POLICY_BYTES:
        return f"{source}: {size} bytes: a Cedar text holds at most {MAX_POLICY_BYTES} (docs/policy.md, sizes)"
    depth = 0
    for _, ch, line in _code(text):
        if ch in "([{":
            depth += 1
            if depth > MAX_NESTING:
                return (f"{source}: line {line}: nested deeper than {MAX_NESTING} levels of ( [ {{: a parser "
                        f"would overflow its stack (docs/policy.md, sizes)")
        elif ch in ")]}":
            depth = max(0, depth - 1)
    return None


def policy_annotations(statement: str) -> dict[str, str]:
    """A policy's annotations (``@id("...")``, ``@rule("...")``), read from its text."""
    found: dict[str, str] = {}
    pos = 0
    while (match := _ANNOTATION.match(statement, pos)) is not None:
        found.setdefault(match.group(1), match.group(2).replace('\\"', '"').replace("\\\\", "\\"))
        pos = match.end()
    return found

