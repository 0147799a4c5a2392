"""How the inbox renders its pages: the templates and static files that ship inside the package
(``tether/inbox/templates``, ``tether/inbox/static``), and the Jinja environment they render in.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import jinja2
from fastapi.templating import Jinja2Templates

from workflows.display import escape_text, show_value

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "templates"
STATIC = HERE / "static"


def templates() -> Jinja2Templates:
    """The inbox's templates. Autoescape on for every template (HTML); untrusted text also goes
    through workflows/display.py (filters t and v), which shows controls, bidi overrides and
    invisible characters as escapes."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True)
    env.filters["t"] = lambda v, limit=None: escape_text("" if v is None else v, limit)
    env.filters["v"] = lambda v, limit=None: show_value(v, limit)
    env.filters["run_href"] = run_href
    return Jinja2Templates(env=env)


def run_href(run_id: str, what: str = "") -> str:
    """The inbox's link to a run (``what``: "", "/live" or "/decide"): its id as data, in the
    query, every character but letters and digits percent-encoded. Never in the path, where a
    browser resolves ``..`` and ``.`` (also ``%2e%2e``) and a ``/`` makes a second segment: the
    row of ``tiny/../victim-2`` would open ``victim-2``."""
    return f"/run{what}?id={quote(run_id, safe='')}"
