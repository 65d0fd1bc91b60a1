"""Issue #15 benchmark: decode a checkpoint streamed over HTTP against the link it comes through.

A hub-style server (tests/hfserver.py) runs in its own process behind an emulated link of --bandwidth payload
bytes/s (one link shared by all connections) with --latency seconds added before every response's first byte.
`--shaping kernel` (the default; root, `ip` and `tc` needed) runs the server in a network namespace of its own
behind a veth pair whose egress a tbf qdisc holds to the rate (bench/netshape.py): the server sends with sendfile
and no pacing loop, so the emulated remote host costs this machine's CPU only its socket writes, and loopback is
not touched. `--shaping userspace` runs it on loopback with the server's own token bucket (a pacing loop: ~0.4 of
a core at 200 MB/s on the 2-core VM, competing with the decode). Before the decodes a raw probe (HttpClient, 8
threads of 3 MiB ranges) measures the link's payload rate and the client's CPU per MB. Three decodes of the same
prompt and seed under the same RAM budget, side by side in one run:
  cold   hf://... with an empty SSD tier: decode tokens/s against the link bound (network bytes fetched per
         decoded token / bandwidth), requests in flight (most, and the mean over the decode), the link's busy share,
         the share of the bytes fetched ahead that no read of the run used, and the link-bound fraction without them;
  warm   the same again from the SSD tier the cold run filled (its pages dropped from the page cache first):
         network requests (must be 0), tokens/s and io_roofline_fraction;
  local  the checkpoint directory itself: tokens/s and io_roofline_fraction (the warm run should match it);
  local_remote_io  the same with the remote run's reads in flight and lookahead reads (the SSD tier's own cost).
Every run reports the client process's CPU (user + sys seconds) per decoded token and per network MB, and the
server process's. io_roofline_fraction is `moestream bench`'s: (bytes read per token / the disk's O_DIRECT
bandwidth) / seconds per token, one disk probe for both runs. Run under `flock /work/bench.lock`. Prints one JSON
object (and a short summary on stderr); exits 1 if the warm run touched the network.

    python bench/http_stream.py DIR [--shaping kernel|userspace] [--bandwidth 200e6] [--latency 0.02]
        [--ram-budget 300MiB] [--gen 16] [--fill-depth N] [--fill-width W] [--wrap-width W] [--fill-inflight BYTES]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SERVER_PID: int | None = None  # the server process (its CPU is reported per run)


def cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (all its threads), or of process `pid` (0.0 once it is gone)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def thread_cpu() -> dict[int, tuple[str, float, float]]:
    """native thread id -> (its group: the thread's name without a trailing -N / _N, user s, sys s, s waiting on a
    run queue) of this process's live Python threads."""
    import re
    import threading

    tck, out = os.sysconf("SC_CLK_TCK"), {}
    for t in threading.enumerate():
        try:
            f = Path(f"/proc/self/task/{t.native_id}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, TypeError):
            continue
        try:  # run time, time waiting on a run queue (ns)
            rq = int(Path(f"/proc/self/task/{t.native_id}/schedstat").read_text().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            rq = 0.0
        out[t.native_id] = (re.sub(r"[-_]\d+(_\d+)?$", "", t.name), int(f[11]) / tck, int(f[12]) / tck, rq)
    return out


def cpu_by_thread(before: dict, after: dict, steps: int) -> dict[str, dict[str, float]]:
    """CPU seconds per decoded token by thread group (user, sys) and seconds spent runnable but waiting for a CPU
    (runq), over the threads alive at the second sample (threads that started or ended in between count from
    their start / to their last sample: approximate)."""
    out: dict[str, list[float]] = {}
    for tid, (name, u, s, q) in after.items():
        _, u0, s0, q0 = before.get(tid, (name, 0.0, 0.0, 0.0))
        g = out.setdefault(name, [0.0, 0.0, 0.0])
        g[0] += u - u0
        g[1] += s - s0
        g[2] += q - q0
    return {k: {"user": round(u / steps, 3), "sys": round(s / steps, 3), "runq": round(q / steps, 3)}
            for k, (u, s, q) in sorted(out.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))}


def decode(path: Path, a: argparse.Namespace, prompt: list[int], io: dict | None = None,
           lookahead_reads: int | None = None) -> dict:
    """One decode from a fresh engine: prefill, then `a.gen` tokens; counters over the decode only. `io` and
    `lookahead_reads` override the engine's I/O settings (the local run with the remote run's)."""
    io = io or {}
    from moestream.engine.engine import Engine

    eng = Engine.open(path, ram_budget=a.ram_budget, threads=a.threads, **io)
    if lookahead_reads is not None:
        eng.runner.lookahead.reads = lookahead_reads
    la = eng.runner.lookahead
    if a.fill_depth is not None:  # the remote fetch-ahead into the SSD tier: 0 turns it off
        la.fill, la.fill_depth = (la.fill if a.fill_depth else None), max(1, a.fill_depth)
    if a.fill_width is not None:
        la.fill_width = a.fill_width
    if a.wrap_width is not None:
        la.wrap_width = a.wrap_width
    net = getattr(eng.plan.store.index, "stats", lambda: {})
    # seconds each MoE layer's step spent on experts that were not resident (their reads landing, then computing),
    # decode steps only: where the misses nothing fetched ahead sit
    drain_s: dict[int, float] = {}
    drain, decoding = eng.runner._drain, [False]

    def timed_drain(layer, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return drain(layer, *args, **kwargs)
        finally:
            if decoding[0]:
                drain_s[layer] = drain_s.get(layer, 0.0) + time.perf_counter() - t0
    eng.runner._drain = timed_drain
    read = lambda: eng.plan.store.bytes_read  # noqa: E731 - expert bytes through the reader (disk or SSD tier)
    try:
        first, n, at_first, read_first = None, 0, {}, 0
        for _ in eng.stream(prompt, a.gen, temperature=1.0, seed=0, stop_token_ids=[]):
            n += 1
            if first is None:
                first, at_first, read_first = time.perf_counter(), net(), read()
                cpu_first, srv_first, thr_first = cpu_s(), cpu_s(SERVER_PID), thread_cpu()
                decoding[0] = True
        end, last, read_last = time.perf_counter(), net(), read()
        cpu_last, srv_last, thr_last = cpu_s(), cpu_s(SERVER_PID), thread_cpu()
        t = eng.runner.times
        prefetch = {"reads": t.prefetch_reads, "used": t.prefetch_used, "withdrawn": t.prefetch_withdrawn,
                    "next_token_guess_recall": getattr(la, "wrap_report", dict)(),
                    "next_layer_recall": {k: v["lifetime_recall"] for k, v in la.report().items()}}
        phases = {"io_wait_s": t.io_wait_s, "expert_s": t.expert_s, "lookahead_s": t.lookahead_s}
        whole = net()
        fills = {k: v for k, v in whole.items() if k.startswith(("fill_", "fetch_", "pool_"))}
    finally:
        eng.close()
    steps, secs = max(1, n - 1), end - first  # forward passes after the first token
    out = {"tokens": n, "decode_tok_s": steps / secs, "read_bytes_per_token": (read_last - read_first) / steps,
           "client_cpu_s_per_token": (cpu_last - cpu_first) / steps, "client_cpu_share": (cpu_last - cpu_first) / secs,
           "client_cpu_by_thread_s_per_token": cpu_by_thread(thr_first, thr_last, steps),
           "prefetch": prefetch, "phases_s_whole_run": phases, "fetch_ahead_whole_run": fills}
    if last:
        d = {k: last[k] - at_first[k] for k in ("http_bytes", "http_requests", "http_inflight_s", "http_busy_s")}
        if SERVER_PID is not None:
            out.update(server_cpu_s_per_token=(srv_last - srv_first) / steps)
        out.update(client_cpu_ms_per_net_mb=(cpu_last - cpu_first) * 1e3 / max(1e-9, d["http_bytes"] / 1e6),
                   net_bytes_per_token=d["http_bytes"] / steps, requests_per_token=d["http_requests"] / steps,
                   net_requests=d["http_requests"], max_inflight=last["http_max_inflight"],
                   mean_inflight=d["http_inflight_s"] / secs, link_busy_share=d["http_busy_s"] / secs,
                   retries=last["http_retries"], disk_hit_bytes=last.get("disk_hit_bytes", 0),
                   corrupt_ranges=last.get("disk_corrupt_ranges", 0),
                   inflight_share=_hist_share(at_first.get("http_inflight_hist", {}), last.get("http_inflight_hist", {})))
        # guesses fetched ahead that no read of the run used (counted against the decode): the honest bytes
        unused = whole.get("fill_bytes", 0) - whole.get("fill_used_bytes", 0)
        out.update(fetch_by_read_per_token=(last["fetch_by_read"] - at_first["fetch_by_read"]) / steps,
                   miss_drain_s_per_token_by_layer={k: round(v / steps, 4) for k, v in sorted(drain_s.items())})
        kinds = {}  # range requests by kind over the decode: a read waits on it, a fill is a guess
        for k, n in last.get("http_kind_n", {}).items():
            dn = n - at_first.get("http_kind_n", {}).get(k, 0)
            if dn:
                kinds[k] = {"per_token": round(dn / steps, 1),
                            "mean_ms_to_headers": round(1e3 * (last["http_kind_head_s"][k]
                                                               - at_first["http_kind_head_s"].get(k, 0.0)) / dn, 1),
                            "mean_ms": round(1e3 * (last["http_kind_s"][k] - at_first["http_kind_s"].get(k, 0.0)) / dn,
                                             1)}
        out.update(requests_by_kind=kinds)
        out.update(fill_unused_share=unused / max(1, whole["http_bytes"]),
                   useful_net_bytes_per_token=max(0, d["http_bytes"] - unused) / steps)
    return out


def probe_link(url: str, ckpt: Path, mb: float, threads: int = 8, piece: int = 3 << 20) -> dict:
    """The raw link: `threads` threads fetching `piece`-byte ranges of the largest shard back to back through
    HttpClient (no parallel parts) until `mb` MB have arrived. Payload bytes/s, and this process's CPU per MB."""
    import threading

    from moestream.weights import http

    shard = max(ckpt.glob("*.safetensors"), key=lambda f: f.stat().st_size)
    target, size = f"{url}/cdn/bench/model/{shard.name}", shard.stat().st_size
    client = http.HttpClient(connections=threads)
    n = max(threads, int(mb * 1e6 // piece))
    lock, next_i = threading.Lock(), [0]

    def work() -> None:
        buf = memoryview(bytearray(piece))
        while True:
            with lock:
                i, next_i[0] = next_i[0], next_i[0] + 1
            if i >= n:
                return
            client._get_range(target, (i * piece * 7) % (size - piece), buf, size, None)

    try:
        client._get_range(target, 0, memoryview(bytearray(4096)), size, None)  # connect and resolve once
        t0, c0 = time.perf_counter(), cpu_s()
        ts = [threading.Thread(target=work) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        secs, cpu = time.perf_counter() - t0, cpu_s() - c0
    finally:
        client.close()
    return {"bytes_per_s": n * piece / secs, "threads": threads, "piece_bytes": piece, "bytes": n * piece,
            "client_cpu_ms_per_mb": cpu * 1e3 / (n * piece / 1e6)}


def _hist_share(before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """Share of the decode's wall time spent with 0, 1-3, 4-7, 8-15 and 16+ requests in flight."""
    bins = {"0": (0, 0), "1-3": (1, 3), "4-7": (4, 7), "8-15": (8, 15), "16+": (16, 1 << 30)}
    secs = {n: after.get(n, 0.0) - before.get(n, 0.0) for n in after}
    total = sum(secs.values()) or 1.0
    return {b: round(sum(s for n, s in secs.items() if lo <= n <= hi) / total, 3) for b, (lo, hi) in bins.items()}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def drop_cache_pages(root: Path) -> None:
    """Write back and drop the SSD tier's range files from the page cache: the warm run reads the disk."""
    from moestream.weights.index import drop_pages

    os.sync()
    for f in root.rglob("*.rng"):
        fd = os.open(f, os.O_RDONLY)
        try:
            drop_pages(fd, 0, 0)
        finally:
            os.close(fd)


def main() -> int:
    global SERVER_PID
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path, help="a local checkpoint directory (served over HTTP)")
    ap.add_argument("--bandwidth", type=float, default=200e6, help="link payload bytes/s (default 200e6)")
    ap.add_argument("--latency", type=float, default=0.02,
                    help="seconds added before each response's first byte (default 0.02)")
    ap.add_argument("--shaping", choices=("kernel", "userspace"), default="kernel",
                    help="kernel (default): the server in a network namespace behind a veth pair and a tbf qdisc "
                         "(bench/netshape.py; root, ip and tc needed); userspace: on loopback, paced by the "
                         "server's own token bucket")
    ap.add_argument("--probe-mb", type=float, default=256,
                    help="MB the raw link probe fetches before the decodes (0: no probe)")
    ap.add_argument("--probe-threads", type=int, default=8, help="requests in flight in the raw link probe")
    ap.add_argument("--ram-budget", default="300MiB",
                    help="bytes (300MiB), or eX: the dense weights plus X times all the experts (e1: every expert "
                         "fits, nothing is evicted; bench/plan_accuracy.py's spec)")
    ap.add_argument("--gen", type=int, default=16, help="tokens decoded per run")
    ap.add_argument("--prompt-len", type=int, default=2)
    ap.add_argument("--io-threads", type=int, default=None, help="range requests in flight (default: remote.py's)")
    ap.add_argument("--lookahead-reads", type=int, default=None,
                    help="predicted experts read ahead into RAM per layer step (default: remote.py's, 1 with an SSD "
                         "tier)")
    ap.add_argument("--fill-depth", type=int, default=None,
                    help="MoE layers ahead whose predicted experts are fetched into the SSD tier (0: none; default: "
                         "experts/prefetch.py's)")
    ap.add_argument("--fill-width", type=int, default=None,
                    help="the fetch-ahead's predictions, times top-k wide (default: experts/prefetch.py's)")
    ap.add_argument("--wrap-width", type=int, default=None,
                    help="the next token's first MoE layer, guessed from this token's last layers and fetched ahead, "
                         "times top-k wide (0: no guess; default: experts/prefetch.py's)")
    ap.add_argument("--fill-inflight", default=None,
                    help="bytes on the link under which the fetch-ahead starts a request (default: fetchahead.py's)")
    ap.add_argument("--split-max", type=int, default=None,
                    help="parallel requests one large range may go as (default: weights/http.py's SPLIT_MAX)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the decode process (seconds; default: Python's 0.005)")
    ap.add_argument("--threads", type=int, default=1, help="compute threads (default 1: on a shared machine more "
                    "threads wait on each other's barriers, docs/performance.md)")
    ap.add_argument("--tmp", type=Path, default=None, help="where the SSD tier goes (default: the system's temp dir)")
    ap.add_argument("--runs", default="cold,warm,local,local_remote_io",
                    help="which decodes, in order (default cold,warm,local,local_remote_io: the local checkpoint "
                         "with the remote run's requests in flight and lookahead reads); a name given again is "
                         "run again (as NAME.2, ...; a repeated cold run starts from the tier the others filled) "
                         "and medians are reported")
    a = ap.parse_args()
    if a.ram_budget.startswith("e"):  # the dense weights plus a share of all experts (2%: read alignment)
        from moestream.info import model_info

        i = model_info(a.dir)
        a.ram_budget = str(int(i.all_resident_budget + float(a.ram_budget[1:]) * i.expert_bytes * 1.02))

    from moestream.bench import model_files, probe_disk
    from moestream.weights import http, remote

    if a.io_threads is not None:
        remote.SETTINGS.io_threads = a.io_threads
    if a.fill_inflight is not None:
        from moestream.config import parse_bytes
        from moestream.weights import fetchahead

        fetchahead.FILL_INFLIGHT = parse_bytes(a.fill_inflight)
    if a.split_max is not None:
        http.SPLIT_MAX = a.split_max
    if a.lookahead_reads is not None:
        remote.SETTINGS.lookahead_reads = a.lookahead_reads
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    link, server = None, None
    argv = [sys.executable, str(ROOT / "tests" / "hfserver.py"), str(a.dir), "--repo", "bench/model", "--latency",
            str(a.latency)]
    # SIGTERM unwinds like Ctrl-C: the finally below stops the server and removes the namespace
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    runs: dict[str, dict] = {}
    report: dict = {}
    try:
        if a.shaping == "kernel":
            import netshape

            if why := netshape.available():
                raise SystemExit(f"--shaping kernel: {why}; run as root with iproute2, or pass --shaping userspace")
            link = netshape.ShapedLink(a.bandwidth).open()
            report["qdisc"] = link.qdisc()
            argv = link.exec_argv(argv + ["--host", link.peer_ip])
        else:
            argv += ["--bandwidth", str(a.bandwidth)]
        server = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        SERVER_PID = server.pid
        url = server.stdout.readline().strip()
        if not url:
            raise SystemExit(f"the server did not start (exit status {server.wait()})")
        os.environ["HF_ENDPOINT"] = url
        if a.probe_mb:
            report["link_probe"] = probe_link(url, a.dir, a.probe_mb, a.probe_threads)
        with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:
            remote.SETTINGS.disk_cache = Path(tmp)
            prompt = [(i * 7919) % 500 + 5 for i in range(a.prompt_len)]
            stub = remote.resolve("hf://bench/model")
            # what the remote runs read ahead into RAM per step (they have an SSD tier)
            la_reads = remote.SETTINGS.lookahead_reads or remote.TIER_LOOKAHEAD_READS
            for name in a.runs.split(","):
                key = name if name not in runs else f"{name}.{sum(k.split('.')[0] == name for k in runs) + 1}"
                if name == "warm":
                    drop_cache_pages(Path(tmp))
                if name == "local_remote_io":  # the local checkpoint read with the remote run's I/O settings
                    runs[key] = decode(a.dir, a, prompt, {"io_threads": remote.SETTINGS.io_threads}, la_reads)
                else:
                    runs[key] = decode(a.dir if name == "local" else stub, a, prompt)
            disk_bw = probe_disk(model_files(a.dir), 4)
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        if link is not None:
            link.close()
            if left := netshape.leftovers():
                print(f"kernel shaping left behind: {left}", file=sys.stderr)
    report = {**report, "shaping": a.shaping, "bandwidth_bytes_per_s": a.bandwidth, "latency_s": a.latency,
              "ram_budget": a.ram_budget,
              "io_threads": remote.SETTINGS.io_threads, "lookahead_reads": la_reads,
              "compute_threads": a.threads,
              "switch_interval_s": sys.getswitchinterval(), "split_max": http.SPLIT_MAX,
              "disk_bandwidth_bytes_per_s": disk_bw,
              "load_average": os.getloadavg(), "runs": runs}
    for r in runs.values():
        r["io_roofline_fraction"] = r["read_bytes_per_token"] / disk_bw * r["decode_tok_s"] if disk_bw else None
        if "net_bytes_per_token" in r and r["net_bytes_per_token"]:
            r["link_bound_fraction"] = r["net_bytes_per_token"] / a.bandwidth * r["decode_tok_s"]
            r["useful_link_bound_fraction"] = r["useful_net_bytes_per_token"] / a.bandwidth * r["decode_tok_s"]
            if "link_probe" in report:  # against what the link measured, not its nominal rate
                r["probed_link_bound_fraction"] = (r["net_bytes_per_token"] / report["link_probe"]["bytes_per_s"]
                                                   * r["decode_tok_s"])
    lines = []
    if "link_probe" in report:
        p = report["link_probe"]
        lines.append(f"link ({a.shaping} shaping): raw probe {p['bytes_per_s'] / 1e6:.1f} MB/s of "
                     f"{a.bandwidth / 1e6:.0f} "
                     f"with {p['threads']} requests of {p['piece_bytes'] >> 20} MiB in flight, client CPU "
                     f"{p['client_cpu_ms_per_mb']:.2f} ms / MB")
    if len(runs) > len(set(k.split(".")[0] for k in runs)):  # repeated runs: medians (a loaded machine is noisy)
        report["median_tok_s"] = {n: _median([r["decode_tok_s"] for k, r in runs.items() if k.split(".")[0] == n])
                                  for n in dict.fromkeys(k.split(".")[0] for k in runs)}
        report["median_cold_link_bound_fraction"] = _median([r["link_bound_fraction"] for k, r in runs.items()
                                                             if k.split(".")[0] == "cold"] or [0.0])
        lines.append(f"medians over repeats: {json.dumps({k: round(v, 3) for k, v in report['median_tok_s'].items()})}"
                     f" tok/s; cold fraction of the link bound {report['median_cold_link_bound_fraction']:.2f}")
    if "cold" in runs:
        cold = runs["cold"]
        link_s = cold["net_bytes_per_token"] / a.bandwidth
        report.update(link_bound_tok_s=1 / link_s if link_s else None, link_bound_fraction=link_s * cold["decode_tok_s"])
        lines.append(f"cold: {cold['decode_tok_s']:.2f} tok/s, {cold['net_bytes_per_token'] / 2**20:.1f} MiB fetched "
                     f"per token, link bound {report['link_bound_tok_s']:.2f} tok/s -> {report['link_bound_fraction']:.2f} "
                     f"of it ({cold.get('probed_link_bound_fraction', 0):.2f} of the probed link); requests in flight: mean {cold['mean_inflight']:.1f}, most {cold['max_inflight']}; link "
                     f"busy {cold['link_busy_share']:.2f} of the decode; fetched ahead and never used "
                     f"{cold['fill_unused_share']:.2f} of the bytes (without them: "
                     f"{cold['useful_link_bound_fraction']:.2f} of the link bound); CPU per token: client "
                     f"{cold['client_cpu_s_per_token']:.2f} s, server {cold.get('server_cpu_s_per_token', 0):.2f} s")
    if "warm" in runs and "local_remote_io" in runs:
        report["warm_vs_local_remote_io_tok_s"] = runs["warm"]["decode_tok_s"] / runs["local_remote_io"]["decode_tok_s"]
        lines.append(f"local with the remote I/O settings: {runs['local_remote_io']['decode_tok_s']:.2f} tok/s, io_roofline "
                     f"{runs['local_remote_io']['io_roofline_fraction']:.3f} (warm/it "
                     f"{report['warm_vs_local_remote_io_tok_s']:.2f})")
    if "warm" in runs and "local" in runs:
        w, loc = runs["warm"], runs["local"]
        med = report.get("median_tok_s", {})  # with repeats: the ratio of the medians
        report["warm_vs_local_tok_s"] = med.get("warm", w["decode_tok_s"]) / med.get("local", loc["decode_tok_s"])
        lines.append(f"warm: {w['decode_tok_s']:.2f} tok/s, {w['net_requests']} network requests, io_roofline "
                     f"{w['io_roofline_fraction']:.3f}; local: {loc['decode_tok_s']:.2f} tok/s, io_roofline "
                     f"{loc['io_roofline_fraction']:.3f} (warm/local {report['warm_vs_local_tok_s']:.2f}); disk "
                     f"{disk_bw / 1e6:.0f} MB/s; load average {report['load_average'][0]:.1f}")
    lines.append("client CPU s / token: "
                 + ", ".join(f"{k} {r['client_cpu_s_per_token']:.2f}" for k, r in runs.items()))
    print(json.dumps(report, indent=1))
    print("\n".join(lines), file=sys.stderr)
    return 1 if runs.get("warm", {}).get("net_requests") else 0


if __name__ == "__main__":
    raise SystemExit(main())
