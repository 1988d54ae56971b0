"""The budget of request-body bytes in flight (auditor.server.budget): first come, first
served, and nothing leaks when a waiter times out or is cancelled, even in the same loop
iteration its bytes were granted. The HTTP side (every outcome leaves the gauge at 0, a
1 GiB-capped server under concurrent 16 MB bodies) is in test_body_and_connection_limits.py."""

from __future__ import annotations

import asyncio
import threading

import pytest

from auditor.config import Settings
from auditor.server.budget import BodyBudget, Lease


def run(coro):
    """``asyncio.run`` in a thread of its own: a test before this one in the same worker
    (Playwright's sync API) can leave an event loop running in the main thread."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(asyncio.run(coro)))
    t.start()
    t.join(60)
    assert out, "the coroutine raised or did not finish (see the thread's traceback)"
    return out[0]


def test_waiters_are_served_in_order_and_everything_comes_back():
    async def main():
        seen: list[int] = []
        b = BodyBudget(100, on_change=seen.append)
        first, second, third = Lease(b), Lease(b), Lease(b)
        assert await first.take(60, 0) and b.held == 60
        waiting = asyncio.ensure_future(second.take(50, 5))   # does not fit: waits
        small = asyncio.ensure_future(third.take(10, 5))      # would fit, but waits its turn
        await asyncio.sleep(0.01)
        assert not waiting.done() and not small.done() and b.held == 60
        first.close()
        assert await waiting and await small and b.held == 60
        assert not await Lease(b).take(41, 0)               # no room, no wait
        assert second.try_grow(40) and b.held == 100 and not third.try_grow(1)
        second.close()
        third.close()
        assert b.held == 0 and seen[-1] == 0
        with pytest.raises(ValueError):
            await Lease(b).take(101, 1)
    run(main())


def test_a_waiter_that_times_out_takes_nothing_and_lets_the_next_one_in():
    async def main():
        b = BodyBudget(100)
        holder = Lease(b)
        assert await holder.take(80, 0)
        big = asyncio.ensure_future(Lease(b).take(90, 0.05))  # head of the queue, never fits
        small = Lease(b)
        small_wait = asyncio.ensure_future(small.take(20, 5))  # fits, but behind the head
        assert await big is False
        assert await small_wait and b.held == 100
        holder.close()
        small.close()
        assert b.held == 0 and not b._waiters
    run(main())


def test_a_cancelled_waiter_gives_back_bytes_granted_in_the_same_iteration():
    async def main():
        b = BodyBudget(100)
        holder = Lease(b)
        assert await holder.take(100, 0)
        lease = Lease(b)
        task = asyncio.ensure_future(lease.take(30, 5))
        await asyncio.sleep(0.01)
        holder.close()   # grants the waiter its 30 bytes...
        assert b.held == 30
        task.cancel()    # ...and it is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await task
        assert b.held == 0 and lease.held == 0 and not b._waiters

        holder = Lease(b)
        assert await holder.take(100, 0)
        task = asyncio.ensure_future(Lease(b).take(30, 5))
        await asyncio.sleep(0.01)
        task.cancel()    # cancelled while waiting, nothing granted
        with pytest.raises(asyncio.CancelledError):
            await task
        holder.close()
        assert b.held == 0 and not b._waiters
    run(main())


def test_the_default_is_derived_from_the_body_size_and_the_ingest_concurrency():
    assert Settings().body_budget_bytes == 2 * 16 * 2**20
    assert Settings(ingest_concurrency=1).body_budget_bytes == 16 * 2**20
    assert Settings(max_body_bytes=4 * 2**20, ingest_concurrency=8).body_budget_bytes == 8 * 2**20
    assert Settings(max_body_bytes_in_flight=100 * 2**20).body_budget_bytes == 100 * 2**20
    assert Settings(max_body_bytes_in_flight=4096).body_budget_bytes == 16 * 2**20  # the largest body fits
