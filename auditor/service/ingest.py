"""Ingest: a validated batch stored in one transaction, and every step it completes audited
in it, as named stages over one :class:`Txn`; the races it can lose answered by one retry
table (:data:`RETRY`).

The stages of one attempt (:meth:`Ingest.attempt`), each relying on the proof it names:

1. :meth:`Caches.check <auditor.service.caches.Caches.check>` — the runs this process
   cached are still the ones cached (else :class:`StaleCaches`).
2. :meth:`Ingest.resolve_series` — each report's run and series, created unless they exist,
   checked against its topology, kind and spec (409s).
3. :meth:`Ingest.lock_series` — the series exist until the transaction ends
   (:meth:`auditor.db.store.Store.lock_series`).
4. :meth:`Ingest.rows_of` — ``reports`` rows in key order, placements and
   ``num_microbatches`` checked, duplicates within the batch counted.
5. :meth:`Ingest.store_rows` — one bulk insert, or row by row for a batch holding re-sends.
6. :meth:`Ingest.count_steps` — arrivals counted per step (its row lock serialises the
   step's writers: exactly one transaction sees it complete), the steps complete in hand
   (:meth:`auditor.service.judge.Judge.fresh_steps`) and the rows kept of open steps
   (:class:`auditor.service.caches.OpenStepRows`).
7. :meth:`auditor.service.judge.Judge.audit_steps` — verdicts recorded exactly once.
"""

from __future__ import annotations

import operator
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import sqlalchemy as sa

from auditor.core import DIMS, REPLACEABLE
from auditor.db.store import ReportsExist, RowDeleted, StepRowExists, Store, report_row
from auditor.contract.models import DEFAULT_SPECS, Report, RunRegistration, StatisticSpec
from auditor.service import dropped, errors
from auditor.service.caches import Caches, by_step
from auditor.service.errors import StaleCaches
from auditor.service.judge import Judge, _Due, _Fresh
from auditor.service.model import SeriesInfo, Topology

_get_workload = operator.attrgetter("workload")


@dataclass
class IngestOutcome:
    accepted: int = 0
    duplicates: int = 0
    audited: list[tuple[int, int, str]] = field(default_factory=list)  # (series_id, step, verdict)
    #: reports the trainers' clients dropped that this ingest counted (wire field ``dropped``,
    #: :mod:`auditor.service.dropped`): series_id -> (count, first_step, last_step)
    dropped: dict[int, tuple[int, int, int]] = field(default_factory=dict)


class Mode(NamedTuple):
    """How an attempt stores a batch."""

    #: audit the steps this transaction inserted every report of with the rows in hand, and
    #: insert their step rows with the verdict (:meth:`auditor.service.judge.Judge.fresh_steps`)
    in_hand: bool = True
    #: one bulk insert for an all-new batch (:meth:`auditor.db.store.Store.insert_all_new`)
    bulk: bool = True


#: The one retry table: what the exception of a failed attempt (its transaction rolled
#: back, nothing of it stored) makes the next attempt do. ``no_fresh_steps``: a step row
#: inserted with its verdict existed after all: no step completed in hand. ``row_by_row``:
#: the bulk insert met a stored report (a re-send): insert report by report.
#: ``drop_caches``: a run this process cached was deleted (and maybe created anew)
#: meanwhile: drop the caches and try again, at most :data:`ATTEMPTS` times, then
#: :class:`auditor.service.errors.Contended`. An integrity error (a cached run or series
#: deleted under a driver's constraint) is ``drop_caches`` on the first attempt only.
RETRY: dict[type[Exception], str] = {
    StepRowExists: "no_fresh_steps",
    ReportsExist: "row_by_row",
    StaleCaches: "drop_caches",
    RowDeleted: "drop_caches",
}
#: Attempts of an ingest or registration that meets concurrent deletions of its runs.
ATTEMPTS = 3


def retry_of(exc: BaseException, drops: int) -> str | None:
    """The :data:`RETRY` action for ``exc`` after ``drops`` cache drops in this mode; None: raise."""
    for kind, action in RETRY.items():
        if isinstance(exc, kind):
            return action
    return "drop_caches" if drops == 0 and is_integrity_error(exc) else None


def is_integrity_error(exc: BaseException) -> bool:
    """SQLAlchemy's IntegrityError, or the driver's (raised by the COPY fast path). Never
    raises: it runs in the error path of every ingest, where an exception of its own would
    replace the one being judged. psycopg's is looked up among the modules already imported
    (an exception of psycopg's exists only once psycopg.errors is), never imported here:
    ``import psycopg`` in this path, on a SQLite server under memory pressure, met a
    half-imported package and raised AttributeError (psycopg has no attribute errors),
    a 500 that hid the original error."""
    if isinstance(exc, sa.exc.IntegrityError):
        return True
    try:
        integrity = getattr(sys.modules.get("psycopg.errors"), "IntegrityError", None)
        return isinstance(integrity, type) and isinstance(exc, integrity)
    except Exception:  # noqa: BLE001 - a half-imported module: not an error of psycopg's
        return False


@dataclass
class Txn:
    """One attempt: its transaction, and what its stages learn for the next ones."""

    conn: sa.Connection
    now: float
    batch: Sequence[Report]
    mode: Mode
    #: the runs this process had cached, verified in this transaction: (topology, created_at)
    cached: dict[str, tuple[Topology, float]]
    out: IngestOutcome = field(default_factory=IngestOutcome)
    topo_of: dict[str, Topology] = field(default_factory=dict)
    series_of: dict[tuple[str, str], SeriesInfo] = field(default_factory=dict)
    #: runs created or read by this transaction: (topology, created_at, first index)
    new_runs: dict[str, tuple[Topology, float | None, int]] = field(default_factory=dict)
    new_series: dict[tuple[str, str], SeriesInfo] = field(default_factory=dict)
    rows: dict[tuple, tuple] = field(default_factory=dict)  # key: reports row
    index_of: dict[tuple, int] = field(default_factory=dict)  # key: index in the batch
    expected: dict[tuple[int, int], int] = field(default_factory=dict)  # (series_id, step): reports
    placed_of: dict[int, tuple[int, dict | None]] = field(default_factory=dict)  # series_id: (count, allowed)
    #: for the open-step rows, after the commit: steps left open, steps complete
    grown: list[tuple[tuple[int, int], tuple[str, float], list[tuple], int]] = field(default_factory=list)
    done: list[tuple[int, int]] = field(default_factory=list)
    told: list[tuple] = field(default_factory=list)  # keys of reports carrying ``dropped``
    #: the workload labels this transaction checked: run_id -> workload
    workloads: dict[str, str] = field(default_factory=dict)


@dataclass
class Stored:
    """What :meth:`Ingest.store_rows` stored: the keys inserted, whether in one bulk
    statement, and what the steps complete in hand were judged while the database stored
    them (``early``: added, fresh, by_step, fresh_of)."""

    keys: Any
    all_new: bool
    early: tuple | None = None


class Ingest:
    """The ingest and registration flows of a :class:`auditor.service.Service`."""

    def __init__(self, store: Store, caches: Caches, judge: Judge, max_statistics_per_run: int | None = None):
        self.store, self.caches, self.judge = store, caches, judge
        self.max_statistics_per_run = max_statistics_per_run

    # ------------------------------------------------------------------------ retries
    def run(self, attempt: Callable[[Mode], Any], contended: Callable[[int], Exception], mode: Mode = Mode(),
            switch: bool = True) -> Any:
        """``attempt(mode)`` until it succeeds, each failure answered by :data:`RETRY`
        (``switch`` False: a mode change is not made, its exception raised);
        ``contended(attempts)`` is raised after too many concurrent deletions."""
        drops = 0
        while True:
            try:
                return attempt(mode)
            except Exception as exc:
                action = retry_of(exc, drops)
                if action == "no_fresh_steps" and switch and mode.in_hand:
                    mode, drops = mode._replace(in_hand=False), 0
                elif action == "row_by_row" and switch and mode.bulk:
                    mode, drops = mode._replace(bulk=False), 0
                elif action == "drop_caches":
                    self.caches.clear()
                    drops += 1
                    if drops == ATTEMPTS:
                        raise contended(ATTEMPTS) from exc
                else:
                    raise

    def ingest(self, batch: Sequence[Report], now: float | None, mode: Mode = Mode(),
               switch: bool = True) -> IngestOutcome:
        """Store ``batch`` and audit the steps it completes (:meth:`attempt`, retried)."""
        return self.run(lambda m: self.attempt(batch, now, m), errors.contended_ingest, mode, switch)

    def register(self, run_id: str, reg: RunRegistration, now: float) -> None:
        """Create the run and its series (``PUT /v1/runs/{run_id}``), retried as an ingest is."""
        topo = Topology.of(reg.world_size, reg.sizes, reg.order, reg.topology)

        def attempt(_mode: Mode) -> None:
            with self.store.write() as conn:
                self.ensure_run(conn, run_id, topo, now, index=None)
                if reg.workload is not None:
                    self.label_workload(conn, run_id, reg.workload, None)
                for name, st in reg.statistics.items():
                    self.ensure_series(conn, run_id, name, st.kind, st.spec, now, index=None)

        self.run(attempt, lambda n: errors.contended_registration(run_id, n))

    # ------------------------------------------------------------------------- stages
    def attempt(self, batch: Sequence[Report], now: float | None = None, mode: Mode = Mode()) -> IngestOutcome:
        """Store a validated batch in one transaction and audit the steps it completes.

        Re-sent identical reports are counted as duplicates and change nothing (but a
        grown ``dropped`` tally: :mod:`auditor.service.dropped`). Raises
        :class:`ConflictError` (and stores nothing of the batch) when a report differs from
        a stored one with the same key, claims the coordinates another rank holds in its
        step, or contradicts its run's topology, its statistic's kind/spec, or its step's
        ``num_microbatches``. A report completing a step audited while incomplete re-audits
        it (once, across replicas: :meth:`auditor.db.store.Store.record_verdicts`).
        """
        now = time.time() if now is None else now
        with self.store.write() as conn:
            t = Txn(conn, now, batch, mode, self.caches.check(self.store, conn, {r.run_id for r in batch}))
            self.resolve_series(t)
            self.label_workloads(t)
            self.lock_series(t)
            self.rows_of(t)
            stored = self.store_rows(t)
            t.out.dropped = dropped.settle(self.store, t, stored) if t.told or not stored.all_new else {}
            due, fresh_of = self.count_steps(t, stored)
            if due or fresh_of:  # the drops are counted in the audit's pass over the series rows
                t.out.audited += self.judge.audit_steps(conn, due, now, fresh_of, t.out.dropped)
            else:
                self.store.count_drops(conn, t.out.dropped)
        self.caches.after_commit(t.grown, t.done, t.new_runs, t.new_series)
        self.caches.workloads.update(t.workloads)
        return t.out

    def resolve_series(self, t: Txn) -> None:
        """Each report's run and series (created unless they exist), checked against the
        topology, kind and spec stored (409s). A cached series may answer only for a run
        :meth:`Caches.check <auditor.service.caches.Caches.check>` verified."""
        t.topo_of.update({rid: c[0] for rid, c in t.cached.items()})
        last = None
        for i, r in enumerate(t.batch):
            sz = r.sizes
            same = (r.run_id, r.statistic, r.kind, r.world_size, sz.dp, sz.cp, sz.tp, sz.pp, sz.edp, sz.ep,
                    sz.etp, r.order, r.topology)
            if same == last and r.spec is None:
                continue  # same run, topology and series as the report before: checked
            last = same
            topo = Topology.of(r.world_size, sz, r.order, r.topology, r.topology_source)
            if t.topo_of.get(r.run_id) != topo:  # creates it, or raises
                made = t.new_runs.get(r.run_id)  # created by an earlier report of this batch?
                born = self.ensure_run(t.conn, r.run_id, topo, t.now, i, t.topo_of.get(r.run_id),
                                       first=made[2] if made is not None and made[1] == t.now else None,
                                       source=r.topology_source)
                t.topo_of[r.run_id] = topo
                t.new_runs[r.run_id] = (topo, born, i)
            skey = (r.run_id, r.statistic)
            info = t.series_of.get(skey)
            if info is None or info.kind != r.kind or (r.spec is not None and r.spec != info.spec):
                info = self.ensure_series(t.conn, r.run_id, r.statistic, r.kind, r.spec, t.now, i,
                                          use_cache=r.run_id in t.cached)
                t.series_of[skey] = info
                t.new_series[skey] = info

    def label_workloads(self, t: Txn) -> None:
        """Each run's ``workload`` label: the first a run is given is kept (the run's row);
        a report of the batch that gives another — than the stored one or than an earlier
        report of the batch — is a 409 ``workload_conflict``. A label this process saw
        committed for a run :meth:`Caches.check <auditor.service.caches.Caches.check>`
        verified is not read again."""
        labels = set(map(_get_workload, t.batch))
        if labels == {None}:
            return
        want: dict[str, tuple[str, int]] = {}
        for i, r in enumerate(t.batch):
            w = r.workload
            if w is None:
                continue
            prev = want.setdefault(r.run_id, (w, i))
            if prev[0] != w:
                raise errors.workload_conflict(r.run_id, prev[0], w, i, first=prev[1])
        for run_id, (w, i) in want.items():
            if run_id in t.cached and self.caches.workloads.get(run_id) == w:
                continue
            self.label_workload(t.conn, run_id, w, i)
            t.workloads[run_id] = w

    def label_workload(self, conn: sa.Connection, run_id: str, workload: str, index: int | None) -> None:
        """Label the stored run ``run_id`` with ``workload`` unless it has a label; raise
        :class:`ConflictError` when it has another (``index``: the report; None: a registration)."""
        stored = self.store.label_workload(conn, run_id, workload)
        if stored is not None and stored != workload:
            raise errors.workload_conflict(run_id, stored, workload, index)

    def lock_series(self, t: Txn) -> None:
        """Hold the batch's series until the transaction ends (:meth:`auditor.db.store.Store.lock_series`);
        one deleted since this process cached it: :class:`StaleCaches` (drop the caches, try again)."""
        sids = {info.id for info in t.series_of.values()}
        if self.store.lock_series(t.conn, sids) != len(sids):
            raise StaleCaches()

    def rows_of(self, t: Txn) -> None:
        """The batch's ``reports`` rows by key, each report's placement checked and its
        step's expected reports (placed ranks × ``num_microbatches``) agreed on; a key sent
        twice in the batch counts as a duplicate if identical, else a 409."""
        for i, r in enumerate(t.batch):
            info = t.series_of[(r.run_id, r.statistic)]
            pl = t.placed_of.get(info.id)
            if pl is None:
                pl = t.placed_of[info.id] = self._placed(t.topo_of[r.run_id], info, i, r)
            if pl[1] is not None:
                errors.check_placed(i, r, pl[1])
            row = report_row(r, info.id, t.now)
            key = row[:4]
            prev = t.rows.get(key)
            if prev is not None:
                if prev[:-1] != row[:-1]:
                    raise errors.conflict([(i, key, prev, row)], t.batch, within=t.index_of[key])
                dropped.within_batch(t, key, i)
                t.out.duplicates += 1
                continue
            t.rows[key] = row
            t.index_of[key] = i
            if r.dropped is not None:
                t.told.append(key)
            sk = key[:2]
            n = pl[0] * r.num_microbatches  # placed ranks × microbatches (expected_reports without placement)
            if t.expected.setdefault(sk, n) != n:
                raise errors.microbatch_conflict(i, r, t.expected[sk] // pl[0], against_stored=False)

    @staticmethod
    def _placed(topo: Topology, info: SeriesInfo, i: int, r: Report) -> tuple[int, dict | None]:
        """(placed ranks, allowed coordinates per placed dim or None) of a series."""
        try:
            allowed = topo.placed(info.engine_spec)
            count = topo.placed_count(info.engine_spec)
        except ValueError as exc:  # stored by a registration before the rule (f47c80a)
            raise errors.unfit_placement(i, r, exc) from None
        return count, {d: set(v) for d, v in allowed.items()} or None

    def store_rows(self, t: Txn) -> Stored:
        """Insert the rows in key order (concurrent transactions take index locks in one
        order: no deadlocks). Fast path: one bulk statement that stores every row, the steps
        complete in hand judged meanwhile, or :class:`ReportsExist` if any key exists (the
        batch is then tried again ``row_by_row``: :data:`RETRY`). Row by row: what is
        stored already must be identical (:meth:`_resent`)."""
        ordered = [t.rows[k] for k in sorted(t.rows)]
        stored = Stored(t.rows.keys(), False)

        def meanwhile() -> None:
            """Every row is new: judge the steps complete in hand while the database
            stores the rows (PostgreSQL's COPY; used only if it succeeds)."""
            added = Counter(k[:2] for k in t.rows)
            fresh = self.judge.fresh_steps(added, t.expected) if t.mode.in_hand else set()
            steps = by_step(ordered)
            stored.early = added, fresh, steps, self._fresh_of(t, fresh, steps, judge=True)

        stored.all_new = bool(ordered) and t.mode.bulk and self.store.insert_all_new(t.conn, ordered, meanwhile)
        if not stored.all_new:  # re-sends: find out row by row what is stored, and whether it is identical
            stored.keys = self.store.insert_returning(t.conn, ordered)
            self._resent(t, stored.keys)
        t.out.accepted = len(stored.keys)
        return stored

    def _resent(self, t: Txn, inserted: set[tuple]) -> None:
        """The rows not inserted must be stored identically (a duplicate), else a 409: taken
        coordinates, different values, or another ``num_microbatches`` for a step the batch
        only re-sends."""
        leftover = [k for k in t.rows if k not in inserted]
        if not leftover:
            return
        stored = self.store.fetch_reports(t.conn, leftover)
        taken = [k for k in leftover if k not in stored]
        if taken:  # not stored under its key: another rank holds its coordinates
            raise self._coordinate_conflict(t, [(t.index_of[k], t.rows[k]) for k in taken])
        clashes = [(t.index_of[k], k, stored[k], t.rows[k]) for k in leftover if stored[k][:-1] != t.rows[k][:-1]]
        if clashes:
            raise errors.conflict(clashes, t.batch)
        # num_microbatches is the step row's (expected), not the report row's: a step this
        # batch adds to is checked by count_arrivals, one it only re-sends is checked here
        only_resent = {k[:2] for k in leftover}.difference(k[:2] for k in inserted)
        for sk, e in self.store.steps_expected(t.conn, only_resent).items():
            if e != t.expected[sk]:
                i = min(t.index_of[k] for k in leftover if k[:2] == sk)
                raise errors.microbatch_conflict(i, t.batch[i], e // t.placed_of[sk[0]][0])
        t.out.duplicates += len(leftover)

    def count_steps(self, t: Txn, stored: Stored) -> tuple[list[_Due], dict[int, _Fresh]]:
        """Count the inserted reports into their steps' rows; the steps to audit and, per
        series, the steps complete in hand.

        Steps complete in hand (fresh): this transaction inserted as many reports of the
        step as it expects (placed ranks × num_microbatches), so they are all of its
        reports and its step row cannot exist yet (:meth:`auditor.service.judge.Judge.fresh_steps`):
        they are audited with the rows in hand and their step rows inserted with the verdict."""
        if stored.all_new and stored.early is not None:
            added, fresh, steps, fresh_of = stored.early
        else:
            added = Counter(k[:2] for k in stored.keys)
            fresh = self.judge.fresh_steps(added, t.expected) if t.mode.in_hand else set()
            steps = by_step((t.rows[k] for k in sorted(t.rows)) if stored.all_new
                            else (t.rows[k] for k in sorted(stored.keys)))
            fresh_of = self._fresh_of(t, fresh, steps, judge=False)
        if not added:
            return [], {}
        arrivals = self.store.count_arrivals(t.conn, {k: n for k, n in added.items() if k not in fresh},
                                             t.expected, t.now)
        for p in arrivals:
            if p.expected != t.expected[(p.series_id, p.step)]:
                i = next(t.index_of[k] for k in sorted(t.rows) if k[:2] == (p.series_id, p.step))
                raise errors.microbatch_conflict(i, t.batch[i], p.expected // t.placed_of[p.series_id][0])
        t.done.extend(fresh)
        return self._due(t, arrivals, added, steps), fresh_of

    def _due(self, t: Txn, arrivals: list, added: Counter, steps: dict) -> list[_Due]:
        """The steps to audit among ``arrivals`` (first audits, and re-audits of steps a late
        report completed), each with its rows when every stored report of the step is one
        this transaction just wrote or one this process wrote before
        (:class:`auditor.service.caches.OpenStepRows`); the rows of steps left open kept."""
        # the runs' incarnations as this transaction verified or read them (OpenStepRows)
        born_of = {rid: c[1] for rid, c in t.cached.items()}
        born_of.update({rid: born for rid, (_, born, _) in t.new_runs.items() if born is not None})
        by_id = {info.id: info for info in t.series_of.values()}
        todo: list[_Due] = []
        for p in arrivals:
            sk = (p.series_id, p.step)
            info = by_id[p.series_id]
            born = born_of.get(info.run_id)
            if p.received < p.expected:
                if born is not None:
                    t.grown.append((sk, (info.run_id, born), steps[sk], p.received))
                continue
            t.done.append(sk)
            # first audit, or a late report completed a step audited while incomplete
            previous = None
            if p.verdict is not None:
                if p.complete_at_audit is None or p.complete_at_audit or p.verdict not in REPLACEABLE:
                    continue
                previous = p.verdict
            mine = steps[sk] if p.received == added[sk] else None if born is None else \
                self.caches.open.rows(sk, (info.run_id, born), steps[sk], p.received)
            todo.append(_Due(info, t.topo_of[info.run_id], p, previous, mine))
        return todo

    def _fresh_of(self, t: Txn, fresh: set[tuple[int, int]], steps: dict, judge: bool) -> dict[int, _Fresh]:
        """:meth:`auditor.service.judge.Judge.fresh_of` of this transaction's series."""
        by_id = {info.id: info for info in t.series_of.values()}
        return self.judge.fresh_of(fresh, steps, by_id, t.topo_of, judge)

    # ------------------------------------------------------------------ runs and series
    def ensure_run(self, conn: sa.Connection, run_id: str, topo: Topology, now: float, index: int | None,
                   stored: Topology | None = None, first: int | None = None, source: str | None = None) -> float | None:
        """Create the run with ``topo`` unless it exists; raise :class:`ConflictError` if it
        is stored (or ``stored``, its topology as this transaction knows it) with another
        topology. ``first``: the index of the report of this batch that created the run in
        this transaction (the run did not exist before): a conflict is then between the
        batch's own reports, and the 409 says so. Returns the run's ``created_at`` when it
        was read from the database."""
        born = None
        if stored is None:
            row = self.store.ensure_run(conn, run_id, topo.world_size, topo.sizes, now, topo.expert, topo.order,
                                        topo.known, source)
            stored, born = Topology.of_row(row), row.created_at
        if stored != topo:
            raise errors.topology_conflict(run_id, stored, topo, index, first)
        return born

    def ensure_series(self, conn: sa.Connection, run_id: str, statistic: str, kind: str,
                      spec: StatisticSpec | None, now: float, index: int | None, use_cache: bool = False) -> SeriesInfo:
        """The series (created unless it exists) of ``(run_id, statistic)``; raises
        :class:`ConflictError` if it is stored with another kind or spec. ``use_cache``:
        the process's cached series may answer (only when its run was checked in this
        transaction, see :class:`auditor.service.caches.Caches`)."""
        info = self.caches.series.get((run_id, statistic)) if use_cache else None
        if info is None:
            want = (spec or DEFAULT_SPECS[kind]).model_dump()
            if self.max_statistics_per_run is not None:
                self._check_statistics_limit(conn, run_id, statistic, index)
            info = SeriesInfo.of(self.store.ensure_series(conn, run_id, statistic, kind, want, now))
        if info.kind != kind or (spec is not None and spec != info.spec):
            raise errors.spec_conflict(info, kind, spec, index)
        return info

    def _check_statistics_limit(self, conn: sa.Connection, run_id: str, statistic: str, index: int | None) -> None:
        limit = self.max_statistics_per_run
        names = self.store.statistic_names(conn, run_id, limit + 1)
        if statistic in names or len(names) < limit:
            return
        raise errors.statistics_limit(run_id, statistic, len(names), limit, index)

    def _coordinate_conflict(self, t: Txn, taken: list[tuple[int, tuple]]) -> errors.ConflictError:
        """409 for reports whose (step, microbatch, coordinates) another rank already holds,
        stored or earlier in the same batch: naming both ranks and the shared coordinates."""
        conflicts = []
        for i, row in taken:
            sid, step, mb = row[0], row[1], row[2]
            other = self.store.rank_at(t.conn, sid, step, mb, tuple(row[4:8]))
            r = t.batch[i]
            entry = {"index": i, "run_id": r.run_id, "statistic": r.statistic, "step": r.step, "microbatch": mb,
                     "rank": r.rank, "other_rank": other, "coords": dict(zip(DIMS, r.coords.as_tuple())),
                     "fields": ["rank", "coords"]}
            j = t.index_of.get((sid, step, mb, other))
            if j is not None and j != i:
                entry["other_index"] = j
            conflicts.append(entry)
        return errors.coordinate_conflict(conflicts)
