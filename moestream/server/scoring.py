"""Prompt scoring for `echo` with `logprobs`: each prompt token's logprob under the tokens before it.

`PromptScorer` takes the all-token logits of each prefill chunk as the engine produces them (`step(...,
all_logits=True)`) and returns OpenAI's legacy entries: the first prompt token has none (nothing predicts it),
every later one the fp32 log-softmax of the previous position's logits at that token, plus the top alternatives.
Evaluation harnesses (lm-evaluation-harness's loglikelihood tasks) read exactly these.
"""
from __future__ import annotations

import torch

from moestream.server.protocol import TokenLogprob
from moestream.tokenizer import Tokenizer


class PromptScorer:
    """Scores a prompt chunk by chunk; keeps the last row of a chunk, which predicts the next chunk's first token."""

    def __init__(self, tokenizer: Tokenizer, top: int):
        self.tokenizer, self.top = tokenizer, top
        self._prev: torch.Tensor | None = None  # [V] logits of the last token fed so far
        self._started = False

    def feed(self, tokens: list[int], logits: torch.Tensor) -> list[TokenLogprob]:
        """Entries for `tokens` (the chunk just fed), given its logits [len(tokens), V]."""
        entries: list[TokenLogprob] = []
        if not self._started:  # the very first prompt token: no logprob, no alternatives
            entries.append(TokenLogprob(self._text(tokens[0]), None, None))
            scored, rows = tokens[1:], logits[:-1]
            self._started = True
        else:
            scored, rows = tokens, torch.cat([self._prev[None], logits[:-1]])
        self._prev = logits[-1]
        if not scored:
            return entries
        lp = rows.float().log_softmax(-1)
        chosen = lp.gather(1, torch.tensor(scored)[:, None])[:, 0].tolist()
        tops: list[list[tuple[str, float]]] = [[] for _ in scored]
        if self.top > 0:
            vals, ids = lp.topk(self.top, dim=-1)
            tops = [[(self._text(i), v) for v, i in zip(vr, ir)] for vr, ir in zip(vals.tolist(), ids.tolist())]
        entries += [TokenLogprob(self._text(t), c, top) for t, c, top in zip(scored, chosen, tops)]
        return entries

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])
