"""Trainer-side client: enqueue reports in memory, deliver them from background threads.

The contract with the training loop
-----------------------------------
* :meth:`AuditorClient.report` only appends the report dict to an in-memory deque (a lock is
  taken for a few counter updates, never across I/O) and never raises. Median cost ≈ 1 µs
  (``benchmarks/client_overhead.py``). Do not mutate a dict after passing it in.
* Memory is bounded: at most ``max_queue`` reports are held. A *spill* thread moves reports
  from memory to an on-disk JSONL spool (:mod:`auditor.trainer.spool`, one file per rank and
  process, fsync'd every ``fsync_interval`` s) when the queue passes half of ``max_queue``,
  or once the service has been failing for ``spool_after`` s. Only if the queue is full
  *and* the spill cannot keep up (or spooling is disabled, or the disk fails) is a report
  dropped — and then counted in ``stats["dropped"]``, never silently.
* A *sender* thread POSTs batches of ``batch_size`` to ``{url}/v1/reports`` (wire contract v1,
  DESIGN.md §3): the spool's undelivered lines first, in file order, then memory, so
  reports reach the service in the order they were made (except a batch in flight when the
  process exits, which is appended to the spool after the ones spilled while it was in
  flight). Transient failures (connection errors, timeouts, 408/429/5xx, and 401/403/404,
  which are configuration errors the data must survive) are retried with capped exponential
  backoff and full jitter, honouring ``Retry-After``. 409/422 naming report indices reject
  just those reports and resend the rest; 413 splits the batch. Replays are safe because the
  service treats an identical re-send as a no-op.
* :meth:`flush` waits (bounded) until everything enqueued so far is sent or rejected;
  :meth:`close` (also run by :mod:`atexit`) flushes for at most ``flush_timeout`` s, then
  writes whatever is still undelivered to the spool and returns, without waiting for a
  request in flight — so a process exits within ``flush_timeout`` (plus a local disk
  write) even when the service is down or hangs. Undelivered spools are uploaded later
  with ``auditor import SPOOL...`` or audited offline with ``auditor audit SPOOL...``.
* Reports from the hooks (:mod:`auditor.trainer.hooks`) arrive through
  :meth:`AuditorClient.report_deferred`: their numbers still on the device, copied
  (non-blocking, on CUDA into pinned memory with an event) into a slot of a fixed ring of
  ``ring_size`` slots (:mod:`auditor.trainer.deferred`); the sender or spill thread reads the
  slot and builds the wire dict. The training thread reads no tensor value. A full ring
  (or queue) drops the report: counted in ``stats["reports_dropped"]`` and said once per
  condition, never a block.
* File-only mode: ``url="file:///some/dir"`` (or ``AUDITOR_URL=file:///some/dir``) makes the
  client write the spool only; ``flush`` then means "written to the spool".

Counters (``stats``): ``enqueued`` (accepted by ``report``), ``sent`` (stored by the service,
or an identical re-send), ``rejected`` (the service refused them: 409 conflicts, 422, other
4xx; or not JSON-serialisable), ``spooled`` (written to the spool file; a spooled report is
later also counted ``sent`` when replayed), ``replayed`` (of ``sent``: delivered from the
spool), ``dropped`` (lost: counted, logged), ``retries`` (failed requests that were retried),
``reports_dropped`` (of ``dropped``: refused at hand-over because the ring or the queue was
full, or the client closed — reports that never left the training thread).
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from auditor.trainer.deferred import RING_SIZE, Deferred, Ring
from auditor.trainer.delivery import CONFIGURATION_ERRORS, MAX_BACKOFF, Outcome, deliver, encode
from auditor.trainer.destination import destination, open_http
from auditor.trainer.handover import HandOver
from auditor.trainer.settings import read_settings, valid_number
from auditor.trainer.spool import Spool, append_lines, dead_letter_path, default_spool_dir, default_spool_name

log = logging.getLogger("auditor.client")

#: Reports encoded and written per spill iteration (bounds how long the spill holds the GIL).
SPILL_CHUNK = 500


class AuditorClient(HandOver):
    """Batching, retrying, spooling client for ``POST /v1/reports`` (see the module docstring).

    Parameters
    ----------
    url:
        Base URL of the service (``http://host:8000``), or ``file:///dir`` for file-only mode.
        Anything else (``notaurl``) is said once and gives file-only mode in the spool
        directory. Numbers that cannot work (``max_queue=0``, a negative timeout, not a
        number) are said once and replaced by their defaults: the client never raises.
    batch_size:
        Most reports per request.
    flush_interval:
        Seconds the sender waits for a batch to fill before sending what it has.
    max_queue:
        Most reports held in memory (≈3 KB each); beyond it ``report`` drops and counts.
    ring_size:
        Slots for reports whose numbers are still on the device
        (:meth:`report_deferred`; 128 bytes each, pinned on CUDA); beyond it those are
        dropped and counted (``reports_dropped``).
    workload:
        Label put on every report that names none (``AUDITOR_WORKLOAD``): runs of one
        workload at different layouts are compared (``GET /v1/workloads/{workload}``).
    timeout:
        Per-request HTTP timeout, seconds: one POST — connecting, sending, the whole answer
        (at most a few KiB read, :func:`auditor.trainer.delivery.answer_limit`) — ends within it.
    token:
        Bearer token sent as ``Authorization: Bearer <token>`` if given.
    spool_dir:
        Directory of the spool file (default :func:`default_spool_dir`); ``spool=False``
        disables spooling (undeliverable reports are then dropped and counted).
    spool_after:
        Seconds of consecutive delivery failures before memory is spilled to the spool.
    fsync_interval:
        Seconds between fsyncs of the spool while it is being written.
    flush_timeout:
        What :meth:`close` (and the atexit hook) waits for delivery at most, seconds.
    max_backoff:
        Upper bound of one retry sleep, seconds.
    rank:
        Used in the spool file name (default ``$RANK``).

    Examples
    --------
    File-only mode needs no service: reports go to ``<dir>/rank0-….jsonl`` for a later
    ``auditor import`` or ``auditor audit``.

    >>> import tempfile
    >>> from auditor import AuditorClient
    >>> client = AuditorClient("file://" + tempfile.mkdtemp(), rank=0)
    >>> client.report({"run_id": "doc", "statistic": "advantages", "step": 0, "rank": 0, "world_size": 1,
    ...                "local": {"count": 2.0, "sum": 1.0, "sum_sq": 0.5},
    ...                "applied": {"count": 2.0, "sum": 1.0, "sum_sq": 0.5}})
    >>> client.flush(timeout=10)
    True
    >>> client.close()
    >>> client.stats["spooled"], client.stats["dropped"]
    (1, 0)
    """

    def __init__(
        self,
        url: str,
        *,
        batch_size: int = 1000,
        flush_interval: float = 0.2,
        max_queue: int = 10_000,
        timeout: float = 5.0,
        token: str | None = None,
        spool_dir: str | os.PathLike | None = None,
        spool: bool = True,
        spool_after: float = 1.0,
        fsync_interval: float = 1.0,
        flush_timeout: float = 5.0,
        max_backoff: float = MAX_BACKOFF,
        rank: int | str | None = None,
        ring_size: int = RING_SIZE,
        workload: str | None = None,
    ) -> None:
        (batch_size, flush_interval, max_queue, timeout, spool_after, fsync_interval, flush_timeout, max_backoff,
         ring_size) = _valid_numbers(batch_size, flush_interval, max_queue, timeout, spool_after, fsync_interval,
                                     flush_timeout, max_backoff, ring_size)
        self.file_only, url, spool_dir, spool = destination(url, token, spool_dir, spool)
        self.url = url.rstrip("/")
        #: put on every report that names none (on the sender/spill thread: :meth:`_resolved`)
        self.workload = workload
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.max_queue = max_queue
        self.spool_after = spool_after
        self.fsync_interval = fsync_interval
        self.flush_timeout = flush_timeout
        self.max_backoff = max_backoff
        self._high_water = max(1, max_queue // 2)
        self._wake_at = min(batch_size, self._high_water)
        self.stats: dict[str, int] = dict.fromkeys(
            ("enqueued", "sent", "rejected", "spooled", "replayed", "dropped", "retries", "reports_dropped"), 0)
        self._ring = Ring(ring_size)
        self._ring_half = max(1, ring_size // 2)  # the sender is woken from here
        self._ring_spill = max(1, ring_size * 3 // 4)  # the spill thread reads slots from here
        self._said: set[str] = set()  # conditions of reports_dropped already logged
        self.spool: Spool | None = (
            Spool(Path(spool_dir or default_spool_dir()) / default_spool_name(rank),
                  None if self.file_only else self.url) if spool else None)
        self._http: httpx.Client | None = None if self.file_only else open_http(timeout, token)
        self._queue: collections.deque[dict] = collections.deque()
        self._lock = threading.Lock()  # guards counters, _inflight, _closed; never held across I/O
        self._settled_cond = threading.Condition(self._lock)
        self._accepted = 0  # reports ever accepted into the queue
        self._settled = 0  # of those, reports whose outcome is final
        self._inflight: list | None = None  # memory batch the sender is delivering (dicts or lines)
        self._down_since: float | None = None  # monotonic time of the first failure of a streak
        self._dead_logged = False
        self._rejected_logged = 0  # rejected reports said in the log so far
        self._wake = threading.Event()
        self._spill_wake = threading.Event()
        self._stop = threading.Event()
        self._closed = False
        self._threads = self._start_threads()
        atexit.register(self.close)

    def _start_threads(self) -> list[threading.Thread]:
        """Start the spill thread (when there is a spool) and the sender (unless file-only)."""
        threads = []
        if self.spool is not None:
            threads.append(threading.Thread(target=self._run_spill, name="auditor-spill", daemon=True))
        if not self.file_only:
            threads.append(threading.Thread(target=self._run_sender, name="auditor-sender", daemon=True))
        for t in threads:
            t.start()
        return threads

    # ------------------------------------------------ caller side: report, report_deferred (auditor.trainer.handover)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every report enqueued before this call has a final outcome.

        Final: sent, rejected or dropped (in file-only mode: written to the spool). A report
        spilled to the spool is final once it is replayed. Returns ``True`` when all are
        final, ``False`` when ``timeout`` seconds passed first (``None``: no limit).
        """
        if timeout is not None:  # NaN waited for ever, above threading.TIMEOUT_MAX raised OverflowError
            timeout = valid_number("timeout", timeout, self.flush_timeout, 0.0)
        with self._lock:
            target = self._accepted
        self._wake.set()
        self._spill_wake.set()
        with self._settled_cond:
            return self._settled_cond.wait_for(lambda: self._settled >= target, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flush for up to ``timeout`` (default ``flush_timeout``) seconds, then write what is
        still undelivered to the spool and stop. Does not wait for a request in flight.
        Idempotent; also registered with :mod:`atexit`."""
        if self._closed:
            return
        timeout = self.flush_timeout if timeout is None else valid_number("timeout", timeout, self.flush_timeout, 0.0)
        atexit.unregister(self.close)
        delivered = self.flush(timeout)
        self._stop.set()
        self._wake.set()
        self._spill_wake.set()
        for t in self._threads:
            if t.name == "auditor-spill":
                t.join(timeout=max(timeout, 1.0))  # local disk only: bounded
        with self._lock:
            self._closed = True
            leftover = list(self._inflight or []) + list(self._queue)
            self._inflight = None
            self._queue.clear()
        self._give_up(leftover, "closed")
        for t in self._threads:
            if t.name == "auditor-sender":
                t.join(timeout=0.2)  # it may be blocked in a request: it is a daemon, leave it
                if not t.is_alive() and self._http is not None:
                    self._http.close()
        if self.spool is not None:
            try:
                if self.file_only:
                    self.spool.close(remove_if_delivered=False)
                    log.info("auditor client: %d reports in %s", self.spool.lines_written, self.spool.path)
                elif not self.spool.close():
                    where = self.spool.path.parent  # the directory: `audit` of one rank's file calls the others crashed
                    log.warning(
                        "auditor client: undelivered reports remain in %s (%s); upload them with "
                        "`auditor import %s --url %s` or audit offline with `auditor audit %s`",
                        where, self.spool.path.name, where, self.url, where)
            except OSError as exc:
                log.error("auditor client: closing spool %s: %s", self.spool.path, exc)
        if self.stats["rejected"] > self._rejected_logged:
            log.warning("auditor client: %d reports rejected in total%s", self.stats["rejected"],
                        f" (in {dead_letter_path(self.spool.path)})" if self.spool is not None else "")
        if not delivered and self.stats["dropped"]:
            log.warning("auditor client: %d reports dropped in total", self.stats["dropped"])

    # ------------------------------------------------------------------ spill thread

    def _should_spill(self) -> bool:
        if self.file_only or len(self._queue) >= self._high_water or self._ring.in_use >= self._ring_spill:
            return True
        down = self._down_since
        return down is not None and time.monotonic() - down >= self.spool_after

    def _run_spill(self) -> None:
        last_sync = time.monotonic()
        while not self._stop.is_set():
            self._spill_wake.wait(min(self.fsync_interval, 0.05 if self.file_only else 0.2))
            self._spill_wake.clear()
            try:
                while self._queue and not self._stop.is_set() and self._should_spill():
                    with self._lock:
                        chunk = [self._queue.popleft() for _ in range(min(SPILL_CHUNK, len(self._queue)))]
                    self._give_up(chunk, "spill")
                if time.monotonic() - last_sync >= self.fsync_interval:
                    self.spool.sync()
                    last_sync = time.monotonic()
            except Exception:  # noqa: BLE001 - the spill must survive anything
                log.exception("auditor client: spill failed")

    def _give_up(self, items: list, reason: str) -> None:
        """The single place where reports the sender cannot deliver now go: the spool (or, if
        there is none or the disk fails, ``dropped``). ``items`` are dicts, deferred reports
        or encoded lines."""
        if not items:
            return
        lines, bad = [], 0
        for item in items:
            if isinstance(item, bytes):
                lines.append(item)
                continue
            item = self._resolved(item)
            if item is None:
                continue
            try:
                lines.append(encode(item))
            except (TypeError, ValueError):
                bad += 1
        if bad:
            log.error("auditor client: %d reports are not JSON-serialisable; rejected", bad)
            self._settle(bad, "rejected")
        if not lines:
            return
        if self.spool is not None:
            try:
                self.spool.append(lines)
                with self._settled_cond:
                    self.stats["spooled"] += len(lines)
                    if self.file_only or reason == "closed":
                        self._settled += len(lines)
                        self._settled_cond.notify_all()
                return
            except OSError as exc:
                log.error("auditor client: cannot write spool %s: %s", self.spool.path, exc)
        log.warning("auditor client: dropping %d reports (%s)", len(lines), reason)
        self._settle(len(lines), "dropped")

    def _resolved(self, item) -> dict | None:
        """``item`` as a wire dict: a deferred report is read from its ring slot and built
        here, on a background thread. One that cannot be built (or builds None) is logged,
        counted ``dropped`` and settled: None."""
        if not isinstance(item, Deferred):
            if self.workload is not None and isinstance(item, dict):
                item.setdefault("workload", self.workload)
            return item
        try:
            report, first = item.resolve()
        except Exception:  # noqa: BLE001 - a bad report must not stop the others
            log.exception("auditor client: could not build a deferred report; dropped")
            report, first = None, True
        if report is None and first:
            self._settle(1, "dropped")
        elif report is not None and self.workload is not None:
            report.setdefault("workload", self.workload)
        return report

    # ------------------------------------------------------------------ sender thread

    def _run_sender(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.flush_interval)
            self._wake.clear()
            while not self._stop.is_set():
                try:
                    if not self._send_one():
                        break
                except Exception:  # noqa: BLE001 - the sender must survive anything
                    log.exception("auditor client: unexpected error in the sender")
                    with self._lock:
                        batch, self._inflight = self._inflight, None
                    self._give_up(batch or [], "error")
                    self._stop.wait(1.0)

    def _send_one(self) -> bool:
        """Deliver one batch: from the spool if it holds undelivered lines, else from memory.
        Returns False when there was nothing to send."""
        spool = self.spool
        if spool is not None and spool.pending():
            lines, end = spool.read(self.batch_size)
            if lines:
                if self._deliver(lines, from_memory=False):
                    with self._lock:
                        self.stats["replayed"] += len(lines)
                    if not self._closed:
                        spool.commit(end)
                return True
            if end > spool._offset:  # only blank lines
                spool.commit(end)
                return True
        with self._lock:
            if not self._queue:
                return False
            batch = [self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))]
            self._inflight = batch
        lines = []
        for r in batch:
            r = self._resolved(r)
            if r is None:
                continue
            try:
                lines.append(encode(r))
            except (TypeError, ValueError):
                log.error("auditor client: report not JSON-serialisable; rejected: %r", r)
                self._settle(1, "rejected")
        with self._lock:
            if self._inflight is batch:
                self._inflight = lines
        self._deliver(lines, from_memory=True)
        return True

    def _deliver(self, lines: list[bytes], from_memory: bool) -> bool:
        """POST ``lines`` until each has a final outcome (True) or the client stops (False)."""
        def on_retry(out: Outcome, failures: int) -> None:
            if self._down_since is None:
                self._down_since = time.monotonic()
                what = ("the service refuses this client's configuration, check AUDITOR_URL and AUDITOR_TOKEN"
                        if out.status in CONFIGURATION_ERRORS else
                        f"{self.url} does not answer as an auditor service, check AUDITOR_URL" if out.foreign
                        else f"service at {self.url} unavailable")
                log.warning("auditor client: %s (%s); nothing of it counts as sent: retrying, spilling to %s after "
                            "%.1fs", what, out.message, self.spool.path.parent if self.spool else "nowhere",
                            self.spool_after)
            with self._lock:
                self.stats["retries"] += 1

        def on_answer() -> None:
            self._down_since = None

        def on_final(kind: str, chunk: list[bytes], pending: list, out: Outcome) -> None:
            if kind == "sent":
                self._settle(len(chunk), "sent", from_memory, pending)
                return
            refused = [line for i, line in enumerate(chunk) if i in out.rejected] if kind == "partial" else chunk
            self._dead_letter(refused, out.message)
            self._settle(len(refused), "rejected", from_memory, pending)

        return deliver(self._http, self.url, lines, on_final=on_final, on_retry=on_retry, on_answer=on_answer,
                       stopped=self._stop.is_set, wait=self._stop.wait, max_backoff=self.max_backoff)

    def _dead_letter(self, lines: list[bytes], reason: str) -> None:
        """Reports the service refused for good: appended to the dead-letter file next to
        the spool (its path logged the first time), so nothing is lost silently."""
        if self.spool is None:
            log.warning("auditor client: %d reports rejected: %s", len(lines), reason)
            self._rejected_logged += len(lines)
            return
        path = dead_letter_path(self.spool.path)
        try:
            append_lines(path, lines)
        except OSError as exc:
            log.error("auditor client: cannot write %s: %s", path, exc)
            return
        if not self._dead_logged:
            self._dead_logged = True
            self._rejected_logged = len(lines)
            log.warning("auditor client: %d reports rejected (%s); rejected reports go to %s (the total is said "
                        "at close)", len(lines), reason, path)

    def _settle(self, n: int, outcome: str, from_memory: bool = False, pending: list | None = None) -> None:
        with self._settled_cond:
            if from_memory:
                if self._closed:
                    return  # close() already took the in-flight batch over
                self._inflight = [line for c in pending for line in c] if pending else None
            self.stats[outcome] += n
            self._settled += n
            self._settled_cond.notify_all()


#: (name, default, minimum, integer) of each number :class:`AuditorClient` takes, in the order checked.
_NUMBERS = (("batch_size", 1000, 1, True), ("flush_interval", 0.2, 0.001, False), ("max_queue", 10_000, 1, True),
            ("timeout", 5.0, 0.001, False), ("spool_after", 1.0, 0.0, False), ("fsync_interval", 1.0, 0.001, False),
            ("flush_timeout", 5.0, 0.0, False), ("max_backoff", MAX_BACKOFF, 0.0, False),
            ("ring_size", RING_SIZE, 1, True))


def _valid_numbers(*values) -> list:
    """Each of :data:`_NUMBERS` as given, or its default (said once) where it cannot work."""
    return [valid_number(name, value, default, minimum, integer=integer)
            for (name, default, minimum, integer), value in zip(_NUMBERS, values, strict=True)]


def client_from_env(**kwargs: Any) -> AuditorClient | None:
    """An :class:`AuditorClient` configured from the environment
    (:mod:`auditor.trainer.settings`), or ``None`` when ``AUDITOR_URL`` is unset or empty.

    ``AUDITOR_URL`` (``http(s)://...`` or ``file:///dir``), ``AUDITOR_TOKEN``,
    ``AUDITOR_SPOOL_DIR``, ``AUDITOR_FLUSH_TIMEOUT`` (s), ``AUDITOR_MAX_QUEUE``; an invalid
    number is logged once and ignored (the default applies), a URL that is neither
    ``http(s)://`` nor ``file://`` makes a spool-only client (logged once). ``kwargs``
    override them.
    """
    settings = read_settings()
    if settings.url is None:
        return None
    conf: dict[str, Any] = {"token": settings.token, "workload": settings.workload}
    for key in ("flush_timeout", "max_queue"):
        value = getattr(settings, key)  # parsed (and a malformed value logged) once, here
        if value is not None:
            conf[key] = value
    return AuditorClient(settings.url, **{**conf, **kwargs})
