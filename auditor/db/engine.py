"""The one place that creates engines and knows dialect specifics, and the schema-version gate.

SQLite: WAL journal, a busy timeout, foreign keys on, and ``BEGIN IMMEDIATE`` for write
transactions (so two writers queue on the lock instead of failing to upgrade a read
lock). PostgreSQL: psycopg 3, ``READ COMMITTED`` (the ingest path relies on row locks,
not on snapshot isolation).
"""

from __future__ import annotations

import contextlib
import sqlite3
from importlib import resources
from pathlib import Path

from typing import TYPE_CHECKING

import sqlalchemy as sa

if TYPE_CHECKING:  # alembic is imported by the functions that use it: a read command needs none of it
    from alembic.config import Config

SQLITE_BUSY_TIMEOUT_MS = 30_000


class SchemaError(RuntimeError):
    """The database schema is not the one this code expects."""


def make_engine(url: str, *, lock_timeout: float | None = None, **kwargs) -> sa.Engine:
    """Create an engine for ``url`` with the dialect settings above.

    ``lock_timeout`` (s): longest wait for a lock before the statement fails with
    ``OperationalError`` (the API answers 503): SQLite's busy timeout (default
    :data:`SQLITE_BUSY_TIMEOUT_MS`), PostgreSQL's ``lock_timeout`` (default: none).
    Raises ``sqlalchemy.exc.ArgumentError`` for a malformed URL, for a SQLite file whose
    directory does not exist: a mistyped path must not silently become a new empty database
    (nor create directories), and for a file that is not a SQLite database (a log, a spool:
    every connection would fail on its first PRAGMA).
    """
    u = sa.make_url(url)
    if u.get_backend_name() == "sqlite":
        if u.database and u.database != ":memory:" and not u.database.startswith("file:"):
            path = Path(u.database).expanduser().absolute()
            if not path.parent.is_dir():
                raise sa.exc.ArgumentError(f"the directory of SQLite database {u.database} does not exist "
                                           f"({path.parent}); create it, or fix the path")
            if not _sqlite_header_or_empty(path):
                raise sa.exc.ArgumentError(f"{u.database} is not a SQLite database (its first bytes are not SQLite's "
                                           "header); fix the path")
        busy_ms = int(lock_timeout * 1000) if lock_timeout is not None else SQLITE_BUSY_TIMEOUT_MS
        engine = sa.create_engine(u, connect_args={"timeout": busy_ms / 1000, "check_same_thread": False}, **kwargs)
        _configure_sqlite(engine, busy_ms)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("pool_size", 10)
    if lock_timeout is not None:
        kwargs["connect_args"] = {**kwargs.get("connect_args", {}),
                                  "options": f"-c lock_timeout={int(lock_timeout * 1000)}"}
    return sa.create_engine(u, isolation_level="READ COMMITTED", **kwargs)


#: The first 16 bytes of every SQLite 3 database file (https://www.sqlite.org/fileformat.html §1.3).
SQLITE_HEADER = b"SQLite format 3\x00"


def _sqlite_header_or_empty(path: Path) -> bool:
    """False only for a file that holds bytes but not SQLite's header; True for a missing,
    empty or unreadable file (SQLite creates, initialises or reports those itself)."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_HEADER))
    except OSError:
        return True
    return not head or head == SQLITE_HEADER


def _fast_sqlite_binds() -> None:
    """Register identity adapters for ``None`` and ``bool`` with the ``sqlite3`` module
    (process-wide; idempotent). They change no value: ``None`` is still bound as NULL and
    ``True``/``False`` as the integers 1/0, exactly as without them.

    Why: CPython's ``sqlite3`` binds ``int``, ``float``, ``str`` and ``bytearray`` directly,
    but for any other type (``None`` and ``bool`` included) it first tries the adaptation
    protocol, whose failed ``__adapt__`` lookup raises and clears an AttributeError: ~400 ns
    per such parameter (CPython 3.11, ``Modules/_sqlite/cursor.c``). A registered adapter
    is found by one dict lookup instead (~90 ns). A ``reports`` row binds three NULLs and a
    bool on average (``local_replicated_sum_sq``, ``non_finite``, ``group_ranks``,
    ``applied``): the bulk insert went from 1.94 to 1.40 µs per row (docs/performance.md).
    ``{}.get`` is a C callable returning None for any key."""
    sqlite3.register_adapter(type(None), {}.get)
    sqlite3.register_adapter(bool, int)


def _configure_sqlite(engine: sa.Engine, busy_ms: int = SQLITE_BUSY_TIMEOUT_MS) -> None:
    _fast_sqlite_binds()

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: sqlite3.Connection, _record) -> None:
        dbapi_conn.isolation_level = None  # let SQLAlchemy's begin event emit BEGIN
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={busy_ms}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        immediate = conn.get_execution_options().get("sqlite_immediate", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def write_begin(engine: sa.Engine):
    """A transaction for writing: ``BEGIN IMMEDIATE`` on SQLite, a plain one elsewhere."""
    return engine.execution_options(sqlite_immediate=True).begin()


def alembic_config(url: str) -> Config:
    """Alembic configuration for ``url``, pointing at the migrations shipped in the package."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(resources.files("auditor.migrations")))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def head_revision() -> str:
    """The newest migration revision this code ships."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_revision(engine: sa.Engine) -> str | None:
    """The database's revision, or None for an empty database."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


#: Key of the PostgreSQL advisory lock that serializes schema changes ("auditor" in ASCII).
MIGRATION_LOCK_KEY = 0x61756469746F72


@contextlib.contextmanager
def migration_lock(url: str):
    """Serialize schema changes between processes: on PostgreSQL, a session-level advisory
    lock (``pg_advisory_lock``) held on a dedicated connection for the duration of the
    block, so replicas that start at once on an empty database migrate one after the other
    instead of colliding on ``CREATE TABLE``. The lock is released on exit, and by the
    server if the process dies. On SQLite (one file, one host) it does nothing."""
    u = sa.make_url(url)
    if u.get_backend_name() != "postgresql":
        yield
        return
    engine = sa.create_engine(u, poolclass=sa.pool.NullPool)
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
            try:
                yield
            finally:
                conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK_KEY})
    finally:
        engine.dispose()


def upgrade(url: str, revision: str = "head") -> None:
    """Apply migrations up to ``revision`` (``auditor db upgrade``), under :func:`migration_lock`."""
    from alembic import command

    with migration_lock(url):
        command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    """Revert migrations down to ``revision`` (``base`` empties the schema), under :func:`migration_lock`."""
    from alembic import command

    with migration_lock(url):
        command.downgrade(alembic_config(url), revision)


def ensure_schema(engine: sa.Engine, url: str) -> None:
    """Start-up gate of ``auditor serve``.

    An empty database is migrated to head; a database at head passes; a database at an
    older revision or at one this code does not know (newer code wrote it) raises
    :class:`SchemaError` with the command to run.
    """
    from alembic import command
    from alembic.script import ScriptDirectory

    current = current_revision(engine)
    head = head_revision()
    if current == head:
        return
    if current is None:
        # Several replicas may start at once on an empty database: the first to take the
        # lock migrates, the others wait, then find the schema at head.
        with migration_lock(url):
            current = current_revision(engine)
            if current == head:
                return
            if current is None:
                with engine.connect() as conn:
                    tables = sa.inspect(conn).get_table_names()
                if tables:
                    raise SchemaError(
                        f"database {engine.url.render_as_string(hide_password=True)} has tables {tables[:5]} "
                        "but no auditor schema version; refusing to touch it"
                    )
                command.upgrade(alembic_config(url), "head")
                return
    known = {rev.revision for rev in ScriptDirectory.from_config(alembic_config(url)).walk_revisions()}
    if current not in known:
        raise SchemaError(
            f"database schema revision {current} is newer than this auditor (head {head}); "
            "upgrade the auditor package, or point it at another database"
        )
    raise SchemaError(
        f"database schema revision {current} is older than this auditor's {head}; "
        f"run `auditor db upgrade --database-url {engine.url.render_as_string(hide_password=True)}`"
    )
