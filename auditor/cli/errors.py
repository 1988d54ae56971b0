"""How the ``auditor`` command fails: one line on stderr and exit code 2 for every error a
user can cause (``check`` reserves exit 1 for "inconsistent"), exit 141 after a closed
stdout, and the wording of database and HTTP errors."""

from __future__ import annotations

import functools
import os
import sys

import typer

from auditor.defaults import DEFAULT_DATABASE_URL


class UsageError(Exception):
    """A user-facing error: printed as one line, exit code 2."""



def errors_as_exit_2(fn):
    """Turn the errors a user can cause (bad URL, unreachable service or database, unknown
    revision, missing driver) into one line on stderr and exit code 2 — never a traceback,
    and never exit 1, which `check` reserves for "inconsistent". Imports nothing until an
    error arrives (``auditor --help`` starts without SQLAlchemy, alembic or httpx)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BrokenPipeError:  # `auditor ... | head`: the reader left; end quietly, as CLI tools do
            quiet_broken_pipe()
        except (typer.Exit, typer.Abort, KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:  # noqa: BLE001 - one line, exit 2; a bug too, never exit 1 (which `check` reserves)
            msg = _error_line(e, kwargs)
        typer.echo(f"error: {msg}", err=True)
        raise typer.Exit(2)

    return wrapper


def _loaded(module: str):
    """``module`` if this process imported it, else None: an exception of its classes can
    only come from a module that was imported, so matching needs no import."""
    return sys.modules.get(module)


def _error_line(e: Exception, kwargs: dict) -> str:
    """The line :func:`errors_as_exit_2` prints for ``e``, raised by a command called with
    ``kwargs`` (its ``database_url``/``keep_database`` pick the database hint); a bug
    prints its traceback first and is ``unexpected <type>: <message>``."""
    httpx, sa, alembic_exc = _loaded("httpx"), _loaded("sqlalchemy"), _loaded("alembic.util.exc")
    offline_reader, reader = _loaded("auditor.offline_reader"), _loaded("auditor.reader")
    spool_errors = (offline_reader.SpoolReaderError, offline_reader.SpoolError) if offline_reader else ()
    http_errors = ((reader.ReaderError,) if reader else ()) + ((httpx.HTTPError, httpx.InvalidURL) if httpx else ())
    if isinstance(e, (UsageError, *spool_errors)):
        return str(e)
    if isinstance(e, http_errors):
        return http_error_message(e)
    if isinstance(e, OSError):  # a file that cannot be read or written: permissions, I/O error, disk full
        return f"{e.strerror}: {e.filename}" if e.strerror and e.filename else f"{type(e).__name__}: {e}"
    if isinstance(e, (ModuleNotFoundError, *((sa.exc.ArgumentError, sa.exc.NoSuchModuleError) if sa else ()))):
        return f"bad database URL: {e}{database_url_hint(kwargs.get('database_url') or kwargs.get('keep_database'))}"
    if sa and isinstance(e, sa.exc.OperationalError):
        return (f"cannot reach the database: {str(e.orig or e).strip().splitlines()[0]}"
                f"{database_url_hint(kwargs.get('database_url'))}")
    if alembic_exc and isinstance(e, alembic_exc.CommandError):
        return f"migration: {e}"
    import traceback

    traceback.print_exc()
    return f"unexpected {type(e).__name__}: {e}"


#: Exit status after stdout was closed by its reader (``| head``): 128 + SIGPIPE, what a
#: tool killed by SIGPIPE gives.
BROKEN_PIPE_EXIT = 141


def quiet_broken_pipe() -> None:
    """Stdout's reader left: point stdout at /dev/null (so the interpreter's last flush
    says nothing) and exit :data:`BROKEN_PIPE_EXIT`, with no message."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    raise SystemExit(BROKEN_PIPE_EXIT)


def database_url_hint(url: str | None) -> str:
    """What the right form of a database URL is, for the mistakes people make (a bare path,
    ``postgres://``, ``sqlite:///`` with a relative path — three slashes then a path relative
    to the current directory, four for an absolute one); empty when ``url`` is none of them."""
    url = (url if url is not None else os.environ.get("AUDITOR_DATABASE_URL") or DEFAULT_DATABASE_URL).strip()
    if "://" not in url:
        path = os.path.abspath(os.path.expanduser(url))
        return (f" — {url!r} is a path, not a URL: a SQLite file is sqlite:///{path} (sqlite:/// then the absolute "
                "path, four slashes in all); PostgreSQL is postgresql+psycopg://user@host/db")
    scheme, _, rest = url.partition("://")
    if scheme in ("postgres", "postgresql", "pgsql"):
        creds, at, host = rest.rpartition("@")
        user, colon, _password = creds.partition(":")
        shown = f"{user}{':***' if colon else ''}{at}{host}"  # the password is not repeated
        return f" — SQLAlchemy spells PostgreSQL with its driver: postgresql+psycopg://{shown}"
    if scheme.startswith("sqlite") and not rest.startswith("/"):
        return f" — a SQLite URL is sqlite:/// then a path: sqlite:///{os.path.abspath(rest)}"
    if scheme.startswith("sqlite") and rest.startswith("/") and not rest.startswith("//") and rest[1:] != ":memory:":
        return (f" — sqlite:///{rest[1:]} is relative to the current directory ({os.path.abspath(rest[1:])}); an "
                f"absolute path takes four slashes: sqlite:////{rest[1:].lstrip('/')}")
    if not scheme.startswith(("sqlite", "postgresql")):
        return (f" — the auditor stores in SQLite (sqlite:///path) or PostgreSQL (postgresql+psycopg://user@host/db); "
                f"{scheme.split('+')[0]!r} is not supported")
    return ""



#: What to check after an HTTP error status, by status.
_HTTP_HINTS = {401: "check --token (or AUDITOR_READ_TOKEN / AUDITOR_TOKEN)",
               403: "check --token (or AUDITOR_READ_TOKEN / AUDITOR_TOKEN)",
               404: "is --url the service's base URL, e.g. http://host:8000?"}


def http_error_message(exc: BaseException, timeout: float | None = None) -> str:
    """One line for an HTTP error of a command that reads from a service: the URL, the
    status (or what failed on the network) and what to check. ``exc``: a
    :class:`auditor.reader.ReaderError`, an ``httpx.HTTPStatusError`` or another
    ``httpx.HTTPError``/``InvalidURL``."""
    import httpx

    from auditor.reader import ReaderError

    if isinstance(exc, ReaderError) and (exc.what is not None or exc.status is None):
        return str(exc) + (" — --timeout sets the first wait" if exc.status is None and "no whole answer" in str(exc)
                           else "")
    if isinstance(exc, (ReaderError, httpx.HTTPStatusError)):
        if isinstance(exc, ReaderError):
            where, status, problem = exc.url, exc.status, exc.problem
        else:
            where, status = str(exc.request.url), exc.response.status_code
            try:
                problem = exc.response.json()
            except ValueError:
                problem = exc.response.text
        if isinstance(problem, dict):
            problem = problem.get("detail") or problem.get("title") or problem
        detail = " ".join(str(problem).split())[:200]
        hint = _HTTP_HINTS.get(status, "the service failed: see its log" if status >= 500 else "")
        return f"{where} answered HTTP {status}: {detail}" + (f" — {hint}" if hint else "")
    where = getattr(getattr(exc, "request", None), "url", None) if not isinstance(exc, httpx.InvalidURL) else None
    if isinstance(exc, httpx.TimeoutException):
        within = f" within {timeout:g} s" if timeout else ""
        return f"no answer from {where}{within} ({type(exc).__name__}; --timeout sets the wait)"
    return f"cannot reach the auditor service{f' at {where}' if where else ''}: {type(exc).__name__}: {exc}"

