"""moestream vs llama.cpp (llama-cpp-python) on the same synthetic qwen3_moe, bf16 experts in both, under the same
cgroup v1 memory cap (RSS plus page cache charged to the group), cold page cache, same prompt.

    python bench/vs_llamacpp.py convert MODEL OUT.gguf      # GGUF written with the `gguf` package (bf16 weights)
    python bench/vs_llamacpp.py run MODEL OUT.gguf --cap 1.5GiB [--rounds 2] [--mode greedy|forced]
    python bench/vs_llamacpp.py run MODEL OUT.gguf --warm [--rounds 5] [--threads 2]   # in RAM, no cap
    python bench/vs_llamacpp.py run MODEL OUT.gguf --cap 3.4GB --batch 256 --mode greedy --rounds 1

`--batch B` compares batched decoding instead: B sequences of `--prompt-len` random tokens, all prefilled together
and then decoded one token per sequence per step, greedy. llama.cpp runs its own batch API (B sequences per
llama_decode, one seq_id each, unified KV cache); moestream runs its server Scheduler (bench/batch_throughput.py's
runner) with its KV cache in bf16 (`--kv-dtype`, as llama.cpp keeps its in f16). Both report aggregate prefill
and decode tokens/s.

`forced` feeds both engines the same fixed token stream one token per step (identical routing, so identical
expert traffic); `greedy` lets each pick argmax (a random-weight model soon repeats one token, which makes the
routing static and flatters every cache). Each engine runs in a fresh child process placed in its own memory
cgroup (moestream/cgroup.py: v1, or v2 with its memory controller); the parent reads the group's peak charge and
prints one JSON line per run and a summary. Without a writable memory cgroup it runs uncapped and says so.

`--warm` is the in-RAM comparison instead: no cap, each engine in a fresh child that first runs the whole
workload once (experts cached / GGUF pages mapped), then times it --passes times: prefill of the 16-token prompt,
greedy decode of --gen-len tokens, and prefill of a --long-len prompt (512) in a fresh sequence. Children alternate
between the engines for --rounds rounds; the summary has medians over all timed passes and ratios, and says
whether the first generated ids agree. (Where loading the model takes minutes, --rounds 1 --passes 5 keeps the
engines' loads to one each.)

`--compute-dtype fp32|bf16 ...` is moestream's precision of many-row products (EngineOptions.compute_dtype; default
fp32): each value given runs as its own moestream child in every round (`--compute-dtype fp32 bf16` compares both
with llama.cpp side by side in one run); a moestream row and the summary's keys name it (`moestream` is fp32,
`moestream-bf16` bf16).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# ---- GGUF conversion ---------------------------------------------------------------------------------------
def convert(model: Path, out: Path) -> None:
    """Write MODEL (qwen3_moe safetensors, Hub or fused layout) as a qwen3moe GGUF, streaming one tensor at a time."""
    import gguf
    import numpy as np
    import torch

    from moestream.weights.index import CheckpointIndex

    cfg = json.loads((model / "config.json").read_text())
    index = CheckpointIndex.open(model)
    plan = list(_gguf_tensors(cfg, index))
    w = gguf.GGUFWriter(str(out), "qwen3moe")
    _write_kv(w, cfg, model)
    for name, shape, f32, _ in plan:
        dt = gguf.GGMLQuantizationType.F32 if f32 else gguf.GGMLQuantizationType.BF16
        nbytes = int(np.prod(shape)) * (4 if f32 else 2)
        w.add_tensor_info(name, shape, np.dtype(np.float32 if f32 else np.uint16), nbytes, raw_dtype=dt)
    w.write_header_to_file(out)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, f32, load in plan:
        t = load()
        arr = t.float().numpy() if f32 else t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
        w.write_tensor_data(arr.reshape(shape))
    w.close()


def _gguf_tensors(cfg: dict, index):
    """(gguf name, numpy-order shape, stored as f32?, loader) in file order; experts stacked per layer."""
    import torch

    h, e = cfg["hidden_size"], cfg.get("num_experts", cfg.get("num_local_experts"))
    inter = cfg["moe_intermediate_size"]
    ld = index.load
    yield "token_embd.weight", (cfg["vocab_size"], h), False, lambda: ld("model.embed_tokens.weight")
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}", f"blk.{i}"
        a = f"{p}.self_attn"
        for src, dst, f32 in (("input_layernorm", "attn_norm", True), ("post_attention_layernorm", "ffn_norm", True)):
            yield f"{b}.{dst}.weight", (h,), f32, (lambda n=f"{p}.{src}.weight": ld(n))
        for src, dst in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
            info = index[f"{a}.{src}.weight"]
            yield f"{b}.{dst}.weight", info.shape, False, (lambda n=info.name: ld(n))
        for src, dst in (("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
            info = index[f"{a}.{src}.weight"]
            yield f"{b}.{dst}.weight", info.shape, True, (lambda n=info.name: ld(n))
        yield f"{b}.ffn_gate_inp.weight", (e, h), True, (lambda n=f"{p}.mlp.gate.weight": ld(n))
        fused = f"{p}.mlp.experts.gate_up_proj" in index
        for part, shape in (("gate", (e, inter, h)), ("up", (e, inter, h)), ("down", (e, h, inter))):
            yield f"{b}.ffn_{part}_exps.weight", shape, False, (
                lambda p=p, part=part: _experts(index, p, part, e, fused))
    yield "output_norm.weight", (h,), True, lambda: ld("model.norm.weight")
    head = "lm_head.weight" if "lm_head.weight" in index else "model.embed_tokens.weight"
    yield "output.weight", (cfg["vocab_size"], h), False, lambda: ld(head)


def _experts(index, p: str, part: str, e: int, fused: bool):
    import torch

    if not fused:
        return torch.stack([index.load(f"{p}.mlp.experts.{j}.{part}_proj.weight") for j in range(e)])
    if part == "down":
        return index.load(f"{p}.mlp.experts.down_proj")
    gate, up = index.load(f"{p}.mlp.experts.gate_up_proj").chunk(2, dim=1)
    return (gate if part == "gate" else up).contiguous()


def _write_kv(w, cfg: dict, model: Path) -> None:
    import gguf

    w.add_name(model.name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg.get("intermediate_size", cfg["moe_intermediate_size"]))
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg.get("num_experts", cfg.get("num_local_experts")))
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    _write_vocab(w, cfg, model)


def _write_vocab(w, cfg: dict, model: Path) -> None:
    """GPT-2 style BPE from tokenizer.json (or a placeholder byte vocab when the checkpoint has none)."""
    n = cfg["vocab_size"]
    tok_file = model / "tokenizer.json"
    tokens, merges, special = [f"<t{i}>" for i in range(n)], [], set()
    if tok_file.exists():
        tj = json.loads(tok_file.read_text())
        for piece, i in tj["model"]["vocab"].items():
            if i < n:
                tokens[i] = piece
        for t in tj.get("added_tokens", []):
            if t["id"] < n:
                tokens[t["id"]], _ = t["content"], special.add(t["id"])
        merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(n)])
    if merges:
        w.add_token_merges(merges)
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(cfg["bos_token_id"])
    if cfg.get("eos_token_id") is not None:
        eos = cfg["eos_token_id"]
        w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)


# ---- the two workloads (run in child processes) ------------------------------------------------------------
def _read_io() -> int:
    """Bytes this process caused to be fetched from storage (page-fault readahead and O_DIRECT included)."""
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("read_bytes:"))


def _stream(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[int]]:
    import random

    rng = random.Random(args.seed)
    prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
    forced = [rng.randrange(3, vocab) for _ in range(args.gen_len)]
    return prompt, forced


def child_moestream(args: argparse.Namespace) -> dict:
    import moestream  # noqa: F401  # before torch: its OpenMP runtime's wait policy (moestream/omp.py)
    import torch

    from moestream import Engine

    eng = Engine.open(args.model, ram_budget=args.budget, threads=args.threads,
                      compute_dtype=args.compute_dtype[0])
    prompt, forced = _stream(args, eng.vocab_size)
    st = eng.new_sequence()
    t0 = time.perf_counter()
    logits = eng.prefill(st, prompt)
    ttft, io0, out = time.perf_counter() - t0, _read_io(), []
    t1 = time.perf_counter()
    for i in range(args.gen_len):
        tok = int(torch.argmax(logits)) if args.mode == "greedy" else forced[i]
        out.append(tok)
        (logits,) = eng.step([(st, [tok])])
    dt = time.perf_counter() - t1
    return _result(_label(args.compute_dtype[0]), args, dt, ttft, _read_io() - io0, out,
                   eng.stats["expert_hit_rate"])


def child_llama(args: argparse.Namespace) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=str(args.gguf), n_ctx=args.prompt_len + args.gen_len + 8, n_threads=args.threads,
                n_threads_batch=args.threads, n_batch=max(8, args.prompt_len), use_mmap=True, verbose=False)
    prompt, forced = _stream(args, llm.n_vocab())
    t0 = time.perf_counter()
    llm.eval(prompt)
    ttft, io0, out = time.perf_counter() - t0, _read_io(), []
    t1 = time.perf_counter()
    for i in range(args.gen_len):
        tok = int(llm.sample(temp=0.0)) if args.mode == "greedy" else forced[i]
        out.append(tok)
        llm.eval([tok])
    dt = time.perf_counter() - t1
    return _result("llama.cpp", args, dt, ttft, _read_io() - io0, out, None)


def _result(engine: str, args, dt: float, ttft: float, nbytes: int, out: list[int], hit) -> dict:
    import resource

    return {"engine": engine, "decode_tokens_per_s": args.gen_len / dt, "ttft_s": ttft,
            "bytes_read_per_token": nbytes / args.gen_len, "expert_hit_rate": hit,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "tokens": out[:8]}


def _label(compute_dtype: str) -> str:
    """moestream's engine label for a compute dtype: fp32 keeps the plain name the summaries always used."""
    return "moestream" if compute_dtype == "fp32" else f"moestream-{compute_dtype}"


# ---- warm, in-RAM comparison (--warm) -------------------------------------------------------------------------
def _long_prompt(args: argparse.Namespace, vocab: int) -> list[int]:
    import random

    rng = random.Random(args.seed + 1)
    return [rng.randrange(3, vocab) for _ in range(args.long_len)]


def _warm_result(engine: str, args, once) -> dict:
    """Runs the workload once to warm, then --passes timed times; per-pass rates and their medians."""
    once()
    passes = [once() for _ in range(args.passes)]
    rates = {"decode_tokens_per_s": [args.gen_len / p[1] for p in passes],
             "prefill_tokens_per_s": [args.prompt_len / p[0] for p in passes],
             "prefill_long_tokens_per_s": [args.long_len / p[2] for p in passes]}
    row = {"engine": engine, "threads": args.threads, "long_len": args.long_len, "tokens": passes[0][3][:8]}
    if engine.startswith("moestream"):
        row["compute_dtype"] = args.compute_dtype[0]
    for key, vals in rates.items():
        row[key] = sorted(vals)[len(vals) // 2]
        row[key + "_passes"] = vals
    return row


def warm_moestream(args: argparse.Namespace) -> dict:
    import moestream  # noqa: F401  # before torch: its OpenMP runtime's wait policy (moestream/omp.py)
    import torch

    from moestream import Engine

    eng = Engine.open(args.model, ram_budget=args.budget, threads=args.threads,
                      compute_dtype=args.compute_dtype[0])
    prompt, _ = _stream(args, eng.vocab_size)
    long = _long_prompt(args, eng.vocab_size)

    def once() -> tuple[float, float, float, list[int]]:
        st = eng.new_sequence()
        t0 = time.perf_counter()
        logits = eng.prefill(st, prompt)
        t1, out = time.perf_counter(), []
        for _ in range(args.gen_len):
            out.append(int(torch.argmax(logits)))
            (logits,) = eng.step([(st, [out[-1]])])
        t2 = time.perf_counter()
        eng.free(st)
        st = eng.new_sequence()
        t3 = time.perf_counter()
        eng.prefill(st, long)
        t4 = time.perf_counter()
        eng.free(st)
        return t1 - t0, t2 - t1, t4 - t3, out

    # the warm pass caches every expert the workload routes to
    return _warm_result(_label(args.compute_dtype[0]), args, once)


def warm_llama(args: argparse.Namespace) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=str(args.gguf), n_ctx=max(args.prompt_len + args.gen_len, args.long_len) + 8,
                n_threads=args.threads, n_threads_batch=args.threads, n_batch=max(args.long_len, args.prompt_len),
                n_ubatch=max(args.long_len, args.prompt_len), use_mmap=True, verbose=False)
    prompt, _ = _stream(args, llm.n_vocab())
    long = _long_prompt(args, llm.n_vocab())

    def once() -> tuple[float, float, float, list[int]]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1, out = time.perf_counter(), []
        for _ in range(args.gen_len):
            out.append(int(llm.sample(temp=0.0)))
            llm.eval([out[-1]])
        t2 = time.perf_counter()
        llm.reset()
        t3 = time.perf_counter()
        llm.eval(long)
        t4 = time.perf_counter()
        return t1 - t0, t2 - t1, t4 - t3, out

    return _warm_result("llama.cpp", args, once)  # the warm pass maps the GGUF's pages


def run_warm(args: argparse.Namespace) -> int:
    """Alternate fresh children of the two engines, uncapped; medians and ratios of the timed (second) passes."""
    common = ["--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len), "--threads", str(args.threads),
              "--seed", str(args.seed), "--long-len", str(args.long_len), "--passes", str(args.passes), "--warm"]
    me = [sys.executable, os.path.abspath(__file__)]
    print(json.dumps({"mode": "warm", "threads": args.threads, "prompt_len": args.prompt_len,
                      "gen_len": args.gen_len, "long_len": args.long_len, "rounds": args.rounds,
                      "compute_dtypes": args.compute_dtype}), flush=True)
    engines = {_label(dt): dt for dt in args.compute_dtype}
    results: dict[str, list[dict]] = {**{e: [] for e in engines}, "llama.cpp": []}
    for rnd in range(args.rounds):
        for engine in results:
            sub = ["child-moestream", args.model, "--compute-dtype", engines[engine]] + \
                (["--budget", str(args.budget)] if args.budget else []) \
                if engine in engines else ["child-llama", args.model, "--gguf", str(args.gguf)]
            proc = subprocess.run(me + sub + common, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"error": proc.stderr[-2000:]}
            row["round"] = rnd
            print(json.dumps(row), flush=True)
            results[engine].append(row)
    print(json.dumps(_warm_summary(results)))
    return 0


def _warm_summary(results: dict[str, list[dict]]) -> dict:
    def med(engine: str, key: str):
        vals = sorted(v for r in results[engine] for v in r.get(key + "_passes", []))
        return vals[len(vals) // 2] if vals else None

    out: dict = {"summary": True, "mode": "warm"}
    for key in ("decode_tokens_per_s", "prefill_tokens_per_s", "prefill_long_tokens_per_s"):
        lc = med("llama.cpp", key)
        out[f"llamacpp_{key}"] = lc
        for engine in results:
            if engine == "llama.cpp":
                continue
            ms, tag = med(engine, key), "" if engine == "moestream" else engine[len("moestream"):].replace("-", "_")
            out[f"moestream{tag}_{key}"] = ms
            out[f"ratio{tag}_{key}"] = ms / lc if ms and lc else None
    firsts = {tuple(r["tokens"][:1]) for rows in results.values() for r in rows if "tokens" in r}
    out["first_ids_agree"] = len(firsts) == 1
    out["first_ids"] = sorted(firsts)
    return out
# ---- batched decoding (--batch B) --------------------------------------------------------------------------
def _batch_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(args.seed)
    return [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]


def _batch_result(engine: str, args, prefill_s: float, decode_s: float, decode_tokens: int, nbytes: int,
                  first: list[list[int]], extra: dict) -> dict:
    import resource

    return {"engine": engine, "batch": args.batch, "prefill_tokens_per_s": args.batch * args.prompt_len / prefill_s,
            "decode_tokens_per_s": decode_tokens / decode_s, "prefill_s": prefill_s, "decode_s": decode_s,
            "decode_tokens": decode_tokens, "bytes_read_per_decode_token": nbytes / max(1, decode_tokens),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "tokens": first[:2], **extra}


def child_llama_batch(args: argparse.Namespace) -> dict:
    """llama.cpp's own batched decoding: every prompt in one llama_decode, then B tokens per llama_decode."""
    import ctypes

    import llama_cpp as L
    import numpy as np

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_mmap = True
    model = L.llama_model_load_from_file(str(args.gguf).encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx = args.batch * (args.prompt_len + args.gen_len + 8)
    cp.n_batch = cp.n_ubatch = max(512, args.batch)
    cp.n_seq_max = args.batch
    cp.kv_unified = True
    cp.n_threads = cp.n_threads_batch = args.threads
    ctx = L.llama_init_from_model(model, cp)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    prompts = _batch_prompts(args, n_vocab)
    batch = L.llama_batch_init(max(cp.n_batch, args.batch * args.prompt_len), 0, 1)

    def decode(rows: list[tuple[int, int, int, bool]]) -> list[int]:
        """rows: (token, pos, seq, wants logits) -> argmax per row that wants logits."""
        out = []
        for lo in range(0, len(rows), cp.n_batch):
            part = rows[lo:lo + cp.n_batch]
            batch.n_tokens = len(part)
            for i, (tok, pos, seq, want) in enumerate(part):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, want
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (_, _, _, want) in enumerate(part):
                if want:
                    ptr = L.llama_get_logits_ith(ctx, i)
                    out.append(int(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                                         shape=(n_vocab,)).argmax()))
        return out

    t0 = time.perf_counter()
    toks = decode([(t, p, s, p == args.prompt_len - 1) for s, pr in enumerate(prompts) for p, t in enumerate(pr)])
    prefill_s, io0, t1 = time.perf_counter() - t0, _read_io(), time.perf_counter()
    outs = [[t] for t in toks]
    for step in range(args.gen_len - 1):
        toks = decode([(t, args.prompt_len + step, s, True) for s, t in enumerate(toks)])
        for o, t in zip(outs, toks):
            o.append(t)
    decode_s = time.perf_counter() - t1
    return _batch_result("llama.cpp", args, prefill_s, decode_s, args.batch * (args.gen_len - 1), _read_io() - io0,
                         outs, {})


def child_moestream_batch(args: argparse.Namespace) -> dict:
    """moestream's batch path: the server Scheduler over B greedy requests, prompts in one multi-prompt step."""
    from batch_throughput import StepMeter, run_scheduler

    from moestream import Engine
    from moestream.server.protocol import GenRequest
    from moestream.tokenizer import Tokenizer

    eng = Engine.open(args.model, ram_budget=args.budget, threads=args.threads, kv_dtype=args.kv_dtype,
                      compute_dtype=args.compute_dtype[0])
    prompts = _batch_prompts(args, eng.vocab_size)
    reqs = [GenRequest(p, args.gen_len, 0.0) for p in prompts]
    meter = StepMeter(eng)
    io0 = _read_io()
    results, rep = run_scheduler(eng, Tokenizer.load(args.model), reqs, args.batch, args.batch * args.prompt_len)
    prefill = [s for s in meter.steps if s.decode_rows < s.logit_rows or s.tokens > s.logit_rows]
    decode = [s for s in meter.steps if s not in prefill]
    dec_bytes = sum(s.bytes_read for s in decode)
    return _batch_result(_label(args.compute_dtype[0]), args, sum(s.seconds for s in prefill),
                         sum(s.seconds for s in decode), sum(s.decode_rows for s in decode), dec_bytes,
                         [[r.get("text", "")] for r in results],
                         {"batch_plan": rep["batch_plan"], "failed": rep["failed"], "steps": len(meter.steps),
                          "kv_dtype": args.kv_dtype, "compute_dtype": args.compute_dtype[0],
                          "expert_hit_rate": eng.stats["expert_hit_rate"], "all_bytes_read": _read_io() - io0})


# ---- the memory cap (moestream/cgroup.py) ---------------------------------------------------------------------
def run_capped(cmd: list[str], cap: int | None, name: str) -> tuple[dict, dict]:
    """Run `cmd` in a fresh memory cgroup limited to `cap` bytes (moestream.cgroup); uncapped, and saying so, where
    no memory controller is writable. Returns (its JSON line, cgroup figures)."""
    from moestream.cgroup import find_controller
    from moestream.cgroup import run_capped as capped_run

    if cap is None or find_controller()[0] is None:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        rc, out, err, info = proc.returncode, proc.stdout, proc.stderr, {"capped": False, "cap_bytes": cap}
    else:
        run = capped_run(cmd, cap, name, trace_peak=False)
        rc, out, err = run.returncode, run.stdout, run.stderr
        info = {"capped": True, "cap_bytes": cap, "cgroup_peak_bytes": run.peak_bytes,
                "cgroup_failcnt": run.failcnt, "oom_kills": run.oom_kills}
    info["returncode"] = rc
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if rc != 0 or not lines:
        return {"error": err[-2000:]}, info
    return json.loads(lines[-1]), info


def run(args: argparse.Namespace) -> int:
    from moestream.bench import drop_page_cache
    from moestream.config import parse_bytes
    from moestream.engine.engine import plan

    cap = parse_bytes(args.cap)
    p = plan(args.model)
    budget = args.budget or (cap - parse_bytes(args.overhead))
    print(json.dumps({"experts_bytes": p.expert_bytes, "cap_bytes": cap, "moestream_ram_budget": budget,
                      "oversubscription": p.expert_bytes / cap, "mode": args.mode, "threads": args.threads}))
    files = sorted(Path(args.model).glob("*.safetensors")) + [Path(args.gguf)]
    common = ["--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len), "--threads", str(args.threads),
              "--mode", args.mode, "--seed", str(args.seed)]
    me = [sys.executable, os.path.abspath(__file__)]
    if len(args.compute_dtype) != 1:
        raise SystemExit("--compute-dtype takes several values only with --warm")
    results: dict[str, list[dict]] = {"moestream": [], "llama.cpp": []}
    kind = "-batch" if args.batch else ""
    common += ["--batch", str(args.batch), "--kv-dtype", args.kv_dtype, "--compute-dtype", args.compute_dtype[0]]
    for rnd in range(args.rounds):
        for engine in ("moestream", "llama.cpp"):
            drop_page_cache(files)
            sub = [f"child-moestream{kind}", args.model, "--budget", str(budget)] if engine == "moestream" else \
                [f"child-llama{kind}", args.model, "--gguf", str(args.gguf)]
            r, info = run_capped(me + sub + common, cap, engine.replace(".", ""))
            row = {**r, **info, "round": rnd}
            if engine == "moestream":
                row["compute_dtype"] = args.compute_dtype[0]
            print(json.dumps(row), flush=True)
            results[engine].append(row)
    print(json.dumps(_batch_summary(results, cap) if args.batch else _summary(results, cap)))
    return 0


def _batch_summary(results: dict[str, list[dict]], cap: int) -> dict:
    def best(engine: str, key: str):
        return max((r[key] for r in results[engine] if key in r), default=None)

    out = {"summary": True, "cap_bytes": cap, "batch": next((r.get("batch") for r in results["moestream"]), None)}
    for key in ("decode_tokens_per_s", "prefill_tokens_per_s"):
        ms, lc = best("moestream", key), best("llama.cpp", key)
        out.update({f"moestream_{key}": ms, f"llamacpp_{key}": lc, f"{key}_ratio": ms / lc if ms and lc else None})
    return out


def _summary(results: dict[str, list[dict]], cap: int) -> dict:
    def med(engine: str, key: str):
        vals = sorted(r[key] for r in results[engine] if key in r)
        return vals[len(vals) // 2] if vals else None

    ms, lc = med("moestream", "decode_tokens_per_s"), med("llama.cpp", "decode_tokens_per_s")
    return {"summary": True, "moestream_decode_tokens_per_s": ms, "llamacpp_decode_tokens_per_s": lc,
            "ratio": ms / lc if ms and lc else None,
            "moestream_bytes_read_per_token": med("moestream", "bytes_read_per_token"),
            "llamacpp_bytes_read_per_token": med("llama.cpp", "bytes_read_per_token"),
            "moestream_cgroup_peak_bytes": max((r.get("cgroup_peak_bytes", 0) for r in results["moestream"]),
                                               default=None),
            "llamacpp_cgroup_peak_bytes": max((r.get("cgroup_peak_bytes", 0) for r in results["llama.cpp"]),
                                              default=None), "cap_bytes": cap}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert")
    c.add_argument("model", type=Path)
    c.add_argument("out", type=Path)
    for name in ("run", "child-moestream", "child-llama", "child-moestream-batch", "child-llama-batch"):
        r = sub.add_parser(name)
        r.add_argument("model", type=Path)
        r.add_argument("gguf", type=Path, nargs="?" if name != "run" else None)
        r.add_argument("--gguf", dest="gguf_opt", type=Path, default=None)
        r.add_argument("--cap", default="1.5GiB")
        r.add_argument("--overhead", default="330MiB", help="cap minus this is moestream's --ram-budget")
        r.add_argument("--budget", type=int, default=None)
        r.add_argument("--prompt-len", type=int, default=16)
        r.add_argument("--gen-len", type=int, default=16)
        r.add_argument("--threads", type=int, default=1)
        r.add_argument("--mode", choices=("forced", "greedy"), default="forced")
        r.add_argument("--seed", type=int, default=0)
        r.add_argument("--rounds", type=int, default=2)
        r.add_argument("--warm", action="store_true", help="in-RAM comparison: no cap, warm, prefill and decode")
        r.add_argument("--long-len", type=int, default=512, help="--warm: the long prefill's prompt length")
        r.add_argument("--passes", type=int, default=1, help="--warm: timed passes per child after the warm one")
        r.add_argument("--batch", type=int, default=0, help="sequences decoded together (0: one stream)")
        r.add_argument("--kv-dtype", choices=("fp32", "bf16", "int8"), default="bf16",
                       help="--batch: moestream's KV cache (llama.cpp keeps its KV in f16 by default; fp32 doubles "
                            "the state and leaves less of the cap to experts)")
        r.add_argument("--compute-dtype", nargs="+", choices=("fp32", "bf16"), default=["fp32"],
                       help="moestream's precision of many-row products (EngineOptions.compute_dtype); with --warm "
                            "several values run side by side, each as its own moestream child per round")
    args = ap.parse_args(argv)
    if args.cmd == "convert":
        convert(args.model, args.out)
        return 0
    args.gguf = args.gguf_opt or args.gguf
    if args.cmd == "run":
        return run_warm(args) if args.warm else run(args)
    children = {"child-moestream": warm_moestream if args.warm else child_moestream,
                "child-llama": warm_llama if args.warm else child_llama,
                "child-moestream-batch": child_moestream_batch, "child-llama-batch": child_llama_batch}
    print(json.dumps(children[args.cmd](args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
