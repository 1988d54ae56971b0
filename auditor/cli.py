"""The ``auditor`` command (typer)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from enum import Enum
from typing import Optional

import typer
from rich.console import Console

from auditor import status as _status
from auditor.config import DEFAULT_DATABASE_URL, Settings

app = typer.Typer(help="Audit the statistics distributed trainers all-reduce across ranks.",
                  no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode="markdown")


def _version(value: bool) -> None:
    if value:
        from auditor import __version__

        typer.echo(f"auditor {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Audit the statistics distributed trainers all-reduce across ranks."""
db_app = typer.Typer(help="Database schema (Alembic migrations).", no_args_is_help=True)
app.add_typer(db_app, name="db")

DatabaseUrl = typer.Option(
    None, "--database-url", envvar="AUDITOR_DATABASE_URL",
    help=f"SQLAlchemy URL [default: {DEFAULT_DATABASE_URL}]",
)
ServiceUrl = typer.Option(
    None, "--url", envvar="AUDITOR_URL",
    help="Base URL of a running auditor service; without it the database is read directly.",
)
Timeout = typer.Option(
    10.0, "--timeout", min=0.01,
    help="Seconds for the service's first whole answer (connecting included: a host that accepts connections "
         "and never answers, or trickles its answer, fails after this); once it answered, each request may take "
         "max(--timeout, 60) s in all, and the command 600 s waiting on the service.")

#: Seconds one command may spend waiting on the service in all (every request of it).
COMMAND_SECONDS = 600.0
#: Seconds each request after the first (the service's ``/healthz``) may take in all, at least.
READ_SECONDS = 60.0


def _header_token(value: str | None) -> str | None:
    """``--token`` is sent as ``Authorization: Bearer <token>``: printable ASCII only (httpx
    raised UnicodeEncodeError for any other character: a traceback, "unexpected" exit 2)."""
    from auditor.reader import header_safe

    if value and not header_safe(value):
        raise typer.BadParameter("must be printable ASCII (it is sent in the Authorization header)")
    return value


ReadToken = typer.Option(
    None, "--token", envvar=["AUDITOR_READ_TOKEN", "AUDITOR_TOKEN"], callback=_header_token,
    help="Bearer token for a service that requires one (env AUDITOR_READ_TOKEN, else AUDITOR_TOKEN).",
)

AllowIncomplete = typer.Option(
    False, "--allow-incomplete",
    help="Pass a run whose steps were audited with reports missing (a job known to lose ranks); an inconsistent "
         "step still fails.")
AllowUnverified = typer.Option(
    False, "--allow-unverified",
    help="Pass a run audited without a known layout (no topology: each rank checked only against the group it "
         "reduced over, so a reduction over the wrong group cannot be told apart); a fault still fails.")
AllowPending = typer.Option(
    False, "--allow-pending",
    help="Pass although some steps hold reports but no verdict yet (a check of a live run); without it they "
         "fail the check: the reports that did arrive may be wrong.")
AllowRefused = typer.Option(
    False, "--allow-refused",
    help="Pass a run although reports contradicting its stored ones were refused (409: the run id was reused, or "
         "a rank re-sent different values).")


class Format(str, Enum):
    table = "table"
    json = "json"


#: A run's status (:data:`auditor.status.STATUSES`, worst first), as ``--status`` takes it.
RunStatus = Enum("RunStatus", {s: s for s in _status.STATUSES}, type=str)


class ReportFormat(str, Enum):
    table = "table"
    json = "json"
    html = "html"


class UsageError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def _db_url(url: str | None) -> str:
    return url or DEFAULT_DATABASE_URL


def _settings(**values) -> Settings:
    """``Settings`` from the ``AUDITOR_*`` environment (and ``values``); a variable out of its
    range is a :class:`UsageError` naming each such variable, its value and the rule (it was
    pydantic's ValidationError: a traceback and "unexpected ValidationError")."""
    import pydantic

    try:
        return Settings(**values)
    except pydantic.ValidationError as e:
        raise UsageError("; ".join(
            f"AUDITOR_{'_'.join(map(str, err['loc'])).upper()}={err['input']!r}: {err['msg']}"
            for err in e.errors(include_url=False))) from None


def _errors_as_exit_2(fn):
    """Turn the errors a user can cause (bad URL, unreachable service or database, unknown
    revision, missing driver) into one line on stderr and exit code 2 — never a traceback,
    and never exit 1, which `check` reserves for "inconsistent"."""
    import httpx
    import sqlalchemy as sa
    from alembic.util.exc import CommandError

    from auditor.offline_reader import SpoolError, SpoolReaderError
    from auditor.reader import ReaderError

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BrokenPipeError:  # `auditor ... | head`: the reader left; end quietly, as CLI tools do
            _quiet_broken_pipe()
        except (UsageError, SpoolReaderError, SpoolError) as e:
            msg = str(e)
        except (ReaderError, httpx.HTTPError, httpx.InvalidURL) as e:
            msg = http_error_message(e)
        except OSError as e:  # a file that cannot be read or written: permissions, I/O error, disk full
            msg = f"{e.strerror}: {e.filename}" if e.strerror and e.filename else f"{type(e).__name__}: {e}"
        except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError, ModuleNotFoundError) as e:
            msg = f"bad database URL: {e}{database_url_hint(kwargs.get('database_url') or kwargs.get('keep_database'))}"
        except sa.exc.OperationalError as e:
            msg = (f"cannot reach the database: {str(e.orig or e).strip().splitlines()[0]}"
                   f"{database_url_hint(kwargs.get('database_url'))}")
        except CommandError as e:
            msg = f"migration: {e}"
        except (typer.Exit, typer.Abort, KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:  # noqa: BLE001 - a bug, still never exit 1 (which `check` reserves)
            import traceback

            traceback.print_exc()
            msg = f"unexpected {type(e).__name__}: {e}"
        typer.echo(f"error: {msg}", err=True)
        raise typer.Exit(2)

    return wrapper


#: Exit status after stdout was closed by its reader (``| head``): 128 + SIGPIPE, what a
#: tool killed by SIGPIPE gives.
BROKEN_PIPE_EXIT = 141


def _quiet_broken_pipe() -> None:
    """Stdout's reader left: point stdout at /dev/null (so the interpreter's last flush
    says nothing) and exit :data:`BROKEN_PIPE_EXIT`, with no message."""
    import sys

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    raise SystemExit(BROKEN_PIPE_EXIT)


def main() -> None:
    """The ``auditor`` console script: the typer app, and a closed stdout (``auditor runs |
    head``, ``--help | head``) ends it quietly (:data:`BROKEN_PIPE_EXIT`)."""
    try:
        app(prog_name="auditor")
    except BrokenPipeError:
        _quiet_broken_pipe()


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
    return ""


def database_shown(url: str) -> str:
    """``url`` as ``auditor serve`` names it at start-up: password hidden, a relative SQLite
    path made absolute (the default ``./auditor.db`` is the current directory's)."""
    import sqlalchemy as sa

    u = sa.make_url(url)
    if u.get_backend_name() == "sqlite" and u.database and u.database != ":memory:" \
            and not u.database.startswith("file:"):
        u = u.set(database=os.path.abspath(os.path.expanduser(u.database)))
    return u.render_as_string(hide_password=True)


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


def _reach(url: str, timeout: float) -> None:
    """Fail fast, in one line, when ``url`` is not an answering auditor service: ``GET
    /healthz`` (open even with tokens) must answer within ``timeout`` seconds, and not 404."""
    import httpx

    from auditor import bounded_http

    try:
        with bounded_http.client(timeout=timeout) as http:
            r = bounded_http.exchange(http, "GET", f"{url}/healthz", max_bytes=64 << 10, seconds=timeout)
    except bounded_http.BadAnswer as e:
        raise UsageError(f"{url} is not an auditor service: GET {url}/healthz answered {e}") from None
    except httpx.HTTPError as e:
        raise UsageError(http_error_message(e, timeout)) from None
    if r.status == 404:
        raise UsageError(f"{url} is not an auditor service's base URL (GET {url}/healthz answered 404); pass "
                         "e.g. --url http://host:8000")


def _service_url(url: str | None) -> str | None:
    """``--url``/``AUDITOR_URL`` as a service base URL; a ``file://`` spool is not a service."""
    url = (url or "").strip()
    if not url:
        return None
    if url.startswith("file:"):
        raise UsageError(f"AUDITOR_URL={url} is a spool directory, not a service: audit it with "
                         f"`auditor audit {url.removeprefix('file://')} --check`, or pass --database-url")
    import httpx

    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise UsageError(f"--url/AUDITOR_URL must be the http(s) URL of an auditor service, e.g. "
                         f"http://127.0.0.1:8000, got {url!r}")
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url  # the API's prefix given with the base URL


def _require_existing_sqlite(url: str) -> None:
    """Read-only commands must not create a SQLite file, nor write into an empty one (connecting
    would): refuse a missing or empty one."""
    import sqlalchemy as sa

    u = sa.make_url(url)
    if u.get_backend_name() == "sqlite" and u.database and u.database != ":memory:":
        from pathlib import Path

        path = Path(u.database).expanduser()
        if not path.is_file():
            raise UsageError(f"no auditor database at {u.database} (pass --database-url or --url)"
                             f"{database_url_hint(url)}")
        if path.stat().st_size == 0:  # SQLite would write its header into it on connecting
            raise UsageError(f"no auditor database at {u.database} (an empty file; pass --database-url or --url)")


def _ensure_schema(database_url: str) -> None:
    """Migrate an empty database to head, accept one at head (:func:`auditor.db.engine.ensure_schema`);
    anything else (another revision, a bad URL, an unreachable server) is a :class:`UsageError`."""
    from auditor.db.engine import SchemaError, ensure_schema, make_engine

    engine = make_engine(database_url)
    try:
        ensure_schema(engine, database_url)
    except SchemaError as e:
        raise UsageError(str(e)) from None
    finally:
        engine.dispose()


class ReportSource:
    """Where ``report``, ``check`` and ``runs`` read from: a running service over HTTP
    (``--url``, through :class:`auditor.reader.Reader`: every answer bounded in size, each
    request in time, the command to :data:`COMMAND_SECONDS` waiting on the service) or the
    service's flows on a local database (:class:`auditor.service.Service`). Both give the
    same JSON; an unknown run raises :class:`UsageError`."""

    def __init__(self, url: str | None, database_url: str | None, token: str | None = None, timeout: float = 10.0):
        self.url = _service_url(url)
        self.token = token
        self._service = None
        self._reader = None
        #: once the service answered /healthz: longer requests (a large run's report takes a while)
        self.read_timeout = max(timeout, READ_SECONDS)
        self._ends = time.monotonic() + COMMAND_SECONDS
        if self.url is not None:
            _reach(self.url, timeout)
            from auditor.reader import Reader

            self._reader = Reader(self.url, token, timeout=self.read_timeout, deadline=COMMAND_SECONDS)
        else:
            from auditor.db.engine import current_revision, make_engine
            from auditor.service import Service

            _require_existing_sqlite(_db_url(database_url))
            engine = make_engine(_db_url(database_url))
            if current_revision(engine) is None:
                where = engine.url.render_as_string(hide_password=True)
                engine.dispose()
                raise UsageError(f"no auditor database at {where} (pass --database-url or --url)")
            self._service = Service.from_engine(engine)

    def __enter__(self) -> "ReportSource":
        return self

    def __exit__(self, *exc) -> None:
        if self._service is not None:
            self._service.close()
        if self._reader is not None:
            self._reader.close()

    def reader(self):
        """The Reader, its per-call deadline what is left of the command's."""
        left = self._ends - time.monotonic()
        if left <= 0:
            raise UsageError(f"the command took longer than {COMMAND_SECONDS:g} s waiting on {self.url}; stopped")
        self._reader.deadline = left
        return self._reader

    def report(self, run_id: str, bad_steps: int, rank_rows: int | None = None) -> dict:
        """``GET /v1/runs/{run_id}/report`` (``rank_rows``: rows of each bad step's per-rank
        table; the service's default when None)."""
        extra = {} if rank_rows is None else {"rank_rows": rank_rows}
        return self._run_call(run_id, lambda r: r.report_json(run_id, bad_steps=bad_steps, rank_rows=rank_rows),
                              lambda s: s.report(run_id, bad_steps_limit=bad_steps, **extra))

    def _run_call(self, run_id: str, remote, local) -> dict:
        """``remote(reader)`` over HTTP, or ``local(service)``; an unknown run (404,
        :class:`auditor.service.NotFound`) raises :class:`UsageError` naming it, and so does a
        RUN_ID no run can have (``big1?x=1``, ``big1/report?``: in the URL they addressed run
        ``big1``, whose status ``check`` then reported as theirs)."""
        from auditor.trainer.settings import is_wire_run_id

        if not is_wire_run_id(run_id):
            raise UsageError(f"{run_id!r} is not a run id: a run id is 1 to 128 of A-Z a-z 0-9 . _ : - "
                             "(not only dots)")
        if self._service is None:
            from auditor.reader import NotFoundError

            try:
                return remote(self.reader())
            except NotFoundError as e:
                try:
                    self.reader()._get("/v1/runs", {"limit": 1})
                except NotFoundError:  # no API under this URL: not a missing run
                    raise UsageError(f"{self.url} is not an auditor service's base URL ({e.url} and {self.url}/v1/runs "
                                     "answered 404); pass e.g. --url http://host:8000") from None
                raise UsageError(f"run {run_id!r} not found at {self.url}") from None
        from auditor.service import NotFound

        try:
            return local(self._service)
        except NotFound:
            raise UsageError(f"run {run_id!r} not found") from None

    # the reads of a run page (auditor.web.PageSource)
    def report_json(self, run_id: str, *, bad_steps: int = 20) -> dict:
        return self.report(run_id, bad_steps)

    def steps_json(self, run_id: str, statistic: str, *, verdict: str | None = None, page_size: int | None = None):
        from auditor.web import PAGE_STEPS

        if self._service is None:
            yield from self.reader().steps_json(run_id, statistic, verdict=verdict, page_size=page_size or PAGE_STEPS)
            return
        if verdict is not None:
            yield from self._service.steps(run_id, statistic, verdict=verdict, limit=page_size or 1000)["steps"]
            return
        from auditor.service import PageReads

        yield from PageReads(self._service).steps_json(run_id, statistic)

    def step_json(self, run_id: str, statistic: str, step: int, *, limit: int | None = None,
                  after: tuple[int, int] | None = None) -> dict:
        if self._service is None:
            return self.reader().step_json(run_id, statistic, step, limit=limit, after=after)
        from auditor.service import PageReads

        return PageReads(self._service).step_json(run_id, statistic, step, limit=limit, after=after)

    def runs(self, status: str | None = None) -> list[dict]:
        """Every run of ``GET /v1/runs`` (all pages; ``status``: of that status only), newest first."""
        if self._service is None:
            return list(self.reader().runs_json(status=status, page_size=1000))
        return self._service.list_runs(status=status)

    def delete(self, run_id: str, chunk_rows: int) -> dict:
        """``DELETE /v1/runs/{run_id}``: the counts of what was deleted."""
        return self._run_call(run_id, lambda r: self._delete_remote(run_id),
                              lambda s: s.delete_run(run_id, chunk_rows=chunk_rows))

    def _delete_remote(self, run_id: str) -> dict:
        from urllib.parse import quote

        from auditor import bounded_http
        from auditor.reader import NotFoundError, ReaderError

        where = f"{self.url}/v1/runs/{quote(run_id, safe='')}"
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        with bounded_http.client(timeout=DELETE_SECONDS, headers=headers) as http:
            answer = bounded_http.exchange(http, "DELETE", where, max_bytes=64 << 10,
                                           seconds=min(DELETE_SECONDS, max(self._ends - time.monotonic(), 0.0)))
        try:
            doc = json.loads(answer.body)
        except (ValueError, RecursionError):
            doc = None
        if answer.status >= 300:
            raise (NotFoundError if answer.status == 404 else ReaderError)(answer.status, doc or answer.text[:300],
                                                                           where)
        if not (isinstance(doc, dict) and all(type(doc.get(k)) is int for k in ("reports", "steps", "statistics"))):
            raise ReaderError(answer.status, None, where, f"HTTP {answer.status} but not what a deletion answers "
                                                          f"(counts of reports, steps, statistics): "
                                                          f"{answer.text[:120]!r}")
        return doc

    def pending_lines(self, report: dict) -> list[str]:
        """For each statistic with steps still pending, the first such step: how many of
        its reports arrived and which ranks have not reported (from that step's rank rows;
        the ranks of a world with no placement, 0 to world_size − 1)."""
        from auditor.core import ranks_text

        lines = []
        world = report.get("world_size")
        for stat in report.get("statistics") or []:
            if not stat.get("steps_pending"):
                continue
            name = stat["statistic"]
            first = next(iter(self.steps_json(report["run_id"], name, verdict="pending", page_size=1)), None)
            if first is None:
                continue
            detail = self.step_json(report["run_id"], name, first["step"])
            reported = {row["rank"] for row in detail.get("ranks") or []}
            missing = sorted(set(range(world)) - reported) if isinstance(world, int) and world <= 1 << 20 else []
            got = f"{first.get('reports')} of {first.get('expected')} report(s)"
            lines.append(f"{report['run_id']}: {name} step {first['step']} has {got}: "
                         + (f"{ranks_text(missing)} not reported yet" if missing else
                            f"{ranks_text(reported)} reported, some microbatches still missing"))
        return lines


#: Seconds ``auditor runs delete`` waits for the service's answer (a large run takes a while).
DELETE_SECONDS = 600.0


def _require_torch() -> None:
    """`auditor demo` spawns torch.distributed ranks with Megatron-core groups: name the
    missing extra (and how to install it) before anything is created."""
    import importlib.util

    missing = [m for m in ("torch", "megatron.core") if _find(importlib.util, m) is None]
    if missing:
        raise UsageError(f"auditor demo needs the torch extra ({' and '.join(missing)} not installed; the service "
                         "image does not ship it): install torch==2.13.0 (the CPU wheel on machines without a GPU), "
                         "then pip install 'auditor[torch]' — or run scripts/setup.sh in a checkout. Nothing was "
                         "created")


def _find(util, module: str):
    try:
        return util.find_spec(module)
    except (ImportError, ValueError):  # a parent package is missing
        return None


def _console() -> Console:
    """A console for tables; when output is piped (CI logs), wide enough not to cut numbers."""
    console = Console()
    console = console if console.is_terminal else Console(width=160)
    console.on_broken_pipe = _quiet_broken_pipe  # rich's own exits 1, which `check` reserves
    return console


@app.command()
@_errors_as_exit_2
def serve(
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    port: int = typer.Option(8000, min=1, max=65535, help="TCP port."),
    database_url: Optional[str] = DatabaseUrl,
    workers: int = typer.Option(
        1, min=1, help="uvicorn worker processes. With more than one, the ingest metrics use prometheus-client's "
                       "multiprocess mode in $PROMETHEUS_MULTIPROC_DIR (wiped at start; a fresh temporary "
                       "directory if unset)."),
    grace_seconds: Optional[float] = typer.Option(
        None, min=0, envvar="AUDITOR_GRACE_SECONDS", show_default=False,
        help=f"Seconds a step may stay incomplete before it is audited with missing_report "
             f"[default: {Settings.model_fields['grace_seconds'].default:g}]."),
    log_level: str = typer.Option("info", help="uvicorn log level: critical, error, warning, info, debug."),
) -> None:
    """Run the HTTP service. Migrates an empty database first (under a PostgreSQL advisory lock,
    so replicas may start at once); refuses a database whose schema is at another revision
    (run `auditor db upgrade`). Exit 2 with one line when the port is taken or the database
    is unusable; SIGTERM/SIGINT stop it within AUDITOR_SHUTDOWN_TIMEOUT_SECONDS + 5 s."""
    if database_url:
        os.environ["AUDITOR_DATABASE_URL"] = database_url
    if grace_seconds is not None:
        os.environ["AUDITOR_GRACE_SECONDS"] = str(grace_seconds)
    settings = _settings()
    from auditor.server.run import BindError, listen_socket
    from auditor.server.run import serve as run_server

    try:  # first: a taken port fails at once, before the database or the app start anything
        sock = listen_socket(host, port)
    except BindError as e:
        raise UsageError(e.strerror) from None
    try:
        _ensure_schema(settings.database_url)
    except BaseException:
        sock.close()
        raise
    # which database: the default ./auditor.db is the current directory's (started elsewhere, another one)
    typer.echo(f"auditor serve: database {database_shown(settings.database_url)}", err=True)
    run_server(host, port, workers=workers, log_level=log_level, sock=sock)


@db_app.command("upgrade")
@_errors_as_exit_2
def db_upgrade(database_url: Optional[str] = DatabaseUrl, revision: str = typer.Argument("head")) -> None:
    """Apply migrations up to REVISION (default: head)."""
    from auditor.db.engine import upgrade

    upgrade(_db_url(database_url), revision)
    typer.echo(f"database at {revision}")


@db_app.command("downgrade")
@_errors_as_exit_2
def db_downgrade(revision: str = typer.Argument(..., help="Target revision, or 'base'."),
                 database_url: Optional[str] = DatabaseUrl) -> None:
    """Revert migrations down to REVISION ('base' drops every auditor table)."""
    from auditor.db.engine import downgrade

    downgrade(_db_url(database_url), revision)
    typer.echo(f"database at {revision}")


@db_app.command("current")
@_errors_as_exit_2
def db_current(database_url: Optional[str] = DatabaseUrl) -> None:
    """Print the database's schema revision and the code's head."""
    from auditor.db.engine import current_revision, head_revision, make_engine

    _require_existing_sqlite(_db_url(database_url))
    engine = make_engine(_db_url(database_url))
    typer.echo(f"database: {current_revision(engine) or '(empty)'}  code head: {head_revision()}")
    engine.dispose()


@app.command()
@_errors_as_exit_2
def report(
    run_id: str,
    url: Optional[str] = ServiceUrl,
    database_url: Optional[str] = DatabaseUrl,
    format: ReportFormat = typer.Option(
        ReportFormat.table, "--format", "-f",
        help="table, json, or html: the run page with its plots as one self-contained file (plotly.js inlined; "
             "opens offline), e.g. `auditor report RUN --format html > run.html`."),
    bad_steps: int = typer.Option(20, min=0, help="Bad steps shown per statistic."),
    rank_rows: Optional[int] = typer.Option(
        None, min=0, max=16_384,
        help="Rows of each bad step's per-rank table (the faulted ranks first; service default 64). "
             "The full table of a step: GET .../statistics/STAT/steps/STEP."),
    token: Optional[str] = ReadToken,
    timeout: float = Timeout,
) -> None:
    """Print the consistency report of RUN_ID (exit 2: run, service or database not found)."""
    if format is ReportFormat.html:
        typer.echo(_report_html(run_id, url, database_url, bad_steps, token, timeout), nl=False)
        return
    with ReportSource(url, database_url, token, timeout) as source:
        data = source.report(run_id, bad_steps, rank_rows)
        pending = source.pending_lines(data) if format is ReportFormat.table else []
    if format is ReportFormat.json:
        typer.echo(json.dumps(data, indent=2))
        return
    from auditor.render import render_report

    console = _console()
    render_report(data, console)
    for line in pending:  # which ranks a pending step waits for
        console.print(f"[yellow]pending:[/] {line}", highlight=False)


def _report_html(run_id: str, url: str | None, database_url: str | None, bad_steps: int,
                 token: str | None = None, timeout: float = 10.0) -> str:
    """The run page of RUN_ID as one self-contained HTML document, read from a service
    (``--url``) or straight from the database — the same page ``GET /runs/{run_id}`` serves."""
    from auditor import web

    with ReportSource(url, database_url, token, timeout) as source:
        page = web.gather_run_page(source, run_id, bad_steps=bad_steps)
    return web.render_run_page(**page, inline_assets=True)


@app.command()
@_errors_as_exit_2
def check(
    run_id: Optional[str] = typer.Argument(None, help="The run to check; default $AUDITOR_RUN_ID, or the only run "
                                                      "there is."),
    url: Optional[str] = ServiceUrl,
    database_url: Optional[str] = DatabaseUrl,
    min_steps: int = typer.Option(0, min=0, help="Also fail when fewer steps than this were audited "
                                                  "(a CI job whose trainer reported nothing)."),
    allow_incomplete: bool = AllowIncomplete,
    allow_pending: bool = AllowPending,
    allow_refused: bool = AllowRefused,
    allow_unverified: bool = AllowUnverified,
    token: Optional[str] = ReadToken,
    timeout: float = Timeout,
) -> None:
    """For the CI job of a training framework: exit 1 if RUN_ID is inconsistent (a step
    inconsistent, or one the engine could not audit), unverified (a step audited without
    a known layout: the groups could not be checked; --allow-unverified accepts that),
    incomplete (a step audited with reports missing; --allow-incomplete accepts that), has steps with reports but no
    verdict yet (--allow-pending), had reports refused for contradicting stored ones (a
    reused run id; --allow-refused), or fewer than --min-steps steps were audited; 0
    otherwise; 2 if the run, the service or the database cannot be found — or if
    no RUN_ID is given and it cannot tell which run is meant (several runs and no
    $AUDITOR_RUN_ID). The status is the one every surface shows (auditor.status)."""
    from auditor import status

    run_id = _which_run(run_id, url, database_url, token, timeout)
    # the verdict needs no per-rank table (rank_rows=0: no step re-audited, whatever the world)
    with ReportSource(url, database_url, token, timeout) as source:
        data = source.report(run_id, bad_steps=20, rank_rows=0)
        passed, lines = status.check(data, allow_incomplete=allow_incomplete, allow_refused=allow_refused,
                                     min_steps=min_steps, allow_pending=allow_pending,
                                     allow_unverified=allow_unverified)
        lines += source.pending_lines(data)  # which ranks a pending step waits for
    for line in lines:
        typer.echo(line)
    if not passed:
        raise typer.Exit(1)


def _which_run(run_id: str | None, url: str | None, database_url: str | None, token: str | None = None,
               timeout: float = 10.0) -> str:
    """RUN_ID, else ``$AUDITOR_RUN_ID``, else the only run stored. Raises
    :class:`UsageError` (exit 2) naming the candidates when that is ambiguous, and for
    ``none``/empty, which no trainer hook uses as a run id."""
    from auditor.trainer.settings import usable_run_id

    given = run_id if run_id is not None else os.environ.get("AUDITOR_RUN_ID")
    if given is not None:
        if usable_run_id(given) is None:
            raise UsageError(f"{given!r} is not a run id (torchrun's placeholder when no --rdzv-id is set); the "
                             "trainer logged its run id on rank 0 ('auditor: run id ...'): pass that")
        return given
    with ReportSource(url, database_url, token, timeout) as source:
        runs = source.runs()
    if len(runs) == 1:
        return runs[0]["run_id"]
    if not runs:
        raise UsageError("no runs stored yet: nothing to check")
    names = ", ".join(r["run_id"] for r in runs[:5]) + (f", … and {len(runs) - 5} more" if len(runs) > 5 else "")
    raise UsageError(f"which run? {len(runs)} runs are stored ({names}); pass RUN_ID or set AUDITOR_RUN_ID")


#: How ``auditor runs`` and the report header print each status (auditor.status).
_STATUS_STYLE = {"inconsistent": "[red bold]INCONSISTENT[/]", "unverified": "[magenta bold]UNVERIFIED[/]",
                 "incomplete": "[yellow bold]INCOMPLETE[/]",
                 "consistent": "[green]consistent[/]", "pending": "no step audited yet"}

runs_app = typer.Typer(help="Runs: list them (no subcommand) or delete one.", invoke_without_command=True)
app.add_typer(runs_app, name="runs")


@runs_app.command("delete")
@_errors_as_exit_2
def runs_delete(
    run_id: str,
    url: Optional[str] = ServiceUrl,
    database_url: Optional[str] = DatabaseUrl,
    token: Optional[str] = typer.Option(None, "--token", envvar="AUDITOR_TOKEN", callback=_header_token,
                                      help="Bearer token (writes)."),
    chunk_rows: int = typer.Option(5000, min=1, help="Reports deleted per transaction (database mode)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Delete without asking (scripts; needed when stdin is not a "
                                                        "terminal)."),
    timeout: float = Timeout,
) -> None:
    """Delete RUN_ID with its reports, verdicts and faults, in bounded transactions (other
    runs keep being ingested). Asks first, naming what goes (--yes: no question). Exit 2 if
    the run does not exist, or when asked with no terminal to answer and no --yes."""
    import sys

    with ReportSource(url, database_url, token, timeout) as source:
        if not yes:
            data = source.report(run_id, bad_steps=0, rank_rows=0)  # exit 2 for an unknown run, before asking
            what = (f"run {run_id} ({len(data.get('statistics') or [])} statistic(s), "
                    f"{sum(int(st.get('steps_audited') or 0) for st in data.get('statistics') or [])} audited "
                    f"step(s), status {data.get('status')}) from {source.url or _db_url(database_url)}")
            if not sys.stdin.isatty():
                raise UsageError(f"not deleting {what}: no terminal to confirm on; pass --yes")
            if not typer.confirm(f"Delete {what}, with its reports and verdicts?", default=False):
                typer.echo("nothing deleted")
                raise typer.Exit(1)
        counts = source.delete(run_id, chunk_rows)
    typer.echo(f"deleted run {run_id}: {counts['reports']} report(s), {counts['steps']} step(s), "
               f"{counts['statistics']} statistic(s)")


@runs_app.callback()
@_errors_as_exit_2
def runs(ctx: typer.Context, url: Optional[str] = ServiceUrl, database_url: Optional[str] = DatabaseUrl,
         status: Optional[RunStatus] = typer.Option(None, "--status", help="Only runs of this status."),
         format: Format = typer.Option(Format.table, "--format", "-f",
                                       help="table, or json (the runs of GET /v1/runs, every page, as one list)."),
         token: Optional[str] = ReadToken, timeout: float = Timeout) -> None:
    """List runs with their status, topology and audit counts, newest first."""
    if ctx.invoked_subcommand is not None:
        return
    with ReportSource(url, database_url, token, timeout) as source:
        data = source.runs(status=status.value if status is not None else None)
    if format is Format.json:
        typer.echo(json.dumps(data, indent=2))
        return
    from rich.table import Table

    from rich.table import Column

    from auditor import status

    t = Table("run", "status", "world", Column("dp×cp×tp×pp", no_wrap=True), "statistics", "steps audited",
              "inconsistent", "unverified", "incomplete", "refused")
    for r in data:
        s = r["sizes"]
        # an unknown topology's sizes are placeholders of 1, not a 1×1×1×1 layout (as on the run page)
        sizes = (f"unknown (world {r['world_size']})" if r.get("topology") == "unknown"
                 else f"{s['dp']}×{s['cp']}×{s['tp']}×{s['pp']}")
        state = status.status_of(r)
        t.add_row(r["run_id"], _STATUS_STYLE.get(state, state), str(r["world_size"]), sizes,
                  ", ".join(r["statistics"]), str(r["steps_audited"]), str(r["steps_inconsistent"]),
                  str(r.get("steps_unverified", "—")), str(r.get("steps_incomplete", "—")), str(r.get("refused_reports", "—")))
    _console().print(t)


@app.command()
@_errors_as_exit_2
def demo(
    dp: int = typer.Option(1, min=1, help="Data-parallel size."),
    cp: int = typer.Option(2, min=1, help="Context-parallel size."),
    steps: int = typer.Option(1, min=1, max=1000, help="Rollout steps per run: step 0 is the reference case, later "
                                                         "steps whiten fresh rewards (a history for the run page)."),
    url: Optional[str] = typer.Option(None, "--url", help="Use a running service instead of starting one."),
    database_url: Optional[str] = DatabaseUrl,
) -> None:
    """The reference case end to end: real gloo ranks with Megatron-core process groups whiten
    GRPO advantages under zigzag CP sharding twice — reduced over the DP group without CP
    (slime's bug) and with CP (the fix) — push to the auditor, and print both reports."""
    from auditor.demo.reference import check_world

    try:  # before torch, a service or ./auditor.db: nothing started
        check_world(dp, cp)
    except ValueError as e:
        raise UsageError(str(e)) from None
    _require_torch()
    from auditor.demo import run_demo

    console = _console()
    if cp < 2:
        console.print("[yellow]note: with --cp 1 there is no context parallelism, so the DP group without CP is "
                      "the right group and the '-buggy' run is consistent; the bug needs --cp 2 or more[/]")
    url = _service_url(url)
    if url:
        from auditor.server.run import wait_healthy

        try:
            wait_healthy(url, timeout=10)
        except TimeoutError as e:
            raise UsageError(str(e)) from None
        result = run_demo(url, dp=dp, cp=cp, steps=steps, console=console)
        console.print(f"Run pages: {url.rstrip('/')}/runs/{result.buggy_run_id}  {url.rstrip('/')}/runs/"
                      f"{result.fixed_run_id}", highlight=False, soft_wrap=True)
        return
    from auditor.server.run import BackgroundServer

    settings = _settings(database_url=_db_url(database_url))
    _ensure_schema(settings.database_url)  # bad URL, missing directory, unreachable: exit 2 now
    console.print(f"[dim]auditor service on {settings.database_url}[/dim]")
    try:
        with BackgroundServer(settings) as base:
            result = run_demo(base, dp=dp, cp=cp, steps=steps, console=console)
    except TimeoutError as e:
        raise UsageError(str(e)) from None
    db = "" if database_url is None else f" --database-url {settings.database_url}"
    console.print(f"See them in a browser: `auditor serve{db}`, then http://127.0.0.1:8000/runs/{result.buggy_run_id}"
                  f" — or `auditor report {result.buggy_run_id}{db} --format html > run.html`",
                  highlight=False, soft_wrap=True)



SpoolPaths = typer.Argument(..., help="Spool files (*.jsonl) or directories holding them.", show_default=False)
Quiet = typer.Option(False, "--quiet", "-q", help="No progress bar (there is none when stderr is not a terminal).")


FollowSymlinks = typer.Option(
    False, "--follow-symlinks",
    help="Read spool files that are symbolic links (refused by default: a link may point anywhere, e.g. /etc/passwd).")


def _spool_files(spools: list[str], follow_symlinks: bool = False, dead: list | None = None):
    """The spool files of SPOOL... vetted (:func:`auditor.offline.vet_spools`): exit 2 naming
    a missing file, a link, a file that is not a spool or not UTF-8 — and, for none at all,
    the dead-letter files found there (``dead``) with --include-deadletter."""
    from auditor.offline import vet_spools

    files = vet_spools(spools, follow_symlinks=follow_symlinks)
    if not files:
        held = (f"; it holds only dead-letter files ({', '.join(f'{p} ({n})' for p, n in dead)}): retry them with "
                "--include-deadletter" if dead else "")
        raise UsageError(f"no spool files (*.jsonl) in {' '.join(spools)}{held}")
    return files


@contextlib.contextmanager
def _spool_progress(what: str, quiet: bool):
    """A progress bar on stderr over the bytes of the spools (with reports and reports/s),
    yielding the ``on_progress(done_bytes, total_bytes, reports)`` callback of
    :mod:`auditor.offline`. Off with ``--quiet`` and when stderr is not a terminal (CI logs,
    pipes: the callback is then a no-op)."""
    console = Console(stderr=True)
    if quiet or not console.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(TextColumn(f"[bold]{what}"), BarColumn(), DownloadColumn(),
                  TextColumn("{task.fields[reports]:,} reports ({task.fields[rate]:,.0f}/s)"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False) as progress:
        task = progress.add_task(what, total=None, reports=0, rate=0.0)
        t0 = time.perf_counter()

        def on_progress(done: int, total: int, reports: int) -> None:
            rate = reports / max(time.perf_counter() - t0, 1e-9)
            progress.update(task, completed=done, total=total, reports=reports, rate=rate)

        yield on_progress


@app.command("import")
@_errors_as_exit_2
def import_spools(
    spools: list[str] = SpoolPaths,
    url: str = typer.Option(..., "--url", envvar="AUDITOR_URL", help="Base URL of the auditor service."),
    token: Optional[str] = typer.Option(None, "--token", envvar="AUDITOR_TOKEN", callback=_header_token,
                                      help="Bearer token."),
    batch_size: int = typer.Option(10_000, min=1, help="Reports per request, cut between steps (10,000: the "
                                                        "service's largest; a service or proxy answering 413 "
                                                        "gets halves)."),
    restart: bool = typer.Option(False, help="Ignore the .offset sidecars and upload from the start."),
    include_deadletter: bool = typer.Option(
        False, "--include-deadletter",
        help="Also retry the reports of the `.deadletter` files next to the spools; those delivered leave them."),
    timeout: float = Timeout,
    follow_symlinks: bool = FollowSymlinks,
    quiet: bool = Quiet,
) -> None:
    """Upload trainer spools to a service: the files (one per rank) are merged so that each
    request carries whole steps. Resumable (each file's `.offset` sidecar records, per
    service URL, what was delivered there) and idempotent (the service ignores identical
    re-sends). Reports the service refuses go to `<spool>.deadletter`; dead-letter files
    found are named (retry them with --include-deadletter). Exit 0: all delivered; 1: some
    refused (dead-lettered); 2: service unreachable (no answer within 3 × --timeout), or a
    wrong URL or token (401/403/404/405)."""
    url = _service_url(url)
    from auditor.offline import upload, vet_spools
    from auditor.trainer.spool import dead_letter_files

    dead = dead_letter_files(spools)
    files = (vet_spools(spools, follow_symlinks=follow_symlinks) if include_deadletter and dead
             else _spool_files(spools, follow_symlinks, dead))
    with _spool_progress("import", quiet) as on_progress:
        try:
            counts = upload(files, url, token=token, batch_size=batch_size, restart=restart, timeout=timeout,
                            dead_letters=[p for p, _ in dead] if include_deadletter else (),
                            on_progress=on_progress, follow_symlinks=follow_symlinks)
        except ConnectionError as e:  # unreachable, or a wrong URL/token: 2 (1 means refused reports)
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
    new = counts["sent"] - counts["duplicates"]
    where = ", ".join(f"{p} (+{n})" for p, n in counts["dead_lettered"].items())
    typer.echo(f"imported {new} new report(s) from {counts['files']} file(s)"
               + (f" ({counts['duplicates']} already stored, not counted)" if counts["duplicates"] else "")
               + f"; {counts['rejected']} rejected" + (f" (appended to {where})" if where else "")
               + f", {counts['retries']} retried request(s)")
    if counts["skipped"]:
        typer.echo(f"{counts['skipped']} file(s) were already delivered to {url} (their .offset sidecars say so; "
                   "--restart sends them again)")
    if dead and include_deadletter:
        left = [(p, n) for p, n in dead_letter_files(spools)]
        typer.echo(f"retried {sum(n for _, n in dead)} dead-lettered report(s) from {len(dead)} file(s): "
                   + (f"{sum(n for _, n in left)} still refused, kept in {', '.join(str(p) for p, _ in left)}"
                      if left else "all delivered, the dead-letter files are removed"))
    elif dead:
        typer.echo(f"not retried: {sum(n for _, n in dead)} dead-lettered report(s) in "
                   + ", ".join(f"{p} ({n})" for p, n in dead) + " — retry them with --include-deadletter")
    if counts["rejected"]:
        raise typer.Exit(1)


@app.command("audit")
@_errors_as_exit_2
def audit_spools(
    spools: list[str] = SpoolPaths,
    run_id: Optional[str] = typer.Option(None, "--run-id", help="Audit only this run."),
    format: Format = typer.Option(Format.table, "--format", "-f", help="table, or json (a list of run reports)."),
    bad_steps: int = typer.Option(20, help="Bad steps shown per statistic."),
    keep_database: Optional[str] = typer.Option(
        None, "--database-url", help="Store into this database instead of a temporary SQLite file."),
    check: bool = typer.Option(False, "--check", help="Exit 1 unless every audited run passes `auditor check`: "
                                                      "no inconsistent, unverified or incomplete step, no refused "
                                                      "report."),
    allow_incomplete: bool = AllowIncomplete,
    allow_refused: bool = AllowRefused,
    allow_unverified: bool = AllowUnverified,
    batch_size: int = typer.Option(10_000, min=1, max=100_000,
                                   help="Reports stored and audited per transaction (cut between steps); "
                                        "memory grows with it, not with the spools."),
    follow_symlinks: bool = FollowSymlinks,
    quiet: bool = Quiet,
) -> None:
    """Audit trainer spools offline, with no service: the same engine and report as the service
    (steps still incomplete at the end are audited as after the grace period). The files (one
    per rank) are merged and streamed in batches of whole steps: memory stays flat."""
    from auditor.offline import audit_offline

    files = _spool_files(spools, follow_symlinks)
    with _spool_progress("audit", quiet) as on_progress:
        reports, counts = audit_offline(files, keep_database, run_id=run_id, bad_steps=bad_steps,
                                        batch_size=batch_size, on_progress=on_progress,
                                        follow_symlinks=follow_symlinks)
    typer.echo(f"read {counts['reports']} report(s) from {counts['files']} file(s): {counts['stored']} stored, "
               f"{counts['duplicates']} duplicate(s), {counts['invalid']} invalid, "
               f"{counts['conflicting']} conflicting", err=True)
    if format is Format.json:
        typer.echo(json.dumps(reports, indent=2))
    else:
        from auditor.render import render_report

        console = _console()
        for data in reports:
            render_report(data, console)
    if not reports:
        raise UsageError("no valid reports in the spools" + (f" for run {run_id!r}" if run_id else ""))
    if check:
        from auditor import status

        failed = False
        for data in reports:
            passed, lines = status.check(data, allow_incomplete=allow_incomplete, allow_refused=allow_refused,
                                         allow_unverified=allow_unverified)
            for line in lines:
                typer.echo(line, err=format is Format.json)  # JSON on stdout stays parseable
            failed |= not passed
        if failed:
            raise typer.Exit(1)
