"""Tools that call the billing example service, one per effect class.

- ``get_order``: read_only.
- ``issue_refund``: idempotent: the service dedupes refunds by the ``Idempotency-Key`` header.
- ``post_ledger_entry``: reconcilable: the ledger is not idempotent, but an entry can be found
  again by its key, so a retry looks it up before writing.
- ``send_email``: unsafe: a second call sends a second email, so it runs at most once.

Two writes declare how they are undone (``compensate=``): a refund by ``void_refund`` (the
refund's id from its result), a ledger entry by ``reverse_ledger_entry`` (the entry's id). Both
undo tools are idempotent: the service voids a refund and reverses an entry at most once. An
email cannot be unsent: it has no recovery path, and the approver is told so.

The service URL comes from ``BILLING_URL`` (default ``http://127.0.0.1:8765``). Every call
passes ``ctx.seconds_left()`` as its HTTP timeout: nothing is sent after the attempt's deadline,
so once the runtime sees an attempt over, no late request of it can still land.
"""

from __future__ import annotations

import urllib.parse

from pydantic import BaseModel, Field

# The service's HTTP client, in a module of its own: other tool modules use it without
# registering these tools (docs/writing-tools.md).
from examples.billing.api import HTTP_TIMEOUT_SECONDS, billing_url, call  # noqa: F401
from tether import ToolContext, ToolEffect, tool

ORDER_ID = r"^[A-Z]-\d{4}$"

# The service keeps its books in EUR cents: approvers see 49.99 EUR, not 4999 (client.money).
EUR_CENTS = {"x-money": {"currency": "EUR", "minor_units": 2}}


class OrderRef(BaseModel):
    order_id: str = Field(pattern=ORDER_ID, description="order id, e.g. A-1001")


class Order(BaseModel):
    """An order as the service returns it; its total in the order's own currency (approvers read
    what the lookup found as 49.99 EUR (4999))."""

    id: str
    customer_email: str
    total_cents: int = Field(json_schema_extra={"x-money": {"currency_arg": "currency", "minor_units": 2}})
    currency: str
    status: str


@tool(effect=ToolEffect.READ_ONLY, timeout=15)
def get_order(args: OrderRef, ctx: ToolContext) -> Order:
    """Look up an order: customer, total and status."""
    return Order.model_validate(call("GET", f"/orders/{urllib.parse.quote(args.order_id)}", timeout=ctx.seconds_left()))


class RefundArgs(BaseModel):
    order_id: str = Field(pattern=ORDER_ID)
    amount_cents: int = Field(gt=0, le=10_000_000, description="refund amount in cents", json_schema_extra=EUR_CENTS)
    reason: str = Field(min_length=1, max_length=500)


@tool(
    effect=ToolEffect.IDEMPOTENT,
    timeout=15,
    max_retries=4,
    summary_fields=("order_id", "amount_cents"),
    compensate=("void_refund", {"refund_id": "/result/refund_id"}),
)
def issue_refund(args: RefundArgs, ctx: ToolContext) -> dict:
    """Refund (part of) an order to the customer's payment method."""
    return call(
        "POST",
        "/refunds",
        args.model_dump(),
        headers={"Idempotency-Key": ctx.idempotency_key},
        timeout=ctx.seconds_left(),
    )


class LedgerArgs(BaseModel):
    order_id: str = Field(pattern=ORDER_ID)
    amount_cents: int = Field(ge=-10_000_000, le=10_000_000, json_schema_extra=EUR_CENTS)
    memo: str = Field(min_length=1, max_length=500)


@tool(
    effect=ToolEffect.RECONCILABLE,
    timeout=15,
    max_retries=4,
    summary_fields=("order_id", "amount_cents"),
    compensate=("reverse_ledger_entry", {"entry_id": "/result/entry_id"}),
)
def post_ledger_entry(args: LedgerArgs, ctx: ToolContext) -> dict:
    """Post an entry to the accounting ledger, keyed by the tool call's idempotency key."""
    return call("POST", "/ledger", {"key": ctx.idempotency_key, **args.model_dump()}, timeout=ctx.seconds_left())


@post_ledger_entry.lookup
def find_ledger_entry(ctx: ToolContext) -> dict | None:
    entries = call(
        "GET", "/ledger?" + urllib.parse.urlencode({"key": ctx.idempotency_key}), timeout=ctx.seconds_left()
    )
    found = entries.get("entries") or []
    return found[0] if found else None


class VoidArgs(BaseModel):
    refund_id: str = Field(pattern=r"^R-\d{1,18}$", description="refund id, e.g. R-12")


@tool(effect=ToolEffect.IDEMPOTENT, timeout=15, max_retries=4, summary_fields=("refund_id",))
def void_refund(args: VoidArgs, ctx: ToolContext) -> dict:
    """Void a refund (the undo of issue_refund). Voiding a voided refund changes nothing."""
    return call("POST", f"/refunds/{urllib.parse.quote(args.refund_id)}/void", {}, timeout=ctx.seconds_left())


class ReverseArgs(BaseModel):
    entry_id: str = Field(pattern=r"^L-\d{1,18}$", description="ledger entry id, e.g. L-7")


@tool(effect=ToolEffect.IDEMPOTENT, timeout=15, max_retries=4, summary_fields=("entry_id",))
def reverse_ledger_entry(args: ReverseArgs, ctx: ToolContext) -> dict:
    """Post the reversing entry of a ledger entry (the undo of post_ledger_entry), at most once."""
    return call(
        "POST",
        f"/ledger/{urllib.parse.quote(args.entry_id)}/reverse",
        {"key": ctx.idempotency_key},
        timeout=ctx.seconds_left(),
    )


class EmailArgs(BaseModel):
    to: str = Field(pattern=r"^[^@\s]+@[^@\s]+$", max_length=254)
    subject: str = Field(min_length=1, max_length=200)
    body: str = Field(min_length=1, max_length=10_000)


@tool(effect=ToolEffect.UNSAFE, timeout=15, summary_fields=("subject",))
def send_email(args: EmailArgs, ctx: ToolContext) -> dict:
    """Send an email to a customer. Not idempotent: never retried blindly."""
    # The reference only lets operators (and tests) count calls; the service does not dedupe.
    return call(
        "POST",
        "/emails",
        args.model_dump(),
        headers={"X-Request-Ref": ctx.idempotency_key},
        timeout=ctx.seconds_left(),
    )
