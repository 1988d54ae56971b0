"""``auditor db``: the database schema (Alembic migrations); and what ``serve`` and ``demo``
do to a database before starting (migrate an empty one, name it)."""

from __future__ import annotations

import os
from typing import Optional

import typer

from auditor.cli.root import app
from auditor.cli.errors import UsageError, errors_as_exit_2
from auditor.cli.options import DatabaseUrl, db_url
from auditor.cli.sources import require_existing_sqlite

db_app = typer.Typer(help="Database schema (Alembic migrations).", no_args_is_help=True)
app.add_typer(db_app, name="db")


def database_shown(url: str) -> str:
    """``url`` as ``auditor serve`` names it at start-up: password hidden, a relative SQLite
    path made absolute (the default ``./auditor.db`` is the current directory's)."""
    import sqlalchemy as sa

    u = sa.make_url(url)
    if u.get_backend_name() == "sqlite" and u.database and u.database != ":memory:" \
            and not u.database.startswith("file:"):
        u = u.set(database=os.path.abspath(os.path.expanduser(u.database)))
    return u.render_as_string(hide_password=True)


def ensure_schema(database_url: str) -> None:
    """Migrate an empty database to head, accept one at head (:func:`auditor.db.engine.ensure_schema`);
    anything else (another revision, a bad URL, an unreachable server) is a :class:`UsageError`."""
    from auditor.db import engine as engines

    engine = engines.make_engine(database_url)
    try:
        engines.ensure_schema(engine, database_url)
    except engines.SchemaError as e:
        raise UsageError(str(e)) from None
    finally:
        engine.dispose()


@db_app.command("upgrade")
@errors_as_exit_2
def db_upgrade(database_url: Optional[str] = DatabaseUrl, revision: str = typer.Argument("head")) -> None:
    """Apply migrations up to REVISION (default: head)."""
    from auditor.db.engine import upgrade

    upgrade(db_url(database_url), revision)
    typer.echo(f"database at {revision}")


@db_app.command("downgrade")
@errors_as_exit_2
def db_downgrade(revision: str = typer.Argument(..., help="Target revision, or 'base'."),
                 database_url: Optional[str] = DatabaseUrl) -> None:
    """Revert migrations down to REVISION ('base' drops every auditor table)."""
    from auditor.db.engine import downgrade

    downgrade(db_url(database_url), revision)
    typer.echo(f"database at {revision}")


@db_app.command("current")
@errors_as_exit_2
def db_current(database_url: Optional[str] = DatabaseUrl) -> None:
    """Print the database's schema revision and the code's head."""
    from auditor.db.engine import current_revision, head_revision, make_engine

    require_existing_sqlite(db_url(database_url))
    engine = make_engine(db_url(database_url))
    typer.echo(f"database: {current_revision(engine) or '(empty)'}  code head: {head_revision()}")
    engine.dispose()

