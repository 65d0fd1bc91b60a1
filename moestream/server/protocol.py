"""OpenAI request/response shapes: validation of chat and completion bodies, and the JSON the server sends back.

Owns which fields are supported (anything else is a 400 naming the field), the plain-data `GenRequest` handed to
the scheduler, and response/chunk/error bodies (stop strings are matched in stops.py). No I/O, no torch.
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from moestream.server.errors import ProtocolError
from moestream.server.errors import bad_request as _bad
from moestream.server.options import (CHAT_EXTRA_FIELDS, COMPLETION_EXTRA_FIELDS, MESSAGE_EXTRA_KEYS, Extras,
                                      message_extras, parse_extras)

MAX_TOP_LOGPROBS = 5
MAX_STOPS = 4
MAX_STOP_CHARS = 256  # per stop string: bounds the text held back while a stop string might still be forming

COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
                 "user", "presence_penalty", "frequency_penalty"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"} | CHAT_EXTRA_FIELDS
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of"} | COMPLETION_EXTRA_FIELDS
# Fields accepted only at the value that leaves generation unchanged (clients often send the default).
NEUTRAL = {"best_of": 1, "presence_penalty": 0, "frequency_penalty": 0}
ROLES = {"system", "user", "assistant", "developer", "tool"}


@dataclass
class GenRequest:
    """What the scheduler needs to run one request: plain data only."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    # options.py / structured.py / tools.py features (defaults: off)
    n: int = 1  # choices, sharing one prefill
    echo: bool = False  # the prompt (and its logprobs) first in the output
    grammar: str | None = None  # llguidance grammar the output must match
    logit_bias: dict[int, float] = field(default_factory=dict)
    keep_token_ids: tuple[int, ...] = ()  # special tokens kept in the text (tool-call / reasoning markers)


@dataclass
class Parsed:
    """A validated request body: the prompt (messages or prompt) plus generation options."""

    kind: str  # "chat" | "completion"
    model: str
    prompt: Any  # chat: list of {"role", "content"}; completion: str or list[int]
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    extras: Extras = field(default_factory=Extras)

    def request(self, prompt_ids: list[int], context: int | None) -> GenRequest:
        """Bind the tokenized prompt; the default max_tokens is whatever the context window leaves."""
        room = None if context is None else context - len(prompt_ids)
        if room is not None and room < (1 if self.max_tokens != 0 else 0):
            raise ProtocolError(400, f"the prompt has {len(prompt_ids)} tokens, which leaves no room in the model's "
                                f"context of {context} tokens", "messages" if self.kind == "chat" else "prompt",
                                code="context_length_exceeded")
        if self.max_tokens is not None and room is not None and self.max_tokens > room:
            raise ProtocolError(400, f"max_tokens {self.max_tokens} + {len(prompt_ids)} prompt tokens exceeds the "
                                f"model's context of {context} tokens", "max_tokens", code="context_length_exceeded")
        max_tokens = self.max_tokens if self.max_tokens is not None else (room or 4096)
        ex = self.extras
        return GenRequest(prompt_ids, max_tokens, self.temperature, self.top_p, self.seed, self.stop, self.logprobs,
                          self.top_logprobs, ex.n, ex.echo, ex.grammar, ex.logit_bias, ex.keep_token_ids)


# ---- validation ---------------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise _bad(name, f"'{name}' must be a number, got {type(v).__name__}")
    if not math.isfinite(v):  # JSON as Python reads it allows NaN and Infinity; no range check catches NaN
        raise _bad(name, f"'{name}' must be a finite number, got {v}")
    if v > hi or v < lo or (lo_open and v == lo):
        raise _bad(name, f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise _bad(name, f"'{name}' must be an integer, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        raise _bad(name, f"'{name}' must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
    return v


def _check_fields(body: dict, allowed: set[str], endpoint: str) -> None:
    for name in body:
        if name not in allowed:
            raise _bad(name, f"'{name}' is not supported by this server's {endpoint} endpoint; remove it")
    for name, neutral in NEUTRAL.items():
        if name in allowed and body.get(name) is not None and body[name] != neutral:
            raise _bad(name, f"'{name}' is only supported with the value {neutral!r}, got {body[name]!r}")


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", "'stop' must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOPS:
        raise _bad("stop", f"'stop' takes at most {MAX_STOPS} strings, got {len(stops)}")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise _bad("stop", f"each stop string may have at most {MAX_STOP_CHARS} characters")
    return list(dict.fromkeys(stops))


def _stream_options(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise _bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    if not isinstance(opts, dict):
        raise _bad("stream_options", "'stream_options' must be an object")
    for k in opts:
        if k != "include_usage":
            raise _bad(f"stream_options.{k}", f"'stream_options.{k}' is not supported; only include_usage is")
    if not isinstance(opts.get("include_usage", False), bool):
        raise _bad("stream_options.include_usage", "'stream_options.include_usage' must be a boolean")
    return bool(opts.get("include_usage", False))


def _common(body: Any, allowed: set[str], endpoint: str) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError(400, "the request body must be a JSON object")
    _check_fields(body, allowed, endpoint)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "'model' is required and must be a string")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", "'stream' must be a boolean")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", "'user' must be a string")
    return dict(model=model, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), seed=_int(body, "seed", -(2**63), 2**63 - 1),
                stop=_stop(body), stream=stream, include_usage=_stream_options(body, stream))


def _content(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    where = f"messages[{i}].content"
    if not isinstance(content, list):
        raise _bad(where, f"'{where}' must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}]", f"'{where}[{j}]' must be {{\"type\": \"text\", \"text\": ...}}; other "
                       "content types are not supported")
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "'messages' is required and must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"'messages[{i}]' must be an object")
        for k in m:
            if k not in ("role", "content", "name", *MESSAGE_EXTRA_KEYS):
                raise _bad(f"messages[{i}].{k}", f"'messages[{i}].{k}' is not supported")
        if m.get("role") not in ROLES:
            raise _bad(f"messages[{i}].role", f"'messages[{i}].role' must be one of {sorted(ROLES)}")
        extra = message_extras(i, m)
        content = "" if m.get("content") is None and "tool_calls" in extra else _content(i, m.get("content"))
        out.append({"role": m["role"], "content": content, **extra})
    return out


def parse_chat(body: Any) -> Parsed:
    c = _common(body, CHAT_FIELDS, "chat completions")
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    logprobs = body.get("logprobs", False)
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad("logprobs", "'logprobs' must be a boolean")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise _bad("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
    return Parsed("chat", c["model"], _messages(body), max_tokens, c["temperature"], c["top_p"], c["seed"], c["stop"],
                  c["stream"], c["include_usage"], bool(logprobs), top or 0, parse_extras(body, "chat"))


def parse_completion(body: Any) -> Parsed:
    c = _common(body, COMPLETION_FIELDS, "completions")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(_is_int(t) for t in prompt):
            raise _bad("prompt", "'prompt' must be a string or a non-empty list of token ids (one prompt per request)")
    elif not isinstance(prompt, str) or not prompt:
        raise _bad("prompt", "'prompt' is required and must be a non-empty string or list of token ids")
    logprobs = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    extras = parse_extras(body, "completion")
    max_tokens = _int(body, "max_tokens", 0)
    if max_tokens == 0 and not extras.echo:
        raise _bad("max_tokens", "'max_tokens' 0 is only useful with 'echo' (to score the prompt)")
    return Parsed("completion", c["model"], prompt, max_tokens, c["temperature"], c["top_p"],
                  c["seed"], c["stop"], c["stream"], c["include_usage"], logprobs is not None, logprobs or 0, extras)


# ---- responses ----------------------------------------------------------------------------------------------
@dataclass
class TokenLogprob:
    text: str
    logprob: float | None  # None: the first prompt token of an echo (nothing predicts it)
    top: list[tuple[str, float]] | None
    bytes: list[int] | None = None  # the token's own bytes (None: the UTF-8 of `text`)
    top_bytes: list[list[int]] | None = None  # the same for each entry of `top`


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8"))


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    def top(e: TokenLogprob) -> list[dict]:
        own = e.top_bytes or [None] * len(e.top)
        return [{"token": t, "logprob": lp, "bytes": b if b is not None else _bytes(t)}
                for (t, lp), b in zip(e.top, own)]

    return {"content": [{"token": e.text, "logprob": e.logprob,
                         "bytes": e.bytes if e.bytes is not None else _bytes(e.text), "top_logprobs": top(e)}
                        for e in entries]}


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict:
    offsets, pos = [], offset
    for e in entries:
        offsets.append(pos)
        pos += len(e.text)
    return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.top is None else _top_dict(e.top) for e in entries], "text_offset": offsets}


def _top_dict(top: list[tuple[str, float]]) -> dict[str, float]:
    """Legacy top_logprobs are keyed by text: of alternatives that decode alike, keep the likeliest (listed first)."""
    out: dict[str, float] = {}
    for text, lp in top:
        out.setdefault(text, lp)
    return out


class Formatter:
    """Builds the response bodies of one request (chat or completion, streamed or not, one choice or `n`)."""

    def __init__(self, parsed: Parsed):
        from moestream.server.tools import OutputParser

        self.p = parsed
        self.chat = parsed.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        n = parsed.extras.n
        self.offsets = [0] * n  # completion logprobs' text_offset runs over each choice's whole output
        ex = parsed.extras
        # Chat text holding tool calls or reasoning is split into content / reasoning_content / tool_calls.
        self.parsers = [OutputParser(ex) for _ in range(n)] if self.chat and (ex.tool_format or ex.reasoning) \
            else None
        self.called = [False] * n

    def _envelope(self, chunk: bool) -> dict:
        obj = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": obj + (".chunk" if chunk and self.chat else ""), "created": self.created,
                "model": self.p.model}

    def _logprobs(self, entries: list[TokenLogprob], index: int = 0) -> dict | None:
        if not self.p.logprobs:
            return None
        out = chat_logprobs(entries) if self.chat else completion_logprobs(entries, self.offsets[index])
        self.offsets[index] += sum(len(e.text) for e in entries)
        return out

    def _finish(self, index: int, finish: str | None) -> str | None:
        return "tool_calls" if finish == "stop" and self.called[index] else finish

    def _parse(self, index: int, text: str, final: bool) -> dict:
        """Chat message fields from a piece of output: content, reasoning_content, tool_calls."""
        if self.parsers is None:
            return {"content": text} if text else {}
        parser = self.parsers[index]
        out: dict[str, Any] = {}
        for kind, value in parser.feed(text) + (parser.flush() if final else []):
            if kind == "tool_call":
                out.setdefault("tool_calls", []).append(value)
                self.called[index] = True
            else:
                key = "content" if kind == "content" else "reasoning_content"
                out[key] = out.get(key, "") + value
        return out

    def chunk(self, text: str | None, entries: list[TokenLogprob], finish: str | None, first: bool = False,
              index: int = 0) -> dict:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            delta.update(self._parse(index, text or "", final=finish is not None))
            if "tool_calls" in delta:
                delta["tool_calls"] = [c.body(with_index=True) for c in delta["tool_calls"]]
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice.update(logprobs=self._logprobs(entries, index) if entries else None,
                      finish_reason=self._finish(index, finish))
        body = self._envelope(True) | {"choices": [choice]}
        if self.p.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        return self._envelope(True) | {"choices": [], "usage": usage.body()}

    def _choice(self, index: int, text: str, entries: list[TokenLogprob], finish: str) -> dict:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            fields = self._parse(index, text, final=True)
            message: dict[str, Any] = {"role": "assistant", "content": fields.get("content", "")}
            if "reasoning_content" in fields:
                message["reasoning_content"] = fields["reasoning_content"]
            if "tool_calls" in fields:
                message["tool_calls"] = [c.body() for c in fields["tool_calls"]]
                message["content"] = message["content"] or None
            choice["message"] = message
        else:
            choice["text"] = text
        choice.update(logprobs=self._logprobs(entries, index), finish_reason=self._finish(index, finish))
        return choice

    def final(self, text: str, entries: list[TokenLogprob], finish: str, usage: Usage) -> dict:
        return self.final_choices([(text, entries, finish)], usage)

    def final_choices(self, choices: list[tuple[str, list[TokenLogprob], str]], usage: Usage) -> dict:
        """The whole response: one (text, logprob entries, finish reason) per choice, in index order."""
        return self._envelope(False) | {"choices": [self._choice(i, *c) for i, c in enumerate(choices)],
                                        "usage": usage.body()}
