"""The handler's side of a scheduled request: the events a ticket carries (Delta, Done, Failed), the outbox that
hands them from the scheduler thread to the handlers' event loops, and the errors submit raises.

A ticket never waits on a dead scheduler thread or past --request-timeout; the scheduler itself lives in
scheduler.py and never imports this module's asyncio side into its engine work.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable

from moestream.errors import MoestreamError
from moestream.server.protocol import GenRequest, TokenLogprob, Usage


@dataclass
class Delta:
    text: str
    logprobs: list[TokenLogprob]
    index: int = 0  # the choice (of `n`) this belongs to


@dataclass
class Done:
    finish_reason: str  # "stop" | "length"
    usage: Usage
    index: int = 0


@dataclass
class Failed:
    status: int
    message: str
    err_type: str = "server_error"


class QueueFull(MoestreamError):
    """More requests are waiting than --max-queue allows."""


class Unavailable(MoestreamError):
    """The scheduler takes no requests: its thread is gone, or the server is draining for shutdown."""


def err_type(status: int) -> str:
    return "invalid_request_error" if status < 500 else "server_error"


POLL_S = 0.5  # how often the loop's watchdog checks that the scheduler thread runs and no request is overdue
_WAKE = object()  # the watchdog's marker in a ticket's queue: look again (thread gone, or past the timeout)


class Outbox:
    """Events from the scheduler thread to the handlers' event loops, held during an iteration and delivered with
    one wake-up per loop: eight streams cost the loop one callback per engine step, not eight."""

    def __init__(self) -> None:
        self._held: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}

    def send(self, ticket: "Ticket", event: Any) -> None:
        self._held.setdefault(ticket.loop, []).append((ticket.events, event))

    def flush(self) -> None:
        held, self._held = self._held, {}
        for loop, items in held.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
                pass


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, event in items:
        q.put_nowait(event)


class Ticket:
    """The handler's side of one request: an asyncio queue of Delta / Done / Failed events."""

    _ids = itertools.count()

    def __init__(self, req: GenRequest, loop: asyncio.AbstractEventLoop, outbox: Outbox,
                 alive: Callable[[], bool] = lambda: True, timeout_s: float | None = None):
        self.id = next(self._ids)
        self.req = req
        self.loop = loop
        self.outbox = outbox
        self.events: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.alive = alive
        self.submitted = time.monotonic()
        self.timeout_s = timeout_s
        self._open = req.n  # choices not yet done

    def put(self, event: Any) -> None:
        """Called from the scheduler thread (through its outbox, flushed after every iteration)."""
        self.outbox.send(self, event)

    async def next(self) -> Any:
        """The next event; a Failed one (not from the scheduler) when its thread died or the request ran past its
        timeout, so a handler never waits forever. The caller then cancels the ticket, which frees its state.
        The ticket is finished after a Failed event or once all `n` choices are Done."""
        while True:
            if self.events.empty():
                overdue = self._overdue()
                if overdue is not None:
                    self.finished = True  # a streaming handler stops at its first Failed event, as at the scheduler's
                    return overdue
                dog = _Watchdog.of(self.loop)
                dog.watch(self)
                try:
                    event = await self.events.get()
                finally:
                    dog.tickets.pop(self.id, None)
            else:
                event = self.events.get_nowait()
            if event is not _WAKE:
                break
        if isinstance(event, Done):
            self._open -= 1
        if isinstance(event, Failed) or self._open <= 0:
            self.finished = True
        return event

    def _overdue(self) -> Failed | None:
        if not self.alive():
            return Failed(503, "the server's scheduler thread stopped; the request cannot finish")
        if self.timeout_s is not None and time.monotonic() - self.submitted > self.timeout_s:
            return Failed(504, f"the request did not finish within the server's --request-timeout of "
                               f"{self.timeout_s:g} s", "timeout_error")
        return None


class _Watchdog:
    """One task per event loop (while any ticket waits) that, every POLL_S, wakes the waiting tickets whose scheduler
    thread has stopped or whose request is past its timeout (a marker in their queue; `next` then returns the Failed
    event). Waiting
    tickets cost nothing in between: a thousand requests of a batch job once woke the loop two thousand times a
    second, each with its own timed wait, holding the GIL the scheduler thread computes with."""

    _loops: dict[asyncio.AbstractEventLoop, "_Watchdog"] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.tickets: dict[int, Ticket] = {}
        self.task: asyncio.Task | None = None

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "_Watchdog":
        dog = cls._loops.get(loop)
        if dog is None:
            dog = cls._loops[loop] = cls(loop)
        return dog

    def watch(self, ticket: Ticket) -> None:
        self.tickets[ticket.id] = ticket
        if self.task is None or self.task.done():
            self.task = self.loop.create_task(self._run())

    async def _run(self) -> None:
        try:
            while self.tickets:
                await asyncio.sleep(POLL_S)
                for ticket in list(self.tickets.values()):  # the tickets waiting right now
                    if ticket.events.empty() and ticket._overdue() is not None:
                        ticket.events.put_nowait(_WAKE)
        finally:
            if self._loops.get(self.loop) is self:
                del self._loops[self.loop]
