"""The store: the only code that speaks SQL. Ingest, audit bookkeeping, sweep, reads.

Exactly-once auditing. Every step has one ``step_audits`` row. An ingest transaction
inserts its reports (``ON CONFLICT DO NOTHING``), then upserts the step rows it touched,
adding the number of reports it really inserted, ``RETURNING`` the new count. The upsert
takes the row lock, so concurrent transactions (threads, workers, replicas) that add to one
step serialize on it, and exactly one of them sees ``received == expected``; that one
audits the step in the same transaction. The verdict is written with
``UPDATE ... WHERE verdict IS NULL``, so the sweep (missing reports after the grace period)
and an ingest can never both record a verdict. On SQLite, write transactions are
``BEGIN IMMEDIATE`` and simply queue.
"""

from __future__ import annotations

import math
import operator
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from auditor import core
from auditor.db.engine import write_begin
from auditor.db.tables import faults, reports, runs, series, series_faults, step_audits
from auditor.schemas import DEFAULT_SPECS, DIMS, Report, RunRegistration, StatisticSpec

VERDICTS = ("consistent", "inconsistent", "incomplete")
_KEY = ("series_id", "step", "microbatch", "rank")
_COMPARED = tuple(c.name for c in reports.columns if c.name not in ("received_at",))
_REPORT_FIELDS = tuple(f for f in core.RankReport.__dataclass_fields__)
#: Column order of ``reports`` (and of the tuples :func:`report_values` builds). The key
#: comes first and ``received_at`` last, so ``row[:4]`` is the key and ``row[:-1]`` is what
#: an identical re-send must match.
_COLUMNS = tuple(c.name for c in reports.columns)
assert _COLUMNS[:4] == _KEY and _COLUMNS[-1] == "received_at" and _COLUMNS[:-1] == _COMPARED
_LOCAL_FIELDS = ("count", "sum", "sum_sq", "min", "max", "replicated_sum_sq")
_APPLIED_FIELDS = ("count", "sum", "sum_sq", "mean", "var")
_FLOAT_NAMES = tuple(f"local_{f}" for f in _LOCAL_FIELDS) + tuple(f"applied_{f}" for f in _APPLIED_FIELDS)
_NO_APPLIED = (None,) * len(_APPLIED_FIELDS)
#: Picks the RankReport fields (in dataclass order) out of a ``reports`` row tuple.
_AUDIT_FIELDS = operator.itemgetter(*(_COLUMNS.index(f) for f in _REPORT_FIELDS))
_GROUP_RANKS = _REPORT_FIELDS.index("group_ranks")
_APPLIED = _REPORT_FIELDS.index("applied")
#: Below this many rows a PostgreSQL batch is inserted with one ``INSERT ... RETURNING``.
_PG_COPY_MIN_ROWS = 32
_PG_COPY_TYPES = {"BIGINT": "int8", "INTEGER": "int4", "FLOAT": "float8", "BOOLEAN": "bool", "TEXT": "text"}


class ConflictError(Exception):
    """A batch contradicts what is stored (HTTP 409); nothing of the batch was stored.

    ``error`` is ``conflicting_report``, ``topology_conflict`` or ``spec_conflict``;
    ``conflicts`` lists ``{"index": i, "field": ..., ...}`` per offending report.
    """

    def __init__(self, error: str, message: str, conflicts: list[dict]):
        super().__init__(message)
        self.error, self.message, self.conflicts = error, message, conflicts


class NotFound(Exception):
    """No such run (HTTP 404)."""


@dataclass(frozen=True, slots=True)
class Topology:
    world_size: int
    sizes: tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class SeriesInfo:
    id: int
    run_id: str
    statistic: str
    kind: str
    spec: StatisticSpec


@dataclass
class IngestOutcome:
    accepted: int = 0
    duplicates: int = 0
    audited: list[tuple[int, int, str]] = field(default_factory=list)  # (series_id, step, verdict)


def _finite_or_none(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None


def _json_safe(obj: Any) -> Any:
    """JSON columns must not hold NaN/Inf (PostgreSQL's json rejects them)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def report_values(r: Report, series_id: int, now: float) -> tuple:
    """Flatten one wire report into a ``reports`` row, a tuple in :data:`_COLUMNS` order (the
    ingest hot path: no dict per report). NaN becomes NULL (SQLite cannot store NaN) and the
    names of all non-finite fields go to ``non_finite``."""
    loc, app, c = r.local, r.applied, r.coords
    vals = (loc.count, loc.sum, loc.sum_sq, loc.min, loc.max, loc.replicated_sum_sq) + (
        _NO_APPLIED if app is None else (app.count, app.sum, app.sum_sq, app.mean, app.var))
    non_finite = None
    try:  # one C-level pass for the common all-finite case
        finite = math.isfinite(math.fsum([v for v in vals if v is not None]))
    except OverflowError:  # finite values whose sum overflows: decide field by field
        finite = False
    if not finite:
        bad = [n for n, v in zip(_FLOAT_NAMES, vals) if v is not None and not math.isfinite(v)]
        if bad:
            non_finite = ",".join(bad)
            vals = tuple(None if v is not None and math.isnan(v) else v for v in vals)
    return (series_id, r.step, r.microbatch, r.rank, c.dp, c.cp, c.tp, c.pp, r.dtype, *vals[:6],
            app is not None, *vals[6:], non_finite,
            core.compress_ranks(r.group_ranks) if r.group_ranks is not None else None, now)


def _comparable(row: tuple) -> tuple:
    """What two reports with the same key must agree on (every column but ``received_at``)."""
    return row[:-1]


def _rank_report(row: Sequence) -> core.RankReport:
    """An :class:`core.RankReport` from a ``reports`` row tuple (:data:`_COLUMNS` order)."""
    v = list(_AUDIT_FIELDS(row))
    if v[_GROUP_RANKS] is not None:
        v[_GROUP_RANKS] = core.expand_ranks(v[_GROUP_RANKS])
    return core.RankReport(*v)


class Store:
    """All database access of the service. Thread-safe; holds no state but immutable caches
    (a run's topology and a series' kind/spec never change once stored)."""

    def __init__(self, engine: sa.Engine):
        self.engine = engine
        self.dialect = engine.dialect.name
        self._insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
        self._topology: dict[str, Topology] = {}
        self._series: dict[tuple[str, str], SeriesInfo] = {}
        names = ", ".join(f'"{c}"' for c in _COLUMNS)
        self._insert_sql = (f"INSERT INTO reports ({names}) VALUES ({', '.join('?' * len(_COLUMNS))}) "
                            "ON CONFLICT DO NOTHING")
        self._copy_sql = f"COPY reports ({names}) FROM STDIN (FORMAT BINARY)"
        mark = "%s" if self.dialect == "postgresql" else "?"
        self._step_sql = (f"SELECT {', '.join(f'{chr(34)}{f}{chr(34)}' for f in _REPORT_FIELDS)} FROM reports "
                          f"WHERE series_id = {mark} AND step = {mark}")
        self._copy_types = [
            _PG_COPY_TYPES["TEXT" if isinstance(c.type, sa.String) else c.type.compile(postgresql.dialect())]
            for c in reports.columns
        ] if self.dialect == "postgresql" else []

    # ------------------------------------------------------------------ runs and series
    def register_run(self, run_id: str, reg: RunRegistration, now: float | None = None) -> dict:
        """``PUT /v1/runs/{run_id}``: fix the topology and statistic specs. Idempotent;
        raises :class:`ConflictError` if it contradicts what is stored."""
        now = time.time() if now is None else now
        topo = Topology(reg.world_size, reg.sizes.as_tuple())
        with write_begin(self.engine) as conn:
            self._ensure_run(conn, run_id, topo, now, index=None)
            for name, st in reg.statistics.items():
                self._ensure_series(conn, run_id, name, st.kind, st.spec, now, index=None)
        return self.get_run(run_id)

    def _ensure_run(self, conn: sa.Connection, run_id: str, topo: Topology, now: float, index: int | None) -> None:
        stored = self._topology.get(run_id)
        if stored is None:
            conn.execute(
                self._insert(runs).values(
                    run_id=run_id, world_size=topo.world_size, created_at=now,
                    **dict(zip(DIMS, topo.sizes)),
                ).on_conflict_do_nothing()
            )
            row = conn.execute(sa.select(runs).where(runs.c.run_id == run_id)).one()
            stored = Topology(row.world_size, (row.dp, row.cp, row.tp, row.pp))
        if stored != topo:
            raise ConflictError(
                "topology_conflict",
                f"run {run_id!r} was registered with world_size={stored.world_size} "
                f"sizes={dict(zip(DIMS, stored.sizes))}; this report says world_size={topo.world_size} "
                f"sizes={dict(zip(DIMS, topo.sizes))}",
                [{"index": index, "field": "sizes"}] if index is not None else [],
            )

    def _ensure_series(
        self, conn: sa.Connection, run_id: str, statistic: str, kind: str, spec: StatisticSpec | None,
        now: float, index: int | None,
    ) -> SeriesInfo:
        info = self._series.get((run_id, statistic))
        if info is None:
            want = (spec or DEFAULT_SPECS[kind]).model_dump()
            conn.execute(
                self._insert(series).values(
                    run_id=run_id, statistic=statistic, kind=kind, spec=want, created_at=now, updated_at=now,
                ).on_conflict_do_nothing()
            )
            row = conn.execute(
                sa.select(series.c.id, series.c.kind, series.c.spec)
                .where(series.c.run_id == run_id, series.c.statistic == statistic)
            ).one()
            info = SeriesInfo(row.id, run_id, statistic, row.kind, StatisticSpec(**row.spec))
        if info.kind != kind or (spec is not None and spec != info.spec):
            raise ConflictError(
                "spec_conflict",
                f"statistic {statistic!r} of run {run_id!r} is kind={info.kind!r} spec={info.spec.model_dump()}; "
                f"this report says kind={kind!r} spec={spec.model_dump() if spec else None}",
                [{"index": index, "field": "spec" if info.kind == kind else "kind"}] if index is not None else [],
            )
        return info

    # ------------------------------------------------------------------------- ingest
    def ingest(self, batch: Sequence[Report], now: float | None = None) -> IngestOutcome:
        """Store a validated batch in one transaction and audit the steps it completes.

        Re-sent identical reports are counted as duplicates and change nothing. Raises
        :class:`ConflictError` (and stores nothing of the batch) when a report differs from
        a stored one with the same key, or contradicts its run's topology or its
        statistic's kind/spec.
        """
        now = time.time() if now is None else now
        out = IngestOutcome()
        new_topology: dict[str, Topology] = {}
        new_series: dict[tuple[str, str], SeriesInfo] = {}
        with write_begin(self.engine) as conn:
            series_of: dict[tuple[str, str], SeriesInfo] = {}
            last = None
            for i, r in enumerate(batch):
                sz = r.sizes
                same = (r.run_id, r.statistic, r.kind, r.world_size, sz.dp, sz.cp, sz.tp, sz.pp)
                if same == last and r.spec is None:
                    continue  # same run, topology and series as the report before: checked
                last = same
                topo = Topology(r.world_size, sz.as_tuple())
                if (self._topology.get(r.run_id) or new_topology.get(r.run_id)) != topo:
                    self._ensure_run(conn, r.run_id, topo, now, i)  # creates it, or raises
                    new_topology[r.run_id] = topo
                skey = (r.run_id, r.statistic)
                info = series_of.get(skey)
                if info is None or info.kind != r.kind or (r.spec is not None and r.spec != info.spec):
                    info = self._ensure_series(conn, r.run_id, r.statistic, r.kind, r.spec, now, i)
                    series_of[skey] = info
                    if skey not in self._series:
                        new_series[skey] = info

            rows: dict[tuple, tuple] = {}
            index_of: dict[tuple, int] = {}
            expected: dict[tuple[int, int], int] = {}
            for i, r in enumerate(batch):
                info = series_of[(r.run_id, r.statistic)]
                row = report_values(r, info.id, now)
                key = row[:4]
                prev = rows.get(key)
                if prev is not None:
                    if _comparable(prev) != _comparable(row):
                        raise self._conflict([(i, key, prev, row)], batch, within=index_of[key])
                    out.duplicates += 1
                    continue
                rows[key] = row
                index_of[key] = i
                sk = key[:2]
                n = r.world_size * r.num_microbatches
                if expected.setdefault(sk, n) != n:
                    raise self._microbatch_conflict(i, r, expected[sk] // r.world_size)

            # Key order: concurrent transactions take index locks in one order (no deadlocks).
            ordered = [rows[k] for k in sorted(rows)]
            # Fast path: one bulk statement that stores every row, or nothing if any key exists.
            all_new = bool(ordered) and self._insert_all_new(conn, ordered)
            if all_new:
                inserted_keys: Any = rows.keys()
            else:  # re-sends: find out row by row what is stored, and whether it is identical
                inserted = conn.execute(
                    self._insert(reports).on_conflict_do_nothing().returning(
                        reports.c.series_id, reports.c.step, reports.c.microbatch, reports.c.rank
                    ),
                    [dict(zip(_COLUMNS, row)) for row in ordered],
                ).all() if ordered else []
                inserted_keys = {tuple(k) for k in inserted}
                leftover = [k for k in rows if k not in inserted_keys]
                if leftover:
                    stored = self._fetch_reports(conn, leftover)
                    clashes = [
                        (index_of[k], k, stored[k], rows[k])
                        for k in leftover if _comparable(stored[k]) != _comparable(rows[k])
                    ]
                    if clashes:
                        raise self._conflict(clashes, batch)
                    out.duplicates += len(leftover)
            out.accepted = len(inserted_keys)

            added = Counter(k[:2] for k in inserted_keys)
            by_step: dict[tuple[int, int], list[tuple]] | None = None
            if added:
                stmt = self._insert(step_audits)
                stmt = stmt.on_conflict_do_update(
                    index_elements=["series_id", "step"],
                    set_={"received": step_audits.c.received + stmt.excluded.received},
                ).returning(
                    step_audits.c.series_id, step_audits.c.step, step_audits.c.received,
                    step_audits.c.expected, step_audits.c.verdict,
                )
                progress = conn.execute(stmt, [
                    {"series_id": s, "step": st, "received": n, "expected": expected[(s, st)], "first_seen": now}
                    for (s, st), n in sorted(added.items())
                ]).all()
                for p in progress:
                    if p.expected != expected[(p.series_id, p.step)]:
                        i = next(index_of[k] for k in sorted(rows) if k[:2] == (p.series_id, p.step))
                        world = batch[i].world_size
                        raise self._microbatch_conflict(i, batch[i], p.expected // world)
                by_id = {info.id: info for info in series_of.values()}
                for p in sorted(progress, key=lambda p: (p.series_id, p.step)):
                    if p.verdict is None and p.received >= p.expected:
                        info = by_id[p.series_id]
                        mine = None
                        if all_new and p.received == added[(p.series_id, p.step)]:
                            # Every stored report of the step is one this transaction just
                            # wrote: audit the rows in hand instead of reading them back.
                            if by_step is None:
                                by_step = defaultdict(list)
                                for row in ordered:
                                    by_step[row[:2]].append(row)
                            mine = [_rank_report(row) for row in by_step[(p.series_id, p.step)]]
                        v = self._audit(conn, info, self._topology.get(info.run_id) or new_topology[info.run_id],
                                        p.step, p.expected, now, mine)
                        if v is not None:
                            out.audited.append((p.series_id, p.step, v))
        self._topology.update(new_topology)
        self._series.update(new_series)
        return out

    def _insert_all_new(self, conn: sa.Connection, rows: list[tuple]) -> bool:
        """Insert ``rows`` (tuples in :data:`_COLUMNS` order) with one bulk driver call inside
        a savepoint. True if every row was stored; False, with nothing stored, if any key
        already exists (the caller then takes the row-by-row ``RETURNING`` path).

        PostgreSQL: binary ``COPY`` (a duplicate key fails it with a unique violation, after
        waiting for a concurrent writer of that key like any insert). SQLite: ``executemany``
        of ``INSERT ... ON CONFLICT DO NOTHING``, all rows stored iff the change count matches.
        """
        if self.dialect == "postgresql" and len(rows) < _PG_COPY_MIN_ROWS:
            return False  # SAVEPOINT + COPY + RELEASE cost more round trips than they save
        savepoint = conn.begin_nested()
        cur = conn.connection.driver_connection.cursor()
        try:
            if self.dialect == "postgresql":
                import psycopg

                try:
                    with cur.copy(self._copy_sql) as copy:
                        copy.set_types(self._copy_types)
                        for row in rows:
                            copy.write_row(row)
                except psycopg.errors.UniqueViolation:
                    savepoint.rollback()
                    return False
            else:
                cur.executemany(self._insert_sql, rows)
                if cur.rowcount != len(rows):
                    savepoint.rollback()
                    return False
        finally:
            cur.close()
        savepoint.commit()
        return True

    @staticmethod
    def _microbatch_conflict(i: int, r: Report, other: int) -> ConflictError:
        return ConflictError(
            "conflicting_report",
            f"reports[{i}] (step {r.step}, rank {r.rank}) says num_microbatches={r.num_microbatches}, but other "
            f"reports of that step say {other}: every report of a step must give the same num_microbatches; "
            "nothing of this batch was stored",
            [{"index": i, "run_id": r.run_id, "statistic": r.statistic, "step": r.step,
              "microbatch": r.microbatch, "rank": r.rank, "fields": ["num_microbatches"]}],
        )

    def _conflict(self, clashes: list[tuple[int, tuple, tuple, tuple]], batch: Sequence[Report],
                  within: int | None = None) -> ConflictError:
        """409 for reports that differ from one with the same key: the stored one, or (``within``:
        its index) an earlier one of the same batch."""
        conflicts = []
        for i, _key, stored, sent in clashes:
            stored, sent = dict(zip(_COLUMNS, stored)), dict(zip(_COLUMNS, sent))
            fields = [c for c in _COMPARED if stored[c] != sent[c]]
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
        return ConflictError("conflicting_report", message, conflicts)

    def _fetch_reports(self, conn: sa.Connection, keys: Iterable[tuple]) -> dict[tuple, tuple]:
        wanted = set(keys)
        by_series: dict[int, set[int]] = defaultdict(set)
        for s, st, _, _ in wanted:
            by_series[s].add(st)
        out = {}
        for s, steps in by_series.items():
            for row in conn.execute(
                sa.select(reports).where(reports.c.series_id == s, reports.c.step.in_(sorted(steps)))
            ).mappings():
                k = tuple(row[c] for c in _KEY)
                if k in wanted:
                    out[k] = tuple(row[c] for c in _COLUMNS)
        return out

    # -------------------------------------------------------------------------- audit
    def _step_reports(self, conn: sa.Connection, series_id: int, step: int) -> list[core.RankReport]:
        """Every stored report of one step. Read with the driver's cursor (one step can hold
        thousands of rows and this is on the verdict-latency path); SQLite's 0/1 ``applied``
        becomes a bool as SQLAlchemy would make it."""
        cur = conn.connection.driver_connection.cursor()
        try:
            cur.execute(self._step_sql, (series_id, step))
            rows = cur.fetchall()
        finally:
            cur.close()
        out = []
        fix_bool = self.dialect == "sqlite"
        for row in rows:
            if row[_GROUP_RANKS] is None and not fix_bool:
                out.append(core.RankReport(*row))
                continue
            v = list(row)
            if fix_bool:
                v[_APPLIED] = bool(v[_APPLIED])
            if v[_GROUP_RANKS] is not None:
                v[_GROUP_RANKS] = core.expand_ranks(v[_GROUP_RANKS])
            out.append(core.RankReport(*v))
        return out

    def _history(self, conn: sa.Connection, series_id: int, step: int):
        def load():
            hist: dict[tuple, list] = defaultdict(list)
            for row in conn.execute(
                sa.select(step_audits.c.step, step_audits.c.groups)
                .where(step_audits.c.series_id == series_id, step_audits.c.step < step,
                       step_audits.c.verdict.is_not(None))
                .order_by(step_audits.c.step.desc()).limit(core.STALE_LOOKBACK)
            ):
                for key, _mb, count, mean, var in row.groups or []:
                    hist[tuple(key)].append((row.step, count, mean, var))
            return {k: v[::-1] for k, v in hist.items()}
        return load

    def _audit(self, conn: sa.Connection, info: SeriesInfo, topo: Topology, step: int, expected: int,
               now: float, rank_reports: list[core.RankReport] | None = None) -> str | None:
        """Audit one step inside the caller's transaction; return the verdict, or None if
        another transaction recorded it first. ``rank_reports``: every stored report of the
        step, if the caller holds them (else they are read)."""
        if rank_reports is None:
            rank_reports = self._step_reports(conn, info.id, step)
        v = core.audit_step(
            rank_reports, topo.sizes, info.spec.to_core(),
            num_microbatches=max(1, expected // topo.world_size),
            history=self._history(conn, info.id, step), kind=info.kind,
        )
        groups = [[list(g.key), g.microbatch, g.count, g.mean, g.var] for g in v.groups]
        done = conn.execute(
            step_audits.update()
            .where(step_audits.c.series_id == info.id, step_audits.c.step == step, step_audits.c.verdict.is_(None))
            .values(
                verdict=v.verdict, audited_at=now,
                cp_disagreement_sigma=_finite_or_none(v.cp_disagreement_sigma),
                applied_error_sigma=_finite_or_none(v.applied_error_sigma),
                fault_kinds=",".join(map(str, v.fault_kinds)) or None, groups=_json_safe(groups),
            )
        ).rowcount
        if done != 1:
            return None
        # Lock order: step_audits row (above), then the series row, then series_faults rows.
        # The series row is updated before series_faults so that every auditing transaction
        # takes these locks in one order; the other way round, a transaction auditing two
        # steps with different fault kinds deadlocked with one auditing a third (PostgreSQL).
        bad = v.verdict == "inconsistent"
        latest = sa.or_(series.c.last_audited_step.is_(None), series.c.last_audited_step <= step)
        conn.execute(
            series.update().where(series.c.id == info.id).values(
                updated_at=now,
                **{f"steps_{v.verdict}": series.c[f"steps_{v.verdict}"] + 1},
                first_bad_step=sa.case(
                    (sa.and_(sa.literal(bad), sa.or_(series.c.first_bad_step.is_(None),
                                                     series.c.first_bad_step > step)), step),
                    else_=series.c.first_bad_step),
                last_bad_step=sa.case(
                    (sa.and_(sa.literal(bad), sa.or_(series.c.last_bad_step.is_(None),
                                                     series.c.last_bad_step < step)), step),
                    else_=series.c.last_bad_step),
                cp_disagreement_sigma=sa.case(
                    (latest, _finite_or_none(v.cp_disagreement_sigma)), else_=series.c.cp_disagreement_sigma),
                applied_error_sigma=sa.case(
                    (latest, _finite_or_none(v.applied_error_sigma)), else_=series.c.applied_error_sigma),
                last_audited_step=sa.case((latest, step), else_=series.c.last_audited_step),
            )
        )
        if v.faults:
            conn.execute(faults.insert(), [
                {"series_id": info.id, "step": step, "kind": str(f.kind), "ranks": core.compress_ranks(f.ranks),
                 "message": f.message, "evidence": _json_safe(f.evidence)}
                for f in v.faults
            ])
            counts: dict[str, int] = defaultdict(int)
            for f in v.faults:
                counts[str(f.kind)] += 1
            stmt = self._insert(series_faults)
            conn.execute(
                stmt.on_conflict_do_update(
                    index_elements=["series_id", "kind"],
                    set_={"count": series_faults.c.count + stmt.excluded.count},
                ),
                [{"series_id": info.id, "kind": k, "count": n} for k, n in sorted(counts.items())],
            )
        return v.verdict

    def sweep(self, grace_seconds: float, now: float | None = None, limit: int = 1000) -> int:
        """Audit steps still incomplete ``grace_seconds`` after their first report
        (``missing_report``). Safe to run on every replica at once: each step's verdict
        is recorded exactly once. Returns the number of steps this call audited."""
        now = time.time() if now is None else now
        with self.engine.connect() as conn:
            due = conn.execute(
                sa.select(step_audits.c.series_id, step_audits.c.step, step_audits.c.expected)
                .where(step_audits.c.verdict.is_(None), step_audits.c.first_seen <= now - grace_seconds)
                .order_by(step_audits.c.series_id, step_audits.c.step).limit(limit)
            ).all()
        audited = 0
        for series_id, step, expected in due:
            with write_begin(self.engine) as conn:
                info, topo = self._series_by_id(conn, series_id)
                if self._audit(conn, info, topo, step, expected, now) is not None:
                    audited += 1
        return audited

    def _series_by_id(self, conn: sa.Connection, series_id: int) -> tuple[SeriesInfo, Topology]:
        row = conn.execute(
            sa.select(series.c.id, series.c.run_id, series.c.statistic, series.c.kind, series.c.spec,
                      runs.c.world_size, runs.c.dp, runs.c.cp, runs.c.tp, runs.c.pp)
            .join(runs, runs.c.run_id == series.c.run_id).where(series.c.id == series_id)
        ).one()
        info = SeriesInfo(row.id, row.run_id, row.statistic, row.kind, StatisticSpec(**row.spec))
        return info, Topology(row.world_size, (row.dp, row.cp, row.tp, row.pp))

    # -------------------------------------------------------------------------- reads
    def list_runs(self) -> list[dict]:
        """Every run with its topology and per-statistic step counts, newest first."""
        with self.engine.connect() as conn:
            run_rows = conn.execute(sa.select(runs).order_by(runs.c.created_at.desc())).mappings().all()
            srows = conn.execute(sa.select(series)).mappings().all()
        by_run: dict[str, list] = defaultdict(list)
        for s in srows:
            by_run[s["run_id"]].append(s)
        return [self._run_summary(r, by_run[r["run_id"]]) for r in run_rows]

    def get_run(self, run_id: str) -> dict:
        """One run's summary; raises :class:`NotFound`."""
        with self.engine.connect() as conn:
            r = conn.execute(sa.select(runs).where(runs.c.run_id == run_id)).mappings().one_or_none()
            if r is None:
                raise NotFound(run_id)
            srows = conn.execute(sa.select(series).where(series.c.run_id == run_id)).mappings().all()
        return self._run_summary(r, srows)

    @staticmethod
    def _run_summary(r, srows) -> dict:
        audited = sum(s["steps_consistent"] + s["steps_inconsistent"] + s["steps_incomplete"] for s in srows)
        bad = sum(s["steps_inconsistent"] for s in srows)
        return {
            "run_id": r["run_id"], "world_size": r["world_size"],
            "sizes": {d: r[d] for d in DIMS}, "created_at": r["created_at"],
            "last_activity": max((s["updated_at"] for s in srows), default=r["created_at"]),
            "statistics": sorted(s["statistic"] for s in srows),
            "steps_audited": audited, "steps_inconsistent": bad, "consistent": bad == 0,
        }

    def report(self, run_id: str, bad_steps_limit: int = 20, statistic: str | None = None) -> dict:
        """The consistency report of a run (``GET /v1/runs/{run_id}/report``).

        Served from the per-series aggregates plus, for at most ``bad_steps_limit`` bad
        steps per statistic (inconsistent first, then incomplete, by step), their faults
        and per-rank tables (recomputed from the step's stored reports). Raises
        :class:`NotFound`.
        """
        run = self.get_run(run_id)
        out = {k: run[k] for k in ("run_id", "world_size", "sizes", "created_at", "last_activity")}
        out["statistics"] = []
        with self.engine.connect() as conn:
            q = sa.select(series).where(series.c.run_id == run_id).order_by(series.c.statistic)
            if statistic is not None:
                q = q.where(series.c.statistic == statistic)
            for s in conn.execute(q).mappings().all():
                out["statistics"].append(self._series_report(conn, s, run, bad_steps_limit))
        if statistic is not None and not out["statistics"]:
            raise NotFound(f"{run_id}/{statistic}")
        out["consistent"] = all(s["steps_inconsistent"] == 0 for s in out["statistics"])
        return out

    def _series_report(self, conn: sa.Connection, s, run: dict, limit: int) -> dict:
        fault_counts = dict(conn.execute(
            sa.select(series_faults.c.kind, series_faults.c.count)
            .where(series_faults.c.series_id == s["id"]).order_by(series_faults.c.kind)
        ).all())
        pending = conn.execute(
            sa.select(sa.func.count()).select_from(step_audits)
            .where(step_audits.c.series_id == s["id"], step_audits.c.verdict.is_(None))
        ).scalar_one()
        bad_rows = conn.execute(
            sa.select(step_audits)
            .where(step_audits.c.series_id == s["id"], step_audits.c.verdict.in_(("inconsistent", "incomplete")))
            .order_by((step_audits.c.verdict == "incomplete"), step_audits.c.step).limit(limit)
        ).mappings().all()
        info = SeriesInfo(s["id"], s["run_id"], s["statistic"], s["kind"], StatisticSpec(**s["spec"]))
        topo = Topology(run["world_size"], tuple(run["sizes"][d] for d in DIMS))
        audited = s["steps_consistent"] + s["steps_inconsistent"] + s["steps_incomplete"]
        return {
            "statistic": s["statistic"], "kind": s["kind"], "spec": s["spec"],
            "steps_audited": audited, "steps_consistent": s["steps_consistent"],
            "steps_inconsistent": s["steps_inconsistent"], "steps_incomplete": s["steps_incomplete"],
            "steps_pending": pending,
            "first_bad_step": s["first_bad_step"], "last_bad_step": s["last_bad_step"],
            "last_audited_step": s["last_audited_step"],
            "faults": fault_counts,
            "cp_disagreement_sigma": s["cp_disagreement_sigma"], "applied_error_sigma": s["applied_error_sigma"],
            "bad_steps": [self._step_detail(conn, info, topo, row) for row in bad_rows],
            "bad_steps_shown": len(bad_rows),
            "bad_steps_total": s["steps_inconsistent"] + s["steps_incomplete"],
        }

    def _step_detail(self, conn: sa.Connection, info: SeriesInfo, topo: Topology, row) -> dict:
        fault_rows = conn.execute(
            sa.select(faults.c.kind, faults.c.ranks, faults.c.message, faults.c.evidence)
            .where(faults.c.series_id == info.id, faults.c.step == row["step"]).order_by(faults.c.id)
        ).mappings().all()
        recomputed = core.audit_step(
            self._step_reports(conn, info.id, row["step"]), topo.sizes, info.spec.to_core(),
            num_microbatches=max(1, row["expected"] // topo.world_size), kind=info.kind,
        )
        return {
            "step": row["step"], "verdict": row["verdict"], "audited_at": row["audited_at"],
            "reports": row["received"], "expected": row["expected"],
            "cp_disagreement_sigma": row["cp_disagreement_sigma"],
            "applied_error_sigma": row["applied_error_sigma"],
            "faults": [
                {"kind": f["kind"], "message": f["message"], "ranks": list(core.expand_ranks(f["ranks"]) or ()),
                 "evidence": f["evidence"]}
                for f in fault_rows
            ],
            "ranks": [_row_json(r) for r in recomputed.rows],
        }

    def step(self, run_id: str, statistic: str, step: int) -> dict:
        """One step's verdict and per-rank table; raises :class:`NotFound`."""
        run = self.get_run(run_id)
        with self.engine.connect() as conn:
            s = conn.execute(
                sa.select(series).where(series.c.run_id == run_id, series.c.statistic == statistic)
            ).mappings().one_or_none()
            if s is None:
                raise NotFound(f"{run_id}/{statistic}")
            row = conn.execute(
                sa.select(step_audits).where(step_audits.c.series_id == s["id"], step_audits.c.step == step)
            ).mappings().one_or_none()
            if row is None:
                raise NotFound(f"{run_id}/{statistic}/{step}")
            info = SeriesInfo(s["id"], run_id, statistic, s["kind"], StatisticSpec(**s["spec"]))
            topo = Topology(run["world_size"], tuple(run["sizes"][d] for d in DIMS))
            return {"run_id": run_id, "statistic": statistic, **self._step_detail(conn, info, topo, row)}

    def metric_series(self, since: float) -> list[dict]:
        """Per-series aggregates for /metrics, for series active after ``since`` (Unix s)."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(series).where(series.c.updated_at >= since)
            ).mappings().all()
            ids = [r["id"] for r in rows]
            fcounts: dict[int, dict[str, int]] = defaultdict(dict)
            if ids:
                for sid, kind, n in conn.execute(
                    sa.select(series_faults.c.series_id, series_faults.c.kind, series_faults.c.count)
                    .where(series_faults.c.series_id.in_(ids))
                ):
                    fcounts[sid][kind] = n
        return [dict(r, faults=fcounts.get(r["id"], {})) for r in rows]


def _row_json(r: core.RankRow) -> dict:
    return _json_safe({k: getattr(r, k) for k in r.__dataclass_fields__})
