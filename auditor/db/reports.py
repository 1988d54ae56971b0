"""The statements of ``reports`` rows: the bulk insert of an all-new batch (PostgreSQL's
binary ``COPY``, SQLite's multi-row ``VALUES``), the row-by-row insert of a batch holding
re-sends, and the reads of stored reports (by key, by step, by coordinates)."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable

import sqlalchemy as sa

from auditor.core import RankReport
from auditor.db import dialect as sql_text
from auditor.db.dialect import PG_COPY_MIN_ROWS, Statements, flatten, size_runs
from auditor.db.races import ReportsExist
from auditor.db.rows import APPLIED_COLUMN, COLUMNS, KEY, rank_report
from auditor.db.tables import reports


class ReportStatements(Statements):
    """Insert and read ``reports`` rows (a part of :class:`auditor.db.store.Store`)."""

    #: SQLite: (rows per statement, INSERT text), largest first (:meth:`_sqlite_insert`).
    _sqlite_chunks: list[tuple[int, str]] | None
    _copy_sql: str
    _copy_types: list[str]
    _step_sql: str

    def _prepare_reports(self) -> None:
        """The texts of this dialect's report statements (built once per store)."""
        self._sqlite_chunks = None
        self._copy_sql = sql_text.copy_reports_sql()
        self._copy_types = sql_text.copy_report_types() if self.dialect == "postgresql" else []
        self._step_sql = sql_text.step_reports_sql(self.dialect)

    def insert_all_new(self, conn: sa.Connection, rows: list[tuple],
                       meanwhile: Callable[[], None] | None = None) -> bool:
        """Insert ``rows`` (tuples in :data:`COLUMNS` order, in key order) with one bulk
        driver call: True when every row was stored. Raises :class:`ReportsExist` if any key
        (or any step's coordinates) is stored already; the caller rolls its transaction
        back and inserts with :meth:`insert_returning` instead. False, with nothing done,
        for a PostgreSQL batch under ``PG_COPY_MIN_ROWS`` rows (one ``INSERT ...
        RETURNING`` costs fewer round trips than ``COPY``).

        PostgreSQL: binary ``COPY`` (a duplicate key fails it with a unique violation, after
        waiting for a concurrent writer of that key like any insert). SQLite: ``INSERT ... ON
        CONFLICT DO NOTHING`` of up to :data:`auditor.db.dialect._SQLITE_ROWS_PER_INSERT` rows per statement
        (:meth:`_sqlite_insert`), all rows stored iff the change count matches.

        ``meanwhile()`` is called once the rows are sent and before their result is awaited
        (PostgreSQL: before the COPY's end, so the backend stores them meanwhile), or after
        the insert (SQLite); not when False is returned. Work it does is lost if
        :class:`ReportsExist` follows.

        No savepoint: a batch holding a stored report (a re-send) is rare, and rolling the
        whole transaction back then costs less than a savepoint on every batch did
        (SAVEPOINT and RELEASE were 7.6 % of a PostgreSQL ingest of 1,000-report batches,
        docs/performance.md)."""
        if self.dialect == "postgresql" and len(rows) < PG_COPY_MIN_ROWS:
            return False
        cur = conn.connection.driver_connection.cursor()
        try:
            if self.dialect == "postgresql":
                import psycopg

                try:
                    with cur.copy(self._copy_sql) as copy:
                        copy.set_types(self._copy_types)
                        for row in rows:
                            copy.write_row(row)
                        if meanwhile is not None:
                            meanwhile()
                except psycopg.errors.UniqueViolation:
                    raise ReportsExist() from None
            else:
                if self._sqlite_insert(cur, rows) != len(rows):
                    raise ReportsExist()
                if meanwhile is not None:
                    meanwhile()
        finally:
            cur.close()
        return True

    def _sqlite_insert(self, cur, rows: list[tuple]) -> int:
        """Insert ``rows`` (in order) with ``INSERT ... VALUES (...), (...), ... ON CONFLICT
        DO NOTHING`` statements of :data:`auditor.db.dialect._SQLITE_ROWS_PER_INSERT` rows, then of 16, then
        one by one (three statement texts, each prepared once per connection); the number
        of rows stored.

        Why: ``executemany`` of a one-row statement pays the driver's per-execution work
        (reset, clear, step, the row's sequence checks) and SQLite's statement start per
        row; a 256-row statement binds the same parameters (the rows flattened) with 1/256
        of it: 3.0 -> 2.3 µs per row stored, commit included (10,000-row batches into a
        growing file, docs/performance.md). The chunk shrinks if the SQLite build allows
        fewer variables per statement (``SQLITE_LIMIT_VARIABLE_NUMBER``; 32,766 by default
        since 3.32, 999 before)."""
        if self._sqlite_chunks is None:
            self._sqlite_chunks = sql_text.sqlite_insert_chunks(cur)
        stored = 0
        sqls = dict(self._sqlite_chunks)
        for k, start, end in size_runs(len(rows), list(sqls)):
            cur.executemany(sqls[k], rows[start:end] if k == 1 else
                            [tuple(flatten(rows[i:i + k])) for i in range(start, end, k)])
            stored += cur.rowcount
        return stored

    def insert_returning(self, conn: sa.Connection, rows: list[tuple]) -> set[tuple]:
        """Insert ``rows`` (key order), skipping keys already stored; the keys inserted."""
        if not rows:
            return set()
        inserted = conn.execute(
            self._insert(reports).on_conflict_do_nothing().returning(
                reports.c.series_id, reports.c.step, reports.c.microbatch, reports.c.rank
            ),
            [dict(zip(COLUMNS, row)) for row in rows],
        ).all()
        return {tuple(k) for k in inserted}

    def steps_expected(self, conn: sa.Connection, steps: Iterable[tuple[int, int]]) -> dict[tuple[int, int], int]:
        """``{(series_id, step): expected}`` of those of ``steps`` that have a step row."""
        by_series: dict[int, list[int]] = defaultdict(list)
        for sid, st in steps:
            by_series[int(sid)].append(int(st))
        out: dict[tuple[int, int], int] = {}
        for sid, sts in sorted(by_series.items()):
            for _, st, e in self._fetch_in(
                    conn, f"SELECT series_id, step, expected FROM step_audits WHERE series_id = {sid} AND step {{}}",
                    sorted(sts)):
                out[(sid, st)] = e
        return out

    def fetch_reports(self, conn: sa.Connection, keys: Iterable[tuple]) -> dict[tuple, tuple]:
        """The stored ``reports`` rows (:data:`COLUMNS` order) of ``keys``, by key."""
        wanted = set(keys)
        by_series: dict[int, set[int]] = defaultdict(set)
        for s, st, _, _ in wanted:
            by_series[s].add(st)
        out = {}
        for s, steps in by_series.items():
            for row in conn.execute(
                sa.select(reports).where(reports.c.series_id == s, reports.c.step.in_(sorted(steps)))
            ).mappings():
                k = tuple(row[c] for c in KEY)
                if k in wanted:
                    out[k] = tuple(row[c] for c in COLUMNS)
        return out

    def rank_at(self, conn: sa.Connection, series_id: int, step: int, microbatch: int,
                coords: tuple[int, int, int, int]) -> int | None:
        """The rank stored at these coordinates of a step and microbatch, or None."""
        c = reports.c
        dp, cp, tp, pp = coords
        return conn.execute(
            sa.select(c.rank).where(c.series_id == series_id, c.step == step, c.microbatch == microbatch,
                                    c.dp == dp, c.cp == cp, c.tp == tp, c.pp == pp)
        ).scalar_one_or_none()

    def report_rows(self, conn: sa.Connection, series_id: int, step: int) -> list[tuple]:
        """Every stored report of one step as ``reports`` row tuples (:data:`COLUMNS` order).
        Read with the driver's cursor (one step can hold thousands of rows and this is on
        the verdict-latency path); SQLite's 0/1 ``applied`` becomes a bool as SQLAlchemy
        would make it."""
        cur = conn.connection.driver_connection.cursor()
        try:
            cur.execute(self._step_sql, (series_id, step))
            rows = cur.fetchall()
        finally:
            cur.close()
        if self.dialect == "sqlite":
            a = APPLIED_COLUMN
            rows = [(*r[:a], bool(r[a]), *r[a + 1:]) for r in rows]
        return rows

    def steps_report_rows(self, conn: sa.Connection, series_id: int, first: int, last: int) -> list[tuple]:
        """Every stored report of the steps ``first``..``last`` (inclusive) of a series, as
        ``reports`` row tuples (:data:`COLUMNS` order) in step order: one indexed range read
        over the primary key; the caller bounds the range (the rows it may hold)."""
        c = reports.c
        q = (sa.select(*(c[n] for n in COLUMNS)).where(c.series_id == series_id, c.step >= first, c.step <= last)
             .order_by(c.step))
        return [tuple(r) for r in conn.execute(q)]

    def step_reports(self, conn: sa.Connection, series_id: int, step: int) -> list[RankReport]:
        """Every stored report of one step, as the engine's reports (:func:`rank_report`:
        ``group_ranks`` as the stored text)."""
        return [rank_report(r) for r in self.report_rows(conn, series_id, step)]
