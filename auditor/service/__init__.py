"""The flows of the service, above a SQL-only store and the audit engine: a thin
:class:`Service` over its named parts.

* :mod:`~auditor.service.ingest` — :meth:`Service.ingest`: store a validated batch and audit
  every step it completes, in one store transaction, as named stages; one retry table.
* :mod:`~auditor.service.judge` — the clean path and the exact path of judging steps.
* :mod:`~auditor.service.progress` — hang localisation of steps audited with reports missing.
* :mod:`~auditor.service.lifecycle` — :meth:`Service.sweep`, :meth:`Service.delete_run`,
  :meth:`Service.idle_runs`.
* :mod:`~auditor.service.reads` — :meth:`Service.report`, :meth:`Service.step`,
  :meth:`Service.list_runs`, :meth:`Service.get_run`, ...: the read documents
  (:mod:`auditor.contract.reads`) the API and the CLI serve; :class:`LocalReader`, the read protocol of :class:`auditor.reader.Reader` over a
  database.
* :mod:`~auditor.service.workloads` — :meth:`Service.compare_workload`,
  :meth:`Service.compare_runs`: runs of one workload compared across layouts (issue 26).
* :mod:`~auditor.service.errors` (409/422/404/503 and their wording),
  :mod:`~auditor.service.model` (:class:`Topology`, :class:`SeriesInfo`),
  :mod:`~auditor.service.caches` (the process's caches and their proofs).

Every caller goes through here: the HTTP API (:mod:`auditor.server`), ``auditor audit``
(:mod:`auditor.offline`) and the CLI's database mode. Exactly-once auditing across
threads, workers and replicas, and the lock order, are the store's
(:mod:`auditor.db.store`); this package only decides *what* to write, and words the errors.
"""

from __future__ import annotations

import time
from typing import Sequence

import sqlalchemy as sa

from auditor.db.store import Store
from auditor.contract.models import Report, RunRegistration
from auditor.contract import reads as documents
from auditor.service.caches import OPEN_STEP_ROWS, Caches, OpenStepRows, by_step
from auditor.service import errors
from auditor.service.errors import (
    ConflictError, Contended, LimitError, NotFound, StaleCaches, check_placed, conflict, microbatch_conflict,
    wire_fields,
)
from auditor.service.ingest import ATTEMPTS, IngestOutcome, Ingest, Mode, is_integrity_error
from auditor.service.judge import Judge, _Due, _Fresh
from auditor.service.lifecycle import Lifecycle
from auditor.service.model import SeriesInfo, Topology, stored_order
from auditor.service.progress import PROGRESS_LOOKBACK_REPORTS, PROGRESS_WINDOW
from auditor.service.reads import (
    REPORT_AUDIT_BUDGET, REPORT_FAULT_RANKS, REPORT_RANK_ROWS, REPORT_ROWS_BUDGET, STEP_RANK_ROWS,
    STEP_RANK_ROWS_MAX, LocalReader, Reads, _cp_sigma, _rank_row, _run_summary,
)
from auditor.service.workloads import WORKLOAD_RUNS, WORKLOAD_STEPS, WORKLOAD_STEPS_MAX, Workloads

__all__ = [
    "ConflictError", "Contended", "IngestOutcome", "LimitError", "LocalReader", "NotFound", "OPEN_STEP_ROWS",
    "PROGRESS_LOOKBACK_REPORTS", "PROGRESS_WINDOW", "REPORT_AUDIT_BUDGET", "REPORT_FAULT_RANKS",
    "REPORT_RANK_ROWS", "REPORT_ROWS_BUDGET", "STEP_RANK_ROWS", "STEP_RANK_ROWS_MAX", "SeriesInfo", "Service",
    "Topology", "WORKLOAD_RUNS", "WORKLOAD_STEPS", "WORKLOAD_STEPS_MAX",
]

#: Names of the single-module service that other code (tests) imported, kept importable.
_OpenStepRows = OpenStepRows
_StaleCaches = StaleCaches
_ATTEMPTS = ATTEMPTS
_is_integrity_error = is_integrity_error
_by_step = by_step
_stored_order = stored_order
_check_placed, _conflict, _microbatch_conflict, _wire_fields = check_placed, conflict, microbatch_conflict, wire_fields
_PRIVATE = (_Due, _Fresh, _cp_sigma, _rank_row, _run_summary)


class Service:
    """The flows over one database. Thread-safe; holds no state but caches of what does not
    change once stored (:class:`auditor.service.caches.Caches`, with the proof of why an
    entry is never used for a run deleted meanwhile)."""

    def __init__(self, store: Store, *, max_statistics_per_run: int | None = None,
                 open_step_rows: int = OPEN_STEP_ROWS):
        self.store = store
        self.max_statistics_per_run = max_statistics_per_run
        self.caches = Caches(open_step_rows)
        self.judge = Judge(store)
        self.ingestion = Ingest(store, self.caches, self.judge, max_statistics_per_run)
        self.lifecycle = Lifecycle(store, self.caches, self.judge)
        self.reads = Reads(store)
        self.workloads = Workloads(store)

    @classmethod
    def from_engine(cls, engine: sa.Engine, **limits) -> "Service":
        return cls(Store(engine), **limits)

    def close(self) -> None:
        self.store.dispose()

    # ------------------------------------------------------------------------- writes
    def register_run(self, run_id: str, reg: RunRegistration, now: float | None = None) -> documents.Run:
        """``PUT /v1/runs/{run_id}``: fix the topology and statistic specs. Idempotent;
        raises :class:`ConflictError` if it contradicts what is stored. Returns the run's summary."""
        self.ingestion.register(run_id, reg, time.time() if now is None else now)
        return self.get_run(run_id)

    def ingest(self, batch: Sequence[Report], now: float | None = None, record_refused: bool = True) -> IngestOutcome:
        """Store a validated batch in one transaction and audit the steps it completes
        (:meth:`auditor.service.ingest.Ingest.attempt`). A foreign-key violation means a cached run or series was deleted
        meanwhile (``DELETE /v1/runs``, retention, maybe on another replica): the caches are
        dropped and the batch is tried once more. A step completed in hand whose step row
        existed after all (:meth:`auditor.service.judge.Judge.fresh_steps`) rolls the batch back; it is ingested again
        without completing steps in hand. So does a batch holding a stored report (a
        re-send: :class:`ReportsExist` from the bulk insert, which has no savepoint); it is
        ingested again report by report (``bulk=False``: ``Store.insert_returning``).

        A :class:`ConflictError` (409) stores nothing of the batch; after its rollback, the
        reports that contradicted a stored series are counted against it in a small write
        transaction of their own (:func:`auditor.service.errors.record_refused`; ``record_refused=False``: not,
        e.g. while ``auditor audit`` bisects a batch), so the report can say that a run id
        was reused or a rank re-sent different values. The ConflictError is raised either way.

        Reports that tell of reports their client dropped at hand-over (wire field
        ``dropped``) are counted on their series in the ingest's transaction, a re-send's
        grown tally by its growth (:mod:`auditor.service.dropped`)."""
        try:
            out = self.ingestion.ingest(batch, now)
        except ConflictError as exc:
            if record_refused and exc.against_stored:
                errors.record_refused(self.store, exc, batch, time.time() if now is None else now)
            raise
        return out

    def _ingest(self, batch: Sequence[Report], now: float | None = None, in_hand: bool = True,
                bulk: bool = True) -> IngestOutcome:
        """One attempt of :meth:`ingest` in one mode, no retry (:meth:`Ingest.attempt`)."""
        return self.ingestion.attempt(batch, now, Mode(in_hand, bulk))

    def _ingest_retrying(self, batch: Sequence[Report], now: float | None, in_hand: bool,
                         bulk: bool = True) -> IngestOutcome:
        """:meth:`ingest` kept in one mode: retried after concurrent deletions only (a
        :class:`~auditor.db.store.StepRowExists` or :class:`~auditor.db.store.ReportsExist`
        is raised, not answered by a change of mode)."""
        return self.ingestion.ingest(batch, now, Mode(in_hand, bulk), switch=False)

    # ---------------------------------------------------------------------- lifecycle
    def sweep(self, grace_seconds: float, now: float | None = None, limit: int = 1000,
              max_seconds: float | None = None) -> int:
        """One bounded sweep round (:meth:`Lifecycle.sweep <auditor.service.lifecycle.Lifecycle.sweep>`);
        the number of steps it audited."""
        return self.lifecycle.sweep(grace_seconds, now, limit, max_seconds)

    def delete_run(self, run_id: str, chunk_rows: int = 5000, max_chunks: int | None = None) -> dict | None:
        """Delete a run in bounded transactions (:meth:`Lifecycle.delete_run
        <auditor.service.lifecycle.Lifecycle.delete_run>`); raises :class:`NotFound`."""
        return self.lifecycle.delete_run(run_id, chunk_rows, max_chunks)

    def idle_runs(self, idle_seconds: float, now: float | None = None, limit: int = 10) -> list[str]:
        """Runs with no report for ``idle_seconds``, oldest first, at most ``limit``."""
        return self.lifecycle.idle_runs(idle_seconds, now, limit)

    # -------------------------------------------------------------------------- reads
    def list_runs(self, status: str | None = None) -> list[documents.Run]:
        """Every run (optionally of one ``status``), newest first (:meth:`Reads.list_runs`)."""
        return self.reads.list_runs(status)

    def runs_page(self, limit: int | None = None, after: tuple[float, str] | None = None,
                  status: str | None = None) -> tuple[list[documents.Run], tuple[float, str] | None]:
        """One keyset page of runs (``GET /v1/runs``, :meth:`Reads.runs_page`)."""
        return self.reads.runs_page(limit, after, status)

    def get_run(self, run_id: str) -> documents.Run:
        """One run's summary; raises :class:`NotFound`."""
        return self.reads.get_run(run_id)

    def report(self, run_id: str, bad_steps_limit: int = 20, statistic: str | None = None,
               rank_rows: int = REPORT_RANK_ROWS) -> documents.Report:
        """The consistency report of a run, bounded (:meth:`Reads.report`); raises :class:`NotFound`."""
        return self.reads.report(run_id, bad_steps_limit, statistic, rank_rows)

    def steps(self, run_id: str, statistic: str, *, start: int | None = None, stop: int | None = None,
              verdict: str | None = None, limit: int = 1000,
              after: int | None = None) -> tuple[documents.StepsPage, int | None]:
        """Step history of one statistic, one keyset page and the next page's key (:meth:`Reads.steps`)."""
        return self.reads.steps(run_id, statistic, start=start, stop=stop, verdict=verdict, limit=limit, after=after)

    def step(self, run_id: str, statistic: str, step: int, *, limit: int | None = None,
             after: tuple[int, int] | None = None) -> tuple[documents.StepPage, tuple[int, int] | None]:
        """One step's verdict, faults and a page of its per-rank table, and the next page's
        key (:meth:`Reads.step`)."""
        return self.reads.step(run_id, statistic, step, limit=limit, after=after)

    def metric_series(self, since: float, max_series: int | None = None) -> list[dict]:
        """Per-series figures for /metrics (:meth:`auditor.db.store.Store.metric_series`)."""
        return self.reads.metric_series(since, max_series)

    def compare_workload(self, workload: str, *, start: int | None = None, stop: int | None = None,
                         max_steps: int = WORKLOAD_STEPS) -> documents.Workload:
        """The runs labelled ``workload`` compared across layouts
        (:meth:`auditor.service.workloads.Workloads.compare_workload`); raises :class:`NotFound`."""
        return self.workloads.compare_workload(workload, start=start, stop=stop, max_steps=max_steps)

    def workload_page(self, workload: str) -> tuple[documents.Workload, dict]:
        """:meth:`compare_workload` and the curves of the workload page
        (:meth:`auditor.service.workloads.Workloads.workload_page`); raises :class:`NotFound`."""
        return self.workloads.workload_page(workload)

    def compare_runs(self, run_ids: Sequence[str], *, start: int | None = None, stop: int | None = None,
                     max_steps: int = WORKLOAD_STEPS) -> documents.Workload:
        """The runs ``run_ids`` compared across layouts
        (:meth:`auditor.service.workloads.Workloads.compare_runs`); raises :class:`NotFound`."""
        return self.workloads.compare_runs(run_ids, start=start, stop=stop, max_steps=max_steps)

    # ------------------------------------------------------------------ caches (tests)
    @property
    def _runs(self) -> dict:
        return self.caches.runs

    @property
    def _series(self) -> dict:
        return self.caches.series

    @property
    def _open(self) -> OpenStepRows:
        return self.caches.open

    def _forget(self, run_id: str) -> None:
        self.caches.forget(run_id)
