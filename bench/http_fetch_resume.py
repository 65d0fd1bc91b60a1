"""Issue #15 kill-and-resume check: `moestream fetch` SIGKILLed at random points, then resumed to completion.

A hub-style server (tests/hfserver.py, its own process, throttled so a fetch takes several seconds) logs every
range it sends. The fetch is started and SIGKILLed --kills times, each time at a random moment mid-transfer (up to
--max-delay seconds after that run stored its first range), then run to completion. Then:
  corrupt ranges     every range file in the SSD tier re-verified (crc32 per MiB) and compared byte for byte with
                     the checkpoint's shards: must be 0;
  fetched twice      bytes of shard ranges the server sent more than once in full, beyond what was in flight when
                     a kill landed (at most --io-threads requests of 16 MiB per kill): must be 0.
`ranges_cut_by_kills` counts the bodies the kills cut off (each one a request in flight). Prints one JSON object.
Not timed (no flock needed).

    python bench/http_fetch_resume.py DIR [--kills 20] [--bandwidth 100e6]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def fetch_cmd(cache: Path, threads: int) -> list[str]:
    code = ("import sys; from moestream.weights import remote; remote.SETTINGS.io_threads = int(sys.argv[1]); "
            "from moestream.cli import main; sys.exit(main(sys.argv[2:]))")
    return [sys.executable, "-c", code, str(threads), "fetch", "hf://org/model", "--disk-cache", str(cache)]


def check_ranges(cache: Path, ckpt: Path) -> tuple[int, int]:
    """(ranges, corrupt): every range verified by its checksums and compared with the checkpoint's bytes."""
    from moestream.weights.diskcache import DiskCache
    from moestream.weights.remote import open_remote_index, SETTINGS

    SETTINGS.disk_cache, SETTINGS.offline = cache, True
    stub = next((cache / "models").glob("*/*/moestream-remote.json")).parent
    index = open_remote_index(stub)
    files = {f.key: f for f in {i.file for i in index.tensors.values()}}
    dc = DiskCache(cache)
    ranges = corrupt = 0
    for rng in (cache / "ranges").rglob("*.rng"):
        f = files[rng.parent.name]
        off, n = (int(x, 16) for x in rng.stem.split("-"))
        got = memoryview(bytearray(n))
        ranges += 1
        with open(ckpt / f.name, "rb") as fh:
            fh.seek(off)
            want = fh.read(n)
        if not dc.read(f.key, off, got) or bytes(got) != want:
            corrupt += 1
    return ranges, corrupt


def _ranges_on_disk(cache: Path) -> int:
    return sum(1 for _ in (cache / "ranges").rglob("*.rng")) if (cache / "ranges").is_dir() else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path, help="a local checkpoint directory (served over HTTP)")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--bandwidth", type=float, default=100e6)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-delay", type=float, default=1.0,
                    help="a kill lands up to this many seconds after the run stored its first range (default 1)")
    ap.add_argument("--tmp", type=Path, default=None, help="where the SSD tier goes (default: the system's temp dir)")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:
        log = Path(tmp) / "served.jsonl"
        server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "hfserver.py"), str(a.dir), "--repo",
                                  "org/model", "--bandwidth", str(a.bandwidth), "--log", str(log)],
                                  stdout=subprocess.PIPE, text=True)
        env = {**os.environ, "HF_ENDPOINT": server.stdout.readline().strip()}
        cache = Path(tmp) / "cache"
        kills, t0 = 0, time.time()
        try:
            while kills < a.kills:
                before = _ranges_on_disk(cache)
                p = subprocess.Popen(fetch_cmd(cache, a.io_threads), env=env, stderr=subprocess.DEVNULL)
                # the kill lands mid-transfer: once this run has stored a range (its other requests are then
                # under way; start-up takes seconds on a loaded machine), after a random further delay
                while p.poll() is None and _ranges_on_disk(cache) <= before:
                    time.sleep(0.02)
                try:
                    p.wait(timeout=rng.uniform(0.0, a.max_delay))
                    break  # finished before the kill
                except subprocess.TimeoutExpired:
                    p.send_signal(signal.SIGKILL)
                    p.wait()
                    kills += 1
            final = subprocess.run(fetch_cmd(cache, a.io_threads), env=env, stderr=subprocess.PIPE, text=True)
        finally:
            server.terminate()
            server.wait()
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        shard_bytes = sum(f.stat().st_size for f in a.dir.glob("*.safetensors"))
        full: dict[tuple, int] = {}
        for path, start, end, sent in rows:
            if path.endswith(".safetensors") and start >= 8 and end - start > 1 << 20 and sent == end - start:
                full[(path, start, end)] = full.get((path, start, end), 0) + 1
        twice = sum((c - 1) * (k[2] - k[1]) for k, c in full.items() if c > 1)
        cut = [r for r in rows if r[0].endswith(".safetensors") and r[3] < r[2] - r[1]]  # bodies a kill cut off
        allowed = kills * a.io_threads * (16 << 20)
        ranges, corrupt = check_ranges(cache, a.dir)
        report = {"kills": kills, "final_rc": final.returncode, "seconds": round(time.time() - t0, 1),
                  "shard_bytes": shard_bytes, "bytes_served": sum(r[3] for r in rows),
                  "ranges_cut_by_kills": len(cut), "bytes_of_cut_ranges": sum(r[3] for r in cut),
                  "complete_ranges_sent_twice_bytes": twice,
                  # every range sent again (cut or complete) must have been in flight at a kill
                  "ranges_sent_again": len(cut) + sum(c - 1 for c in full.values()),
                  "requests_in_flight_at_kills": kills * a.io_threads, "in_flight_allowance_bytes": allowed,
                  "fetched_twice_beyond_in_flight_bytes": max(0, twice - allowed),
                  "ranges": ranges, "corrupt_ranges": corrupt}
    print(json.dumps(report, indent=1))
    return 0 if final.returncode == 0 and corrupt == 0 and twice <= allowed else 1


if __name__ == "__main__":
    raise SystemExit(main())
