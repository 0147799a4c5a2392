"""A tool of one's own, as a newcomer writes it: docs/writing-tools.md's ``goodwill.py`` and its
playbook, saved from the page into a folder of the test's and loaded (as the worker's ``--tools``
does) into a tool registry of its own, never the process-wide one; then a model's run of those
two steps waiting on an approver, on an inbox stack whose worker serves that registry."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import pytest

from examples.fake_openai import call, text, tool_calls
from tests.helpers.fake_model import fake_model
from tether.tools.sdk import ToolRegistry, load_tool_modules
from tests.helpers.doc_files import page_files
from tests.helpers.inbox_stack import Stack

PAGE = "docs/writing-tools.md"
MODULE = "goodwill"
# The page's `tether start --goal ...` (checked against the page: the test follows it).
GOAL = "Goodwill credit on order A-1002: it arrived late"


@contextmanager
def goodwill_tools(folder: Path) -> Iterator[ToolRegistry]:
    """The page's tool module, saved in ``folder`` and loaded into a registry of its own."""
    files = page_files(PAGE)
    assert f'--goal "{GOAL}"' in (Path(__file__).resolve().parents[2] / PAGE).read_text(), "the page's goal changed"
    (folder / f"{MODULE}.py").write_text(files[f"{MODULE}.py"])
    sys.path.insert(0, str(folder))
    try:
        yield load_tool_modules([MODULE], ToolRegistry())
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(MODULE, None)


@asynccontextmanager
async def a_model_looks_up_then_credits(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    """The page's two steps as a newcomer's model runs them (``--planner model``: a plan is
    approved before any of its steps runs, so only a planner that reads first has found
    something to show): it looks order A-1002 up with ``order_balance`` (a read: it runs at
    once), then proposes the page's ``goodwill_credit``; alice asked. Yields its run id once it
    waits on an approver and is listed so; the model stays up to answer once the credit is made."""
    lookup, credit = json.loads(page_files(PAGE)[f"{MODULE}.playbook.json"])
    with fake_model(monkeypatch) as fake:
        fake.script(tool_calls(call(lookup["tool"], lookup["args"])), tool_calls(call(credit["tool"], credit["args"])),
                    text("Credited 5.00 EUR on order A-1002."))
        run_id = await stack.start(requested_by="alice", goal=GOAL, planner="model", playbook=[])
        await stack.wait(run_id, "AWAITING_APPROVAL")
        await stack.visible(run_id)
        yield run_id
