"""The lifecycle of stored steps and runs: the sweep (steps still incomplete after the
grace period, and re-audits left over), deletion in bounded transactions, idle runs for
retention."""

from __future__ import annotations

import time

from auditor.db.store import Arrival, Store
from auditor.service.caches import Caches
from auditor.service.errors import NotFound
from auditor.service.judge import Judge
from auditor.service.model import SeriesInfo, Topology


class Lifecycle:
    """Sweep, delete and retention of a :class:`auditor.service.Service`."""

    def __init__(self, store: Store, caches: Caches, judge: Judge):
        self.store, self.caches, self.judge = store, caches, judge

    def sweep(self, grace_seconds: float, now: float | None = None, limit: int = 1000,
              max_seconds: float | None = None) -> int:
        """One bounded sweep round; returns the number of steps it audited.

        Audits (a) steps still incomplete ``grace_seconds`` after their first report
        (``missing_report``) and (b) steps audited while incomplete that late reports have
        completed since, if the ingest that completed them did not (steps stored before
        revision 0003). At most ``limit`` steps, each in its own short write transaction (so
        ingest never waits behind a whole round), and no new step after ``max_seconds``. A
        step's cost is O(its reports + world_size + num_microbatches), never O(expected).
        Safe on every replica at once: each verdict is recorded exactly once.
        """
        now = time.time() if now is None else now
        t0 = time.monotonic()
        with self.store.read() as conn:
            due = [(*d, None) for d in self.store.due_steps(conn, now - grace_seconds, limit)]
            if len(due) < limit:
                due += self.store.reaudit_steps(conn, limit - len(due))
        audited = 0
        for series_id, step, expected, previous in due:
            if max_seconds is not None and time.monotonic() - t0 > max_seconds:
                break
            with self.store.write() as conn:
                found = self.store.series_by_id(conn, series_id)
                if found is None:
                    continue  # deleted meanwhile
                srow, run = found
                topo = Topology.of_row(run)
                if self.judge.audit_one(conn, SeriesInfo.of(srow), topo,
                                        Arrival(series_id, step, 0, expected, previous), now,
                                        previous=previous) is not None:
                    audited += 1
        return audited

    def delete_run(self, run_id: str, chunk_rows: int = 5000, max_chunks: int | None = None) -> dict | None:
        """Delete a run with its reports, verdicts and faults (``DELETE /v1/runs/{run_id}``,
        ``auditor runs delete``, retention), in transactions of at most ``chunk_rows``
        reports each (whole steps, or rank ranges of one larger step), so ingest and reads
        interleave and no transaction holds the write lock for long. Returns
        ``{"run_id", "reports", "steps", "statistics"}``, or None when ``max_chunks`` ran out
        first (call again to go on). Raises :class:`NotFound`. Reports arriving for the run
        meanwhile are deleted with it."""
        store = self.store
        with store.read() as conn:
            run = store.run(conn, run_id)
            if run is None:
                raise NotFound(run_id)
            sids = [s["id"] for s in store.series_rows(conn, run_id)]
        self.caches.forget(run_id)
        world = max(1, run.world_size)
        counts = {"run_id": run_id, "reports": 0, "steps": 0, "statistics": len(sids)}
        budget = [max_chunks]
        for sid in sids:
            if not self._delete_series(sid, world, chunk_rows, budget, counts):
                return None
        with store.write() as conn:
            store.delete_run_rows(conn, run_id, sids)
        self.caches.forget(run_id)
        return counts

    def _delete_series(self, sid: int, world: int, chunk_rows: int, budget: list[int | None],
                       counts: dict) -> bool:
        """Delete the steps of one series, a transaction of at most ``chunk_rows`` reports at
        a time (whole steps, or a range of ranks of one larger step), adding to ``counts``;
        False when ``budget[0]`` (transactions left; None: no bound) ran out first."""
        store = self.store
        while True:
            if budget[0] is not None:
                if budget[0] <= 0:
                    return False
                budget[0] -= 1
            with store.write() as conn:
                steps = store.first_steps(conn, sid, chunk_rows)
                if not steps:
                    return True
                first, received, expected = steps[0]
                last = first
                if received > chunk_rows:  # one large step: a range of ranks at a time
                    n = store.delete_rank_range(conn, sid, first, max(1, chunk_rows * world // max(expected, 1)))
                    if n is not None:
                        counts["reports"] += n
                        continue
                else:
                    total = 0
                    for step, k, _ in steps:
                        if total + k > chunk_rows:
                            break
                        total, last = total + k, step
                n, m = store.delete_steps(conn, sid, first, last)
                counts["reports"] += n
                counts["steps"] += m

    def idle_runs(self, idle_seconds: float, now: float | None = None, limit: int = 10) -> list[str]:
        """Runs with no report for ``idle_seconds``, oldest first, at most ``limit``."""
        now = time.time() if now is None else now
        with self.store.read() as conn:
            return self.store.idle_runs(conn, now - idle_seconds, limit)
