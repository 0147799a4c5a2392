"""Names of people, as the runtime compares them: normalised before anything is compared.

Pure: no Temporal, no I/O (the confusables data is read once, when this module is imported
outside the workflow sandbox). ``alice``, ``Alice`` and ``ＡＬＩＣＥ`` (full-width) are one
person; ``alice `` and ``alice\\u200b`` are refused, not silently merged: a name with whitespace
or an invisible character is a name somebody chose to look like another one. So is a name a
person cannot tell from another one (Unicode UTS #39, with the confusables and script data the
``confusable-homoglyphs`` package ships from Unicode's own files):

- a name that **mixes scripts** (``аlice`` with a Cyrillic ``а``) is refused; Latin with Han and
  Hiragana/Katakana, Bopomofo or Hangul (how Japanese, Chinese and Korean names are written) is
  one writing system;
- a name with a non-ASCII letter that, whole, **reads as an ASCII name** (``аѕе`` in Cyrillic,
  ``ɑlice`` with a Latin alpha) is refused: it would show on a record as somebody else;
- names that pass are compared by their **skeleton** where telling two people apart matters
  (four-eyes, distinct approvers, the policy file's approvers): ``a1ice`` is not alice's second
  approver, and ``rnallory`` is mallory.
"""

from __future__ import annotations

import functools
import unicodedata
from typing import Annotated

from confusable_homoglyphs import categories as _scripts
from confusable_homoglyphs import confusables as _confusables
from pydantic import AfterValidator, Field

MAX_NAME_CHARS = 128
# Control, format (zero-width joiners, bidi marks), private-use, surrogate, unassigned, and
# every kind of separator: none of them belongs in a name a person reads and trusts.
_INVISIBLE = frozenset({"Cc", "Cf", "Co", "Cs", "Cn", "Zs", "Zl", "Zp"})
# Characters of every script (digits, punctuation) and combining marks: never "another script".
_ANY_SCRIPT = frozenset({"COMMON", "INHERITED"})
# UTS #39 "highly restrictive": the script sets one writing system uses.
_ONE_SYSTEM = (
    frozenset({"LATIN", "HAN", "HIRAGANA", "KATAKANA"}),
    frozenset({"LATIN", "HAN", "BOPOMOFO"}),
    frozenset({"LATIN", "HAN", "HANGUL"}),
)
# The refusal's words: AgentRun records such a name under the rule ``look_alike_name``.
LOOK_ALIKE = "a name people could not tell from another one"


@functools.cache
def _prototypes() -> dict[str, str]:
    """Each confusable character -> the one string standing for its class (UTS #39's prototype).

    The package lists, for every character, the characters it is confusable with (both ways,
    from Unicode's confusables.txt). Its classes are disjoint stars around one prototype; a
    multi-character prototype ("rn" for "m") is the class's representative, else the lowest code
    point (any fixed member gives the same equality). Built from data already in memory.
    """
    bidi = dict.fromkeys(map(ord, "\u200e\u200f"))  # the package keeps RTL characters wrapped
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for key, glyphs in sorted(_confusables.confusables_data.items()):
        a = key.translate(bidi)
        for glyph in glyphs:
            b = glyph["c"].translate(bidi)
            if a and b and (ra := find(a)) != (rb := find(b)):
                parent[max(ra, rb)] = min(ra, rb)
    classes: dict[str, list[str]] = {}
    for member in list(parent):
        classes.setdefault(find(member), []).append(member)
    prototype: dict[str, str] = {}
    for members in classes.values():
        multi = [m for m in members if len(m) > 1]
        chosen = min(multi or members, key=lambda m: (len(m), [ord(c) for c in m]))
        prototype.update((m, chosen) for m in members if len(m) == 1 and m != chosen)
        # How a refusal shows the name it looks like: the class's ASCII member, a small letter first.
        ascii_ = sorted((m for m in members if m.isascii()), key=lambda m: (not m.islower(), len(m), m))
        if ascii_:
            _ASCII_TWIN.update((m, ascii_[0]) for m in members if len(m) == 1 and not m.isascii())
    return prototype


_ASCII_TWIN: dict[str, str] = {}


def skeleton(name: str) -> str:
    """UTS #39's skeleton (NFD, each character to its prototype, NFD), case-folded and taken to
    a fixed point: two names with one skeleton look alike."""
    table = _prototypes()
    text = unicodedata.normalize("NFD", name).casefold()
    for _ in range(8):
        mapped = unicodedata.normalize("NFD", "".join(table.get(ch, ch) for ch in text)).casefold()
        if mapped == text:
            break
        text = mapped
    return text


def same_person(a: str, b: str) -> bool:
    """Whether two (normalised) names are, or look like, the same person."""
    return a == b or skeleton(a) == skeleton(b)


def _scripts_of(name: str) -> set[str]:
    return {_scripts.alias(ch) for ch in name} - _ANY_SCRIPT


def _reads_as_ascii(ch: str) -> bool:
    return ord(ch) < 128 or _scripts.alias(ch) in _ANY_SCRIPT or skeleton(ch).isascii()


def look_alike_problem(name: str) -> str | None:
    """Why a normalised name could be taken for another one (UTS #39), or None."""
    if name.isascii():
        return None  # one script (Latin, or none): only a skeleton comparison can tell
    _prototypes()  # the tables, built once
    scripts = _scripts_of(name)
    if len(scripts) > 1 and not any(scripts <= system for system in _ONE_SYSTEM):
        # The character from the script the name uses least: the one that does not belong.
        least = min(sorted(scripts), key=lambda s: sum(_scripts.alias(c) == s for c in name))
        odd = next(ch for ch in name if _scripts.alias(ch) == least)
        twin = "".join(_ASCII_TWIN.get(ch, ch) for ch in name)
        return (
            f"{LOOK_ALIKE}: it mixes scripts ({', '.join(sorted(s.lower() for s in scripts))}; "
            f"U+{ord(odd):04X} is {_scripts.alias(odd).lower()})" + (f" and reads as {twin!r}" if twin.isascii() else "")
        )
    if not name.isascii() and all(_reads_as_ascii(ch) for ch in name):
        odd = next(ch for ch in name if not ch.isascii())
        twin = "".join(_ASCII_TWIN.get(ch, ch) for ch in name)
        return f"{LOOK_ALIKE}: it reads as {twin!r} (U+{ord(odd):04X} looks like {_ASCII_TWIN.get(odd, '?')!r})"
    return None


def normalize_name(raw: str) -> str:
    """NFKC, then case-folded; raises ValueError for an empty, too long, disguised or look-alike
    name."""
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
    if (problem := look_alike_problem(name)) is not None:
        raise ValueError(problem)
    return name


# A person's name in any contract: validated and normalised on the way in.
Name = Annotated[str, Field(min_length=1, max_length=4 * MAX_NAME_CHARS), AfterValidator(normalize_name)]
