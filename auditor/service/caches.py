"""The caches of a service process (runs, series, the reports of open steps) and the
proofs that each answers only what the database would."""

from __future__ import annotations

import itertools
import operator
import threading
from typing import Iterable, Sequence

import sqlalchemy as sa

from auditor.db.store import Store
from auditor.service.errors import StaleCaches
from auditor.service.model import SeriesInfo, Topology

#: The reports of open steps an ingesting process keeps (:class:`OpenStepRows`), in rows.
OPEN_STEP_ROWS = 65_536
#: A row's place in its step: (microbatch, rank), the key order of the rows in hand.
_IN_STEP = operator.itemgetter(2, 3)
#: A row's step: (series_id, step).
_STEP_KEY = operator.itemgetter(0, 1)


def by_step(rows: Iterable[tuple]) -> dict[tuple[int, int], list[tuple]]:
    """``reports`` rows in key order, grouped by (series_id, step)."""
    return {sk: list(g) for sk, g in itertools.groupby(rows, _STEP_KEY)}


class OpenStepRows:
    """The ``reports`` rows (:data:`auditor.db.store.COLUMNS` order, as
    :meth:`auditor.db.store.Store.report_rows` returns them) this process stored for steps
    still open, so the batch completing a step audits them with the rows in hand instead
    of reading them back (~20 % of server CPU at 1,024 ranks per step in batches of 1,000;
    several ms of verdict latency on PostgreSQL). Keyed by ``(series_id, step)``, each
    entry tagged with its run's incarnation ``(run_id, created_at)``.

    Why the rows given by :meth:`rows` are every stored report of the step. An entry only
    ever holds rows that a committed transaction of this process inserted (:meth:`grow`
    runs after the commit; a rolled-back batch leaves nothing), each key once (a key is
    inserted once; re-sends are duplicates, neither inserted nor counted). The step row's
    ``received`` counts every report any transaction of any process inserted
    (:meth:`auditor.db.store.Store.count_arrivals` adds the inserted keys only). So when
    the completing transaction finds ``len(entry) + inserted == received`` (its step row
    after its own upsert, which serialises the step's writers), the entry and the rows in
    hand are disjoint subsets of the step's reports whose sizes add up to all of them:
    they are all of them, and no replica or other worker stored one. Anything else (a
    report stored elsewhere, an entry evicted or started late by a thread that committed
    out of order) fails the count and the step is read back as before. The tag must
    equal the run's ``created_at`` this transaction verified (:class:`auditor.service.errors.StaleCaches`) or
    read, so a run deleted and created anew, or a series id SQLite hands to a new series,
    never meets the old run's rows; :meth:`Caches.forget` (``delete_run`` in this
    process) and the stale-cache retry drop entries too. Not covered: reports deleted
    while the run lives — only ``delete_run`` deletes reports (``delete_rank_range``,
    ``delete_steps``), and what a concurrent ingest audits of a run being deleted is
    deleted with it.

    Bounded: at most ``max_rows`` rows in all (a row of a 1,024-rank step is 0.29-0.39 kB
    as Python objects, measured with tracemalloc, so 65,536 rows ≈ 25 MB), the oldest
    entries (by their first rows) evicted first;
    an evicted step is read back. Thread-safe: one lock around the map, no I/O under it."""

    def __init__(self, max_rows: int = OPEN_STEP_ROWS):
        self.max_rows = max_rows
        self._lock = threading.Lock()
        self._steps: dict[tuple[int, int], tuple[tuple[str, float], list[tuple]]] = {}
        self._total = 0

    def __len__(self) -> int:
        """The number of rows held."""
        return self._total

    def rows(self, key: tuple[int, int], tag: tuple[str, float], in_hand: list[tuple],
             received: int) -> list[tuple] | None:
        """Every report of step ``key`` = (series_id, step) as ``reports`` rows in key order,
        ``in_hand`` (the rows this transaction inserted) included, when the entry's tag is
        ``tag`` and its rows plus ``in_hand`` are ``received`` (the step row's count);
        None otherwise (the caller reads the step back)."""
        with self._lock:
            got = self._steps.get(key)
            if got is None or got[0] != tag or len(got[1]) + len(in_hand) != received:
                return None
            out = got[1] + in_hand
        out.sort(key=_IN_STEP)  # two sorted runs: one merge
        return out

    def update(self, grown: Sequence[tuple[tuple[int, int], tuple[str, float], list[tuple], int]],
               done: Sequence[tuple[int, int]]) -> None:
        """After a commit: drop the entries of the steps in ``done`` (audited complete) and
        add each ``(key, tag, rows, received)`` of ``grown`` (rows this transaction inserted
        into a step left incomplete, ``received`` its step row's count) to its entry when
        the entry then holds all ``received`` reports (else the entry goes: it could not
        pass :meth:`rows`); evict the oldest entries beyond ``max_rows``."""
        with self._lock:
            steps = self._steps
            for key in done:
                got = steps.pop(key, None)
                if got is not None:
                    self._total -= len(got[1])
            for key, tag, rows, received in grown:
                got = steps.get(key)
                if got is not None and got[0] == tag and len(got[1]) + len(rows) == received:
                    got[1].extend(rows)
                    self._total += len(rows)
                    continue
                if got is not None:
                    del steps[key]
                    self._total -= len(got[1])
                if len(rows) == received and received <= self.max_rows:
                    steps[key] = (tag, list(rows))
                    self._total += received
            while self._total > self.max_rows:
                self._total -= len(steps.pop(next(iter(steps)))[1])  # the oldest entry

    def forget(self, run_id: str) -> None:
        """Drop the entries of every incarnation of ``run_id``."""
        with self._lock:
            for key in [k for k, (tag, _) in self._steps.items() if tag[0] == run_id]:
                self._total -= len(self._steps.pop(key)[1])

    def clear(self) -> None:
        with self._lock:
            self._steps.clear()
            self._total = 0


class Caches:
    """The caches of one process, of what does not change once stored: a run's topology and
    created_at, a series' id, kind and spec — for as long as the run is not deleted — and
    the reports of open steps (:class:`OpenStepRows`).

    Why a cached entry is never used for a run deleted meanwhile. Another process (replica,
    worker, ``auditor runs delete``, retention) can delete a run and create it anew, and
    SQLite then hands the deleted series' ids to new series, so each ingest first checks, in
    its transaction, that every cached run it relies on is still the one cached (its
    ``created_at``: :meth:`check`), and then holds its series rows until it commits
    (:meth:`auditor.db.store.Store.lock_series`). A series cached for a checked run may
    answer (:meth:`auditor.service.ingest.Ingest.ensure_series` with ``use_cache``). What a
    transaction learns enters the caches only after its commit (:meth:`after_commit`).
    Thread-safe for the flows' use: dict updates are atomic, and a stale read fails
    :meth:`check` and is retried with the caches dropped."""

    def __init__(self, open_step_rows: int = OPEN_STEP_ROWS):
        self.runs: dict[str, tuple[Topology, float]] = {}  # run_id: (topology, created_at)
        self.series: dict[tuple[str, str], SeriesInfo] = {}
        #: the workload label a committed transaction gave or read per run (valid while the run is)
        self.workloads: dict[str, str] = {}
        #: reports this process stored of open steps (``open_step_rows`` rows at most; 0: none)
        self.open = OpenStepRows(open_step_rows)

    def check(self, store: Store, conn: sa.Connection, run_ids: Iterable[str]) -> dict[str, tuple[Topology, float]]:
        """The cached runs of ``run_ids``, each verified in this transaction to be the one
        cached (its ``created_at``); raises :class:`StaleCaches` if one is not (before
        anything relies on them)."""
        cached = {rid: c for rid in set(run_ids) if (c := self.runs.get(rid)) is not None}
        if cached:
            stored_at = store.runs_created_at(conn, cached)
            if any(stored_at.get(rid) != c[1] for rid, c in cached.items()):
                raise StaleCaches()
        return cached

    def after_commit(self, grown: Sequence[tuple[tuple[int, int], tuple[str, float], list[tuple], int]],
                     done: Sequence[tuple[int, int]], new_runs: dict[str, tuple[Topology, float | None, int]],
                     new_series: dict[tuple[str, str], SeriesInfo]) -> None:
        """What a committed ingest learned: the rows of the steps it left open
        (:meth:`OpenStepRows.update`), the runs and series it created or read."""
        if grown or done:
            self.open.update(grown, done)
        self.runs.update({rid: (t, born) for rid, (t, born, _) in new_runs.items()})
        self.series.update(new_series)

    def clear(self) -> None:
        """Drop everything (a run was deleted under this process: the retry starts afresh)."""
        self.runs.clear()
        self.series.clear()
        self.workloads.clear()
        self.open.clear()

    def forget(self, run_id: str) -> None:
        """Drop what is cached of ``run_id`` (deleted by this process)."""
        self.runs.pop(run_id, None)
        self.workloads.pop(run_id, None)
        self.open.forget(run_id)
        for key in [k for k in self.series if k[0] == run_id]:
            self.series.pop(key, None)
