"""Names of people, as the runtime compares them: normalised before anything is compared.

Pure: no Temporal, no I/O. ``alice``, ``Alice`` and ``ＡＬＩＣＥ`` (full-width) are one person;
``alice `` and ``alice\\u200b`` are refused, not silently merged: a name with whitespace or an
invisible character is a name somebody chose to look like another one.
"""

from __future__ import annotations

import unicodedata
from typing import Annotated

from pydantic import AfterValidator, Field

MAX_NAME_CHARS = 128
# Control, format (zero-width joiners, bidi marks), private-use, surrogate, unassigned, and
# every kind of separator: none of them belongs in a name a person reads and trusts.
_INVISIBLE = frozenset({"Cc", "Cf", "Co", "Cs", "Cn", "Zs", "Zl", "Zp"})


def normalize_name(raw: str) -> str:
    """NFKC, then case-folded; raises ValueError for an empty, too long or disguised name."""
    name = unicodedata.normalize("NFKC", raw).casefold()
    if not name:
        raise ValueError("a name cannot be empty")
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"a name has at most {MAX_NAME_CHARS} characters")
    for ch in name:
        if ch.isspace() or unicodedata.category(ch) in _INVISIBLE:
            raise ValueError(
                f"a name cannot contain whitespace or invisible characters (U+{ord(ch):04X})"
            )
    return name


# A person's name in any contract: validated and normalised on the way in.
Name = Annotated[str, Field(min_length=1, max_length=4 * MAX_NAME_CHARS), AfterValidator(normalize_name)]
