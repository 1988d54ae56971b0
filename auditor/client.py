"""Trainer-side client: queue reports in memory, deliver them in batches from a daemon thread.

``AuditorClient.report`` is called inside the training step, so it only appends to a
bounded in-memory queue: no I/O, no lock held while anything slow happens, no exception.
A background thread drains the queue in batches of ``batch_size`` and POSTs
``{"reports": [...]}`` to ``{url}/v1/reports`` (wire contract v1, DESIGN.md §3).

Delivery outcome of every report is exactly one of: ``sent`` (stored or an identical
re-send), ``rejected`` (the service refused it: 409 conflicts, other 4xx) or ``dropped``
(the queue was full, or the client closed before it could be delivered). Transient
failures (connection errors, timeouts, 5xx, 429) are retried with capped exponential
backoff and full jitter, honouring ``Retry-After``; they are counted in ``retries``.

Reports the client gives up on pass through :meth:`AuditorClient._give_up`, the single
place where an on-disk spool can take them over later.
"""

from __future__ import annotations

import atexit
import collections
import email.utils
import json
import logging
import math
import os
import random
import threading
import time
from typing import Any

import httpx

log = logging.getLogger("auditor.client")

#: Upper bound of one backoff sleep, seconds.
MAX_BACKOFF = 30.0
#: First backoff sleep, seconds; doubled on every consecutive transient failure.
BASE_BACKOFF = 0.1


class AuditorClient:
    """Batching, retrying HTTP client for ``POST /v1/reports``.

    Parameters
    ----------
    url:
        Base URL of the auditor service, e.g. ``http://127.0.0.1:8000``.
    batch_size:
        Most reports per request.
    flush_interval:
        Seconds the sender waits for a batch to fill before sending what it has.
    max_queue:
        Most reports held in memory; ``report`` drops (and counts) reports beyond it.
    timeout:
        Per-request HTTP timeout, seconds.
    token:
        Bearer token sent as ``Authorization: Bearer <token>`` if given.

    Attributes
    ----------
    stats:
        Counters ``enqueued``, ``sent``, ``rejected``, ``dropped``, ``retries`` (reports,
        except ``retries``: failed requests that were retried).
    """

    def __init__(
        self,
        url: str,
        *,
        batch_size: int = 1000,
        flush_interval: float = 0.2,
        max_queue: int = 1_000_000,
        timeout: float = 5.0,
        token: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.max_queue = max_queue
        self.stats: dict[str, int] = dict.fromkeys(("enqueued", "sent", "rejected", "dropped", "retries"), 0)
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(timeout=timeout, headers=headers)
        self._queue: collections.deque[dict] = collections.deque()
        self._lock = threading.Lock()  # guards stats and the settled counter; never held across I/O
        self._settled_cond = threading.Condition(self._lock)
        self._accepted = 0  # reports ever accepted into the queue
        self._settled = 0  # of those, reports whose outcome is final (sent/rejected/dropped)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="auditor-client", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # ------------------------------------------------------------------ caller side

    def report(self, report: dict) -> None:
        """Enqueue one report (a wire-contract dict). Never blocks on I/O, never raises."""
        try:
            with self._lock:
                if self._closed or len(self._queue) >= self.max_queue:
                    self.stats["dropped"] += 1
                    return
                self._queue.append(report)
                self._accepted += 1
                self.stats["enqueued"] += 1
                full = len(self._queue) >= self.batch_size
            if full:
                self._wake.set()
        except Exception:  # noqa: BLE001 - the training step must never see a client error
            log.exception("auditor client: could not enqueue a report")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every report enqueued before this call has a final outcome.

        Returns ``True`` when all of them were sent, rejected or dropped (see ``stats``),
        ``False`` when ``timeout`` seconds passed first. ``None`` waits indefinitely (for as
        long as the service keeps failing transiently).
        """
        with self._lock:
            target = self._accepted
        self._wake.set()
        with self._settled_cond:
            return self._settled_cond.wait_for(lambda: self._settled >= target, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Flush for up to ``timeout`` seconds, then stop the sender.

        Reports still undelivered are given up (counted ``dropped``). Idempotent; also
        registered with :mod:`atexit`.
        """
        if self._closed:
            return
        atexit.unregister(self.close)
        if not self.flush(timeout):
            log.warning("auditor client: flush timed out after %.1fs; dropping undelivered reports", timeout)
        with self._lock:
            self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=max(timeout, 1.0))
        self._http.close()

    # ------------------------------------------------------------------ sender thread

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.flush_interval)
            self._wake.clear()
            while self._queue and not self._stop.is_set():
                batch = self._take(self.batch_size)
                try:
                    self._deliver(batch)
                except Exception:  # noqa: BLE001 - the sender must survive anything
                    log.exception("auditor client: unexpected error delivering %d reports", len(batch))
                    self._give_up(batch, "error")
        self._give_up(self._take(len(self._queue)), "closed")

    def _take(self, n: int) -> list[dict]:
        batch = []
        while self._queue and len(batch) < n:
            batch.append(self._queue.popleft())
        return batch

    def _deliver(self, batch: list[dict]) -> None:
        """POST ``batch`` until every report in it has a final outcome or the client stops."""
        failures = 0
        while batch:
            if self._stop.is_set():
                self._give_up(batch, "closed")
                return
            delay = self._post(batch)
            if isinstance(delay, list):
                batch = delay
                failures = 0
                continue
            if delay is None:
                return
            failures += 1
            with self._lock:
                self.stats["retries"] += 1
            self._stop.wait(max(delay, _backoff(failures)))

    def _post(self, batch: list[dict]) -> list[dict] | float | None:
        """Send one request. Returns ``None`` when the batch is settled, a list of reports
        to resend at once (after 409), or a float: retry after at least that many seconds."""
        try:
            body = json.dumps({"reports": batch}).encode()  # NaN/Infinity tokens allowed
            response = self._http.post(f"{self.url}/v1/reports", content=body)
        except httpx.TransportError as exc:
            log.warning("auditor client: %s: %s", type(exc).__name__, exc)
            return 0.0
        status = response.status_code
        if status < 300:
            self._settle(len(batch), "sent")
            return None
        if status == 429 or status >= 500:
            log.warning("auditor client: HTTP %d, will retry %d reports", status, len(batch))
            return _retry_after(response)
        if status == 409:
            rest = self._drop_conflicts(batch, response)
            if rest is not None:
                return rest
        log.warning("auditor client: HTTP %d rejected %d reports: %s", status, len(batch), response.text[:500])
        self._settle(len(batch), "rejected")
        return None

    def _drop_conflicts(self, batch: list[dict], response: httpx.Response) -> list[dict] | None:
        """Remove the reports a 409 names from ``batch``; return the rest to resend.

        ``None`` when the response does not name valid indices (the whole batch is then
        rejected, so a malformed 409 cannot loop forever).
        """
        try:
            detail = response.json()["detail"]
            bad = {int(c["index"]) for c in detail["conflicts"]}
        except (ValueError, KeyError, TypeError):
            return None
        if not bad or not bad <= set(range(len(batch))):
            return None
        log.warning(
            "auditor client: %s: %s (%d of %d reports rejected)",
            detail.get("error"), detail.get("message"), len(bad), len(batch),
        )
        self._settle(len(bad), "rejected")
        return [r for i, r in enumerate(batch) if i not in bad]

    def _give_up(self, batch: list[dict], reason: str) -> None:
        """Final outcome for reports the client cannot deliver (future spool hook)."""
        if batch:
            log.warning("auditor client: dropping %d reports (%s)", len(batch), reason)
            self._settle(len(batch), "dropped")

    def _settle(self, n: int, outcome: str) -> None:
        with self._settled_cond:
            self.stats[outcome] += n
            self._settled += n
            self._settled_cond.notify_all()


def _backoff(failures: int) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(MAX, BASE·2^(failures−1))]."""
    return random.uniform(0.0, min(MAX_BACKOFF, BASE_BACKOFF * 2.0 ** (failures - 1)))


def _retry_after(response: httpx.Response) -> float:
    """Seconds from a ``Retry-After`` header (delta-seconds or HTTP date), capped; 0 if absent."""
    value = response.headers.get("Retry-After")
    if not value:
        return 0.0
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return 0.0
    return min(max(seconds, 0.0), MAX_BACKOFF) if math.isfinite(seconds) else 0.0


def client_from_env(**kwargs: Any) -> AuditorClient | None:
    """An :class:`AuditorClient` for ``$AUDITOR_URL`` (token ``$AUDITOR_TOKEN``), or ``None``
    when ``AUDITOR_URL`` is unset or empty. ``kwargs`` go to the constructor."""
    url = os.environ.get("AUDITOR_URL")
    if not url:
        return None
    return AuditorClient(url, token=os.environ.get("AUDITOR_TOKEN") or None, **kwargs)
