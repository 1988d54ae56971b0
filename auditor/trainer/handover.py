"""The training thread's side of :class:`~auditor.trainer.client.AuditorClient`: the hand-over.

:meth:`HandOver.report` appends a finished wire dict to the client's in-memory queue;
:meth:`HandOver.report_deferred` copies a device payload into a ring slot
(:mod:`auditor.trainer.deferred`) and queues it for the sender or spill thread to build.
Neither reads a tensor value, waits on I/O, nor raises: a full ring or queue (or a closed
client) drops the report, counted in ``stats["reports_dropped"]`` and said once per
condition, and remembered per (run, statistic) (:class:`Gaps`): the next report of that
series the client delivers carries the count and the steps (wire field ``dropped``), so the
service shows that the run's audit has gaps. The threads that empty the queue live in
:mod:`auditor.trainer.client`.
"""

from __future__ import annotations

import logging

from auditor.trainer.deferred import Deferred
from auditor.trainer.settings import warn_once

log = logging.getLogger("auditor.client")

#: Series (run, statistic) whose drops a client remembers at once; drops of further series
#: are counted in ``stats`` only (said once).
GAPS_MAX = 4096


class Gaps:
    """Reports dropped at hand-over not yet told to the service, per (run_id, statistic):
    ``[count, first_step, last_step]``. :meth:`add` runs on the training thread (only when
    a report is dropped), :meth:`attach` on a background thread; the caller holds the
    client's lock for both."""

    def __init__(self) -> None:
        self.pending: dict[tuple[str, str], list[int]] = {}

    def add(self, about) -> bool:
        """Remember one dropped report (``about``: its wire dict, or what the hook knew of it:
        ``run_id``, ``statistic``, ``step``). False when it cannot be told (no such keys, or
        :data:`GAPS_MAX` series pending already)."""
        if not isinstance(about, dict):
            return False
        key, step = (about.get("run_id"), about.get("statistic")), about.get("step")
        if not (isinstance(key[0], str) and isinstance(key[1], str) and type(step) is int):
            return False
        gap = self.pending.get(key)
        if gap is None:
            if len(self.pending) >= GAPS_MAX:
                return False
            self.pending[key] = [1, step, step]
        else:
            gap[0] += 1
            gap[1], gap[2] = min(gap[1], step), max(gap[2], step)
        return True

    def attach(self, report: dict) -> dict:
        """``report``, with the drops pending for its series as its ``dropped`` field (a
        new dict; they are no longer pending), or itself when none are."""
        gap = self.pending.pop((report.get("run_id"), report.get("statistic")), None)
        if gap is None:
            return report
        told = report.get("dropped")  # a report that already carries drops (an import, a re-send) adds them
        if isinstance(told, dict) and all(type(told.get(k)) is int for k in ("count", "first_step", "last_step")):
            gap = [gap[0] + told["count"], min(gap[1], told["first_step"]), max(gap[2], told["last_step"])]
        return {**report, "dropped": {"count": gap[0], "first_step": gap[1], "last_step": gap[2]}}


class HandOver:
    """The client's caller-side methods; :class:`~auditor.trainer.client.AuditorClient`
    sets up the state they share with its threads (queue, ring, lock, counters, events)."""

    def report(self, report: dict) -> None:
        """Enqueue one report (a wire-contract dict). Never blocks on I/O, never raises.
        Anything but a dict is counted ``dropped`` (and said once)."""
        try:
            if not isinstance(report, dict):
                with self._lock:
                    self.stats["dropped"] += 1
                warn_once(f"report-type-{id(self)}", "auditor client: report() takes a dict (a wire report), got "
                          "%s; dropped (counted in stats['dropped'])", type(report).__name__)
                return
            self._enqueue(report)
        except Exception:  # noqa: BLE001 - the training step must never see a client error
            pass

    def report_deferred(self, payload, finish, about: dict | None = None) -> None:
        """Enqueue one report whose numbers are still on the device; never reads them, never
        blocks, never raises.

        ``payload``: 1-D float64 tensor of at most :data:`auditor.trainer.deferred.WIDTH`
        values, on any device; it is copied now (non-blocking on CUDA, into a pinned ring
        slot with an event recorded after the copy). ``finish(values)``: called later on
        the sender or spill thread with the payload's values as a list of floats; returns
        the wire dict (or None: nothing is sent, counted ``dropped``). With every ring slot
        taken the report is dropped and counted in ``reports_dropped`` (logged once).
        ``about``: the report's ``run_id``, ``statistic`` and ``step`` (a dict holding them,
        e.g. the body ``finish`` completes): a dropped report is then told to the service
        with the next report of its series (wire field ``dropped``).
        """
        try:
            if self._closed or len(self._queue) >= self.max_queue:  # before copying anything
                self._drop_at_handover("closed" if self._closed else "queue", about)
                return
            handle = self._ring.put(payload)
            if handle is None:
                self._drop_at_handover("ring", about)
                return
            if not self._enqueue(Deferred(self._ring, handle, finish, about)):
                self._ring.release(handle)  # closed or filled meanwhile: the slot is free again
            elif self._ring.in_use >= self._ring_half and not self._wake.is_set():
                self._wake.set()  # the sender reads the slots before the ring fills
        except Exception as exc:  # noqa: BLE001 - the training step must never see a client error
            with self._lock:
                self.stats["dropped"] += 1
            warn_once(f"report-deferred-{id(self)}-{type(exc).__name__}", "auditor client: a deferred report could "
                      "not be handed over (%s: %s); dropped (counted in stats['dropped'])", type(exc).__name__, exc)

    def _enqueue(self, item) -> bool:
        """Queue ``item`` (a dict or a :class:`~auditor.trainer.deferred.Deferred`), or drop
        and count it when the client is closed or the queue full. Returns whether queued."""
        with self._lock:
            if self._closed or len(self._queue) >= self.max_queue:
                reason = "closed" if self._closed else "queue"
            else:
                reason = None
                self._queue.append(item)
                self._accepted += 1
                self.stats["enqueued"] += 1
                n = len(self._queue)
        if reason is not None:
            self._drop_at_handover(reason, item.about if isinstance(item, Deferred) else item)
            return False
        if n >= self._wake_at:
            if not self._wake.is_set():
                self._wake.set()
            if n >= self._high_water and not self._spill_wake.is_set():
                self._spill_wake.set()
        if self._ring.in_use >= self._ring_spill and not self._spill_wake.is_set():
            self._spill_wake.set()  # the sender is not keeping up (or is stuck): read slots to the spool
        return True

    def _drop_at_handover(self, reason: str, about=None) -> None:
        """Count one report refused by ``report``/``report_deferred`` (``reason``: ``ring``,
        ``queue`` or ``closed``) and remember it for its series (:class:`Gaps`; ``about``:
        the report or what is known of it); the first drop of each reason is logged, not the next."""
        with self._lock:
            self.stats["dropped"] += 1
            self.stats["reports_dropped"] += 1
            told = reason != "closed" and self._gaps.add(about)  # after close nothing is delivered
        if not told and reason != "closed" and "untold" not in self._said:
            self._said.add("untold")
            log.warning("auditor client: a dropped report cannot be told to the service (it names no run, "
                        "statistic and step, or %d series have drops pending); counted in stats only", GAPS_MAX)
        if reason not in self._said:
            self._said.add(reason)
            why = {"ring": f"all {self._ring.size} ring slots hold reports the sender has not read yet (ring_size)",
                   "queue": f"the queue is full (max_queue={self.max_queue}: the service is down or slow and the "
                            "spool cannot keep up, or spooling is off)",
                   "closed": "the client is closed"}[reason]
            log.warning("auditor client: dropping reports: %s; counted in stats['reports_dropped'] (the steps "
                        "they belong to stay incomplete on the service); said once", why)
