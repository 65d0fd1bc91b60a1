"""Router lookahead: predict the next MoE layer's experts from this layer's input, behind a per-layer gate.

Owns the registered routers (a family hands `layer -> fn(x) -> expert ids`), the predictions made one layer
ahead, and the gate: every prediction is scored against what the layer really routed to (recall, an EMA), and
a layer's prefetch is issued only while its recall pays. A gate that switched off keeps measuring (one step in
`probe`: at published widths a router is a 13 MB GEMV, not free), so it can switch on again. No I/O here:
dispatch.py reads, and a remote checkpoint's fetch-ahead (`fill`) gets the predictions two layers deep, the next
layer's `fill_width` times wider when asked (the top width x k by its router's scores). Past the last MoE layer the
fetch-ahead's chain wraps to the first MoE layers of the next token, which no layer of their own token can predict
in time: their routers on this token's input, `wrap_width` x k wide, scored in `wrap_gates` when they route."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

RouterFn = Callable[..., torch.Tensor]  # (x [T, H], width=1) -> expert ids [T, width x k], best first


@dataclass
class Gate:
    """Recall of one layer's lookahead: EMA of |predicted & routed| / |routed|, and lifetime totals."""

    recall: float = 0.0
    scored: int = 0
    predicted: int = 0
    correct: int = 0
    routed: int = 0
    issued_steps: int = 0
    closed_steps: int = 0  # steps the gate was closed (one in Lookahead.probe of them still predicts)

    def score(self, predicted: set[int], routed: set[int], ema: float) -> None:
        r = len(predicted & routed) / max(1, len(routed))
        self.recall = r if self.scored == 0 else ema * self.recall + (1 - ema) * r
        self.scored += 1
        self.predicted += len(predicted)
        self.correct += len(predicted & routed)
        self.routed += len(routed)


@dataclass
class Lookahead:
    """`threshold`: minimum recall EMA for a layer's prefetch to be issued; `warmup`: scored steps before the
    gate may open; `max_share`: predictions naming more than this share of a layer's experts (large prefill
    batches) are not prefetched, since they would flush the cache."""

    threshold: float = 0.5
    warmup: int = 4
    ema: float = 0.8
    max_share: float = 0.25
    # how many predicted experts that are not resident a step reads ahead, best-scored first. The reads queue
    # behind the step's own and are withdrawn if the layer routes elsewhere before they start, so they fill the
    # disk's idle time between layers. One beat two (fewer wasted bytes once the disk is busy) and none on the
    # medium synthetic model (docs/performance.md)
    reads: int = 1
    probe: int = 4  # a closed gate's layer is predicted (and scored) on one step in this many
    # a warm step (every routed expert cached) skips the next layer's router when each of that layer's latest
    # `quiet` steps read no expert (dispatch.ExpertRunner counts them; 0: never skip). Once the cache holds what
    # the tokens route to, what is left to predict are experts no token used so far: on the peer checkpoint (1,857
    # of its 2,048 experts cached after vs_llamacpp's warm pass and one decode) a 32-token decode ran the router
    # on all 1,024 layer steps and read 1 expert ahead
    quiet: int = 8
    enabled: bool = True
    # a remote checkpoint's fetch-ahead into its SSD tier (ExpertStore.fill_hook): each prediction, and those of the
    # `fill_depth - 1` MoE layers after it (their routers on the same input), go there too, gate or no gate:
    # over a link a round trip costs more than a wrong guess, which the link fetches while it would be idle
    fill: Callable[[list[tuple[int, list[int]]]], None] | None = None
    fill_depth: int = 2
    # ... the next layer's ranked this many times k wide (the router's `select(x, width)`), the later ones at k. At
    # top 2k the next layer's routed experts were 0.94 of the prediction on q3m_med (0.75 at top k), but 2k fetched
    # 30% more bytes a token and decoded cold 0.70-0.73 tok/s against 0.91-0.98 at k over a 200 MB/s + 20 ms
    # loopback link on the 2-core VM, where each byte fetched costs the decode CPU (docs/performance.md). A missed
    # expert costs a round trip on the decode's critical path, a wrong guess CPU, link time and SSD-tier room
    fill_width: int = 1
    # the next token's first MoE layers (the fetch-ahead's chain past the last layer, 0: none), each ranked by its own
    # router on this token's latest MoE input, this many times k wide. Nothing of the next token exists yet, so this
    # is a guess from the current token's state; every expert it names that the SSD tier lacks is fetched while the
    # current token's last layers compute, instead of a round trip after the next token's router asks for it
    wrap_width: int = 2
    routers: dict[int, RouterFn] = field(default_factory=dict)
    gates: dict[int, Gate] = field(default_factory=dict)
    wrap_gates: dict[int, Gate] = field(default_factory=dict)  # recall of the next-token guesses, per layer
    _pending: dict[int, set[int]] = field(default_factory=dict)
    _wrap_pending: dict[int, set[int]] = field(default_factory=dict)
    _order: list[int] = field(default_factory=list)
    _next: dict[int, int | None] = field(default_factory=dict)  # next_layer's answers

    def register(self, layer: int, fn: RouterFn) -> None:
        self.routers[layer] = fn
        self._order = sorted(self.routers)
        self._next = {}

    def next_layer(self, layer: int) -> int | None:
        """The first registered MoE layer after `layer` (None past the last)."""
        nxt = self._next.get(layer, -1)
        if nxt == -1:
            nxt = self._next[layer] = next((n for n in self._order if n > layer), None)
        return nxt

    def observe(self, layer: int, routed: list[int]) -> None:
        """Score the prediction made for `layer` (if any) against what it routed to."""
        pred = self._pending.pop(layer, None)
        if pred is not None:
            self.gates.setdefault(layer, Gate()).score(pred, set(routed), self.ema)
        pred = self._wrap_pending.pop(layer, None)
        if pred is not None:
            self.wrap_gates.setdefault(layer, Gate()).score(pred, set(routed), self.ema)

    def predict(self, layer: int, x: torch.Tensor, num_experts: int) -> tuple[int, list[int]] | None:
        """Run the next MoE layer's router on `x` (this layer's MoE input). Returns (next layer, its predicted
        experts, best first: every token's first choice, then every token's second, ...) when that layer's gate
        is open, else None (the prediction is still kept for scoring)."""
        if not self.enabled:
            return None
        nxt = self.next_layer(layer)
        if nxt is None:  # the last MoE layer: only the next token's first layers are left to fetch ahead
            if self.fill is not None and self.fill_depth > 1:
                preds = self._wrap(x, self.fill_depth - 1, num_experts)
                if preds:
                    self.fill(preds)
            return None
        gate = self.gates.setdefault(nxt, Gate())
        closed = gate.scored >= self.warmup and gate.recall < self.threshold
        if closed:
            gate.closed_steps += 1
            if gate.closed_steps % self.probe:
                return None
        ranked = _ranked(self.routers[nxt](x))
        self._pending[nxt] = set(ranked)
        if self.fill is not None and len(ranked) <= self.max_share * num_experts:
            self._fill_ahead(nxt, x, ranked, num_experts)
        if closed or gate.scored < self.warmup or len(ranked) > self.max_share * num_experts:
            return None
        gate.issued_steps += 1
        return nxt, ranked

    def _fill_ahead(self, nxt: int, x: torch.Tensor, ranked: list[int], num_experts: int) -> None:
        """Hand `fill` the predictions for `nxt` (`fill_width` wide) and the `fill_depth - 1` MoE layers after it,
        past the last layer the next token's first ones (`_wrap`)."""
        preds = [(nxt, ranked if self.fill_width == 1 else _ranked(self.routers[nxt](x, self.fill_width)))]
        layer = nxt
        for i in range(self.fill_depth - 1):
            layer = self.next_layer(layer)
            if layer is None:
                preds += self._wrap(x, self.fill_depth - 1 - i, num_experts)
                break
            preds.append((layer, _ranked(self.routers[layer](x))))
        self.fill(preds)

    def _wrap(self, x: torch.Tensor, depth: int, num_experts: int) -> list[tuple[int, list[int]]]:
        """The next token's first `depth` MoE layers, each ranked by its router on `x` `wrap_width` x k wide, kept
        for scoring. A single row's guess goes at any width (the fill fetches only what the SSD tier lacks, and
        unused guesses are held to their share of it); several rows' (a prefill's) not when they name more than
        `max_share` of the experts."""
        if not self.wrap_width or not self._order:
            return []
        out = []
        for layer in self._order[:depth]:
            ranked = _ranked(self.routers[layer](x, self.wrap_width))
            if x.shape[0] > 1 and len(ranked) > self.max_share * num_experts:
                return out
            self._wrap_pending[layer] = set(ranked)
            out.append((layer, ranked))
        return out

    def wrap_report(self) -> dict[int, dict]:
        """Recall of the next-token guesses (`wrap_width`) for each first MoE layer they named."""
        return {layer: {"lifetime_recall": round(g.correct / max(1, g.routed), 3), "scored": g.scored,
                        "predicted_per_step": round(g.predicted / max(1, g.scored), 1)}
                for layer, g in sorted(self.wrap_gates.items())}

    def report(self) -> dict[int, dict]:
        return {layer: {"recall": round(g.recall, 3), "on": g.scored >= self.warmup and g.recall >= self.threshold,
                        "issued_steps": g.issued_steps, "lifetime_recall": round(g.correct / max(1, g.routed), 3)}
                for layer, g in sorted(self.gates.items())}


def _ranked(ids: torch.Tensor) -> list[int]:
    """Expert ids [T, n] (each row best first) as one list best first: every token's first choice, then every
    token's second, ..., each expert once."""
    return list(dict.fromkeys(ids.t().reshape(-1).tolist()))
