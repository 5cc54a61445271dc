"""Tool calling's request side: ``parse_tools`` validates ``tools`` and ``tool_choice`` (or the legacy
``functions`` and ``function_call``) into a ``ToolRequest``. For a forced choice, ``constraint_schema`` is
the JSON schema that the grammar engine constrains generation with, as vLLM does it:

* ``tool_choice={"type": "function", "function": {"name": F}}``: the output is F's arguments object.
* ``tool_choice="required"``: the output is a JSON array ``[{"name": N, "parameters": {...}}, ...]``.

The output side, the tool calls found in the model's text, is ``tools.py``'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from appliance.server.protocol import OpenAIError

TOOL_PARSERS = ("hermes", "llama3_json")
MAX_TOOLS = 128
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_DEFAULT_PARAMETERS = {"type": "object"}


# ----------------------------------------------------------------------------------------------------
# Request


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict]  # the validated tools as the client sent them ({"type": "function", "function": {...}})
    choice: str  # "none" | "auto" | "required" | "named"
    function: Optional[str] = None  # the named function when choice == "named"

    def parameters(self, name: str) -> dict:
        """The parameters schema of tool ``name`` (``{"type": "object"}`` when it has none)."""
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or dict(_DEFAULT_PARAMETERS)
        raise KeyError(name)

    def constraint_schema(self) -> Optional[dict]:
        """The JSON schema that constrains generation for a forced choice; None for "none" and "auto"."""
        if self.choice == "named":
            assert self.function is not None  # a named choice names its function
            return self.parameters(self.function)
        if self.choice != "required":
            return None
        names = [tool["function"]["name"] for tool in self.tools]
        variants = [{"properties": {"name": {"type": "string", "enum": [name]}, "parameters": self.parameters(name)},
                     "required": ["name", "parameters"]} for name in names]
        return {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def _check_function(fn: Any, param: str) -> str:
    """Checks one function definition; returns its name."""
    if not isinstance(fn, dict):
        raise _bad(param, f"'{param}' must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(f"{param}.name", f"'{param}.name' must be a string of 1 to 64 letters, digits, '_' or '-'")
    for key, kind, what in (("description", str, "a string"), ("parameters", dict, "a JSON schema object"),
                            ("strict", bool, "a boolean")):
        if fn.get(key) is not None and not isinstance(fn[key], kind):
            raise _bad(f"{param}.{key}", f"'{param}.{key}' must be {what}")
    return name


def _tool_list(body: dict, field: str) -> list[dict]:
    """The validated ``tools`` (or legacy ``functions``, wrapped as tools); [] when absent."""
    items = body.get(field)
    if items is None:
        return []
    if not isinstance(items, list):
        raise _bad(field, f"'{field}' must be a list")
    if len(items) > MAX_TOOLS:
        raise _bad(field, f"'{field}' may hold at most {MAX_TOOLS} functions, not {len(items)}")
    tools, names = [], set()
    for i, item in enumerate(items):
        param = f"{field}[{i}]"
        if field == "tools":
            if not isinstance(item, dict):
                raise _bad(param, f"'{param}' must be an object")
            if item.get("type") != "function":
                raise _bad(f"{param}.type", f"'{param}.type' must be 'function'")
            name = _check_function(item.get("function"), f"{param}.function")
            param = f"{param}.function"
        else:
            name = _check_function(item, param)
            item = {"type": "function", "function": item}
        if name in names:
            raise _bad(f"{param}.name", f"'{param}.name': the function name '{name}' is given twice")
        names.add(name)
        tools.append(item)
    return tools


def _choice(body: dict, field: str, tools: list[dict], listed: str) -> tuple[Optional[str], Optional[str]]:
    """``tool_choice`` (or legacy ``function_call``) as (choice, named function); (None, None) without tools."""
    value = body.get(field)
    if value is None or value == "none":
        return (("auto" if value is None else "none") if tools else None), None
    if not tools:
        raise _bad(field, f"'{field}' needs '{listed}'")
    modes = ("auto", "required") if field == "tool_choice" else ("auto",)
    if isinstance(value, str) and value in modes:
        return value, None
    if field == "tool_choice":
        shape = "'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}"
        fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    else:
        shape = "'none', 'auto' or {\"name\": ...}"
        fn = value
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad(field, f"'{field}' must be {shape}")
    if name not in {tool["function"]["name"] for tool in tools}:
        raise _bad(field, f"'{field}' names the function '{name}', which is not in '{listed}'")
    return "named", name


def parse_tools(body: dict) -> Optional[ToolRequest]:
    """The request's tools and tool choice, validated; None when it gives no tools."""
    tools, functions = _tool_list(body, "tools"), _tool_list(body, "functions")
    if tools and functions:
        raise _bad("functions", "give either 'tools' or the legacy 'functions', not both")
    choice, function = _choice(body, "tool_choice", tools, "tools")
    legacy_choice, legacy_function = _choice(body, "function_call", functions, "functions")
    if not (tools or functions):
        return None
    if functions:
        assert legacy_choice is not None  # a mode when its list is given
        return ToolRequest(functions, legacy_choice, legacy_function)
    assert choice is not None
    return ToolRequest(tools, choice, function)


def foreign_tools(tools: Any, is_function: Callable[[dict], bool], function: Callable[[dict], dict],
                  what: str) -> Optional[list[dict]]:
    """Another API's ``tools`` as chat's function tools (``function`` makes a tool's ``{"name", ...}``; None when
    absent), checked afterwards as chat's are."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "'tools' must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not is_function(t):
            raise _bad(f"tools[{i}]", f"'tools[{i}]': only {what} are supported")
        out.append({"type": "function", "function": function(t)})
    return out
