"""HTTP transport for remote checkpoints: whole-file GETs and validated byte-range GETs with retries.

Owns the urllib3 connection pool (several connections; redirects followed and the final location remembered so
later ranges of a file skip the hub's resolve hop; auth headers sent only to the origin that issued them), the retry policy
(resets, timeouts, 429 with Retry-After, 5xx: exponential backoff with jitter) and the checks that keep a bad
response out of every cache: status 206, the exact Content-Range, the full body length and the pinned ETag.
It knows nothing about safetensors or caching.
"""
from __future__ import annotations

import email.utils
import http.client
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

import urllib3

from moestream.errors import CheckpointError

RETRY_STATUS = {429, 500, 502, 503, 504}
SPLIT_PART = 1 << 20  # a range of at least two of these goes as parallel requests of about this size ...
SPLIT_MAX = 4  # ... at most this many
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class RemoteError(CheckpointError):
    """A remote checkpoint could not be read (after retries), or answered something that cannot be trusted."""


class RemoteChangedError(RemoteError):
    """A file's ETag changed after it was pinned: bytes of two versions must never be mixed."""


@dataclass
class RetryPolicy:
    attempts: int = 8  # tries per request, the first included
    backoff_s: float = 0.1  # first wait; doubled each retry, with +-50% jitter
    max_backoff_s: float = 10.0
    max_retry_after_s: float = 60.0  # a longer Retry-After is waited as this long


@dataclass
class HttpStats:
    requests: int = 0  # HTTP requests sent (range and whole-file), retries included
    bytes_fetched: int = 0  # body bytes received from the network
    retries: int = 0
    inflight: int = 0
    max_inflight: int = 0  # most requests in flight at once
    inflight_s: float = 0.0  # integral of requests in flight over time (/ an interval: the mean in flight)
    busy_s: float = 0.0  # time with at least one request in flight
    inflight_hist: dict[int, float] = field(default_factory=dict)  # requests in flight -> seconds spent at it
    # range requests by kind ("read": a read waits on it, "fill": a guess): count, seconds from sending the request
    # to its response headers (the round trip plus the bytes queued ahead on the link), seconds in all
    kind_n: dict[str, int] = field(default_factory=dict)
    kind_head_s: dict[str, float] = field(default_factory=dict)
    kind_s: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _last: float = field(default_factory=time.perf_counter, repr=False)

    def begin(self) -> None:
        with self.lock:
            self._tick()
            self.requests += 1
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)

    def end(self, nbytes: int) -> None:
        with self.lock:
            self._tick()
            self.inflight -= 1
            self.bytes_fetched += nbytes

    def kind(self, kind: str, head_s: float, total_s: float) -> None:
        with self.lock:
            self.kind_n[kind] = self.kind_n.get(kind, 0) + 1
            self.kind_head_s[kind] = self.kind_head_s.get(kind, 0.0) + head_s
            self.kind_s[kind] = self.kind_s.get(kind, 0.0) + total_s

    def _tick(self) -> None:
        """Caller holds the lock: add the time since the last change to the in-flight integrals."""
        now = time.perf_counter()
        self.inflight_s += self.inflight * (now - self._last)
        self.busy_s += (now - self._last) if self.inflight else 0.0
        self.inflight_hist[self.inflight] = self.inflight_hist.get(self.inflight, 0.0) + now - self._last
        self._last = now

    def snapshot(self) -> dict[str, float]:
        with self.lock:
            self._tick()
            return {"http_requests": self.requests, "http_bytes": self.bytes_fetched, "http_retries": self.retries,
                    "http_max_inflight": self.max_inflight, "http_inflight_s": self.inflight_s,
                    "http_busy_s": self.busy_s, "http_inflight_hist": dict(self.inflight_hist),
                    "http_kind_n": dict(self.kind_n),
                    "http_kind_head_s": dict(self.kind_head_s), "http_kind_s": dict(self.kind_s)}


class _Retry(Exception):
    """A transient failure: wait `delay` (None: the backoff schedule) and try again."""

    def __init__(self, why: str, delay: float | None = None):
        super().__init__(why)
        self.delay = delay


def normalize_etag(value: str | None) -> str | None:
    """Strong and weak forms of one ETag compare equal (servers add W/ when they compress)."""
    if not value:
        return None
    value = value.strip()
    return value[2:] if value.startswith("W/") else value


def retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class HttpClient:
    """One pooled client for a checkpoint's files. `auth` headers go only to `auth_origin` (scheme://host:port);
    urllib3 strips them from a redirect to another host as well."""

    def __init__(self, auth: dict[str, str] | None = None, auth_origin: str | None = None,
                 timeout_s: float = 30.0, connections: int = 32, retry: RetryPolicy | None = None):
        self.auth = dict(auth or {})
        self.auth_origin = auth_origin
        self.retry = retry or RetryPolicy()
        self.stats = HttpStats()
        # urllib3 rather than httpx for the bodies: a range lands in the caller's buffer with one copy and large
        # reads, about a third of the CPU per request (which a loaded machine turns into wall time)
        self._pool = urllib3.PoolManager(num_pools=8, maxsize=connections, block=False, timeout=urllib3.Timeout(
            connect=min(timeout_s, 10.0), read=timeout_s))
        self._where: dict[str, str] = {}  # file URL -> where its last redirect led (a CDN location)
        self._lock = threading.Lock()
        self._parts = ThreadPoolExecutor(connections, thread_name_prefix="moestream-http")

    def close(self) -> None:
        self._parts.shutdown(wait=False)
        self._pool.clear()

    def _headers(self, url: str, extra: dict[str, str]) -> dict[str, str]:
        h = dict(extra)
        if self.auth and self.auth_origin and origin(url) == self.auth_origin:
            h.update(self.auth)
        return h

    def _open(self, url: str, headers: dict[str, str], preload: bool) -> urllib3.BaseHTTPResponse:
        """One GET with redirects followed by urllib3 (our own retry loop handles everything else)."""
        return self._pool.request("GET", url, headers=self._headers(url, headers), redirect=True,
                                  retries=_REDIRECTS_ONLY, preload_content=preload, decode_content=preload)

    # ---- whole files -------------------------------------------------------------------------------
    def get(self, url: str, missing_ok: bool = False) -> tuple[bytes, str | None] | None:
        """(body, ETag) of a small file; None when it is absent (404) and `missing_ok`."""
        def once() -> tuple[bytes, str | None] | None:
            self.stats.begin()
            got = 0
            try:
                r = self._open(url, {}, preload=True)  # a short body raises (urllib3 enforces Content-Length)
                if r.status == 404 and missing_ok:
                    return None
                self._check_status(url, r, (200,))
                body = r.data
                got = len(body)
                return body, normalize_etag(r.headers.get("etag"))
            finally:
                self.stats.end(got)
        return self._with_retries(url, once)

    # ---- byte ranges -------------------------------------------------------------------------------
    def get_range(self, url: str, offset: int, out: memoryview, size: int | None = None,
                  etag: str | None = None, guess: bool = False) -> tuple[str | None, int | None]:
        """Fill `out` with bytes [offset, offset + len(out)) of `url`. `size` (the file's length) and `etag`
        (pinned at first contact), when given, must match the response. Returns the response's (ETag, file
        length from Content-Range). A large range of a pinned file goes as up to SPLIT_MAX requests in parallel
        (one connection each): one connection's rate is bounded by round trips and by how often this process
        gets a CPU, so an expert lands sooner on several, and the link stays busier. `guess`: the fetch-ahead's
        (counted apart from reads in the stats)."""
        cuts = _split(len(out)) if etag is not None else [0, len(out)]
        if len(cuts) == 2:
            return self._get_range(url, offset, out, size, etag, guess)
        rest = [self._parts.submit(self._get_range, url, offset + a, out[a:b], size, etag, guess)
                for a, b in zip(cuts[1:-1], cuts[2:])]
        try:
            return self._get_range(url, offset, out[:cuts[1]], size, etag, guess)
        finally:
            for f in rest:  # every part has landed (or failed) before `out` goes back to the caller
                f.result()

    def _get_range(self, url: str, offset: int, out: memoryview, size: int | None,
                   etag: str | None, guess: bool = False) -> tuple[str | None, int | None]:
        """One range request (with retries) for all of `out`."""
        if len(out) == 0:
            return etag, size

        def once() -> tuple[str | None, int | None]:
            target = self._where.get(url, url)
            self.stats.begin()
            got, t0, head = 0, time.perf_counter(), None
            r = None
            try:
                r = self._open(target, {"Range": f"bytes={offset}-{offset + len(out) - 1}",
                                        "Accept-Encoding": "identity"}, preload=False)
                head = time.perf_counter() - t0
                if r.status in (401, 403, 404, 410) and target != url:
                    self._forget(url)  # an expired signed CDN location: ask the origin again
                    raise _Retry(f"HTTP {r.status} from a remembered redirect", 0.0)
                self._check_status(url, r, (206,))
                total = self._check_range(url, r, offset, len(out), size)
                got_etag = normalize_etag(r.headers.get("etag"))
                if etag is not None and got_etag is not None and got_etag != etag:
                    raise RemoteChangedError(
                        f"{url}: the file changed on the server (ETag {got_etag}, pinned {etag}); its cached "
                        f"bytes belong to the old version: open the model again to pin the new one")
                got = _read_body(r, out)
                self._remember(url, target, r)
                return got_etag, total
            finally:
                if r is not None:
                    if got == len(out):
                        r.release_conn()  # read to its end: the connection is reusable
                    else:
                        r.close()  # a half-read body must not go back to the pool
                self.stats.end(got)
                if head is not None:
                    self.stats.kind("fill" if guess else "read", head, time.perf_counter() - t0)
        return self._with_retries(url, once)

    def _remember(self, url: str, target: str, r: urllib3.BaseHTTPResponse) -> None:
        """Where the redirects of `target` led (the last hop's Location, resolved against its URL)."""
        hops = [h for h in (r.retries.history if r.retries else ()) if h.redirect_location]
        if hops and target == url:
            with self._lock:
                self._where[url] = urljoin(hops[-1].url, hops[-1].redirect_location)

    def _forget(self, url: str) -> None:
        with self._lock:
            self._where.pop(url, None)

    @staticmethod
    def _check_status(url: str, r: urllib3.BaseHTTPResponse, ok: tuple[int, ...]) -> None:
        if r.status in ok:
            return
        if r.status in RETRY_STATUS:
            raise _Retry(f"HTTP {r.status}", retry_after(r.headers.get("retry-after")))
        if r.status in (401, 403):
            raise RemoteError(f"{url}: HTTP {r.status}: access denied (for a gated or private Hugging Face "
                              f"repository set HF_TOKEN to a token that has accepted its terms)")
        if r.status == 404:
            raise RemoteError(f"{url}: HTTP 404: no such file on the server")
        if r.status == 200 and 206 in ok:
            raise RemoteError(f"{url}: the server ignored the Range header (HTTP 200); moestream needs byte "
                              f"ranges to stream a checkpoint")
        raise RemoteError(f"{url}: unexpected HTTP {r.status}")

    @staticmethod
    def _check_range(url: str, r: urllib3.BaseHTTPResponse, offset: int, nbytes: int, size: int | None) -> int | None:
        m = _CONTENT_RANGE.fullmatch(r.headers.get("content-range", "").strip())
        want_end = offset + nbytes - 1
        if m is None or int(m.group(1)) != offset or int(m.group(2)) != want_end \
                or (size is not None and m.group(3) != "*" and int(m.group(3)) != size):
            # a proxy or server that answered some other range: never trust the body
            raise _Retry(f"wrong Content-Range {r.headers.get('content-range')!r} for bytes {offset}-{want_end}"
                         + (f"/{size}" if size is not None else ""))
        length = r.headers.get("content-length")
        if length is not None and int(length) != nbytes:
            raise _Retry(f"Content-Length {length} for a range of {nbytes} bytes")
        return None if m.group(3) == "*" else int(m.group(3))

    def _with_retries(self, url: str, once):
        pol, last = self.retry, "no attempt"
        for attempt in range(pol.attempts):
            try:
                return once()
            except _Retry as e:
                last, delay = str(e), e.delay
            except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError, ValueError) as e:
                # resets, timeouts, truncated bodies (ValueError: a read of a response the server closed)
                last, delay = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__, None
            if attempt + 1 == pol.attempts:
                break
            with self.stats.lock:
                self.stats.retries += 1
            if delay is None:
                delay = min(pol.max_backoff_s, pol.backoff_s * 2 ** attempt) * random.uniform(0.5, 1.5)
            time.sleep(min(delay, pol.max_retry_after_s))
        raise RemoteError(f"{url}: giving up after {pol.attempts} attempts (last: {last}); check the network or "
                          f"run with --offline on a complete disk cache")


# redirects are urllib3's to follow (auth stripped across hosts); every failure comes back to our retry loop
_REDIRECTS_ONLY = urllib3.Retry(total=None, connect=0, read=0, status=0, other=0, redirect=10, raise_on_status=False)


def _split(n: int) -> list[int]:
    """Cut points [0, ..., n] of a range into parallel requests: about SPLIT_PART each (4 KiB aligned), at most
    SPLIT_MAX; [0, n] for a range too small to split."""
    k = min(SPLIT_MAX, n // SPLIT_PART)
    if k < 2:
        return [0, n]
    step = -(-n // k // 4096) * 4096
    return [min(i * step, n) for i in range(k)] + [n]


def _read_body(r: urllib3.BaseHTTPResponse, out: memoryview) -> int:
    """Read the body into `out`; a body shorter than `out` is a transient failure. The bytes go from the socket
    straight into `out` through http.client's `readinto` under urllib3's response: urllib3's own `readinto` reads a
    fresh bytes object and copies it, and http.client's `read(n)` below that allocates and copies once more (three
    copies and two fresh allocations of the range, their page faults included: 1.0-1.3 against 0.7 ms of CPU per
    MB for 3 MiB ranges over the shaped link)."""
    fp = getattr(r, "_fp", None)
    if isinstance(fp, http.client.HTTPResponse) and r.headers.get("content-encoding", "identity") == "identity":
        readinto = fp.readinto
    else:  # not the urllib3 this was written against: its own (copying) path
        readinto = r.readinto
    got = 0
    while got < len(out):
        n = readinto(out[got:])
        if not n:
            break
        got += n
    if got != len(out):
        raise _Retry(f"short body ({got} of {len(out)} bytes)")
    return got


def origin(url: str) -> str:
    u = urlsplit(url)
    return f"{u.scheme}://{u.netloc}".lower()
