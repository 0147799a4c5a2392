"""The docs a newcomer reads: the README fits on a few screens and has a table of contents, its
CLI table is the argument parser's, every relative link resolves, nothing points outside the
repository, and user docs carry no internal history."""

from __future__ import annotations

import re
from pathlib import Path

import starter

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
USER_DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_readme_is_short_with_a_table_of_contents() -> None:
    text = README.read_text()
    assert len(text.encode()) < 15_000, f"README.md is {len(text.encode())} bytes: move reference material to docs/"
    assert "## Contents" in text
    toc = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    sections = {slug(h) for h in re.findall(r"^## (.+)$", text, re.M)} - {"contents"}
    assert {m for m in re.findall(r"\]\(#([^)]+)\)", toc)} == sections


def test_readme_cli_table_is_generated_from_the_parser() -> None:
    text = README.read_text()
    block = re.search(r"<!-- cli-table:[^>]*-->\n(.*?)\n<!-- /cli-table -->", text, re.S)
    assert block, "README.md has no <!-- cli-table --> block"
    assert block.group(1) == starter.cli_table(), (
        "README's CLI table is out of date: paste the output of "
        "`.venv/bin/python -c 'import starter; print(starter.cli_table())'`"
    )


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in [*USER_DOCS, ROOT / "CHANGELOG.md"]:
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not ours to check offline
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists() or not resolved.is_relative_to(ROOT):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_user_docs_stay_inside_the_repository_and_carry_no_history() -> None:
    for page in [*USER_DOCS, ROOT / "CHANGELOG.md"]:
        text = page.read_text()
        assert "../shared" not in text and "ARCHITECTURE.md" not in text, page
    for page in USER_DOCS:
        text = page.read_text()
        assert not re.search(r"Migration note|\bissue #?\d+\b", text, re.I), page


def test_the_contracts_transition_table_is_the_codes() -> None:
    from workflows.states import TRANSITIONS, RunState

    text = (ROOT / "docs/contract.md").read_text()
    rows = re.findall(r"^\| ([A-Z_]+) \| (.+) \|$", text, re.M)
    documented = {
        RunState(src): {RunState(t.strip()) for t in re.sub(r"\([^)]*\)", "", targets).split(",")}
        for src, targets in rows
    }
    assert documented == {s: set(out) for s, out in TRANSITIONS.items() if out}
