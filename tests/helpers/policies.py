"""Steps and policies the policy tests judge: a refund of an amount, the recorded policy of the
what-if tests, and judgement lines signed as the policy activity logs them."""

from __future__ import annotations

from typing import Any


def refund(amount: int, order: str = "A-1002") -> dict:
    return {"tool": "issue_refund", "args": {"order_id": order, "amount_cents": amount, "reason": "policy test"}}


def signed_lines(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Judgement lines as the policy activity logs them: signed with the fleet's ring."""
    from tether.policy.judgements import sign
    from tether.store.keys import KeyRing

    ring = KeyRing.from_env()
    return [sign(ring, line) for line in lines]


RECORDED_POLICY = """
[tenants.default]
tools = ["get_order", "issue_refund"]
[tenants.default.approvers]
alice = { roles = ["approver"] }
bob = { roles = ["approver"] }
[tenants.default.auto_approve]
limits = [{ tool = "issue_refund", field = "amount_cents", max = %d }]
"""


def refund_step(amount: int) -> dict:
    # A-9999 does not exist: nothing is refunded whatever happens; the checks before it are made.
    return {"tool": "issue_refund", "args": {"order_id": "A-9999", "amount_cents": amount, "reason": "what-if"}}
