"""Prometheus metrics (DESIGN.md §6).

Two sources, chosen so that ``/metrics`` stays true with several workers and replicas:

* Audit results (steps audited, faults, the two sigma gauges, last audited step) are read
  from the database at scrape time (:class:`AuditCollector`) from the per-series aggregates
  the audit transaction maintains. Every replica exports the same values, whichever
  process audited the step, and nothing is lost when a worker restarts. Series idle for
  longer than ``metrics_retention_seconds`` are not exported.
* Ingest counters and the latency histogram describe the process that served the request.
  With one process they are ordinary prometheus-client metrics. With several uvicorn
  workers (``auditor serve --workers N``) a scrape reaches one worker at random, so they use
  prometheus-client's multiprocess mode: ``serve`` points ``PROMETHEUS_MULTIPROC_DIR`` at a
  directory it wipes at start (:func:`prepare_multiprocess_dir`), every worker writes its
  values to its own mmap files there, and ``/metrics`` merges all files
  (``MultiProcessCollector``), so every worker exports the sum over all workers, including
  workers that have died (a counter must never go down). Across replicas (separate hosts)
  aggregate over instances in PromQL.

Labels are bounded: run, statistic, kind, verdict, reason. Per-rank detail lives in the
report, never in a label.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

#: prometheus-client's multiprocess switch: set (before prometheus_client is imported) in
#: every process that serves, it makes metric values live in mmap files in that directory.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_DB_FILE = re.compile(r"^(counter|gauge_[a-z]+|histogram|summary)_(\d+)\.db$")

#: Metric family names the service exports (histogram without its _bucket/_sum/_count).
EXPORTED_METRICS: tuple[str, ...] = (
    "auditor_reports_received_total",
    "auditor_reports_rejected_total",
    "auditor_steps_audited_total",
    "auditor_faults_total",
    "auditor_cp_disagreement_sigma",
    "auditor_applied_error_sigma",
    "auditor_last_audited_step",
    "auditor_ranks_behind",
    "auditor_reports_dropped_total",
    "auditor_replica_divergence_steps_total",
    "auditor_replica_gap_ratio",
    "auditor_ingest_duration_seconds",
    "auditor_body_bytes_in_flight",
)
#: Exported series without a panel of the Grafana dashboard (deploy/grafana), each with why:
#: every other one is queried there (tests/e2e/test_deploy.py checks both ways on a scrape).
INTERNAL_METRICS: dict[str, str] = {
    "auditor_body_bytes_in_flight": "capacity detail behind the 503 'overloaded' of bodies in flight "
                                    "(AUDITOR_MAX_BODY_BYTES_IN_FLIGHT): read it on /metrics when they appear; "
                                    "nobody acts on its value otherwise",
}


def multiprocess_dir() -> str | None:
    """The multiprocess directory of this process, or None (single-process mode)."""
    return os.environ.get(MULTIPROC_ENV) or None


def prepare_multiprocess_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` and delete the metric files a previous run left there, so counters
    start at zero with the service. Only prometheus-client's own ``*_<pid>.db`` files are
    removed. Call it in the parent, before any worker starts."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    for f in p.iterdir():
        if _DB_FILE.match(f.name):
            f.unlink(missing_ok=True)
    return p


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_dead_workers(path: str | os.PathLike) -> list[int]:
    """``multiprocess.mark_process_dead`` for every pid that left files in ``path`` and no
    longer runs (uvicorn has no child-exit hook, so each worker checks at start-up and at
    every scrape). It drops the dead process's live-gauge files; its counter and histogram
    files stay, so the totals keep the work it did. Returns the dead pids."""
    from prometheus_client import multiprocess

    pids = {int(m.group(2)) for f in os.listdir(path) if (m := _DB_FILE.match(f))}
    dead = sorted(pid for pid in pids if not _alive(pid))
    for pid in dead:
        multiprocess.mark_process_dead(pid, str(path))
    return dead


class _Reaping:
    """Collector wrapper: reap dead workers' files, then merge every worker's files."""

    def __init__(self, path: str):
        from prometheus_client import multiprocess

        self._path = path
        self._merge = multiprocess.MultiProcessCollector(None, path=path)

    def collect(self) -> Iterable[Metric]:
        """Merged metrics. A worker that uvicorn is starting right now may have created its
        file without its first value (``struct.error`` while reading it), and a dead
        worker's gauge files may vanish between listing and reading (``OSError``): such a
        scrape is retried a few times (50 ms apart) instead of answering 500."""
        import struct

        for attempt in range(4):
            reap_dead_workers(self._path)
            try:
                return list(self._merge.collect())
            except (struct.error, OSError):
                if attempt == 3:
                    raise
                time.sleep(0.05)
        return []


def scrape_registry(load: Callable[..., list[dict]], retention_seconds: float, max_series: int | None = None
                    ) -> tuple[CollectorRegistry, "ServiceMetrics"]:
    """The registry ``/metrics`` exports and the process-local metrics to update.

    Single process: the ingest metrics are registered in the registry. Multiprocess
    (``PROMETHEUS_MULTIPROC_DIR`` set): they are registered nowhere (their values go to this
    worker's mmap files) and the registry merges all workers' files instead. Either way the
    DB-derived :class:`AuditCollector` is added."""
    registry = CollectorRegistry()
    path = multiprocess_dir()
    if path is None:
        metrics = ServiceMetrics(registry)
    else:
        metrics = ServiceMetrics(None)
        reap_dead_workers(path)
        registry.register(_Reaping(path))
    registry.register(AuditCollector(load, retention_seconds, max_series))
    return registry, metrics


class ServiceMetrics:
    """The process-local metrics, registered in ``registry`` (None: in none, for
    multiprocess mode, where :func:`scrape_registry` merges the workers' files)."""

    def __init__(self, registry: CollectorRegistry | None):
        self.received = Counter(
            "auditor_reports_received", "Reports stored (duplicates excluded).", registry=registry
        )
        self.rejected = Counter(
            "auditor_reports_rejected", "Reports rejected, by reason.", ["reason"], registry=registry
        )
        self.ingest_duration = Histogram(
            "auditor_ingest_duration_seconds",
            "Time to validate, store and audit one POST /v1/reports, in seconds.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=registry,
        )
        self.body_bytes = Gauge(
            "auditor_body_bytes_in_flight",
            "Request-body bytes held now, from before a body is read until its decode and ingest are done "
            "(at most AUDITOR_MAX_BODY_BYTES_IN_FLIGHT per process).",
            multiprocess_mode="livesum", registry=registry,
        )


class AuditCollector:
    """Exports audit results from the database at scrape time.

    ``load(since)`` returns the per-series rows of :meth:`auditor.service.Service.metric_series`.
    """

    def __init__(self, load: Callable[..., list[dict]], retention_seconds: float, max_series: int | None = None):
        self._load = load
        self._retention = retention_seconds
        self._max_series = max_series

    def collect(self) -> Iterable[Metric]:
        """The audit metrics of every series active within the retention window (at most
        ``max_series``), read from the database at scrape time."""
        rows = self._load(time.time() - self._retention, self._max_series)
        steps, faults, cp, err, last, behind, dropped, drift, gap = families = _families()
        for r in rows:
            labels = [r["run_id"], r["statistic"]]
            dropped.add_metric(labels, r.get("reports_dropped") or 0)
            for verdict, n in r["steps"].items():
                steps.add_metric(labels + [verdict], n)
            for kind, n in sorted(r["faults"].items()):
                faults.add_metric(labels + [kind], n)
            if r["last_audited_step"] is not None:
                last.add_metric(labels, r["last_audited_step"])
            if r.get("kind") == "fingerprint":  # its step figure is a gap ratio, not a σ
                drift.add_metric(labels, r["steps"].get("inconsistent", 0))
                if r["applied_error_sigma"] is not None:
                    gap.add_metric(labels, r["applied_error_sigma"])
                continue
            if r.get("ranks_behind") is not None:
                behind.add_metric(labels, r["ranks_behind"])
            if r["cp_disagreement_sigma"] is not None:
                cp.add_metric(labels, r["cp_disagreement_sigma"])
            if r["applied_error_sigma"] is not None:
                err.add_metric(labels, r["applied_error_sigma"])
        yield from families


def _families() -> tuple[Metric, ...]:
    """The empty metric families of :class:`AuditCollector`, in export order: steps,
    faults, cp, err, last, behind, dropped, drift, gap."""
    steps = CounterMetricFamily(
        "auditor_steps_audited",
        "Verdicts recorded, by verdict (consistent, inconsistent, incomplete, audit_error, unverified). A step re-audited "
        "after a late report counts under its first and its final verdict; the report shows the final one.",
        labels=["run", "statistic", "verdict"]
    )
    faults = CounterMetricFamily(
        "auditor_faults", "Faults found, by kind (one per step and diagnosis).", labels=["run", "statistic", "kind"]
    )
    cp = GaugeMetricFamily(
        "auditor_cp_disagreement_sigma",
        "Latest audited step: largest gap between CP peers' whitened values, in σ of the correct statistic.",
        labels=["run", "statistic"],
    )
    err = GaugeMetricFamily(
        "auditor_applied_error_sigma",
        "Latest audited step: largest gap between an applied and the correct whitening, in σ.",
        labels=["run", "statistic"],
    )
    last = GaugeMetricFamily(
        "auditor_last_audited_step", "Highest step audited so far.", labels=["run", "statistic"]
    )
    behind = GaugeMetricFamily(
        "auditor_ranks_behind",
        "Ranks whose newest report is older than the statistic's newest reported step, as of the last step "
        "audited incomplete (0 once a newer step is complete); which ranks: the report's progress.",
        labels=["run", "statistic"],
    )
    dropped = CounterMetricFamily(
        "auditor_reports_dropped",
        "Reports the trainers' clients dropped before sending them (their ring of device reports or their queue "
        "was full), as told by later reports: the statistic's audit has gaps (its status is never consistent).",
        labels=["run", "statistic"],
    )
    drift = CounterMetricFamily(
        "auditor_replica_divergence_steps",
        "Fingerprint statistics (replica drift): steps whose replicas of the tensor disagreed (verdicts "
        "inconsistent ever recorded).", labels=["run", "statistic"])
    gap = GaugeMetricFamily(
        "auditor_replica_gap_ratio",
        "Fingerprint statistics: latest audited step's largest gap between a replica and its reference, "
        "‖x_r − x_ref‖/‖x_ref‖ (0 when every group agreed; a correct run stays below 4 unit roundoffs).",
        labels=["run", "statistic"])
    return steps, faults, cp, err, last, behind, dropped, drift, gap
