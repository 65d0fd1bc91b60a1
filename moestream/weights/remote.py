"""Remote checkpoints: `hf://ORG/NAME[@REVISION]` and `https://.../DIR/` read like local ones.

Owns the process's remote settings (disk cache, budget, offline, requests in flight), parsing a spec, and the
read side: `RemoteFile` stands in for a shard's path (its reads go to the SSD tier, diskcache.py, and on a miss
to HTTP range requests, http.py, neighbouring pieces in one request, each range fetched once across threads,
fetchahead.py), and `RemoteIndex` is the CheckpointIndex of a stub directory (weights/stub.py builds it: config,
index json, headers and the pinned revision in a `moestream-remote.json` manifest), which also takes the
lookahead's predictions for its fetch-ahead. Nothing in a checkpoint is executed.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from moestream.errors import CheckpointError, MoestreamError
from moestream.weights.buffers import POOL, copy_into, pooled_copy
from moestream.weights.fetchahead import FillQueue, Flights
from moestream.weights.index import REMOTE_MANIFEST, CheckpointIndex, tensors_from_header

if TYPE_CHECKING:
    from moestream.weights.buffers import Lease

MANIFEST_FORMAT, MANIFEST_VERSION = "moestream-remote", 1
INDEX_JSON = "model.safetensors.index.json"
REMOTE_IO_THREADS = 8  # expert range requests in flight (a link with latency needs depth a local disk does not)
# predicted experts of the next layer read ahead into RAM per step (experts/prefetch.py): a local disk reads one,
# but over a link without an SSD tier every unpredicted miss costs a round trip after the router, so all of a
# token's predictions go. With an SSD tier the fetch-ahead (fetchahead.py) brings the predictions of the next two
# layers onto local disk, so the RAM read-ahead is the local disk's one: a warm tier then reads the bytes a local
# checkpoint reads (8 read 1.24x the bytes per token, and cost a warm decode 0.82x the local speed)
REMOTE_LOOKAHEAD_READS, TIER_LOOKAHEAD_READS = 8, 1
WARM_THREADS, WARM_PIECE = 4, 4 << 20  # dense weights fetched ahead while the model opens: requests, bytes each
_HF = re.compile(r"hf://([\w.-]+/[\w.-]+)(?:@([\w./-]+))?/?")


@dataclass
class RemoteSettings:
    """How remote checkpoints are opened in this process (the CLI sets it from --disk-cache / --disk-budget /
    --offline; the environment gives the defaults)."""

    disk_cache: Path | None = None  # keep fetched ranges here; None: only stubs (config, headers) are kept
    disk_budget: int | None = None  # bytes of ranges on disk; None: no limit
    offline: bool = False
    io_threads: int = REMOTE_IO_THREADS
    lookahead_reads: int | None = None  # None: REMOTE_LOOKAHEAD_READS, or TIER_LOOKAHEAD_READS with an SSD tier
    http_timeout_s: float = 30.0  # connect / read timeout of one request (a stalled one is retried)

    @classmethod
    def from_env(cls) -> "RemoteSettings":
        from moestream.config import parse_bytes

        cache = os.environ.get("MOESTREAM_DISK_CACHE")
        return cls(Path(cache).expanduser() if cache else None, parse_bytes(os.environ.get("MOESTREAM_DISK_BUDGET")),
                   _truthy(os.environ.get("MOESTREAM_OFFLINE")) or _truthy(os.environ.get("HF_HUB_OFFLINE")),
                   http_timeout_s=float(os.environ.get("MOESTREAM_HTTP_TIMEOUT") or 30.0))

    def stub_root(self) -> Path:
        if self.disk_cache is not None:
            return self.disk_cache
        from moestream.config import default_cache_dir

        return default_cache_dir() / "http"


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes", "on")


SETTINGS = RemoteSettings.from_env()


def is_remote(spec: str | Path) -> bool:
    return isinstance(spec, str) and spec.startswith(("hf://", "http://", "https://"))


@dataclass(frozen=True)
class Source:
    """A parsed remote spec."""

    spec: str
    kind: str  # "hf" or "url"
    repo: str = ""
    revision: str = "main"
    base: str = ""  # url kind: the directory URL, ending in "/"

    @classmethod
    def parse(cls, spec: str) -> "Source":
        if spec.startswith("hf://"):
            m = _HF.fullmatch(spec)
            if not m:
                raise MoestreamError(f"{spec}: expected hf://ORG/NAME or hf://ORG/NAME@REVISION")
            return cls(spec, "hf", m.group(1), m.group(2) or "main")
        return cls(spec, "url", base=spec if spec.endswith("/") else spec + "/")

    def key(self) -> str:
        """A directory name for this source's stubs."""
        name = self.repo if self.kind == "hf" else self.base.split("://", 1)[1]
        safe = re.sub(r"[^\w.-]+", "--", name).strip("-")[:80]
        return f"{self.kind}--{safe}--{hashlib.sha1(name.encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class RemoteFile:
    """A remote shard standing in for its local path: `read_into` serves bytes from the SSD tier or HTTP."""

    name: str
    url: str
    size: int
    etag: str | None
    ident: str  # what the file is, whatever the endpoint: "hf:ORG/NAME@COMMIT/FILE", or its URL
    client: object = field(compare=False, hash=False, repr=False)  # http.HttpClient, or None offline
    cache: object = field(compare=False, hash=False, repr=False)  # diskcache.DiskCache or None
    flights: Flights | None = field(default=None, compare=False, hash=False, repr=False)  # fetches in flight

    def __str__(self) -> str:
        return self.url

    @property
    def key(self) -> str:
        """The SSD tier's name for this file's bytes: what it is and its version (a mirror shares them)."""
        return hashlib.sha1(f"{self.ident}\0{self.etag}".encode()).hexdigest()[:24]

    def read_into(self, offset: int, views: list[memoryview]) -> None:
        """Fill consecutive `views` from `offset`; bytes past the end of the file (alignment padding) are zeros."""
        pieces, at = [], offset
        for v in views:
            pieces.append((at, v))
            at += len(v)
        self.read_pieces(pieces)

    def read_pieces(self, pieces: list[tuple[int, memoryview]], behind: bool = True) -> None:
        """Fill each (offset, view): from the SSD tier where it holds the bytes, the rest with one range request
        per group of neighbouring pieces (overlaps and holes up to 4 KiB read through), kept in the SSD tier after
        (`behind`: by its writer thread, so the read does not wait for the disk)."""
        missing = []
        for off, view in pieces:
            view = self._clip(off, view)
            if not len(view):
                continue
            if self.cache is not None and self.cache.read(self.key, off, view):
                if self.flights is not None:
                    self.flights.used(self.key, off)
            else:
                missing.append((off, view))
        if self.flights is not None:  # a range another thread is fetching is waited for, not fetched again
            self.flights.fetch(self, missing, lambda rest: self._fetch_missing(rest, behind))
        else:
            self._fetch_missing(missing, behind)

    def _fetch_missing(self, missing: list[tuple[int, memoryview]], behind: bool | str,
                       base: tuple[int, memoryview, Lease] | None = None) -> None:
        """One range request per group of neighbouring pieces (overlaps and holes up to 4 KiB read through).
        `base` (offset, view, its pooled buffer): every piece is the slice of that one buffer at its file offset,
        so a group's request lands in the buffer directly."""
        missing.sort(key=lambda p: p[0])
        group: list[tuple[int, memoryview]] = []
        for off, view in missing:
            if group and off > max(o + len(v) for o, v in group) + 4096:
                self._fetch_group(group, behind, base)
                group = []
            group.append((off, view))
        if group:
            self._fetch_group(group, behind, base)

    def _keep(self, offset: int, view: memoryview, behind: bool | str, lease: Lease | None = None) -> None:
        """Into the SSD tier: `behind` True by the writer thread from a copy in a pooled buffer (the view is the
        caller's buffer, an expert's, recycled once it is evicted), "own" from the view itself (the fetch-ahead's
        own buffer, `lease`, held by the tier until written), False before returning."""
        if self.cache is None:
            return
        if behind == "own":
            self.cache.put_soon(self.key, offset, view, lease)
        elif behind:
            copy = pooled_copy(view)
            try:
                self.cache.put_soon(self.key, offset, copy.view, copy)
            finally:
                copy.release()
        else:
            self.cache.put(self.key, offset, view)

    def _fetch_group(self, group: list[tuple[int, memoryview]], behind: bool | str,
                     base: tuple[int, memoryview, Lease] | None = None) -> None:
        """One request for neighbouring pieces; each piece is kept on disk as its own range, so a later read of
        one expert is one whole range file (read straight into its buffer) rather than part of a larger one.
        With `base` (see `_fetch_missing`) the request lands in the pieces' own buffer; else in a buffer of its
        own, copied into each piece."""
        lease, guess = (base[2] if base is not None else None), behind == "own"
        if len(group) == 1:
            self._download(*group[0], guess)
            self._keep(*group[0], behind, lease)
            return
        lo, hi = group[0][0], max(o + len(v) for o, v in group)
        if base is not None:
            self._download(lo, base[1][lo - base[0]:hi - base[0]], guess)
        else:
            scratch = POOL.take(hi - lo)  # no fresh pages per request
            try:
                buf = scratch.view
                self._download(lo, buf, guess)
                for off, view in group:
                    copy_into(view, buf[off - lo:off - lo + len(view)])
            finally:
                scratch.release()
        for off, view in group:
            self._keep(off, view, behind, lease)

    def _clip(self, offset: int, out: memoryview) -> memoryview:
        """The part of `out` inside the file; the rest (alignment padding past the end) is zeroed."""
        end = min(offset + len(out), self.size)
        if offset + len(out) > end:
            out[max(0, end - offset):] = bytes(len(out) - max(0, end - offset))
            out = out[:max(0, end - offset)]
        return out

    def fetch(self, offset: int, out: memoryview) -> None:
        """Bytes [offset, offset + len(out)): from the SSD tier, else one range request, on disk when this returns
        (`moestream fetch`: what it reports done is done)."""
        self.read_pieces([(offset, out)], behind=False)

    def fill(self, ranges: list[tuple[int, int]]) -> int:
        """Bring these (offset, length) ranges into the SSD tier (the fetch-ahead), except those there or being
        fetched; neighbours go as one request, each kept as its own range. Returns the bytes this call fetched.
        Needs an SSD tier and the network."""
        if self.cache is None or self.client is None or self.flights is None:
            return 0
        want = [(off, n) for off, n in ((off, min(n, self.size - off)) for off, n in ranges)
                if n > 0 and not self.cache.covered(self.key, off, n)]
        if not want:
            return 0
        # one buffer for all of them, each piece its slice at its file offset: a request for neighbours lands in
        # place (no second buffer and copy); the SSD tier's writer keeps the slices, so the buffer lives until the
        # last is on disk. Page-aligned, so the tier writes each page-aligned piece with O_DIRECT (no page-cache
        # copy); pooled (the tier's queue holds it until written), so its pages are not faulted in afresh
        lo = min(off for off, _ in want)
        lease = POOL.take(max(off + n for off, n in want) - lo)
        buf = lease.view
        try:
            pieces = [(off, buf[off - lo:off - lo + n]) for off, n in want]
            return self.flights.fetch(self, pieces, lambda rest: self._fetch_missing(rest, "own", (lo, buf, lease)),
                                      for_read=False)
        finally:
            lease.release()

    def _download(self, offset: int, out: memoryview, guess: bool = False) -> None:
        """One range request (offline: the error naming the missing bytes); `guess`: the fetch-ahead's."""
        if self.client is None:
            raise CheckpointError(f"offline: bytes [{offset}, {offset + len(out)}) of {self.name} ({self.url}) are not "
                                  f"in the disk cache {self.cache.root if self.cache else '(none)'}; run once online "
                                  f"with --disk-cache or `moestream fetch` it first")
        self.client.get_range(self.url, offset, out, self.size, self.etag, guess)


class RemoteIndex(CheckpointIndex):
    """A CheckpointIndex whose files are RemoteFiles; `remote` says where they come from and what they cost."""

    min_io_threads = REMOTE_IO_THREADS

    def __init__(self, root: Path, tensors: dict, manifest: dict, client, cache, flights: Flights | None = None):
        super().__init__(root, tensors)
        self.manifest, self.client, self.cache = manifest, client, cache
        self.flights = flights or Flights()
        # predictions go to the network only with somewhere to keep them and a network to fetch them from
        self._fill = FillQueue(self.flights, cache) if cache is not None and client is not None else None
        self.min_io_threads = SETTINGS.io_threads
        self.lookahead_reads = SETTINGS.lookahead_reads if SETTINGS.lookahead_reads is not None else \
            TIER_LOOKAHEAD_READS if self._fill is not None else REMOTE_LOOKAHEAD_READS
        self.dense_filter: Callable[[str], bool] | None = None  # set by ExpertStore: which tensors are dense
        self._warm: dict[str, list[_WarmPiece]] | None = None
        self._warm_lock = threading.Lock()

    def load(self, name: str):
        """One tensor, as CheckpointIndex.load. The first call starts fetching every dense tensor into the SSD tier
        (see `_start_warm`); a tensor still being fetched is waited for, then read from disk."""
        for piece in self._start_warm().get(name, ()):
            piece.done.wait()
            if piece.error is not None:  # a changed ETag is final; anything else, the load below tries again
                raise piece.error
        return super().load(name)

    def _start_warm(self) -> dict[str, list[_WarmPiece]]:
        """Dense tensors in file order, neighbours merged and large ones cut into WARM_PIECE requests, fetched by
        WARM_THREADS daemon threads into the SSD tier, so building the model costs one round trip per 4 MiB
        rather than one per tensor. Needs an SSD tier and the network; holds at most WARM_THREADS x WARM_PIECE
        bytes outside the RAM budget while the model opens."""
        with self._warm_lock:
            if self._warm is not None:
                return self._warm
            self._warm = {}
            if self.cache is None or self.client is None or self.dense_filter is None:
                return self._warm
            jobs: queue.Queue = queue.Queue()
            for f, lo, n, names in _warm_pieces([self.tensors[t] for t in self.tensors if self.dense_filter(t)]):
                piece = _WarmPiece(f, lo, n)
                jobs.put(piece)
                for t in names:
                    self._warm.setdefault(t, []).append(piece)
            for i in range(WARM_THREADS):
                threading.Thread(target=_warm_worker, args=(jobs,), name=f"moestream-warm-{i}", daemon=True).start()
            return self._warm

    def fill_ahead(self, ranges: list[tuple[RemoteFile, int, int]]) -> None:
        """Fetch these (file, offset, length) ranges into the SSD tier ahead of need, best first, in place of the
        ranges an earlier call queued that have not started (weights/fetchahead.py); a no-op without an SSD tier
        or offline."""
        if self._fill is not None:
            self._fill.replace([r for r in ranges if isinstance(r[0], RemoteFile)])

    def close(self) -> None:
        """Every range fetched so far is on disk when this returns (the SSD tier writes behind reads)."""
        if self._fill is not None:
            self._fill.replace([])
        if self.cache is not None:
            self.cache.flush()

    def stats(self) -> dict[str, int]:
        """Network and SSD-tier counters of this process's reads of the model."""
        f = self.flights.stats
        out = {"http_requests": 0, "http_bytes": 0, "http_retries": 0, "http_max_inflight": 0, "http_inflight_s": 0.0,
               "http_busy_s": 0.0, "fetch_joined": f.joined, "fetch_joined_bytes": f.joined_bytes,
               "fetch_by_read": f.read_fetched, "fetch_by_read_bytes": f.read_fetched_bytes,
               "fill_ranges": f.filled, "fill_bytes": f.filled_bytes, "fill_used_bytes": f.fill_used_bytes,
               "fill_unused_bytes": self.flights.unused_bytes, "fill_dropped_bytes": f.fill_dropped_bytes,
               "pool_taken": POOL.taken, "pool_reused": POOL.reused}  # the process's buffer pool (buffers.py)
        if self.client is not None:
            out.update(self.client.stats.snapshot())
        if self.cache is not None:
            c = self.cache.stats
            out.update(disk_hit_bytes=c.hit_bytes, disk_put_bytes=c.put_bytes, disk_corrupt_ranges=c.corrupt_ranges,
                       disk_evicted_bytes=c.evicted_bytes)
        return out


def _warm_pieces(infos: list) -> list[tuple[RemoteFile, int, int, list[str]]]:
    """(file, offset, length, tensor names) requests covering `infos`: neighbours (holes up to 4 KiB) merged up to
    WARM_PIECE bytes, a larger tensor cut into WARM_PIECE pieces."""
    out: list[list] = []  # [file, lo, hi, names]
    for info in sorted(infos, key=lambda i: (i.file.name, i.offset)):
        at, end = info.offset, info.offset + info.nbytes
        while at < end:
            last = out[-1] if out else None
            if last is not None and last[0] == info.file and at <= last[2] + 4096 and at < last[1] + WARM_PIECE:
                last[2] = max(last[2], min(end, last[1] + WARM_PIECE))  # > at: the request grows
            else:
                last = [info.file, at, min(end, at + WARM_PIECE), []]
                out.append(last)
            if not last[3] or last[3][-1] != info.name:
                last[3].append(info.name)
            at = last[2]
    return [(f, lo, hi - lo, names) for f, lo, hi, names in out]


class _WarmPiece:
    """One fetch-ahead request of dense weights; `done` is set when it ends, `error` holds a changed ETag."""

    __slots__ = ("file", "offset", "nbytes", "done", "error")

    def __init__(self, file: RemoteFile, offset: int, nbytes: int):
        self.file, self.offset, self.nbytes = file, offset, nbytes
        self.done, self.error = threading.Event(), None


def _warm_worker(jobs: queue.Queue) -> None:
    from moestream.weights.http import RemoteChangedError

    while True:
        try:
            p = jobs.get_nowait()
        except queue.Empty:
            return
        try:
            if not p.file.cache.covered(p.file.key, p.offset, p.nbytes):
                p.file.fetch(p.offset, memoryview(bytearray(p.nbytes)))
        except RemoteChangedError as e:
            p.error = e
        except Exception:  # noqa: BLE001 - the tensor's own load fetches it again and reports what is wrong
            pass
        finally:
            p.done.set()


# ---- opening ----------------------------------------------------------------------------------------
def model_path(spec: str | Path, full: bool = True) -> Path:
    """The local directory behind any model argument: a remote spec (hf://, http(s)://) becomes its stub
    (`resolve`; `full` False: headers only, as `info` and `plan` need), anything else is a path. Every entry point
    that takes a model (Engine.open, engine.plan, the CLI's commands) resolves through here."""
    if is_remote(spec):
        return resolve(str(spec), full=full)
    return Path(spec).expanduser()


def resolve(spec: str, settings: RemoteSettings | None = None, full: bool = True) -> Path:
    """The local stub directory of a remote checkpoint (weights/stub.py): config.json, the index json and every
    shard's header, plus the tokenizer and other run-time files unless `full` is False."""
    from moestream.weights.stub import resolve_stub

    return resolve_stub(spec, settings or SETTINGS, full)


def open_remote_index(root: Path, settings: RemoteSettings | None = None) -> RemoteIndex:
    """The index of a stub directory: tensors from the cached headers, files that read over HTTP + SSD tier."""
    s = settings or SETTINGS
    path = root / REMOTE_MANIFEST
    try:
        m = json.loads(path.read_text())
        if m.get("format") != MANIFEST_FORMAT or m.get("version") != MANIFEST_VERSION:
            raise CheckpointError(f"{path}: not a moestream remote manifest of version {MANIFEST_VERSION}")
        shards = m["shards"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: cannot read the remote manifest: {e}") from None
    from moestream.weights.stub import endpoint, http_client

    src = Source.parse(m["source"])
    client = None if s.offline else http_client(src, s.http_timeout_s)
    cache = None
    if s.disk_cache is not None:
        from moestream.weights.diskcache import DiskCache

        cache = DiskCache(s.disk_cache, s.disk_budget)
    tensors, flights = {}, Flights()
    for name, sh in shards.items():
        url, ident = sh["url"], sh["url"]
        if src.kind == "hf":  # the current endpoint (HF_ENDPOINT may name a mirror since the stub was made)
            from huggingface_hub import hf_hub_url

            url = hf_hub_url(src.repo, name, revision=m["revision"], endpoint=endpoint())
            ident = f"hf:{src.repo}@{m['revision']}/{name}"
        f = RemoteFile(name, url, int(sh["size"]), sh.get("etag"), ident, client, cache, flights)
        tensors.update(tensors_from_header(f, sh["header"].encode(), f.size))
    return RemoteIndex(root, tensors, m, client, cache, flights)


def manifest_of(root: Path) -> dict | None:
    """The remote manifest of a stub directory (None for a local checkpoint)."""
    path = Path(root) / REMOTE_MANIFEST
    if not path.exists():
        return None
    return json.loads(path.read_text())
