"""The statements of runs and series rows: their creation (``ON CONFLICT DO NOTHING``, then
read back), the lock an ingest holds on its series, the refusal counts of a 409, and the
deletion of a run (whole steps, rank ranges of a large step, then the rows above them)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Iterable, Sequence

import sqlalchemy as sa

from auditor.db.dialect import Statements
from auditor.db.races import RowDeleted
from auditor.db.rows import RunRow, SeriesRow
from auditor.db.tables import faults, report_drops, reports, runs, series, series_faults, step_audits


class RunStatements(Statements):
    """Runs and series: create, lock, count refusals, delete (a part of :class:`auditor.db.store.Store`)."""

    def ensure_run(self, conn: sa.Connection, run_id: str, world_size: int, sizes: tuple[int, int, int, int],
                   now: float, expert: tuple[int, int, int, int] | None = None, order: str | None = None,
                   known: bool = True, source: str | None = None) -> RunRow:
        """Create the run with this topology (and ``source``, where its layout came from)
        unless it exists; return the stored run. Raises
        :class:`RowDeleted` when a concurrent deletion of the run committed between the two
        statements (PostgreSQL, read committed: the INSERT found the row, the SELECT no
        more)."""
        conn.execute(
            self._insert(runs).values(
                run_id=run_id, world_size=world_size, created_at=now,
                **dict(zip(("dp", "cp", "tp", "pp"), sizes)),
                **(dict(zip(("edp", "ep", "etp"), expert[:3])) if expert else {}),
                rank_order=order, topology="known" if known else "unknown", topology_source=source,
            ).on_conflict_do_nothing()
        )
        row = conn.execute(sa.select(runs).where(runs.c.run_id == run_id)).one_or_none()
        if row is None:
            raise RowDeleted(f"run {run_id!r}")
        return RunRow.of(row)

    def label_workload(self, conn: sa.Connection, run_id: str, workload: str) -> str | None:
        """Give run ``run_id`` the label ``workload`` unless it has one; return the run's label
        (``workload``, or the one it had: the caller compares) or None when the run is gone."""
        conn.execute(sa.update(runs).where(runs.c.run_id == run_id, runs.c.workload.is_(None)).values(workload=workload))
        return conn.execute(sa.select(runs.c.workload).where(runs.c.run_id == run_id)).scalar_one_or_none()

    def workload_runs(self, conn: sa.Connection, workload: str, limit: int) -> list[RunRow]:
        """The runs labelled ``workload``, by run id, at most ``limit`` (indexed read)."""
        rows = conn.execute(sa.select(runs).where(runs.c.workload == workload).order_by(runs.c.run_id).limit(limit))
        return [RunRow.of(r) for r in rows]

    def runs_created_at(self, conn: sa.Connection, run_ids: Iterable[str]) -> dict[str, float]:
        """``{run_id: created_at}`` of those of ``run_ids`` that exist (one indexed read;
        :meth:`_fetch_in`)."""
        return dict(self._fetch_in(conn, "SELECT run_id, created_at FROM runs WHERE run_id {}", sorted(run_ids)))

    def ensure_series(self, conn: sa.Connection, run_id: str, statistic: str, kind: str, spec: dict,
                      now: float) -> SeriesRow:
        """Create the (run, statistic) with this kind and spec unless it exists; return the
        stored one. Raises :class:`RowDeleted` as :meth:`ensure_run` does."""
        conn.execute(
            self._insert(series).values(
                run_id=run_id, statistic=statistic, kind=kind, spec=spec, created_at=now, updated_at=now,
            ).on_conflict_do_nothing()
        )
        row = conn.execute(
            sa.select(series).where(series.c.run_id == run_id, series.c.statistic == statistic)
        ).one_or_none()
        if row is None:
            raise RowDeleted(f"statistic {statistic!r} of run {run_id!r}")
        return SeriesRow(*row)

    def statistic_names(self, conn: sa.Connection, run_id: str, limit: int) -> list[str]:
        """Up to ``limit`` statistic names of a run."""
        return conn.execute(sa.select(series.c.statistic).where(series.c.run_id == run_id).limit(limit)
                            ).scalars().all()

    def series_by_id(self, conn: sa.Connection, series_id: int) -> tuple[SeriesRow, RunRow] | None:
        """A series and its run; None if it was deleted."""
        row = conn.execute(
            sa.select(series, *runs.c).join(runs, runs.c.run_id == series.c.run_id).where(series.c.id == series_id)
        ).one_or_none()
        if row is None:
            return None
        n = len(series.columns)
        return SeriesRow(*row[:n]), RunRow.of(SimpleNamespace(**dict(zip(runs.c.keys(), row[n:]))))

    def lock_series(self, conn: sa.Connection, series_ids: Iterable[int]) -> int:
        """Hold the rows of ``series_ids`` ``FOR KEY SHARE`` until the transaction ends
        (PostgreSQL; SQLite's write transaction holds the whole database) and return how
        many exist. An ingest takes them, in id order, before it writes any report or step
        row: what the foreign keys of ``reports`` and ``step_audits`` did per row on
        PostgreSQL (migration 0006), once per batch. A deletion (:meth:`delete_run_rows`)
        waits for the lock; a series deleted before it is missing from the count, and the
        caller retries the batch (``auditor.service.ingest.RETRY``: a stale cache)."""
        ids = sorted(set(series_ids))
        if not ids:
            return 0
        lock = " ORDER BY id FOR KEY SHARE" if self.dialect == "postgresql" else ""
        return len(self._fetch_in(conn, "SELECT id FROM series WHERE id {}" + lock, ids))

    def record_refused(self, conn: sa.Connection, refused: Sequence[tuple[str, str, int, int, int, str]],
                       now: float) -> int:
        """Count reports a 409 refused against the series they contradicted: per
        ``(run_id, statistic, n, first_step, last_step, kind)`` add ``n`` to
        ``refused_reports``, widen ``refused_first_step``/``refused_last_step`` to the
        steps, set ``refused_at`` to ``now`` (Unix seconds) and ``refused_kind``. A series
        that does not exist is skipped (nothing of a refused batch is stored, so a new
        run's series never is). Returns the number of series updated. One UPDATE per
        series, in series id order (the order :meth:`record_verdicts` locks them in)."""
        return self._count_reports(conn, [r[:5] for r in refused], "refused_reports", "refused_first_step",
                                   "refused_last_step", [{"refused_at": now, "refused_kind": r[5][:32]} for r in refused])

    def _count_reports(self, conn: sa.Connection, rows: Sequence[tuple[str, str, int, int, int]], count: str,
                       first: str, last: str, extra: Sequence[dict] | None = None) -> int:
        """Per ``(run_id, statistic, n, lo, hi)`` (and its ``extra`` column values): add
        ``n`` to the series' column ``count`` and widen ``first``/``last`` to ``lo``/``hi``."""
        c = series.c
        keys = {(r[0], r[1]) for r in rows}
        if not keys:
            return 0
        ids = {(row.run_id, row.statistic): row.id for row in conn.execute(
            sa.select(c.id, c.run_id, c.statistic).where(c.run_id.in_(sorted({k[0] for k in keys}))))
            if (row.run_id, row.statistic) in keys}
        more = extra or [{}] * len(rows)
        done = 0
        for sid, (_, _, n, lo, hi), values in sorted(((ids[(r[0], r[1])], r, e) for r, e in zip(rows, more)
                                                      if (r[0], r[1]) in ids), key=lambda x: x[0]):
            lo_c, hi_c = c[first], c[last]
            done += conn.execute(series.update().where(c.id == sid).values(
                **{count: c[count] + n,
                   first: sa.case((lo_c.is_(None), lo), (lo_c > lo, lo), else_=lo_c),
                   last: sa.case((hi_c.is_(None), hi), (hi_c < hi, hi), else_=hi_c)},
                **values,
            )).rowcount
        return done

    def idle_runs(self, conn: sa.Connection, before: float, limit: int) -> list[str]:
        """Runs with no activity since ``before`` (newest series update, else creation), oldest first."""
        last = sa.func.coalesce(sa.func.max(series.c.updated_at), runs.c.created_at)
        return conn.execute(
            sa.select(runs.c.run_id).select_from(runs.outerjoin(series, series.c.run_id == runs.c.run_id))
            .group_by(runs.c.run_id, runs.c.created_at).having(last < before).order_by(last).limit(limit)
        ).scalars().all()

    def first_steps(self, conn: sa.Connection, series_id: int, limit: int) -> list[tuple[int, int, int]]:
        """The first ``limit`` steps of a series: ``(step, received, expected)``."""
        sa_ = step_audits.c
        return [tuple(r) for r in conn.execute(
            sa.select(sa_.step, sa_.received, sa_.expected).where(sa_.series_id == series_id)
            .order_by(sa_.step).limit(limit)
        ).all()]

    def delete_steps(self, conn: sa.Connection, series_id: int, first: int, last: int) -> tuple[int, int]:
        """Delete the reports (and their dropped tallies), faults and step rows of steps
        ``first..last`` of a series: ``(reports deleted, steps deleted)``."""
        n = conn.execute(reports.delete().where(reports.c.series_id == series_id,
                                                reports.c.step.between(first, last))).rowcount
        conn.execute(report_drops.delete().where(report_drops.c.series_id == series_id,
                                                 report_drops.c.step.between(first, last)))
        conn.execute(faults.delete().where(faults.c.series_id == series_id, faults.c.step.between(first, last)))
        m = conn.execute(step_audits.delete().where(step_audits.c.series_id == series_id,
                                                    step_audits.c.step.between(first, last))).rowcount
        return n, m

    def delete_rank_range(self, conn: sa.Connection, series_id: int, step: int, span: int) -> int | None:
        """Delete the reports of one step from its lowest stored rank up to ``span`` ranks
        on; the number deleted, or None when the step holds no report any more."""
        c = reports.c
        lo = conn.execute(sa.select(sa.func.min(c.rank)).where(c.series_id == series_id, c.step == step)).scalar_one()
        if lo is None:
            return None
        return conn.execute(reports.delete().where(c.series_id == series_id, c.step == step,
                                                   c.rank < lo + span)).rowcount

    def delete_run_rows(self, conn: sa.Connection, run_id: str, series_ids: Sequence[int]) -> None:
        """Delete a run: its series_faults, reports, step rows, faults, series and run row,
        whatever arrived meanwhile included.

        Lock order, the one every ingest follows (:meth:`lock_series`): the run row first
        (``FOR UPDATE``: an ingest making a new series of the run waits, then finds the run
        gone), then its series rows (``FOR UPDATE``: waits for every ingest holding one
        ``FOR KEY SHARE`` to commit), and only then, in statements that see what those
        ingests committed, the rows below them. On PostgreSQL ``reports`` and
        ``step_audits`` have no foreign key (migration 0006), so they are deleted here, not
        by ``ON DELETE CASCADE``; ``series_ids`` (read before the chunked deletion) is
        widened by the series the run has now."""
        conn.execute(sa.select(runs.c.run_id).where(runs.c.run_id == run_id).with_for_update())
        ids = sorted(set(series_ids).union(conn.execute(
            sa.select(series.c.id).where(series.c.run_id == run_id).order_by(series.c.id).with_for_update()
        ).scalars()))
        if ids:
            conn.execute(series_faults.delete().where(series_faults.c.series_id.in_(ids)))
            conn.execute(reports.delete().where(reports.c.series_id.in_(ids)))
            conn.execute(step_audits.delete().where(step_audits.c.series_id.in_(ids)))
        conn.execute(runs.delete().where(runs.c.run_id == run_id))
