"""Range fetches of a remote checkpoint in flight, and the lookahead's fetch-ahead into the SSD tier.

Owns `Flights`: every network fetch of a range registers here, so a second reader of the same range waits for
the first and gets its bytes instead of sending the request again (bytes cross the link once), the bytes that
reads are waiting on, and the fetched-ahead ranges no read has used yet (the guesses' waste, held to a share of
the SSD tier's budget). And `FillQueue`: the router lookahead's predictions for the next MoE layers, fetched over
the network into the SSD tier only (no RAM cache room taken, so the predictions can be generous), the newest
predictions replacing those not yet started, neighbouring ranges of a file in one request, on as many threads as
keep FILL_INFLIGHT bytes on the link together with the reads' own fetches (reads never wait for a guess; a guess
starts whenever the link has room, so it is never idle between a read's requests).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moestream.weights.buffers import copy_into

if TYPE_CHECKING:
    from moestream.weights.diskcache import DiskCache
    from moestream.weights.remote import RemoteFile

# bytes kept on the link by reads and fetch-ahead together: four times the bandwidth-delay product of a 200 MB/s
# link with 20 ms latency (4 MB). Each request waits out its round trip before its bytes flow, so B bytes in flight
# carry B / (B / rate + latency): 0.67 of the rate at 8 MiB, 0.8 at 16, 0.86 at 24
FILL_INFLIGHT = 16 << 20
# unused predictions (fetched ahead, not read since) hold at most this share of the SSD tier's budget; past it the
# oldest leave the tier, so guesses never push out what the decode reads
FILL_UNUSED_SHARE = 0.25
FILL_THREADS = 8  # fill requests in flight at most (each takes up to FILL_COALESCE bytes of neighbouring ranges)
FILL_COALESCE = 8 << 20  # neighbouring predicted ranges of one file fetched as one request, up to this many bytes
IDLE_S = 5.0  # a fill thread with nothing queued for this long exits (a later prediction starts it again)
# predictions are fetched only this soon after a read needed the network: once the SSD tier holds what the decode
# reads (a warm tier, a `moestream fetch`), the link stays quiet instead of fetching guesses
RECENT_S = 5.0

Piece = tuple[int, memoryview]  # (file offset, where its bytes go)


class _Flight:
    """One range being fetched; readers of the same range add their buffer to `waiters`."""

    __slots__ = ("waiters", "done", "ok")

    def __init__(self) -> None:
        self.waiters: list[memoryview] = []
        self.done = threading.Event()
        self.ok = False


@dataclass
class FetchStats:
    joined: int = 0  # reads that got their bytes from a fetch already in flight instead of a request of their own
    joined_bytes: int = 0
    read_fetched: int = 0  # fetches a read made itself (nothing predicted it in time)
    read_fetched_bytes: int = 0
    filled: int = 0  # ranges the fetch-ahead brought into the SSD tier
    filled_bytes: int = 0
    fill_skipped: int = 0  # predicted ranges already on disk or in flight
    fill_used_bytes: int = 0  # bytes of filled ranges a read has since used (the rest: guesses not used yet)
    fill_dropped_bytes: int = 0  # bytes of filled ranges gone from the SSD tier unused (evicted, or dropped as the
    # oldest unused guesses past the fetch-ahead's share of the tier)


class Flights:
    """The ranges of a checkpoint's files being fetched, shared by the reader threads and the fill queue."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self._table: dict[tuple[str, int, int], _Flight] = {}
        self.read_bytes = 0  # bytes of fetches made for reads (not fill) on the link: the fill queue leaves room
        self.last_read_fetch = float("-inf")  # time.monotonic() of the last read that needed the network
        self.stats = FetchStats()
        self.unused: dict[tuple[str, int], int] = {}  # (file key, offset) -> bytes of a filled range no read used yet
        self.unused_bytes = 0

    def fetch(self, file: RemoteFile, pieces: list[Piece], fetch: Callable[[list[Piece]], None],
              for_read: bool = True) -> int:
        """Fill every piece exactly once across threads: a piece another thread is fetching is waited for and
        copied from it (the fill queue, `for_read` False, skips it instead); the rest are claimed, looked up once
        more in the SSD tier (a fetch that just finished put them there before it let go of them), and those still
        missing go to `fetch` in one call. A waited-for fetch that failed is tried again here. Returns the bytes
        this call fetched."""
        mine, theirs = self._claim(file, pieces, for_read)
        fetched, on_link = 0, 0
        try:
            rest = []
            for o, v in mine:
                if file.cache is not None and file.cache.read(file.key, o, v):
                    if for_read:
                        self.used(file.key, o)
                else:
                    rest.append((o, v))
            if rest:
                if for_read:
                    on_link = sum(len(v) for _, v in rest)
                    with self.cv:
                        self.last_read_fetch = time.monotonic()
                        self.read_bytes += on_link
                        self.stats.read_fetched += 1
                        self.stats.read_fetched_bytes += on_link
                fetch(rest)
                if not for_read:
                    self._guessed(file.key, rest)
            fetched, ok = sum(len(v) for _, v in rest), True
        except BaseException:
            ok = False
            raise
        finally:
            self._release(file, mine, ok, on_link)
        again = []
        for off, view, flight in theirs:
            flight.done.wait()
            if flight.ok:
                with self.cv:
                    self.stats.joined += 1
                    self.stats.joined_bytes += len(view)
                self.used(file.key, off)
            else:
                again.append((off, view))
        if again:
            fetched += self.fetch(file, again, fetch, for_read)
        return fetched

    def _guessed(self, key: str, pieces: list[Piece]) -> None:
        """Filled ranges count as unused guesses until a read uses them (before their flights let go of them)."""
        with self.cv:
            for off, view in pieces:
                if (key, off) not in self.unused:
                    self.unused[(key, off)] = len(view)
                    self.unused_bytes += len(view)

    def used(self, key: str, offset: int) -> None:
        """A read got range (key, offset) from the SSD tier or a flight: a filled range there is a guess that paid."""
        if not self.unused:
            return
        with self.cv:
            n = self.unused.pop((key, offset), 0)
            self.unused_bytes -= n
            self.stats.fill_used_bytes += n

    def drop_guesses(self, limit: int, cache: DiskCache) -> None:
        """Unused guesses past `limit` bytes leave the SSD tier, oldest first (those it evicted itself just leave
        the count), so wrong predictions never hold more than `limit` of the tier's room."""
        while True:
            with self.cv:
                if self.unused_bytes <= limit or not self.unused:
                    return
                (key, off), n = next(iter(self.unused.items()))
                del self.unused[(key, off)]
                self.unused_bytes -= n
                self.stats.fill_dropped_bytes += n
            cache.discard(key, off, n)

    def _claim(self, file: RemoteFile, pieces: list[Piece], for_read: bool):
        mine: list[Piece] = []
        theirs: list[tuple[int, memoryview, _Flight]] = []
        with self.cv:
            for off, view in pieces:
                k = (file.key, off, len(view))
                flight = self._table.get(k)
                if flight is None:
                    self._table[k] = _Flight()
                    mine.append((off, view))
                elif for_read:
                    flight.waiters.append(view)
                    theirs.append((off, view, flight))
        return mine, theirs

    def _release(self, file: RemoteFile, mine: list[Piece], ok: bool, on_link: int) -> None:
        """Hand the bytes to every waiter and let go of the claims (after the SSD tier has them, so a reader that
        arrives now finds them there); `on_link` read bytes leave the link."""
        with self.cv:
            flights = [(view, self._table.pop((file.key, off, len(view)))) for off, view in mine]
            if on_link:
                self.read_bytes -= on_link
                self.cv.notify_all()
        for view, flight in flights:
            if ok:
                for w in flight.waiters:
                    copy_into(w, view)
            flight.ok = ok
            flight.done.set()


Job = tuple["RemoteFile", int, int]  # (file, offset, length) of a predicted range


class FillQueue:
    """Ranges to bring into the SSD tier ahead of need, best first; `replace` swaps in the newest predictions."""

    def __init__(self, flights: Flights, cache: DiskCache, threads: int = FILL_THREADS, inflight: int | None = None):
        self.flights = flights
        self.cache = cache
        self.threads = threads
        # bytes on the link (reads' and fills') under which a fill may start
        self.inflight = FILL_INFLIGHT if inflight is None else inflight
        self.unused_limit = None if cache.budget is None else int(cache.budget * FILL_UNUSED_SHARE)
        self._jobs: deque[Job] = deque()
        self._running = 0  # fill threads alive
        self.fill_bytes = 0  # bytes of fills started and not finished

    def replace(self, jobs: list[Job]) -> None:
        """Fetch `jobs` ahead, in order, instead of whatever is still queued; nothing while the decode's reads
        find their bytes on disk (none needed the network in the last RECENT_S)."""
        cv = self.flights.cv
        if time.monotonic() - self.flights.last_read_fetch > RECENT_S:
            jobs = []
        if self.unused_limit is not None:
            self.flights.drop_guesses(self.unused_limit, self.cache)
        with cv:
            self._jobs = deque(jobs)
            for i in range(self._running, min(self.threads, len(jobs))):
                self._running += 1
                threading.Thread(target=self._work, name=f"moestream-fill-{i}", daemon=True).start()
            cv.notify_all()

    def _room(self) -> bool:
        """Caller holds the lock: whether the link has room for another fill (reads' bytes count first)."""
        return self.flights.read_bytes + self.fill_bytes < self.inflight

    def _next(self) -> list[Job] | None:
        """The next job and the queued jobs that continue it in its file (one request), once the link has room;
        their bytes count as on the link until `_done`. None after IDLE_S with nothing queued (thread exits)."""
        cv = self.flights.cv
        with cv:
            while not self._jobs or not self._room():
                if not cv.wait(IDLE_S) and not self._jobs:
                    self._running -= 1
                    return None
            batch = [self._jobs.popleft()]
            self._coalesce(batch)
            self.fill_bytes += sum(n for _, _, n in batch)
            return batch

    def _coalesce(self, batch: list[Job]) -> None:
        """Caller holds the lock: move queued jobs that continue `batch`'s last range (same file, starting within
        4 KiB of its end) into it, up to FILL_COALESCE bytes."""
        total = batch[0][2]
        while total < FILL_COALESCE:
            f, off, n = batch[-1]
            nxt = next((j for j in self._jobs if j[0] is f and off + n <= j[1] <= off + n + 4096), None)
            if nxt is None:
                return
            self._jobs.remove(nxt)
            batch.append(nxt)
            total += nxt[2]

    def _work(self) -> None:
        while (batch := self._next()) is not None:
            try:
                got = batch[0][0].fill([(off, n) for _, off, n in batch])
            except Exception:  # noqa: BLE001 - a guess that failed costs nothing: the read itself fetches and reports
                got = 0
            with self.flights.cv:
                self.fill_bytes -= sum(n for _, _, n in batch)
                st = self.flights.stats
                if got:
                    st.filled, st.filled_bytes = st.filled + len(batch), st.filled_bytes + got
                else:
                    st.fill_skipped += len(batch)
                self.flights.cv.notify_all()
