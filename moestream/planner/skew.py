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

import math
from dataclasses import dataclass, field
from functools import lru_cache


@dataclass(frozen=True)
class Skew:
    """Zipf exponent of expert popularity within a layer (0: uniform) and where the value comes from."""

    exponent: float
    source: str
    reuse: float = 0.0  # P(an expert of token t is routed again at t + 1); 0: no more than chance
    # measured popularity by rank (most popular first, summing to 1; a trace's per-layer shares averaged rank by
    # rank): used instead of the Zipf law where it covers the model's experts
    weights: tuple[float, ...] | None = None
    # the same per MoE layer (a trace's layers, in order): each layer's own law, and a cache shared by all layers
    # holds the experts most popular over the whole model (layers differ: early ones near uniform, late ones skewed)
    layers: tuple[tuple[float, ...], ...] | None = None
    # the recorded routing itself (prompts[p][t][j]: token t's expert ids in MoE layer j), replayed through the
    # engine's cache policy for one stream's cold start (replay_decode)
    routing: list | None = field(default=None, compare=False, repr=False)

    def describe(self) -> str:
        if self.weights is not None:
            top = max(1, len(self.weights) // 10)
            pop = (f"measured popularity of {len(self.weights)} experts by rank (top 10% take "
                   f"{sum(self.weights[:top]):.0%} of the weight; Zipf fit {self.exponent:g})")
            if self.layers is not None:
                tops = [sum(w[:top]) for w in self.layers]
                pop += (f", per MoE layer where the model's {len(self.layers)} match (top 10% "
                        f"{min(tops):.0%}-{max(tops):.0%}; the cache holds the most popular over all layers)")
        else:
            pop = ("uniform popularity (every expert equally likely)" if self.exponent == 0 else
                   f"Zipf-like popularity, rank-i expert weight i^-{self.exponent:g}")
        return f"{pop}, next-token reuse {self.reuse:g} ({self.source})"

    def replayable(self, num_experts: int, moe_layers: int) -> bool:
        """The recorded routing covers the model's MoE layers (and no expert id beyond its count)."""
        if not self.routing or self.layers is None:
            return False
        return len(self.layers) == moe_layers and all(len(w) == num_experts for w in self.layers)

    def laws(self, num_experts: int, moe_layers: int) -> list[float | tuple[float, ...]]:
        """Each MoE layer's law where the measured layers match the model's (count and experts), else one law
        standing for every layer."""
        if self.layers is not None and len(self.layers) == moe_layers and all(len(w) == num_experts
                                                                               for w in self.layers):
            return list(self.layers)
        return [self.law(num_experts)]

    def law(self, num_experts: int) -> float | tuple[float, ...]:
        """What selection() takes for a layer of `num_experts`: the measured weights where they cover exactly
        that many experts, else the exponent."""
        return self.weights if self.weights is not None and len(self.weights) == num_experts else self.exponent


def excess_reuse(num_experts: int, top_k: int, reuse: float) -> float:
    """The share of a token's experts reused from the previous token beyond what independent routing gives
    (chance: top_k / num_experts, already inside the popularity hit rate)."""
    chance = min(1.0, top_k / max(1, num_experts))
    return max(0.0, reuse - chance) / (1.0 - chance) if chance < 1.0 else 0.0


@lru_cache(maxsize=64)
def selection(num_experts: int, top_k: int, exponent: float | tuple[float, ...]) -> tuple[float, ...]:
    """P(expert of rank i is among a token's top_k), most popular first; sums to top_k. The popularity share p_i
    (rank-i weight i^-exponent, or `exponent` itself when it is a tuple of measured weights, most popular first)
    is scaled by one factor and capped at 1 (an expert is picked at most once per token), the factor water-filled
    so the probabilities sum to top_k."""
    e = max(1, num_experts)
    k = max(0, min(top_k, e))
    if isinstance(exponent, tuple):
        if len(exponent) != e:
            raise ValueError(f"{len(exponent)} measured weights for {e} experts")
        weights = sorted((max(0.0, float(w)) for w in exponent), reverse=True)
        if sum(weights) <= 0:
            weights = [1.0] * e
    else:
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


def hit_rate(num_experts: int, top_k: int, exponent: float | tuple[float, ...], cached: float, reuse: float = 0.0) -> float:
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


def distinct(num_experts: int, top_k: int, exponent: float | tuple[float, ...], tokens: int, cached: float = 0.0,
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


def single_row(num_experts: int, top_k: int, exponent: float | tuple[float, ...], tokens: int) -> float:
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


def first_use(num_experts: int, top_k: int, exponent: float | tuple[float, ...], cached: float, seen: float,
              tokens: int = 1, over: int = 1) -> float:
    """Expected experts of the cached (most popular `cached`) set that a step of `tokens` tokens routes to and no
    token since the cache was empty did (`seen` tokens before this step): the cache has not loaded them yet, so
    they miss although the steady state holds them. A cold start's compulsory misses; 0 once every cached expert
    has been used. With `over` > 1: the mean over that many consecutive steps (seen, seen + tokens, ...), in
    closed form."""
    q = selection(num_experts, top_k, exponent)
    c = max(0.0, min(float(len(q)), cached))
    whole, n, g = int(c), max(0, tokens), max(1, over)
    out = 0.0
    for i, qi in enumerate(q[:whole + 1]):
        part = 1.0 if i < whole else c - whole
        if part <= 0 or qi <= 0:
            continue
        stay = (1.0 - qi) ** n  # not used by one step
        mean = 1.0 if g == 1 or stay >= 1.0 else (1.0 - stay ** g) / (g * (1.0 - stay))  # mean of stay^j, j < g
        out += part * (1.0 - stay) * (1.0 - qi) ** max(0.0, seen) * mean
    return out


def split_cache(laws: list, num_experts: int, top_k: int, cached_per_layer: float) -> list[float]:
    """Experts each layer keeps when a cache of cached_per_layer x layers experts holds the most popular over all
    layers (a global frequency-aware cache): one law, or layers alike, keep cached_per_layer each."""
    if len(laws) <= 1:
        return [cached_per_layer] * max(1, len(laws))
    total = max(0.0, cached_per_layer) * len(laws)
    ranked = sorted(((qi, j) for j, law in enumerate(laws) for qi in selection(num_experts, top_k, law)),
                    key=lambda x: -x[0])
    out = [0.0] * len(laws)
    for qi, j in ranked:
        if total <= 0:
            break
        take = min(1.0, total)
        out[j] += take
        total -= take
    return out


# ---- a measured routing ----------------------------------------------------------------------------------------
def routing_report(prompts: list[list[list[list[int]]]], num_experts: int, top_k: int) -> dict:
    """The part of `moestream trace --json`'s report the planner reads, from recorded routing: prompts[p][t][j] is
    the k expert ids token t of prompt p took in MoE layer j. Per layer: every expert's share of the routings
    (most used first) and the top-10% share; P(an expert of token t is routed again at t + 1) within a prompt."""
    layers = max((len(tok) for p in prompts for tok in p), default=0)
    if not layers or num_experts < 1:
        raise ValueError("the trace holds no routed token")
    counts = [[0] * num_experts for _ in range(layers)]
    same, pairs = [0] * layers, [0] * layers
    tokens = 0
    for p in prompts:
        for t, tok in enumerate(p):
            tokens += 1
            for j, ids in enumerate(tok):
                for e in ids:
                    if 0 <= int(e) < num_experts:
                        counts[j][int(e)] += 1
                if t:
                    prev = set(p[t - 1][j])
                    same[j] += sum(1 for e in ids if e in prev)
                    pairs[j] += len(ids)
    top = max(1, num_experts // 10)
    usage = []
    for row in counts:
        total = max(1, sum(row))
        shares = sorted((c / total for c in row), reverse=True)
        usage.append({"top10_share": sum(shares[:top]), "shares": [round(x, 6) for x in shares]})
    return {"tokens": tokens, "num_experts": num_experts, "top_k": top_k, "usage": usage,
            "reuse": [s_ / n if n else 0.0 for s_, n in zip(same, pairs)],
            "routing": [[[[int(e) for e in ids] for ids in tok] for tok in p] for p in prompts]}


def from_report(report: dict, source: str, pseudo: float = 0.5) -> Skew:
    """A Skew from a routing report (`moestream trace --json`, or routing_report's). Popularity: each layer's
    shares as counts (shares x tokens x top_k) plus `pseudo` each (an expert the trace never saw is rare, not
    impossible), sorted: kept per layer, and averaged rank by rank over the layers (for a model whose layers the
    trace does not match); a report without per-expert shares gives the Zipf law alone. The Zipf exponent fitted to each layer's top-10% share, averaged, is printed beside it. Reuse: the
    layers' mean P(reuse next)."""
    e, k = int(report["num_experts"]), int(report["top_k"])
    rows, reuse = report["usage"], report.get("reuse") or [0.0]
    if not rows:
        raise ValueError("the report has no MoE layer")
    fits = [fit_exponent(float(u["top10_share"]), e, k) for u in rows]
    weights = None
    routed = float(report.get("tokens") or 0) * k
    layers = None
    if all(len(u.get("shares") or ()) == e for u in rows):
        smooth = []
        for u in rows:
            c = [float(x) * routed for x in u["shares"]]
            total = sum(c) + pseudo * e
            smooth.append(tuple(sorted(((x + pseudo) / total for x in c), reverse=True)))
        weights = tuple(sum(col) / len(rows) for col in zip(*smooth))
        layers = tuple(smooth)
    return Skew(round(sum(fits) / len(fits), 3), f"{source}: {report.get('tokens')} tokens x {len(rows)} MoE layers",
                round(sum(reuse) / len(reuse), 4), weights, layers, report.get("routing") or None)


def from_trace_file(path) -> Skew:
    """A Skew from `moestream trace --save FILE` (JSON lines: a header with layers / num_experts / top_k, then one
    object per token with its prompt, position and expert ids per layer) or a routing report: `moestream trace
    --json`'s, or `moestream plan --save-skew`'s."""
    import json

    text = open(path, encoding="utf-8").read()
    try:
        report = json.loads(text)
    except ValueError:
        report = None
    if isinstance(report, dict) and "usage" in report:
        return from_report(report, report.get("source") or f"routing report {path}")
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not lines or "num_experts" not in lines[0]:
        raise ValueError(f"{path}: neither a `moestream trace --save` file nor a routing report")
    head, prompts = lines[0], {}
    for row in lines[1:]:
        prompts.setdefault(row["prompt"], []).append((row["pos"], row["experts"]))
    routed = [[ids for _, ids in sorted(p)] for _, p in sorted(prompts.items())]
    return from_report(routing_report(routed, int(head["num_experts"]), int(head["top_k"])), f"trace {path}")


def binomial_spread(top_k: int, mean: float) -> dict[int, float]:
    """Share of a layer's one-token steps with each number of misses when its top_k routed experts each miss
    independently with the same chance, `mean` / top_k (no recorded routing to replay)."""
    k = max(1, top_k)
    p = min(1.0, max(0.0, mean / k))
    return {m: math.comb(k, m) * p ** m * (1.0 - p) ** (k - m) for m in range(k + 1)}


def replay_decode(routing: list, capacity: int, prompt: int, gen: int, policy: str = "lfru",
                  chunk: int = 512, spread: dict[int, float] | None = None,
                  fills: list[float] | None = None) -> tuple[float, float, str]:
    """One stream's cold start replayed through the engine's cache policy: (expert misses per generated token,
    all MoE layers together; hit rate of the generated tokens; what was replayed). The recorded tokens are cut into
    windows of prompt + gen tokens; each starts with an empty cache of `capacity` experts (shared by every layer),
    feeds its prompt in `chunk`-token steps (a layer step loads the distinct experts of its tokens) and counts the
    misses of its generated tokens, one layer step per token, served as the engine serves them (hits first, never
    evicting the step's own experts; a step larger than the cache streams through). A trace shorter than one window
    gives one window of half prompt, half generated tokens. `spread`, if given, is filled with the share of the
    generated tokens' layer steps that had each number of misses (what the step's timing depends on, not only
    their mean: a layer step waits for its own reads). `fills`, if given, gets the share of the generated tokens'
    misses that filled free room rather than evicting (a read that evicts reuses the evicted expert's buffer; one
    into free room faults in a fresh one)."""
    from moestream.experts.policies import POLICIES

    misses = routed = windows = gen_tokens = filled = 0
    counts: dict[int, int] = {}
    p = g = 0
    for tokens in routing:
        n = len(tokens)
        if n < 2:
            continue
        p, g = (prompt, gen) if n >= prompt + gen else (min(prompt, n // 2), n - min(prompt, n // 2))
        for start in range(0, n - (p + g) + 1, p + g):
            windows, gen_tokens = windows + 1, gen_tokens + g
            resident: set = set()
            pol = POLICIES[policy]()

            def serve(step: list, count: bool) -> None:
                nonlocal misses, routed, filled
                keep = frozenset(step)
                before = misses
                for key in step:
                    routed += count
                    free = len(resident) < capacity
                    if serve_key(key, resident, pol, capacity, keep):
                        misses += count
                        filled += count and free
                if count:
                    counts[misses - before] = counts.get(misses - before, 0) + 1

            layers = len(tokens[start])
            for c0 in range(start, start + p, chunk):
                part = tokens[c0:min(start + p, c0 + chunk)]
                for j in range(layers):
                    serve(sorted({(j, int(e)) for tok in part for e in tok[j]}), False)
            for t in range(start + p, start + p + g):
                for j in range(layers):
                    serve([(j, int(e)) for e in dict.fromkeys(tokens[t][j])], True)
    if not routed:
        return 0.0, 1.0, "no routed token to replay"
    if spread is not None:
        steps = sum(counts.values())
        spread.update({m: n / steps for m, n in sorted(counts.items())})
    if fills is not None:
        fills.append(filled / misses if misses else 0.0)
    return (misses / gen_tokens, 1.0 - misses / routed,
            f"{windows} windows of {p} prompt + {g} generated recorded tokens replayed through {policy}")


def serve_key(key, resident: set, pol, capacity: int, keep: frozenset, evict: bool = True) -> bool:
    """One routed expert through a replayed cache of `capacity` experts under policy `pol`; True on a miss. A hit is
    touched; a miss is read and kept, evicting the policy's first victim outside `keep` (the step's own experts)
    when the cache is full, or (`evict` False: a scanning step) kept only where there is free room."""
    if key in resident:
        pol.touch(key)
        return False
    if len(resident) >= capacity:
        victim = next((k for k in pol.victims() if k not in keep), None) if evict else None
        if victim is None:
            return True
        resident.discard(victim)
        pol.remove(victim)
    resident.add(key)
    pol.insert(key)
    return True


def batch_windows(routing: list, prompt: int, gen: int) -> list[list]:
    """The recorded prompts cut into windows of prompt + gen tokens, in the order a batch of independent sequences
    takes them: every prompt's first window, then every prompt's second, ... (windows of one prompt share its
    direction in the residual stream, so distinct prompts come first)."""
    cut = [[tokens[s:s + prompt + gen] for s in range(0, len(tokens) - (prompt + gen) + 1, prompt + gen)]
           for tokens in routing if len(tokens) >= prompt + gen]
    return [c[i] for i in range(max((len(c) for c in cut), default=0)) for c in cut if i < len(c)]


def replay_batch(routing: list, capacity: int, prompt: int, gen: int, sequences: int, num_experts: int,
                 policy: str = "lfru", chunk: int = 512,
                 scan_share: float = 0.5) -> tuple[float, float, float, str] | None:
    """`sequences` sequences decoding together from an engine just opened, replayed through the engine's cache
    policy: (expert reads per decode step, all MoE layers together; distinct experts per layer step; hit rate of
    the decode steps; what was replayed), or None where the recording has fewer than `sequences` windows of
    prompt + gen tokens (batch_windows). Each group of `sequences` windows starts with an empty cache of `capacity`
    experts (shared by every layer): their prompts fed `chunk` tokens a step, then `gen` decode steps, each layer
    step routing to the union of the sequences' experts for that token, served as the engine serves a multi-row
    step (experts/dispatch.py): hits first, then reads, each evicting the policy's victim outside the step's own
    experts, except in a step routing to `scan_share` or more of a layer's experts, which evicts nothing (reads fill
    free room only, else stream through). Every sequence keeps its own routing, so the experts its own tokens reuse
    stay cached, which a pooled popularity does not see."""
    from moestream.experts.policies import POLICIES

    wins = batch_windows(routing, prompt, gen)
    n = max(1, sequences)
    if len(wins) < n or gen < 1:
        return None
    reads = routed = steps = layer_steps = 0
    groups = len(wins) // n
    for g0 in range(groups):
        group = wins[g0 * n:(g0 + 1) * n]
        resident: set = set()
        pol = POLICIES[policy]()

        def serve(step: list) -> int:
            keep, scan = frozenset(step), len(step) >= scan_share * num_experts
            return sum(serve_key(key, resident, pol, capacity, keep, evict=not scan) for key in step)

        layers = len(group[0][0])
        for c0 in range(0, prompt, chunk):
            for j in range(layers):
                serve(sorted({(j, int(e)) for w in group for tok in w[c0:min(prompt, c0 + chunk)] for e in tok[j]}))
        for t in range(prompt, prompt + gen):
            steps += 1
            for j in range(layers):
                step = sorted({(j, int(e)) for w in group for e in w[t][j]})
                reads += serve(step)
                routed += len(step)  # distinct experts of the layer step (each routed once)
                layer_steps += 1
    return (reads / steps, routed / layer_steps, 1.0 - reads / max(1, routed),
            f"{groups} group(s) of {n} windows of {prompt} prompt + {gen} generated recorded tokens decoding "
            f"together, replayed through {policy}")
