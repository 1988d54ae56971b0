"""Where ``report``, ``check``, ``runs`` and ``runs delete`` read from, picked once by
:func:`open_source`: a running service over HTTP (``--url``: :class:`auditor.reader.Reader`,
every answer bounded in size, each request in time, the command to
:data:`COMMAND_SECONDS` waiting on the service) or the service's reads on a local database.
Both sources give the same JSON documents through the same read protocol (the methods of
:class:`auditor.reader.Reader`); what differs — reaching the source, an unknown run's
wording, deleting — is each source's own class, never an if/else per read."""

from __future__ import annotations

import json
import time
from typing import NoReturn

from auditor.cli.errors import UsageError, database_url_hint, http_error_message
from auditor.cli.options import db_url

#: Seconds one command may spend waiting on the service in all (every request of it).
COMMAND_SECONDS = 600.0
#: Seconds each request after the first (the service's ``/healthz``) may take in all, at least.
READ_SECONDS = 60.0
#: Seconds ``auditor runs delete`` waits for the service's answer (a large run takes a while).
DELETE_SECONDS = 600.0


def open_source(url: str | None, database_url: str | None, token: str | None = None,
                timeout: float = 10.0) -> "Source":
    """The service at ``url`` (``--url``/``AUDITOR_URL``; it must answer ``/healthz`` within
    ``timeout`` seconds) or, without one, the database at ``database_url`` (which must exist
    and hold an auditor schema). Raises :class:`UsageError`."""
    url = service_url(url)
    if url is not None:
        return HttpSource(url, token, timeout)
    return LocalSource(db_url(database_url))


class Source:
    """The read protocol the commands call, over :meth:`reads` (a Reader or a local reader
    of the same documents); an unknown run, or a RUN_ID no run can have, raises
    :class:`UsageError`. Subclasses say how to reach their reader, how an unknown run is
    worded, and how a run is deleted."""

    #: What the reader raises for an unknown run (each source sets its own).
    not_found: type[Exception] | tuple[type[Exception], ...] = ()
    #: Where the documents come from, as messages name it (a URL).
    where: str = ""

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError

    def reads(self):
        """The reader (:class:`auditor.reader.Reader`'s methods) for the next call."""
        raise NotImplementedError

    def _unknown_run(self, run_id: str, exc: Exception) -> NoReturn:
        """Raise the :class:`UsageError` of an unknown run (``exc``: :attr:`not_found`)."""
        raise NotImplementedError

    def _foreign(self, exc: Exception) -> None:
        """After a 404 (``exc``: :attr:`not_found`): raise the :class:`UsageError` saying the
        URL is no auditor's when its API is missing too; return when only the thing asked for is."""

    def _delete(self, run_id: str, chunk_rows: int) -> dict:
        raise NotImplementedError

    def report(self, run_id: str, bad_steps: int, rank_rows: int | None = None) -> dict:
        """``GET /v1/runs/{run_id}/report`` (``rank_rows``: rows of each bad step's per-rank
        table; the service's default when None)."""
        return self._run_call(run_id, lambda r: r.report_json(run_id, bad_steps=bad_steps, rank_rows=rank_rows))

    def _run_call(self, run_id: str, call) -> dict:
        """``call(reader)``; an unknown run (:attr:`not_found`) raises :class:`UsageError`
        naming it, and so does a RUN_ID no run can have (``big1?x=1``, ``big1/report?``: in
        the URL they addressed run ``big1``, whose status ``check`` then reported as theirs)."""
        from auditor.trainer.settings import is_wire_run_id

        if not is_wire_run_id(run_id):
            raise UsageError(f"{run_id!r} is not a run id: a run id is 1 to 128 of A-Z a-z 0-9 . _ : - "
                             "(not only dots)")
        try:
            return call(self.reads())
        except self.not_found as e:
            self._unknown_run(run_id, e)

    # the reads of a run page (auditor.web.PageSource)
    def report_json(self, run_id: str, *, bad_steps: int = 20) -> dict:
        return self.report(run_id, bad_steps)

    def steps_json(self, run_id: str, statistic: str, *, verdict: str | None = None, page_size: int | None = None):
        from auditor.web import PAGE_STEPS

        yield from self.reads().steps_json(run_id, statistic, verdict=verdict, page_size=page_size or PAGE_STEPS)

    def step_json(self, run_id: str, statistic: str, step: int, *, limit: int | None = None,
                  after: tuple[int, int] | None = None) -> dict:
        return self.reads().step_json(run_id, statistic, step, limit=limit, after=after)

    def compare(self, run_ids: list[str], workload: str | None, steps: int | None = None) -> dict:
        """``GET /v1/workloads/{workload}`` (``workload`` given) or ``GET /v1/compare?run=…``:
        the comparison document; an unknown workload or run raises :class:`UsageError`."""
        from auditor.trainer.settings import is_wire_run_id

        bad = [n for n in ([workload] if workload else run_ids) if not is_wire_run_id(n)]
        if bad:
            raise UsageError(f"{bad[0]!r} is not a {'workload' if workload else 'run id'}: 1 to 128 of "
                             "A-Z a-z 0-9 . _ : - (not only dots)")
        try:
            r = self.reads()
            return r.workload_json(workload, steps=steps) if workload else r.compare_json(run_ids, steps=steps)
        except self.not_found as e:
            self._foreign(e)
            what = f"no run is labelled workload {workload!r}" if workload else f"a run was not found ({e})"
            raise UsageError(f"{what} at {self.where}") from None
        except ValueError as e:  # the database's own limits (more runs than a comparison takes)
            raise UsageError(str(e)) from None

    def runs(self, status: str | None = None) -> list[dict]:
        """Every run of ``GET /v1/runs`` (all pages; ``status``: of that status only), newest first."""
        return list(self.reads().runs_json(status=status, page_size=1000))

    def delete(self, run_id: str, chunk_rows: int) -> dict:
        """``DELETE /v1/runs/{run_id}``: the counts of what was deleted."""
        return self._run_call(run_id, lambda r: self._delete(run_id, chunk_rows))


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



class HttpSource(Source):
    """A running service at ``url`` (a base URL, :func:`service_url`), read through
    :class:`auditor.reader.Reader`: ``/healthz`` must answer within ``timeout`` seconds;
    then each request may take ``max(timeout, READ_SECONDS)`` and every call what is left
    of the command's :data:`COMMAND_SECONDS`."""

    def __init__(self, url: str, token: str | None, timeout: float):
        from auditor.reader import NotFoundError, Reader

        self.url = self.where = url
        self.token = token
        self.not_found = NotFoundError
        #: once the service answered /healthz: longer requests (a large run's report takes a while)
        self.read_timeout = max(timeout, READ_SECONDS)
        self._ends = time.monotonic() + COMMAND_SECONDS
        reach(url, timeout)
        self._reader = Reader(url, token, timeout=self.read_timeout, deadline=COMMAND_SECONDS)

    def close(self) -> None:
        self._reader.close()

    def reads(self):
        """The Reader, its per-call deadline what is left of the command's."""
        left = self._ends - time.monotonic()
        if left <= 0:
            raise UsageError(f"the command took longer than {COMMAND_SECONDS:g} s waiting on {self.url}; stopped")
        self._reader.deadline = left
        return self._reader

    def _unknown_run(self, run_id: str, exc: Exception) -> NoReturn:
        self._foreign(exc)
        raise UsageError(f"run {run_id!r} not found at {self.url}") from None

    def _foreign(self, exc: Exception) -> None:
        try:
            self.reads()._get("/v1/runs", {"limit": 1})
        except self.not_found:  # no API under this URL: not a missing run
            raise UsageError(f"{self.url} is not an auditor service's base URL ({exc.url} and {self.url}/v1/runs "
                             "answered 404); pass e.g. --url http://host:8000") from None

    def _delete(self, run_id: str, chunk_rows: int) -> dict:
        """``DELETE /v1/runs/{run_id}`` as one bounded exchange (``chunk_rows`` is the
        service's own)."""
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


class LocalSource(Source):
    """The service's reads straight from the database at ``database_url``
    (:class:`auditor.service.Service`), which must exist (a read command never creates a
    SQLite file) and hold an auditor schema."""

    def __init__(self, database_url: str):
        require_existing_sqlite(database_url)  # first: a missing file is refused before the service is imported
        from auditor.db.engine import current_revision, make_engine
        from auditor.service import LocalReader, NotFound, Service

        self.url, self.where = None, database_url
        self.not_found = NotFound
        engine = make_engine(database_url)
        if current_revision(engine) is None:
            where = engine.url.render_as_string(hide_password=True)
            engine.dispose()
            raise UsageError(f"no auditor database at {where} (pass --database-url or --url)")
        self.service = Service.from_engine(engine)
        self._reader = LocalReader(self.service)

    def close(self) -> None:
        self.service.close()

    def reads(self):
        return self._reader

    def _unknown_run(self, run_id: str, exc: Exception) -> NoReturn:
        raise UsageError(f"run {run_id!r} not found") from None

    def _foreign(self, exc: Exception) -> None:
        """A database answers for itself: a missing run is only that."""

    def _delete(self, run_id: str, chunk_rows: int) -> dict:
        return self.service.delete_run(run_id, chunk_rows=chunk_rows)


def reach(url: str, timeout: float) -> None:
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


def service_url(url: str | None) -> str | None:
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


def require_existing_sqlite(url: str) -> None:
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

