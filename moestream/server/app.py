"""The HTTP front end: Starlette routes that validate, translate to the scheduler, and stream back.

Owns the routes (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics), the API key check, body
limits, OpenAI-shaped errors, server-sent events and cancel-on-disconnect. Generation itself happens in the
scheduler's thread; nothing here touches the engine.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from moestream.config import parse_bytes, read_model_config
from moestream.errors import MoestreamError
from moestream.server.handling import check_model, prompt_ids
from moestream.server.errors import ProtocolError, error_body
from moestream.server.protocol import Formatter, Parsed, parse_chat, parse_completion
from moestream.server.metrics import CONTENT_TYPE, ServerMetrics
from moestream.server.responses import add_usage, collect
from moestream.server.scheduler import Scheduler, SchedulerConfig
from moestream.server.tickets import Delta, Done, Failed, QueueFull, Ticket, Unavailable
from moestream.tokenizer import Tokenizer

Handler = Callable[[Request], Awaitable[Response]]


@dataclass
class ServerConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    ram_budget: str | int | None = None
    max_batch: int = 16
    max_queue: int = 64
    api_key: str | None = None
    prefix_cache: str | int | None = None  # bytes; None: min(1 GiB, budget / 8); 0 disables
    prefill_chunk: int = 256
    max_body: str | int = "8MiB"
    model_name: str | None = None
    retry_after_s: int = 1
    threads: int | None = None  # torch CPU threads for the forward pass (default: the engine's choice)
    state_room: str | int | None = None  # budget kept free for KV caches when dense weights stream
    kv_dtype: str = "fp32"  # KV cache storage (EngineOptions.kv_dtype)
    compute_dtype: str = "fp32"  # many-row products' precision (EngineOptions.compute_dtype)
    request_timeout: float | None = None  # seconds; a request still running then gets a 504 and is cancelled
    shutdown_timeout: float = 30.0  # seconds SIGTERM waits for in-flight requests before cancelling them


def context_length(model_dir: str | Path) -> int | None:
    """The model's context window; multimodal checkpoints (Kimi K2.5 / K3) keep it under `text_config`."""
    cfg = read_model_config(model_dir)
    text = cfg.get("text_config")
    for source in (text if isinstance(text, dict) else {}, cfg):
        value = source.get("max_position_embeddings")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def default_prefix_cache(budget: int | None) -> int:
    return min(1 << 30, budget // 8) if budget else 1 << 30


class ServerState:
    """Everything the handlers share: the scheduler, the tokenizer, and the served model's id and limits."""

    def __init__(self, cfg: ServerConfig, engine, tokenizer: Tokenizer, scheduler: Scheduler):
        self.cfg, self.engine, self.tokenizer, self.scheduler = cfg, engine, tokenizer, scheduler
        self.model_id = cfg.model_name or Path(cfg.model).resolve().name
        self.context = context_length(cfg.model)
        self.metrics = ServerMetrics(scheduler.snapshot)
        scheduler.observe = self.metrics.observe
        self.max_body = parse_bytes(cfg.max_body) or 0
        self.created = int(time.time())

    @classmethod
    def open(cls, cfg: ServerConfig) -> "ServerState":
        from moestream.engine.engine import Engine

        budget = parse_bytes(cfg.ram_budget)
        prefix = parse_bytes(cfg.prefix_cache) if cfg.prefix_cache is not None else default_prefix_cache(budget)
        # concurrent sequences: their state grows into the cache's room, which the head's resident rows would take
        engine = Engine.open(cfg.model, ram_budget=budget, state_room=cfg.state_room, kv_dtype=cfg.kv_dtype,
                             compute_dtype=cfg.compute_dtype, head_rows=cfg.state_room is not None)
        if cfg.threads:
            import torch

            torch.set_num_threads(cfg.threads)  # after open(), which picks its own default
        tokenizer = Tokenizer.load(cfg.model)
        sched = Scheduler(engine, tokenizer, SchedulerConfig(cfg.max_batch, cfg.max_queue, cfg.prefill_chunk, prefix,
                                                             request_timeout_s=cfg.request_timeout))
        return cls(cfg, engine, tokenizer, sched)


# ---- request plumbing ----------------------------------------------------------------------------------------
def _error(e: ProtocolError, srv: ServerState) -> JSONResponse:
    srv.metrics.error(e.status)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _api(handler: Handler, auth: bool = True) -> Handler:
    """Wrap a route: API key check, and every failure turned into an OpenAI-shaped error response."""

    async def wrapped(request: Request) -> Response:
        try:
            if auth:
                _check_key(request)
            return await handler(request)
        except ProtocolError as e:
            return _error(e, _srv(request))
        except Unavailable as e:  # the scheduler is gone or the server is draining
            return _error(ProtocolError(503, str(e), err_type="server_error", code="unavailable"), _srv(request))
        except MoestreamError as e:  # tokenizer / chat template / request parameter problems
            return _error(ProtocolError(400, str(e)), _srv(request))
        except Exception as e:  # a bug: still an OpenAI-shaped answer, and the server keeps serving
            return _error(ProtocolError(500, f"internal error: {type(e).__name__}: {e}", err_type="server_error"),
                          _srv(request))

    return wrapped


def _check_key(request: Request) -> None:
    key = _srv(request).cfg.api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise ProtocolError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _srv(request: Request) -> ServerState:
    return request.app.state.srv


async def read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ProtocolError(413, f"the request body is {length} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ProtocolError(413, f"the request body exceeds the limit of {limit} bytes")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(400, f"the request body is not valid JSON: {e}") from None


async def _on_disconnect(request: Request, callback: Callable[[], None]) -> None:
    """Calls `callback` when the client goes away (the body has been read, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            callback()
            return


# ---- generation -----------------------------------------------------------------------------------------------
def _submit(srv: ServerState, parsed: Parsed, ids: list[int]) -> Ticket:
    try:
        return srv.scheduler.submit(parsed.request(ids, srv.context))
    except QueueFull as e:
        raise ProtocolError(429, f"the server is busy: {e}; retry later", err_type="rate_limit_error",
                            code="queue_full", headers={"Retry-After": str(srv.cfg.retry_after_s)}) from None


async def _generate(request: Request, parsed: Parsed, ids: list[int]) -> Response:
    srv = _srv(request)
    ticket = _submit(srv, parsed, ids)
    fmt = Formatter(parsed)
    if parsed.stream:
        return StreamingResponse(_sse(request, ticket, fmt), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _collect(request, ticket, fmt)


def _data(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


async def _sse(request: Request, ticket: Ticket, fmt: Formatter) -> AsyncIterator[str]:
    sched = _srv(request).scheduler
    watcher = asyncio.create_task(_on_disconnect(request, lambda: sched.cancel(ticket)))
    try:
        if fmt.chat:
            for index in range(ticket.req.n):
                yield _data(fmt.chunk("", [], None, first=True, index=index))
        usage = None
        while True:
            event = await ticket.next()
            if isinstance(event, Delta):
                yield _data(fmt.chunk(event.text, event.logprobs, None, index=event.index))
            elif isinstance(event, Done):
                yield _data(fmt.chunk(None, [], event.finish_reason, index=event.index))
                usage = add_usage(usage, event.usage)
                if ticket.finished and fmt.p.include_usage:
                    yield _data(fmt.usage_chunk(usage))
            elif isinstance(event, Failed):
                _srv(request).metrics.error(event.status)
                yield _data(error_body(event.message, event.err_type))
            if ticket.finished:
                break
        yield _data("[DONE]")
    finally:
        watcher.cancel()
        sched.cancel(ticket)  # a no-op when it finished; frees the state at once when the client went away


async def _collect(request: Request, ticket: Ticket, fmt: Formatter) -> Response:
    sched = _srv(request).scheduler
    watcher = asyncio.create_task(_on_disconnect(request, lambda: sched.cancel(ticket)))
    try:
        status, body = await collect(ticket, fmt)
        if status != 200:
            _srv(request).metrics.error(status)
        return JSONResponse(body, status_code=status)
    finally:
        watcher.cancel()
        sched.cancel(ticket)


# ---- routes ---------------------------------------------------------------------------------------------------
async def chat_completions(request: Request) -> Response:
    return await _route(request, parse_chat)


async def completions(request: Request) -> Response:
    return await _route(request, parse_completion)


async def _route(request: Request, parse: Callable[[Any], Parsed]) -> Response:
    srv = _srv(request)
    parsed = parse(await read_json(request, srv.max_body))
    check_model(parsed, srv.model_id)
    # off the event loop: an 8 MiB body takes a while to render and tokenize, and other streams must keep flowing
    ids = await asyncio.to_thread(prompt_ids, parsed, srv.tokenizer, srv.engine.vocab_size)
    return await _generate(request, parsed, ids)


async def models(request: Request) -> Response:
    srv = _srv(request)
    return JSONResponse({"object": "list", "data": [{"id": srv.model_id, "object": "model", "created": srv.created,
                                                     "owned_by": "moestream"}]})


async def health(request: Request) -> Response:
    srv = _srv(request)
    if srv.scheduler.draining:
        return JSONResponse({"status": "draining", "detail": "the server is shutting down"}, status_code=503)
    if not srv.scheduler.alive:
        return JSONResponse({"status": "error", "detail": "the scheduler thread is not running"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(_srv(request).metrics.render(), media_type=CONTENT_TYPE)


async def _not_found(request: Request, exc: HTTPException) -> Response:
    return _error(ProtocolError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"), _srv(request))


def create_app(srv: ServerState) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette):
        srv.scheduler.start()
        yield
        srv.scheduler.stop()

    routes = [Route("/v1/chat/completions", _api(chat_completions), methods=["POST"]),
              Route("/v1/completions", _api(completions), methods=["POST"]),
              Route("/v1/models", _api(models), methods=["GET"]),
              Route("/metrics", _api(metrics), methods=["GET"]),
              Route("/health", _api(health, auth=False), methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: _not_found, 405: _not_found})
    app.state.srv = srv
    return app
