"""Structured output at the HTTP boundary: OpenAI's ``response_format``, and tool calling
(``tools`` / ``tool_choice``) over structured output.

The model is told about the tools in a system message, and its output is held by a grammar
(``tandem.structured``) to what ``tool_choice`` allows: ``required`` or a named function make the
whole output one call ``{"name": ..., "arguments": {...}}`` whose arguments match the function's
``parameters`` schema; ``auto`` allows either such a call or plain text (a Lark grammar with the
call embedded as JSON); ``none`` adds no grammar. A call in the output becomes the message's
``tool_calls`` (``finish_reason: "tool_calls"``), its arguments as a JSON string, as OpenAI
returns them. Conversations carry calls back as assistant messages with ``tool_calls`` and the
results as ``tool`` messages; both are rendered into the prompt as text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from tandem.errors import InvalidRequestError
from tandem.structured import Structure

TOOLS_PROMPT = ("You can call these functions:\n{tools}\n"
                "To call one, reply with only a JSON object {{\"name\": <function name>, \"arguments\": "
                "<its arguments as a JSON object>}}.{rule}")
COMPACT = {"whitespace_flexible": False}  # llguidance's JSON option: calls are written without free whitespace
RULES = {"auto": " Otherwise, answer in plain text.", "required": " You must call one of them.",
         "none": " Do not call any now; answer in plain text."}


def response_format_structure(rf: dict | None) -> Structure | None:
    """OpenAI's ``response_format`` as a grammar: None for text, any JSON object, or a JSON schema
    (enforced whether ``strict`` or not).

    Raises:
        InvalidRequestError: an unknown type or a json_schema without its schema.
    """
    if rf is None:
        return None
    kind = rf.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidRequestError('response_format type must be "text", "json_object" or "json_schema"',
                                  param="response_format.type")
    extra = sorted(set(rf) - ({"type", "json_schema"} if kind == "json_schema" else {"type"}))
    if extra:
        raise InvalidRequestError(f"unknown response_format field(s) for type {kind}: {', '.join(extra)}",
                                  param=f"response_format.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structure("json_object")
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name"), str) or not isinstance(js.get("schema"), dict):
        raise InvalidRequestError('json_schema needs {"name": "<a name>", "schema": {<a JSON schema>}}',
                                  param="response_format.json_schema")
    unknown = sorted(set(js) - {"name", "schema", "strict", "description"})
    if unknown:
        raise InvalidRequestError(f"unknown json_schema field(s): {', '.join(unknown)}",
                                  param=f"response_format.json_schema.{unknown[0]}")
    if "strict" in js and not isinstance(js["strict"], (bool, type(None))):
        raise InvalidRequestError("json_schema.strict must be a boolean", param="response_format.json_schema.strict")
    return Structure("json_schema", json.dumps(js["schema"]))


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    description: str
    parameters: dict

    def call_schema(self) -> dict:
        """The JSON schema of a call to this function."""
        return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": self.name}, "arguments": self.parameters}}


def parse_tools(tools: list | None, tool_choice) -> tuple[list[Tool], str | None]:
    """Validate ``tools`` and ``tool_choice`` (OpenAI's shapes).

    Returns:
        ``(tools, choice)``: choice is ``none``, ``auto``, ``required`` or a function's name; None
        without tools.

    Raises:
        InvalidRequestError: malformed tools, duplicate names, a choice naming no tool, a choice
            other than none without tools.
    """
    parsed: list[Tool] = []
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidRequestError('each tool must be {"type": "function", "function": {...}}', param=f"tools.{i}")
        # no parameters: a function that takes none (OpenAI's reading), i.e. arguments {}
        name = fn.get("name")
        params = fn.get("parameters", {"type": "object", "properties": {}, "additionalProperties": False})
        if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "_-" for c in name):
            raise InvalidRequestError("a function name must be 1-64 letters, digits, '_' or '-'",
                                      param=f"tools.{i}.function.name")
        if not isinstance(params, dict):
            raise InvalidRequestError("function parameters must be a JSON schema object",
                                      param=f"tools.{i}.function.parameters")
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise InvalidRequestError(f"unknown function field(s): {', '.join(unknown)}",
                                      param=f"tools.{i}.function.{unknown[0]}")
        parsed.append(Tool(name, str(fn.get("description", "")), params))
    if len({t.name for t in parsed}) != len(parsed):
        raise InvalidRequestError("two tools have the same name", param="tools")
    if tool_choice is None:
        return parsed, ("auto" if parsed else None)
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequestError('tool_choice must be "none", "auto", "required" or a function', param="tool_choice")
        choice = tool_choice
    elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str)):
        choice = tool_choice["function"]["name"]
        if choice not in {t.name for t in parsed}:
            raise InvalidRequestError(f"tool_choice names {choice!r}, which is not among the tools", param="tool_choice")
    else:
        raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                  '"function": {"name": ...}}', param="tool_choice")
    if not parsed:
        if choice != "none":
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return parsed, None
    return parsed, choice


def tools_message(tools: list[Tool], choice: str) -> dict[str, str]:
    """The system message that tells the model about the tools."""
    listed = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters})
                       for t in tools if choice in ("none", "auto", "required") or t.name == choice)
    return {"role": "system", "content": TOOLS_PROMPT.format(tools=listed, rule=RULES.get(choice, " You must call it."))}


def tool_structure(tools: list[Tool], choice: str) -> Structure | None:
    """The grammar ``choice`` puts on the output (None for ``none``).

    Raises:
        InvalidRequestError: a function's parameters that do not make a JSON schema.
    """
    if choice == "none":
        return None
    chosen = [t for t in tools if choice in ("auto", "required") or t.name == choice]
    schema = chosen[0].call_schema() if len(chosen) == 1 else {"anyOf": [t.call_schema() for t in chosen]}
    schema["x-guidance"] = COMPACT  # no whitespace between tokens of a call: short, and no run of blanks
    if choice != "auto":
        return Structure("json_schema", json.dumps(schema), param="tools")
    # either a call or plain text that does not start like one
    lark = f"start: call | text\ntext: /[^{{\\s][\\s\\S]*/\ncall: %json {json.dumps(schema)}\n"
    return Structure("lark", lark, param="tools")


_NAME = re.compile(r'^\{\s*"name"\s*:\s*"([^"]*)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


def parse_tool_call(text: str, tools: list[Tool]) -> dict | None:
    """The OpenAI ``tool_calls`` entry of an output that is a call, else None (plain text).

    Under a tools grammar an output that starts with ``{`` is a call (``auto``'s text cannot
    start so). A complete call gives its name and its arguments as compact JSON text; a call cut
    short (``max_tokens``, a stop string) keeps what was written: the name if it is complete (else
    ""), and the arguments' text so far, as OpenAI returns a call cut by the token limit.
    """
    stripped = text.strip()
    if not stripped.startswith("{"):
        return None
    try:
        call = json.loads(stripped)
    except json.JSONDecodeError:
        call = None
    if isinstance(call, dict) and call.get("name") in {t.name for t in tools} and isinstance(call.get("arguments"),
                                                                                              dict):
        name, arguments = call["name"], json.dumps(call["arguments"], separators=(",", ":"), ensure_ascii=False)
    else:  # cut short: what was written
        m = _NAME.match(stripped)
        name = m.group(1) if m else ""
        a = _ARGUMENTS.search(stripped)
        arguments = stripped[a.end():] if a else ""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def render_messages(messages: list[dict]) -> list[dict[str, str]]:
    """Chat messages with tool calls and tool results as plain text the chat template renders:
    an assistant's ``tool_calls`` become its content (the call JSON, as the model writes one),
    a ``tool`` message names the call it answers."""
    out = []
    for m in messages:
        content = m["content"]
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                     for c in m["tool_calls"]]
            content = "\n".join(json.dumps(c) for c in calls) if not content else content
        if m["role"] == "tool":
            content = f"Result of tool call {m.get('tool_call_id') or ''}: {content}".replace("  ", " ")
        out.append({"role": m["role"], "content": content})
    return out


def check_tool_calls(calls, i: int) -> list[dict]:
    """Validate an assistant message's ``tool_calls`` (OpenAI's shape).

    Raises:
        InvalidRequestError: a call that is not a function with a name and JSON-object arguments.
    """
    if not isinstance(calls, list):
        raise InvalidRequestError("tool_calls must be a list", param=f"messages.{i}.tool_calls")
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        ok = isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)
        if ok:
            try:
                ok = isinstance(json.loads(fn["arguments"]), dict)
            except json.JSONDecodeError:
                ok = False
        if not ok:
            raise InvalidRequestError('each tool call needs {"function": {"name": ..., "arguments": "<JSON object>"}}',
                                      param=f"messages.{i}.tool_calls.{j}")
    return calls
