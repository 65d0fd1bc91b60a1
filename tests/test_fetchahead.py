"""Fetch-ahead over HTTP (weights/fetchahead.py), against the real loopback hub server: a range is fetched once
however many readers want it, the lookahead's predictions land in the SSD tier with several requests in flight
(neighbouring ranges in one request) alongside a read's own requests, guesses no read used are counted and held to
a share of the SSD tier, and the SSD tier writes behind reads without losing a range."""
from __future__ import annotations

import os
import sys
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hfserver import CheckpointServer  # noqa: E402

from moestream.engine.engine import Engine  # noqa: E402
from moestream.weights import remote  # noqa: E402
from moestream.weights.diskcache import DiskCache  # noqa: E402
from moestream.weights.fetchahead import FillQueue, Flights  # noqa: E402
from moestream.weights.http import HttpClient  # noqa: E402
from moestream.weights.remote import RemoteFile  # noqa: E402

PIECE = 200_000


@pytest.fixture
def blob(tmp_path):
    """A 2 MB file served by a hub server that answers each request after 0.2 s, and a RemoteFile reading it
    through an SSD tier."""
    data = os.urandom(10 * PIECE + 123)
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "blob.bin").write_bytes(data)
    with CheckpointServer({"org/blob": tmp_path / "srv"}, latency=0.2) as srv:
        client = HttpClient()
        url = f"{srv.url}/plain/org/blob/blob.bin"
        etag, size = client.get_range(url, 0, memoryview(bytearray(8)))
        f = RemoteFile("blob.bin", url, size, etag, "test:blob", client, DiskCache(tmp_path / "dc"), Flights())
        wait_for(lambda: srv.log)  # the server logs a range after sending it: the probe's entry may come late
        srv.log.clear()
        srv.max_active = 0
        try:
            yield data, srv, f
        finally:
            client.close()


def ranges_sent(srv) -> Counter:
    return Counter((a, b) for p, a, b, n in srv.log if p.endswith("blob.bin") and n == b - a)


def wait_for(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_readers_of_one_range_share_one_request(blob):
    data, srv, f = blob
    outs = [bytearray(PIECE) for _ in range(4)]
    go = threading.Barrier(len(outs))

    def read(out: bytearray) -> None:
        go.wait()
        f.read_into(PIECE, [memoryview(out)])

    threads = [threading.Thread(target=read, args=(o,)) for o in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(bytes(o) == data[PIECE:2 * PIECE] for o in outs)
    srv.settled()  # every reader has its bytes; a second request, were there one, is logged once answered
    assert ranges_sent(srv) == Counter({(PIECE, 2 * PIECE): 1})  # four readers, one request
    assert f.flights.stats.joined == 3


def test_fill_brings_ranges_to_disk_with_requests_in_flight(blob):
    data, srv, f = blob
    q = FillQueue(f.flights, f.cache, threads=4)
    q.replace([(f, 0, PIECE)])  # no read has needed the network yet: predictions are not fetched
    f.read_into(9 * PIECE, [memoryview(bytearray(PIECE))])
    wait_for(lambda: srv.log)
    srv.log.clear()
    assert f.flights.stats.filled == 0
    apart = [0, 2, 4, 6, 8]  # no two neighbours: one request each
    q.replace([(f, i * PIECE, PIECE) for i in apart])
    wait_for(lambda: f.flights.stats.filled == 5 and len(ranges_sent(srv)) == 5)
    f.cache.flush()
    assert srv.max_active >= 4  # four fill threads, each request 0.2 s on the server: all four overlapped
    assert ranges_sent(srv) == Counter({(i * PIECE, (i + 1) * PIECE): 1 for i in apart})
    for i in apart:  # on disk, verified; reading them sends nothing
        out = memoryview(bytearray(PIECE))
        assert DiskCache(f.cache.root).read(f.key, i * PIECE, out) and bytes(out) == data[i * PIECE:(i + 1) * PIECE]
    before = len(srv.log)
    f.read_into(4 * PIECE, [memoryview(bytearray(PIECE))])
    assert len(srv.log) == before


def test_neighbouring_predictions_go_as_one_request_kept_as_their_own_ranges(blob):
    data, srv, f = blob
    f.read_into(9 * PIECE, [memoryview(bytearray(PIECE))])  # a read needed the network: predictions go
    wait_for(lambda: srv.log)
    srv.log.clear()
    q = FillQueue(f.flights, f.cache, threads=1)
    q.replace([(f, 5 * PIECE, PIECE), (f, 0, PIECE), (f, 6 * PIECE, PIECE), (f, 1 * PIECE, PIECE)])
    wait_for(lambda: f.flights.stats.filled == 4 and len(ranges_sent(srv)) == 2)
    f.cache.flush()
    assert ranges_sent(srv) == Counter({(5 * PIECE, 7 * PIECE): 1, (0, 2 * PIECE): 1})
    fresh = DiskCache(f.cache.root)
    for i in (0, 1, 5, 6):  # each prediction is its own range on disk: a later read of one is one whole file
        out = memoryview(bytearray(PIECE))
        assert fresh.read(f.key, i * PIECE, out) and bytes(out) == data[i * PIECE:(i + 1) * PIECE]
    assert len(list((f.cache.root / "ranges" / f.key).glob("*.rng"))) == 5


def test_fill_shares_the_link_with_reads_and_newest_predictions_win(blob):
    """A read's fetch on the link does not stop the fetch-ahead while the link has room (a pause per read left
    the link idle between requests); reads holding the whole in-flight budget do."""
    data, srv, f = blob
    q = FillQueue(f.flights, f.cache, threads=1, inflight=4 * PIECE)
    with f.flights.cv:
        f.flights.read_bytes = 4 * PIECE  # reads' own requests fill the link
        f.flights.last_read_fetch = time.monotonic()
    q.replace([(f, 0, PIECE)])
    q.replace([(f, 5 * PIECE, PIECE), (f, 8 * PIECE, PIECE)])  # replaces the first prediction before it started
    time.sleep(0.5)
    assert not srv.log
    with f.flights.cv:
        f.flights.read_bytes = PIECE  # one read still in flight: room for the guesses
        f.flights.cv.notify_all()
    wait_for(lambda: f.flights.stats.filled == 2 and len(ranges_sent(srv)) == 2)
    assert set(ranges_sent(srv)) == {(5 * PIECE, 6 * PIECE), (8 * PIECE, 9 * PIECE)}
    assert f.flights.read_bytes == PIECE and q.fill_bytes == 0


def test_fill_goes_while_a_read_is_on_the_link(blob):
    """The fetch-ahead's requests go while a read's own fetch is still in flight (held here until both
    predictions have landed: a fill that waited for the read would never land)."""
    data, srv, f = blob
    f.read_into(9 * PIECE, [memoryview(bytearray(PIECE))])
    wait_for(lambda: srv.log)
    held = threading.Event()
    out = memoryview(bytearray(PIECE))

    def fetch_when_released(rest):
        held.wait()
        f._fetch_missing(rest, True)

    reader = threading.Thread(target=f.flights.fetch, args=(f, [(3 * PIECE, out)], fetch_when_released))
    reader.start()
    wait_for(lambda: f.flights.read_bytes == PIECE)  # the read's fetch is on the link
    q = FillQueue(f.flights, f.cache, threads=2)
    q.replace([(f, 0, PIECE), (f, 6 * PIECE, PIECE)])
    try:
        wait_for(lambda: f.flights.stats.filled == 2)
        assert f.flights.read_bytes == PIECE  # still in flight
    finally:
        held.set()
        reader.join()
    assert bytes(out) == data[3 * PIECE:4 * PIECE] and f.flights.read_bytes == 0
    kinds = f.client.stats.snapshot()["http_kind_n"]  # requests counted by kind: the read's and the two guesses
    assert kinds.get("fill") == 2 and kinds.get("read", 0) >= 2  # (the fixture's probe was a read too)
    srv.settled()  # the read's own entry is logged after its body has gone
    assert {(0, PIECE), (6 * PIECE, 7 * PIECE), (3 * PIECE, 4 * PIECE)} <= set(ranges_sent(srv))


def test_unused_guesses_are_counted_and_held_to_their_share_of_the_tier(blob, tmp_path):
    """Ranges fetched ahead count as unused until a read takes them; past FILL_UNUSED_SHARE of the SSD tier's budget
    the oldest unused ones leave the tier (the bytes wrong guesses hold stay bounded), the used ones stay."""
    from moestream.weights import fetchahead

    data, srv, f0 = blob
    cache = DiskCache(tmp_path / "budgeted", budget=12 * PIECE)
    f = RemoteFile("blob.bin", f0.url, f0.size, f0.etag, "test:blob", f0.client, cache, Flights())
    f.read_into(9 * PIECE, [memoryview(bytearray(PIECE))])  # a read needed the network: predictions go
    q = FillQueue(f.flights, cache, threads=2)
    assert q.unused_limit == int(12 * PIECE * fetchahead.FILL_UNUSED_SHARE) == 3 * PIECE
    q.replace([(f, i * PIECE, PIECE) for i in range(6)])
    wait_for(lambda: f.flights.stats.filled == 6)
    assert f.flights.unused_bytes == 6 * PIECE and f.flights.stats.fill_used_bytes == 0
    for i in (0, 1):  # the decode reads two of the guesses, from the SSD tier
        out = memoryview(bytearray(PIECE))
        f.read_into(i * PIECE, [out])
        assert bytes(out) == data[i * PIECE:(i + 1) * PIECE]
    assert f.flights.stats.fill_used_bytes == 2 * PIECE and f.flights.unused_bytes == 4 * PIECE
    cache.flush()
    q.replace([])  # past the share: the oldest unused guess (range 2) leaves the tier
    assert f.flights.unused_bytes == 3 * PIECE and f.flights.stats.fill_dropped_bytes == PIECE
    on_disk = {int(p.stem.split("-")[0], 16) // PIECE for p in (cache.root / "ranges" / f.key).glob("*.rng")}
    assert on_disk == {0, 1, 3, 4, 5, 9}
    assert DiskCache(cache.root).verify_all() == (6, 0)
    out = memoryview(bytearray(PIECE))  # a dropped guess is fetched again when a read wants it
    f.read_into(2 * PIECE, [out])
    assert bytes(out) == data[2 * PIECE:3 * PIECE]


def test_copies_of_fetched_ranges_are_exact():
    """copy_into (the GIL-free copy of a fetched range) copies small, large, sliced and read-only sources exactly and
    refuses a length mismatch; pooled_copy hands the writer a private copy."""
    from moestream.weights.buffers import copy_into, pooled_copy

    data = os.urandom(3 << 20)
    src = memoryview(bytearray(data))
    for lo, hi in ((0, 10), (5, 5 + (1 << 16)), (4096, 4096 + (2 << 20)), (0, len(data))):
        dst = memoryview(bytearray(hi - lo))
        copy_into(dst, src[lo:hi])
        assert bytes(dst) == data[lo:hi]
    dst = memoryview(bytearray(1 << 20))
    copy_into(dst, data[:1 << 20])  # a read-only source
    assert bytes(dst) == data[:1 << 20]
    with pytest.raises(ValueError):
        copy_into(dst, src[:10])
    kept = pooled_copy(src)
    src[:4] = b"\0\0\0\0"
    assert bytes(kept.view) == data
    kept.release()


def test_write_behind_serves_pending_ranges_and_flushes(tmp_path):
    cache = DiskCache(tmp_path / "dc")
    data = os.urandom(3 << 20)
    cache.put_soon("k", 4096, data)
    out = memoryview(bytearray(1 << 20))
    assert cache.covered("k", 4096, len(data)) and cache.read("k", 4096 + 5, out)  # before or after the write
    assert bytes(out) == data[5:5 + (1 << 20)]
    cache.flush()
    fresh = DiskCache(tmp_path / "dc")  # another process's view: only what is on disk
    got = memoryview(bytearray(len(data)))
    assert fresh.read("k", 4096, got) and bytes(got) == data
    assert fresh.verify_all() == (1, 0)


def test_pooled_buffers_come_back_only_after_the_last_holder():
    """A pooled buffer is reused only once every holder has let go (the taker, a queued write, a reader copying
    from it); the pool keeps at most POOL_KEEP bytes; a buffer released twice is refused."""
    from moestream.weights.buffers import Pool

    pool = Pool(keep=8 << 20)
    a = pool.take(3 << 20)
    assert len(a.view) == 3 << 20 and pool.reused == 0
    a.hold()  # a queued write
    a.release()  # the taker is done
    b = pool.take(3 << 20)
    assert pool.reused == 0  # a is still held: b is another buffer
    a.release()  # the write is done: a goes back
    c = pool.take((3 << 20) - 100)  # the same size class
    assert pool.reused == 1 and len(c.view) == (3 << 20) - 100
    with pytest.raises(RuntimeError):
        a.release()
    for lease in (b, c, pool.take(4 << 20)):  # 3 + 3 + 4 MiB: past `keep`, the last is dropped
        lease.release()
    assert pool._free_bytes == 6 << 20


def test_queued_ranges_keep_their_pooled_buffer_until_written(tmp_path, monkeypatch):
    """A range queued for the SSD tier's writer from a pooled buffer holds it: the fill that took it lets go at
    once, a read of the queued range and the writer copy from bytes nobody else can have, and the buffer goes
    back to the pool only after the write; on disk the range is exact."""
    from moestream.weights import buffers
    from moestream.weights.diskcache import DiskCache as DC

    pool = buffers.Pool()
    cache = DC(tmp_path / "dc")
    gate = threading.Event()
    real = DC._write_pending

    def slow_write(self, key, offset):
        gate.wait()
        real(self, key, offset)

    monkeypatch.setattr(DC, "_write_pending", slow_write)
    data = os.urandom(3 << 20)
    lease = pool.take(len(data))
    lease.view[:] = data
    cache.put_soon("k", 0, lease.view, lease)
    lease.release()  # the fill is done with it; the queue still holds it
    other = pool.take(len(data))
    assert pool.reused == 0  # not recycled while queued
    other.view[:] = b"\xff" * len(data)
    out = memoryview(bytearray(1 << 20))
    assert cache.read("k", 4096, out) and bytes(out) == data[4096:4096 + (1 << 20)]
    gate.set()
    cache.flush()
    other.release()
    assert pool.reused == 0 and pool._free_bytes == 2 * (3 << 20)  # both back, neither reused early
    got = memoryview(bytearray(len(data)))
    assert DC(tmp_path / "dc").read("k", 0, got) and bytes(got) == data


@pytest.mark.parametrize("direct", [True, False])
def test_tier_writes_from_aligned_buffers_go_around_the_page_cache(tmp_path, monkeypatch, direct):
    """A range handed over in a page-aligned buffer (the fetch-ahead's, the write-behind's copy) is written with
    O_DIRECT: whole pages straight from the buffer, a partial last page through a padded one and the file cut to
    length. Where O_DIRECT is refused (direct False: as on tmpfs) the put writes buffered and later puts stay
    buffered. Either way the range file is the same: readable, verified, the same size, usage counted."""
    from moestream.weights import diskcache as dcmod
    from moestream.weights.buffers import aligned, pooled_copy

    opened = []
    real_open = os.open

    def spy_open(path, flags, *a):
        if flags & os.O_DIRECT and flags & os.O_WRONLY:
            opened.append(path)
            if not direct:
                raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(dcmod.os, "open", spy_open)
    cache = DiskCache(tmp_path / "dc")
    data = os.urandom((3 << 20) + 1234)  # a partial last page
    buf = aligned(len(data))
    buf[:] = data
    cache.put("k", 8192, buf)
    small = pooled_copy(memoryview(data[:5000]))  # less than two pages
    cache.put("k", 1 << 30, small.view)
    small.release()
    cache.put("k", 1 << 31, data[:4096])  # bytes: not aligned, always buffered
    assert len(opened) == (2 if direct else 1) and cache._direct_write is direct
    fresh = DiskCache(tmp_path / "dc")
    for off, want in ((8192, data), (1 << 30, data[:5000]), (1 << 31, data[:4096])):
        got = memoryview(bytearray(len(want)))
        assert fresh.read("k", off, got) and bytes(got) == want
    assert fresh.verify_all() == (3, 0)
    files = sorted((tmp_path / "dc" / "ranges" / "k").glob("*.rng"))
    sizes = [f.stat().st_size for f in files]
    assert sizes == [dcmod._data_start(4) + len(data), dcmod._data_start(1) + 5000, dcmod._data_start(1) + 4096]
    assert fresh.usage() == sum(sizes)
    assert list((tmp_path / "dc" / "tmp").iterdir()) == []  # nothing left half-written


def test_usage_record_is_rewritten_in_place_and_rebuilt_when_torn(tmp_path):
    """The tier's byte count is one checksummed record rewritten in place: inserts keep its inode (no file
    created and freed per range), and a torn, foreign or missing record is rebuilt from the range files."""
    cache = DiskCache(tmp_path / "dc")
    usage = tmp_path / "dc" / "usage"
    cache.put("k", 0, os.urandom(5000))
    ino = usage.stat().st_ino
    for i in range(1, 4):
        cache.put("k", i << 20, os.urandom(7000))
    on_disk = sum(f.stat().st_size for f in (tmp_path / "dc" / "ranges" / "k").glob("*.rng"))
    assert usage.stat().st_ino == ino and cache.usage() == on_disk
    raw = usage.read_bytes()
    for bad in (raw[:10] + b"9" + raw[11:], b"12345", b""):  # a torn digit (checksum fails), the old text, empty
        usage.write_bytes(bad)
        assert cache.usage() == on_disk and usage.read_bytes() == raw
    usage.unlink()
    assert cache.usage() == on_disk


def test_decode_fetches_predictions_ahead_once(tmp_path, monkeypatch):
    """A remote decode with an SSD tier hands the lookahead's predictions to the fetch-ahead, and no range of the
    checkpoint is sent twice in full (reads join fetches in flight); tokens equal the local run's."""
    from moestream.synth import synthesize

    ckpt = tmp_path / "tiny"
    synthesize("qwen3_moe", ckpt, "tiny", cache_dir=tmp_path / "synth", progress=False)
    prompt = [5, 17, 42, 99]
    eng = Engine.open(ckpt)
    try:
        want = eng.generate(prompt, 8, stop_token_ids=[])
    finally:
        eng.close()
    with CheckpointServer({"org/tiny": ckpt}, latency=0.01) as srv:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        for k, v in vars(remote.RemoteSettings()).items():
            monkeypatch.setattr(remote.SETTINGS, k, v)
        monkeypatch.setattr(remote.SETTINGS, "disk_cache", tmp_path / "dc")
        stub = remote.resolve("hf://org/tiny")
        srv.log.clear()
        eng = Engine.open(stub)
        la = eng.runner.lookahead
        handed = []  # every prediction the fetch-ahead got: [(layer, experts)]
        fill = la.fill
        la.fill = lambda preds: (handed.extend(preds), fill(preds))[1]
        try:
            assert fill is not None
            assert la.reads == 1  # the SSD tier takes the predictions: RAM reads ahead as locally
            la.warmup = 0
            la.fill_width = 2  # the next layer's guess twice as wide (off by default: docs/performance.md)
            got = eng.generate(prompt, 8, stop_token_ids=[])
            stats = eng.plan.store.index.stats()
        finally:
            eng.close()
        sent = Counter((p, a, b) for p, a, b, n in srv.log if n == b - a)
    assert got == want
    assert stats["fill_ranges"] > 0
    # a decode row's prediction for the next layer is its router's top 2k, for the one after its top k (tiny: 2 of
    # 16 experts routed)
    assert handed and sorted({len(set(experts)) for _, experts in handed}) == [2, 4]
    # the next token's first MoE layer (nothing of its token predicts it) was guessed from the token before it
    # (wrap_width 2: its router's top 2k on that token's input) and scored when it routed
    first = min(la.routers)
    assert any(layer == first and len(set(experts)) == 4 for layer, experts in handed)
    assert la.wrap_report()[first]["scored"] >= 6  # the decode steps after the prefill's
    assert 0 < stats["fill_used_bytes"] <= stats["fill_bytes"]
    assert [r for r, n in sent.items() if n > 1] == []


def test_every_read_is_verified_and_a_range_touched_at_most_every_touch_s(tmp_path, monkeypatch):
    """Each read checks the blocks it touches (a range damaged after an earlier good read is caught), while the
    range's mtime (its eviction order) is written at most once per TOUCH_S by a process (it was an inode write per
    expert read)."""
    from moestream.weights import diskcache

    data = os.urandom(3 << 20)
    DiskCache(tmp_path / "dc").put("k", 0, data)
    hashed = []
    monkeypatch.setattr(diskcache, "crc32", lambda b: hashed.append(len(b)) or zlib.crc32(b))
    cache = DiskCache(tmp_path / "dc")
    out = memoryview(bytearray(len(data)))
    assert cache.read("k", 0, out) and bytes(out) == data and len(hashed) == 3
    [rng] = (tmp_path / "dc" / "ranges" / "k").glob("*.rng")
    os.utime(rng, (1, 1))
    assert cache.read("k", 0, out) and bytes(out) == data and len(hashed) == 6
    assert rng.stat().st_mtime == 1  # touched by the first read, not again within TOUCH_S
    assert DiskCache(tmp_path / "dc").read("k", 0, out) and len(hashed) == 9
    assert rng.stat().st_mtime > 1  # another process touches it
    with open(rng, "r+b") as f:  # damage the last byte of the data after good reads
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    assert not cache.read("k", 0, out) and cache.stats.corrupt_ranges == 1


def test_neighbouring_predictions_land_in_one_buffer_without_a_copy(blob, monkeypatch):
    """A fill's neighbours (a hole under 4 KiB between them, one already on disk) go as requests straight into the
    fill's one buffer, each piece its slice: no second buffer copied into the pieces, and every byte right."""
    import moestream.weights.remote as remote_mod

    data, srv, f = blob
    f.read_into(9 * PIECE, [memoryview(bytearray(PIECE))])  # a read needed the network: predictions go
    f.read_into(2 * PIECE, [memoryview(bytearray(PIECE))])  # the middle one is on disk (or queued for it)
    wait_for(lambda: len(srv.log) >= 2)
    srv.settled()
    srv.log.clear()

    def no_copy(dst, src):
        raise AssertionError("a fill's bytes were copied out of a second buffer")

    monkeypatch.setattr(remote_mod, "copy_into", no_copy)
    ranges = [(0, PIECE), (PIECE + 1000, PIECE - 1000), (2 * PIECE, PIECE), (3 * PIECE, PIECE)]
    assert f.fill(ranges) == 3 * PIECE - 1000  # the pieces' bytes; [2P, 3P) was there already
    f.cache.flush()
    assert ranges_sent(srv) == Counter({(0, 2 * PIECE): 1, (3 * PIECE, 4 * PIECE): 1})
    fresh = DiskCache(f.cache.root)
    for off, n in ranges:
        out = memoryview(bytearray(n))
        assert fresh.read(f.key, off, out) and bytes(out) == data[off:off + n]
