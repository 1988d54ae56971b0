"""The one exception -> problem table of the HTTP layer (auditor.server.errors) and what a
database error means (auditor.db.errors.classify), which the table asks instead of naming
SQLAlchemy: a storage failure (disk full, read-only) is a 503 recorded for /readyz, a
passing condition (locked, dropped connection) a 503, anything else a 500."""

from __future__ import annotations

import sqlite3

import pytest
import sqlalchemy as sa

from auditor.config import Settings
from auditor.db.errors import DRIVER_ERRORS, DatabaseError, classify, storage_failure


def _sqlite_error(message: str, code: int) -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError(message)
    exc.sqlite_errorcode = code  # what the driver sets from the result code
    return exc


class _PgError(Exception):
    """A psycopg error as far as classify reads it: its SQLSTATE."""

    def __init__(self, message: str, sqlstate: str):
        super().__init__(message)
        self.sqlstate = sqlstate


@pytest.mark.parametrize(("exc", "kind", "words"), [
    (sa.exc.OperationalError("INSERT", {}, _sqlite_error("database or disk is full", 13)), "storage",
     "disk full: database or disk is full"),
    (sa.exc.OperationalError("INSERT", {}, _sqlite_error("attempt to write a readonly database", 8)), "storage",
     "read-only: attempt to write a readonly database"),
    (_sqlite_error("disk I/O error", 10 | (3 << 8)), "storage", "I/O error: disk I/O error"),  # an extended code
    (sa.exc.InternalError("INSERT", {}, _PgError("cannot execute INSERT in a read-only transaction", "25006")),
     "storage", "read-only: cannot execute INSERT in a read-only transaction"),
    (sa.exc.OperationalError("SELECT", {}, _sqlite_error("database is locked", 5)), "unavailable", None),
    (sa.exc.TimeoutError("QueuePool limit reached"), "unavailable", None),
    (sa.exc.DBAPIError("SELECT", {}, _PgError("server closed the connection", "08006"),
                       connection_invalidated=True), "unavailable", None),
    (sa.exc.IntegrityError("INSERT", {}, sqlite3.IntegrityError("UNIQUE constraint failed")), None, None),
    (sqlite3.OperationalError("database is locked"), None, None),  # a driver's own error never passes
    (ValueError("not a database error"), None, None),
])
def test_classify_says_what_a_database_error_means(exc, kind, words):
    """Storage failures by SQLite result code (extended codes by their primary byte) or
    PostgreSQL SQLSTATE, worded with the driver's message; passing conditions by
    SQLAlchemy's exception type or an invalidated connection; nothing else."""
    assert classify(exc) == kind
    assert storage_failure(exc) == words


def test_every_exception_of_the_table_has_its_handler_on_the_app(tmp_path):
    """create_app registers the handler of every row of the table, the database's base error
    and each driver's error among them, and nothing else."""
    from auditor.server.app import create_app
    from auditor.server.errors import PROBLEMS

    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'a.db'}"))
    assert {t: app.exception_handlers.get(t) for t in PROBLEMS} == PROBLEMS
    assert DatabaseError in PROBLEMS and sqlite3.Error in DRIVER_ERRORS
    assert all(t in PROBLEMS for t in DRIVER_ERRORS)
