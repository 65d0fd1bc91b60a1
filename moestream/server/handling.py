"""The front-end-neutral path of one generation request, shared by the HTTP server and `moestream batch`.

Owns the model-id check, turning a validated body's prompt into token ids (chat template, tokenization, token-id
range check) and collecting a scheduler ticket's events into the final response body, so a request gets the same
tokens, the same body and the same 4xx/5xx errors whichever front end it came through.
"""
from __future__ import annotations

from moestream.server.protocol import Formatter, Parsed, ProtocolError, error_body
from moestream.server.scheduler import Delta, Done, Ticket
from moestream.tokenizer import Tokenizer


def check_model(parsed: Parsed, model_id: str) -> None:
    if parsed.model != model_id:
        raise ProtocolError(404, f"the model '{parsed.model}' does not exist; this server serves '{model_id}'",
                            "model", code="model_not_found")


def prompt_ids(parsed: Parsed, tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """Token ids of a parsed request's prompt (chat: through the chat template with the generation prompt)."""
    if parsed.kind == "chat":
        return tokenizer.encode(tokenizer.apply_chat_template(parsed.prompt, add_generation_prompt=True))
    if isinstance(parsed.prompt, str):
        ids = tokenizer.encode(parsed.prompt)
    else:
        ids = list(parsed.prompt)
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ProtocolError(400, f"prompt token ids must be in [0, {vocab_size})", "prompt")
    if not ids:
        raise ProtocolError(400, "the prompt encodes to no tokens", "prompt")
    return ids


async def collect(ticket: Ticket, fmt: Formatter) -> tuple[int, dict]:
    """Wait for a non-streamed request to end: (HTTP status, response body or OpenAI error body)."""
    text, entries = [], []
    while True:
        event = await ticket.next()
        if isinstance(event, Delta):
            text.append(event.text)
            entries.extend(event.logprobs)
        elif isinstance(event, Done):
            return 200, fmt.final("".join(text), entries, event.finish_reason, event.usage)
        else:
            return event.status, error_body(event.message, event.err_type)
