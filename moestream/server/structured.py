"""Constrained sampling: `response_format` grammars and `logit_bias`, applied to one sequence's logits per step.

Grammars go through llguidance (a maintained grammar engine, Rust, CPU): a JSON schema or a Lark grammar becomes an
llguidance grammar string at parse time (a bad schema is a 400 then), and every sequence that asks for one gets its
own `LLMatcher`, which masks the logits before sampling, advances with each accepted token, and says when the
grammar is complete. `Guide` owns one sequence's constraint; `GuideFactory` owns the tokenizer llguidance needs.
"""
from __future__ import annotations

import json
from typing import Any

import torch

from moestream.errors import RequestError
from moestream.server.errors import bad_request as _bad
from moestream.tokenizer import Tokenizer

NEG_INF = float("-inf")


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise RequestError("structured output needs llguidance: pip install 'moestream[server]'") from None
    return llguidance




def _check(grammar: str, param: str) -> str:
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    if error:
        raise _bad(param, f"'{param}' cannot be compiled to a grammar: {error}")
    return grammar


def json_grammar(schema: dict[str, Any] | None, param: str) -> str:
    """An llguidance grammar for JSON matching `schema` (None: any JSON object). 400 naming `param` if invalid."""
    llg = _llguidance()
    if schema is None:
        schema = {"type": "object"}
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
    except (ValueError, TypeError) as e:
        raise _bad(param, f"'{param}' is not a usable JSON schema: {e}") from None
    return _check(grammar, param)


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark fragment matching JSON under `schema`, written compactly (no free whitespace between tokens: a model
    that likes whitespace tokens could otherwise fill max_tokens with it)."""
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})


def lark_grammar(lark: str, param: str) -> str:
    return _check(_llguidance().LLMatcher.grammar_from_lark(lark), param)


class GuideFactory:
    """Builds the llguidance tokenizer once (about a second for a large vocabulary), then one `Guide` per sequence."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: list[int]):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._lltok = None

    def lltokenizer(self):
        if self._lltok is None:
            llg = _llguidance()
            backend = self.tokenizer.backend
            if hasattr(backend, "to_str"):  # HF tokenizers
                self._lltok = llg.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_ids)
            else:
                from llguidance.tiktoken import lltokenizer_from_encoding

                self._lltok = lltokenizer_from_encoding(backend, n_vocab=self.vocab_size, eos_token=self.eos_ids)
        return self._lltok

    def guide(self, grammar: str | None, logit_bias: dict[int, float]) -> "Guide | None":
        """None when the request has no constraint (the common case costs nothing)."""
        if grammar is None and not logit_bias:
            return None
        bad = [t for t in logit_bias if t >= self.vocab_size]
        if bad:
            raise RequestError(f"logit_bias names token {bad[0]}, outside the vocabulary of {self.vocab_size}")
        matcher = None
        if grammar is not None:
            matcher = _llguidance().LLMatcher(self.lltokenizer(), grammar, log_level=0)
            if matcher.is_error():
                raise RequestError(f"the grammar could not be used: {matcher.get_error()}")
        return Guide(matcher, logit_bias, self.vocab_size)


class Guide:
    """One sequence's constraint: a grammar matcher (optional) and a logit bias (optional)."""

    def __init__(self, matcher: Any, logit_bias: dict[int, float], vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.bias = None
        if logit_bias:
            self.bias = torch.zeros(vocab_size)
            self.bias[list(logit_bias)] = torch.tensor(list(logit_bias.values()))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits sampling sees: biased (OpenAI: added before softmax), then grammar-masked."""
        out = logits.float()
        if self.bias is not None:
            out = out + self.bias
        if self.matcher is not None:
            allowed = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)
            if allowed.numel() < out.numel():  # ids past the tokenizer's vocabulary are never allowed
                allowed = torch.cat([allowed, allowed.new_zeros(out.numel() - allowed.numel())])
            out = out.masked_fill(allowed[:out.numel()] == 0, NEG_INF)
        return out

    def accept(self, token: int) -> None:
        if self.matcher is not None and not self.matcher.consume_token(token):
            raise RequestError(f"the grammar rejected token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but the end of the output may follow."""
        return self.matcher is not None and self.matcher.is_stopped()
