"""A non-streamed request's events, every choice of it, collected into the final OpenAI body.

Front-end neutral (the HTTP server and batch jobs both wait on a scheduler ticket): `collect` returns (HTTP status,
body); `add_usage` counts the shared prompt once and the choices' completions together.
"""
from __future__ import annotations

from moestream.server.errors import error_body
from moestream.server.protocol import Formatter, TokenLogprob, Usage
from moestream.server.tickets import Delta, Done, Ticket


def add_usage(total: Usage | None, one: Usage) -> Usage:
    """Choices share the prompt: its tokens count once, the completions add up."""
    if total is None:
        return one
    return Usage(total.prompt_tokens, total.completion_tokens + one.completion_tokens, total.cached_tokens)


async def collect(ticket: Ticket, fmt: Formatter) -> tuple[int, dict]:
    """Wait for a non-streamed request to end: (HTTP status, response body or OpenAI error body)."""
    n = ticket.req.n
    text: list[list[str]] = [[] for _ in range(n)]
    entries: list[list[TokenLogprob]] = [[] for _ in range(n)]
    finish = [""] * n
    usage = None
    while True:
        event = await ticket.next()
        if isinstance(event, Delta):
            text[event.index].append(event.text)
            entries[event.index].extend(event.logprobs)
        elif isinstance(event, Done):
            finish[event.index], usage = event.finish_reason, add_usage(usage, event.usage)
            if ticket.finished:
                return 200, fmt.final_choices([("".join(t), e, f) for t, e, f in zip(text, entries, finish)], usage)
        else:
            return event.status, error_body(event.message, event.err_type)
