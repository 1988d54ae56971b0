"""The flows of the service, above a SQL-only store and the audit engine.

* :meth:`Service.ingest` — store a validated batch and audit every step it completes, in one
  store transaction: check each report against its run's topology and its statistic's
  kind/spec, insert the new reports, count arrivals per step, audit the steps that became
  complete (:func:`auditor.core.audit_step`) and record their verdicts.
* :meth:`Service.sweep` — audit steps still incomplete after the grace period (``missing_report``).
* :meth:`Service.report`, :meth:`Service.step`, :meth:`Service.list_runs`,
  :meth:`Service.get_run` — the JSON the API and the CLI serve, with per-rank tables
  recomputed from the stored reports.

Every caller goes through here: the HTTP API (:mod:`auditor.server`), ``auditor audit``
(:mod:`auditor.offline`) and the CLI's database mode. Exactly-once auditing across
threads, workers and replicas, and the lock order, are the store's
(:mod:`auditor.db.store`); this module only decides *what* to write, and words the errors.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import sqlalchemy as sa

from auditor import core
from auditor.core import DIMS, RankReport
from auditor.db.store import COLUMNS, COMPARED, Arrival, SeriesRow, Store, json_safe, rank_report, report_row
from auditor.schemas import DEFAULT_SPECS, Report, RunRegistration, StatisticSpec


class ConflictError(Exception):
    """A batch contradicts what is stored (HTTP 409); nothing of the batch was stored.

    ``error`` is ``conflicting_report``, ``topology_conflict`` or ``spec_conflict``;
    ``conflicts`` lists ``{"index": i, "field": ..., ...}`` per offending report.
    """

    def __init__(self, error: str, message: str, conflicts: list[dict]):
        super().__init__(message)
        self.error, self.message, self.conflicts = error, message, conflicts


class NotFound(Exception):
    """No such run, statistic or step (HTTP 404)."""


@dataclass(frozen=True, slots=True)
class Topology:
    world_size: int
    sizes: tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class SeriesInfo:
    """A (run, statistic) as the flows use it: the wire spec (for conflict checks) and the
    engine's spec (for audits)."""

    id: int
    run_id: str
    statistic: str
    kind: str
    spec: StatisticSpec
    engine_spec: core.Spec

    @classmethod
    def of(cls, row: SeriesRow) -> "SeriesInfo":
        spec = StatisticSpec(**row.spec)
        return cls(row.id, row.run_id, row.statistic, row.kind, spec, spec.to_core())


@dataclass
class IngestOutcome:
    accepted: int = 0
    duplicates: int = 0
    audited: list[tuple[int, int, str]] = field(default_factory=list)  # (series_id, step, verdict)


class Service:
    """The flows over one database. Thread-safe; holds no state but immutable caches (a
    run's topology and a series' kind/spec never change once stored)."""

    def __init__(self, store: Store):
        self.store = store
        self._topology: dict[str, Topology] = {}
        self._series: dict[tuple[str, str], SeriesInfo] = {}

    @classmethod
    def from_engine(cls, engine: sa.Engine) -> "Service":
        return cls(Store(engine))

    def close(self) -> None:
        self.store.dispose()

    # ------------------------------------------------------------------ runs and series
    def register_run(self, run_id: str, reg: RunRegistration, now: float | None = None) -> dict:
        """``PUT /v1/runs/{run_id}``: fix the topology and statistic specs. Idempotent;
        raises :class:`ConflictError` if it contradicts what is stored."""
        now = time.time() if now is None else now
        topo = Topology(reg.world_size, reg.sizes.as_tuple())
        with self.store.write() as conn:
            self._ensure_run(conn, run_id, topo, now, index=None)
            for name, st in reg.statistics.items():
                self._ensure_series(conn, run_id, name, st.kind, st.spec, now, index=None)
        return self.get_run(run_id)

    def _ensure_run(self, conn: sa.Connection, run_id: str, topo: Topology, now: float, index: int | None) -> None:
        stored = self._topology.get(run_id)
        if stored is None:
            row = self.store.ensure_run(conn, run_id, topo.world_size, topo.sizes, now)
            stored = Topology(row.world_size, row.sizes)
        if stored != topo:
            raise ConflictError(
                "topology_conflict",
                f"run {run_id!r} was registered with world_size={stored.world_size} "
                f"sizes={dict(zip(DIMS, stored.sizes))}; this report says world_size={topo.world_size} "
                f"sizes={dict(zip(DIMS, topo.sizes))}",
                [{"index": index, "field": "sizes"}] if index is not None else [],
            )

    def _ensure_series(
        self, conn: sa.Connection, run_id: str, statistic: str, kind: str, spec: StatisticSpec | None,
        now: float, index: int | None,
    ) -> SeriesInfo:
        info = self._series.get((run_id, statistic))
        if info is None:
            want = (spec or DEFAULT_SPECS[kind]).model_dump()
            info = SeriesInfo.of(self.store.ensure_series(conn, run_id, statistic, kind, want, now))
        if info.kind != kind or (spec is not None and spec != info.spec):
            raise ConflictError(
                "spec_conflict",
                f"statistic {statistic!r} of run {run_id!r} is kind={info.kind!r} spec={info.spec.model_dump()}; "
                f"this report says kind={kind!r} spec={spec.model_dump() if spec else None}",
                [{"index": index, "field": "spec" if info.kind == kind else "kind"}] if index is not None else [],
            )
        return info

    # ------------------------------------------------------------------------- ingest
    def ingest(self, batch: Sequence[Report], now: float | None = None) -> IngestOutcome:
        """Store a validated batch in one transaction and audit the steps it completes.

        Re-sent identical reports are counted as duplicates and change nothing. Raises
        :class:`ConflictError` (and stores nothing of the batch) when a report differs from
        a stored one with the same key, or contradicts its run's topology or its
        statistic's kind/spec, or its step's ``num_microbatches``.
        """
        now = time.time() if now is None else now
        store = self.store
        out = IngestOutcome()
        new_topology: dict[str, Topology] = {}
        new_series: dict[tuple[str, str], SeriesInfo] = {}
        with store.write() as conn:
            series_of: dict[tuple[str, str], SeriesInfo] = {}
            last = None
            for i, r in enumerate(batch):
                sz = r.sizes
                same = (r.run_id, r.statistic, r.kind, r.world_size, sz.dp, sz.cp, sz.tp, sz.pp)
                if same == last and r.spec is None:
                    continue  # same run, topology and series as the report before: checked
                last = same
                topo = Topology(r.world_size, sz.as_tuple())
                if (self._topology.get(r.run_id) or new_topology.get(r.run_id)) != topo:
                    self._ensure_run(conn, r.run_id, topo, now, i)  # creates it, or raises
                    new_topology[r.run_id] = topo
                skey = (r.run_id, r.statistic)
                info = series_of.get(skey)
                if info is None or info.kind != r.kind or (r.spec is not None and r.spec != info.spec):
                    info = self._ensure_series(conn, r.run_id, r.statistic, r.kind, r.spec, now, i)
                    series_of[skey] = info
                    if skey not in self._series:
                        new_series[skey] = info

            rows: dict[tuple, tuple] = {}
            index_of: dict[tuple, int] = {}
            expected: dict[tuple[int, int], int] = {}
            for i, r in enumerate(batch):
                info = series_of[(r.run_id, r.statistic)]
                row = report_row(r, info.id, now)
                key = row[:4]
                prev = rows.get(key)
                if prev is not None:
                    if prev[:-1] != row[:-1]:
                        raise _conflict([(i, key, prev, row)], batch, within=index_of[key])
                    out.duplicates += 1
                    continue
                rows[key] = row
                index_of[key] = i
                sk = key[:2]
                n = r.world_size * r.num_microbatches
                if expected.setdefault(sk, n) != n:
                    raise _microbatch_conflict(i, r, expected[sk] // r.world_size)

            # Key order: concurrent transactions take index locks in one order (no deadlocks).
            ordered = [rows[k] for k in sorted(rows)]
            # Fast path: one bulk statement that stores every row, or nothing if any key exists.
            all_new = bool(ordered) and store.insert_all_new(conn, ordered)
            if all_new:
                inserted_keys: Any = rows.keys()
            else:  # re-sends: find out row by row what is stored, and whether it is identical
                inserted_keys = store.insert_returning(conn, ordered)
                leftover = [k for k in rows if k not in inserted_keys]
                if leftover:
                    stored = store.fetch_reports(conn, leftover)
                    clashes = [(index_of[k], k, stored[k], rows[k])
                               for k in leftover if stored[k][:-1] != rows[k][:-1]]
                    if clashes:
                        raise _conflict(clashes, batch)
                    out.duplicates += len(leftover)
            out.accepted = len(inserted_keys)

            added = Counter(k[:2] for k in inserted_keys)
            if added:
                progress = store.count_arrivals(conn, added, expected, now)
                for p in progress:
                    if p.expected != expected[(p.series_id, p.step)]:
                        i = next(index_of[k] for k in sorted(rows) if k[:2] == (p.series_id, p.step))
                        raise _microbatch_conflict(i, batch[i], p.expected // batch[i].world_size)
                by_id = {info.id: info for info in series_of.values()}
                by_step: dict[tuple[int, int], list[tuple]] | None = None
                for p in sorted(progress, key=lambda p: (p.series_id, p.step)):
                    if p.verdict is None and p.received >= p.expected:
                        info = by_id[p.series_id]
                        mine = None
                        if all_new and p.received == added[(p.series_id, p.step)]:
                            # Every stored report of the step is one this transaction just
                            # wrote: audit the rows in hand instead of reading them back.
                            if by_step is None:
                                by_step = defaultdict(list)
                                for row in ordered:
                                    by_step[row[:2]].append(row)
                            mine = [rank_report(row) for row in by_step[(p.series_id, p.step)]]
                        topo = self._topology.get(info.run_id) or new_topology[info.run_id]
                        v = self._audit(conn, info, topo, p, now, mine)
                        if v is not None:
                            out.audited.append((p.series_id, p.step, v))
        self._topology.update(new_topology)
        self._series.update(new_series)
        return out

    def _audit(self, conn: sa.Connection, info: SeriesInfo, topo: Topology, p: Arrival, now: float,
               rank_reports: list[RankReport] | None = None) -> str | None:
        """Audit one step inside the caller's transaction and record the verdict; return it,
        or None if another transaction recorded it first. ``rank_reports``: every stored
        report of the step, if the caller holds them (else they are read)."""
        store = self.store
        if rank_reports is None:
            rank_reports = store.step_reports(conn, info.id, p.step)
        v = core.audit_step(
            rank_reports, topo.sizes, info.engine_spec,
            num_microbatches=max(1, p.expected // topo.world_size),
            history=store.history(conn, info.id, p.step), kind=info.kind,
        )
        return v.verdict if store.record_verdict(conn, info.id, p.step, v, now) else None

    def sweep(self, grace_seconds: float, now: float | None = None, limit: int = 1000) -> int:
        """Audit steps still incomplete ``grace_seconds`` after their first report
        (``missing_report``), one transaction per step. Safe to run on every replica at
        once: each step's verdict is recorded exactly once. Returns the steps this call audited."""
        now = time.time() if now is None else now
        with self.store.read() as conn:
            due = self.store.due_steps(conn, now - grace_seconds, limit)
        audited = 0
        for series_id, step, expected in due:
            with self.store.write() as conn:
                srow, run = self.store.series_by_id(conn, series_id)
                topo = Topology(run.world_size, run.sizes)
                if self._audit(conn, SeriesInfo.of(srow), topo, Arrival(series_id, step, 0, expected, None),
                               now) is not None:
                    audited += 1
        return audited

    # -------------------------------------------------------------------------- reads
    def list_runs(self, status: str | None = None) -> list[dict]:
        """Every run (optionally of one ``status``) with its topology and per-statistic step
        counts, newest first."""
        return self.runs_page(status=status)[0]

    def runs_page(self, limit: int | None = None, after: tuple[float, str] | None = None,
                  status: str | None = None) -> tuple[list[dict], tuple[float, str] | None]:
        """Runs with their topology and per-statistic step counts, newest first, one keyset
        page at a time (``GET /v1/runs``).

        ``after``: (created_at, run_id) of the last run of the previous page; ``status``:
        ``inconsistent`` or ``consistent``. Returns (runs, the key to pass as ``after`` for
        the next page, or None on the last page)."""
        if status not in (None, "consistent", "inconsistent"):
            raise ValueError(f"status must be 'consistent' or 'inconsistent', got {status!r}")
        with self.store.read() as conn:
            run_rows = self.store.runs(conn, None if limit is None else limit + 1, after, status)
            more = limit is not None and len(run_rows) > limit
            run_rows = run_rows[:limit] if limit is not None else run_rows
            srows = self.store.series_rows(conn, [r["run_id"] for r in run_rows]) if run_rows else []
        by_run: dict[str, list] = defaultdict(list)
        for s in srows:
            by_run[s["run_id"]].append(s)
        last = (run_rows[-1]["created_at"], run_rows[-1]["run_id"]) if more else None
        return [_run_summary(r, by_run[r["run_id"]]) for r in run_rows], last

    def get_run(self, run_id: str) -> dict:
        """One run's summary; raises :class:`NotFound`."""
        with self.store.read() as conn:
            r = self.store.run(conn, run_id)
            if r is None:
                raise NotFound(run_id)
            srows = self.store.series_rows(conn, run_id)
        return _run_summary(r, srows)

    def report(self, run_id: str, bad_steps_limit: int = 20, statistic: str | None = None) -> dict:
        """The consistency report of a run (``GET /v1/runs/{run_id}/report``).

        Served from the per-series aggregates plus, for at most ``bad_steps_limit`` bad
        steps per statistic (inconsistent first, then incomplete, by step), their faults
        and per-rank tables (recomputed from the step's stored reports). Raises
        :class:`NotFound`.
        """
        run = self.get_run(run_id)
        out = {k: run[k] for k in ("run_id", "world_size", "sizes", "created_at", "last_activity")}
        out["statistics"] = []
        with self.store.read() as conn:
            for s in self.store.series_rows(conn, run_id, statistic, ordered=True):
                out["statistics"].append(self._series_report(conn, s, run, bad_steps_limit))
        if statistic is not None and not out["statistics"]:
            raise NotFound(f"{run_id}/{statistic}")
        out["consistent"] = all(s["steps_inconsistent"] == 0 for s in out["statistics"])
        return out

    def _series_report(self, conn: sa.Connection, s, run: dict, limit: int) -> dict:
        store = self.store
        fault_counts = store.fault_counts(conn, s["id"])
        pending = store.pending_steps(conn, s["id"])
        bad_rows = store.bad_steps(conn, s["id"], limit)
        info = SeriesInfo.of(SeriesRow(s["id"], s["run_id"], s["statistic"], s["kind"], s["spec"]))
        topo = Topology(run["world_size"], tuple(run["sizes"][d] for d in DIMS))
        audited = s["steps_consistent"] + s["steps_inconsistent"] + s["steps_incomplete"]
        return {
            "statistic": s["statistic"], "kind": s["kind"], "spec": s["spec"],
            "steps_audited": audited, "steps_consistent": s["steps_consistent"],
            "steps_inconsistent": s["steps_inconsistent"], "steps_incomplete": s["steps_incomplete"],
            "steps_pending": pending,
            "first_bad_step": s["first_bad_step"], "last_bad_step": s["last_bad_step"],
            "last_audited_step": s["last_audited_step"],
            "faults": fault_counts,
            "cp_disagreement_sigma": s["cp_disagreement_sigma"], "applied_error_sigma": s["applied_error_sigma"],
            "worst_cp_disagreement_sigma": s["worst_cp_disagreement_sigma"],
            "worst_cp_disagreement_step": s["worst_cp_disagreement_step"],
            "worst_applied_error_sigma": s["worst_applied_error_sigma"],
            "worst_applied_error_step": s["worst_applied_error_step"],
            "bad_steps": [self._step_detail(conn, info, topo, row) for row in bad_rows],
            "bad_steps_shown": len(bad_rows),
            "bad_steps_total": s["steps_inconsistent"] + s["steps_incomplete"],
        }

    def _step_detail(self, conn: sa.Connection, info: SeriesInfo, topo: Topology, row) -> dict:
        fault_rows = self.store.step_faults(conn, info.id, row["step"])
        recomputed = core.audit_step(
            self.store.step_reports(conn, info.id, row["step"]), topo.sizes, info.engine_spec,
            num_microbatches=max(1, row["expected"] // topo.world_size), kind=info.kind,
        )
        return {
            "step": row["step"], "verdict": row["verdict"], "audited_at": row["audited_at"],
            "reports": row["received"], "expected": row["expected"],
            "cp_disagreement_sigma": row["cp_disagreement_sigma"],
            "applied_error_sigma": row["applied_error_sigma"],
            "faults": [
                {"kind": f["kind"], "message": f["message"], "ranks": list(core.expand_ranks(f["ranks"]) or ()),
                 "evidence": f["evidence"]}
                for f in fault_rows
            ],
            "ranks": [_row_json(r) for r in recomputed.rows],
        }

    def steps(self, run_id: str, statistic: str, *, start: int | None = None, stop: int | None = None,
              verdict: str | None = None, limit: int = 1000, after: int | None = None) -> dict:
        """Step history of one statistic (``GET .../statistics/{statistic}/steps``): one
        summary per stored step row, in step order, never re-audited: step, verdict
        (``pending`` while open), reports received of expected, the σ figures and rounding
        tolerance (σ of the correct statistic), the fault kinds.

        ``start``/``stop``: inclusive step bounds; ``verdict``: ``consistent``,
        ``inconsistent``, ``incomplete`` or ``pending``; ``after``: the last step of the
        previous page. Returns ``{"run_id", "statistic", "kind", "steps": [...], "last"}``,
        ``last`` set when more steps may follow. Raises :class:`NotFound`."""
        lo = start if after is None else (after + 1 if start is None else max(start, after + 1))
        with self.store.read() as conn:
            found = self.store.series_rows(conn, run_id, statistic)
            if not found:
                raise NotFound(f"{run_id}/{statistic}" if self.store.run(conn, run_id) is not None else run_id)
            rows = self.store.step_rows(conn, found[0]["id"], start=lo, stop=stop, verdict=verdict, limit=limit + 1)
        more = len(rows) > limit
        rows = rows[:limit]
        return {
            "run_id": run_id, "statistic": statistic, "kind": found[0]["kind"],
            "steps": [{
                "step": r["step"], "verdict": r["verdict"] or "pending", "reports": r["received"],
                "expected": r["expected"], "cp_disagreement_sigma": r["cp_disagreement_sigma"],
                "applied_error_sigma": r["applied_error_sigma"], "tolerance_sigma": r["tolerance_sigma"],
                "fault_kinds": r["fault_kinds"].split(",") if r["fault_kinds"] else [], "audited_at": r["audited_at"],
            } for r in rows],
            "last": rows[-1]["step"] if more and rows else None,
        }

    def step(self, run_id: str, statistic: str, step: int) -> dict:
        """One step's verdict and per-rank table; raises :class:`NotFound`."""
        run = self.get_run(run_id)
        with self.store.read() as conn:
            found = self.store.series_rows(conn, run_id, statistic)
            if not found:
                raise NotFound(f"{run_id}/{statistic}")
            s = found[0]
            row = self.store.step_row(conn, s["id"], step)
            if row is None:
                raise NotFound(f"{run_id}/{statistic}/{step}")
            info = SeriesInfo.of(SeriesRow(s["id"], run_id, statistic, s["kind"], s["spec"]))
            topo = Topology(run["world_size"], tuple(run["sizes"][d] for d in DIMS))
            return {"run_id": run_id, "statistic": statistic, **self._step_detail(conn, info, topo, row)}

    def metric_series(self, since: float) -> list[dict]:
        """Per-series aggregates for /metrics, for series active after ``since`` (Unix s)."""
        return self.store.metric_series(since)


class PageReads:
    """The three reads of a run page (:class:`auditor.web.PageSource`) from a
    :class:`Service`: the same JSON documents as the endpoints they name."""

    def __init__(self, service: Service):
        self.service = service

    def report_json(self, run_id: str, *, bad_steps: int = 20) -> dict:
        """``GET /v1/runs/{run_id}/report``."""
        return self.service.report(run_id, bad_steps_limit=bad_steps)

    def steps_json(self, run_id: str, statistic: str) -> Iterator[dict]:
        """Every item of ``GET .../statistics/{statistic}/steps``, page by page."""
        after = None
        while True:
            page = self.service.steps(run_id, statistic, limit=10_000, after=after)
            yield from page["steps"]
            after = page["last"]
            if after is None:
                return

    def step_json(self, run_id: str, statistic: str, step: int) -> dict:
        """``GET .../statistics/{statistic}/steps/{step}``."""
        return self.service.step(run_id, statistic, step)


def _run_summary(r, srows) -> dict:
    audited = sum(s["steps_consistent"] + s["steps_inconsistent"] + s["steps_incomplete"] for s in srows)
    bad = sum(s["steps_inconsistent"] for s in srows)
    return {
        "run_id": r["run_id"], "world_size": r["world_size"],
        "sizes": {d: r[d] for d in DIMS}, "created_at": r["created_at"],
        "last_activity": max((s["updated_at"] for s in srows), default=r["created_at"]),
        "statistics": sorted(s["statistic"] for s in srows),
        "steps_audited": audited, "steps_inconsistent": bad, "consistent": bad == 0,
    }


def _row_json(r: core.RankRow) -> dict:
    return json_safe({k: getattr(r, k) for k in r.__dataclass_fields__})


def _microbatch_conflict(i: int, r: Report, other: int) -> ConflictError:
    return ConflictError(
        "conflicting_report",
        f"reports[{i}] (step {r.step}, rank {r.rank}) says num_microbatches={r.num_microbatches}, but other "
        f"reports of that step say {other}: every report of a step must give the same num_microbatches; "
        "nothing of this batch was stored",
        [{"index": i, "run_id": r.run_id, "statistic": r.statistic, "step": r.step,
          "microbatch": r.microbatch, "rank": r.rank, "fields": ["num_microbatches"]}],
    )


def _conflict(clashes: list[tuple[int, tuple, tuple, tuple]], batch: Sequence[Report],
              within: int | None = None) -> ConflictError:
    """409 for reports that differ from one with the same key: the stored one, or (``within``:
    its index) an earlier one of the same batch."""
    conflicts = []
    for i, _key, stored, sent in clashes:
        stored, sent = dict(zip(COLUMNS, stored)), dict(zip(COLUMNS, sent))
        fields = [c for c in COMPARED if stored[c] != sent[c]]
        r = batch[i]
        conflicts.append({
            "index": i, "run_id": r.run_id, "statistic": r.statistic, "step": r.step,
            "microbatch": r.microbatch, "rank": r.rank, "fields": fields,
        })
    first = conflicts[0]
    if within is not None:
        message = (f"reports[{within}] and reports[{first['index']}] have the same (run, statistic, step, "
                   f"microbatch, rank) but differ in {', '.join(first['fields'])}; nothing of this batch "
                   "was stored")
    else:
        message = (f"{len(conflicts)} report(s) differ from the stored report with the same (run, statistic, "
                   f"step, microbatch, rank), e.g. reports[{first['index']}] (step {first['step']}, rank "
                   f"{first['rank']}) differs in {', '.join(first['fields'])}; the stored report stays, "
                   "nothing of this batch was stored")
    return ConflictError("conflicting_report", message, conflicts)
