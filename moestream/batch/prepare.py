"""One batch request line to a runnable job or to its finished output line (OpenAI batch output format).

Owns the line-level checks (custom_id, method, url) and hands the body to the server's own validation and prompt
path (protocol.parse_chat / parse_completion, handling.check_model / prompt_ids), so a body the server would
refuse gets the very status and error body the server would send. Also builds the output lines.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable

from moestream.batch.inputs import BatchRequest
from moestream.errors import MoestreamError
from moestream.server.handling import check_model, prompt_ids
from moestream.server.errors import ProtocolError
from moestream.server.protocol import GenRequest, Parsed, parse_chat, parse_completion
from moestream.tokenizer import Tokenizer

URLS: dict[str, Callable[[Any], Parsed]] = {"/v1/chat/completions": parse_chat, "/v1/completions": parse_completion}


@dataclass
class RequestContext:
    """What validating a body needs: the tokenizer and the served model's id, vocabulary and context window."""

    tokenizer: Tokenizer
    model_id: str
    vocab_size: int
    context: int | None
    default_max_tokens: int | None = None  # for bodies that set none (the server's default is the whole context)


@dataclass
class Job:
    id: str
    custom_id: str
    parsed: Parsed
    request: GenRequest


def error_line(rid: str, custom_id: str | None, code: str, message: str) -> dict:
    """A request that never reached the model as an HTTP request would (bad line, unknown url...)."""
    return {"id": rid, "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}


def response_line(rid: str, custom_id: str, status: int, body: dict) -> dict:
    return {"id": rid, "custom_id": custom_id,
            "response": {"status_code": status, "request_id": uuid.uuid4().hex, "body": body}, "error": None}


def prepare(req: BatchRequest, ctx: RequestContext) -> Job | dict:
    """A Job to run, or the request's finished output line when it cannot run."""
    line = req.line
    cid = line.get("custom_id") if isinstance(line, dict) else None
    cid = cid if isinstance(cid, str) and cid else None
    if req.problem is not None:
        return error_line(req.id, cid, *req.problem)
    if not isinstance(line, dict):
        return error_line(req.id, None, "invalid_request", f"line {req.lineno} is not a JSON object")
    if cid is None:
        return error_line(req.id, None, "missing_custom_id",
                          f"line {req.lineno} has no 'custom_id' (a non-empty string naming the request)")
    if line.get("method") != "POST":
        return error_line(req.id, cid, "invalid_method", f"'method' must be \"POST\", got {line.get('method')!r}")
    parse = URLS.get(line.get("url"))
    if parse is None:
        return error_line(req.id, cid, "invalid_url",
                          f"'url' must be one of {', '.join(URLS)}, got {line.get('url')!r}")
    try:
        parsed = _parse(parse, line.get("body"), ctx)
        ids = prompt_ids(parsed, ctx.tokenizer, ctx.vocab_size)
        return Job(req.id, cid, parsed, parsed.request(ids, ctx.context))
    except ProtocolError as e:
        return response_line(req.id, cid, e.status, e.body())
    except MoestreamError as e:  # tokenizer / chat template problems: a 400, as the server answers them
        return response_line(req.id, cid, 400, ProtocolError(400, str(e)).body())


def _parse(parse: Callable[[Any], Parsed], body: Any, ctx: RequestContext) -> Parsed:
    if body is None:
        raise ProtocolError(400, "the request line has no 'body'", "body")
    parsed = parse(body)
    if parsed.stream:
        raise ProtocolError(400, "'stream' is not supported in a batch: remove it (results go to the output file)",
                            "stream")
    check_model(parsed, ctx.model_id)
    if parsed.max_tokens is None and ctx.default_max_tokens is not None:
        parsed = replace(parsed, max_tokens=ctx.default_max_tokens)
    return parsed
