"""Router lookahead recall per family: how many of the next MoE layer's routed experts the lookahead predicted.

Each MoE layer runs the next MoE layer's router (that family's exact selection rule) on its own router input; this
script decodes through the engine under a budget holding `--fraction` of the experts, with the gate forced open
(threshold 0, no warm-up) so every decode step's prediction is scored and its best `--reads` not-resident experts
are read ahead. Per checkpoint it prints recall@top-k (predicted and routed / routed, decode steps only), precision
(predicted and routed / predicted), chance (k / experts), the experts read ahead that were used before eviction,
wasted (read, not used) or withdrawn before their read started, their bytes, and how many layers the default gate
(recall EMA >= 0.5) would leave on. Random-weight checkpoints have unrelated routers in consecutive layers; the
trained demo model (`demo`) has learned routing. Not timed (no lock needed). Usage:
    python bench/lookahead_recall.py [--families qwen3_moe,mixtral,kimi_linear,kimi_k3,deepseek_v3,gpt_oss,demo]
        [--preset medium] [--root /work/tmp/lookahead] [--tokens 32] [--json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

FAMILIES = ("qwen3_moe", "mixtral", "kimi_linear", "kimi_k3", "deepseek_v3", "gpt_oss", "demo")
SHARED_Q3_MEDIUM = Path("/work/synth/q3m_med")  # the shared medium qwen3_moe, when this machine has it
# transformers-built families (no moestream.synth layout): the small preset's widths (hidden 512, 8 layers,
# 64 experts of 256, top-8); DeepSeek-V3 with 8 groups of which 4 are kept, as the real model
HF_SMALL = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, head_dim=64,
                max_position_embeddings=4096, eos_token_id=None, bos_token_id=None, pad_token_id=0)


def checkpoint(family: str, preset: str, root: Path) -> Path:
    """The checkpoint directory for `family`, written once under `root` when it does not exist yet."""
    if family == "demo":
        from moestream import demo_model

        return demo_model.path()
    if family == "qwen3_moe" and preset == "medium" and (SHARED_Q3_MEDIUM / "config.json").exists():
        return SHARED_Q3_MEDIUM
    path = root / f"{family}_{preset if family not in ('deepseek_v3', 'gpt_oss') else 'small'}"
    if (path / "config.json").exists():
        return path
    if family in ("deepseek_v3", "gpt_oss"):
        _write_hf(family, path)
    else:
        from moestream.synth import synthesize

        synthesize(family, path, preset, progress=False)
    return path


def _router_init(w: torch.Tensor, gen: torch.Generator) -> None:
    """As moestream.synth's routers: logits of std about 2 on unit-RMS input, per-expert row scales in [0.5, 1.5]."""
    w.copy_(torch.randn(w.shape, generator=gen) * (2.0 / math.sqrt(w.shape[-1]))
            * (0.5 + torch.rand((w.shape[0], 1), generator=gen)))


def _write_hf(family: str, path: Path) -> None:
    """A random transformers model (bf16 on disk) with synth-style routers, correction biases and router biases."""
    import transformers

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if family == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(**HF_SMALL, intermediate_size=2048, moe_intermediate_size=256,
                                            n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4,
                                            first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=256,
                                            qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64)
        model = transformers.DeepseekV3ForCausalLM(cfg)
        routers = [(layer.mlp.gate.weight, layer.mlp.gate.e_score_correction_bias) for layer in model.model.layers[1:]]
    else:
        cfg = transformers.GptOssConfig(**HF_SMALL, intermediate_size=256, num_key_value_heads=2,
                                        num_local_experts=64, num_experts_per_tok=8, sliding_window=128)
        model = transformers.GptOssForCausalLM(cfg)
        routers = [(layer.mlp.router.weight, layer.mlp.router.bias) for layer in model.model.layers]
    with torch.no_grad():
        for weight, bias in routers:
            _router_init(weight, gen)
            bias.copy_(0.05 * torch.randn(bias.shape, generator=gen))
    model.to(torch.bfloat16).save_pretrained(path)
    # a tokenizer is not needed: prompts are random ids


def _budget(path: Path, fraction: float) -> int:
    from moestream.engine.engine import plan

    p = plan(path)
    return p.dense_bytes + p.scratch_bytes + max(2 * p.max_expert_bytes, int(p.expert_bytes * fraction))


def _prompts(family: str, vocab: int, n: int, length: int) -> list[list[int]]:
    """Random ids for random-weight models; the demo model's own code prompts for the trained one."""
    if family == "demo":
        from moestream import demo_model
        from moestream.tokenizer import Tokenizer

        tok = Tokenizer.load(demo_model.path())
        texts = [t.strip("\n") + "\n" for t in (demo_model.path() / "prompts.txt").read_text().split("---\n")]
        return [tok.encode(t) for t in texts[:n]]
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def _totals(eng) -> dict:
    gates, t = eng.runner.lookahead.gates, eng.runner.times
    return {"predicted": sum(g.predicted for g in gates.values()), "correct": sum(g.correct for g in gates.values()),
            "routed": sum(g.routed for g in gates.values()), "reads": t.prefetch_reads, "used": t.prefetch_used,
            "withdrawn": t.prefetch_withdrawn, "layers": {n: (g.correct, g.routed) for n, g in gates.items()}}


def measure(family: str, path: Path, args: argparse.Namespace) -> dict:
    """Decode `args.tokens` tokens after each of `args.prompts` prompts; recall and read-ahead over decode steps."""
    from moestream import Engine

    eng = Engine.open(path, ram_budget=_budget(path, args.fraction))
    la = eng.runner.lookahead
    la.threshold, la.warmup, la.reads = 0.0, 0, args.reads
    layout = eng.plan.layout
    gen = torch.Generator().manual_seed(args.seed)
    temperature = 0.7 if family == "demo" else 1.0  # random weights loop on one token under greedy
    diff = {k: 0 for k in ("predicted", "correct", "routed", "reads", "used", "withdrawn")}
    layers: dict[int, list[int]] = {}  # layer -> [correct, routed] over decode steps
    try:
        for prompt in _prompts(family, eng.vocab_size, args.prompts, args.prompt_len):
            state = eng.new_sequence()
            logits = eng.prefill(state, prompt)
            eng.runner.finish()  # prefill's read-ahead lands before decode is counted
            before = _totals(eng)
            for _ in range(args.tokens):
                tok = int(torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=gen))
                (logits,) = eng.step([(state, [tok])])
            eng.runner.finish()
            after = _totals(eng)
            eng.free(state)
            for k in diff:
                diff[k] += after[k] - before[k]
            for n, (correct, routed) in after["layers"].items():
                c0, r0 = before["layers"].get(n, (0, 0))
                got = layers.setdefault(n, [0, 0])
                got[0], got[1] = got[0] + correct - c0, got[1] + routed - r0
        per = eng.plan.store.resident_nbytes(layout.moe_layers[0], 0)
        on = sum(1 for g in la.gates.values() if g.recall >= 0.5)  # Lookahead's default threshold
    finally:
        eng.close()
    wasted = diff["reads"] - diff["withdrawn"] - diff["used"]
    return {"family": family, "path": str(path), "experts": layout.num_experts, "top_k": layout.top_k,
            "moe_layers": len(layout.moe_layers), "chance": layout.top_k / layout.num_experts,
            "recall": diff["correct"] / max(1, diff["routed"]), "precision": diff["correct"] / max(1, diff["predicted"]),
            "read_ahead": diff["reads"], "used": diff["used"], "wasted": wasted, "withdrawn": diff["withdrawn"],
            "used_bytes": diff["used"] * per, "wasted_bytes": wasted * per, "gates_on_default": on,
            "gates": len(la.gates),
            "layer_recall": {n: round(c / max(1, r), 3) for n, (c, r) in sorted(layers.items())}}


def table(rows: list[dict]) -> str:
    head = (f"{'family':<12} {'E':>4} {'k':>2} {'chance':>6} {'recall@k':>8} {'precision':>9} "
            f"{'read ahead':>10} {'used':>5} {'wasted':>6} {'withdrawn':>9} {'MiB used':>9} {'MiB wasted':>10} "
            f"{'gate on':>7}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['family']:<12} {r['experts']:>4} {r['top_k']:>2} {r['chance']:>6.3f} {r['recall']:>8.3f} "
                     f"{r['precision']:>9.3f} {r['read_ahead']:>10} {r['used']:>5} {r['wasted']:>6} "
                     f"{r['withdrawn']:>9} {r['used_bytes'] / 2**20:>9.1f} {r['wasted_bytes'] / 2**20:>10.1f} "
                     f"{r['gates_on_default']:>3}/{r['gates']:<3}")
    lines.append("recall per predicted layer (decode steps):")
    lines += [f"  {r['family']:<12} " + " ".join(f"{v:.2f}" for v in r["layer_recall"].values()) for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--preset", default="medium", help="moestream.synth preset of the random-weight families")
    ap.add_argument("--root", type=Path, default=Path("/work/tmp/lookahead"), help="where checkpoints are written")
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens per prompt")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=16, help="random prompt length (random-weight models)")
    ap.add_argument("--fraction", type=float, default=0.3, help="share of the expert bytes the budget caches")
    ap.add_argument("--reads", type=int, default=1, help="predicted experts read ahead per layer step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for family in args.families.split(","):
        rows.append(measure(family, checkpoint(family, args.preset, args.root), args))
        print(json.dumps(rows[-1]) if args.json else f"done: {family}", file=sys.stderr, flush=True)
    print(json.dumps(rows, indent=1) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
