"""An unsafe write whose answer is held until the test says, so a forger can answer it meanwhile
(issue 46): its registry, its tool and the policy that lets bob approve and dana hand off."""

from __future__ import annotations

import threading

from tether.tools.sdk import ToolContext, ToolRegistry, tool
from examples.billing.tools import EmailArgs, call
from workflows.contract import ToolEffect

HELD = ToolRegistry()
RELEASED: dict[str, threading.Event] = {}  # recipient -> the test lets the honest call answer


@tool(effect=ToolEffect.UNSAFE, timeout=60, name="held_email", registry=HELD)
def held_email(args: EmailArgs, ctx: ToolContext) -> dict:
    """Sends the email, then holds its answer until the test says (a forger answers meanwhile)."""
    sent = call("POST", "/emails", args.model_dump(), headers={"X-Request-Ref": ctx.idempotency_key})
    RELEASED.setdefault(args.to, threading.Event()).wait(60)
    return sent


WEDGED_POLICY = """
[tenants.default]
tools = ["held_email"]
approval_roles = ["approver"]

[tenants.default.approvers]
bob = { roles = ["approver"] }
dana = { roles = ["support"] }
"""
