"""Range fetches of a remote checkpoint in flight, and the lookahead's fetch-ahead into the SSD tier.

Owns `Flights`: every network fetch of a range registers here, so a second reader of the same range waits for
the first and gets its bytes instead of sending the request again (bytes cross the link once), and the count of
fetches that reads are waiting on. And `FillQueue`: the router lookahead's predictions for the next MoE layers,
fetched over the network into the SSD tier only (no RAM cache room taken, so the predictions can be generous),
on FILL_THREADS threads, the newest predictions replacing those not yet started, and paused while a read's own
fetch is on the link (its latency is on the decode's critical path; a guess must not share the link with it).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moestream.weights.remote import RemoteFile

# experts fetched ahead at once: each is split into ~1 MiB requests (http.SPLIT_MAX), so 2 keep ~6 requests, more
# than the bandwidth-delay product of a 200 MB/s link with 20 ms latency (4 MB), on the link between reads
FILL_THREADS = 2
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
    filled: int = 0  # ranges the fetch-ahead brought into the SSD tier
    filled_bytes: int = 0
    fill_skipped: int = 0  # predicted ranges already on disk or in flight


class Flights:
    """The ranges of a checkpoint's files being fetched, shared by the reader threads and the fill queue."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self._table: dict[tuple[str, int, int], _Flight] = {}
        self.reading = 0  # fetches made for reads (not fill) in flight: the fill queue waits while any are
        self.last_read_fetch = float("-inf")  # time.monotonic() of the last read that needed the network
        self.stats = FetchStats()

    def fetch(self, file: RemoteFile, pieces: list[Piece], fetch: Callable[[list[Piece]], None],
              for_read: bool = True) -> int:
        """Fill every piece exactly once across threads: a piece another thread is fetching is waited for and
        copied from it (the fill queue, `for_read` False, skips it instead); the rest are claimed, looked up once
        more in the SSD tier (a fetch that just finished put them there before it let go of them), and those still
        missing go to `fetch` in one call. A waited-for fetch that failed is tried again here. Returns the pieces
        this call fetched."""
        mine, theirs = self._claim(file, pieces, for_read)
        fetched = 0
        try:
            rest = [(o, v) for o, v in mine if not (file.cache is not None and file.cache.read(file.key, o, v))]
            if rest:
                if for_read:
                    self.last_read_fetch = time.monotonic()
                fetch(rest)
            fetched, ok = len(rest), True
        except BaseException:
            ok = False
            raise
        finally:
            self._release(file, mine, ok, for_read)
        again = []
        for off, view, flight in theirs:
            flight.done.wait()
            if flight.ok:
                with self.cv:
                    self.stats.joined += 1
                    self.stats.joined_bytes += len(view)
            else:
                again.append((off, view))
        if again:
            fetched += self.fetch(file, again, fetch, for_read)
        return fetched

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
            if mine and for_read:
                self.reading += 1
        return mine, theirs

    def _release(self, file: RemoteFile, mine: list[Piece], ok: bool, for_read: bool) -> None:
        """Hand the bytes to every waiter and let go of the claims (after the SSD tier has them, so a reader that
        arrives now finds them there)."""
        with self.cv:
            flights = [(view, self._table.pop((file.key, off, len(view)))) for off, view in mine]
            if mine and for_read:
                self.reading -= 1
                self.cv.notify_all()
        for view, flight in flights:
            if ok:
                for w in flight.waiters:
                    w[:] = view
            flight.ok = ok
            flight.done.set()


class FillQueue:
    """Ranges to bring into the SSD tier ahead of need, best first; `replace` swaps in the newest predictions."""

    def __init__(self, flights: Flights, threads: int = FILL_THREADS):
        self.flights = flights
        self.threads = threads
        self._jobs: deque[tuple[RemoteFile, int, int]] = deque()
        self._running = 0  # fill threads alive

    def replace(self, jobs: list[tuple[RemoteFile, int, int]]) -> None:
        """Fetch `jobs` (file, offset, length) ahead, in order, instead of whatever is still queued; nothing while
        the decode's reads find their bytes on disk (none needed the network in the last RECENT_S)."""
        cv = self.flights.cv
        if time.monotonic() - self.flights.last_read_fetch > RECENT_S:
            jobs = []
        with cv:
            self._jobs = deque(jobs)
            for i in range(self._running, min(self.threads, len(jobs))):
                self._running += 1
                threading.Thread(target=self._work, name=f"moestream-fill-{i}", daemon=True).start()
            cv.notify_all()

    def _next(self) -> tuple[RemoteFile, int, int] | None:
        """The next job once no read's fetch is in flight; None after IDLE_S with nothing queued (thread exits)."""
        cv = self.flights.cv
        with cv:
            while not self._jobs or self.flights.reading:
                if not cv.wait(IDLE_S) and not self._jobs:
                    self._running -= 1
                    return None
            return self._jobs.popleft()

    def _work(self) -> None:
        while (job := self._next()) is not None:
            file, offset, nbytes = job
            try:
                got = file.fill(offset, nbytes)
            except Exception:  # noqa: BLE001 - a guess that failed costs nothing: the read itself fetches and reports
                got = False
            with self.flights.cv:
                st = self.flights.stats
                if got:
                    st.filled, st.filled_bytes = st.filled + 1, st.filled_bytes + nbytes
                else:
                    st.fill_skipped += 1
