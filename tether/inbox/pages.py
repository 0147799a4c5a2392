"""How the inbox renders its pages: the templates and static files that ship inside the package
(``tether/inbox/templates``, ``tether/inbox/static``), and the Jinja environment they render in.
"""

from __future__ import annotations

from pathlib import Path

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
    return Jinja2Templates(env=env)
