"""What went wrong, as a TetherError: a pydantic error as a usage error naming the field; the
run's refusal (on its record, or from its decide or cancel Update's validator) as REFUSED with
its rule.
"""

from __future__ import annotations

from pydantic import ValidationError
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from workflows.contract import first_error
from workflows.states import TransitionRecord
from tether.connection import Refused, TetherError, UsageError


class JudgementLogUnreadable(TetherError):
    """`tether policy what-if` / `explain`: the judgement log could not be read at all (a missing
    file, no permission, the database down): exit 4, apart from 2 "NEW_POLICY is invalid"."""

    code = 4


def invalid(what: str, err: ValidationError) -> TetherError:
    """A pydantic error as a usage error naming the field (never a traceback)."""
    first = err.errors()[0]
    names = [str(p) for p in first["loc"] if not isinstance(p, int)]
    return UsageError(f"invalid {what}: {first_error(err)}", field=names[-1] if names else None, detail=first["msg"])


def _refused(record: TransitionRecord | None) -> None:
    if record is not None and record.kind == "refused":
        raise Refused(f"{record.reason} [rule: {record.rule}]", rule=record.rule)


def _refused_update(err: WorkflowUpdateFailedError, kind: str) -> TetherError:
    """The decide validator's refusal: its rule is the failure's type (``approve refused [rule]:
    why`` shown as ``approve refused: why [rule: rule]``). An older build's validator raised a
    plain error, typed by its Python class (``ValueError``): no rule, its message as it is."""
    cause = err.cause
    message = str(getattr(cause, "message", None) or cause or err)
    rule = cause.type if isinstance(cause, ApplicationError) else None
    if not rule or not rule.islower():  # ValueError, TypeError: a class name, not a rule
        return Refused(message)
    why = message.removeprefix(f"{kind} refused [{rule}]: ")
    return Refused(f"{kind} refused: {why} [rule: {rule}]", rule=rule)
