"""The front-end-neutral path of one generation request, shared by the HTTP server and `moestream batch`.

Owns the model-id check and turning a validated body's prompt into token ids (chat template with tools, tokenization
that keeps message text from becoming control tokens, token-id range check); responses.collect turns a ticket's
events into the final body. A request gets the same tokens, body and errors whichever front end it came through.
"""
from __future__ import annotations

from moestream.server.errors import ProtocolError
from moestream.server.protocol import Parsed
from moestream.server.tools import chat_prompt_ids
from moestream.tokenizer import Tokenizer


def check_model(parsed: Parsed, model_id: str) -> None:
    if parsed.model != model_id:
        raise ProtocolError(404, f"the model '{parsed.model}' does not exist; this server serves '{model_id}'",
                            "model", code="model_not_found")


def prompt_ids(parsed: Parsed, tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """Token ids of a parsed request's prompt (chat: through the chat template with the generation prompt)."""
    if parsed.kind == "chat":
        return chat_prompt_ids(tokenizer, parsed.prompt, parsed.extras)
    if isinstance(parsed.prompt, str):
        ids = tokenizer.encode(parsed.prompt)  # raw text: special tokens parsed (as a completion prompt should be)
    else:
        ids = list(parsed.prompt)
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ProtocolError(400, f"prompt token ids must be in [0, {vocab_size})", "prompt")
    if not ids:
        raise ProtocolError(400, "the prompt encodes to no tokens", "prompt")
    return ids
