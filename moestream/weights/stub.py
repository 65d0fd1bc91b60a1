"""Stubs of remote checkpoints: what first contact with a hub repository or a plain URL fetches, and where it goes.

Owns resolving `hf://ORG/NAME[@REVISION]` through huggingface_hub (the commit a branch or tag points to, the file
list, the hub's URLs for the current HF_ENDPOINT, HF_TOKEN auth) and a plain `https://.../DIR/` (files by name,
pinned by ETag), then building the stub directory atomically: config.json and the index json fetched whole, each
shard's length, ETag and safetensors header (two range requests per shard) in the manifest; the run-time files
(tokenizer, generation config, chat template) fetched once by the commands that run. `*.py` is never fetched.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from moestream.errors import CheckpointError, MoestreamError
from moestream.weights.index import REMOTE_MANIFEST
from moestream.weights.remote import INDEX_JSON, MANIFEST_FORMAT, MANIFEST_VERSION, RemoteSettings, Source

# small files a running model may read; fetched whole (absent ones are skipped)
SMALL_FILES = ("config.json", INDEX_JSON, "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "tiktoken.model", "tokenizer.model")
SMALL_SUFFIXES = (".json", ".jinja", ".model", ".tiktoken", ".txt")
MAX_SMALL_FILE = 64 << 20
MAX_HEADER = 100 << 20
_SHA = re.compile(r"[0-9a-f]{40}")


def resolve_stub(spec: str, s: RemoteSettings, full: bool = True) -> Path:
    """The local stub directory of a remote checkpoint, created (or refreshed) on first contact. The stub holds
    config.json, the index json and every shard's header; `full` also fetches the files a run needs (tokenizer,
    generation config, chat template), which `info` does not."""
    src = Source.parse(spec)
    _require_extra(src)
    home = s.stub_root() / "models" / src.key()
    if src.kind == "hf":
        stub = _resolve_hf(src, home, s)
    elif s.offline:
        stub = home / "current"
        if not (stub / REMOTE_MANIFEST).exists():
            raise CheckpointError(f"offline: {spec} was never opened with the disk cache {s.stub_root()}: its config "
                                  f"and headers are not cached; run once online first")
    else:
        client = http_client(src, s.http_timeout_s)
        try:
            stub = _build_stub(src, home, "current", {n: src.base + n for n in SMALL_FILES}, client, None)
        finally:
            client.close()
    if full:
        _complete(stub, src, s)
    return stub


def _complete(stub: Path, src: Source, s: RemoteSettings) -> None:
    """Fetch the stub's run-time files (tokenizer and friends) once; `.complete` marks it done."""
    if (stub / ".complete").exists():
        return
    m = json.loads((stub / REMOTE_MANIFEST).read_text())
    pending = [n for n in m.get("rest", []) if not (stub / n).exists()]
    if s.offline and pending:
        raise CheckpointError(f"offline: {', '.join(pending)} of {src.spec} are not cached (only `info` ran online); "
                              f"run it once online first")
    if pending:
        if src.kind == "hf":
            from huggingface_hub import hf_hub_url

            urls = {n: hf_hub_url(src.repo, n, revision=m["revision"], endpoint=endpoint()) for n in pending}
        else:
            urls = {n: src.base + n for n in pending}
        client = http_client(src, s.http_timeout_s)
        try:
            _fetch_small(urls, client, stub)
        finally:
            client.close()
    _write_text(stub / ".complete", "")


def _resolve_hf(src: Source, home: Path, s: RemoteSettings) -> Path:
    ref = home / "refs" / src.revision.replace("/", "%2F")
    if _SHA.fullmatch(src.revision) and (home / src.revision / REMOTE_MANIFEST).exists():
        return home / src.revision  # a commit never changes: no network needed
    if s.offline:
        if ref.exists() and (home / ref.read_text().strip() / REMOTE_MANIFEST).exists():
            return home / ref.read_text().strip()
        raise CheckpointError(f"offline: {src.spec} was never opened with the disk cache {home.parent.parent}: its "
                              f"revision, config and headers are not cached; run once online first")
    sha, files = _hf_listing(src)
    _write_text(ref, sha)
    if (home / sha / REMOTE_MANIFEST).exists():
        return home / sha
    from huggingface_hub import hf_hub_url

    keep = SMALL_SUFFIXES + (".safetensors",)
    wanted = [f for f in files if "/" not in f and (f in SMALL_FILES or f.endswith(keep))]
    names = {f: hf_hub_url(src.repo, f, revision=sha, endpoint=endpoint()) for f in wanted}
    client = http_client(src, s.http_timeout_s)
    try:
        return _build_stub(src, home, sha, names, client, sha)
    finally:
        client.close()


def endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _hf_listing(src: Source) -> tuple[str, list[str]]:
    """(commit hash, file names) of a hub revision, through huggingface_hub's API client."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    api = HfApi(endpoint=endpoint(), token=os.environ.get("HF_TOKEN") or None)
    try:
        info = api.model_info(src.repo, revision=src.revision)
    except GatedRepoError:
        raise CheckpointError(f"{src.spec}: gated repository: accept its terms on the hub and set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{src.spec}: no revision {src.revision!r} in {src.repo}") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{src.spec}: no such repository at {endpoint()} (or it is private: set "
                              f"HF_TOKEN)") from None
    except (HfHubHTTPError, *_network_errors()) as e:
        raise CheckpointError(f"{src.spec}: cannot reach {endpoint()}: {e}; use --offline with a complete disk "
                              f"cache to run without the network") from None
    if not info.sha:
        raise CheckpointError(f"{src.spec}: the hub did not report a commit hash for revision {src.revision!r}")
    return info.sha, [s.rfilename for s in (info.siblings or [])]


def _network_errors() -> tuple[type[BaseException], ...]:
    """What a hub call raises when the network fails: OSError (requests, urllib3), and httpx's errors, which are
    not OSErrors (huggingface_hub 1.x speaks httpx)."""
    try:
        import httpx
    except ImportError:
        return (OSError,)
    return (OSError, httpx.HTTPError)


def _require_extra(src: Source) -> None:
    import importlib.util

    for module in ("urllib3", "huggingface_hub") if src.kind == "hf" else ("urllib3",):
        if importlib.util.find_spec(module) is None:
            raise MoestreamError(f"remote checkpoints need the http extra ({module} is missing): "
                                 f"pip install 'moestream[http]'")


def http_client(src: Source, timeout: float = 30.0):
    from moestream.weights.http import HttpClient, origin

    if src.kind != "hf":
        return HttpClient(timeout_s=timeout)
    from huggingface_hub.utils import build_hf_headers

    from moestream import __version__

    auth = build_hf_headers(token=os.environ.get("HF_TOKEN") or None, library_name="moestream",
                            library_version=__version__)
    auth = {k: v for k, v in auth.items() if k.lower() == "authorization"}
    return HttpClient(auth=auth, auth_origin=origin(endpoint()), timeout_s=timeout)


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
