"""The tools of the synthetic tool-calling and agentic rows, as JSON schemas."""

from __future__ import annotations

from typing import Any

_TOOLS: dict[str, tuple[str, dict[str, tuple[str, str]], tuple[str, ...]]] = {
    "get_weather": (
        "Get the current weather for a city.",
        {"city": ("string", "City name, e.g. Paris."), "unit": ("string", "celsius or fahrenheit")},
        ("city",),
    ),
    "search_web": (
        "Search the web and return the top results.",
        {"query": ("string", "Search query."), "limit": ("integer", "How many results.")},
        ("query",),
    ),
    "get_stock_price": ("Get the latest price of a stock.", {"symbol": ("string", "Ticker symbol.")}, ("symbol",)),
    "convert_currency": (
        "Convert an amount between currencies.",
        {
            "amount": ("number", "Amount."),
            "from_currency": ("string", "Source currency."),
            "to_currency": ("string", "Target currency."),
        },
        ("amount", "from_currency", "to_currency"),
    ),
    "send_email": (
        "Send an email.",
        {
            "to": ("string", "Recipient address."),
            "subject": ("string", "Subject line."),
            "body": ("string", "Message body."),
        },
        ("to", "subject", "body"),
    ),
    "create_event": (
        "Create a calendar event.",
        {
            "title": ("string", "Event title."),
            "date": ("string", "Date, YYYY-MM-DD."),
            "duration_minutes": ("integer", "Length."),
        },
        ("title", "date"),
    ),
    "lookup_order": ("Look up an order by id.", {"order_id": ("string", "Order id.")}, ("order_id",)),
    "search_products": (
        "Search the product catalog.",
        {"query": ("string", "Search text."), "max_price": ("number", "Price limit.")},
        ("query",),
    ),
    "query_database": ("Run a read-only SQL query.", {"sql": ("string", "SQL SELECT statement.")}, ("sql",)),
    "get_directions": (
        "Get directions between two places.",
        {
            "origin": ("string", "Start."),
            "destination": ("string", "End."),
            "mode": ("string", "driving, walking or transit"),
        },
        ("origin", "destination"),
    ),
}
_AGENT_TOOLS: dict[str, tuple[str, dict[str, tuple[str, str]], tuple[str, ...]]] = {
    "list_files": ("List files under a directory.", {"path": ("string", "Directory.")}, ("path",)),
    "read_file": ("Read a file from the repository.", {"path": ("string", "File path.")}, ("path",)),
    "search_code": (
        "Search the repository with a regular expression.",
        {"pattern": ("string", "Regex."), "path": ("string", "Where to search.")},
        ("pattern",),
    ),
    "edit_file": (
        "Replace old_str with new_str in a file.",
        {
            "path": ("string", "File path."),
            "old_str": ("string", "Exact text to replace."),
            "new_str": ("string", "Replacement."),
        },
        ("path", "old_str", "new_str"),
    ),
    "run_tests": ("Run the test suite or a subset of it.", {"target": ("string", "Test path or node id.")}, ()),
    "run_command": ("Run a shell command in the repository.", {"command": ("string", "Command line.")}, ("command",)),
}


def _schema(name: str, spec: tuple[str, dict[str, tuple[str, str]], tuple[str, ...]]) -> dict[str, Any]:
    description, params, required = spec
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": t, "description": d} for k, (t, d) in params.items()},
                "required": list(required),
            },
        },
    }


_TOOL_SCHEMAS = {name: _schema(name, spec) for name, spec in _TOOLS.items()}
_AGENT_SCHEMAS = [_schema(name, spec) for name, spec in _AGENT_TOOLS.items()]


# ---------------------------------------------------------------------------------------
# Row generation. One _Gen per shard, driven by the shard's own Random.
