"""A request's output constraint, from whichever field asks for one:
``response_format`` (``json_object``, ``json_schema``), the
``structured_outputs`` extension (``json``, ``regex``, ``choice``,
``grammar``, ``json_object``; ``disable_any_whitespace``), vLLM's older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``,
or a forced tool call (``tool_choice`` ``required`` or a named function).
At most one may be given; the constraint is checked here
(``structured_output.check``: the schema, regex or grammar parses, and
uses nothing xgrammar would leave unenforced) so a bad one is a 400 naming
its field before the engine sees it.
"""

from __future__ import annotations

from typing import Any, Optional

from appliance.sampling_params import STRUCTURED_KINDS, SamplingParamsError, StructuredOutputsParams
from appliance.server.protocol import OpenAIError
from appliance.server.tools import ToolRequest

_OPTIONS = ("disable_any_whitespace",)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _from_response_format(fmt: Any) -> Optional[StructuredOutputsParams]:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if not isinstance(kind, str):
        raise OpenAIError(400, "'response_format' must be an object with a string 'type'", param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise OpenAIError(400, "'response_format.json_schema' must be an object with 'name' and 'schema'",
                              param="response_format.json_schema")
        name, schema, strict = spec.get("name"), spec.get("schema"), spec.get("strict")
        if not isinstance(name, str) or not name:
            raise OpenAIError(400, "'response_format.json_schema.name' must be a non-empty string",
                              param="response_format.json_schema.name")
        if not isinstance(schema, dict):
            raise OpenAIError(400, "'response_format.json_schema.schema' must be a JSON schema object",
                              param="response_format.json_schema.schema")
        if strict is not None and not isinstance(strict, bool):
            raise OpenAIError(400, "'response_format.json_schema.strict' must be a boolean",
                              param="response_format.json_schema.strict")
        return StructuredOutputsParams(json=schema)
    raise OpenAIError(400, f"'response_format' type {kind[:40]!r} is unknown; 'text', 'json_object' and "
                           f"'json_schema' are supported", param="response_format")


def _from_structured_outputs(so: Any) -> Optional[StructuredOutputsParams]:
    if so is None:
        return None
    if not isinstance(so, dict):
        raise OpenAIError(400, "'structured_outputs' must be an object", param="structured_outputs")
    for key in so:
        if key not in STRUCTURED_KINDS and key not in _OPTIONS:
            raise OpenAIError(400, f"'structured_outputs.{str(key)[:40]}' is not supported; use one of "
                                   f"{', '.join(STRUCTURED_KINDS)} (and {', '.join(_OPTIONS)})",
                              param=f"structured_outputs.{str(key)[:40]}")
    args = {k: v for k, v in so.items() if v is not None}
    if not isinstance(args.get("disable_any_whitespace", False), bool):
        raise OpenAIError(400, "'structured_outputs.disable_any_whitespace' must be a boolean",
                          param="structured_outputs.disable_any_whitespace")
    if not isinstance(args.get("json_object", False), bool):
        raise OpenAIError(400, "'structured_outputs.json_object' must be a boolean",
                          param="structured_outputs.json_object")
    if "json" in args and not isinstance(args["json"], (dict, str)):
        raise OpenAIError(400, "'structured_outputs.json' must be a JSON schema (an object or its JSON text)",
                          param="structured_outputs.json")
    if "choice" in args and not isinstance(args["choice"], list):
        raise OpenAIError(400, "'structured_outputs.choice' must be a list of strings", param="structured_outputs.choice")
    for key in ("regex", "grammar"):
        if key in args and not isinstance(args[key], str):
            raise OpenAIError(400, f"'structured_outputs.{key}' must be a string", param=f"structured_outputs.{key}")
    try:
        return StructuredOutputsParams(**args)
    except SamplingParamsError as e:
        raise OpenAIError(400, str(e), param=e.param) from None


def constraint_from_body(body: dict, tools: Optional[ToolRequest]) -> tuple[Optional[StructuredOutputsParams], str]:
    """The request's one output constraint (or None) and the field it came
    from; a 400 when more than one field asks for one."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    so = _from_response_format(body.get("response_format"))
    if so is not None:
        found.append(("response_format", so))
    so = _from_structured_outputs(body.get("structured_outputs"))
    if so is not None:
        found.append(("structured_outputs", so))
    for key, kind in _GUIDED.items():
        if body.get(key) is not None:
            found.append((key, _from_structured_outputs({kind: body[key]})))
    if tools is not None and (schema := tools.constraint_schema()) is not None:
        found.append(("tool_choice", StructuredOutputsParams(json=schema)))
    if len(found) > 1:
        raise OpenAIError(400, "only one output constraint may be given; this request has "
                               + ", ".join(f"'{k}'" for k, _ in found), param=found[1][0])
    if not found:
        return None, ""
    return found[0][1], found[0][0]


def check_constraint(so: StructuredOutputsParams, source: str) -> None:
    """A 400 naming the field when the constraint does not compile (or
    asks for what cannot be enforced). Milliseconds: call it off the event loop."""
    from appliance.structured_output import check

    try:
        check(so)
    except SamplingParamsError as e:
        param = e.param if source == "structured_outputs" else source
        raise OpenAIError(400, str(e), param=param) from None
