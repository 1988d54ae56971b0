"""The store: the only code that speaks SQL. Rows in, rows and dataclasses out.

A thin :class:`Store` over its parts: :mod:`~auditor.db.rows` (one result type per table
and the row codec), :mod:`~auditor.db.dialect` (SQL texts per dialect),
:mod:`~auditor.db.races` (the races a statement lost, for the caller's retry), and the
statements: :mod:`~auditor.db.runs` (runs and series, deletion),
:mod:`~auditor.db.reports` (reports), :mod:`~auditor.db.steps` (step rows and verdicts),
:mod:`~auditor.db.views` (the read models' reads). The names the store exported before the
split are re-exported here.

Every method takes the connection of a transaction the caller opened with :meth:`Store.write`
(``BEGIN IMMEDIATE`` on SQLite) or :meth:`Store.read`, so one flow of
:class:`auditor.service.Service` — ingest, find completed steps, audit them, record the
verdicts — runs inside one transaction. Nothing here decides a verdict, words an error or
shapes a response.

Exactly-once auditing. Every step has one ``step_audits`` row. An ingest transaction
inserts its reports (``ON CONFLICT DO NOTHING``), then upserts the step rows it touched
(:meth:`Store.count_arrivals`), adding the number of reports it really inserted,
``RETURNING`` the new count. The upsert takes the row lock, so concurrent transactions
(threads, workers, replicas) that add to one step serialize on it, and exactly one of them
sees ``received == expected``; that one audits the step in the same transaction. The verdict
is written with ``UPDATE ... WHERE verdict IS NULL`` (:meth:`Store.record_verdicts`), so the
sweep (missing reports after the grace period) and an ingest can never both record a
verdict. On SQLite, write transactions are ``BEGIN IMMEDIATE`` and simply queue.

A step whose every report one ingest transaction inserted (``auditor.service.judge.Judge.fresh_steps``) skips
the upsert: no other transaction can have made its row, so it is audited with the rows in
hand and its row INSERTed with the verdict (``ON CONFLICT DO NOTHING``; a row that exists
after all sends the batch the general way). On PostgreSQL the step-row statements run once
per batch over ``unnest`` arrays, not once per step.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from auditor.db.drops import DropStatements
from auditor.db.engine import write_begin
from auditor.db.races import ReportsExist, RowDeleted, StepRowExists
from auditor.db.reports import ReportStatements
from auditor.db.rows import (
    COLUMNS, COMPARED, KEY, Arrival, CleanSteps, RunRow, SeriesRow, VerdictItem, as_float, elements,
    finite_or_none, json_safe, json_scalar, rank_report, report_row,
)
from auditor.db.runs import RunStatements
from auditor.db.steps import StepStatements
from auditor.db.views import ViewStatements

__all__ = [
    "COLUMNS", "COMPARED", "KEY", "Arrival", "CleanSteps", "ReportsExist", "RowDeleted", "RunRow", "SeriesRow",
    "StepRowExists", "Store", "VerdictItem", "as_float", "elements", "finite_or_none", "json_safe", "json_scalar", "rank_report",
    "report_row",
]


class Store(RunStatements, ReportStatements, StepStatements, ViewStatements, DropStatements):
    """All SQL of the service. Thread-safe; holds no state but prepared statement text."""

    def __init__(self, engine: sa.Engine):
        self.engine = engine
        self.dialect = engine.dialect.name
        self._insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
        self._prepare_reports()
        self._prepare_steps()

    def write(self):
        """A write transaction (``BEGIN IMMEDIATE`` on SQLite): ``with store.write() as conn:``."""
        return write_begin(self.engine)

    def read(self):
        """A read-only connection: ``with store.read() as conn:``."""
        return self.engine.connect()

    def dispose(self) -> None:
        self.engine.dispose()
