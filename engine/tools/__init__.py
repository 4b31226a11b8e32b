"""Tool calling: the per-family tool-call parsers, the grammar that constrains a tool call, and tool output formatting."""
