"""Judging steps: the clean path (one array pass per series, :mod:`auditor.core.batch`) and
the exact path (:func:`auditor.core.audit_step`, the one source of every finding), engine
errors contained to their step, and the verdicts buffered until they are recorded."""

from __future__ import annotations

import itertools
import json
import logging
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import sqlalchemy as sa

from auditor import core
from auditor.core import RankReport
from auditor.db.store import Arrival, CleanSteps, StepRowExists, Store, VerdictItem, elements, json_safe, rank_report
from auditor.service.model import SeriesInfo, Topology
from auditor.service.progress import localise

log = logging.getLogger("auditor.service")


@dataclass(slots=True)  # not frozen: one per step, and a frozen __init__ costs 5× (1.05 vs 0.21 µs)
class _Due:
    """A step to audit: its series, topology, step row, the verdict it replaces (re-audit)
    and its reports as ``reports`` rows when the caller holds them all."""

    info: SeriesInfo
    topo: Topology
    arrival: Arrival
    previous: str | None
    rows: list[tuple] | None
    #: no step row yet (every report of the step is in ``rows``): insert it with the verdict
    fresh: bool = False


@dataclass(slots=True)
class _Fresh:
    """The steps of one series this transaction inserted every report of (no step row yet:
    :meth:`Judge.fresh_steps`), key order: ``rows[i]`` the ``reports`` rows of
    ``steps[i]`` (as many as it expects). ``judged``: ``clean`` holds what
    :meth:`Judge.clean` gives for them already (computed while the database stored the
    rows: :meth:`Judge.fresh_of`)."""

    info: SeriesInfo
    topo: Topology
    steps: list[int]
    rows: list[list[tuple]]
    judged: bool = False
    clean: core.batch.Clean | None = None


class Judge:
    """Audits steps inside the caller's transaction and records their verdicts."""

    def __init__(self, store: Store):
        self.store = store

    def audit_steps(self, conn: sa.Connection, due: Sequence["_Due"], now: float,
                     fresh: dict[int, _Fresh] | None = None,
                     drops: dict[int, tuple[int, int, int]] | None = None) -> list[tuple[int, int, str]]:
        """Audit steps (key order) inside the caller's transaction and record their verdicts
        with :meth:`auditor.db.store.Store.record_verdicts`; return ``(series_id, step,
        verdict)`` of those recorded (not those another transaction recorded first).

        ``fresh``: per series id, steps this transaction inserted every report of (no step
        row yet). Their clean steps are judged by :func:`auditor.core.batch.clean_columns`
        (one array pass per series) and recorded as columns (:class:`CleanSteps`: no object
        per step); the others join ``due``. The clean steps of ``due`` with their reports in
        hand are judged by the same pass, as StepVerdicts (:meth:`audit_clean`); every other step (or
        every step, if that pass raises) by :func:`auditor.core.audit_step`, the one source
        of every finding. A step's reports are the rows in hand (``_Due.rows``) or read
        back. Verdicts wait to be written until the end, except that a step whose diagnosis
        needs the series' history first writes those of the steps before it, so it sees
        them as it did when each verdict was written at once. ``drops``: per series id, the
        reports its clients dropped that this transaction learnt of, counted with the
        verdicts in the same pass over the series rows (:class:`VerdictBuffer`)."""
        clean, unclean = self._judge_fresh(fresh or {})
        if unclean:  # both kinds: key order
            due = sorted([*due, *unclean], key=_key) if due else unclean
        rows = self._rows_of(conn, due)
        fast = self.audit_clean(due, rows)
        buffer = VerdictBuffer(self.store, conn, now, clean, drops)
        unstored: dict[int, set[int]] | None = None
        for d in due:
            p = d.arrival
            v, n = fast.get(_key(d)), p.expected
            if v is None:
                v, n = self._exact_of(conn, d, rows.get(_key(d)), buffer)
            progress = None
            if any(f.kind == core.FaultKind.MISSING_REPORT for f in v.faults):
                if unstored is None:
                    unstored = _unstored(due, fresh)
                progress = localise(self.store, conn, d.info, d.topo, unstored.get(d.info.id, ())).to_json()
            buffer.add(VerdictItem(p.series_id, p.step, v, n >= p.expected, d.previous, progress, d.fresh,
                                   p.expected, p.received))
        return buffer.flush()

    def _judge_fresh(self, fresh: dict[int, _Fresh]) -> tuple[list[CleanSteps], list[_Due]]:
        """The steps ``fresh`` of each series (key order): the clean ones as columns
        (:class:`CleanSteps`, judged by :meth:`clean` unless ``judged`` already), the others
        as :class:`_Due` for the exact path."""
        clean: list[CleanSteps] = []
        unclean: list[_Due] = []
        for sid in sorted(fresh):
            f = fresh[sid]
            expected = [len(rs) for rs in f.rows]
            c = f.clean if f.judged else self.clean(f.info, f.topo, f.rows, expected)
            if c is not None and c.index:
                clean.append(CleanSteps.of(sid, f.steps, expected, c))
            judged = set(c.index) if c is not None else set()
            if len(judged) < len(f.steps):
                unclean += [_Due(f.info, f.topo, Arrival(sid, st, n, n, None), None, rs, fresh=True)
                            for i, (st, n, rs) in enumerate(zip(f.steps, expected, f.rows)) if i not in judged]
        return clean, unclean

    def _rows_of(self, conn: sa.Connection, due: Sequence[_Due]) -> dict[tuple[int, int], list[tuple] | None]:
        """Per step of ``due``, its ``reports`` rows: those in hand, else read back when the
        clean path may judge it (None: the exact path reads its reports itself)."""
        rows = {_key(d): d.rows for d in due}
        for d in due:
            if d.rows is None and core.batch.eligible(d.info.engine_spec, d.info.kind,
                                                      "known" if d.topo.known else "unknown"):
                rows[_key(d)] = self.store.report_rows(conn, d.arrival.series_id, d.arrival.step)
        return rows

    def _exact_of(self, conn: sa.Connection, d: _Due, rows: list[tuple] | None,
                  buffer: "VerdictBuffer") -> tuple[core.StepVerdict, int]:
        """The exact path's verdict of ``d`` and the number of its reports audited. Its
        history, if the diagnosis needs it, is loaded after the buffered verdicts of the
        steps before it are written (:meth:`VerdictBuffer.flush`), so it sees them as it did
        when each verdict was written at once."""
        info, p = d.info, d.arrival
        reports = [rank_report(r) for r in rows] if rows is not None else self.store.step_reports(conn, info.id, p.step)
        load = (self.store.drift_history if info.kind == "fingerprint" else self.store.history)(conn, info.id, p.step)

        def history():
            buffer.flush(_key(d))  # the verdicts of the steps before this one, as history
            return load()

        return self.exact(conn, info, d.topo, p.step, p.expected, reports, history), len(reports)

    def audit_one(self, conn: sa.Connection, info: SeriesInfo, topo: Topology, p: Arrival, now: float,
               previous: str | None = None) -> str | None:
        """Audit one step (its reports read back) inside the caller's transaction and record
        the verdict; return it, or None if another transaction recorded it first.
        ``previous``: re-audit a step whose verdict ``previous`` was recorded while reports
        were missing."""
        done = self.audit_steps(conn, [_Due(info, topo, p, previous, None)], now)
        return done[0][2] if done else None

    def clean(self, info: SeriesInfo, topo: Topology, steps: Sequence[Sequence[tuple]],
               expected: Sequence[int]) -> core.batch.Clean | None:
        """The clean path: :func:`auditor.core.batch.clean_columns` of steps of one series (``steps[i]``: the
        ``reports`` rows of step ``i``, ``expected[i]`` the reports it expects); None when
        the series is not eligible. An exception is logged and gives None: the exact engine
        judges every step instead."""
        if not core.batch.eligible(info.engine_spec, info.kind, "known" if topo.known else "unknown"):
            return None
        try:
            return core.batch.clean_columns(elements(steps), np.array(expected), topo.sizes, info.engine_spec,
                                            info.kind)
        except Exception:  # noqa: BLE001 - the exact engine judges every step instead
            log.exception("the batched audit raised; auditing each step on its own")
            return None

    def audit_clean(self, due: Sequence["_Due"], rows: dict) -> dict[tuple[int, int], core.StepVerdict]:
        """The verdicts :func:`auditor.core.batch.clean_columns` gives, per (series_id,
        step), of the steps in ``due`` whose reports are in ``rows`` (:meth:`clean`)."""
        out: dict[tuple[int, int], core.StepVerdict] = {}
        for _, group in itertools.groupby(due, key=lambda d: d.arrival.series_id):
            group = [d for d in group if rows.get((d.arrival.series_id, d.arrival.step)) is not None]
            if not group:
                continue
            c = self.clean(group[0].info, group[0].topo, [rows[(d.arrival.series_id, d.arrival.step)] for d in group],
                            [d.arrival.expected for d in group])
            if c is not None:
                for i, v in zip(c.index, c.verdicts()):
                    d = group[i]
                    out[(d.arrival.series_id, d.arrival.step)] = v
        return out

    def exact(self, conn: sa.Connection, info: SeriesInfo, topo: Topology, step: int, expected: int,
               rank_reports: list[RankReport], history) -> core.StepVerdict:
        """The exact path: run the engine on one step (``history``: its lazy loader). Never raises: an
        exception of the engine (or findings that cannot be stored) becomes the verdict
        ``audit_error`` with the exception as the step's one fault, logged once; nothing else
        of the batch is affected. (:class:`StepRowExists` from the history loader's flush
        is the batch's, not the step's: it passes.)"""
        try:
            v = core.audit_step(
                rank_reports, topo.sizes, info.engine_spec,
                num_microbatches=max(1, expected // topo.placed_count(info.engine_spec)),
                history=history, kind=info.kind, step=step, **topo.audit_args(),
            )
            json.dumps(json_safe([[[list(g.key), g.microbatch, g.count, g.mean, g.var] for g in v.groups],
                                  [f.evidence for f in v.faults]]), allow_nan=False)  # storable
            return v
        except StepRowExists:  # raised by the history loader's flush: the batch, not this step
            raise
        except Exception as exc:  # noqa: BLE001 - contained to this step (verdict audit_error)
            log.exception("audit of %s/%s step %d raised; recorded as audit_error", info.run_id, info.statistic, step)
            message = (f"the audit engine raised {type(exc).__name__}: {str(exc)[:500]} — this step has no verdict; "
                       "please report it with the step's reports (GET .../steps/{step})")
            fault = core.Fault(core.FaultKind.AUDIT_ERROR, message, [], {"exception": type(exc).__name__})
            return core.StepVerdict("audit_error", [fault], [], [], None, None)

    def fresh_of(self, fresh: set[tuple[int, int]], by_step: dict[tuple[int, int], list[tuple]],
                  by_id: dict[int, SeriesInfo], topo_of: dict[str, Topology], judge: bool) -> dict[int, _Fresh]:
        """The steps ``fresh`` (:meth:`fresh_steps`) per series id, with their rows from
        ``by_step``; ``judge``: with :meth:`clean`'s result too."""
        out: dict[int, _Fresh] = {}
        for sk in sorted(fresh):
            f = out.get(sk[0])
            if f is None:
                info = by_id[sk[0]]
                f = out[sk[0]] = _Fresh(info, topo_of[info.run_id], [], [])
            f.steps.append(sk[1])
            f.rows.append(by_step[sk])
        if judge:
            for f in out.values():
                f.clean, f.judged = self.clean(f.info, f.topo, f.rows, [len(rs) for rs in f.rows]), True
        return out

    @staticmethod
    def fresh_steps(added: Counter, expected: dict[tuple[int, int], int]) -> set[tuple[int, int]]:
        """The steps (series_id, step) of which this transaction inserted ``expected``
        reports: all of the step's reports, so no other transaction can have made its step
        row, which :meth:`auditor.service.ingest.Ingest.count_steps` then inserts with the verdict.

        Why no step row can exist. A step row is made only by :meth:`Store.count_arrivals`
        in a transaction that inserted at least one of the step's reports (``added``
        counts inserted keys only). Every report of a step lies in a key space of
        ``expected`` = placed ranks × ``num_microbatches`` places: the schema validates
        ``microbatch < num_microbatches``, ``rank < world_size`` and each coordinate below
        its size; ``_check_placed`` keeps the placed dims within the placement; every
        report of the step in this batch gave one ``num_microbatches`` (else 409); and
        ``uq_reports_coords`` (series, step, microbatch, dense coords) admits one report
        per place (unknown topology: the coords are the rank, < world_size). Having
        inserted ``expected`` of them, this transaction holds every place: another
        transaction's report of the step waits on these keys and then conflicts (a
        duplicate, or a 409), so it inserts none and makes no step row, before or after.
        Not covered by that argument, and caught by the step rows' insert (SQLite's ``ON
        CONFLICT DO NOTHING`` count, PostgreSQL's ``COPY`` unique violation:
        :class:`StepRowExists`, the batch is ingested again the general way):
        a step row left by the deletion of its reports (``delete_rank_range``), a
        concurrent report saying another ``num_microbatches`` (today a 409 at its step
        row), and an expert placement without an ``order``, where the dense-coordinate
        index bounds a step by the world rather than the placed ranks."""
        return {k for k, n in added.items() if n == expected[k]}


class VerdictBuffer:
    """Verdicts waiting to be written in one transaction (:meth:`Judge.audit_steps`): the
    items of the exact path and the clean steps as columns, recorded together by
    :meth:`auditor.db.store.Store.record_verdicts` at the end, or those before a step
    whose diagnosis reads the series' history first (:meth:`flush` with ``upto``). The
    ``drops`` counts of a series go with the first flush that reaches its id, so the series
    rows are updated in one ascending id order across flushes."""

    def __init__(self, store: Store, conn: sa.Connection, now: float, clean: list[CleanSteps],
                 drops: dict[int, tuple[int, int, int]] | None = None):
        self.store, self.conn, self.now = store, conn, now
        self.clean = clean
        self.drops = dict(drops or {})
        self.pending: list[VerdictItem] = []
        #: ``(series_id, step, verdict)`` of each verdict recorded (not those another
        #: transaction recorded first)
        self.recorded: list[tuple[int, int, str]] = []

    def add(self, item: VerdictItem) -> None:
        self.pending.append(item)

    def flush(self, upto: tuple[int, int] | None = None) -> list[tuple[int, int, str]]:
        """Record the pending verdicts and the clean steps before ``upto`` (all: None);
        :data:`recorded` so far. A fresh item whose step row existed after all raises
        :class:`StepRowExists` (the batch is ingested again the general way)."""
        take = self._take_clean(upto)
        drops = {sid: d for sid, d in self.drops.items() if upto is None or sid <= upto[0]}
        for sid in drops:
            del self.drops[sid]
        for it, ok in zip(self.pending, self.store.record_verdicts(self.conn, self.pending, self.now, take, drops)):
            if ok:
                self.recorded.append((it.series_id, it.step, it.verdict.verdict))
            elif it.fresh:
                raise StepRowExists(it.series_id, it.step)
        for c in take:
            self.recorded.extend(zip(itertools.repeat(c.series_id), c.steps, itertools.repeat("consistent")))
        self.pending.clear()
        return self.recorded

    def _take_clean(self, upto: tuple[int, int] | None) -> list[CleanSteps]:
        """The clean steps before ``upto`` (all: None), taken out of :data:`clean`."""
        if upto is None:
            take, self.clean = self.clean, []
            return take
        take, rest = [], []
        for c in self.clean:
            if c.series_id == upto[0]:
                before, after = c.split(upto[1])
                take.append(before)
                rest.append(after)
            else:
                (take if c.series_id < upto[0] else rest).append(c)
        self.clean = rest
        return take


def _key(d: "_Due") -> tuple[int, int]:
    """A due step's key (series_id, step)."""
    return d.arrival.series_id, d.arrival.step


def _unstored(due: Sequence["_Due"], fresh: dict[int, "_Fresh"] | None) -> dict[int, set[int]]:
    """Per series, the steps whose rows are inserted with their verdicts (not stored yet):
    they still count as steps of their series for hang localisation (as
    :meth:`auditor.db.store.Store.count_arrivals`' rows did)."""
    out: dict[int, set[int]] = defaultdict(set)
    for x in due:
        if x.fresh:
            out[x.arrival.series_id].add(x.arrival.step)
    for sid, f in (fresh or {}).items():
        out[sid].update(f.steps)
    return out
