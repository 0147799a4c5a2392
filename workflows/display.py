"""The one way text from outside is shown to a person.

Whatever came from a model, a requester, a signal, a tool or an MCP server (risk summaries,
record reasons, comments, run ids, argument values) reaches a terminal, the Web UI's details,
a webhook or an inbox page only through these functions. Pure and deterministic, so the
workflow (which writes the Web UI details) and every client use the same code.

- `escape_text` makes a string safe for a terminal line: C0/C1 controls, DEL, ESC, bidi
  overrides and other invisible or line-breaking characters are shown as `\\x1b`, `\\u202e`…,
  and a backslash as `\\\\`, so an escaped text cannot be mistaken for another one and no
  sender can start a new line, move the cursor, recolour the screen or reorder what is shown.
- `markdown_text` does the same and makes markdown and HTML inert, for prose in markdown.
- `markdown_code` shows a value inside an inline code span (argument values, ids, hashes).
"""

from __future__ import annotations

import json
import unicodedata

__all__ = ["approve_command", "escape_text", "markdown_code", "markdown_text", "shell_word", "show_value"]

# Unicode categories a person cannot see or that change how the rest of the line is shown:
# controls (Cc: C0, DEL, C1), format characters (Cf: bidi embeddings/overrides/isolates, zero-width
# joiners and spaces, the BOM, soft hyphen...), line and paragraph separators (Zl, Zp), surrogates
# (Cs), private use (Co) and unassigned code points (Cn).
_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})
# Spaces other than the plain one look like a space but are not one (U+00A0, U+2007, U+3000...).
_ODD_SPACES = frozenset(c for c in map(chr, range(0x80, 0x3001)) if unicodedata.category(c) == "Zs")
# Markdown and HTML punctuation that can start a construct (CommonMark's escapable set), less
# what the Temporal Web UI's renderer shows with its backslash (" ' =) and never starts a
# construct inline (a run of = under a line needs a line of its own: escape_text keeps one
# line), and the backslash, which escape_text has doubled already (the renderer shows one).
_MARKDOWN = frozenset("`*_{}[]()<>#+-.!|~&:$")
_ELLIPSIS = "…"


def _escape_char(c: str) -> str:
    code = ord(c)
    if c == "\\":
        return "\\\\"
    if code < 0x80 and (code < 0x20 or code == 0x7F):
        return f"\\x{code:02x}"
    if code >= 0x80 and (unicodedata.category(c) in _HIDDEN_CATEGORIES or c in _ODD_SPACES):
        return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
    return c


def escape_text(value: object, limit: int | None = None) -> str:
    """`value` (a str, or anything: shown as its str) as one safe terminal line.

    `limit` bounds the result in characters (escapes count at their shown length); a clipped
    text ends with an ellipsis. Never raises.
    """
    text = value if isinstance(value, str) else str(value)
    if text.isascii() and text.isprintable() and "\\" not in text:
        # Nothing to escape (the common case, checked at C speed): only the clip, each
        # character one long, exactly as below.
        if limit is None or len(text) <= limit:
            return text
        return text[: max(limit - 1, 0)] + _ELLIPSIS
    return _escape_each(text, limit)


def _escape_each(text: str, limit: int | None) -> str:
    """escape_text, a character at a time."""
    out: list[str] = []
    length = 0
    for c in text:
        piece = _escape_char(c)
        out.append(piece)
        length += len(piece)
        if limit is not None and length > limit:
            # Clip whole escapes only, and leave room for the ellipsis.
            while out and length + len(_ELLIPSIS) > limit:
                length -= len(out.pop())
            out.append(_ELLIPSIS)
            break
    return "".join(out)


def markdown_text(value: object, limit: int | None = None) -> str:
    """Untrusted prose for a markdown page: escaped as `escape_text`, then inert as markdown."""
    return "".join(f"\\{c}" if c in _MARKDOWN else c for c in escape_text(value, limit))


def markdown_code(value: object, limit: int | None = None) -> str:
    """Untrusted value shown inside an inline code span, whatever backticks it holds."""
    text = escape_text(value, limit)
    longest = run = 0
    for c in text:
        run = run + 1 if c == "`" else 0
        longest = max(longest, run)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text.strip() else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def show_value(value: object, limit: int | None = None) -> str:
    """An argument or summary value (any JSON value) as one escaped line: strings as JSON strings."""
    if isinstance(value, str):
        # Quoted, a quote inside shown as \x22: a value cannot close its own quotes and pass off
        # what follows as another field, even once escaped again by a display that quotes it.
        inner = escape_text(value, None if limit is None else max(limit - 2, 1)).replace('"', "\\x22")
        return f'"{inner}"'
    try:
        text = json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    except (TypeError, ValueError):
        text = str(value)
    return escape_text(text, limit)


def shell_word(word: str) -> str:
    """``word`` as one POSIX shell word (shlex.quote, without importing shlex into the sandbox)."""
    if word and all(c.isascii() and (c.isalnum() or c in "@%+=:,./-_") for c in word):
        return word
    return "'" + word.replace("'", "'\"'\"'") + "'"


def approve_command(run_id: str, plan_hash: str) -> str:
    """The command a person pastes to approve this plan: bound to the hash they were shown (the
    12-character form Tether prints), the run id one shell word whatever it holds."""
    return f"tether approve {shell_word(run_id)} --by NAME --plan-hash {shell_word(plan_hash[:12])}"
