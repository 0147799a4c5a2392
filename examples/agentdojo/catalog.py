"""AgentDojo's v1 suites as it ships them, and what each of their functions does to its world.

Every function of the four suites is one Tether tool of the same name (``send_email`` is the
same function in workspace and travel: one tool, applied to the run's own environment). Its
effect is declared from what the function does to the environment and what the tool-side
service (examples/agentdojo/service.py) promises for it:

- ``read_only``: the function leaves the environment as it was (tests/examples/
  test_agentdojo_service.py runs every ground-truth call and checks it);
- ``idempotent``: a write whose second application changes nothing more (set a value, cancel,
  mark read, share, add a member); the service also answers a repeated idempotency key with the
  first answer;
- ``reconcilable``: a write that adds something each time (an email, a payment, a message, a
  reservation): the service refuses a repeated key (409) and a retry looks the first call up by
  its key (``GET /runs/{run}/calls?key=``) instead of writing again.

No function is ``unsafe``: the service journals every write by its key, so none has to be run
blind. Some reads are writes in AgentDojo's world, and are declared so: ``get_unread_emails``
marks what it returns as read, and ``get_webpage`` records a request to the URL (the way data
leaves the Slack suite).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

BENCHMARK_VERSION = "v1"
SUITES = ("workspace", "travel", "banking", "slack")

IDEMPOTENT = frozenset({
    "delete_email", "get_unread_emails", "cancel_calendar_event", "reschedule_calendar_event",
    "add_calendar_event_participants", "delete_file", "share_file",
    "update_scheduled_transaction", "update_password", "update_user_info",
    "add_user_to_channel", "remove_user_from_slack", "get_webpage",
})
RECONCILABLE = frozenset({
    "send_email", "create_calendar_event", "append_to_file", "create_file",
    "reserve_hotel", "reserve_car_rental", "reserve_restaurant",
    "send_money", "schedule_transaction",
    "send_direct_message", "send_channel_message", "invite_user_to_slack", "post_webpage",
})

# What an approver sees first (docs/writing-tools.md): the target and the amount. Every
# argument is still shown in full with the plan.
SUMMARY_FIELDS: dict[str, tuple[str, ...]] = {
    "send_email": ("recipients", "subject"),
    "delete_email": ("email_id",),
    "create_calendar_event": ("title", "participants"),
    "cancel_calendar_event": ("event_id",),
    "reschedule_calendar_event": ("event_id", "new_start_time"),
    "add_calendar_event_participants": ("event_id", "participants"),
    "append_to_file": ("file_id",),
    "create_file": ("filename",),
    "delete_file": ("file_id",),
    "share_file": ("file_id", "email", "permission"),
    "reserve_hotel": ("hotel", "start_day"),
    "reserve_car_rental": ("company", "start_time"),
    "reserve_restaurant": ("restaurant", "start_time"),
    "send_money": ("recipient", "amount"),
    "schedule_transaction": ("recipient", "amount", "date"),
    "update_scheduled_transaction": ("id", "recipient", "amount"),
    "update_password": (),  # never the password itself
    "update_user_info": ("first_name", "last_name"),
    "add_user_to_channel": ("user", "channel"),
    "send_direct_message": ("recipient",),
    "send_channel_message": ("channel",),
    "invite_user_to_slack": ("user", "user_email"),
    "remove_user_from_slack": ("user",),
    "get_webpage": ("url",),
    "post_webpage": ("url",),
}

# The undos the environments allow: a tool of the suite that takes the effect back, its
# arguments from the original call's result (``id`` is the created object's id) or arguments.
UNDO: dict[str, tuple[str, dict[str, str]]] = {
    "create_calendar_event": ("cancel_calendar_event", {"event_id": "/result/id"}),
    "create_file": ("delete_file", {"file_id": "/result/id"}),
    "invite_user_to_slack": ("remove_user_from_slack", {"user": "/args/user"}),
}


def effect_of(name: str) -> str:
    if name in IDEMPOTENT:
        return "idempotent"
    if name in RECONCILABLE:
        return "reconcilable"
    return "read_only"


@lru_cache(maxsize=1)
def suites() -> dict[str, Any]:
    """AgentDojo's v1 task suites (name -> TaskSuite), loaded once per process (offline: the
    environments, tasks and injection vectors are files of the package)."""
    from agentdojo.task_suite.load_suites import get_suites

    loaded = get_suites(BENCHMARK_VERSION)
    return {name: loaded[name] for name in SUITES}


@lru_cache(maxsize=1)
def functions() -> dict[str, Any]:
    """Every function of the four suites by name (AgentDojo ``Function``: its argument model,
    description and Python body). A name two suites share is one function."""
    found: dict[str, Any] = {}
    for suite in suites().values():
        for fn in suite.tools:
            known = found.setdefault(fn.name, fn)
            if known.run is not fn.run:
                raise RuntimeError(f"two different functions named {fn.name}")
    return found


def _restore(model: Any, data: Any) -> None:
    """Put back what validation rebuilt from the ``initial_*`` fields: AgentDojo's inbox, calendar
    and drive hold their state in ``emails`` / ``events`` / ``files`` but rebuild those from
    ``initial_emails`` ... when validated, which would drop every change since the start."""
    from pydantic import BaseModel, TypeAdapter

    if not isinstance(model, BaseModel) or not isinstance(data, dict):
        return
    fields = type(model).model_fields
    for name, info in fields.items():
        if name not in data:
            continue
        if f"initial_{name}" in fields:
            setattr(model, name, TypeAdapter(info.annotation).validate_python(data[name]))
        else:
            _restore(getattr(model, name), data[name])


def dump_environment(env: Any) -> str:
    return env.model_dump_json()


def load_environment(suite_name: str, data: str | dict[str, Any]) -> Any:
    """A suite's environment from ``dump_environment``'s JSON (or its parsed form), exactly as it
    was (tests/examples/test_agentdojo.py round-trips every ground truth's world)."""
    import json

    parsed = json.loads(data) if isinstance(data, str) else data
    env = suites()[suite_name].environment_type.model_validate(parsed)
    _restore(env, parsed)
    return env


def canonical(function: str, args: dict[str, Any]) -> str:
    """A call as an approver compares it: its arguments through the tool's model (defaults filled)."""
    model = functions()[function].parameters
    return function + json.dumps(model.model_validate(args).model_dump(mode="json"), sort_keys=True)
