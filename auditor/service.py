"""The flows of the service, above a SQL-only store and the audit engine.

* :meth:`Service.ingest` — store a validated batch and audit every step it completes, in one
  store transaction: check each report against its run's topology and its statistic's
  kind/spec, insert the new reports, count arrivals per step, audit the steps that became
  complete (:func:`auditor.core.audit_step`) and record their verdicts.
* :meth:`Service.sweep` — audit steps still incomplete after the grace period (``missing_report``).
* :meth:`Service.report`, :meth:`Service.step`, :meth:`Service.list_runs`,
  :meth:`Service.get_run` — the JSON the API and the CLI serve, with per-rank tables
  recomputed from the stored reports.

Every caller goes through here: the HTTP API (:mod:`auditor.server`), ``auditor audit``
(:mod:`auditor.offline`) and the CLI's database mode. Exactly-once auditing across
threads, workers and replicas, and the lock order, are the store's
(:mod:`auditor.db.store`); this module only decides *what* to write, and words the errors.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import json
import logging
import operator
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import sqlalchemy as sa

from auditor import core, layout
from auditor import status as statuses
from auditor.core import DIMS, EXPERT_DIMS, REPLACEABLE, RankReport
from auditor.db.store import (
    COLUMNS, COMPARED, Arrival, CleanSteps, ReportsExist, RowDeleted, RunRow, SeriesRow, StepRowExists, Store, VerdictItem, elements, json_safe, rank_report, report_row,
)
from auditor.schemas import DEFAULT_SPECS, Report, RunRegistration, StatisticSpec
from auditor.status import STATUSES
from auditor.web import PAGE_STEPS

log = logging.getLogger("auditor.service")


class ConflictError(Exception):
    """A batch contradicts what is stored (HTTP 409); nothing of the batch was stored.

    ``error`` is ``conflicting_report``, ``coordinate_conflict``, ``topology_conflict``,
    ``spec_conflict`` or ``placement_conflict``; ``conflicts`` lists ``{"index": i, "fields": [wire names], ...}`` per
    offending report.
    """

    def __init__(self, error: str, message: str, conflicts: list[dict], against_stored: bool = True):
        super().__init__(message)
        self.error, self.message, self.conflicts = error, message, conflicts
        #: False when the batch contradicts only itself (two of its reports, or a placement):
        #: nothing stored was contradicted, so the refusal is not counted against a series
        self.against_stored = against_stored


class NotFound(Exception):
    """No such run, statistic or step (HTTP 404)."""


class LimitError(Exception):
    """A request would take the service past a configured limit (HTTP 422); nothing was
    stored. ``field`` is the wire field (``reports[3].statistic``, ``statistics.NAME``)."""

    def __init__(self, field: str, loc: list, message: str):
        super().__init__(message)
        self.field, self.loc, self.message = field, loc, message


#: Newest steps of a series read to tell which ranks reached which step (hang localisation).
PROGRESS_WINDOW = 16
#: Hang localisation: "sent nothing" (no report of the series at all) is told from "sent
#: nothing since before step N" by looking at the reports before the window while those
#: steps hold at most this many reports of the expected ranks (a bounded index range).
PROGRESS_LOOKBACK_REPORTS = 1 << 16
#: Rows of each bad step's per-rank table a report shows by default (``?rank_rows=``): the
#: ranks its faults name first, then the rest in rank order; the step endpoint pages the rest.
REPORT_RANK_ROWS = 64
#: Most rank rows one report response holds over all its bad steps (and most ranks each
#: fault lists there): a report asking for more shows each bad step an equal share of it.
#: Bounds the response whatever the world (≈ 330 bytes a row: ≈ 5.4 MB at most).
REPORT_ROWS_BUDGET = 16_384
#: Most stored reports one report response re-audits for its per-rank tables (each bad
#: step's table needs every report of its step: a rank's correct value is its whole expected
#: group's); bad steps past it show their faults and ``ranks_total`` but no rows
#: (``ranks_truncated``): the step endpoint has them. Bounds the time and memory of a read.
REPORT_AUDIT_BUDGET = 1 << 19
#: Most ranks each fault of a report's bad step lists (fewer when many bad steps are shown:
#: an equal share of :data:`REPORT_ROWS_BUDGET`, at least 16); the step endpoint lists all.
REPORT_FAULT_RANKS = 1024
#: Rank rows per page of the step endpoint by default, and at most.
STEP_RANK_ROWS = 10_000
STEP_RANK_ROWS_MAX = 65_536


@dataclass(frozen=True, slots=True)
class Topology:
    """A run's topology (DESIGN.md §3.1): dense sizes (dp, cp, tp, pp), the expert
    factorisation (edp, ep, etp, pp) if any, the rank order if known, known/unknown."""

    world_size: int
    sizes: tuple[int, int, int, int]
    expert: tuple[int, int, int, int] | None = None
    order: str | None = None
    known: bool = True
    #: where the layout came from (``topology_source``): words fix hints, never a conflict
    source: str | None = field(default=None, compare=False)

    @classmethod
    def of(cls, world_size: int, sizes, order: str | None, topology: str, source: str | None = None) -> "Topology":
        """From wire fields (a :class:`auditor.schemas.Sizes`; ``order`` validated, kept in
        its canonical spelling, :func:`auditor.layout.canonical_order`); an unknown topology
        keeps the world size only."""
        if topology == "unknown":
            return cls(world_size, (1, 1, 1, 1), None, None, False, source)
        return cls(world_size, sizes.as_tuple(), sizes.expert_tuple(), layout.canonical_order(order), True, source)

    @classmethod
    def of_row(cls, r: RunRow) -> "Topology":
        """From a stored run (its order as stored before orders were canonical, too)."""
        return cls(r.world_size, r.sizes, r.expert, _stored_order(r.order), r.known, r.source)

    @classmethod
    def of_summary(cls, run: dict) -> "Topology":
        """From a run summary (:meth:`Service.get_run`)."""
        sz = run["sizes"]
        expert = (sz["edp"], sz["ep"], sz["etp"], sz["pp"]) if "edp" in sz else None
        return cls(run["world_size"], tuple(sz[d] for d in DIMS), expert, _stored_order(run.get("order")),
                   run.get("topology") != "unknown", run.get("topology_source"))

    def describe(self) -> dict:
        """``world_size``, ``sizes`` (expert ones too) and, when set, ``order`` / ``topology: unknown``."""
        out: dict = {"world_size": self.world_size, "sizes": dict(zip(DIMS, self.sizes))}
        if self.expert is not None:
            out["sizes"].update(zip(("edp", "ep", "etp"), self.expert[:3]))
        if self.order:
            out["order"] = self.order
        if not self.known:
            out["topology"] = "unknown"
        return out

    def dims_sizes(self, spec: core.Spec) -> tuple[tuple[str, ...], tuple[int, int, int, int]]:
        """The statistic's factorisation: its dims and their sizes."""
        if spec.factorisation == "expert" and self.expert is not None:
            return EXPERT_DIMS, self.expert
        return DIMS, self.sizes

    def placed(self, spec: core.Spec) -> dict[str, list[int]]:
        """The placed coordinates per dim (``{}``: every rank)."""
        if not spec.placement or not self.known:
            return {}
        dims, sizes = self.dims_sizes(spec)
        return spec.placed(dict(zip(dims, sizes)))

    def placed_count(self, spec: core.Spec) -> int:
        """Ranks that hold the statistic (the world unless ``spec.placement``)."""
        placed = self.placed(spec)
        if not placed:
            return self.world_size
        dims, sizes = self.dims_sizes(spec)
        return core.placed_count(self.world_size, sizes, dims, placed)

    def audit_args(self) -> dict:
        """The topology keywords of :func:`auditor.core.audit_step`."""
        return {"expert_sizes": self.expert, "order": self.order, "topology": "known" if self.known else "unknown",
                "world_size": self.world_size, "source": self.source}


@dataclass(frozen=True, slots=True)
class SeriesInfo:
    """A (run, statistic) as the flows use it: the wire spec (for conflict checks) and the
    engine's spec (for audits)."""

    id: int
    run_id: str
    statistic: str
    kind: str
    spec: StatisticSpec
    engine_spec: core.Spec

    @classmethod
    def of(cls, row: SeriesRow) -> "SeriesInfo":
        spec = StatisticSpec(**row.spec)
        return cls(row.id, row.run_id, row.statistic, row.kind, spec, spec.to_core())


@dataclass(slots=True)  # not frozen: one per step, and a frozen __init__ costs 5× (1.05 vs 0.21 µs)
class _Due:
    """A step to audit: its series, topology, step row, the verdict it replaces (re-audit)
    and its reports as ``reports`` rows when the caller holds them all."""

    info: SeriesInfo
    topo: Topology
    arrival: Arrival
    previous: str | None
    rows: list[tuple] | None
    #: no step row yet (every report of the step is in ``rows``): insert it with the verdict
    fresh: bool = False


@dataclass(slots=True)
class _Fresh:
    """The steps of one series this transaction inserted every report of (no step row yet:
    :meth:`Service._fresh_steps`), key order: ``rows[i]`` the ``reports`` rows of
    ``steps[i]`` (as many as it expects). ``judged``: ``clean`` holds what
    :meth:`Service._clean` gives for them already (computed while the database stored the
    rows: :meth:`Service._fresh_of`)."""

    info: SeriesInfo
    topo: Topology
    steps: list[int]
    rows: list[list[tuple]]
    judged: bool = False
    clean: core.batch.Clean | None = None


@dataclass
class IngestOutcome:
    accepted: int = 0
    duplicates: int = 0
    audited: list[tuple[int, int, str]] = field(default_factory=list)  # (series_id, step, verdict)


class Contended(Exception):
    """A write kept meeting concurrent deletions of the runs it touches; nothing of it was
    stored (the API answers 503 with Retry-After)."""


#: Attempts of an ingest or registration that meets concurrent deletions of its runs.
_ATTEMPTS = 3


class _StaleCaches(Exception):
    """A run this process has cached was deleted (and maybe created anew) by another
    process: :meth:`Service.ingest` drops its caches and tries the batch once more."""


#: The reports of open steps an ingesting process keeps (:class:`_OpenStepRows`), in rows.
OPEN_STEP_ROWS = 65_536
#: A row's place in its step: (microbatch, rank), the key order of the rows in hand.
_IN_STEP = operator.itemgetter(2, 3)
#: A row's step: (series_id, step).
_STEP_KEY = operator.itemgetter(0, 1)


def _stored_order(order: str | None) -> str | None:
    """A stored order in its canonical spelling; one that no longer parses as it was."""
    try:
        return layout.canonical_order(order)
    except ValueError:
        return order


def _by_step(rows: Iterable[tuple]) -> dict[tuple[int, int], list[tuple]]:
    """``reports`` rows in key order, grouped by (series_id, step)."""
    return {sk: list(g) for sk, g in itertools.groupby(rows, _STEP_KEY)}


class _OpenStepRows:
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
    equal the run's ``created_at`` this transaction verified (:class:`_StaleCaches`) or
    read, so a run deleted and created anew, or a series id SQLite hands to a new series,
    never meets the old run's rows; :meth:`Service._forget` (``delete_run`` in this
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


class Service:
    """The flows over one database. Thread-safe; holds no state but caches of what does not
    change once stored: a run's topology and created_at, a series' id, kind and spec — for
    as long as the run is not deleted. Another process (replica, worker, ``auditor runs
    delete``, retention) can delete a run and create it anew, and SQLite then hands the
    deleted series' ids to new series, so each ingest first checks, in its transaction,
    that every cached run it relies on is still the one cached (its ``created_at``)."""

    def __init__(self, store: Store, *, max_statistics_per_run: int | None = None,
                 open_step_rows: int = OPEN_STEP_ROWS):
        self.store = store
        self.max_statistics_per_run = max_statistics_per_run
        self._runs: dict[str, tuple[Topology, float]] = {}  # run_id: (topology, created_at)
        self._series: dict[tuple[str, str], SeriesInfo] = {}
        #: reports this process stored of open steps (``open_step_rows`` rows at most; 0: none)
        self._open = _OpenStepRows(open_step_rows)

    @classmethod
    def from_engine(cls, engine: sa.Engine, **limits) -> "Service":
        return cls(Store(engine), **limits)

    def close(self) -> None:
        self.store.dispose()

    # ------------------------------------------------------------------ runs and series
    def register_run(self, run_id: str, reg: RunRegistration, now: float | None = None) -> dict:
        """``PUT /v1/runs/{run_id}``: fix the topology and statistic specs. Idempotent;
        raises :class:`ConflictError` if it contradicts what is stored."""
        now = time.time() if now is None else now
        topo = Topology.of(reg.world_size, reg.sizes, reg.order, reg.topology)
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                with self.store.write() as conn:
                    self._ensure_run(conn, run_id, topo, now, index=None)
                    for name, st in reg.statistics.items():
                        self._ensure_series(conn, run_id, name, st.kind, st.spec, now, index=None)
                break
            except RowDeleted as exc:  # a concurrent DELETE of the run committed meanwhile
                if attempt == _ATTEMPTS:
                    raise Contended(f"run {run_id!r} was deleted {_ATTEMPTS} times while it was registered; "
                                    "nothing was stored") from exc
        return self.get_run(run_id)

    def _ensure_run(self, conn: sa.Connection, run_id: str, topo: Topology, now: float, index: int | None,
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
            field_ = "topology" if stored.known != topo.known else "order" if stored.order != topo.order else "sizes"
            where = [{"index": index, "field": field_}] if index is not None else []
            if first is not None:
                raise ConflictError(
                    "topology_conflict",
                    f"reports[{first}] and reports[{index}] of this batch disagree on the topology of the new run "
                    f"{run_id!r}: {stored.describe()} against {topo.describe()}; every report of a run must give "
                    "the same topology (world_size, sizes, order, topology); nothing of this batch was stored",
                    [{**w, "other_index": first} for w in where], against_stored=False,
                )
            raise ConflictError(
                "topology_conflict",
                f"run {run_id!r} was registered with {stored.describe()}; this report says {topo.describe()}; "
                "nothing of this batch was stored",
                where,
            )
        return born

    def _ensure_series(
        self, conn: sa.Connection, run_id: str, statistic: str, kind: str, spec: StatisticSpec | None,
        now: float, index: int | None, use_cache: bool = False,
    ) -> SeriesInfo:
        """The series (created unless it exists) of ``(run_id, statistic)``; raises
        :class:`ConflictError` if it is stored with another kind or spec. ``use_cache``:
        the process's cached series may answer (only when its run was checked in this
        transaction, see :class:`Service`)."""
        info = self._series.get((run_id, statistic)) if use_cache else None
        if info is None:
            want = (spec or DEFAULT_SPECS[kind]).model_dump()
            if self.max_statistics_per_run is not None:
                self._check_statistics_limit(conn, run_id, statistic, index)
            info = SeriesInfo.of(self.store.ensure_series(conn, run_id, statistic, kind, want, now))
        if info.kind != kind or (spec is not None and spec != info.spec):
            raise ConflictError(
                "spec_conflict",
                f"statistic {statistic!r} of run {run_id!r} is kind={info.kind!r} spec={info.spec.model_dump()}; "
                f"this report says kind={kind!r} spec={spec.model_dump() if spec else None}",
                [{"index": index, "field": "spec" if info.kind == kind else "kind"}] if index is not None else [],
            )
        return info

    def _check_statistics_limit(self, conn: sa.Connection, run_id: str, statistic: str, index: int | None) -> None:
        limit = self.max_statistics_per_run
        names = self.store.statistic_names(conn, run_id, limit + 1)
        if statistic in names or len(names) < limit:
            return
        field, loc = ((f"reports[{index}].statistic", ["reports", index, "statistic"]) if index is not None
                      else (f"statistics.{statistic}", ["statistics", statistic]))
        raise LimitError(field, loc, f"run {run_id!r} already has {len(names)} statistics, the most one run may have "
                                     f"(AUDITOR_MAX_STATISTICS_PER_RUN={limit}); {statistic!r} was not added")

    # ------------------------------------------------------------------------- ingest
    def ingest(self, batch: Sequence[Report], now: float | None = None, record_refused: bool = True) -> IngestOutcome:
        """Store a validated batch in one transaction and audit the steps it completes
        (:meth:`_ingest`). A foreign-key violation means a cached run or series was deleted
        meanwhile (``DELETE /v1/runs``, retention, maybe on another replica): the caches are
        dropped and the batch is tried once more. A step completed in hand whose step row
        existed after all (:meth:`_fresh_steps`) rolls the batch back; it is ingested again
        without completing steps in hand. So does a batch holding a stored report (a
        re-send: :class:`ReportsExist` from the bulk insert, which has no savepoint); it is
        ingested again report by report (``bulk=False``: ``Store.insert_returning``).

        A :class:`ConflictError` (409) stores nothing of the batch; after its rollback, the
        reports that contradicted a stored series are counted against it in a small write
        transaction of their own (:meth:`_record_refused`; ``record_refused=False``: not,
        e.g. while ``auditor audit`` bisects a batch), so the report can say that a run id
        was reused or a rank re-sent different values. The ConflictError is raised either way."""
        try:
            in_hand = bulk = True
            while True:
                try:
                    return self._ingest_retrying(batch, now, in_hand, bulk)
                except StepRowExists:
                    if not in_hand:
                        raise
                    in_hand = False
                except ReportsExist:
                    if not bulk:
                        raise
                    bulk = False
        except ConflictError as exc:
            if record_refused and exc.against_stored:
                self._record_refused(exc, batch, time.time() if now is None else now)
            raise

    def _record_refused(self, exc: ConflictError, batch: Sequence[Report], now: float) -> None:
        """Count the reports ``exc`` refused per series (``series.refused_*``): the reports
        its ``conflicts`` name, or for a topology (spec) conflict every report of the batch
        of that run (statistic). Never raises: a failure is logged, the 409 stays a 409."""
        try:
            picked: list[Report] = []
            for c in exc.conflicts:
                i = c.get("index")
                if i is None or not 0 <= i < len(batch) or "other_index" in c:
                    continue  # a registration, or two reports of this batch: nothing stored contradicted
                r = batch[i]
                if exc.error == "topology_conflict":
                    picked.extend(x for x in batch if x.run_id == r.run_id)
                elif exc.error == "spec_conflict":
                    picked.extend(x for x in batch if (x.run_id, x.statistic) == (r.run_id, r.statistic))
                else:
                    picked.append(r)
            per: dict[tuple[str, str], list[int]] = defaultdict(list)
            for r in {id(r): r for r in picked}.values():
                per[(r.run_id, r.statistic)].append(r.step)
            if not per:
                return
            rows = [(rid, st, len(steps), min(steps), max(steps), exc.error) for (rid, st), steps in per.items()]
            with self.store.write() as conn:
                self.store.record_refused(conn, rows, now)
        except Exception:  # noqa: BLE001 - counting must never turn the 409 into a 500
            log.exception("could not count the reports refused by a %s", exc.error)

    def _ingest_retrying(self, batch: Sequence[Report], now: float | None, in_hand: bool,
                         bulk: bool = True) -> IngestOutcome:
        """:meth:`_ingest`, tried again after a concurrent deletion of a run it touches
        (:class:`_StaleCaches`, :class:`RowDeleted`: up to :data:`_ATTEMPTS` attempts, then
        :class:`Contended`) or an integrity error (a cached run or series deleted: once),
        with the process's caches dropped before each retry."""
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                return self._ingest(batch, now, in_hand, bulk)
            except Exception as exc:
                deleted = isinstance(exc, (_StaleCaches, RowDeleted))
                if not (deleted or (attempt == 1 and _is_integrity_error(exc))):
                    raise
                self._runs.clear()
                self._series.clear()
                self._open.clear()
                if attempt == _ATTEMPTS:
                    raise Contended(f"the runs of this batch were deleted and created anew {_ATTEMPTS} times "
                                    "while it was stored; nothing of it was stored") from exc
        raise AssertionError("unreachable")

    def _ingest(self, batch: Sequence[Report], now: float | None = None, in_hand: bool = True,
                bulk: bool = True) -> IngestOutcome:
        """Store a validated batch in one transaction and audit the steps it completes.

        Re-sent identical reports are counted as duplicates and change nothing. Raises
        :class:`ConflictError` (and stores nothing of the batch) when a report differs from
        a stored one with the same key, claims the coordinates another rank holds in its
        step, or contradicts its run's topology, its statistic's kind/spec, or its step's
        ``num_microbatches``. A report completing a step audited while incomplete re-audits
        it (once, across replicas: :meth:`auditor.db.store.Store.record_verdicts`).
        """
        now = time.time() if now is None else now
        store = self.store
        out = IngestOutcome()
        new_runs: dict[str, tuple[Topology, float | None, int]] = {}  # (topology, created_at, first index)
        new_series: dict[tuple[str, str], SeriesInfo] = {}
        grown: list[tuple[tuple[int, int], tuple[str, float], list[tuple], int]] = []  # for self._open, after
        done: list[tuple[int, int]] = []  # the commit: steps left open, steps complete
        with store.write() as conn:
            cached = {rid: c for rid in {r.run_id for r in batch} if (c := self._runs.get(rid)) is not None}
            if cached:  # still the runs this process cached? (before anything relies on them)
                stored_at = store.runs_created_at(conn, cached)
                if any(stored_at.get(rid) != c[1] for rid, c in cached.items()):
                    raise _StaleCaches()
            topo_of = {rid: c[0] for rid, c in cached.items()}
            series_of: dict[tuple[str, str], SeriesInfo] = {}
            last = None
            for i, r in enumerate(batch):
                sz = r.sizes
                same = (r.run_id, r.statistic, r.kind, r.world_size, sz.dp, sz.cp, sz.tp, sz.pp, sz.edp, sz.ep,
                        sz.etp, r.order, r.topology)
                if same == last and r.spec is None:
                    continue  # same run, topology and series as the report before: checked
                last = same
                topo = Topology.of(r.world_size, sz, r.order, r.topology, r.topology_source)
                if topo_of.get(r.run_id) != topo:  # creates it, or raises
                    made = new_runs.get(r.run_id)  # created by an earlier report of this batch?
                    born = self._ensure_run(conn, r.run_id, topo, now, i, topo_of.get(r.run_id),
                                            first=made[2] if made is not None and made[1] == now else None,
                                            source=r.topology_source)
                    topo_of[r.run_id] = topo
                    new_runs[r.run_id] = (topo, born, i)
                skey = (r.run_id, r.statistic)
                info = series_of.get(skey)
                if info is None or info.kind != r.kind or (r.spec is not None and r.spec != info.spec):
                    info = self._ensure_series(conn, r.run_id, r.statistic, r.kind, r.spec, now, i,
                                               use_cache=r.run_id in cached)
                    series_of[skey] = info
                    new_series[skey] = info

            # the series exist until this transaction ends (Store.lock_series); one deleted
            # since this process cached it: drop the caches and try again
            sids = {info.id for info in series_of.values()}
            if store.lock_series(conn, sids) != len(sids):
                raise _StaleCaches()

            rows: dict[tuple, tuple] = {}
            index_of: dict[tuple, int] = {}
            expected: dict[tuple[int, int], int] = {}
            placed_of: dict[int, tuple[int, dict | None]] = {}
            for i, r in enumerate(batch):
                info = series_of[(r.run_id, r.statistic)]
                pl = placed_of.get(info.id)
                if pl is None:
                    topo = topo_of[r.run_id]
                    try:
                        allowed = topo.placed(info.engine_spec)
                        count = topo.placed_count(info.engine_spec)
                    except ValueError as exc:  # stored by a registration before the rule (f47c80a)
                        raise ConflictError(
                            "spec_conflict",
                            f"statistic {r.statistic!r} of run {r.run_id!r} was registered with a placement that "
                            f"does not fit the run's topology ({exc}); no report of it can be stored: delete the "
                            "run (DELETE /v1/runs/{run_id}) and register it again; nothing of this batch was stored",
                            [{"index": i, "field": "spec"}], against_stored=False) from None
                    pl = placed_of[info.id] = (count, {d: set(v) for d, v in allowed.items()} or None)
                if pl[1] is not None:
                    _check_placed(i, r, pl[1])
                row = report_row(r, info.id, now)
                key = row[:4]
                prev = rows.get(key)
                if prev is not None:
                    if prev[:-1] != row[:-1]:
                        raise _conflict([(i, key, prev, row)], batch, within=index_of[key])
                    out.duplicates += 1
                    continue
                rows[key] = row
                index_of[key] = i
                sk = key[:2]
                n = pl[0] * r.num_microbatches  # placed ranks × microbatches (expected_reports without placement)
                if expected.setdefault(sk, n) != n:
                    raise _microbatch_conflict(i, r, expected[sk] // pl[0], against_stored=False)

            # Key order: concurrent transactions take index locks in one order (no deadlocks).
            ordered = [rows[k] for k in sorted(rows)]
            by_id = {info.id: info for info in series_of.values()}
            early: tuple | None = None  # (added, fresh, by_step, fresh_of) of an all-new batch

            def meanwhile() -> None:
                """Every row is new: judge the steps complete in hand while the database
                stores the rows (PostgreSQL's COPY; used only if it succeeds)."""
                nonlocal early
                added = Counter(k[:2] for k in rows)
                fresh = self._fresh_steps(added, expected) if in_hand else set()
                by_step = _by_step(ordered)
                early = added, fresh, by_step, self._fresh_of(fresh, by_step, by_id, topo_of, judge=True)

            # Fast path: one bulk statement that stores every row, or ReportsExist if any key
            # exists (the batch is then tried again with bulk=False: Service.ingest).
            all_new = bool(ordered) and bulk and store.insert_all_new(conn, ordered, meanwhile)
            if all_new:
                inserted_keys: Any = rows.keys()
            else:  # re-sends: find out row by row what is stored, and whether it is identical
                inserted_keys = store.insert_returning(conn, ordered)
                leftover = [k for k in rows if k not in inserted_keys]
                if leftover:
                    stored = store.fetch_reports(conn, leftover)
                    taken = [k for k in leftover if k not in stored]
                    if taken:  # not stored under its key: another rank holds its coordinates
                        raise self._coordinate_conflict(conn, [(index_of[k], rows[k]) for k in taken], batch,
                                                        index_of)
                    clashes = [(index_of[k], k, stored[k], rows[k])
                               for k in leftover if stored[k][:-1] != rows[k][:-1]]
                    if clashes:
                        raise _conflict(clashes, batch)
                    # num_microbatches is the step row's (expected), not the report row's: a
                    # step this batch adds to is checked by count_arrivals, one it only
                    # re-sends is checked here
                    only_resent = {k[:2] for k in leftover}.difference(k[:2] for k in inserted_keys)
                    for sk, e in store.steps_expected(conn, only_resent).items():
                        if e != expected[sk]:
                            i = min(index_of[k] for k in leftover if k[:2] == sk)
                            raise _microbatch_conflict(i, batch[i], e // placed_of[sk[0]][0])
                    out.duplicates += len(leftover)
            out.accepted = len(inserted_keys)

            # Steps complete in hand (fresh): this transaction inserted as many reports of the
            # step as it expects (placed ranks × num_microbatches), so they are all of its
            # reports and its step row cannot exist yet (Service._fresh_steps): audit them with
            # the rows in hand and insert their step rows with the verdict.
            if all_new and early is not None:
                added, fresh, by_step, fresh_of = early
            else:
                added = Counter(k[:2] for k in inserted_keys)
                fresh = self._fresh_steps(added, expected) if in_hand else set()
                by_step = _by_step(ordered if all_new else (rows[k] for k in sorted(inserted_keys)))
                fresh_of = self._fresh_of(fresh, by_step, by_id, topo_of, judge=False)
            if added:
                progress = store.count_arrivals(conn, {k: n for k, n in added.items() if k not in fresh},
                                                expected, now)
                for p in progress:
                    if p.expected != expected[(p.series_id, p.step)]:
                        i = next(index_of[k] for k in sorted(rows) if k[:2] == (p.series_id, p.step))
                        raise _microbatch_conflict(i, batch[i], p.expected // placed_of[p.series_id][0])
                # the runs' incarnations as this transaction verified or read them (_OpenStepRows)
                born_of = {rid: c[1] for rid, c in cached.items()}
                born_of.update({rid: born for rid, (_, born, _) in new_runs.items() if born is not None})
                todo: list[_Due] = []
                done.extend(fresh)
                for p in progress:
                    sk = (p.series_id, p.step)
                    info = by_id[p.series_id]
                    born = born_of.get(info.run_id)
                    if p.received < p.expected:
                        if born is not None:
                            grown.append((sk, (info.run_id, born), by_step[sk], p.received))
                        continue
                    done.append(sk)
                    # first audit, or a late report completed a step audited while incomplete
                    previous = None
                    if p.verdict is not None:
                        if p.complete_at_audit is None or p.complete_at_audit or p.verdict not in REPLACEABLE:
                            continue
                        previous = p.verdict
                    # Every stored report of the step is one this transaction just wrote, or
                    # one this process wrote before (_OpenStepRows): audit the rows in hand
                    # (and those kept) instead of reading them back.
                    mine = by_step[sk] if p.received == added[sk] else None if born is None else \
                        self._open.rows(sk, (info.run_id, born), by_step[sk], p.received)
                    todo.append(_Due(info, topo_of[info.run_id], p, previous, mine))
                out.audited += self._audit_steps(conn, todo, now, fresh_of)
        if grown or done:  # committed: keep the rows of the steps left open, drop those complete
            self._open.update(grown, done)
        self._runs.update({rid: (t, born) for rid, (t, born, _) in new_runs.items()})
        self._series.update(new_series)
        return out

    def _fresh_of(self, fresh: set[tuple[int, int]], by_step: dict[tuple[int, int], list[tuple]],
                  by_id: dict[int, SeriesInfo], topo_of: dict[str, Topology], judge: bool) -> dict[int, _Fresh]:
        """The steps ``fresh`` (:meth:`_fresh_steps`) per series id, with their rows from
        ``by_step``; ``judge``: with :meth:`_clean`'s result too."""
        out: dict[int, _Fresh] = {}
        for sk in sorted(fresh):
            f = out.get(sk[0])
            if f is None:
                info = by_id[sk[0]]
                f = out[sk[0]] = _Fresh(info, topo_of[info.run_id], [], [])
            f.steps.append(sk[1])
            f.rows.append(by_step[sk])
        if judge:
            for f in out.values():
                f.clean, f.judged = self._clean(f.info, f.topo, f.rows, [len(rs) for rs in f.rows]), True
        return out

    @staticmethod
    def _fresh_steps(added: Counter, expected: dict[tuple[int, int], int]) -> set[tuple[int, int]]:
        """The steps (series_id, step) of which this transaction inserted ``expected``
        reports: all of the step's reports, so no other transaction can have made its step
        row, which :meth:`_ingest` then inserts with the verdict.

        Why no step row can exist. A step row is made only by :meth:`Store.count_arrivals`
        in a transaction that inserted at least one of the step's reports (``added``
        counts inserted keys only). Every report of a step lies in a key space of
        ``expected`` = placed ranks × ``num_microbatches`` places: the schema validates
        ``microbatch < num_microbatches``, ``rank < world_size`` and each coordinate below
        its size; ``_check_placed`` keeps the placed dims within the placement; every
        report of the step in this batch gave one ``num_microbatches`` (else 409); and
        ``uq_reports_coords`` (series, step, microbatch, dense coords) admits one report
        per place (unknown topology: the coords are the rank, < world_size). Having
        inserted ``expected`` of them, this transaction holds every place: another
        transaction's report of the step waits on these keys and then conflicts (a
        duplicate, or a 409), so it inserts none and makes no step row, before or after.
        Not covered by that argument, and caught by the step rows' insert (SQLite's ``ON
        CONFLICT DO NOTHING`` count, PostgreSQL's ``COPY`` unique violation:
        :class:`StepRowExists`, the batch is ingested again the general way):
        a step row left by the deletion of its reports (``delete_rank_range``), a
        concurrent report saying another ``num_microbatches`` (today a 409 at its step
        row), and an expert placement without an ``order``, where the dense-coordinate
        index bounds a step by the world rather than the placed ranks."""
        return {k for k, n in added.items() if n == expected[k]}

    def _judge(self, conn: sa.Connection, info: SeriesInfo, topo: Topology, step: int, expected: int,
               rank_reports: list[RankReport], history) -> core.StepVerdict:
        """Run the engine on one step (``history``: its lazy loader). Never raises: an
        exception of the engine (or findings that cannot be stored) becomes the verdict
        ``audit_error`` with the exception as the step's one fault, logged once; nothing else
        of the batch is affected. (:class:`StepRowExists` from the history loader's flush
        is the batch's, not the step's: it passes.)"""
        try:
            v = core.audit_step(
                rank_reports, topo.sizes, info.engine_spec,
                num_microbatches=max(1, expected // topo.placed_count(info.engine_spec)),
                history=history, kind=info.kind, **topo.audit_args(),
            )
            json.dumps(json_safe([[[list(g.key), g.microbatch, g.count, g.mean, g.var] for g in v.groups],
                                  [f.evidence for f in v.faults]]), allow_nan=False)  # storable
            return v
        except StepRowExists:  # raised by the history loader's flush: the batch, not this step
            raise
        except Exception as exc:  # noqa: BLE001 - contained to this step (verdict audit_error)
            log.exception("audit of %s/%s step %d raised; recorded as audit_error", info.run_id, info.statistic, step)
            message = (f"the audit engine raised {type(exc).__name__}: {str(exc)[:500]} — this step has no verdict; "
                       "please report it with the step's reports (GET .../steps/{step})")
            fault = core.Fault(core.FaultKind.AUDIT_ERROR, message, [], {"exception": type(exc).__name__})
            return core.StepVerdict("audit_error", [fault], [], [], None, None)

    def _audit_steps(self, conn: sa.Connection, due: Sequence["_Due"], now: float,
                     fresh: dict[int, _Fresh] | None = None) -> list[tuple[int, int, str]]:
        """Audit steps (key order) inside the caller's transaction and record their verdicts
        with :meth:`auditor.db.store.Store.record_verdicts`; return ``(series_id, step,
        verdict)`` of those recorded (not those another transaction recorded first).

        ``fresh``: per series id, steps this transaction inserted every report of (no step
        row yet). Their clean steps are judged by :func:`auditor.core.batch.clean_columns`
        (one array pass per series) and recorded as columns (:class:`CleanSteps`: no object
        per step); the others join ``due``. The clean steps of ``due`` with their reports in
        hand are judged by the same pass, as StepVerdicts (:meth:`_audit_clean`); every other step (or
        every step, if that pass raises) by :func:`auditor.core.audit_step`, the one source
        of every finding. A step's reports are the rows in hand (``_Due.rows``) or read
        back. Verdicts wait to be written until the end, except that a step whose diagnosis
        needs the series' history first writes those of the steps before it, so it sees
        them as it did when each verdict was written at once."""
        store = self.store
        clean: list[CleanSteps] = []
        unclean: list[_Due] = []
        for sid in sorted(fresh or ()):
            f = fresh[sid]
            expected = [len(rs) for rs in f.rows]
            c = f.clean if f.judged else self._clean(f.info, f.topo, f.rows, expected)
            if c is not None and c.index:
                clean.append(CleanSteps.of(sid, f.steps, expected, c))
            judged = set(c.index) if c is not None else set()
            if len(judged) < len(f.steps):
                unclean += [_Due(f.info, f.topo, Arrival(sid, st, n, n, None), None, rs, fresh=True)
                            for i, (st, n, rs) in enumerate(zip(f.steps, expected, f.rows)) if i not in judged]
        if unclean:  # both kinds: key order
            due = sorted([*due, *unclean], key=lambda d: (d.arrival.series_id, d.arrival.step)) if due else unclean
        rows = {(d.arrival.series_id, d.arrival.step): d.rows for d in due}
        for d in due:
            if d.rows is None and core.batch.eligible(d.info.engine_spec, d.info.kind,
                                                      "known" if d.topo.known else "unknown"):
                rows[(d.arrival.series_id, d.arrival.step)] = store.report_rows(conn, d.arrival.series_id,
                                                                                d.arrival.step)
        fast = self._audit_clean(due, rows)
        pending: list[VerdictItem] = []
        recorded: list[tuple[int, int, str]] = []
        unstored: dict[int, set[int]] | None = None

        def flush(upto: tuple[int, int] | None = None) -> None:
            """Record the pending verdicts and the clean steps before ``upto`` (all: None)."""
            nonlocal clean
            if upto is None:
                take, clean = clean, []
            else:
                take, rest = [], []
                for c in clean:
                    if c.series_id == upto[0]:
                        before, after = c.split(upto[1])
                        take.append(before)
                        rest.append(after)
                    else:
                        (take if c.series_id < upto[0] else rest).append(c)
                clean = rest
            for it, ok in zip(pending, store.record_verdicts(conn, pending, now, take)):
                if ok:
                    recorded.append((it.series_id, it.step, it.verdict.verdict))
                elif it.fresh:
                    raise StepRowExists(it.series_id, it.step)
            for c in take:
                recorded.extend(zip(itertools.repeat(c.series_id), c.steps, itertools.repeat("consistent")))
            pending.clear()

        for d in due:
            info, p = d.info, d.arrival
            key = (p.series_id, p.step)
            v = fast.get(key)
            n = p.expected
            if v is None:
                rr = rows.get(key)
                reports = [rank_report(r) for r in rr] if rr is not None else store.step_reports(conn, info.id, p.step)
                n = len(reports)
                load = store.history(conn, info.id, p.step)

                def history(load=load, key=key):
                    flush(key)  # the verdicts of the steps before this one, as history
                    return load()

                v = self._judge(conn, info, d.topo, p.step, p.expected, reports, history)
            progress = None
            if any(f.kind == core.FaultKind.MISSING_REPORT for f in v.faults):
                if unstored is None:  # steps whose rows are inserted with their verdicts: not stored
                    unstored = defaultdict(set)  # yet, they still count as steps of their series
                    for x in due:  # for hang localisation (as count_arrivals' rows did)
                        if x.fresh:
                            unstored[x.arrival.series_id].add(x.arrival.step)
                    for sid, f in (fresh or {}).items():
                        unstored[sid].update(f.steps)
                progress = self._progress(conn, info, d.topo, unstored.get(info.id, ()))
            pending.append(VerdictItem(p.series_id, p.step, v, n >= p.expected, d.previous, progress, d.fresh,
                                       p.expected, p.received))
        flush()
        return recorded

    def _clean(self, info: SeriesInfo, topo: Topology, steps: Sequence[Sequence[tuple]],
               expected: Sequence[int]) -> core.batch.Clean | None:
        """:func:`auditor.core.batch.clean_columns` of steps of one series (``steps[i]``: the
        ``reports`` rows of step ``i``, ``expected[i]`` the reports it expects); None when
        the series is not eligible. An exception is logged and gives None: the exact engine
        judges every step instead."""
        if not core.batch.eligible(info.engine_spec, info.kind, "known" if topo.known else "unknown"):
            return None
        try:
            return core.batch.clean_columns(elements(steps), np.array(expected), topo.sizes, info.engine_spec,
                                            info.kind)
        except Exception:  # noqa: BLE001 - the exact engine judges every step instead
            log.exception("the batched audit raised; auditing each step on its own")
            return None

    def _audit_clean(self, due: Sequence["_Due"], rows: dict) -> dict[tuple[int, int], core.StepVerdict]:
        """The verdicts :func:`auditor.core.batch.clean_columns` gives, per (series_id,
        step), of the steps in ``due`` whose reports are in ``rows`` (:meth:`_clean`)."""
        out: dict[tuple[int, int], core.StepVerdict] = {}
        for _, group in itertools.groupby(due, key=lambda d: d.arrival.series_id):
            group = [d for d in group if rows.get((d.arrival.series_id, d.arrival.step)) is not None]
            if not group:
                continue
            c = self._clean(group[0].info, group[0].topo, [rows[(d.arrival.series_id, d.arrival.step)] for d in group],
                            [d.arrival.expected for d in group])
            if c is not None:
                for i, v in zip(c.index, c.verdicts()):
                    d = group[i]
                    out[(d.arrival.series_id, d.arrival.step)] = v
        return out

    def _audit(self, conn: sa.Connection, info: SeriesInfo, topo: Topology, p: Arrival, now: float,
               previous: str | None = None) -> str | None:
        """Audit one step (its reports read back) inside the caller's transaction and record
        the verdict; return it, or None if another transaction recorded it first.
        ``previous``: re-audit a step whose verdict ``previous`` was recorded while reports
        were missing."""
        done = self._audit_steps(conn, [_Due(info, topo, p, previous, None)], now)
        return done[0][2] if done else None

    def _progress(self, conn: sa.Connection, info: SeriesInfo, topo: Topology, unstored=()) -> dict:
        """Hang localisation: which ranks reached which step, from the newest
        :data:`PROGRESS_WINDOW` steps of the series. The ranks expected are the placed ranks
        (the world; by rank number when the placement and order allow), plus any that
        reported. ``{"newest_step", "ranks_behind", "at": [{"step", "ranks"}], "summary"}``,
        e.g. summary "ranks 0,2-3 stopped at step 39; rank 1 at 41"; a rank that sent nothing
        in the window sent nothing "since before" its first step, or "sent nothing" when it
        has no report of the series at all (looked up while the steps before the window hold
        at most :data:`PROGRESS_LOOKBACK_REPORTS` reports of the expected ranks; beyond, the
        "since before" form)."""
        lo, last = self.store.rank_progress(conn, info.id, PROGRESS_WINDOW, unstored)
        expected: set[int] = set(last)
        placed = topo.placed(info.engine_spec)
        if placed and topo.order:
            dims, sizes = topo.dims_sizes(info.engine_spec)
            fact = "expert" if dims == EXPERT_DIMS else "dense"
            sz = dict(zip(dims, sizes))
            axes = [placed[d] if d in placed else range(n) for d, n in zip(dims, sizes)]
            expected |= {layout.rank_of(dict(zip(dims, c)), sz, topo.order, fact) for c in itertools.product(*axes)}
        elif not placed:
            expected |= set(range(topo.world_size))
        newest = max(last.values(), default=lo)
        by_step: dict[int | None, list[int]] = defaultdict(list)
        for r in expected:
            by_step[last.get(r)].append(r)
        never: set[int] = set()
        if by_step.get(None):
            seen = self.store.ranks_reported_before(conn, info.id, lo, by_step[None],
                                                    max(1, PROGRESS_LOOKBACK_REPORTS // max(len(expected), 1)))
            never = set() if seen is None else set(by_step[None]) - seen
        at, parts = [], []
        for s, rs in sorted(by_step.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
            ranks = core.compress_ranks(rs)
            at.append({"step": s, "ranks": ranks})
            if s is None:
                earlier = [r for r in rs if r not in never]
                if never:
                    parts.append(f"{core.ranks_text(never)} sent nothing")
                if earlier:
                    parts.append(f"{core.ranks_text(earlier)} sent nothing since before step {lo}")
                continue
            who = core.ranks_text(rs)
            parts.append(f"{who} stopped at step {s}" if s < newest else f"{who} at {s}")
        behind = sum(len(rs) for s, rs in by_step.items() if s is None or s < newest)
        return {"newest_step": newest, "ranks_behind": behind, "at": at, "summary": "; ".join(parts)}

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
                if self._audit(conn, SeriesInfo.of(srow), topo, Arrival(series_id, step, 0, expected, previous),
                               now, previous=previous) is not None:
                    audited += 1
        return audited

    # ---------------------------------------------------------------------- lifecycle
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
        self._forget(run_id)
        world = max(1, run.world_size)
        counts = {"run_id": run_id, "reports": 0, "steps": 0, "statistics": len(sids)}
        chunks = 0
        for sid in sids:
            while True:
                if max_chunks is not None and chunks >= max_chunks:
                    return None
                chunks += 1
                with store.write() as conn:
                    steps = store.first_steps(conn, sid, chunk_rows)
                    if not steps:
                        break
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
        with store.write() as conn:
            store.delete_run_rows(conn, run_id, sids)
        self._forget(run_id)
        return counts

    def _forget(self, run_id: str) -> None:
        self._runs.pop(run_id, None)
        self._open.forget(run_id)
        for key in [k for k in self._series if k[0] == run_id]:
            self._series.pop(key, None)

    def idle_runs(self, idle_seconds: float, now: float | None = None, limit: int = 10) -> list[str]:
        """Runs with no report for ``idle_seconds``, oldest first, at most ``limit``."""
        now = time.time() if now is None else now
        with self.store.read() as conn:
            return self.store.idle_runs(conn, now - idle_seconds, limit)

    # -------------------------------------------------------------------------- reads
    def list_runs(self, status: str | None = None) -> list[dict]:
        """Every run (optionally of one ``status``) with its topology and per-statistic step
        counts, newest first."""
        return self.runs_page(status=status)[0]

    def runs_page(self, limit: int | None = None, after: tuple[float, str] | None = None,
                  status: str | None = None) -> tuple[list[dict], tuple[float, str] | None]:
        """Runs with their topology and per-statistic step counts, newest first, one keyset
        page at a time (``GET /v1/runs``).

        ``after``: (created_at, run_id) of the last run of the previous page; ``status``:
        ``inconsistent``, ``incomplete``, ``consistent`` or ``pending`` (:mod:`auditor.status`).
        Returns (runs, the key to pass as ``after`` for the next page, or None on the last page)."""
        if status is not None and status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}; got {status!r}")
        with self.store.read() as conn:
            run_rows = self.store.runs(conn, None if limit is None else limit + 1, after, status)
            more = limit is not None and len(run_rows) > limit
            run_rows = run_rows[:limit] if limit is not None else run_rows
            srows = self.store.series_rows(conn, [r.run_id for r in run_rows]) if run_rows else []
        by_run: dict[str, list] = defaultdict(list)
        for s in srows:
            by_run[s["run_id"]].append(s)
        last = (run_rows[-1].created_at, run_rows[-1].run_id) if more else None
        return [_run_summary(r, by_run[r.run_id]) for r in run_rows], last

    def get_run(self, run_id: str) -> dict:
        """One run's summary; raises :class:`NotFound`."""
        with self.store.read() as conn:
            r = self.store.run(conn, run_id)
            if r is None:
                raise NotFound(run_id)
            srows = self.store.series_rows(conn, run_id)
        return _run_summary(r, srows)

    def report(self, run_id: str, bad_steps_limit: int = 20, statistic: str | None = None,
               rank_rows: int = REPORT_RANK_ROWS) -> dict:
        """The consistency report of a run (``GET /v1/runs/{run_id}/report``).

        Served from the per-series aggregates plus, for at most ``bad_steps_limit`` bad
        steps per statistic (inconsistent first, then incomplete, by step), their faults
        and per-rank tables (recomputed from the step's stored reports, one step at a time).
        Bounded whatever the world: each table shows at most ``rank_rows`` rows (the ranks
        the step's faults name first, then the rest in rank order) and each fault lists at
        most as many ranks, with ``ranks_total``/``ranks_truncated`` telling the full
        count; at most :data:`REPORT_ROWS_BUDGET` rows in all (shared equally by the bad
        steps shown) and at most :data:`REPORT_AUDIT_BUDGET` reports re-audited. The full
        table is the step endpoint's (:meth:`step`). Raises :class:`NotFound`.
        """
        run = self.get_run(run_id)
        out = {k: run[k] for k in ("run_id", "world_size", "sizes", "order", "topology", "topology_source",
                                   "created_at", "last_activity") if k in run}
        out["statistics"] = []
        with self.store.read() as conn:
            series = [(s, self.store.bad_steps(conn, s["id"], bad_steps_limit))
                      for s in self.store.series_rows(conn, run_id, statistic, ordered=True)]
            shown = sum(len(b) for _, b in series)
            cap = min(rank_rows, REPORT_ROWS_BUDGET // max(1, shown))
            fault_cap = min(REPORT_FAULT_RANKS, max(16, REPORT_ROWS_BUDGET // max(1, shown)))
            budget = [REPORT_AUDIT_BUDGET]
            for s, bad_rows in series:
                out["statistics"].append(self._series_report(conn, s, run, bad_rows, (cap, fault_cap), budget))
        if statistic is not None and not out["statistics"]:
            raise NotFound(f"{run_id}/{statistic}")
        # one definition (auditor.status): an audit_error or an incomplete step is no
        # evidence of consistency; `consistent` is true only when the status is consistent
        out["status"] = statuses.combine(s["status"] for s in out["statistics"])
        out["consistent"] = statuses.is_consistent(out["status"])
        out["steps_incomplete"] = sum(s["steps_incomplete"] for s in out["statistics"])
        out["steps_unverified"] = sum(s["steps_unverified"] for s in out["statistics"])
        out["refused_reports"] = sum(s["refused_reports"] for s in out["statistics"])
        return out

    def _series_report(self, conn: sa.Connection, s, run: dict, bad_rows: Sequence, cap: tuple[int, int],
                       budget: list[int]) -> dict:
        store = self.store
        fault_counts = store.fault_counts(conn, s["id"])
        pending = store.pending_steps(conn, s["id"])
        info = SeriesInfo.of(SeriesRow(s["id"], s["run_id"], s["statistic"], s["kind"], s["spec"]))
        topo = Topology.of_summary(run)
        audited = sum(s[f"steps_{v}"] for v in core.VERDICTS)
        # a CP σ of steps audited with reports missing measures only the CP groups whose
        # peers all arrived: with no complete step, there is no CP figure to show
        complete = s["steps_consistent"] + s["steps_inconsistent"] + s["steps_audit_error"] + s["steps_unverified"]
        cp = {k: (s[k] if complete else None) for k in ("cp_disagreement_sigma", "worst_cp_disagreement_sigma",
                                                          "worst_cp_disagreement_step")}
        if complete and s["steps_incomplete"] and s["last_audited_step"] is not None:
            last = store.step_row(conn, s["id"], s["last_audited_step"])  # the latest figure is its step's
            if last is not None and last["verdict"] == "incomplete":
                cp["cp_disagreement_sigma"] = None
        return {
            "statistic": s["statistic"], "kind": s["kind"], "spec": s["spec"],
            "status": statuses.statistic_status(s),
            "steps_audited": audited, "steps_consistent": s["steps_consistent"],
            "steps_inconsistent": s["steps_inconsistent"], "steps_incomplete": s["steps_incomplete"],
            "steps_audit_error": s["steps_audit_error"], "steps_unverified": s["steps_unverified"],
            "steps_pending": pending,
            # verdicts a late report replaced (each such step's previous_verdict says which)
            "steps_reaudited": sum(s[f"superseded_{v}"] for v in REPLACEABLE),
            "first_bad_step": s["first_bad_step"], "last_bad_step": s["last_bad_step"],
            "last_audited_step": s["last_audited_step"],
            "faults": fault_counts,
            "cp_disagreement_sigma": cp["cp_disagreement_sigma"], "applied_error_sigma": s["applied_error_sigma"],
            "worst_cp_disagreement_sigma": cp["worst_cp_disagreement_sigma"],
            "worst_cp_disagreement_step": cp["worst_cp_disagreement_step"],
            "worst_applied_error_sigma": s["worst_applied_error_sigma"],
            "worst_applied_error_step": s["worst_applied_error_step"],
            "ranks_behind": s["ranks_behind"], "progress": s["progress"],
            "bad_steps": [self._report_step(conn, info, topo, row, cap, budget) for row in bad_rows],
            "bad_steps_shown": len(bad_rows),
            "bad_steps_total": s["steps_inconsistent"] + s["steps_incomplete"] + s["steps_audit_error"],
            # reports refused (409) for contradicting this statistic's stored ones
            "refused_reports": s["refused_reports"], "refused_first_step": s["refused_first_step"],
            "refused_last_step": s["refused_last_step"], "refused_at": s["refused_at"],
            "refused_kind": s["refused_kind"],
        }

    def _rank_table(self, conn: sa.Connection, info: SeriesInfo, topo: Topology, row) -> list[core.RankRow]:
        """The per-rank table of a step, recomputed from its stored reports (all of them: a
        rank's correct value is its expected group's); [] when the audit fails."""
        try:  # the per-rank table is recomputed; a read must never fail on odd data
            return core.audit_step(
                self.store.step_reports(conn, info.id, row["step"]), topo.sizes, info.engine_spec,
                num_microbatches=max(1, row["expected"] // topo.placed_count(info.engine_spec)), kind=info.kind,
                **topo.audit_args(),
            ).rows
        except Exception:  # noqa: BLE001 - the stored verdict (audit_error) already says it
            log.exception("per-rank table of %s/%s step %d", info.run_id, info.statistic, row["step"])
            return []

    def _step_head(self, conn: sa.Connection, info: SeriesInfo, row, fault_ranks: int | None,
                   named: set[int] | None = None) -> dict:
        """A step's verdict, counts, σ figures and faults; each fault lists at most
        ``fault_ranks`` ranks (all when None), with ``ranks_total`` and ``ranks_truncated``;
        ``named`` (if given) gains every rank a fault names."""
        faults = []
        for f in self.store.step_faults(conn, info.id, row["step"]):
            ranks = list(core.expand_ranks(f["ranks"]) or ())
            n = len(ranks)
            if named is not None:
                named.update(ranks)
            cut = fault_ranks is not None and n > fault_ranks
            faults.append({"kind": f["kind"], "message": f["message"], "ranks": ranks[:fault_ranks] if cut else ranks,
                           "ranks_total": n, "ranks_truncated": cut, "evidence": f["evidence"]})
        return {
            "step": row["step"], "verdict": row["verdict"], "audited_at": row["audited_at"],
            "previous_verdict": row["previous_verdict"], "verdict_changed_at": row["verdict_changed_at"],
            "reports": row["received"], "expected": row["expected"],
            "cp_disagreement_sigma": _cp_sigma(row["verdict"], row["cp_disagreement_sigma"]),
            "applied_error_sigma": row["applied_error_sigma"],
            "faults": faults,
        }

    def _report_step(self, conn: sa.Connection, info: SeriesInfo, topo: Topology, row, caps: tuple[int, int],
                     budget: list[int]) -> dict:
        """One of a report's bad steps: its head, and at most ``cap`` rows of its per-rank
        table, the rows of the ranks its faults name first (rank order), then the rest (rank
        order); each fault lists at most ``fault_cap`` ranks (``caps = (cap, fault_cap)``). ``budget[0]``: reports the response may still re-audit; a step past it keeps
        its head and ``ranks_total`` (the reports received) without rows."""
        cap, fault_cap = caps
        named: set[int] = set()
        out = self._step_head(conn, info, row, fault_cap, named)
        if cap <= 0 or budget[0] < row["received"]:
            out.update(ranks=[], ranks_total=row["received"], ranks_truncated=row["received"] > 0)
            return out
        budget[0] -= row["received"]
        rows = self._rank_table(conn, info, topo, row)
        first = heapq.nsmallest(cap, rows, key=lambda r: (r.rank not in named and not r.faults, r.rank, r.microbatch))
        out.update(ranks=[_row_json(r) for r in first], ranks_total=len(rows), ranks_truncated=len(rows) > len(first))
        return out

    def _step_detail(self, conn: sa.Connection, info: SeriesInfo, topo: Topology, row,
                     limit: int | None = None, after: tuple[int, int] | None = None) -> tuple[dict, tuple | None]:
        """A step's head (faults with every rank) and its per-rank table in (rank,
        microbatch) order: the rows after ``after``, at most ``limit`` (all when None).
        Returns the detail and the key of its last row when more rows follow (else None)."""
        out = self._step_head(conn, info, row, None)
        rows = sorted(self._rank_table(conn, info, topo, row), key=lambda r: (r.rank, r.microbatch))
        total = len(rows)
        if after is not None:
            rows = rows[bisect.bisect_right(rows, tuple(after), key=lambda r: (r.rank, r.microbatch)):]
        more = limit is not None and len(rows) > limit
        rows = rows[:limit] if more else rows
        out.update(ranks=[_row_json(r) for r in rows], ranks_total=total, ranks_truncated=more)
        return out, ((rows[-1].rank, rows[-1].microbatch) if more and rows else None)

    def steps(self, run_id: str, statistic: str, *, start: int | None = None, stop: int | None = None,
              verdict: str | None = None, limit: int = 1000, after: int | None = None) -> dict:
        """Step history of one statistic (``GET .../statistics/{statistic}/steps``): one
        summary per stored step row, in step order, never re-audited: step, verdict
        (``pending`` while open), reports received of expected, the σ figures and rounding
        tolerance (σ of the correct statistic), the fault kinds.

        ``start``/``stop``: inclusive step bounds; ``verdict``: ``consistent``,
        ``inconsistent``, ``incomplete`` or ``pending``; ``after``: the last step of the
        previous page. Returns ``{"run_id", "statistic", "kind", "steps": [...], "last"}``,
        ``last`` set when more steps may follow. Raises :class:`NotFound`."""
        lo = start if after is None else (after + 1 if start is None else max(start, after + 1))
        with self.store.read() as conn:
            found = self.store.series_rows(conn, run_id, statistic)
            if not found:
                raise NotFound(f"{run_id}/{statistic}" if self.store.run(conn, run_id) is not None else run_id)
            rows = self.store.step_rows(conn, found[0]["id"], start=lo, stop=stop, verdict=verdict, limit=limit + 1)
        more = len(rows) > limit
        rows = rows[:limit]
        return {
            "run_id": run_id, "statistic": statistic, "kind": found[0]["kind"],
            "steps": [{
                "step": r["step"], "verdict": r["verdict"] or "pending", "reports": r["received"],
                "expected": r["expected"], "cp_disagreement_sigma": _cp_sigma(r["verdict"], r["cp_disagreement_sigma"]),
                "applied_error_sigma": r["applied_error_sigma"], "tolerance_sigma": r["tolerance_sigma"],
                "fault_kinds": r["fault_kinds"].split(",") if r["fault_kinds"] else [], "audited_at": r["audited_at"],
            } for r in rows],
            "last": rows[-1]["step"] if more and rows else None,
        }

    def step(self, run_id: str, statistic: str, step: int, *, limit: int | None = None,
             after: tuple[int, int] | None = None) -> dict:
        """One step's verdict, faults and per-rank table (``GET .../steps/{step}``): the rows
        in (rank, microbatch) order after ``after`` (the ``last`` of the previous page), at
        most ``limit`` (all when None); ``ranks_total`` rows in all, ``last`` set when more
        follow. Raises :class:`NotFound`."""
        run = self.get_run(run_id)
        with self.store.read() as conn:
            found = self.store.series_rows(conn, run_id, statistic)
            if not found:
                raise NotFound(f"{run_id}/{statistic}")
            s = found[0]
            row = self.store.step_row(conn, s["id"], step)
            if row is None:
                raise NotFound(f"{run_id}/{statistic}/{step}")
            info = SeriesInfo.of(SeriesRow(s["id"], run_id, statistic, s["kind"], s["spec"]))
            topo = Topology.of_summary(run)
            detail, last = self._step_detail(conn, info, topo, row, limit, after)
        return {"run_id": run_id, "statistic": statistic, **detail, "last": last}

    def metric_series(self, since: float, max_series: int | None = None) -> list[dict]:
        """Per-series figures for /metrics (:meth:`auditor.db.store.Store.metric_series`)."""
        return self.store.metric_series(since, max_series)

    def _coordinate_conflict(self, conn: sa.Connection, taken: list[tuple[int, tuple]], batch: Sequence[Report],
                             index_of: dict[tuple, int]) -> ConflictError:
        """409 for reports whose (step, microbatch, coordinates) another rank already holds,
        stored or earlier in the same batch: naming both ranks and the shared coordinates."""
        conflicts = []
        for i, row in taken:
            sid, step, mb = row[0], row[1], row[2]
            other = self.store.rank_at(conn, sid, step, mb, tuple(row[4:8]))
            r = batch[i]
            entry = {"index": i, "run_id": r.run_id, "statistic": r.statistic, "step": r.step, "microbatch": mb,
                     "rank": r.rank, "other_rank": other, "coords": dict(zip(DIMS, r.coords.as_tuple())),
                     "fields": ["rank", "coords"]}
            j = index_of.get((sid, step, mb, other))
            if j is not None and j != i:
                entry["other_index"] = j
            conflicts.append(entry)
        first = conflicts[0]
        where = f"reports[{first['other_index']}]" if "other_index" in first else "a stored report"
        coords = ", ".join(f"{k}={v}" for k, v in first["coords"].items())
        message = (f"reports[{first['index']}] (rank {first['rank']}) and {where} (rank {first['other_rank']}) both "
                   f"claim coords {coords} of step {first['step']} microbatch {first['microbatch']}: one place in "
                   "the world holds one rank; nothing of this batch was stored")
        return ConflictError("coordinate_conflict", message, conflicts)


class PageReads:
    """The three reads of a run page (:class:`auditor.web.PageSource`) from a
    :class:`Service`: the same JSON documents as the endpoints they name."""

    def __init__(self, service: Service):
        self.service = service

    def report_json(self, run_id: str, *, bad_steps: int = 20, rank_rows: int = REPORT_RANK_ROWS) -> dict:
        """``GET /v1/runs/{run_id}/report``."""
        return self.service.report(run_id, bad_steps_limit=bad_steps, rank_rows=rank_rows)

    def steps_json(self, run_id: str, statistic: str, *, page_size: int = PAGE_STEPS) -> Iterator[dict]:
        """Every item of ``GET .../statistics/{statistic}/steps``, read ``page_size`` at a
        time: a consumer that does not keep them holds one page at most."""
        after = None
        while True:
            page = self.service.steps(run_id, statistic, limit=page_size, after=after)
            yield from page["steps"]
            after = page["last"]
            if after is None:
                return

    def step_json(self, run_id: str, statistic: str, step: int, *, limit: int | None = None,
                  after: tuple[int, int] | None = None) -> dict:
        """``GET .../statistics/{statistic}/steps/{step}``: the rank rows after ``after``, at
        most ``limit`` (every row when None), as one page (``ranks_total`` in all)."""
        out = self.service.step(run_id, statistic, step, limit=limit, after=after)
        out.pop("last")
        return out


def _cp_sigma(verdict: str | None, sigma: float | None) -> float | None:
    """A step's CP-disagreement σ as shown: none for a step audited ``incomplete`` (a CP
    peer's report is missing, so the figure covers only the groups that all arrived and
    would read as a measured 0)."""
    return None if verdict == "incomplete" else sigma


def _run_summary(r: RunRow, srows) -> dict:
    audited = sum(s[f"steps_{v}"] for s in srows for v in core.VERDICTS)
    bad = sum(s["steps_inconsistent"] for s in srows)
    errors = sum(s["steps_audit_error"] for s in srows)
    state = statuses.run_status(srows)
    topo = Topology(r.world_size, r.sizes, r.expert, r.order, r.known)  # the order as stored
    return {
        "run_id": r.run_id, **topo.describe(), "topology_source": r.source, "created_at": r.created_at,
        "last_activity": max((s["updated_at"] for s in srows), default=r.created_at),
        "statistics": sorted(s["statistic"] for s in srows),
        "steps_audited": audited, "steps_inconsistent": bad, "steps_audit_error": errors,
        "steps_incomplete": sum(s["steps_incomplete"] for s in srows),
        "steps_unverified": sum(s["steps_unverified"] for s in srows),
        "refused_reports": sum(s["refused_reports"] for s in srows),
        "status": state, "consistent": statuses.is_consistent(state),
    }


def _row_json(r: core.RankRow) -> dict:
    return json_safe({k: getattr(r, k) for k in r.__dataclass_fields__})


def _check_placed(i: int, r: Report, allowed: dict[str, set[int]]) -> None:
    """409 ``placement_conflict`` for a report from a rank outside the statistic's placement."""
    for d, ok in allowed.items():
        c = getattr(r.coords, d)
        if c not in ok:
            raise ConflictError(
                "placement_conflict",
                f"reports[{i}] comes from rank {r.rank} ({d}={c}), but statistic {r.statistic!r} of run "
                f"{r.run_id!r} lives only where {d} is in {sorted(ok)} (spec.placement); nothing of this batch "
                "was stored",
                [{"index": i, "run_id": r.run_id, "statistic": r.statistic, "step": r.step, "rank": r.rank,
                  "coords": {d: c}, "fields": [f"coords.{d}"]}],
                against_stored=False,
            )


def _microbatch_conflict(i: int, r: Report, other: int, against_stored: bool = True) -> ConflictError:
    return ConflictError(
        "conflicting_report",
        f"reports[{i}] (step {r.step}, rank {r.rank}) says num_microbatches={r.num_microbatches}, but other "
        f"reports of that step say {other}: every report of a step must give the same num_microbatches; "
        "nothing of this batch was stored",
        [{"index": i, "run_id": r.run_id, "statistic": r.statistic, "step": r.step,
          "microbatch": r.microbatch, "rank": r.rank, "fields": ["num_microbatches"]}],
        against_stored,
    )


def _conflict(clashes: list[tuple[int, tuple, tuple, tuple]], batch: Sequence[Report],
              within: int | None = None) -> ConflictError:
    """409 for reports that differ from one with the same key: the stored one, or (``within``:
    its index) an earlier one of the same batch."""
    conflicts = []
    for i, _key, stored, sent in clashes:
        stored, sent = dict(zip(COLUMNS, stored)), dict(zip(COLUMNS, sent))
        fields = list(dict.fromkeys(_wire_fields(stored, sent)))
        r = batch[i]
        conflicts.append({
            "index": i, "run_id": r.run_id, "statistic": r.statistic, "step": r.step,
            "microbatch": r.microbatch, "rank": r.rank, "fields": fields,
        })
    first = conflicts[0]
    if within is not None:
        message = (f"reports[{within}] and reports[{first['index']}] have the same (run, statistic, step, "
                   f"microbatch, rank) but differ in {', '.join(first['fields'])}; nothing of this batch "
                   "was stored")
    else:
        message = (f"{len(conflicts)} report(s) differ from the stored report with the same (run, statistic, "
                   f"step, microbatch, rank), e.g. reports[{first['index']}] (step {first['step']}, rank "
                   f"{first['rank']}) differs in {', '.join(first['fields'])}; the stored report stays, "
                   "nothing of this batch was stored")
    return ConflictError("conflicting_report", message, conflicts, against_stored=within is None)


#: ``reports`` column → the wire field it stores (409 bodies name wire fields).
_WIRE_FIELD = {
    **{f"local_{f}": f"local.{f}" for f in ("count", "sum", "sum_sq", "min", "max", "replicated_sum_sq")},
    **{f"applied_{f}": f"applied.{f}" for f in ("count", "sum", "sum_sq", "mean", "var")},
    **{d: f"coords.{d}" for d in DIMS},
}


def _wire_fields(stored: dict, sent: dict):
    """Wire names of the fields in which two ``reports`` rows differ (``non_finite`` holds
    the column names of NaN/Inf values, so a difference there names those fields)."""
    for c in COMPARED:
        if stored[c] == sent[c]:
            continue
        if c == "non_finite":
            names = set((stored[c] or "").split(",")) ^ set((sent[c] or "").split(","))
            yield from (_WIRE_FIELD.get(n, n) for n in sorted(names) if n)
        else:
            yield _WIRE_FIELD.get(c, c)


def _is_integrity_error(exc: BaseException) -> bool:
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
