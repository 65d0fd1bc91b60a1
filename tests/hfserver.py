"""A real HTTP server on loopback that serves checkpoint directories the way the Hugging Face hub does.

Routes: `/api/models/ORG/NAME[/revision/REV]` (the listing huggingface_hub's `model_info` reads: commit sha and
file names), `/ORG/NAME/resolve/REV/FILE` (small files served directly, `*.safetensors` redirected with 302 to a
`/cdn/...` location like the hub's LFS files), `/cdn/...` and `/plain/ORG/NAME/FILE` (a plain directory URL),
all with Range, ETag and keep-alive. Optional throttling (one token bucket shared by all connections: a link of
`bandwidth` bytes/s, plus `latency` seconds before each response) and injected faults on range requests (drop,
stall, truncate, 5xx, 429, wrong Content-Range, changed ETag). Every range served is logged. Listens on loopback
unless given another `host` (bench/http_stream.py's kernel-shaped link runs it inside a network namespace, on the
far side of a veth pair, unthrottled: the kernel paces it). Used by the tests and by bench/http_stream.py; not part
of the package.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SHA = "0123456789abcdef0123456789abcdef01234567"
CHUNK = 64 * 1024


class TokenBucket:
    """A shared link: `rate` bytes/s across every connection (None: unthrottled), with a bucket of `burst` bytes.

    A sender that wakes late from its sleep (a loaded machine) may catch up by at most `burst` bytes, as a traffic
    shaper's bucket allows; without one every late wake-up would be link time lost, and the emulated link would
    run below its rate because of this process's scheduling rather than the client's requests."""

    def __init__(self, rate: float | None, burst: int = 256 << 10):
        self.rate, self.burst, self.lock, self.t = rate, burst, threading.Lock(), time.monotonic()

    def take(self, n: int) -> None:
        if not self.rate:
            return
        with self.lock:
            now = time.monotonic()
            self.t = max(self.t, now - self.burst / self.rate) + n / self.rate  # when the link has sent these
            wait = self.t - now
        if wait > 0:
            time.sleep(wait)


class CheckpointServer:
    def __init__(self, repos: dict[str, Path], bandwidth: float | None = None, latency: float = 0.0,
                 token: str | None = None, host: str = "127.0.0.1"):
        self.repos = {k: Path(v) for k, v in repos.items()}  # "org/name" -> directory
        self.bucket, self.latency, self.token = TokenBucket(bandwidth), latency, token
        self.faults: list[str] = []  # consumed one per range request to /cdn or /plain
        self.fault_filter: str = ""  # only requests whose path contains this take a fault
        self.log: list[tuple[str, int, int, int]] = []  # (path, start, end exclusive, bytes sent)
        self.etag_salt = ""  # change to make every ETag change (a new upload)
        self.lock = threading.Lock()
        self.requests = 0
        self.active = 0  # requests being answered now (latency included) ...
        self.max_active = 0  # ... and the most at once: the requests a client kept in flight
        handler = type("Handler", (_Handler,), {"srv": self})
        self.httpd = ThreadingHTTPServer((host, 0), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.httpd.server_address[0]}:{self.httpd.server_address[1]}"

    def __enter__(self) -> "CheckpointServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def etag(self, path: Path) -> str:
        st = path.stat()
        return '"' + hashlib.sha1(f"{path}{st.st_size}{st.st_mtime_ns}{self.etag_salt}".encode()).hexdigest() + '"'

    def take_fault(self, path: str) -> str | None:
        with self.lock:
            if self.faults and self.fault_filter in path:
                return self.faults.pop(0)
        return None

    def settled(self, timeout: float = 10.0) -> list[tuple[str, int, int, int]]:
        """The log once no request is being answered: a range is logged after its body has gone, so a client
        can hold the bytes before the server has written the entry."""
        end = time.monotonic() + timeout
        while True:
            with self.lock:
                if not self.active:
                    return list(self.log)
            if time.monotonic() > end:
                raise TimeoutError(f"{self.active} requests still being answered after {timeout} s")
            time.sleep(0.01)

    def bytes_served(self) -> int:
        with self.lock:
            return sum(n for *_, n in self.log)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    srv: CheckpointServer

    def setup(self) -> None:
        super().setup()
        # headers and body go out as separate writes: without NODELAY each response waits on a delayed ACK
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def _route(self, head: bool) -> None:
        srv = self.srv
        with srv.lock:
            srv.requests += 1
            srv.active += 1
            srv.max_active = max(srv.max_active, srv.active)
        try:
            self._answer(head)
        finally:
            with srv.lock:
                srv.active -= 1

    def _answer(self, head: bool) -> None:
        srv = self.srv
        if srv.latency:
            time.sleep(srv.latency)
        path = self.path.split("?", 1)[0]
        if srv.token and self.headers.get("Authorization") != f"Bearer {srv.token}" and not path.startswith("/cdn/"):
            return self._status(401, {"X-Error-Code": "GatedRepo"}, "gated")
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m:
            return self._api(m.group(1), m.group(2) or "main")
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self._resolve(m.group(1), m.group(2), m.group(3), head)
        m = re.fullmatch(r"/(?:cdn|plain)/([^/]+/[^/]+)/(.+)", path)
        if m and m.group(1) in srv.repos:
            return self._file(srv.repos[m.group(1)] / m.group(2), head, fault=True)
        self._status(404, {"X-Error-Code": "EntryNotFound"}, "not found")

    def _api(self, repo: str, rev: str) -> None:
        if repo not in self.srv.repos:
            return self._status(404, {"X-Error-Code": "RepoNotFound"}, "repository not found")
        if rev not in ("main", SHA):
            return self._status(404, {"X-Error-Code": "RevisionNotFound"}, "revision not found")
        files = sorted(p.name for p in self.srv.repos[repo].iterdir() if p.is_file())
        body = json.dumps({"id": repo, "modelId": repo, "sha": SHA, "private": False,
                           "siblings": [{"rfilename": f} for f in files]}).encode()
        self._send(200, {"Content-Type": "application/json"}, body)

    def _resolve(self, repo: str, rev: str, name: str, head: bool) -> None:
        if repo not in self.srv.repos:
            return self._status(404, {"X-Error-Code": "RepoNotFound"}, "repository not found")
        if rev not in ("main", SHA):
            return self._status(404, {"X-Error-Code": "RevisionNotFound"}, "revision not found")
        f = self.srv.repos[repo] / name
        if not f.is_file():
            return self._status(404, {"X-Error-Code": "EntryNotFound"}, "entry not found")
        if name.endswith(".safetensors"):  # LFS: the hub redirects to a signed CDN location
            return self._send(302, {"Location": f"/cdn/{repo}/{name}?sig=x", "X-Repo-Commit": SHA,
                                    "X-Linked-Etag": self.srv.etag(f), "X-Linked-Size": str(f.stat().st_size)}, b"")
        self._file(f, head, fault=False, extra={"X-Repo-Commit": SHA})

    def _file(self, f: Path, head: bool, fault: bool, extra: dict | None = None) -> None:
        srv = self.srv
        if not f.is_file():
            return self._status(404, {}, "not found")
        size = f.stat().st_size
        headers = {"ETag": srv.etag(f), "Accept-Ranges": "bytes", **(extra or {})}
        rng = self.headers.get("Range")
        if not rng:
            if head:
                return self._send(200, {**headers, "Content-Length": str(size)}, None)
            return self._send(200, headers, f.read_bytes())
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
        start = int(m.group(1)) if m else size
        end = min(int(m.group(2)) + 1 if m and m.group(2) else size, size)
        if start >= size or end <= start:
            return self._status(416, {"Content-Range": f"bytes */{size}"}, "range not satisfiable")
        kind = srv.take_fault(self.path) if fault else None
        if kind == "drop":
            self.close_connection = True
            return
        if kind == "stall":
            time.sleep(3.0)
        if kind in ("500", "503"):
            return self._status(int(kind), {}, "server error")
        if kind == "429":
            return self._status(429, {"Retry-After": "1"}, "slow down")
        cr = f"bytes {start + (1 if kind == 'bad_range' else 0)}-{end - 1}/{size}"
        if kind == "etag":
            headers["ETag"] = '"changed"'
        self.send_response(206)
        for k, v in {**headers, "Content-Range": cr, "Content-Length": str(end - start)}.items():
            self.send_header(k, v)
        self.end_headers()
        limit = (end - start) // 2 if kind == "truncate" else end - start
        sent = 0
        try:
            with open(f, "rb") as fh:  # sendfile: the emulated remote host spends little of this machine's CPU
                while sent < limit:
                    # throttled: CHUNK at a time through the bucket; else the whole body in one sendfile loop (a
                    # link shaped by the kernel, bench/netshape.py, paces it with no CPU spent here)
                    n = min(CHUNK, limit - sent) if srv.bucket.rate else limit - sent
                    srv.bucket.take(n)
                    sent += _send_file(self.connection, fh.fileno(), start + sent, n)
        except (BrokenPipeError, ConnectionResetError):
            pass
        with srv.lock:
            srv.log.append((self.path.split("?", 1)[0], start, end, sent))
        if kind == "truncate":
            self.close_connection = True

    def _status(self, code: int, headers: dict, text: str) -> None:
        self._send(code, {**headers, "Content-Type": "text/plain"}, text.encode())

    def _send(self, code: int, headers: dict, body: bytes | None) -> None:
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        if body is not None:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.srv.bucket.take(len(body))
            self.wfile.write(body)


def _send_file(sock: socket.socket, fd: int, offset: int, n: int) -> int:
    """Send bytes [offset, offset + n) of `fd` on `sock` (a blocking socket may take them in several calls)."""
    done = 0
    while done < n:
        got = os.sendfile(sock.fileno(), fd, offset + done, n - done)
        if got == 0:
            break
        done += got
    return done


def main(argv: list[str] | None = None) -> None:
    """`python tests/hfserver.py DIR --repo ORG/NAME [--bandwidth B/s] [--latency S] [--host IP]`: serve until
    killed; prints the base URL on the first line of stdout and, on SIGTERM, writes the range log (--log)."""
    import argparse
    import signal
    import sys

    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--repo", default="org/model")
    ap.add_argument("--bandwidth", type=float, default=None)
    ap.add_argument("--latency", type=float, default=0.0)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    ap.add_argument("--log", type=Path, default=None, help="write the range log here on exit")
    a = ap.parse_args(argv)
    srv = CheckpointServer({a.repo: a.dir}, bandwidth=a.bandwidth, latency=a.latency, host=a.host)

    def stop(*_) -> None:
        if a.log:
            a.log.write_text("".join(json.dumps(row) + "\n" for row in srv.log))
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    with srv:
        print(srv.url, flush=True)
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    main()
