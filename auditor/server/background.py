"""What the service does besides answering requests: the sweep (missing reports, late steps,
run retention) and the database probe of ``/readyz``, started and stopped by the app's
lifespan, and the collector tuning of a service process."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time

import anyio
from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool

from auditor.config import Settings
from auditor.db.errors import is_unavailable, probe, storage_failure
from auditor.server.limits import throttled
from auditor.server.state import AppState
from auditor.service import NotFound

log = logging.getLogger("auditor.api")


def lifespan(settings: Settings):
    """The app's lifespan: an :class:`AppState` as ``app.state.svc`` (which migrates an empty
    database to head and refuses one at another revision), the collector tuned
    (:func:`tune_gc`), the sweep and the probe running until shutdown, then stopped
    (:func:`_stop`) and the engine disposed of."""

    @contextlib.asynccontextmanager
    async def run(app: FastAPI):
        svc = AppState(settings)
        app.state.svc = svc
        tune_gc()
        tasks = [asyncio.create_task(_sweep_forever(svc)), asyncio.create_task(_probe_forever(svc))]
        try:
            yield
        finally:
            await _stop(tasks, settings.shutdown_timeout_seconds)
            svc.close()

    return run


#: Cyclic-GC thresholds of a service process. Validating and storing a batch allocates
#: ~10 objects per report that live until the transaction ends; with the default (700, 10,
#: 10) they are promoted and full collections walk the whole heap again and again (35% of
#: the ingest CPU in the profile, docs/performance.md). The ingest path makes few reference
#: cycles; they are still collected, only later.
GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc() -> None:
    """Move everything allocated at start-up (modules, SQLAlchemy, pydantic schemas) out of
    the collector's reach (``gc.freeze``) and raise the thresholds to :data:`GC_THRESHOLDS`."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def _sweep_forever(svc: AppState) -> None:
    """Every ``sweep_interval_seconds``: one bounded sweep round, then (with
    ``run_retention_days``) the deletion of a few idle runs, in bounded chunks."""
    st = svc.settings
    while True:
        await asyncio.sleep(st.sweep_interval_seconds)
        try:
            n = await run_in_threadpool(svc.service.sweep, st.grace_seconds, None, st.sweep_max_steps,
                                        st.sweep_max_seconds)
            if n:
                log.info("sweep audited %d step(s)", n)
            if st.run_retention_days > 0:
                for run_id in await run_in_threadpool(svc.service.idle_runs, st.run_retention_days * 86400.0, None, 5):
                    counts = await run_in_threadpool(svc.service.delete_run, run_id, st.delete_chunk_rows)
                    log.info("retention: deleted run %s idle for over %s days: %s", run_id,
                             st.run_retention_days, counts)
        except NotFound:
            pass  # a run deleted by another replica meanwhile
        except Exception as exc:  # keep sweeping; the next round retries
            if svc.write_failed(exc):
                throttled.warning("sweep-storage", "sweep: the database cannot store writes (%s); retrying next round",
                                  storage_failure(exc))
            elif is_unavailable(exc):
                throttled.warning("sweep-db", "sweep: database unavailable or busy (%s); retrying next round",
                                  type(exc).__name__)
            else:
                log.exception("sweep failed")


#: Name prefix of the thread of a database probe (:func:`_probe_forever`); at most one per
#: service is alive. The full name adds the database's name (:func:`probe_thread_name`).
PROBE_THREAD = "auditor-db-probe"


def probe_thread_name(database: str | None) -> str:
    """``"auditor-db-probe <database>"``: the name of the probe threads of a service on the
    database named ``database`` (a thread dump tells one service's probes from another's)."""
    return f"{PROBE_THREAD} {database}"


async def _probe_forever(svc: AppState) -> None:
    """Probe the database every ``probe_interval_seconds``, for ``/readyz`` and ``/healthz``,
    in a thread of its own named :data:`PROBE_THREAD` (not a request thread). A probe
    without an answer after ``probe_timeout_seconds`` counts as a failure and is abandoned;
    while its thread is still waiting on the database, no new probe starts (each period
    reports how long it has been waiting), so a hung database holds one probe thread and
    one pooled connection, not one more every period.

    Not ``asyncio.wait_for``: up to Python 3.11 it swallows a cancellation that arrives as
    the awaited future completes, and this loop then never ended: the lifespan shutdown
    waited for it forever (``auditor serve`` on a taken port hung, deaf to SIGTERM)."""
    loop = asyncio.get_running_loop()
    every, timeout = svc.settings.probe_interval_seconds, svc.settings.probe_timeout_seconds
    thread: threading.Thread | None = None
    started = 0.0
    while True:
        if thread is not None and thread.is_alive():
            waited = time.monotonic() - started
            svc.database = (False, f"TimeoutError: the database probe has been waiting {waited:.0f} s for an "
                                   "answer", time.monotonic())
        else:
            answer = loop.create_future()
            started = time.monotonic()
            write = svc.write_failure is not None
            thread = threading.Thread(target=_probe_in_thread, args=(svc.engine, loop, answer, write),
                                      name=probe_thread_name(svc.engine.url.database), daemon=True)
            thread.start()
            try:
                with anyio.fail_after(timeout):
                    ok, message, failed = await asyncio.shield(answer)
                svc.database = (ok, message, time.monotonic())
                if write and ok:
                    if failed is None:
                        svc.wrote()
                    else:
                        svc.write_failed(failed)
            except TimeoutError:
                svc.database = (False, f"TimeoutError: the database did not answer the probe within {timeout:g} s",
                                time.monotonic())
        await asyncio.sleep(every)


def _probe_in_thread(engine, loop: asyncio.AbstractEventLoop, answer: asyncio.Future, write: bool) -> None:
    """One probe (in :data:`PROBE_THREAD`): :func:`auditor.db.errors.probe`'s ``(ok, message,
    write error)`` handed to ``answer`` on ``loop`` (with ``write``, writes have been failing:
    it also tries one)."""
    result = probe(engine, write)
    with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped meanwhile
        loop.call_soon_threadsafe(_settle, answer, result)


def _settle(answer: asyncio.Future, result: tuple) -> None:
    if not answer.done():
        answer.set_result(result)


async def _stop(tasks: list[asyncio.Task], timeout: float) -> None:
    """Cancel the background tasks and wait at most ``timeout`` s for them (a sweep round
    in its thread finishes first): the shutdown never waits on a task forever."""
    for t in tasks:
        t.cancel()
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in pending:
        log.warning("background task %s did not stop within %.0f s of the shutdown; leaving it",
                    t.get_coro().__name__, timeout)
