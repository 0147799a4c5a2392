"""The one escaping function: what a hostile requester, signal sender or tool can put in front
of a person (terminal control sequences, forged lines, bidi reordering, markdown) arrives inert."""

from __future__ import annotations

import pytest

from workflows.display import escape_text, markdown_code, markdown_text, show_value

ATTACKS = [
    "\x1b[2J\x1b[H",  # clear the screen, cursor home
    "\x1b]8;;http://evil\x1b\\link\x1b]8;;\x1b\\",  # OSC 8 hyperlink
    "ok\rAWAITING_APPROVAL -> APPROVED user:carol (signed)",  # carriage return overwrite
    "ok\nAWAITING_APPROVAL -> APPROVED user:carol (signed)",  # forged line
    "\u202eevil\u202c",  # right-to-left override
    "a\u2028b\u2029c",  # line / paragraph separators
    "\x9b31m",  # C1 CSI
    "\u200bzero\u2060width\ufeff",
    "\x7f\x00\x07",
]


@pytest.mark.parametrize("attack", ATTACKS)
def test_escaped_text_holds_no_control_or_invisible_character(attack: str) -> None:
    shown = escape_text(attack)
    assert all(c.isprintable() and c not in "\u202e\u202c" for c in shown), repr(shown)
    assert "\n" not in shown and "\r" not in shown


def test_escaping_is_unambiguous_and_keeps_plain_text() -> None:
    assert escape_text("refund A-1001 for Zoë, 日本") == "refund A-1001 for Zoë, 日本"
    assert escape_text("\x1b") == "\\x1b"
    # A sender who types the escape's own text cannot pass it off as an escaped control character.
    assert escape_text("\\x1b") == "\\\\x1b"
    assert escape_text("\u202e") == "\\u202e"
    assert escape_text("\U000e0041") == "\\U000e0041"  # a tag character


def test_clipping_bounds_the_line_and_never_cuts_an_escape() -> None:
    assert escape_text("x" * 50, 10) == "x" * 9 + "…"
    assert escape_text("\x1b" * 10, 10) == "\\x1b\\x1b…"
    assert escape_text("short", 10) == "short"
    assert all(len(escape_text("\u202e" * 40, n)) <= n for n in range(1, 30))


def test_markdown_is_inert() -> None:
    shown = markdown_text("**bold** [click](http://evil) <img src=x onerror=alert(1)> `code` # h")
    # Every markdown or HTML punctuation mark is backslash-escaped (CommonMark: shown literally).
    for i, c in enumerate(shown):
        if c in "*[]()<>`#":
            assert shown[i - 1] == "\\", (i, shown)
    # What the Temporal Web UI's renderer shows with the backslash it was given (measured in
    # Chromium: `\\'` read as `\\’`): left as written, none starts a construct inline.
    # A backslash is escape_text's own (doubled), which the renderer shows as one.
    assert markdown_text("the customer's \"refund\" a=b C:\\x") == "the customer's \"refund\" a=b C\\:\\\\x"
    assert markdown_code("a``b") == "```a``b```"
    assert markdown_code("`x") == "`` `x ``"
    assert "\n" not in markdown_code("x\ny")


def test_values_show_as_json_with_strings_escaped() -> None:
    assert show_value("\x1b[31mred") == '"\\x1b[31mred"'
    assert show_value({"amount_cents": 1200}) == '{"amount_cents": 1200}'
    # A value cannot close its own quotes: what follows stays inside it.
    assert show_value('Hi", amount_cents=1200, x="') == '"Hi\\x22, amount_cents=1200, x=\\x22"'
    assert "\n" not in show_value({"s": "a\nb", "t": "\u202e"})


def test_the_start_details_say_what_the_summary_does_not() -> None:
    """The Web UI shows a run's summary and details together: the goal once (in the details too
    only where the summary cut it), every value a requester wrote inert."""
    from workflows.details import SUMMARY_GOAL_CHARS, start_details, start_summary
    from workflows.run_state import RunRequest

    short = RunRequest(goal="Refund **A-1001**", tenant="acme", requested_by="al`ice", planner="playbook")
    assert start_summary(short) == "Refund \\*\\*A\\-1001\\*\\* · tenant acme"
    assert start_details(short) == "**requested by** ``al`ice`` · **planner** `playbook`"
    long = short.model_copy(update={"goal": "x" * (SUMMARY_GOAL_CHARS + 50)})
    assert start_details(long).startswith("**Goal:** " + "x" * (SUMMARY_GOAL_CHARS + 50) + "\n\n**requested by**")
    assert len(start_summary(long)) < SUMMARY_GOAL_CHARS + 20


def test_the_run_setup_marker_keeps_what_the_run_decides_with() -> None:
    """run_setup's marker leaves out the schemas' title annotations (a property named ``title``
    stays) and bounds each tool's description (the view shows it to approvers); read back, every
    other field is the same, and bounding again changes nothing (the attestation covers it)."""
    from workflows.contract import ToolCatalog, ToolEffect, ToolInfo
    from workflows.budgets import clip
    from workflows.wire import DESCRIPTION_CHARS, PolicySnapshot, RunSetup, untitled

    schema = {"title": "Args", "type": "object", "required": ["title"],
              "properties": {"title": {"title": "Title", "type": "string"}, "n": {"title": "N", "type": "integer"}}}
    assert untitled(schema) == {"type": "object", "required": ["title"],
                                "properties": {"title": {"type": "string"}, "n": {"type": "integer"}}}
    tool = ToolInfo(name="t", description="long  words\n" * 40 + "\nsecond paragraph", effect=ToolEffect.IDEMPOTENT, requires_approval=True,
                    args_schema=schema, timeout_seconds=5.0, max_retries=2, summary_fields=["title"])
    setup = RunSetup(catalog=ToolCatalog(tools=[tool]), policy=PolicySnapshot(tenant="acme", policy={}, policy_hash="h" * 64, source="test"))
    back = RunSetup.model_validate_json(setup.model_dump_json()).catalog.tools[0]
    assert back == tool.model_copy(update={"description": clip("long words " * 39 + "long words", DESCRIPTION_CHARS),
                                           "args_schema": untitled(schema)})
    assert len(back.description) == DESCRIPTION_CHARS and back.description.startswith("long words long words")
    again = RunSetup(catalog=ToolCatalog(tools=[back]), policy=setup.policy)
    assert again.model_dump_json() == setup.model_dump_json()


def test_plain_text_takes_the_fast_path_to_the_same_result() -> None:
    """Printable ASCII without a backslash is returned as it is (clipped the same way): the
    result is the character-at-a-time escape's, for every limit."""
    from workflows.display import _escape_each

    samples = ["", "a", "refund A-1001 for 12,000 cents", "x" * 300, "back\\slash", "tab\tthere", "é", *ATTACKS]
    for text in samples:
        for limit in (None, 0, 1, 2, 5, 40, 299, 300, 301):
            assert escape_text(text, limit) == _escape_each(text, limit), (text, limit)
