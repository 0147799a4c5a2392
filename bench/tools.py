"""Trivial tools for the benchmarks: the work they do is negligible, so what is measured is
the orchestration around them. Loaded into the bench worker with ``--tools bench.tools``; their
bodies are in bench/tool_bodies.py.
"""

from __future__ import annotations

from tether.tools.sdk import tool
from bench.tool_bodies import read_value, write_value
from workflows.contract import ToolEffect

bench_read = tool(effect=ToolEffect.READ_ONLY, timeout=30, name="bench_read")(read_value)
bench_write = tool(effect=ToolEffect.IDEMPOTENT, timeout=30, name="bench_write")(write_value)
