"""Remote checkpoints: `hf://ORG/NAME[@REVISION]` and `https://.../DIR/` opened as a local stub directory.

Owns turning a remote spec into a local directory the rest of moestream opens like any checkpoint: the small files
(config.json, the index json, tokenizer, generation config, chat template) fetched whole, and a
`moestream-remote.json` manifest holding each shard's URL, length, pinned ETag and safetensors header (two range
requests per shard at first contact, none afterwards). A hub revision is pinned to its commit hash and every URL
names that commit. `RemoteFile` stands in for a shard's path: its reads go to the SSD tier (diskcache.py) and, on
a miss, to HTTP range requests (http.py). The hub's URL scheme, auth headers and endpoint come from
huggingface_hub. Nothing in a checkpoint is executed; `*.py` files are never fetched.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from moestream.errors import CheckpointError, MoestreamError
from moestream.weights.index import REMOTE_MANIFEST, CheckpointIndex, tensors_from_header

MANIFEST_FORMAT, MANIFEST_VERSION = "moestream-remote", 1
INDEX_JSON = "model.safetensors.index.json"
# small files a running model may read; fetched whole (absent ones are skipped)
SMALL_FILES = ("config.json", INDEX_JSON, "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "tiktoken.model", "tokenizer.model")
SMALL_SUFFIXES = (".json", ".jinja", ".model", ".tiktoken", ".txt")
MAX_SMALL_FILE = 64 << 20
MAX_HEADER = 100 << 20
REMOTE_IO_THREADS = 8  # expert range requests in flight (a link with latency needs depth a local disk does not)
_HF = re.compile(r"hf://([\w.-]+/[\w.-]+)(?:@([\w./-]+))?/?")
_SHA = re.compile(r"[0-9a-f]{40}")


@dataclass
class RemoteSettings:
    """How remote checkpoints are opened in this process (the CLI sets it from --disk-cache / --disk-budget /
    --offline; the environment gives the defaults)."""

    disk_cache: Path | None = None  # keep fetched ranges here; None: only stubs (config, headers) are kept
    disk_budget: int | None = None  # bytes of ranges on disk; None: no limit
    offline: bool = False
    io_threads: int = REMOTE_IO_THREADS
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
        from moestream.synth import default_cache_dir

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

    def read_pieces(self, pieces: list[tuple[int, memoryview]]) -> None:
        """Fill each (offset, view): from the SSD tier where it holds the bytes, the rest with one range request
        per group of neighbouring pieces (overlaps and holes up to 4 KiB read through)."""
        missing = []
        for off, view in pieces:
            view = self._clip(off, view)
            if len(view) and not (self.cache is not None and self.cache.read(self.key, off, view)):
                missing.append((off, view))
        missing.sort(key=lambda p: p[0])
        group: list[tuple[int, memoryview]] = []
        for off, view in missing:
            if group and off > max(o + len(v) for o, v in group) + 4096:
                self._fetch_group(group)
                group = []
            group.append((off, view))
        if group:
            self._fetch_group(group)

    def _fetch_group(self, group: list[tuple[int, memoryview]]) -> None:
        if len(group) == 1:
            self._download(*group[0])
            return
        lo, hi = group[0][0], max(o + len(v) for o, v in group)
        buf = memoryview(bytearray(hi - lo))
        self._download(lo, buf)
        for off, view in group:
            view[:] = buf[off - lo:off - lo + len(view)]

    def _clip(self, offset: int, out: memoryview) -> memoryview:
        """The part of `out` inside the file; the rest (alignment padding past the end) is zeroed."""
        end = min(offset + len(out), self.size)
        if offset + len(out) > end:
            out[max(0, end - offset):] = bytes(len(out) - max(0, end - offset))
            out = out[:max(0, end - offset)]
        return out

    def fetch(self, offset: int, out: memoryview) -> None:
        """Bytes [offset, offset + len(out)): from the SSD tier, else one range request (then kept on disk)."""
        out = self._clip(offset, out)
        if len(out) == 0:
            return
        if self.cache is not None and self.cache.read(self.key, offset, out):
            return
        self._download(offset, out)

    def _download(self, offset: int, out: memoryview) -> None:
        """One range request (offline: the error naming the missing bytes); the bytes are then kept on disk."""
        if self.client is None:
            raise CheckpointError(f"offline: bytes [{offset}, {offset + len(out)}) of {self.name} ({self.url}) are not "
                                  f"in the disk cache {self.cache.root if self.cache else '(none)'}; run once online "
                                  f"with --disk-cache or `moestream fetch` it first")
        self.client.get_range(self.url, offset, out, self.size, self.etag)
        if self.cache is not None:
            self.cache.put(self.key, offset, out)


class RemoteIndex(CheckpointIndex):
    """A CheckpointIndex whose files are RemoteFiles; `remote` says where they come from and what they cost."""

    min_io_threads = REMOTE_IO_THREADS

    def __init__(self, root: Path, tensors: dict, manifest: dict, client, cache):
        super().__init__(root, tensors)
        self.manifest, self.client, self.cache = manifest, client, cache
        self.min_io_threads = SETTINGS.io_threads

    def stats(self) -> dict[str, int]:
        """Network and SSD-tier counters of this process's reads of the model."""
        out = {"http_requests": 0, "http_bytes": 0, "http_retries": 0, "http_max_inflight": 0}
        if self.client is not None:
            s = self.client.stats
            out.update(http_requests=s.requests, http_bytes=s.bytes_fetched, http_retries=s.retries,
                       http_max_inflight=s.max_inflight)
        if self.cache is not None:
            c = self.cache.stats
            out.update(disk_hit_bytes=c.hit_bytes, disk_put_bytes=c.put_bytes, disk_corrupt_ranges=c.corrupt_ranges,
                       disk_evicted_bytes=c.evicted_bytes)
        return out


# ---- opening ----------------------------------------------------------------------------------------
def resolve(spec: str, settings: RemoteSettings | None = None, full: bool = True) -> Path:
    """The local stub directory of a remote checkpoint, created (or refreshed) on first contact. The stub holds
    config.json, the index json and every shard's header; `full` also fetches the files a run needs (tokenizer,
    generation config, chat template), which `info` does not."""
    s = settings or SETTINGS
    src = Source.parse(spec)
    home = s.stub_root() / "models" / src.key()
    if src.kind == "hf":
        stub = _resolve_hf(src, home, s.offline)
    elif s.offline:
        stub = home / "current"
        if not (stub / REMOTE_MANIFEST).exists():
            raise CheckpointError(f"offline: {spec} was never opened with the disk cache {s.stub_root()}: its config "
                                  f"and headers are not cached; run once online first")
    else:
        client = _client(src)
        try:
            stub = _build_stub(src, home, "current", {n: src.base + n for n in SMALL_FILES}, client, None)
        finally:
            client.close()
    if full:
        _complete(stub, src, s.offline)
    return stub


def _complete(stub: Path, src: Source, offline: bool) -> None:
    """Fetch the stub's run-time files (tokenizer and friends) once; `.complete` marks it done."""
    if (stub / ".complete").exists():
        return
    m = json.loads((stub / REMOTE_MANIFEST).read_text())
    pending = [n for n in m.get("rest", []) if not (stub / n).exists()]
    if offline and pending:
        raise CheckpointError(f"offline: {', '.join(pending)} of {src.spec} are not cached (only `info` ran online); "
                              f"run it once online first")
    if pending:
        if src.kind == "hf":
            from huggingface_hub import hf_hub_url

            urls = {n: hf_hub_url(src.repo, n, revision=m["revision"], endpoint=_endpoint()) for n in pending}
        else:
            urls = {n: src.base + n for n in pending}
        client = _client(src)
        try:
            _fetch_small(urls, client, stub)
        finally:
            client.close()
    _write_text(stub / ".complete", "")


def _resolve_hf(src: Source, home: Path, offline: bool) -> Path:
    ref = home / "refs" / src.revision.replace("/", "%2F")
    if _SHA.fullmatch(src.revision) and (home / src.revision / REMOTE_MANIFEST).exists():
        return home / src.revision  # a commit never changes: no network needed
    if offline:
        if ref.exists() and (home / ref.read_text().strip() / REMOTE_MANIFEST).exists():
            return home / ref.read_text().strip()
        raise CheckpointError(f"offline: {src.spec} was never opened with the disk cache {home.parent.parent}: its "
                              f"revision, config and headers are not cached; run once online first")
    sha, files = _hf_listing(src)
    _write_text(ref, sha)
    if (home / sha / REMOTE_MANIFEST).exists():
        return home / sha
    from huggingface_hub import hf_hub_url

    wanted = [f for f in files if "/" not in f and (f in SMALL_FILES or f.endswith(SMALL_SUFFIXES + (".safetensors",)))]
    names = {f: hf_hub_url(src.repo, f, revision=sha, endpoint=_endpoint()) for f in wanted}
    client = _client(src)
    try:
        return _build_stub(src, home, sha, names, client, sha)
    finally:
        client.close()


def _endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _hf_listing(src: Source) -> tuple[str, list[str]]:
    """(commit hash, file names) of a hub revision, through huggingface_hub's API client."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    api = HfApi(endpoint=_endpoint(), token=os.environ.get("HF_TOKEN") or None)
    try:
        info = api.model_info(src.repo, revision=src.revision)
    except GatedRepoError:
        raise CheckpointError(f"{src.spec}: gated repository: accept its terms on the hub and set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{src.spec}: no revision {src.revision!r} in {src.repo}") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{src.spec}: no such repository at {_endpoint()} (or it is private: set "
                              f"HF_TOKEN)") from None
    except (HfHubHTTPError, OSError) as e:
        raise CheckpointError(f"{src.spec}: cannot reach {_endpoint()}: {e}; use --offline with a complete disk "
                              f"cache to run without the network") from None
    if not info.sha:
        raise CheckpointError(f"{src.spec}: the hub did not report a commit hash for revision {src.revision!r}")
    return info.sha, [s.rfilename for s in (info.siblings or [])]


def _client(src: Source):
    from moestream.weights.http import HttpClient, origin

    timeout = SETTINGS.http_timeout_s
    if src.kind != "hf":
        return HttpClient(timeout_s=timeout)
    from huggingface_hub.utils import build_hf_headers

    from moestream import __version__

    auth = build_hf_headers(token=os.environ.get("HF_TOKEN") or None, library_name="moestream",
                            library_version=__version__)
    auth = {k: v for k, v in auth.items() if k.lower() == "authorization"}
    return HttpClient(auth=auth, auth_origin=origin(_endpoint()), timeout_s=timeout)


def _build_stub(src: Source, home: Path, leaf: str, names: dict[str, str], client, revision: str | None) -> Path:
    """Fetch the small files and every shard's header into a fresh stub directory, then move it into place."""
    tmp = home / f".tmp-{os.getpid()}-{leaf}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        got = _fetch_small({n: u for n, u in names.items() if n in ("config.json", INDEX_JSON)}, client, tmp)
        if "config.json" not in got:
            raise CheckpointError(f"{src.spec}: no config.json there (is it a Hugging Face checkpoint directory?)")
        shards = _shard_names(src, tmp, names)
        base_url = {n: names.get(n) or _sibling_url(names["config.json"], n) for n in shards}
        with ThreadPoolExecutor(min(8, max(1, len(shards)))) as ex:
            heads = dict(zip(shards, ex.map(lambda n: _fetch_header(client, n, base_url[n]), shards)))
        manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "source": src.spec,
                    "revision": revision, "files": {n: {"etag": got[n]} for n in got}, "shards": heads,
                    "rest": [n for n in names if n not in got and not n.endswith(".safetensors")]}
        _write_text(tmp / REMOTE_MANIFEST, json.dumps(manifest))
        return _install(tmp, home / leaf, replace=src.kind != "hf")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sibling_url(config_url: str, name: str) -> str:
    return config_url[: -len("config.json")] + name


def _fetch_small(names: dict[str, str], client, into: Path) -> dict[str, str | None]:
    """Small files fetched whole (absent ones skipped); returns name -> ETag of those present."""
    got: dict[str, str | None] = {}
    for name, url in names.items():
        if name.endswith(".safetensors"):
            continue
        res = client.get(url, missing_ok=True)
        if res is None:
            continue
        body, etag = res
        if len(body) > MAX_SMALL_FILE:
            raise CheckpointError(f"{url}: {len(body)} bytes is too large for a config or tokenizer file")
        tmp = into / f".{name}.{os.getpid()}"
        tmp.write_bytes(body)
        os.replace(tmp, into / name)  # a reader never sees half a tokenizer
        got[name] = etag
    return got


def _shard_names(src: Source, stub: Path, names: dict[str, str]) -> list[str]:
    idx = stub / INDEX_JSON
    if idx.exists():
        try:
            files = sorted(set(json.loads(idx.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{src.spec}: malformed {INDEX_JSON}: {e}") from None
        bad = [f for f in files if not isinstance(f, str) or "/" in f or f.startswith(".") or "\\" in f]
        if bad:
            raise CheckpointError(f"{src.spec}: {INDEX_JSON} names shards outside the checkpoint: {bad[:3]}")
        return files
    listed = [n for n in names if n.endswith(".safetensors")]
    return listed or ["model.safetensors"]


def _fetch_header(client, name: str, url: str) -> dict:
    """A shard's length, ETag and safetensors header: two range requests (the 8-byte length, then the JSON)."""
    head = bytearray(8)
    etag, size = client.get_range(url, 0, memoryview(head))
    if size is None or size < 8:
        raise CheckpointError(f"{url}: the server did not report the file's length (Content-Range .../*)")
    hlen = int.from_bytes(head, "little")
    if hlen > MAX_HEADER or 8 + hlen > size:
        raise CheckpointError(f"{url}: corrupt safetensors header length {hlen} (file is {size} bytes)")
    raw = bytearray(hlen)
    client.get_range(url, 8, memoryview(raw), size, etag)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{url}: safetensors header is not UTF-8") from None
    return {"url": url, "size": size, "etag": etag, "header": text}


def _install(tmp: Path, final: Path, replace: bool) -> Path:
    if final.exists():
        if not replace:
            return final  # another process pinned the same commit first: identical content
        old = final.with_name(f".old-{os.getpid()}-{final.name}")
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.replace(tmp, final)
    except OSError:
        if not final.exists():
            raise
    return final


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


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
    src = Source.parse(m["source"])
    client = None if s.offline else _client(src)
    cache = None
    if s.disk_cache is not None:
        from moestream.weights.diskcache import DiskCache

        cache = DiskCache(s.disk_cache, s.disk_budget)
    tensors = {}
    for name, sh in shards.items():
        url, ident = sh["url"], sh["url"]
        if src.kind == "hf":  # the current endpoint (HF_ENDPOINT may name a mirror since the stub was made)
            from huggingface_hub import hf_hub_url

            url = hf_hub_url(src.repo, name, revision=m["revision"], endpoint=_endpoint())
            ident = f"hf:{src.repo}@{m['revision']}/{name}"
        f = RemoteFile(name, url, int(sh["size"]), sh.get("etag"), ident, client, cache)
        tensors.update(tensors_from_header(f, sh["header"].encode(), f.size))
    return RemoteIndex(root, tensors, m, client, cache)


def manifest_of(root: Path) -> dict | None:
    """The remote manifest of a stub directory (None for a local checkpoint)."""
    path = Path(root) / REMOTE_MANIFEST
    if not path.exists():
        return None
    return json.loads(path.read_text())
