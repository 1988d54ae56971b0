"""``auditor.Reader``: a typed, read-only Python client of the auditor service.

What a notebook or a CI script needs, as dataclasses instead of JSON::

    from auditor import Reader

    with Reader("http://auditor:8000", token="…") as r:
        for run in r.runs(status="inconsistent"):
            print(run.run_id, run.steps_inconsistent)
        report = r.report("qwen3-4b-grpo-0001")
        adv = report.statistic("advantages")
        print(adv.worst_cp_disagreement_sigma, adv.first_bad_step, adv.faults)
        bad = [s.step for s in r.steps("qwen3-4b-grpo-0001", "advantages", verdict="inconsistent")]
        detail = r.step("qwen3-4b-grpo-0001", "advantages", bad[0])
        for row in detail.ranks:
            print(row.rank, row.coords, row.applied_mean, row.correct_mean, row.faults)

Paginated listings (:meth:`Reader.runs`, :meth:`Reader.steps`) are iterators that follow the
service's opaque cursors page by page. Fields the service adds later (e.g. placement
fields of a topology) land in each object's ``extra`` dict, so an older reader keeps
working.

Nothing an answer holds is trusted: each request is one bounded exchange
(:func:`auditor.bounded_http.exchange`: the whole answer within ``timeout`` seconds and
``max_answer_bytes`` bytes, a body trickled byte by byte included), the time one call spends
waiting on the service in all (the pages of a listing or of a step) is bounded by
``deadline``, every document is checked against the fields' types before it becomes a
dataclass, and a listing whose ``next_cursor`` repeats one it gave is an error, not a loop.

Errors: one type, :class:`ReaderError`, naming the URL and what was wrong — an HTTP error
(``status``, ``problem``: the service's problem details), no whole answer in time, an
answer too large, not JSON, or not the document asked for; :class:`NotFoundError` (a
subclass) for 404. Depends on the standard library and httpx only.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterator, Mapping
from urllib.parse import quote

import httpx

from auditor import bounded_http
# The read documents are declared once, in the contract (standard library only); they are
# re-exported here: ``from auditor.reader import Report`` keeps working.
from auditor.contract.reads import (Fault, Progress, ProgressAt, RankRow, Report, Run, ShapeError, StatisticReport,
                                    StepDetail, StepPage, StepSummary, Workload)

__all__ = ["Reader", "ReaderError", "NotFoundError", "Run", "Report", "StatisticReport", "StepSummary",
           "StepDetail", "StepPage", "RankRow", "Fault", "Progress", "ProgressAt"]


def header_safe(value: str) -> bool:
    """Whether ``value`` can be sent as an HTTP header value (a bearer token): printable
    ASCII. httpx raises UnicodeEncodeError for other characters, on every request."""
    return value.isascii() and value.isprintable()


class ReaderError(Exception):
    """What a read of the service came to instead of a document, naming the URL: an HTTP
    error (``status``; ``problem``: its JSON body, RFC 9457 problem details), or ``what``
    was wrong with the exchange (``status`` None when no answer came: unreachable, no
    whole answer within the time bound) or with the answer (too large, not JSON, not the
    document asked for, a repeated cursor)."""

    def __init__(self, status: int | None, problem: Any, url: str, what: str | None = None):
        self.status, self.problem, self.url, self.what = status, problem, url, what
        if what is None:
            detail = problem.get("detail", problem) if isinstance(problem, dict) else problem
            what = f"HTTP {status}: {' '.join(str(detail).split())[:2000]}"
        super().__init__(f"{url}: {what}")


class NotFoundError(ReaderError):
    """404: no such run, statistic or step."""


def _seg(part: str | int) -> str:
    return quote(str(part), safe="")


class Reader:
    """Read client of an auditor service: runs, reports, step history, step detail.

    Parameters
    ----------
    url:
        Base URL, e.g. ``http://auditor:8000`` (default ``$AUDITOR_URL``).
    token:
        Read token, sent as ``Authorization: Bearer <token>`` (default
        ``$AUDITOR_READ_TOKEN``, else ``$AUDITOR_TOKEN``; none if both are unset).
    timeout:
        Seconds one request may take in all: connecting, sending, the whole answer (not
        the wait between two bytes of it).
    deadline:
        Seconds one call may spend waiting on the service in all, over every request it
        makes (a listing's pages, a step's pages; an iterator counts only the time inside
        its requests, not the consumer's).
    max_answer_bytes:
        Largest answer read, bytes (default :data:`MAX_ANSWER_BYTES`); a longer one is a
        :class:`ReaderError`.

    Examples
    --------
    A service on a temporary SQLite file, fed the reference case's two CP ranks whitened
    over the DP group without CP (each rank over itself, DESIGN.md §4), then read back:

    >>> import pathlib, tempfile, httpx
    >>> from auditor import Reader
    >>> from auditor.testing.server import ServerProcess
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> service = ServerProcess(f"sqlite:///{tmp}/auditor.db", tmp / "server.log").start()
    >>> local = [{"count": 65.0, "sum": -5.0, "sum_sq": 55.0, "min": -1.0, "max": 1.5},
    ...          {"count": 85.0, "sum": 20.0, "sum_sq": 87.5, "min": -1.0, "max": 1.5}]
    >>> def whitening_of(m):  # what the rank applied: its own mean and Bessel-corrected variance
    ...     n, s, q = m["count"], m["sum"], m["sum_sq"]
    ...     return {"count": n, "sum": s, "sum_sq": q, "mean": s / n, "var": (q - s * s / n) / (n - 1)}
    >>> reports = [{"run_id": "doc", "statistic": "advantages", "step": 0, "rank": cp, "world_size": 2,
    ...             "coords": {"dp": 0, "cp": cp, "tp": 0, "pp": 0}, "sizes": {"dp": 1, "cp": 2, "tp": 1, "pp": 1},
    ...             "local": local[cp], "applied": whitening_of(local[cp]), "group_ranks": [cp]} for cp in (0, 1)]
    >>> httpx.post(service.url + "/v1/reports", json={"reports": reports}).json()["steps_audited"]
    1
    >>> with Reader(service.url) as r:
    ...     adv = r.report("doc").statistic("advantages")
    ...     detail = r.step("doc", "advantages", adv.first_bad_step)
    >>> adv.steps_inconsistent, round(adv.worst_cp_disagreement_sigma, 6), round(adv.worst_applied_error_sigma, 6)
    (1, 0.433155, 0.267869)
    >>> sorted(adv.faults)
    ['cp_disagreement', 'group_mismatch', 'wrong_group']
    >>> [(row.rank, round(row.applied_mean, 6), round(row.correct_mean, 6)) for row in detail.ranks]
    [(0, -0.076923, 0.1), (1, 0.235294, 0.1)]
    >>> service.stop()
    """

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout: float = 30.0,
                 deadline: float = 600.0, max_answer_bytes: int | None = None,
                 transport: httpx.BaseTransport | None = None):
        url = (url or os.environ.get("AUDITOR_URL") or "").strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http(s) URL of an auditor service, got {url!r}")
        token = token or os.environ.get("AUDITOR_READ_TOKEN") or os.environ.get("AUDITOR_TOKEN") or None
        if token is not None and not header_safe(token):
            raise ValueError("token must be printable ASCII (it is sent in the Authorization header)")
        for name, value in (("timeout", timeout), ("deadline", deadline)):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self.url, self.timeout, self.deadline = url, float(timeout), float(deadline)
        self.max_answer_bytes = MAX_ANSWER_BYTES if max_answer_bytes is None else int(max_answer_bytes)
        self._http = bounded_http.client(timeout=timeout, transport=transport,
                                         headers={"Authorization": f"Bearer {token}"} if token else {})

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _get(self, path: str, params: Mapping[str, Any] | None = None, budget: "_Budget | None" = None) -> Any:
        """``GET {url}{path}`` as one bounded exchange; the JSON of a 2xx answer. Every other
        outcome is a :class:`ReaderError` naming the URL (:class:`NotFoundError` for 404)."""
        budget = budget or _Budget(self.deadline)
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        where = str(httpx.URL(self.url + path, params=clean))
        seconds = min(self.timeout, budget.left())
        if seconds <= 0:
            raise ReaderError(None, None, where, f"the call's deadline ({self.deadline:g} s waiting on the service) "
                                                 "passed before this request")
        t0 = time.monotonic()
        try:
            answer = bounded_http.exchange(self._http, "GET", where, max_bytes=self.max_answer_bytes, seconds=seconds)
        except httpx.TimeoutException as exc:
            raise ReaderError(None, None, where, f"no whole answer within {seconds:g} s ({type(exc).__name__})") from None
        except bounded_http.BadAnswer as exc:
            raise ReaderError(exc.status, None, where, str(exc)) from None
        except httpx.HTTPError as exc:
            raise ReaderError(None, None, where, f"cannot reach the service: {type(exc).__name__}: {exc}") from None
        finally:
            budget.spent += time.monotonic() - t0
        if answer.status >= 400:
            problem = _json_or_none(answer.body)
            if not isinstance(problem, dict):
                problem = " ".join(answer.text[:500].split()) or "(empty body)"
            raise (NotFoundError if answer.status == 404 else ReaderError)(answer.status, problem, where)
        if answer.status >= 300 or answer.status < 200:
            to = answer.headers.get("Location")
            raise ReaderError(answer.status, None, where, f"HTTP {answer.status}"
                              + (f", a redirect to {to} (the service answers none: pass its base URL)" if to else ""))
        doc = _json_or_none(answer.body)
        if doc is None:
            raise ReaderError(answer.status, None, where, f"HTTP {answer.status} but not JSON: "
                                                          f"{answer.text[:120]!r}")
        return doc

    def _document(self, cls, path: str, params: Mapping[str, Any] | None = None, budget: "_Budget | None" = None):
        """``(cls.from_json(doc), doc)`` of ``GET path``; a document ``cls`` cannot read is a
        :class:`ReaderError`."""
        doc = self._get(path, params, budget)
        return _typed(cls, doc, self.url + path), doc

    # ------------------------------------------------------------------------ reads
    def _pages(self, path: str, key: str, params: Mapping[str, Any], cls) -> Iterator[dict]:
        """The items under ``key`` of every page of a cursor-paginated listing, each checked
        to be a ``cls`` document; a ``next_cursor`` seen before (a loop) is a
        :class:`ReaderError`, and so is a page that is no listing."""
        cursor, seen, budget = None, set(), _Budget(self.deadline)
        while True:
            page = self._get(path, {**params, "cursor": cursor}, budget)
            items = page.get(key) if isinstance(page, dict) else None
            cursor = page.get("next_cursor") if isinstance(page, dict) else None
            if not isinstance(items, list) or not (cursor is None or isinstance(cursor, str)):
                raise ReaderError(200, None, self.url + path, f"not a listing of {key} (a JSON object with a list "
                                                               f"{key!r} and a string or null 'next_cursor')")
            for item in items:
                _typed(cls, item, self.url + path)
                yield item
            if not cursor:
                return
            if cursor in seen:
                raise ReaderError(200, None, self.url + path, f"next_cursor {cursor[:60]!r} was given before: the "
                                                               "listing loops; stopped")
            seen.add(cursor)

    def runs(self, *, status: str | None = None, page_size: int = 100) -> Iterator[Run]:
        """Every run, newest first (``GET /v1/runs``, following its cursor).
        ``status``: ``inconsistent`` (some step inconsistent or audit_error), ``incomplete``
        (none, but some step audited with reports missing), ``consistent`` (every audited
        step consistent) or ``pending`` (no step audited yet) — :mod:`auditor.status`."""
        return (Run.from_json(r) for r in self.runs_json(status=status, page_size=page_size))

    def runs_json(self, *, status: str | None = None, page_size: int = 100) -> Iterator[dict]:
        """:meth:`runs` as the service's JSON objects."""
        return self._pages("/v1/runs", "runs", {"status": status, "limit": page_size}, Run)

    def run(self, run_id: str) -> Run:
        """One run's summary; :class:`NotFoundError` if unknown."""
        return self._document(Run, f"/v1/runs/{_seg(run_id)}")[0]

    def report(self, run_id: str, *, statistic: str | None = None, bad_steps: int = 20,
               rank_rows: int | None = None) -> Report:
        """The consistency report of ``run_id`` (optionally one ``statistic`` only), with the
        details of up to ``bad_steps`` bad steps per statistic, each with up to ``rank_rows``
        rows of its per-rank table (the faulted ranks first; the service's default, 64, when
        None). The full table of a step: :meth:`step`."""
        return self._document(Report, f"/v1/runs/{_seg(run_id)}/report",
                              {"statistic": statistic, "bad_steps": bad_steps, "rank_rows": rank_rows})[0]

    def steps(self, run_id: str, statistic: str, *, start: int | None = None, stop: int | None = None,
              verdict: str | None = None, page_size: int = 1000) -> Iterator[StepSummary]:
        """Per-step verdicts of one statistic in step order (``GET .../steps``), steps in
        [``start``, ``stop``] (both inclusive, either open), optionally of one ``verdict``."""
        return (StepSummary.from_json(s)
                for s in self.steps_json(run_id, statistic, start=start, stop=stop, verdict=verdict,
                                         page_size=page_size))

    def step(self, run_id: str, statistic: str, step: int, *, page_size: int = 10_000) -> StepPage:
        """One step's verdict, faults and its whole per-rank table (following the step
        endpoint's pages of ``page_size`` rows)."""
        return StepPage.from_json(self.step_json(run_id, statistic, step, page_size=page_size))

    def step_json(self, run_id: str, statistic: str, step: int, *, page_size: int = 10_000,
                  limit: int | None = None, after: tuple[int, int] | None = None) -> dict:
        """:meth:`step` as the service's JSON object: the first page, with the rows of every
        page in ``ranks`` (``next_cursor`` None, ``ranks_truncated`` false). With ``limit``
        and/or ``after`` (a (rank, microbatch) key; what a run page reads,
        :class:`auditor.web.PageSource`): only the rows after ``after``, at most ``limit``,
        the pages before them read and dropped one at a time; ``ranks_truncated`` true when
        more follow."""
        path = f"/v1/runs/{_seg(run_id)}/statistics/{_seg(statistic)}/steps/{int(step)}"

        def keep(rows: list[dict]) -> list[dict]:
            return rows if after is None else [r for r in rows if (r["rank"], r.get("microbatch", 0)) > tuple(after)]

        size = page_size if limit is None else max(1, min(page_size, limit))
        budget, seen = _Budget(self.deadline), set()
        out = self._document(StepPage, path, {"limit": size}, budget)[1]
        out["ranks"] = keep(out["ranks"])
        while out.get("next_cursor") and (limit is None or len(out["ranks"]) <= limit):
            if out["next_cursor"] in seen:
                raise ReaderError(200, None, self.url + path, f"next_cursor {str(out['next_cursor'])[:60]!r} was "
                                                               "given before: the pages loop; stopped")
            seen.add(out["next_cursor"])
            page = self._document(StepPage, path, {"limit": size, "cursor": out["next_cursor"]}, budget)[1]
            out["ranks"] += keep(page["ranks"])
            out["next_cursor"] = page.get("next_cursor")
        more = limit is not None and (len(out["ranks"]) > limit or bool(out.get("next_cursor")))
        if limit is not None:
            out["ranks"] = out["ranks"][:limit]
        out["next_cursor"], out["ranks_truncated"] = None, more
        return out

    def report_json(self, run_id: str, *, bad_steps: int = 20, rank_rows: int | None = None) -> dict:
        """The report as the service's JSON (what :func:`auditor.web.render_run_page` takes),
        checked to be a report (:class:`Report`)."""
        return self._document(Report, f"/v1/runs/{_seg(run_id)}/report",
                              {"bad_steps": bad_steps, "rank_rows": rank_rows})[1]

    def steps_json(self, run_id: str, statistic: str, *, start: int | None = None, stop: int | None = None,
                   verdict: str | None = None, page_size: int = 1000) -> Iterator[dict]:
        """:meth:`steps` as the service's JSON objects (what :func:`auditor.web.render_run_page`
        takes)."""
        return self._pages(f"/v1/runs/{_seg(run_id)}/statistics/{_seg(statistic)}/steps", "steps",
                           {"from": start, "to": stop, "verdict": verdict, "limit": page_size}, StepSummary)


    def workload(self, workload: str, *, start: int | None = None, stop: int | None = None,
                 steps: int | None = None) -> Workload:
        """The runs labelled ``workload`` compared across their layouts (``GET
        /v1/workloads/{workload}``: :class:`auditor.contract.workloads.Workload`), over steps
        in [``start``, ``stop``], at most ``steps`` per run and statistic (the service's
        default when None); :class:`NotFoundError` when no run carries the label."""
        return self._document(Workload, f"/v1/workloads/{_seg(workload)}",
                              {"from": start, "to": stop, "steps": steps})[0]

    def workload_json(self, workload: str, *, start: int | None = None, stop: int | None = None,
                      steps: int | None = None) -> dict:
        """:meth:`workload` as the service's JSON."""
        return self._document(Workload, f"/v1/workloads/{_seg(workload)}",
                              {"from": start, "to": stop, "steps": steps})[1]

    def compare(self, run_ids: list[str], *, start: int | None = None, stop: int | None = None,
                steps: int | None = None) -> Workload:
        """The runs ``run_ids`` compared as one workload (``GET /v1/compare?run=…``);
        :class:`NotFoundError` naming an unknown run."""
        return Workload.from_json(self.compare_json(run_ids, start=start, stop=stop, steps=steps))

    def compare_json(self, run_ids: list[str], *, start: int | None = None, stop: int | None = None,
                     steps: int | None = None) -> dict:
        """:meth:`compare` as the service's JSON."""
        return self._document(Workload, "/v1/compare", {"run": list(run_ids), "from": start, "to": stop,
                                                         "steps": steps})[1]


#: Largest answer :class:`Reader` reads by default, bytes: the service's largest documents
#: (a report: at most 16,384 rank rows, ≈ 5.4 MB; a step page of 65,536 rows) fit.
MAX_ANSWER_BYTES = 32 << 20


class _Budget:
    """Seconds one call may still wait on the service (see ``Reader(deadline=...)``)."""

    def __init__(self, seconds: float):
        self.seconds, self.spent = seconds, 0.0

    def left(self) -> float:
        return self.seconds - self.spent


def _json_or_none(body: bytes) -> Any:
    """``body`` as JSON; None when it is not (nested past the parser's limit included)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _typed(cls, doc: Any, where: str):
    """``cls.from_json(doc)``; a document it cannot read (wrong types, fields missing, not an
    object) is a :class:`ReaderError` naming ``where`` and the field."""
    try:
        return cls.from_json(doc)
    except (ShapeError, TypeError, KeyError, ValueError, AttributeError, IndexError) as exc:
        raise ReaderError(200, None, where, f"not a {cls.__name__} document: {exc}") from None
