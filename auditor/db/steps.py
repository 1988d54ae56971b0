"""The statements of step rows (``step_audits``): arrivals counted per step, the verdicts
recorded exactly once with their faults and the series aggregates, and the reads the audit
needs (history, hang localisation, due and re-audit steps).

See :mod:`auditor.db.store` for the exactly-once argument these statements implement.
"""

from __future__ import annotations

import itertools
import operator
from collections import defaultdict
from typing import Any, Callable, Iterable, Mapping, Sequence

import sqlalchemy as sa

from auditor.core import REPLACEABLE, STALE_LOOKBACK, compress_ranks, expand_ranks
from auditor.db import dialect as sql_text
from auditor.db.dialect import (
    PG_STEP_COPY_TYPES, PG_VERDICT_KINDS, SQLITE_CHUNK_SIZES, Statements, pg_array, series_params, size_runs,
)
from auditor.db.drops import drops_params, drops_statement
from auditor.db.races import StepRowExists
from auditor.db.rows import (
    Arrival, CleanSteps, VerdictItem, as_float, json_safe, json_text, verdict_values,
)
from auditor.db.tables import faults, reports, series_faults, step_audits


def _key_order(items: Sequence[VerdictItem]) -> list[int]:
    """The indexes of ``items`` in key (series_id, step) order (the service passes them so)."""
    keys = [(it.series_id, it.step) for it in items]
    order = list(range(len(items)))
    if any(keys[i] > keys[i + 1] for i in range(len(keys) - 1)):
        order.sort(key=keys.__getitem__)
    return order


def _item_entry(it: VerdictItem) -> tuple:
    """The :func:`series_params` entry of an item."""
    v = it.verdict
    return it.step, v.verdict, v.cp_disagreement_sigma, v.applied_error_sigma, it.previous, it.progress


_FIRST = operator.itemgetter(0)


class StepStatements(Statements):
    """Count arrivals and record verdicts of step rows (a part of :class:`auditor.db.store.Store`)."""

    _step_sql_of: dict[str, str]
    _series_stmt: Any

    def _prepare_steps(self) -> None:
        """The texts of this dialect's step-row statements (built once per store)."""
        self._step_sql_of = sql_text.verdict_sql(self.dialect)
        self._series_stmt = sql_text.series_statement()
        self._drops_stmt = drops_statement()

    def count_arrivals(self, conn: sa.Connection, added: Mapping[tuple[int, int], int],
                       expected: Mapping[tuple[int, int], int], now: float) -> list[Arrival]:
        """Add ``added[(series_id, step)]`` new reports to each step's row (created with
        ``expected`` reports and ``first_seen = now`` by its first report), in key order; the
        rows after the update, in key order. The upsert takes each step row's lock: this is
        where concurrent ingests of one step serialize. One statement on PostgreSQL (over
        ``unnest``, rows taken in key order), per 500 steps on SQLite (multi-row
        ``VALUES``)."""
        keys = sorted(added)
        if not keys:
            return []
        sql = self._step_sql_of["arrivals"]
        cur = conn.connection.driver_connection.cursor()
        try:
            if self.dialect == "postgresql":
                cur.execute(sql, (now, pg_array("int", [k[0] for k in keys]), pg_array("int", [k[1] for k in keys]),
                                  pg_array("int", [added[k] for k in keys]),
                                  pg_array("int", [expected[k] for k in keys])))
                got = cur.fetchall()
            else:
                got = []
                for size, start, end in size_runs(len(keys), SQLITE_CHUNK_SIZES):
                    text = sql.format(values=", ".join(["(?, ?, ?, ?, ?)"] * size))
                    for i in range(start, end, size):
                        cur.execute(text, [x for k in keys[i:i + size] for x in (k[0], k[1], added[k], expected[k], now)])
                        got += cur.fetchall()
        finally:
            cur.close()
        return [Arrival(sid, st, rec, exp, verdict, None if complete is None else bool(complete))
                for sid, st, rec, exp, verdict, complete in sorted(got)]

    def history(self, conn: sa.Connection, series_id: int, step: int) -> Callable[[], dict]:
        """A loader of the correct statistic of each group in the last ``STALE_LOOKBACK``
        audited steps before ``step``: ``{group key: [(step, count, mean, var), ...]}``,
        oldest first (the engine's ``history``)."""
        def load():
            hist: dict[tuple, list] = defaultdict(list)
            for row in conn.execute(
                sa.select(step_audits.c.step, step_audits.c.groups)
                .where(step_audits.c.series_id == series_id, step_audits.c.step < step,
                       step_audits.c.verdict.is_not(None))
                .order_by(step_audits.c.step.desc()).limit(STALE_LOOKBACK)
            ):
                for key, _mb, count, mean, var in row.groups or []:
                    hist[tuple(key)].append((row.step, as_float(count), as_float(mean), as_float(var)))
            return {k: v[::-1] for k, v in hist.items()}
        return load

    def drift_history(self, conn: sa.Connection, series_id: int, step: int) -> Callable[[], dict]:
        """A loader of the latest audited step before ``step`` of a ``fingerprint`` series and
        its ``replica_divergence`` findings: ``{"step": s, "verdict": v, "findings": [(ranks,
        evidence), ...]}``, or ``{}`` when none was audited (the engine's ``history`` for
        kind ``fingerprint``: a drift's first step carried from step to step)."""
        def load():
            row = conn.execute(
                sa.select(step_audits.c.step, step_audits.c.verdict)
                .where(step_audits.c.series_id == series_id, step_audits.c.step < step,
                       step_audits.c.verdict.is_not(None))
                .order_by(step_audits.c.step.desc()).limit(1)).first()
            if row is None:
                return {}
            found = conn.execute(
                sa.select(faults.c.ranks, faults.c.evidence)
                .where(faults.c.series_id == series_id, faults.c.step == row.step,
                       faults.c.kind == "replica_divergence")).all()
            return {"step": row.step, "verdict": row.verdict,
                    "findings": [(tuple(expand_ranks(r.ranks or "")), r.evidence) for r in found]}
        return load

    def record_verdicts(self, conn: sa.Connection, items: Sequence["VerdictItem"], now: float,
                        clean: Sequence[CleanSteps] = (), drops: Mapping[int, tuple[int, int, int]] | None = None
                        ) -> list[bool]:
        """Record the verdicts of many steps, their faults and the series aggregates, in a
        bounded number of statements (at most ten, however many steps; on PostgreSQL each
        one backend execution, except the series UPDATE, one per series).
        Returns per item (in the given order) True if it was recorded, False (and nothing of
        it written) if another transaction recorded that step first (for a ``fresh`` item:
        if its step row existed).

        Per item: ``complete``: all expected reports were audited (else the report that
        completes the step re-audits). ``previous``: replace the verdict ``previous``
        recorded while reports were missing (a re-audit): the step row matches only while
        ``complete_at_audit`` is false, so one transaction wins across replicas; the old
        faults are deleted and taken out of ``series_faults`` (their ``superseded`` keeps
        the total), the old verdict out of ``steps_<previous>`` (into
        ``superseded_<previous>``), first/last bad step recomputed when the step stops being
        bad, and the step keeps ``previous_verdict`` and ``verdict_changed_at``.
        ``progress`` (hang localisation, a step audited with missing reports): stored on
        the series with its ``ranks_behind``; without it, a step at least as new as any
        audited resets them (every placed rank reached it).

        The series row ends as if the items had been recorded one by one in key order:
        one parameter set per series for plain first audits (their sums, extremes and
        newest step), one per item for series with re-audits or progress (the statement's
        CASE expressions then apply them in order).

        ``fresh`` items (a step whose every report this transaction inserted, see
        ``auditor.service.ingest``) have no step row yet: it is INSERTed with the verdict,
        ``expected``, ``received`` and ``first_seen = now`` (``ON CONFLICT DO NOTHING``: an
        existing row loses, nothing of it written); the row ends as :meth:`count_arrivals`
        followed by the verdict UPDATE would leave it. ``clean`` holds more such steps, all
        consistent, as columns (:class:`CleanSteps`); if any of their rows existed,
        :class:`StepRowExists` is raised (the caller rolls back).

        ``drops``: per series id, reports its clients dropped (count, first and last step)
        that the caller's transaction learnt of (:meth:`count_drops`), counted in the same
        pass over the series rows, so that every transaction takes them in one id order.

        Lock order: the ``step_audits`` rows (key order), then the ``series`` rows (id
        order), then the ``series_faults`` rows (key order). The series rows are updated
        before ``series_faults`` so that every auditing transaction takes these locks in
        one order; the other way round, a transaction auditing two steps with different
        fault kinds deadlocked with one auditing a third (PostgreSQL). On PostgreSQL the
        verdict UPDATE joins ``unnest`` and visits rows in plan order, not key order: that
        takes no lock out of order because its callers hold those row locks already (an
        ingest upserted them in key order in :meth:`count_arrivals`) or update one row (the
        sweep). Fresh rows are inserted in key order and are no other transaction's to
        touch: any transaction writing such a row must first insert one of the step's
        reports, and waits on this one's report keys before it can.
        """
        order = _key_order(items)
        won = [False] * len(items)
        clean = [c for c in clean if c.steps]
        if order or clean:
            self._write_step_rows(conn, items, order, clean, now, won)
        mine = [items[i] for i in order if won[i]]
        if not mine and not clean:
            self.count_drops(conn, drops or {})
            return won
        old_faults = self._take_old_faults(conn, [it for it in mine if it.previous is not None])
        self._update_series(conn, mine, clean, now, drops or {})
        self._insert_faults(conn, mine)
        self._count_faults(conn, mine, old_faults)
        return won

    def _write_step_rows(self, conn: sa.Connection, items: Sequence[VerdictItem], order: list[int],
                         clean: Sequence[CleanSteps], now: float, won: list[bool]) -> None:
        """Write the step rows of :meth:`record_verdicts`: ``clean`` steps' rows INSERTed
        (:meth:`_clean_step_rows`), then the items' (``won[i]`` set for each one written)."""
        values = {i: verdict_values(items[i]) for i in order}
        cur = conn.connection.driver_connection.cursor()
        try:
            if clean:
                self._clean_step_rows(cur, clean, now)
            if order and self.dialect == "postgresql":
                self._pg_step_rows(cur, items, order, values, now, won)
            elif order:
                self._sqlite_step_rows(conn, cur, items, order, values, now, won)
        finally:
            cur.close()

    def _take_old_faults(self, conn: sa.Connection, reaudited: Sequence[VerdictItem]) -> dict[tuple[int, int], dict[str, int]]:
        """Delete the faults of the re-audited steps' replaced verdicts; their counts by
        (series_id, step) and kind (taken out of ``series_faults`` by :meth:`_count_faults`)."""
        old_faults: dict[tuple[int, int], dict[str, int]] = defaultdict(dict)
        if not reaudited:
            return old_faults
        where = sa.tuple_(faults.c.series_id, faults.c.step).in_([(it.series_id, it.step) for it in reaudited])
        for sid, st, kind, cnt in conn.execute(
            sa.select(faults.c.series_id, faults.c.step, faults.c.kind, sa.func.count()).where(where)
            .group_by(faults.c.series_id, faults.c.step, faults.c.kind)
        ):
            old_faults[(sid, st)][kind] = cnt
        conn.execute(faults.delete().where(where))
        return old_faults

    def _update_series(self, conn: sa.Connection, mine: Sequence[VerdictItem], clean: Sequence[CleanSteps],
                       now: float, drops: Mapping[int, tuple[int, int, int]]) -> None:
        """The ``series`` UPDATE of the recorded items and clean steps (series id order):
        one parameter set per series of plain first audits, one per entry for series with
        re-audits or progress (:func:`series_params`); the ``drops`` counted in the same id
        order (:func:`auditor.db.drops.drops_statement`), each run of consecutive
        parameter sets of one statement executed at once."""
        by_series: dict[int, list[tuple]] = defaultdict(list)
        for it in mine:
            by_series[it.series_id].append(_item_entry(it))
        mixed = set(by_series) & {c.series_id for c in clean}
        for c in clean:
            by_series[c.series_id].extend(c.entries())
        runs: list[tuple[Any, list[dict]]] = []

        def put(stmt, params: list[dict]) -> None:
            if runs and runs[-1][0] is stmt:
                runs[-1][1].extend(params)
            else:
                runs.append((stmt, params))

        for sid in sorted(set(by_series).union(drops)):
            entries = by_series.get(sid)
            if entries and sid in mixed:
                entries.sort(key=_FIRST)  # items and clean steps of one series: key order
            if entries and any(e[4] is not None or e[5] is not None for e in entries):
                put(self._series_stmt, [series_params(sid, [e], now) for e in entries])
            elif entries:
                put(self._series_stmt, [series_params(sid, entries, now)])
            if sid in drops:
                put(self._drops_stmt, drops_params({sid: drops[sid]}))
        for stmt, params in runs:
            conn.execute(stmt, params)

    def _insert_faults(self, conn: sa.Connection, mine: Sequence[VerdictItem]) -> None:
        """INSERT the fault rows of the recorded items (one execution on PostgreSQL, ids in key order)."""
        fault_rows = [(it.series_id, it.step, str(f.kind), compress_ranks(f.ranks), f.message,
                       json_text(json_safe(f.evidence)))
                      for it in mine for f in it.verdict.faults]
        if not fault_rows:
            return
        cur = conn.connection.driver_connection.cursor()
        try:
            if self.dialect == "postgresql":  # one execution, ids in key order
                cur.execute(self._step_sql_of["faults"],
                            [pg_array(k, c) for k, c in zip(("int", "int", "text", "text", "text", "text"),
                                                            zip(*fault_rows))])
            else:
                cur.executemany(self._step_sql_of["faults"], fault_rows)
        finally:
            cur.close()

    def _count_faults(self, conn: sa.Connection, mine: Sequence[VerdictItem],
                      old_faults: dict[tuple[int, int], dict[str, int]]) -> None:
        """Upsert ``series_faults``: per (series, kind) the new faults less the replaced
        ones (``count``), and the replaced ones kept in ``superseded``."""
        deltas: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0])
        for it in mine:
            old = old_faults.get((it.series_id, it.step), {})
            new: dict[str, int] = defaultdict(int)
            for f in it.verdict.faults:
                new[str(f.kind)] += 1
            for k in set(new) | set(old):
                d = deltas[(it.series_id, k)]
                d[0] += new.get(k, 0) - old.get(k, 0)
                d[1] += old.get(k, 0)
        if not deltas:
            return
        stmt = self._insert(series_faults)
        conn.execute(
            stmt.on_conflict_do_update(
                index_elements=["series_id", "kind"],
                set_={"count": series_faults.c.count + stmt.excluded.count,
                      "superseded": series_faults.c.superseded + stmt.excluded.superseded},
            ),
            [{"series_id": sid, "kind": k, "count": c, "superseded": sup}
             for (sid, k), (c, sup) in sorted(deltas.items())],
        )

    def _pg_step_rows(self, cur, items: Sequence[VerdictItem], order: list[int], values: dict[int, tuple],
                      now: float, won: list[bool]) -> None:
        """PostgreSQL: the step rows of :meth:`record_verdicts`, one ``INSERT`` (fresh rows)
        and one ``UPDATE`` (the rest) over ``unnest``, each ``RETURNING`` the keys it wrote."""
        done: set[tuple[int, int]] = set()
        for fresh in (True, False):
            idx = [i for i in order if items[i].fresh is fresh]
            if not idx:
                continue
            cols = [pg_array(k, c) for k, c in
                    zip(PG_VERDICT_KINDS, zip(*((items[i].series_id, items[i].step, *values[i]) for i in idx)))]
            if fresh:
                cur.execute(self._step_sql_of["insert"],
                            (now, now, *cols, pg_array("int", [items[i].expected for i in idx]),
                             pg_array("int", [items[i].received for i in idx])))
            else:
                cur.execute(self._step_sql_of["update"],
                            (now, now, *cols, pg_array("text", [items[i].previous for i in idx])))
            done.update(map(tuple, cur.fetchall()))
        for i in order:
            won[i] = (items[i].series_id, items[i].step) in done

    def _clean_step_rows(self, cur, clean: Sequence[CleanSteps], now: float) -> None:
        """INSERT the step rows of ``clean`` (:meth:`record_verdicts`), in key order: one
        binary ``COPY`` (PostgreSQL) or one multi-row ``VALUES`` statement per
        :data:`SQLITE_CHUNK_SIZES` chunk (SQLite, ``ON CONFLICT DO NOTHING``). Raises
        :class:`StepRowExists` if any of them existed; the caller rolls the transaction back
        (on PostgreSQL the unique violation has aborted it already).

        Why ``COPY`` and not ``INSERT ... SELECT FROM unnest(...) ON CONFLICT DO NOTHING``:
        no array literals to build and parse, and a plain insert instead of a speculative
        one per row: 6.5-11.7 -> 3.1-4.4 µs per step row (5,000-row statements,
        docs/performance.md). A clean step's row cannot exist but in the cases
        ``auditor.service.judge.Judge.fresh_steps`` names, so a failed COPY is as rare as a short INSERT count."""
        rep = itertools.repeat
        rows = list(itertools.chain.from_iterable(
            zip(rep(c.series_id), c.steps, c.expected, c.expected, rep(now), rep("consistent"), rep(True),
                c.cp_sigma, c.err_sigma, c.tol_sigma, rep(None), c.groups, rep(now))
            for c in clean))
        if self.dialect == "postgresql":
            import psycopg

            try:
                with cur.copy(self._step_sql_of["copy"]) as copy:
                    copy.set_types(PG_STEP_COPY_TYPES)
                    for row in rows:
                        copy.write_row(row)
            except psycopg.errors.UniqueViolation:
                raise StepRowExists() from None
        elif self._sqlite_step_inserts(cur, rows) != len(rows):
            raise StepRowExists()

    def _sqlite_step_inserts(self, cur, ps: Sequence[tuple]) -> int:
        """SQLite: INSERT fresh step rows (``ps``: the ``insert`` statement's parameters per
        row) in multi-row ``VALUES`` statements (half the cost per row of an
        ``executemany``); the number inserted (``ON CONFLICT DO NOTHING``)."""
        sql, n = self._step_sql_of, 0
        for k, start, end in size_runs(len(ps), SQLITE_CHUNK_SIZES):
            text = sql["insert_rows"].format(values=", ".join([sql["row"]] * k))
            for j in range(start, end, k):
                cur.execute(text, list(itertools.chain.from_iterable(ps[j:j + k])))
                n += cur.rowcount
        return n

    def _sqlite_step_rows(self, conn: sa.Connection, cur, items: Sequence[VerdictItem], order: list[int],
                          values: dict[int, tuple], now: float, won: list[bool]) -> None:
        """SQLite: the step rows of :meth:`record_verdicts`, an ``executemany`` per kind
        (insert, first audit, re-audit) inside a savepoint; if their change count falls
        short (another transaction recorded some steps first) the savepoint is rolled back
        and the steps are written one by one to find which."""
        sql = self._step_sql_of

        def params(i: int) -> tuple[str, tuple]:
            it, v = items[i], values[i]
            if it.fresh:
                return "insert", (it.series_id, it.step, it.expected, it.received, now, *v, now)
            if it.previous is None:
                return "first", (*v, now, it.series_id, it.step)
            return "again", (*v, now, it.previous, now, it.series_id, it.step, it.previous)

        if len(order) == 1:  # the rowcount of one statement says whether it won
            kind, p = params(order[0])
            cur.execute(sql[kind], p)
            won[order[0]] = cur.rowcount == 1
            return
        by_kind: dict[str, list[tuple]] = defaultdict(list)
        for i in order:
            kind, p = params(i)
            by_kind[kind].append(p)
        savepoint = conn.begin_nested()
        n = 0
        for kind, ps in by_kind.items():
            if kind == "insert":
                n += self._sqlite_step_inserts(cur, ps)
            else:
                cur.executemany(sql[kind], ps)
                n += cur.rowcount
        if n == len(order):
            savepoint.commit()
            for i in order:
                won[i] = True
            return
        savepoint.rollback()  # another transaction recorded some of them: find which, one by one
        for i in order:
            kind, p = params(i)
            cur.execute(sql[kind], p)
            won[i] = cur.rowcount == 1

    #: :func:`auditor.db.rows.verdict_values`, where callers of the private name look for it
    _verdict_values = staticmethod(verdict_values)

    def rank_progress(self, conn: sa.Connection, series_id: int, window: int,
                      unstored: Iterable[int] = ()) -> tuple[int, dict[int, int]]:
        """Hang localisation: the first of the series' newest ``window`` steps, and each rank's
        newest step among them (ranks that sent nothing in the window are absent). Bounded:
        one index range of ``window`` steps. ``unstored``: steps whose reports are stored but
        whose step row this transaction has not inserted yet (they count as steps)."""
        steps = conn.execute(
            sa.select(step_audits.c.step).where(step_audits.c.series_id == series_id)
            .order_by(step_audits.c.step.desc()).limit(window)
        ).scalars().all()
        lo = min(sorted(set(steps).union(unstored), reverse=True)[:window])
        last = dict(conn.execute(
            sa.select(reports.c.rank, sa.func.max(reports.c.step))
            .where(reports.c.series_id == series_id, reports.c.step >= lo).group_by(reports.c.rank)
        ).all())
        return lo, last

    def ranks_reported_before(self, conn: sa.Connection, series_id: int, before: int, ranks: Iterable[int],
                              max_steps: int) -> set[int] | None:
        """Which of ``ranks`` sent a report of the series at a step < ``before``; None (not
        looked at) when the series has more than ``max_steps`` steps before it, so that the
        cost stays bounded (one index range of at most ``max_steps`` steps' reports)."""
        ranks = sorted(set(ranks))
        earlier = conn.execute(sa.select(sa.func.count()).select_from(
            sa.select(step_audits.c.step).where(step_audits.c.series_id == series_id, step_audits.c.step < before)
            .limit(max_steps + 1).subquery())).scalar_one()
        if earlier > max_steps:
            return None
        if not earlier or not ranks:
            return set()
        return set(conn.execute(
            sa.select(reports.c.rank).distinct()
            .where(reports.c.series_id == series_id, reports.c.step < before, reports.c.rank.in_(ranks))
        ).scalars().all())

    def due_steps(self, conn: sa.Connection, before: float, limit: int) -> list[tuple[int, int, int]]:
        """Open steps first seen at or before ``before``: ``(series_id, step, expected)``, in key order."""
        return [tuple(r) for r in conn.execute(
            sa.select(step_audits.c.series_id, step_audits.c.step, step_audits.c.expected)
            .where(step_audits.c.verdict.is_(None), step_audits.c.first_seen <= before)
            .order_by(step_audits.c.series_id, step_audits.c.step).limit(limit)
        ).all()]

    def reaudit_steps(self, conn: sa.Connection, limit: int) -> list[tuple[int, int, int, str]]:
        """Steps audited while incomplete that have all their reports now:
        ``(series_id, step, expected, verdict)``, in key order (the ingest that completed them
        normally re-audits them; these are left from before revision 0003)."""
        sa_ = step_audits.c
        return [tuple(r) for r in conn.execute(
            sa.select(sa_.series_id, sa_.step, sa_.expected, sa_.verdict)
            .where(sa_.complete_at_audit.is_(False), sa_.received >= sa_.expected, sa_.verdict.in_(REPLACEABLE))
            .order_by(sa_.series_id, sa_.step).limit(limit)
        ).all()]
