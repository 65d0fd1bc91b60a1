"""Request options beyond plain sampling: `n`, `echo` (prompt scoring), `logit_bias`, `response_format`, `tools`.

Parses and validates them into `Extras`, plain data that the scheduler and the formatter read. Grammar compilation
lives in structured.py and the checkpoints' tool-call formats in tools.py; this module only checks shapes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from moestream.server.errors import bad_request as _bad

MAX_N = 16
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
CHAT_EXTRA_FIELDS = {"n", "logit_bias", "response_format", "tools", "tool_choice", "parallel_tool_calls"}
COMPLETION_EXTRA_FIELDS = {"n", "logit_bias", "response_format", "echo"}
MESSAGE_EXTRA_KEYS = {"tool_calls", "tool_call_id", "reasoning_content"}
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass
class Extras:
    """What a request asks for beyond one sampled continuation (defaults: nothing)."""

    n: int = 1
    echo: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: str | None = None  # llguidance grammar the output must match (response_format or forced tool call)
    json_schema: dict | None = None  # response_format's schema ({"type": "object"} for json_object)
    tools: list[dict] | None = None
    tool_choice: Any = None  # None (no tools) | "none" | "auto" | "required" | a function name
    parallel_tool_calls: bool = True
    # Set when the chat prompt is rendered (tools.chat_prompt_ids), from the checkpoint's template:
    tool_format: str | None = None  # "kimi" | "deepseek" | "qwen3" when tool calls are parsed out of the text
    reasoning: bool = False  # the template marks reasoning with <think>...</think>
    reasoning_open: bool = False  # the generation prompt already opened <think>
    keep_token_ids: tuple[int, ...] = ()  # special tokens the text must keep (tool-call and reasoning markers)




def _n(body: dict) -> int:
    v = body.get("n")
    if v is None:
        return 1
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_N:
        raise _bad("n", f"'n' must be an integer in [1, {MAX_N}], got {v!r}")
    return v


def _logit_bias(body: dict) -> dict[int, float]:
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids -> bias")
    out = {}
    for k, b in v.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit()):
            raise _bad("logit_bias", f"'logit_bias' keys must be token ids written as strings, got {k!r}")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise _bad("logit_bias", f"'logit_bias' values must be numbers in [-100, 100], got {b!r} for {k}")
        out[int(k)] = float(b)
    return out


def _response_format(body: dict) -> dict | None:
    """The JSON schema the output must match (None: free text); a 400 now if it cannot be compiled."""
    from moestream.server import structured

    v = body.get("response_format")
    if v is None:
        return None
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("response_format", "'response_format' must be {\"type\": \"text\" | \"json_object\" | "
                                      "\"json_schema\", ...}")
    kind = v["type"]
    extra = set(v) - {"type", "json_schema"} if kind == "json_schema" else set(v) - {"type"}
    if extra:
        raise _bad("response_format", f"'response_format' of type {kind!r} does not take {sorted(extra)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = v.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise _bad("response_format.json_schema", "'response_format.json_schema' must be an object with a 'name'")
    unknown = set(spec) - {"name", "description", "schema", "strict"}
    if unknown:
        raise _bad("response_format.json_schema", f"'response_format.json_schema' does not take {sorted(unknown)}")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema", "'response_format.json_schema.schema' must be an object")
    structured.json_grammar(schema, "response_format.json_schema.schema")
    return schema


def _tools(body: dict) -> list[dict] | None:
    from moestream.server import structured

    v = body.get("tools")
    if v is None:
        return None
    if not isinstance(v, list) or not v:
        raise _bad("tools", "'tools' must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    names = set()
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or set(t) - {"type", "function"} \
                or not isinstance(fn, dict):
            raise _bad(where, f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}")
        if not isinstance(fn.get("name"), str) or not _TOOL_NAME.match(fn["name"]):
            raise _bad(f"{where}.function.name", f"'{where}.function.name' must be 1-64 letters, digits, _ or -")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise _bad(f"{where}.function", f"'{where}.function' does not take {sorted(unknown)}")
        if fn["name"] in names:
            raise _bad(f"{where}.function.name", f"the tool name {fn['name']!r} appears twice")
        names.add(fn["name"])
        if "description" in fn and not isinstance(fn["description"], str):
            raise _bad(f"{where}.function.description", f"'{where}.function.description' must be a string")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters", f"'{where}.function.parameters' must be a JSON schema object")
        structured.json_grammar(params, f"{where}.function.parameters")  # 400 now for a schema it cannot compile
    return v


def _tool_choice(body: dict, tools: list[dict] | None) -> Any:
    v = body.get("tool_choice")
    if tools is None:
        if v is not None and v != "none":
            raise _bad("tool_choice", "'tool_choice' needs 'tools'")
        return None
    if v is None:
        return "auto"
    if v in ("none", "auto", "required"):
        return v
    fn = v.get("function") if isinstance(v, dict) else None
    if not isinstance(v, dict) or v.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise _bad("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                  "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if fn["name"] not in {t["function"]["name"] for t in tools}:
        raise _bad("tool_choice", f"'tool_choice' names {fn['name']!r}, which is not in 'tools'")
    return fn["name"]


def parse_extras(body: dict, kind: str) -> Extras:
    """Validate the extra fields of a chat ("chat") or completions ("completion") body."""
    from moestream.server import structured

    ex = Extras(n=_n(body), logit_bias=_logit_bias(body), json_schema=_response_format(body))
    if ex.json_schema is not None:
        ex.grammar = structured.json_grammar(ex.json_schema, "response_format")
    if kind == "completion":
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise _bad("echo", "'echo' must be a boolean")
        ex.echo = echo
        return ex
    ex.tools = _tools(body)
    ex.tool_choice = _tool_choice(body, ex.tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    ex.parallel_tool_calls = parallel
    if ex.grammar is not None and ex.tool_choice not in (None, "none", "auto"):
        raise _bad("response_format", "'response_format' cannot be combined with a 'tool_choice' that forces a call")
    return ex


def message_extras(i: int, m: dict) -> dict:
    """The tool-call keys of one chat message (an assistant's `tool_calls`, a tool result's `tool_call_id`)."""
    out: dict[str, Any] = {}
    calls = m.get("tool_calls")
    if calls is not None:
        if m.get("role") != "assistant" or not isinstance(calls, list):
            raise _bad(f"messages[{i}].tool_calls", f"'messages[{i}].tool_calls' must be a list on an assistant "
                                                    "message")
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                    or not isinstance(fn.get("arguments", ""), str):
                raise _bad(f"messages[{i}].tool_calls[{j}]", f"'messages[{i}].tool_calls[{j}]' must be "
                           "{\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\": string}}")
        out["tool_calls"] = calls
    for key in ("tool_call_id", "reasoning_content"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise _bad(f"messages[{i}].{key}", f"'messages[{i}].{key}' must be a string")
            out[key] = m[key]
    if m.get("role") == "tool" and "tool_call_id" not in out:
        raise _bad(f"messages[{i}].tool_call_id", f"'messages[{i}]' has role 'tool' but no 'tool_call_id'")
    return out
