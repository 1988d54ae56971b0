"""The statements of the reports the trainers' clients dropped (issue 24, wire field
``dropped``): the tally each stored report carried (``report_drops``, by report key) and
the counts on the series (``series.reports_dropped``, ``dropped_first_step``/``_last_step``),
both written in the ingest's transaction (:mod:`auditor.service.dropped`)."""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import sqlalchemy as sa

from auditor.db.dialect import Statements
from auditor.db.tables import report_drops, series

#: The most a series counts as dropped (the wire's bound on one report's ``dropped.count``,
#: 2**62): the count saturates there, so that reports each within the bound never overflow
#: the BIGINT column (PostgreSQL raised "bigint out of range", a 500; SQLite turned the sum
#: into a float that no read could decode).
MAX_DROPPED = 2**62  # = auditor.contract.fields.MAX_STEP (the store imports no wire contract)

#: A report key: (series_id, step, microbatch, rank).
Key = tuple[int, int, int, int]
#: A tally: (count, first_step, last_step).
Tally = tuple[int, int, int]


class DropStatements(Statements):
    """Dropped-report tallies and counts (a part of :class:`auditor.db.store.Store`)."""

    def report_drops(self, conn: sa.Connection, keys: Iterable[Key]) -> dict[Key, Tally]:
        """The tallies stored for the reports ``keys`` (those that carried one), by key; on
        PostgreSQL their rows are held ``FOR UPDATE`` (key order) until the transaction ends,
        so two re-sends of one report count its tally's growth once."""
        wanted = sorted(set(keys))
        if not wanted:
            return {}
        c = report_drops.c
        out: dict[Key, Tally] = {}
        for sid in sorted({k[0] for k in wanted}):
            mine = [k for k in wanted if k[0] == sid]
            q = (sa.select(c.series_id, c.step, c.microbatch, c.rank, c.count, c.first_step, c.last_step)
                 .where(c.series_id == sid, c.step.in_(sorted({k[1] for k in mine})))
                 .order_by(c.series_id, c.step, c.microbatch, c.rank))
            if self.dialect == "postgresql":
                q = q.with_for_update()
            want = set(mine)
            for row in conn.execute(q):
                if tuple(row[:4]) in want:
                    out[tuple(row[:4])] = tuple(row[4:])
        return out

    def store_drops(self, conn: sa.Connection, rows: Sequence[tuple[Key, Tally]]) -> None:
        """Insert or replace the tallies of reports (key order)."""
        if not rows:
            return
        stmt = self._insert(report_drops)
        conn.execute(
            stmt.on_conflict_do_update(
                index_elements=["series_id", "step", "microbatch", "rank"],
                set_={"count": stmt.excluded.count, "first_step": stmt.excluded.first_step,
                      "last_step": stmt.excluded.last_step}),
            [{"series_id": k[0], "step": k[1], "microbatch": k[2], "rank": k[3], "count": n, "first_step": lo,
              "last_step": hi} for k, (n, lo, hi) in sorted(rows)])

    def count_drops(self, conn: sa.Connection, drops: Mapping[int, Tally]) -> None:
        """Per series id, add ``count`` to ``reports_dropped`` (saturating at
        :data:`MAX_DROPPED`) and widen
        ``dropped_first_step``/``dropped_last_step`` to the steps; one UPDATE per series,
        in id order (the order every transaction updates series rows in:
        :meth:`auditor.db.store.Store.record_verdicts` calls this within its own pass)."""
        if drops:
            conn.execute(drops_statement(), drops_params(drops))


def drops_statement() -> sa.Update:
    """The ``series`` UPDATE of :meth:`DropStatements.count_drops`, one parameter set per series."""
    c = series.c
    n = sa.bindparam("d_n", type_=sa.BigInteger)
    lo = sa.bindparam("d_lo", type_=sa.BigInteger)
    hi = sa.bindparam("d_hi", type_=sa.BigInteger)
    first, last = c.dropped_first_step, c.dropped_last_step
    return series.update().where(c.id == sa.bindparam("d_sid", type_=sa.BigInteger)).values(
        reports_dropped=sa.case((c.reports_dropped > sa.literal(MAX_DROPPED, sa.BigInteger) - n, MAX_DROPPED),
                                else_=c.reports_dropped + n),
        dropped_first_step=sa.case((first.is_(None), lo), (first > lo, lo), else_=first),
        dropped_last_step=sa.case((last.is_(None), hi), (last < hi, hi), else_=last))


def drops_params(drops: Mapping[int, Tally]) -> list[dict]:
    """:func:`drops_statement`'s parameter sets of ``drops`` (series id: tally), in id order."""
    return [{"d_sid": sid, "d_n": n, "d_lo": lo, "d_hi": hi} for sid, (n, lo, hi) in sorted(drops.items())]
