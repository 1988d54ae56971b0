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
working. Errors: :class:`NotFoundError` for 404, :class:`ReaderError` for any other HTTP
error (its ``problem`` holds the service's error body), ``httpx.HTTPError`` when the
service cannot be reached. Depends on the standard library and httpx only.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping
from urllib.parse import quote

import httpx

from auditor.status import check as check_report
from auditor.status import status_of

__all__ = ["Reader", "ReaderError", "NotFoundError", "Run", "Report", "StatisticReport", "StepSummary",
           "StepDetail", "RankRow", "Fault"]


def header_safe(value: str) -> bool:
    """Whether ``value`` can be sent as an HTTP header value (a bearer token): printable
    ASCII. httpx raises UnicodeEncodeError for other characters, on every request."""
    return value.isascii() and value.isprintable()


class ReaderError(Exception):
    """The service answered an error. ``status``: HTTP status; ``problem``: its JSON body
    (RFC 9457 problem details, or ``{"detail": ...}``)."""

    def __init__(self, status: int, problem: Any, url: str):
        self.status, self.problem, self.url = status, problem, url
        detail = problem.get("detail", problem) if isinstance(problem, dict) else problem
        super().__init__(f"{url}: HTTP {status}: {detail}")


class NotFoundError(ReaderError):
    """404: no such run, statistic or step."""


def _raw(obj: Any) -> Any:
    """A reader dataclass back to its JSON (``extra`` merged in)."""
    if dataclasses.is_dataclass(obj):
        out = {f.name: _raw(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name != "extra"}
        out.update(getattr(obj, "extra", {}) or {})
        return out
    if isinstance(obj, list):
        return [_raw(x) for x in obj]
    return obj


def _build(cls, data: Mapping[str, Any], **convert):
    """``cls`` from a JSON object: known fields (converted by ``convert[name]``), the rest in
    ``extra``. Missing optional fields take their defaults."""
    names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
    kwargs = {k: (convert[k](v) if k in convert and v is not None else v) for k, v in data.items() if k in names}
    return cls(**kwargs, extra={k: v for k, v in data.items() if k not in names})


@dataclass(frozen=True)
class Run:
    """One run (``GET /v1/runs``): topology, statistics, audit counts. Times: Unix seconds."""

    run_id: str
    world_size: int
    sizes: dict[str, int]
    created_at: float
    last_activity: float
    statistics: list[str]
    steps_audited: int
    steps_inconsistent: int
    consistent: bool
    #: ``inconsistent``, ``unverified``, ``incomplete``, ``consistent`` or ``pending``
    #: (:mod:`auditor.status`); derived from the counts when an older service sends none
    status: str = ""
    steps_incomplete: int = 0
    steps_unverified: int = 0
    refused_reports: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Run":
        return _build(cls, {**data, "status": status_of(data)})


@dataclass(frozen=True)
class Fault:
    """One finding of a step: fault ``kind`` (DESIGN.md §5), the ranks it concerns, the
    diagnosis as text and its ``evidence`` (numbers behind it, e.g. ``factor``)."""

    kind: str
    message: str
    ranks: list[int]
    evidence: dict[str, Any] = field(default_factory=dict)
    #: ranks the fault concerns in all; a report lists at most 1024 of them
    #: (``ranks_truncated``), the step endpoint all
    ranks_total: int | None = None
    ranks_truncated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Fault":
        return _build(cls, data)


@dataclass(frozen=True)
class RankRow:
    """One rank (and microbatch) of a step. ``moments``: local count and mean, the applied
    and the correct mean/std, ``error_sigma`` (gap of the applied whitening, in σ).
    ``sum``/``norm``: the local, applied and correct value (sum, or squared norm) sit in the
    ``*_mean`` fields and ``relative_error`` is |applied − correct| / |correct|."""

    rank: int
    microbatch: int
    coords: dict[str, int]
    local_count: float | None = None
    local_mean: float | None = None
    applied_mean: float | None = None
    applied_std: float | None = None
    correct_mean: float | None = None
    correct_std: float | None = None
    error_sigma: float | None = None
    relative_error: float | None = None
    faults: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "RankRow":
        return _build(cls, data)


@dataclass(frozen=True)
class StepSummary:
    """One audited (or pending) step of a statistic (``GET .../steps``): verdict
    (``consistent``, ``inconsistent``, ``incomplete`` or ``pending``), reports received of
    expected, the σ figures (``moments``) and the fault kinds found."""

    step: int
    verdict: str
    reports: int
    expected: int
    cp_disagreement_sigma: float | None = None
    applied_error_sigma: float | None = None
    tolerance_sigma: float | None = None
    fault_kinds: list[str] = field(default_factory=list)
    audited_at: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "StepSummary":
        return _build(cls, data)


@dataclass(frozen=True)
class StepDetail:
    """One step with its faults and per-rank table (``GET .../steps/{step}``, every row:
    :meth:`Reader.step` follows its pages; and each of a report's ``bad_steps``, at most
    ``rank_rows`` rows, the faulted ranks first). ``ranks_total``: rows of the full table;
    ``ranks_truncated``: ``ranks`` holds fewer."""

    step: int
    verdict: str | None
    reports: int
    expected: int
    faults: list[Fault]
    ranks: list[RankRow]
    cp_disagreement_sigma: float | None = None
    applied_error_sigma: float | None = None
    audited_at: float | None = None
    run_id: str | None = None
    statistic: str | None = None
    ranks_total: int | None = None
    ranks_truncated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "StepDetail":
        return _build(cls, data, faults=lambda v: [Fault.from_json(f) for f in v],
                      ranks=lambda v: [RankRow.from_json(r) for r in v])


@dataclass(frozen=True)
class StatisticReport:
    """The report of one statistic of a run: verdict counts, first/last bad step, fault
    counts by kind, the latest and the worst σ figures (with the steps of the worst), and
    the details of up to ``bad_steps`` bad steps."""

    statistic: str
    kind: str
    spec: dict[str, Any]
    steps_audited: int
    steps_consistent: int
    steps_inconsistent: int
    steps_incomplete: int
    steps_pending: int
    faults: dict[str, int]
    bad_steps: list[StepDetail]
    bad_steps_total: int
    first_bad_step: int | None = None
    last_bad_step: int | None = None
    last_audited_step: int | None = None
    cp_disagreement_sigma: float | None = None
    applied_error_sigma: float | None = None
    worst_cp_disagreement_sigma: float | None = None
    worst_cp_disagreement_step: int | None = None
    worst_applied_error_sigma: float | None = None
    worst_applied_error_step: int | None = None
    #: ``inconsistent``, ``unverified``, ``incomplete``, ``consistent`` or ``pending`` (:mod:`auditor.status`)
    status: str = ""
    steps_audit_error: int = 0
    steps_unverified: int = 0
    refused_reports: int = 0
    refused_first_step: int | None = None
    refused_last_step: int | None = None
    refused_at: float | None = None
    refused_kind: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "StatisticReport":
        return _build(cls, {**data, "status": status_of(data)},
                      bad_steps=lambda v: [StepDetail.from_json(s) for s in v])


@dataclass(frozen=True)
class Report:
    """A run's consistency report (``GET /v1/runs/{run_id}/report``)."""

    run_id: str
    world_size: int
    sizes: dict[str, int]
    consistent: bool
    statistics: list[StatisticReport]
    created_at: float | None = None
    last_activity: float | None = None
    page: str | None = None
    #: ``inconsistent``, ``unverified``, ``incomplete``, ``consistent`` or ``pending`` (:mod:`auditor.status`)
    status: str = ""
    #: reports refused (409) for contradicting the run's stored ones (a reused run id)
    refused_reports: int = 0
    topology: str | None = None
    #: where the ranks' layout came from (``megatron``, ``megatron.core.mpu``, ``device_mesh``, ...)
    topology_source: str | None = None
    steps_unverified: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Report":
        return _build(cls, {**data, "status": status_of(data)},
                      statistics=lambda v: [StatisticReport.from_json(s) for s in v])

    def check(self, *, allow_incomplete: bool = False, allow_refused: bool = False,
              min_steps: int = 0, allow_pending: bool = False, allow_unverified: bool = False) -> tuple[bool, list[str]]:
        """``auditor check`` of this report: ``(passed, lines)`` (:func:`auditor.status.check`)."""
        return check_report(self.raw, allow_incomplete=allow_incomplete, allow_refused=allow_refused,
                            min_steps=min_steps, allow_pending=allow_pending, allow_unverified=allow_unverified)

    @property
    def raw(self) -> dict[str, Any]:
        """The report as JSON again (known fields and ``extra``)."""
        return _raw(self)

    def statistic(self, name: str) -> StatisticReport:
        """The report of statistic ``name``; ``KeyError`` if the run has none by that name."""
        for s in self.statistics:
            if s.statistic == name:
                return s
        raise KeyError(f"run {self.run_id!r} has no statistic {name!r}; it has "
                       f"{[s.statistic for s in self.statistics]}")


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
        Per-request timeout, seconds.

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
                 transport: httpx.BaseTransport | None = None):
        url = (url or os.environ.get("AUDITOR_URL") or "").strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http(s) URL of an auditor service, got {url!r}")
        token = token or os.environ.get("AUDITOR_READ_TOKEN") or os.environ.get("AUDITOR_TOKEN") or None
        if token is not None and not header_safe(token):
            raise ValueError("token must be printable ASCII (it is sent in the Authorization header)")
        self.url = url
        self._http = httpx.Client(base_url=url, timeout=timeout, transport=transport,
                                  headers={"Authorization": f"Bearer {token}"} if token else {})

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _get(self, path: str, params: Mapping[str, Any] | None = None) -> Any:
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        r = self._http.get(path, params=clean)
        if r.status_code >= 400:
            try:
                problem = r.json()
            except ValueError:
                problem = r.text[:500]
            cls = NotFoundError if r.status_code == 404 else ReaderError
            raise cls(r.status_code, problem, str(r.request.url))
        return r.json()

    # ------------------------------------------------------------------------ reads
    def _pages(self, path: str, key: str, params: Mapping[str, Any]) -> Iterator[dict]:
        """The items under ``key`` of every page of a cursor-paginated listing."""
        cursor = None
        while True:
            page = self._get(path, {**params, "cursor": cursor})
            yield from page[key]
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def runs(self, *, status: str | None = None, page_size: int = 100) -> Iterator[Run]:
        """Every run, newest first (``GET /v1/runs``, following its cursor).
        ``status``: ``inconsistent`` (some step inconsistent or audit_error), ``incomplete``
        (none, but some step audited with reports missing), ``consistent`` (every audited
        step consistent) or ``pending`` (no step audited yet) — :mod:`auditor.status`."""
        return (Run.from_json(r) for r in self.runs_json(status=status, page_size=page_size))

    def runs_json(self, *, status: str | None = None, page_size: int = 100) -> Iterator[dict]:
        """:meth:`runs` as the service's JSON objects."""
        return self._pages("/v1/runs", "runs", {"status": status, "limit": page_size})

    def run(self, run_id: str) -> Run:
        """One run's summary; :class:`NotFoundError` if unknown."""
        return Run.from_json(self._get(f"/v1/runs/{_seg(run_id)}"))

    def report(self, run_id: str, *, statistic: str | None = None, bad_steps: int = 20,
               rank_rows: int | None = None) -> Report:
        """The consistency report of ``run_id`` (optionally one ``statistic`` only), with the
        details of up to ``bad_steps`` bad steps per statistic, each with up to ``rank_rows``
        rows of its per-rank table (the faulted ranks first; the service's default, 64, when
        None). The full table of a step: :meth:`step`."""
        return Report.from_json(self._get(f"/v1/runs/{_seg(run_id)}/report",
                                          {"statistic": statistic, "bad_steps": bad_steps, "rank_rows": rank_rows}))

    def steps(self, run_id: str, statistic: str, *, start: int | None = None, stop: int | None = None,
              verdict: str | None = None, page_size: int = 1000) -> Iterator[StepSummary]:
        """Per-step verdicts of one statistic in step order (``GET .../steps``), steps in
        [``start``, ``stop``] (both inclusive, either open), optionally of one ``verdict``."""
        return (StepSummary.from_json(s)
                for s in self.steps_json(run_id, statistic, start=start, stop=stop, verdict=verdict,
                                         page_size=page_size))

    def step(self, run_id: str, statistic: str, step: int, *, page_size: int = 10_000) -> StepDetail:
        """One step's verdict, faults and its whole per-rank table (following the step
        endpoint's pages of ``page_size`` rows)."""
        return StepDetail.from_json(self.step_json(run_id, statistic, step, page_size=page_size))

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
        out = self._get(path, {"limit": size})
        out["ranks"] = keep(out["ranks"])
        while out.get("next_cursor") and (limit is None or len(out["ranks"]) <= limit):
            page = self._get(path, {"limit": size, "cursor": out["next_cursor"]})
            out["ranks"] += keep(page["ranks"])
            out["next_cursor"] = page.get("next_cursor")
        more = limit is not None and (len(out["ranks"]) > limit or bool(out.get("next_cursor")))
        if limit is not None:
            out["ranks"] = out["ranks"][:limit]
        out["next_cursor"], out["ranks_truncated"] = None, more
        return out

    def report_json(self, run_id: str, *, bad_steps: int = 20, rank_rows: int | None = None) -> dict:
        """The report as the service's JSON (what :func:`auditor.web.render_run_page` takes)."""
        return self._get(f"/v1/runs/{_seg(run_id)}/report", {"bad_steps": bad_steps, "rank_rows": rank_rows})

    def steps_json(self, run_id: str, statistic: str, *, start: int | None = None, stop: int | None = None,
                   verdict: str | None = None, page_size: int = 1000) -> Iterator[dict]:
        """:meth:`steps` as the service's JSON objects (what :func:`auditor.web.render_run_page`
        takes)."""
        return self._pages(f"/v1/runs/{_seg(run_id)}/statistics/{_seg(statistic)}/steps", "steps",
                           {"from": start, "to": stop, "verdict": verdict, "limit": page_size})
