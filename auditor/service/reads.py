"""The read models, with their budgets: runs (keyset pages), one run, a run's report (bad
steps with bounded per-rank tables), a statistic's step history, one step (paged rank rows),
the /metrics figures; and :class:`LocalReader`, the read protocol of
:class:`auditor.reader.Reader` served from a database instead of over HTTP."""

from __future__ import annotations

import bisect
import heapq
import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Iterator, Sequence

import sqlalchemy as sa

from auditor import core
from auditor import status as statuses
from auditor.contract.reads import (Fault, Progress, RankRow, Report, Run, StatisticReport, StepDetail, StepPage,
                                    StepsPage, StepSummary, Workload)
from auditor.core import REPLACEABLE
from auditor.db.rows import wire_figure
from auditor.db.store import RunRow, Store, json_scalar
from auditor.service.errors import NotFound
from auditor.service.model import SeriesInfo, Topology
from auditor.status import STATUSES

if TYPE_CHECKING:
    from auditor.service import Service

log = logging.getLogger("auditor.service")

#: Rows of each bad step's per-rank table a report shows by default (``?rank_rows=``): the
#: ranks its faults name first, then the rest in rank order; the step endpoint pages the rest.
REPORT_RANK_ROWS = 64
#: Most rank rows one report response holds over all its bad steps (and most ranks each
#: fault lists there): a report asking for more shows each bad step an equal share of it.
#: Bounds the response whatever the world (≈ 330 bytes a row: ≈ 5.4 MB at most).
REPORT_ROWS_BUDGET = 16_384
#: Most stored reports one report response re-audits for its per-rank tables (each bad
#: step's table needs every report of its step: a rank's correct value is its whole expected
#: group's); bad steps past it show their faults and ``ranks_total`` but no rows
#: (``ranks_truncated``): the step endpoint has them. Bounds the time and memory of a read.
REPORT_AUDIT_BUDGET = 1 << 19
#: Most ranks each fault of a report's bad step lists (fewer when many bad steps are shown:
#: an equal share of :data:`REPORT_ROWS_BUDGET`, at least 16); the step endpoint lists all.
REPORT_FAULT_RANKS = 1024
#: Rank rows per page of the step endpoint by default, and at most.
STEP_RANK_ROWS = 10_000
STEP_RANK_ROWS_MAX = 65_536


class Reads:
    """The read models of a :class:`auditor.service.Service`: the read documents of
    :mod:`auditor.contract.reads`, built here and nowhere else."""

    def __init__(self, store: Store):
        self.store = store

    def list_runs(self, status: str | None = None) -> list[Run]:
        """Every run (optionally of one ``status``) with its topology and per-statistic step
        counts, newest first."""
        return self.runs_page(status=status)[0]

    def runs_page(self, limit: int | None = None, after: tuple[float, str] | None = None,
                  status: str | None = None) -> tuple[list[Run], tuple[float, str] | None]:
        """Runs with their topology and per-statistic step counts, newest first, one keyset
        page at a time (``GET /v1/runs``).

        ``after``: (created_at, run_id) of the last run of the previous page; ``status``:
        ``inconsistent``, ``incomplete``, ``consistent`` or ``pending`` (:mod:`auditor.status`).
        Returns (runs, the key to pass as ``after`` for the next page, or None on the last page)."""
        if status is not None and status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}; got {status!r}")
        with self.store.read() as conn:
            run_rows = self.store.runs(conn, None if limit is None else limit + 1, after, status)
            more = limit is not None and len(run_rows) > limit
            run_rows = run_rows[:limit] if limit is not None else run_rows
            srows = self.store.series_rows(conn, [r.run_id for r in run_rows]) if run_rows else []
        by_run: dict[str, list] = defaultdict(list)
        for s in srows:
            by_run[s["run_id"]].append(s)
        last = (run_rows[-1].created_at, run_rows[-1].run_id) if more else None
        return [_run_summary(r, by_run[r.run_id]) for r in run_rows], last

    def get_run(self, run_id: str) -> Run:
        """One run's summary; raises :class:`NotFound`."""
        with self.store.read() as conn:
            r = self._run_row(conn, run_id)
            srows = self.store.series_rows(conn, run_id)
        return _run_summary(r, srows)

    def _run_row(self, conn: sa.Connection, run_id: str) -> RunRow:
        """The stored run; raises :class:`NotFound`."""
        r = self.store.run(conn, run_id)
        if r is None:
            raise NotFound(run_id)
        return r

    def report(self, run_id: str, bad_steps_limit: int = 20, statistic: str | None = None,
               rank_rows: int = REPORT_RANK_ROWS) -> Report:
        """The consistency report of a run (``GET /v1/runs/{run_id}/report``).

        Served from the per-series aggregates plus, for at most ``bad_steps_limit`` bad
        steps per statistic (inconsistent first, then incomplete, by step), their faults
        and per-rank tables (recomputed from the step's stored reports, one step at a time).
        Bounded whatever the world: each table shows at most ``rank_rows`` rows (the ranks
        the step's faults name first, then the rest in rank order) and each fault lists at
        most as many ranks, with ``ranks_total``/``ranks_truncated`` telling the full
        count; at most :data:`REPORT_ROWS_BUDGET` rows in all (shared equally by the bad
        steps shown) and at most :data:`REPORT_AUDIT_BUDGET` reports re-audited. The full
        table is the step endpoint's (:meth:`step`). Raises :class:`NotFound`.
        """
        with self.store.read() as conn:
            run_row = self._run_row(conn, run_id)
            run = _run_summary(run_row, self.store.series_rows(conn, run_id))
            topo = Topology.of_row(run_row)
            series = [(s, self.store.bad_steps(conn, s["id"], bad_steps_limit))
                      for s in self.store.series_rows(conn, run_id, statistic, ordered=True)]
            shown = sum(len(b) for _, b in series)
            cap = min(rank_rows, REPORT_ROWS_BUDGET // max(1, shown))
            fault_cap = min(REPORT_FAULT_RANKS, max(16, REPORT_ROWS_BUDGET // max(1, shown)))
            budget = [REPORT_AUDIT_BUDGET]
            stats = [self._series_report(conn, s, topo, bad_rows, (cap, fault_cap), budget) for s, bad_rows in series]
        if statistic is not None and not stats:
            raise NotFound(f"{run_id}/{statistic}")
        # one definition (auditor.status): an audit_error or an incomplete step is no
        # evidence of consistency; `consistent` is true only when the status is consistent
        state = statuses.combine(s.status for s in stats)
        return Report(
            run_id=run.run_id, world_size=run.world_size, sizes=run.sizes, order=run.order, topology=run.topology,
            topology_source=run.topology_source, workload=run.workload, created_at=run.created_at,
            last_activity=run.last_activity, statistics=stats, status=state, consistent=statuses.is_consistent(state),
            steps_incomplete=sum(s.steps_incomplete for s in stats),
            steps_unverified=sum(s.steps_unverified for s in stats),
            refused_reports=sum(s.refused_reports for s in stats), reports_dropped=sum(s.reports_dropped for s in stats))

    def _series_report(self, conn: sa.Connection, s, topo: Topology, bad_rows: Sequence, cap: tuple[int, int],
                       budget: list[int]) -> StatisticReport:
        """One statistic of a report: its counts, status, σ figures, faults, refusals and its
        bad steps (:meth:`_report_step`)."""
        store = self.store
        fault_counts = store.fault_counts(conn, s["id"])
        pending = store.pending_steps(conn, s["id"])
        info = SeriesInfo.of(s)
        audited = sum(s[f"steps_{v}"] for v in core.VERDICTS)
        # a CP σ of steps audited with reports missing measures only the CP groups whose
        # peers all arrived: with no complete step, there is no CP figure to show
        complete = s["steps_consistent"] + s["steps_inconsistent"] + s["steps_audit_error"] + s["steps_unverified"]
        cp = {k: (s[k] if complete else None) for k in ("cp_disagreement_sigma", "worst_cp_disagreement_sigma",
                                                          "worst_cp_disagreement_step")}
        if complete and s["steps_incomplete"] and s["last_audited_step"] is not None:
            last = store.step_row(conn, s["id"], s["last_audited_step"])  # the latest figure is its step's
            if last is not None and last["verdict"] == "incomplete":
                cp["cp_disagreement_sigma"] = None
        return StatisticReport(
            statistic=s["statistic"], kind=s["kind"], spec=s["spec"], status=statuses.statistic_status(s),
            steps_audited=audited, steps_consistent=s["steps_consistent"],
            steps_inconsistent=s["steps_inconsistent"], steps_incomplete=s["steps_incomplete"],
            steps_audit_error=s["steps_audit_error"], steps_unverified=s["steps_unverified"], steps_pending=pending,
            # verdicts a late report replaced (each such step's previous_verdict says which)
            steps_reaudited=sum(s[f"superseded_{v}"] for v in REPLACEABLE),
            first_bad_step=s["first_bad_step"], last_bad_step=s["last_bad_step"],
            last_audited_step=s["last_audited_step"], faults=fault_counts,
            cp_disagreement_sigma=cp["cp_disagreement_sigma"], applied_error_sigma=wire_figure(s["applied_error_sigma"]),
            worst_cp_disagreement_sigma=cp["worst_cp_disagreement_sigma"],
            worst_cp_disagreement_step=cp["worst_cp_disagreement_step"],
            worst_applied_error_sigma=wire_figure(s["worst_applied_error_sigma"]),
            worst_applied_error_step=s["worst_applied_error_step"],
            ranks_behind=s["ranks_behind"], progress=None if s["progress"] is None else Progress.from_json(s["progress"]),
            bad_steps=[self._report_step(conn, info, topo, row, cap, budget) for row in bad_rows],
            bad_steps_shown=len(bad_rows),
            bad_steps_total=s["steps_inconsistent"] + s["steps_incomplete"] + s["steps_audit_error"],
            # reports refused (409) for contradicting this statistic's stored ones
            refused_reports=s["refused_reports"], refused_first_step=s["refused_first_step"],
            refused_last_step=s["refused_last_step"], refused_at=s["refused_at"], refused_kind=s["refused_kind"],
            # reports the trainers' clients dropped before sending them (issue 24): gaps
            reports_dropped=s["reports_dropped"], dropped_first_step=s["dropped_first_step"],
            dropped_last_step=s["dropped_last_step"],
        )

    def _rank_table(self, conn: sa.Connection, info: SeriesInfo, topo: Topology, row) -> list[core.RankRow]:
        """The per-rank table of a step, recomputed from its stored reports (all of them: a
        rank's correct value is its expected group's); [] when the audit fails."""
        try:  # the per-rank table is recomputed; a read must never fail on odd data
            return core.audit_step(
                self.store.step_reports(conn, info.id, row["step"]), topo.sizes, info.engine_spec,
                num_microbatches=max(1, row["expected"] // topo.placed_count(info.engine_spec)), kind=info.kind,
                **topo.audit_args(),
            ).rows
        except Exception:  # noqa: BLE001 - the stored verdict (audit_error) already says it
            log.exception("per-rank table of %s/%s step %d", info.run_id, info.statistic, row["step"])
            return []

    def _faults(self, conn: sa.Connection, info: SeriesInfo, row, fault_ranks: int | None,
                named: set[int] | None = None) -> list[Fault]:
        """A step's faults; each lists at most ``fault_ranks`` ranks (all when None), with
        ``ranks_total`` and ``ranks_truncated``; ``named`` (if given) gains every rank a
        fault names."""
        faults = []
        for f in self.store.step_faults(conn, info.id, row["step"]):
            ranks = list(core.expand_ranks(f["ranks"]) or ())
            n = len(ranks)
            if named is not None:
                named.update(ranks)
            cut = fault_ranks is not None and n > fault_ranks
            faults.append(Fault(kind=f["kind"], message=f["message"], ranks=ranks[:fault_ranks] if cut else ranks,
                                ranks_total=n, ranks_truncated=cut, evidence=f["evidence"]))
        return faults

    def _report_step(self, conn: sa.Connection, info: SeriesInfo, topo: Topology, row, caps: tuple[int, int],
                     budget: list[int]) -> StepDetail:
        """One of a report's bad steps: its faults, and at most ``cap`` rows of its per-rank
        table, the rows of the ranks its faults name first (rank order), then the rest (rank
        order); each fault lists at most ``fault_cap`` ranks (``caps = (cap, fault_cap)``).
        ``budget[0]``: reports the response may still re-audit; a step past it keeps its
        faults and ``ranks_total`` (the reports received) without rows."""
        cap, fault_cap = caps
        named: set[int] = set()
        faults = self._faults(conn, info, row, fault_cap, named)
        if cap <= 0 or budget[0] < row["received"]:
            return _step_document(StepDetail, row, faults, [], row["received"], row["received"] > 0)
        budget[0] -= row["received"]
        rows = self._rank_table(conn, info, topo, row)
        first = heapq.nsmallest(cap, rows, key=lambda r: (r.rank not in named and not r.faults, r.rank, r.microbatch))
        return _step_document(StepDetail, row, faults, [_rank_row(r) for r in first], len(rows),
                              len(rows) > len(first))

    def steps(self, run_id: str, statistic: str, *, start: int | None = None, stop: int | None = None,
              verdict: str | None = None, limit: int = 1000, after: int | None = None) -> tuple[StepsPage, int | None]:
        """Step history of one statistic (``GET .../statistics/{statistic}/steps``): one
        summary per stored step row, in step order, never re-audited: step, verdict
        (``pending`` while open), reports received of expected, the σ figures and rounding
        tolerance (σ of the correct statistic), the fault kinds.

        ``start``/``stop``: inclusive step bounds; ``verdict``: ``consistent``,
        ``inconsistent``, ``incomplete`` or ``pending``; ``after``: the last step of the
        previous page. Returns the page (``next_cursor`` None: a cursor is the server's to
        encode) and the key of the next page, the step to pass as ``after``, when more steps
        may follow (else None). Raises :class:`NotFound`."""
        lo = start if after is None else (after + 1 if start is None else max(start, after + 1))
        with self.store.read() as conn:
            found = self.store.series_rows(conn, run_id, statistic)
            if not found:
                raise NotFound(f"{run_id}/{statistic}" if self.store.run(conn, run_id) is not None else run_id)
            rows = self.store.step_rows(conn, found[0]["id"], start=lo, stop=stop, verdict=verdict, limit=limit + 1)
        more = len(rows) > limit
        rows = rows[:limit]
        steps = [StepSummary(
            step=r["step"], verdict=r["verdict"] or "pending", reports=r["received"], expected=r["expected"],
            cp_disagreement_sigma=_cp_sigma(r["verdict"], r["cp_disagreement_sigma"]),
            applied_error_sigma=wire_figure(r["applied_error_sigma"]), tolerance_sigma=r["tolerance_sigma"],
            fault_kinds=r["fault_kinds"].split(",") if r["fault_kinds"] else [], audited_at=r["audited_at"],
        ) for r in rows]
        page = StepsPage(run_id=run_id, statistic=statistic, kind=found[0]["kind"], steps=steps)
        return page, (rows[-1]["step"] if more and rows else None)

    def step(self, run_id: str, statistic: str, step: int, *, limit: int | None = None,
             after: tuple[int, int] | None = None) -> tuple[StepPage, tuple[int, int] | None]:
        """One step's verdict, faults (every rank) and per-rank table (``GET .../steps/{step}``):
        the rows in (rank, microbatch) order after ``after`` (the key of the previous page),
        at most ``limit`` (all when None); ``ranks_total`` rows in all, ``ranks_truncated``
        when more follow. Returns the page (``next_cursor`` None) and the (rank, microbatch)
        key of its last row when more rows follow (else None). Raises :class:`NotFound`."""
        with self.store.read() as conn:
            topo = Topology.of_row(self._run_row(conn, run_id))
            found = self.store.series_rows(conn, run_id, statistic)
            if not found:
                raise NotFound(f"{run_id}/{statistic}")
            row = self.store.step_row(conn, found[0]["id"], step)
            if row is None:
                raise NotFound(f"{run_id}/{statistic}/{step}")
            info = SeriesInfo.of(found[0])
            faults = self._faults(conn, info, row, None)
            rows = sorted(self._rank_table(conn, info, topo, row), key=lambda r: (r.rank, r.microbatch))
        total = len(rows)
        if after is not None:
            rows = rows[bisect.bisect_right(rows, tuple(after), key=lambda r: (r.rank, r.microbatch)):]
        more = limit is not None and len(rows) > limit
        rows = rows[:limit] if more else rows
        page = _step_document(StepPage, row, faults, [_rank_row(r) for r in rows], total, more, run_id=run_id,
                              statistic=statistic)
        return page, ((rows[-1].rank, rows[-1].microbatch) if more and rows else None)

    def metric_series(self, since: float, max_series: int | None = None) -> list[dict]:
        """Per-series figures for /metrics (:meth:`auditor.db.store.Store.metric_series`)."""
        return self.store.metric_series(since, max_series)


def _cp_sigma(verdict: str | None, sigma: float | None) -> float | None:
    """A step's CP-disagreement σ as shown: none for a step audited ``incomplete`` (a CP
    peer's report is missing, so the figure covers only the groups that all arrived and
    would read as a measured 0)."""
    return None if verdict == "incomplete" else sigma


def _step_document(cls: type[StepDetail], row, faults: list[Fault], ranks: list[RankRow], total: int,
                   truncated: bool, **more) -> StepDetail:
    """A :class:`StepDetail` (or :class:`StepPage`, ``more`` its ``run_id`` and
    ``statistic``) of a stored step row, its faults and (a part of) its per-rank table."""
    return cls(step=row["step"], verdict=row["verdict"], audited_at=row["audited_at"],
               previous_verdict=row["previous_verdict"], verdict_changed_at=row["verdict_changed_at"],
               reports=row["received"], expected=row["expected"],
               cp_disagreement_sigma=_cp_sigma(row["verdict"], row["cp_disagreement_sigma"]),
               applied_error_sigma=wire_figure(row["applied_error_sigma"]), faults=faults, ranks=ranks, ranks_total=total,
               ranks_truncated=truncated, **more)


def _run_summary(r: RunRow, srows) -> Run:
    """The :class:`Run` of a stored run and its series rows."""
    state = statuses.run_status(srows)
    topo = Topology(r.world_size, r.sizes, r.expert, r.order, r.known)  # the order as stored
    return Run(
        run_id=r.run_id, topology_source=r.source, created_at=r.created_at, **topo.describe(),
        last_activity=max((s["updated_at"] for s in srows), default=r.created_at),
        statistics=sorted(s["statistic"] for s in srows),
        steps_audited=sum(s[f"steps_{v}"] for s in srows for v in core.VERDICTS),
        steps_inconsistent=sum(s["steps_inconsistent"] for s in srows),
        steps_audit_error=sum(s["steps_audit_error"] for s in srows),
        steps_incomplete=sum(s["steps_incomplete"] for s in srows),
        steps_unverified=sum(s["steps_unverified"] for s in srows),
        refused_reports=sum(s["refused_reports"] for s in srows),
        reports_dropped=sum(s["reports_dropped"] for s in srows),
        status=state, consistent=statuses.is_consistent(state), workload=r.workload,
    )


def _rank_row(r: core.RankRow) -> RankRow:
    """The :class:`RankRow` of a per-rank table's row: each value as
    :func:`auditor.db.store.json_safe` gives it (numpy scalars as Python values, NaN/Inf as
    strings), value by value (up to :data:`REPORT_ROWS_BUDGET` rows a report: no generic
    walk of each row)."""
    v = json_scalar
    return RankRow(rank=v(r.rank), microbatch=v(r.microbatch), coords={str(k): v(n) for k, n in r.coords.items()},
                   local_count=v(r.local_count), local_mean=v(r.local_mean), applied_mean=v(r.applied_mean),
                   applied_std=v(r.applied_std), correct_mean=v(r.correct_mean), correct_std=v(r.correct_std),
                   error_sigma=v(r.error_sigma), faults=list(r.faults), relative_error=v(r.relative_error))


class LocalReader:
    """The read protocol of :class:`auditor.reader.Reader` served from a database: the same
    methods, arguments and documents, read through a :class:`auditor.service.Service`. The
    typed reads hand out the service's documents as built (no JSON round trip); the
    ``*_json`` ones are their :meth:`to_json`, as the HTTP API answers them less the
    report's ``page`` link, which only a server has. What the CLI opens when it is given a
    database instead of a URL. An unknown run, statistic or step raises
    :class:`auditor.service.NotFound`."""

    def __init__(self, service: "Service"):
        self.service = service

    def __enter__(self) -> "LocalReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to release: the service belongs to whoever made it."""

    # ------------------------------------------------------------------ typed reads
    def runs(self, *, status: str | None = None, page_size: int = 100) -> Iterator[Run]:
        """Every run, newest first (``GET /v1/runs``), read ``page_size`` at a time."""
        after = None
        while True:
            rows, after = self.service.runs_page(limit=page_size, after=after, status=status)
            yield from rows
            if after is None:
                return

    def run(self, run_id: str) -> Run:
        """One run's summary (``GET /v1/runs/{run_id}``)."""
        return self.service.get_run(run_id)

    def report(self, run_id: str, *, statistic: str | None = None, bad_steps: int = 20,
               rank_rows: int | None = None) -> Report:
        """The consistency report of ``run_id`` (optionally of one ``statistic``;
        ``rank_rows`` None: :data:`REPORT_RANK_ROWS`), ``page`` None."""
        return self.service.report(run_id, bad_steps_limit=bad_steps, statistic=statistic,
                                   rank_rows=REPORT_RANK_ROWS if rank_rows is None else rank_rows)

    def steps(self, run_id: str, statistic: str, *, start: int | None = None, stop: int | None = None,
              verdict: str | None = None, page_size: int = 1000) -> Iterator[StepSummary]:
        """Every item of ``GET .../statistics/{statistic}/steps``, read ``page_size`` at a
        time: a consumer that does not keep them holds one page at most."""
        after = None
        while True:
            page, after = self.service.steps(run_id, statistic, start=start, stop=stop, verdict=verdict,
                                             limit=page_size, after=after)
            yield from page.steps
            if after is None:
                return

    def step(self, run_id: str, statistic: str, step: int, *, page_size: int = 10_000,
             limit: int | None = None, after: tuple[int, int] | None = None) -> StepPage:
        """``GET .../statistics/{statistic}/steps/{step}`` with the rows of every page: the
        rank rows after ``after``, at most ``limit`` (every row when None), ``ranks_total``
        in all, ``ranks_truncated`` true when more follow, ``next_cursor`` None (one read:
        ``page_size`` does not change the document)."""
        page, _ = self.service.step(run_id, statistic, step, limit=limit,
                                    after=None if after is None else (int(after[0]), int(after[1])))
        return page

    def workload(self, workload: str, *, start: int | None = None, stop: int | None = None,
                 steps: int | None = None) -> Workload:
        """``GET /v1/workloads/{workload}`` (``page`` None)."""
        from auditor.service.workloads import WORKLOAD_STEPS
        return self.service.compare_workload(workload, start=start, stop=stop, max_steps=steps or WORKLOAD_STEPS)

    def compare(self, run_ids: list[str], *, start: int | None = None, stop: int | None = None,
                steps: int | None = None) -> Workload:
        """``GET /v1/compare?run=…``."""
        from auditor.service.workloads import WORKLOAD_STEPS
        return self.service.compare_runs(run_ids, start=start, stop=stop, max_steps=steps or WORKLOAD_STEPS)

    # ----------------------------------------------------------------- JSON documents
    def runs_json(self, *, status: str | None = None, page_size: int = 100) -> Iterator[dict]:
        """:meth:`runs`, each as JSON."""
        return (r.to_json() for r in self.runs(status=status, page_size=page_size))

    def report_json(self, run_id: str, *, bad_steps: int = 20, rank_rows: int | None = None) -> dict:
        """:meth:`report` as JSON (no ``page``)."""
        return self.report(run_id, bad_steps=bad_steps, rank_rows=rank_rows).to_json()

    def steps_json(self, run_id: str, statistic: str, *, start: int | None = None, stop: int | None = None,
                   verdict: str | None = None, page_size: int = 1000) -> Iterator[dict]:
        """:meth:`steps`, each as JSON."""
        return (s.to_json() for s in self.steps(run_id, statistic, start=start, stop=stop, verdict=verdict,
                                                page_size=page_size))

    def step_json(self, run_id: str, statistic: str, step: int, *, page_size: int = 10_000,
                  limit: int | None = None, after: tuple[int, int] | None = None) -> dict:
        """:meth:`step` as JSON."""
        return self.step(run_id, statistic, step, page_size=page_size, limit=limit, after=after).to_json()

    def workload_json(self, workload: str, **kw) -> dict:
        """:meth:`workload` as JSON (no ``page``)."""
        return self.workload(workload, **kw).to_json()

    def compare_json(self, run_ids: list[str], **kw) -> dict:
        """:meth:`compare` as JSON."""
        return self.compare(run_ids, **kw).to_json()
