"""The budget of request-body bytes in flight in one server process.

A ``POST /v1/reports`` (or ``PUT /v1/runs``) body is held from its first byte until its
decode and ingest are done, and decoded it costs several times its size (up to ~17× for
bodies of valid or invalid reports, measured: docs/deploy.md "Limits and security"). The
ingest concurrency limit bounds threads, not that memory: bodies were read before it
applied, and a decoded batch waited for its ingest thread outside it, so 24 clients of
16 MB bodies held ~1 GB. :class:`BodyBudget` bounds it: a request takes its body's bytes
before reading them (its declared ``Content-Length``; a body without one takes each chunk
as it arrives) and gives them back when its response is decided, whatever happens.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Callable

import anyio


class BodyBudget:
    """At most ``limit`` bytes taken at once, handed out first come, first served.

    :meth:`take` waits (up to a timeout) for room, so it must only be called by a request
    that holds nothing yet: a request that holds bytes and waits for more could wait on
    another one doing the same. :meth:`try_grow` (a body that streams in without a
    declared length) never waits. ``on_change(held)`` is called after every change (the
    ``auditor_body_bytes_in_flight`` gauge). Used on the event loop only: no locks.
    """

    def __init__(self, limit: int, on_change: Callable[[int], None] | None = None):
        self.limit = limit
        self.held = 0
        self._waiters: collections.deque[list] = collections.deque()  # [bytes, future]
        self._on_change = on_change

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.held)

    def try_grow(self, n: int) -> bool:
        """Take ``n`` bytes if they fit now (ahead of waiters: a body already being read
        finishes sooner and gives everything back); False if not."""
        if self.held + n > self.limit:
            return False
        self.held += n
        self._changed()
        return True

    async def take(self, n: int, timeout: float) -> bool:
        """Take ``n`` bytes (at most ``limit``), waiting up to ``timeout`` s behind earlier
        waiters; False when they did not fit in time (nothing taken). Cancelled while
        waiting: nothing taken (what was granted meanwhile is given back)."""
        if n > self.limit:
            raise ValueError(f"{n} bytes can never fit a budget of {self.limit}")
        if not self._waiters and self.try_grow(n):
            return True
        fut = asyncio.get_running_loop().create_future()
        entry = [n, fut]
        self._waiters.append(entry)
        try:
            with anyio.move_on_after(timeout):
                await fut
        except BaseException:  # cancelled from outside: give back what was granted meanwhile
            if fut.done() and not fut.cancelled():
                self.release(n)
            else:
                self._leave(entry)
            raise
        if fut.done() and not fut.cancelled():  # granted (also when the timeout came just after)
            return True
        self._leave(entry)
        return False

    def _leave(self, entry: list) -> None:
        """A waiter gives up: out of the queue, and those behind it may fit now."""
        entry[1].cancel()
        try:
            self._waiters.remove(entry)
        except ValueError:
            pass
        self._wake()

    def release(self, n: int) -> None:
        """Give back ``n`` bytes taken before."""
        self.held -= n
        self._changed()
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.held + self._waiters[0][0] <= self.limit:
            n, fut = self._waiters.popleft()
            if fut.done():  # its request was cancelled meanwhile
                continue
            self.held += n
            fut.set_result(True)
            self._changed()


class Lease:
    """What one request took from a :class:`BodyBudget`; :meth:`close` gives it all back
    (call it once, in a ``finally``)."""

    def __init__(self, budget: BodyBudget):
        self.budget = budget
        self.held = 0

    async def take(self, n: int, timeout: float) -> bool:
        if await self.budget.take(n, timeout):
            self.held += n
            return True
        return False

    def try_grow(self, n: int) -> bool:
        if self.budget.try_grow(n):
            self.held += n
            return True
        return False

    def close(self) -> None:
        held, self.held = self.held, 0
        if held:
            self.budget.release(held)
