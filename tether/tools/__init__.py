"""Tools: the tool SDK (``@tool``, ``ToolContext``, the registry) and tools from MCP servers."""
