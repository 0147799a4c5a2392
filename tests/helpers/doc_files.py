"""A docs page's fenced blocks as a reader copies them: each block with the ``<!-- file: NAME -->``
or ``<!-- tested -->`` mark before it (tests/docs/test_doc_commands.py runs them; the approval
screens load the page's tool module)."""

from __future__ import annotations

import re

from tests.helpers.paths import ROOT

BLOCK = re.compile(r"(?:<!-- (?:file: (?P<file>[^ ]+)|(?P<tested>tested)) -->\n)?```(?P<lang>\w+)\n(?P<body>.*?)```", re.S)


def page_parts(page: str) -> list[re.Match[str]]:
    """Every fenced block of the page, in order, with the file or `tested` mark before it."""
    return list(BLOCK.finditer((ROOT / page).read_text()))


def page_files(page: str) -> dict[str, str]:
    """The files the page tells its reader to save: name -> text."""
    return {m["file"]: m["body"] for m in page_parts(page) if m["file"]}
