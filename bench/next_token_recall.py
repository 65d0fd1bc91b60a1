"""Recall of guesses for the next token's first MoE layers (issue #15: what the fetch-ahead can fetch for a layer no
earlier layer of its own token predicts): temporal reuse (the experts that layer chose for recent tokens) against
that layer's router applied to the current token's MoE inputs, on decode rows at temperature 1. Prints JSON;
not timed (run it niced).

    python bench/next_token_recall.py DIR [GEN] [RAM_BUDGET]
"""
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from moestream.engine.engine import Engine  # noqa: E402

path, gen = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 40
eng = Engine.open(path, ram_budget=sys.argv[3] if len(sys.argv) > 3 else "1GiB", threads=1)
la = eng.runner.lookahead
routed, xs = [], []  # per decode token: {layer: set}, {layer: x}
cur_r, cur_x = {}, {}
o_obs, o_pred = la.observe, la.predict
def observe(layer, r):
    cur_r[layer] = set(r); return o_obs(layer, r)
def predict(layer, x, n):
    if x.shape[0] == 1: cur_x[layer] = x.detach().clone()
    return o_pred(layer, x, n)
la.observe, la.predict = observe, predict
order = None
prompt = [(i * 7919) % 500 + 5 for i in range(2)]
for tok in eng.stream(prompt, gen, temperature=1.0, seed=0, stop_token_ids=[]):
    routed.append(dict(cur_r)); xs.append(dict(cur_x)); cur_r.clear(); cur_x.clear()
# the first entry is prefill (+ first sample); decode tokens follow
layers = sorted(la.routers)
L0, L1 = layers[0], layers[1]
k = 8
res = {}
def rec(name, pred_fn, target_layer=L0):
    hit = tot = npred = 0
    for t in range(2, len(routed) - 0):
        if target_layer not in routed[t] or t - 1 < 1: continue
        p = pred_fn(t)
        if p is None: continue
        p = list(p)
        hit += len(set(p) & routed[t][target_layer]); tot += len(routed[t][target_layer]); npred += len(p)
    res[name] = (round(hit / max(1, tot), 3), round(npred / max(1, len(routed) - 2), 1))
def ranked(ids): return list(dict.fromkeys(ids.t().reshape(-1).tolist()))
for tgt in (L0, L1):
    rec(f"L{tgt} temporal last token", lambda t: routed[t-1].get(tgt), tgt)
    for N in (2, 4, 8):
        def f(t, N=N):
            c = Counter(e for s in range(max(1, t-N), t) for e in routed[s].get(tgt, ()))
            return [e for e, _ in c.most_common(k)]
        rec(f"L{tgt} temporal top{k} of last {N}", f, tgt)
        def f2(t, N=N):
            c = Counter(e for s in range(max(1, t-N), t) for e in routed[s].get(tgt, ()))
            return [e for e, _ in c.most_common(2 * k)]
        rec(f"L{tgt} temporal top{2*k} of last {N}", f2, tgt)
    for src in (layers[-1], layers[-2], layers[-4], layers[len(layers)//2]):
        for w in (1, 2):
            rec(f"L{tgt} router on L{src} input (prev token) width {w}",
                lambda t, src=src, w=w: ranked(la.routers[tgt](xs[t-1][src], w)) if src in xs[t-1] else None, tgt)
    # same token, from the embedding? not available here; a frequency prior over the whole run so far
    def fall(t):
        c = Counter(e for s in range(1, t) for e in routed[s].get(tgt, ()))
        return [e for e, _ in c.most_common(k)]
    rec(f"L{tgt} all-so-far top{k}", fall, tgt)
# baseline: next-layer lookahead recall of this model (layer l+1 from layer l input, same token)
hit = tot = 0
for t in range(1, len(routed)):
    for a, b in zip(layers, layers[1:]):
        if a in xs[t] and b in routed[t]:
            p = set(ranked(la.routers[b](xs[t][a])))
            hit += len(p & routed[t][b]); tot += len(routed[t][b])
res["next layer, same token (reference)"] = (round(hit / max(1, tot), 3), 8)
print(json.dumps({"model": str(path), "tokens": len(routed), "recall, experts predicted per token": res}, indent=1))
eng.close()
