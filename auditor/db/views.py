"""The read models' statements: runs by keyset page and status, series rows and their
fault counts, bad steps, step history, one step and its faults, the figures of /metrics.
Nothing here writes."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import sqlalchemy as sa

from auditor.core import REPLACEABLE, VERDICTS
from auditor.db.dialect import Statements
from auditor.db.rows import FaultRow, RunRow, SeriesRow, StepLine, StepRow
from auditor.db.tables import faults, runs, series, series_faults, step_audits
from auditor.status import STATUSES


class ViewStatements(Statements):
    """Reads for the API's documents and /metrics (a part of :class:`auditor.db.store.Store`)."""

    def runs(self, conn: sa.Connection, limit: int | None = None, after: tuple[float, str] | None = None,
             status: str | None = None) -> list[RunRow]:
        """Runs (:class:`RunRow`), newest first (``created_at``, then ``run_id``), from the keyset position
        ``after`` (the last run of the previous page), at most ``limit``; served from
        ``ix_runs_created_at_run_id`` and the per-series aggregates. ``status`` filters by
        the status :mod:`auditor.status` defines, in SQL over those aggregates:
        ``inconsistent`` (some series has an inconsistent or audit_error step),
        ``unverified`` (none, but some step audited unverified), ``incomplete`` (neither,
        but some step audited incomplete), ``consistent`` (none of these, and some step
        audited) or ``pending`` (no step audited). Raises ``ValueError`` for
        any other ``status``."""
        q = sa.select(runs).order_by(runs.c.created_at.desc(), runs.c.run_id.desc())
        if status is not None:
            q = q.where(_status_is(status))
        if after is not None:
            q = q.where(sa.or_(runs.c.created_at < after[0],
                               sa.and_(runs.c.created_at == after[0], runs.c.run_id < after[1])))
        if limit is not None:
            q = q.limit(limit)
        return [RunRow.of(r) for r in conn.execute(q)]

    def run(self, conn: sa.Connection, run_id: str) -> RunRow | None:
        """The run (:class:`RunRow`) of ``run_id``, or None."""
        row = conn.execute(sa.select(runs).where(runs.c.run_id == run_id)).one_or_none()
        return None if row is None else RunRow.of(row)

    def series_rows(self, conn: sa.Connection, run_id: str | Sequence[str] | None = None,
                    statistic: str | None = None, ordered: bool = False) -> list[SeriesRow]:
        """``series`` rows (:class:`SeriesRow`; all, of one run or of several, or one statistic of a run); by
        statistic if ``ordered``."""
        q = sa.select(series)
        if isinstance(run_id, str):
            q = q.where(series.c.run_id == run_id)
        elif run_id is not None:
            q = q.where(series.c.run_id.in_(list(run_id)))
        if statistic is not None:
            q = q.where(series.c.statistic == statistic)
        if ordered:
            q = q.order_by(series.c.statistic)
        return [SeriesRow(*r) for r in conn.execute(q)]

    def fault_counts(self, conn: sa.Connection, series_id: int) -> dict[str, int]:
        """Faults found so far in a series, by kind (sorted)."""
        return dict(conn.execute(
            sa.select(series_faults.c.kind, series_faults.c.count)
            .where(series_faults.c.series_id == series_id, series_faults.c.count > 0).order_by(series_faults.c.kind)
        ).all())

    def pending_steps(self, conn: sa.Connection, series_id: int) -> int:
        """Steps of a series with no verdict yet."""
        return conn.execute(
            sa.select(sa.func.count()).select_from(step_audits)
            .where(step_audits.c.series_id == series_id, step_audits.c.verdict.is_(None))
        ).scalar_one()

    def bad_steps(self, conn: sa.Connection, series_id: int, limit: int) -> list[StepRow]:
        """Up to ``limit`` step rows (:class:`StepRow`) of a series judged inconsistent or
        audit_error (first) or audited with reports missing (incomplete, or unverified while
        incomplete), by step."""
        v = step_audits.c.verdict
        return [StepRow(*r) for r in conn.execute(
            sa.select(step_audits)
            .where(step_audits.c.series_id == series_id,
                   sa.or_(v.in_(("inconsistent", "audit_error", "incomplete")),
                          sa.and_(v == "unverified", step_audits.c.complete_at_audit.is_(False))))
            .order_by(v.in_(("incomplete", "unverified")), step_audits.c.step).limit(limit)
        )]

    def step_rows(self, conn: sa.Connection, series_id: int, *, start: int | None = None, stop: int | None = None,
                  verdict: str | None = None, limit: int = 1000) -> list[StepLine]:
        """The stored per-step rows (:class:`StepLine`) of a series in step order (never re-audited): step,
        verdict (None while open), received, expected, σ figures, tolerance, fault kinds,
        audited_at; steps in [``start``, ``stop``], of one ``verdict`` (``pending``: open),
        at most ``limit``. Keyset reads over the primary key (series_id, step), or over
        ``ix_step_audits_series_verdict_step`` when filtered by verdict."""
        a = step_audits.c
        q = (sa.select(*StepLine.columns)
             .where(a.series_id == series_id).order_by(a.step).limit(limit))
        if verdict == "pending":
            q = q.where(a.verdict.is_(None))
        elif verdict is not None:
            q = q.where(a.verdict == verdict)
        if start is not None:
            q = q.where(a.step >= start)
        if stop is not None:
            q = q.where(a.step <= stop)
        return [StepLine(*r) for r in conn.execute(q)]

    def count_step_rows(self, conn: sa.Connection, series_id: int, *, start: int | None = None,
                        stop: int | None = None) -> int:
        """How many step rows a series holds in [``start``, ``stop``] (an index-only count
        over the primary key)."""
        a = step_audits.c
        q = sa.select(sa.func.count()).select_from(step_audits).where(a.series_id == series_id)
        if start is not None:
            q = q.where(a.step >= start)
        if stop is not None:
            q = q.where(a.step <= stop)
        return int(conn.execute(q).scalar_one())

    def step_row(self, conn: sa.Connection, series_id: int, step: int) -> StepRow | None:
        """The ``step_audits`` row (:class:`StepRow`) of one step, or None."""
        row = conn.execute(
            sa.select(step_audits).where(step_audits.c.series_id == series_id, step_audits.c.step == step)
        ).one_or_none()
        return None if row is None else StepRow(*row)

    def step_faults(self, conn: sa.Connection, series_id: int, step: int) -> list[FaultRow]:
        """The fault rows (:class:`FaultRow`: kind, ranks as stored text, message, evidence) of
        one step, in recorded order."""
        return [FaultRow(*r) for r in conn.execute(
            sa.select(*FaultRow.columns)
            .where(faults.c.series_id == series_id, faults.c.step == step).order_by(faults.c.id)
        )]

    def metric_series(self, since: float, max_series: int | None = None) -> list[dict]:
        """Per-series figures for /metrics, for series active after ``since`` (Unix s).

        Each dict: ``run_id``, ``statistic``, ``kind``, ``steps`` (verdict → verdicts ever recorded:
        current + superseded by re-audits, so the exported counters never go down),
        ``faults`` (kind → findings ever recorded), ``cp_disagreement_sigma``,
        ``applied_error_sigma``, ``last_audited_step``, ``ranks_behind``, ``reports_dropped``
        (reports the trainers' clients dropped before sending them). At most ``max_series`` series (the
        most recently active) get their own dict; the others are summed into one with
        ``run_id`` and ``statistic`` ``"_other"`` (gauges: their maximum), so a scrape is
        bounded however many runs exist.
        """
        s = series.c
        verdict_cols = [(v, s[f"steps_{v}"] + (s[f"superseded_{v}"] if v in REPLACEABLE else 0)) for v in VERDICTS]
        fsum = series_faults.c.count + series_faults.c.superseded
        with self.read() as conn:
            q = (sa.select(s.id, s.run_id, s.statistic, s.kind, s.cp_disagreement_sigma, s.applied_error_sigma,
                           s.last_audited_step, s.ranks_behind, s.reports_dropped,
                           *[c.label(v) for v, c in verdict_cols])
                 .where(s.updated_at >= since).order_by(s.updated_at.desc(), s.id))
            if max_series is not None:
                q = q.limit(max_series)
            rows = conn.execute(q).mappings().all()
            ids = [r["id"] for r in rows]
            fcounts: dict[int, dict[str, int]] = defaultdict(dict)
            if ids:
                for sid, kind, n in conn.execute(
                    sa.select(series_faults.c.series_id, series_faults.c.kind, fsum)
                    .where(series_faults.c.series_id.in_(ids))
                ):
                    fcounts[sid][kind] = n
            out = [{"run_id": r["run_id"], "statistic": r["statistic"], "kind": r["kind"],
                    "steps": {v: r[v] for v in VERDICTS},
                    "faults": fcounts.get(r["id"], {}),
                    **{k: r[k] for k in ("cp_disagreement_sigma", "applied_error_sigma", "last_audited_step",
                                         "ranks_behind", "reports_dropped")}}
                   for r in rows]
            if max_series is None or len(rows) < max_series:
                return out
            other = _metric_other(conn, since, ids, verdict_cols, fsum)
        return out if other is None else [*out, other]



def _status_is(status: str) -> Any:
    """The SQL condition that a run has ``status`` (:mod:`auditor.status`), over its series'
    aggregates; ``ValueError`` for any other ``status``."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}; got {status!r}")
    c = series.c

    def some(cond):
        return sa.exists().where(c.run_id == runs.c.run_id, cond)

    bad = some(sa.or_(c.steps_inconsistent > 0, c.steps_audit_error > 0))
    unverified = some(c.steps_unverified > 0)
    # consistent steps of a statistic whose client dropped reports: gaps (auditor.status)
    incomplete = some(sa.or_(c.steps_incomplete > 0, sa.and_(c.steps_consistent > 0, c.reports_dropped > 0)))
    ok = some(c.steps_consistent > 0)
    return {"inconsistent": bad, "unverified": sa.and_(~bad, unverified),
            "incomplete": sa.and_(~bad, ~unverified, incomplete),
            "consistent": sa.and_(~bad, ~unverified, ~incomplete, ok),
            "pending": sa.and_(~bad, ~unverified, ~incomplete, ~ok)}[status]


def _metric_other(conn: sa.Connection, since: float, ids: list[int], verdict_cols: list, fsum: Any) -> dict | None:
    """The ``_other`` figures of :meth:`ViewStatements.metric_series`: the series active
    after ``since`` beyond those of ``ids``, summed (gauges: their maximum); None if none."""
    s = series.c
    rest = sa.and_(s.updated_at >= since, s.id.not_in(ids)) if ids else (s.updated_at >= since)
    agg = conn.execute(
        sa.select(sa.func.count(), *[sa.func.coalesce(sa.func.sum(c), 0) for _, c in verdict_cols],
                  sa.func.max(s.cp_disagreement_sigma), sa.func.max(s.applied_error_sigma),
                  sa.func.max(s.last_audited_step), sa.func.max(s.ranks_behind),
                  sa.func.coalesce(sa.func.sum(s.reports_dropped), 0)).where(rest)
    ).one()
    if not agg[0]:
        return None
    kinds = dict(conn.execute(
        sa.select(series_faults.c.kind, sa.func.sum(fsum))
        .join(series, series.c.id == series_faults.c.series_id).where(rest).group_by(series_faults.c.kind)
    ).all())
    n_v = len(VERDICTS)
    return {"run_id": "_other", "statistic": "_other",
            "steps": {v: int(agg[1 + i]) for i, v in enumerate(VERDICTS)},
            "faults": {k: int(n) for k, n in kinds.items()},
            "cp_disagreement_sigma": agg[1 + n_v], "applied_error_sigma": agg[2 + n_v],
            "last_audited_step": agg[3 + n_v], "ranks_behind": agg[4 + n_v], "reports_dropped": int(agg[5 + n_v])}
