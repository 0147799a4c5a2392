"""Money in what a read step found is shown in words, as an argument's is: a tool whose function
returns a pydantic model declares its money fields there (``x-money``), and the CLI, the inbox's
run page and the Web UI's details show ``75.50 EUR (7550)``, escaped, through the same words
(workflows/wording.py). A module's tools load into a registry of one's own."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import BaseModel, Field

from tether.cli.output import found_lines
from tether.inbox.pages import templates
from tether.tools.sdk import REGISTRY, ToolContext, ToolRegistry, load_tool_modules, tool
from workflows.contract import ExecutedStep, ToolEffect
from workflows.details import _found_lines
from workflows.run_state import found_steps

EUR = {"x-money": {"currency": "EUR", "minor_units": 2}}
HOSTILE = "late\x1b[2J <b>x</b>"


class OrderRef(BaseModel):
    order_id: str


class OrderTotal(BaseModel):
    id: str
    total_cents: int = Field(json_schema_extra=EUR)
    refunded_cents: int = Field(json_schema_extra={"x-money": {"currency_arg": "currency", "minor_units": 0}})
    currency: str
    items: int  # a number, not money
    note: str


OWN = ToolRegistry()


@tool(effect=ToolEffect.READ_ONLY, registry=OWN, summary_fields=("id", "total_cents", "items", "note"))
def order_total(args: OrderRef, ctx: ToolContext) -> OrderTotal:
    """An order's total."""
    raise AssertionError("not called here")


@tool(effect=ToolEffect.READ_ONLY, registry=OWN)
def order_as_dict(args: OrderRef, ctx: ToolContext) -> dict:
    """The same, undeclared."""
    raise AssertionError("not called here")


def step(tool_name: str, result: dict) -> ExecutedStep:
    return ExecutedStep(tool_call_id="c1", tool=tool_name, args={"order_id": "A-1002"}, status="ok",
                        observation=json.dumps(result, sort_keys=True), outcome="ok")


RESULT = {"id": "A-1002", "total_cents": 7550, "refunded_cents": 1200, "currency": "JPY", "items": 3, "note": HOSTILE}


def test_a_read_results_money_is_shown_in_words_on_every_surface() -> None:
    catalog = OWN.catalog()
    schema = catalog.get("order_total").result_schema
    assert schema is not None and schema["properties"]["total_cents"]["x-money"] == EUR["x-money"]
    assert catalog.get("order_as_dict").result_schema is None

    [found] = found_steps([step("order_total", RESULT)], catalog)
    # Raw values stay as the tool returned them; the words beside them (the summary fields only).
    assert found.fields == {"id": "A-1002", "total_cents": 7550, "items": 3, "note": HOSTILE}
    assert found.money == {"total_cents": "75.50 EUR"}
    [every] = found_steps([step("order_total", {**RESULT, "note": "x"})], catalog.model_copy(
        update={"tools": [catalog.get("order_total").model_copy(update={"summary_fields": []})]}))
    # A currency named by another field of the result (JPY, no minor units).
    assert every.money == {"total_cents": "75.50 EUR", "refunded_cents": "1200 JPY"}
    # Undeclared: the number alone, never guessed from a field's name.
    [plain] = found_steps([step("order_as_dict", RESULT)], catalog)
    assert plain.fields["total_cents"] == 7550 and plain.money == {}

    # The CLI (`tether status`, the approve prompt).
    [line] = found_lines([found])
    assert "total_cents: 75.50 EUR (7550)" in line and "items: 3," in line, line
    assert "\x1b" not in line and '"late\\x1b[2J <b>x</b>"' in line, line
    [undeclared] = found_lines([plain])
    assert undeclared.endswith("total_cents: 7550") and "EUR" not in undeclared, undeclared

    # The inbox's run page (autoescaped, hostile text inert).
    page = templates().env.get_template("_run_live.html").render(
        run={"found": [found.model_dump(mode="json")], "policy": {}, "steps": [], "web_ui": "http://ui"})
    assert '<code>total_cents</code> = <strong class="money">75.50 EUR</strong> (7550)' in page, page
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page

    # The Web UI's current details (markdown: the value in a code span).
    details = "\n".join(_found_lines(SimpleNamespace(executed=[step("order_total", RESULT)]), catalog, "run-1"))
    assert "total\\_cents `75.50 EUR (7550)`" in details, details
    assert "items `3`" in details and "\x1b" not in details, details


def test_a_tool_module_loads_into_a_registry_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = "own_tools_" + tmp_path.name.replace("-", "_")
    (tmp_path / f"{name}.py").write_text(
        "from pydantic import BaseModel\n"
        "from tether import ToolContext, ToolEffect, tool\n\n"
        "class A(BaseModel):\n    x: int\n\n"
        "@tool(effect=ToolEffect.READ_ONLY)\n"
        f"def {name}_read(args: A, ctx: ToolContext) -> dict:\n    '''Read.'''\n    return {{}}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    own = load_tool_modules([name], ToolRegistry())
    assert list(own.tools) == [f"{name}_read"]
    assert REGISTRY.get(f"{name}_read") is None  # the process-wide registry is left as it was
    # A second registry of its own, the module already imported: the same tools.
    again = load_tool_modules([name], ToolRegistry())
    assert list(again.tools) == [f"{name}_read"] and again.get(f"{name}_read") is own.get(f"{name}_read")
    monkeypatch.delitem(sys.modules, name)
