"""Which effect class an MCP tool gets: the operator's word, else (trusted servers only) the
server's annotations, else the MCP spec's pessimistic defaults.

Pure: no Temporal, no I/O, no ``mcp`` import (the hints come in as plain values), so the rule is
unit-tested directly and shown as is by ``python -m tether.tools.mcp tools``.

MCP annotations are hints a server makes about itself; the spec says clients must not base
decisions on hints from untrusted servers. So an untrusted server's tools are all ``unsafe``
(run at most once, approval needed) and count as destructive (the spec's default), unless the
operator's configuration says otherwise for a tool.
"""

from __future__ import annotations

from dataclasses import dataclass

from workflows.contract import ToolEffect


@dataclass(frozen=True)
class Hints:
    """The behaviour hints of an MCP ``ToolAnnotations`` (None: the server left it out)."""

    read_only: bool | None = None
    idempotent: bool | None = None
    destructive: bool | None = None


@dataclass(frozen=True)
class EffectDecision:
    effect: ToolEffect
    destructive: bool
    why: str  # shown by `tools`: where the effect came from


def effect_for(
    hints: Hints | None,
    *,
    trusted: bool,
    override: ToolEffect | None = None,
    destructive_override: bool | None = None,
) -> EffectDecision:
    """The effect class of one MCP tool.

    - ``override`` (the operator's configuration) always wins;
    - else, for a trusted server: ``readOnlyHint`` -> read_only; not read-only and
      ``idempotentHint`` -> idempotent; anything else -> unsafe;
    - else (untrusted server, or no annotations): unsafe.

    ``destructive`` (shown in the approval's risk summary, matchable by high-risk rules) follows
    the spec: meaningful for tools that write, true unless a trusted server says false.
    """
    trusted_hints = hints if trusted else None
    if override is not None:
        effect, why = override, f"override: effect = {override.value}"
    elif not trusted:
        effect, why = ToolEffect.UNSAFE, "untrusted server: annotations ignored, unsafe"
    elif hints is None:
        effect, why = ToolEffect.UNSAFE, "no annotations: unsafe (spec default)"
    elif hints.read_only:
        effect, why = ToolEffect.READ_ONLY, "annotation: readOnlyHint"
    elif hints.idempotent:
        effect, why = ToolEffect.IDEMPOTENT, "annotation: idempotentHint, not readOnlyHint"
    else:
        effect, why = ToolEffect.UNSAFE, "annotation: neither readOnlyHint nor idempotentHint"
    if destructive_override is not None:
        destructive = destructive_override
        why += f"; override: destructive = {str(destructive).lower()}"
    elif effect == ToolEffect.READ_ONLY:
        destructive = False
    else:
        destructive = not (trusted_hints is not None and trusted_hints.destructive is False)
        if destructive and trusted_hints is not None and trusted_hints.destructive:
            why += ", destructiveHint"
    return EffectDecision(effect=effect, destructive=destructive, why=why)
