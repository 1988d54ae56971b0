"""Throw-away PostgreSQL databases with unique names, so parallel runs never collide."""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Callable, Iterator

#: Maintenance database to create and drop the throw-away ones from (trust auth on localhost).
PG_ADMIN_URL = os.environ.get("AUDITOR_TEST_PG", "postgresql://127.0.0.1:5432/postgres")


def create_database(tag: str, admin_url: str = PG_ADMIN_URL) -> tuple[str, Callable[[], None]]:
    """Create an empty database ``<tag>_<8 hex>``; return its SQLAlchemy URL
    (``postgresql+psycopg://...``) and a function that drops it (``WITH (FORCE)``).
    Raises ``psycopg.OperationalError`` when PostgreSQL is unreachable."""
    import psycopg

    name = f"{tag}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")

    def drop() -> None:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return f"{base}/{name}", drop


@contextlib.contextmanager
def database(tag: str, admin_url: str = PG_ADMIN_URL) -> Iterator[str]:
    """``with database("bench") as url:`` — an empty database, dropped afterwards."""
    url, drop = create_database(tag, admin_url)
    try:
        yield url
    finally:
        drop()
