"""The pure parts of MCP support: annotations -> effect class under the trust policy, the config
file's errors (line and key), and destructive tools in the approval's risk summary and policy."""

from __future__ import annotations

import pytest

from tether.tools.mcp_config import McpConfigError, parse_config
from workflows.mcp_effects import Hints, effect_for
from workflows.contract import Plan, PlanStep, ToolCatalog, ToolEffect, ToolInfo
from workflows.policy_file import HighRisk, TenantPolicy
from workflows.policy import review_plan

E = ToolEffect
READ_ONLY = Hints(read_only=True, idempotent=True, destructive=False)


@pytest.mark.parametrize(
    ("hints", "effect", "destructive"),
    [
        (READ_ONLY, E.READ_ONLY, False),
        (Hints(read_only=True), E.READ_ONLY, False),
        (Hints(read_only=False, idempotent=True, destructive=False), E.IDEMPOTENT, False),
        (Hints(read_only=False, idempotent=True, destructive=True), E.IDEMPOTENT, True),
        (Hints(read_only=False, idempotent=False, destructive=False), E.UNSAFE, False),
        (Hints(idempotent=True), E.IDEMPOTENT, True),  # destructiveHint left out: the spec's default, true
        (Hints(), E.UNSAFE, True),  # annotations without behaviour hints
        (None, E.UNSAFE, True),  # no annotations at all
    ],
)
def test_trusted_server_annotations_decide(hints: Hints | None, effect: ToolEffect, destructive: bool) -> None:
    decision = effect_for(hints, trusted=True)
    assert (decision.effect, decision.destructive) == (effect, destructive)
    assert decision.why


@pytest.mark.parametrize("hints", [READ_ONLY, Hints(read_only=False, idempotent=True, destructive=False), None])
def test_untrusted_server_annotations_are_ignored(hints: Hints | None) -> None:
    decision = effect_for(hints, trusted=False)
    assert decision.effect == E.UNSAFE and decision.destructive
    assert decision.why.startswith("untrusted server")


def test_operator_override_wins_over_annotations_and_trust() -> None:
    assert effect_for(READ_ONLY, trusted=True, override=E.UNSAFE).effect == E.UNSAFE
    untrusted = effect_for(READ_ONLY, trusted=False, override=E.READ_ONLY)
    assert (untrusted.effect, untrusted.destructive) == (E.READ_ONLY, False)
    assert untrusted.why == "override: effect = read_only"
    marked = effect_for(Hints(read_only=False, idempotent=True, destructive=False), trusted=True, destructive_override=True)
    assert (marked.effect, marked.destructive) == (E.IDEMPOTENT, True)
    assert "override: destructive = true" in marked.why


# ----------------------------------------------------------------------------- the config file


def test_config_parses_and_resolves_cwd_against_the_file(tmp_path) -> None:
    config = parse_config(
        '[servers.git]\ncommand = "mcp-server-git"\ncwd = "repo"\ntrust_annotations = true\n'
        '[servers.git.tools.git_commit]\neffect = "unsafe"\nsummary_fields = ["message"]\n',
        base=tmp_path,
    )
    git = config.servers["git"]
    assert git.cwd == str(tmp_path / "repo") and git.trust_annotations
    assert git.tools["git_commit"].effect == E.UNSAFE and git.tools["git_commit"].summary_fields == ["message"]
    assert not parse_config('[servers.time]\nurl = "http://127.0.0.1:9/mcp"\n').servers["time"].trust_annotations


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[servers.git]\ncommand = "x"\n\n[servers.git.tools.git_add]\neffect = "sometimes"\n',
         "line 5, key servers.git.tools.git_add.effect: Input should be"),
        ('[servers.git]\ncommand = "x"\ntrust_annotation = true\n', "line 3, key servers.git.trust_annotation: Extra inputs"),
        ('[servers.git]\nargs = ["-v"]\n', "line 1, key servers.git: Value error, set exactly one of command"),
        ('[servers.git]\ncommand = "x"\nurl = "http://h/mcp"\n', "key servers.git: Value error, set exactly one"),
        ('[servers.git]\ncommand = "x"\n[servers.git.tools.put]\neffect = "reconcilable"\n',
         "line 3, key servers.git.tools.put: Value error, effect \"reconcilable\" needs lookup"),
        ('[servers.a__b]\ncommand = "x"\n', "key servers: Value error, server name 'a__b'"),
        ('[servers.git]\ncommand = "x"\ntimeout = 0\n', "line 3, key servers.git.timeout: Input should be greater than 0"),
        ("[servers.git\n", "not valid TOML"),
    ],
)
def test_config_errors_name_the_line_and_key(text: str, expected: str) -> None:
    with pytest.raises(McpConfigError) as err:
        parse_config(text, "mcp.toml")
    assert str(err.value).startswith("mcp.toml: ") and expected in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- policy


def _catalog() -> ToolCatalog:
    schema = {"type": "object"}
    return ToolCatalog(tools=[
        ToolInfo(name="git__git_status", effect=E.READ_ONLY, requires_approval=False, args_schema=schema,
                 timeout_seconds=30, max_retries=3, source="mcp:git"),
        ToolInfo(name="git__git_reset", effect=E.IDEMPOTENT, requires_approval=True, args_schema=schema,
                 timeout_seconds=30, max_retries=3, destructive=True, source="mcp:git"),
        ToolInfo(name="git__git_add", effect=E.IDEMPOTENT, requires_approval=True, args_schema=schema,
                 timeout_seconds=30, max_retries=3, source="mcp:git"),
    ])


def _plan(*tools: str) -> Plan:
    steps = [PlanStep(tool_call_id=f"c{i}", tool=t, args={"repo_path": "."}) for i, t in enumerate(tools)]
    return Plan(steps=steps, plan_hash=Plan.hash_steps(steps))


def test_destructive_tools_show_in_the_risk_summary_and_match_high_risk() -> None:
    normal = review_plan(_plan("git__git_status", "git__git_reset"), _catalog(), None)
    assert normal.risk == "normal" and "git__git_reset (cannot be undone; may destroy data)" in normal.summary
    strict = TenantPolicy(high_risk=HighRisk(destructive=True, approvals=2))
    high = review_plan(_plan("git__git_status", "git__git_reset"), _catalog(), strict)
    assert (high.risk, high.approvals_required) == ("high", 2)
    # Only destructive tools count: an additive write stays normal, a read needs no approval.
    assert review_plan(_plan("git__git_add"), _catalog(), strict).risk == "normal"
    assert not review_plan(_plan("git__git_status"), _catalog(), strict).needs_approval


# ----------------------------------------------------------------------------- listings -> registry


def test_untrusted_listings_are_bounded_and_checked_before_they_reach_the_catalog(caplog) -> None:
    from mcp.types import Tool, ToolAnnotations

    from tether.tools.mcp_catalog import MAX_DESCRIPTION_CHARS, MAX_SERVER_CATALOG_CHARS, tool_specs
    from tether.tools.mcp_session import Connection

    ok = {"type": "object", "properties": {"x": {"$ref": "#/$defs/X"}}, "$defs": {"X": {"type": "string"}}}
    config = parse_config(
        '[servers.s]\ncommand = "x"\ntrust_annotations = true\n'
        '[servers.s.tools.put]\neffect = "reconcilable"\nlookup = "missing"\n'
        '[servers.s.tools.ghost]\neffect = "unsafe"\n'
    ).servers["s"]
    tools = [
        Tool(name="good", description="d" * 5000, input_schema=ok, annotations=ToolAnnotations(read_only_hint=True)),
        Tool(name="bad.name/x", input_schema={"type": "object"}),
        Tool(name="broken", input_schema={"type": "objekt"}),
        Tool(name="remote", input_schema={"type": "object", "properties": {"x": {"$ref": "https://evil.example/s.json"}}}),
        Tool(name="huge", input_schema={"type": "object", "description": "h" * MAX_SERVER_CATALOG_CHARS}),
        Tool(name="put", input_schema={"type": "object"}),
    ]
    specs = {s.name: s for s in tool_specs("s", config, Connection("s", config), tools)}
    assert sorted(specs) == ["s__good", "s__put"]
    assert specs["s__good"].effect == E.READ_ONLY and len(specs["s__good"].description) == MAX_DESCRIPTION_CHARS
    # reconcilable without its lookup tool on the server: the safe class instead.
    assert specs["s__put"].effect == E.UNSAFE and "'missing' is not published" in specs["s__put"].why
    log = caplog.text
    assert "'bad.name/x' left out: 's__bad.name/x' is not a valid tool name" in log
    assert "'broken' left out: invalid input schema" in log
    assert "'remote' left out: input schema refers outside itself" in log
    assert "'huge' left out: the server's tools exceed" in log
    assert "the config names tool 'ghost', which the server does not publish" in log
