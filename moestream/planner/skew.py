"""Routing skew: how often a MoE layer routes to each expert, and what a cache of the popular ones then hits.

Owns the routing model the planner states: a Zipf-like popularity per layer (expert of rank i is routed to with
weight i^-s; s = 0 is a uniform router), the per-token selection probabilities of top-k routing under it, the hit
rate of a cache holding a layer's C most popular experts (what a frequency-aware policy such as LFRU converges
to under a stationary popularity) plus temporal reuse (P(an expert routed for a token is routed again for the
next one), `moestream trace`'s "P(reuse next)" column: a cache holding the last token's experts hits the excess
over chance), and the expected distinct / not-cached experts of a step over N tokens. Pure arithmetic: no torch,
no checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Skew:
    """Zipf exponent of expert popularity within a layer (0: uniform) and where the value comes from."""

    exponent: float
    source: str
    reuse: float = 0.0  # P(an expert of token t is routed again at t + 1); 0: no more than chance

    def describe(self) -> str:
        pop = ("uniform popularity (every expert equally likely)" if self.exponent == 0 else
               f"Zipf-like popularity, rank-i expert weight i^-{self.exponent:g}")
        return f"{pop}, next-token reuse {self.reuse:g} ({self.source})"


def excess_reuse(num_experts: int, top_k: int, reuse: float) -> float:
    """The share of a token's experts reused from the previous token beyond what independent routing gives
    (chance: top_k / num_experts, already inside the popularity hit rate)."""
    chance = min(1.0, top_k / max(1, num_experts))
    return max(0.0, reuse - chance) / (1.0 - chance) if chance < 1.0 else 0.0


@lru_cache(maxsize=64)
def selection(num_experts: int, top_k: int, exponent: float) -> tuple[float, ...]:
    """P(expert of rank i is among a token's top_k), most popular first; sums to top_k. The popularity share p_i is
    scaled by one factor and capped at 1 (an expert is picked at most once per token), the factor water-filled so
    the probabilities sum to top_k."""
    e = max(1, num_experts)
    k = max(0, min(top_k, e))
    weights = [(i + 1) ** -exponent for i in range(e)]
    q = [0.0] * e
    capped, free = 0, list(range(e))
    while True:  # cap the most popular at 1 and spread the rest of k over the others in proportion
        total = sum(weights[i] for i in free)
        scale = (k - capped) / total if total > 0 else 0.0
        over = [i for i in free if weights[i] * scale > 1.0]
        if not over:
            for i in free:
                q[i] = weights[i] * scale
            return tuple(q)
        for i in over:
            q[i] = 1.0
        capped += len(over)
        free = [i for i in free if i not in set(over)]


def hit_rate(num_experts: int, top_k: int, exponent: float, cached: float, reuse: float = 0.0) -> float:
    """Share of a token's routed experts found in a cache holding the layer's `cached` most popular experts (a
    fractional count takes that share of the next expert) and, as far as room allows, the previous token's: a miss
    of the popular set is still a hit when it is the excess reuse of the last token's experts."""
    q = selection(num_experts, top_k, exponent)
    k = sum(q)
    if k <= 0:
        return 1.0
    c = max(0.0, min(float(len(q)), cached))
    whole = int(c)
    got = (sum(q[:whole]) + (q[whole] * (c - whole) if whole < len(q) else 0.0)) / k
    held = min(1.0, c / k)  # the share of the last token's experts the cache can hold
    return 1.0 - (1.0 - got) * (1.0 - excess_reuse(num_experts, top_k, reuse) * held)


def distinct(num_experts: int, top_k: int, exponent: float, tokens: int, cached: float = 0.0,
             reuse: float = 0.0) -> tuple[float, float]:
    """(expected distinct experts a step over `tokens` independent tokens routes to in one layer, expected
    distinct ones the cache lacks): expert i is used unless all tokens miss it, 1 - (1-q_i)^N; the cache holds the
    `cached` most popular and, as room allows, each token's previous experts (its excess reuse hits)."""
    q = selection(num_experts, top_k, exponent)
    n = max(0, tokens)
    used = [1.0 - (1.0 - qi) ** n for qi in q]
    c = max(0.0, min(float(len(q)), cached))
    whole = int(c)
    outside = sum(used[whole + 1:]) + (used[whole] * (1.0 - (c - whole)) if whole < len(used) else 0.0)
    held = min(1.0, c / max(1e-9, n * sum(q)))  # the share of every token's previous experts the cache can hold
    return sum(used), outside * (1.0 - excess_reuse(num_experts, top_k, reuse) * held)


def single_row(num_experts: int, top_k: int, exponent: float, tokens: int) -> float:
    """Expected experts of a layer step routed to by exactly one of `tokens` tokens (those run in the one-row
    native kernel; experts with more rows are expanded to fp32 and run as one GEMM)."""
    q = selection(num_experts, top_k, exponent)
    n = max(0, tokens)
    return sum(n * qi * (1.0 - qi) ** (n - 1) for qi in q) if n > 0 else 0.0


def top_share(num_experts: int, top_k: int, exponent: float, share: float = 0.1) -> float:
    """Share of routings that go to the most popular `share` of the experts (`moestream trace`'s top10% column)."""
    top = max(1, int(num_experts * share))
    return hit_rate(num_experts, top_k, exponent, top)


def fit_exponent(top10_share: float, num_experts: int, top_k: int) -> float:
    """The exponent whose top-10% share equals a measured one (bisection over [0, 4]): turns a `moestream trace`
    report into a --skew value."""
    lo, hi = 0.0, 4.0
    if top10_share <= top_share(num_experts, top_k, lo):
        return 0.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if top_share(num_experts, top_k, mid) < top10_share:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 3)
