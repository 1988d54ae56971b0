"""``auditor.service._is_integrity_error``, which the ingest's retry path calls on every
exception: true for SQLAlchemy's and psycopg's integrity errors (real ones, from SQLite and
PostgreSQL), false for others, and never an exception of its own. It imported psycopg in
that path, and on a SQLite server under memory pressure that import met a half-imported
package: ``AttributeError: psycopg has no attribute errors``, a 500 hiding the real error."""

from __future__ import annotations

import sqlite3
import sys
import types

import psycopg
import pytest
import sqlalchemy as sa

from auditor.service import _is_integrity_error
from auditor.testing.postgres import PG_ADMIN_URL


def _raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("nothing raised")


def test_real_integrity_errors_are_recognised_and_others_are_not(tmp_path):
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'a.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (k INTEGER PRIMARY KEY)")
        conn.exec_driver_sql("INSERT INTO t VALUES (1)")
    with engine.connect() as conn:
        dup = _raised(lambda: conn.exec_driver_sql("INSERT INTO t VALUES (1)"))
        missing = _raised(lambda: conn.exec_driver_sql("INSERT INTO nope VALUES (1)"))
    engine.dispose()
    assert isinstance(dup, sa.exc.IntegrityError) and _is_integrity_error(dup)
    assert isinstance(missing, sa.exc.OperationalError) and not _is_integrity_error(missing)
    assert not _is_integrity_error(sqlite3.OperationalError("database is locked"))

    with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
        conn.execute("CREATE TEMP TABLE t (k int PRIMARY KEY, v int NOT NULL)")
        conn.execute("INSERT INTO t VALUES (1, 1)")
        unique = _raised(lambda: conn.execute("INSERT INTO t VALUES (1, 1)"))
        not_null = _raised(lambda: conn.execute("INSERT INTO t VALUES (2, NULL)"))
        zero = _raised(lambda: conn.execute("SELECT 1 / 0"))
    assert type(unique) is psycopg.errors.UniqueViolation and _is_integrity_error(unique)
    assert type(not_null) is psycopg.errors.NotNullViolation and _is_integrity_error(not_null)
    assert type(zero) is psycopg.errors.DivisionByZero and not _is_integrity_error(zero)
    assert not _is_integrity_error(MemoryError()) and not _is_integrity_error(RuntimeError("x"))


class _Broken(types.ModuleType):
    def __getattr__(self, name):
        raise RuntimeError(f"half-imported: {name}")


@pytest.mark.parametrize("module", [None, types.ModuleType("psycopg.errors"), _Broken("psycopg.errors")],
                         ids=["absent", "half-imported", "raising"])
def test_a_missing_or_half_imported_psycopg_is_never_an_exception(monkeypatch, module):
    """The module table as a SQLite-only install, or an import cut short by MemoryError,
    leaves it: the answer is False for anything but SQLAlchemy's error, and no exception."""
    if module is None:
        monkeypatch.delitem(sys.modules, "psycopg.errors", raising=False)
    else:
        monkeypatch.setitem(sys.modules, "psycopg.errors", module)
    monkeypatch.setattr(psycopg, "errors", None, raising=False)  # `import psycopg` half done
    assert _is_integrity_error(MemoryError()) is False
    assert _is_integrity_error(ValueError("x")) is False
    assert _is_integrity_error(sa.exc.IntegrityError("INSERT", {}, ValueError("dup"))) is True
