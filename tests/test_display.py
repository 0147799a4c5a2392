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
    assert markdown_code("a``b") == "```a``b```"
    assert markdown_code("`x") == "`` `x ``"
    assert "\n" not in markdown_code("x\ny")


def test_values_show_as_json_with_strings_escaped() -> None:
    assert show_value("\x1b[31mred") == '"\\x1b[31mred"'
    assert show_value({"amount_cents": 1200}) == '{"amount_cents": 1200}'
    # A value cannot close its own quotes: what follows stays inside it.
    assert show_value('Hi", amount_cents=1200, x="') == '"Hi\\x22, amount_cents=1200, x=\\x22"'
    assert "\n" not in show_value({"s": "a\nb", "t": "\u202e"})
