"""What a database error means for the caller, without the caller naming SQLAlchemy or a driver.

The HTTP layer (:mod:`auditor.server.errors`) registers its handlers for
:data:`DatabaseError` and :data:`DRIVER_ERRORS` and asks :func:`classify` what one says:
the database cannot store writes (disk full, I/O error, read-only: a 503 until a write
succeeds again), it is unavailable or busy for a while (unreachable, locked, pool exhausted,
a dropped connection: a 503), or neither (a 500). :func:`probe` is the readiness check that
runs SQL (``/readyz``).
"""

from __future__ import annotations

import contextlib
import sqlite3
from typing import Literal

import sqlalchemy as sa

from auditor.db.engine import current_revision

#: The base class of every error SQLAlchemy raises (what ``Store`` calls raise when the
#: database fails): the server's handler is registered for it.
DatabaseError = sa.exc.SQLAlchemyError

#: Driver errors that can reach a caller unwrapped (the store's raw cursors): sqlite3's, and
#: psycopg's with the postgres extra.
DRIVER_ERRORS: tuple[type[BaseException], ...] = (sqlite3.Error,)
with contextlib.suppress(ImportError):  # the postgres extra
    import psycopg

    DRIVER_ERRORS += (psycopg.Error,)

#: SQLite's primary result codes of a database that cannot store a write (sqlite3.h):
#: SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN.
_SQLITE_STORAGE = {8: "read-only", 10: "I/O error", 13: "disk full", 14: "cannot open the database file"}
#: PostgreSQL SQLSTATEs of the same: disk_full, io_error, read_only_sql_transaction.
_PG_STORAGE = {"53100": "disk full", "58030": "I/O error", "25006": "read-only"}


def storage_failure(exc: BaseException) -> str | None:
    """What ``exc`` (a SQLAlchemy or driver error) says about the database's storage, in a
    few words and the driver's message ("disk full: database or disk is full"), when it
    says a write cannot be stored; None for any other error (locks, timeouts, a dropped
    connection, bad input)."""
    orig = getattr(exc, "orig", None) or exc
    code = getattr(orig, "sqlite_errorcode", None)
    what = (_SQLITE_STORAGE.get(code & 0xFF) if isinstance(code, int)
            else _PG_STORAGE.get(str(getattr(orig, "sqlstate", None) or "")))
    return None if what is None else f"{what}: {str(orig).strip()[:200]}"


def is_unavailable(exc: BaseException) -> bool:
    """Database conditions that pass: unreachable, locked, pool exhausted, deadlock, lock
    timeout, connection dropped mid-request."""
    if isinstance(exc, (sa.exc.OperationalError, sa.exc.TimeoutError, sa.exc.InterfaceError)):
        return True
    return isinstance(exc, sa.exc.DBAPIError) and bool(exc.connection_invalidated)


def classify(exc: BaseException) -> Literal["storage", "unavailable"] | None:
    """``"storage"`` when ``exc`` says the database cannot store writes
    (:func:`storage_failure`), ``"unavailable"`` when it is unavailable or busy for a while
    (:func:`is_unavailable`; a driver's own error never is), None for anything else."""
    if storage_failure(exc) is not None:
        return "storage"
    if is_unavailable(exc):
        return "unavailable"
    return None


def probe(engine: sa.Engine, write: bool) -> tuple[bool, str, BaseException | None]:
    """One readiness probe of ``engine``: ``(ok, message, write error)``. It reads the schema
    revision; with ``write`` (writes have been failing) it also commits a write that changes
    nothing (the schema revision set to itself) and returns the database error that raised,
    if any (else None): tried only then, so a probe never competes with ingest for the
    write lock while writes succeed. Raises nothing."""
    failed = None
    try:
        current_revision(engine)
        if write:
            try:
                with engine.begin() as conn:
                    conn.execute(sa.text("UPDATE alembic_version SET version_num = version_num"))
            except sa.exc.SQLAlchemyError as exc:  # a storage failure, or a lock: not cleared either way
                failed = exc
    except Exception as exc:  # noqa: BLE001 - reported by /readyz
        return False, f"{type(exc).__name__}: {str(exc)[:200]}", None
    return True, "ok", failed
