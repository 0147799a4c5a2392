"""An MCP server whose tool listing is partly bad, run as a stdio subprocess by tests/activities/test_mcp.py:

    python tests/helpers/mcp_bad_listing_server.py

Plain JSON-RPC over stdio, no SDK: the SDK's server checks its own results, and this server
must break the rules a well-behaved one keeps. It lists:

- ``echo`` (read only): a ``text`` argument with the nested-quantifier pattern ``^(\\w+\\s?)+$``,
  which takes Python's backtracking ``re`` minutes on a 32-character non-match; RE2 is linear;
- ``twice``, listed two times (with different schemas);
- ``lookahead``: a pattern with lookahead, which no linear-time engine takes;
- ``broken``: an input schema that is not a valid JSON schema (``type: 12``);
- ``huge``: an input schema over the server's catalog budget;
- an entry with no ``name`` and one whose ``inputSchema`` is a string (the protocol's ``Tool``
  type refuses both).

Only ``echo`` is a tool a worker should offer.
"""

from __future__ import annotations

import json
import sys

NESTED = r"^(\w+\s?)+$"
READ_ONLY = {"readOnlyHint": True}


def text_schema(pattern: str) -> dict:
    return {"type": "object", "properties": {"text": {"type": "string", "pattern": pattern}}, "required": ["text"]}


def tool(name: str, schema: object, description: str = "A tool.") -> dict:
    return {"name": name, "description": description, "inputSchema": schema, "annotations": READ_ONLY}


TOOLS = [
    tool("echo", text_schema(NESTED), "Echoes words back (read only)."),
    tool("twice", text_schema("^a+$")),
    tool("lookahead", text_schema("^(?=x)x+$")),
    tool("broken", {"type": "object", "properties": {"x": {"type": 12}}}),
    tool("huge", {"type": "object", "description": "x" * 300_000}),
    tool("twice", {"type": "object"}),
    {"description": "no name", "inputSchema": {"type": "object"}},
    tool("stringschema", "not a schema"),
]


def answer(request: dict) -> dict | None:
    method, params = request.get("method"), request.get("params") or {}
    if "id" not in request:
        return None  # a notification
    if method == "initialize":
        result = {
            "protocolVersion": params.get("protocolVersion", "2025-06-18"),
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "tether-bad-listing", "version": "1"},
        }
    elif method == "tools/list":
        result = {"tools": TOOLS}
    elif method == "tools/call":
        text = str((params.get("arguments") or {}).get("text", ""))
        result = {"content": [{"type": "text", "text": f"{params.get('name')}: {len(text)} chars"}], "isError": False}
    elif method == "ping":
        result = {}
    else:
        return {"jsonrpc": "2.0", "id": request["id"], "error": {"code": -32601, "message": f"no method {method}"}}
    return {"jsonrpc": "2.0", "id": request["id"], "result": result}


def main() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        reply = answer(json.loads(line))
        if reply is not None:
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
