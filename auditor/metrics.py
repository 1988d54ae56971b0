"""Prometheus metrics (DESIGN.md §6).

Two sources, chosen so that ``/metrics`` stays true with several workers and replicas:

* Audit results (steps audited, faults, the two sigma gauges, last audited step) are read
  from the database at scrape time (:class:`AuditCollector`) from the per-series aggregates
  the audit transaction maintains. Every replica exports the same values, whichever
  process audited the step, and nothing is lost when a worker restarts. Series idle for
  longer than ``metrics_retention_seconds`` are not exported.
* Ingest counters and the latency histogram describe the process that served the request;
  they are ordinary prometheus-client metrics (aggregate over instances in PromQL).

Labels are bounded: run, statistic, kind, verdict, reason. Per-rank detail lives in the
report, never in a label.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

#: Metric family names the service exports (histogram without its _bucket/_sum/_count).
EXPORTED_METRICS: tuple[str, ...] = (
    "auditor_reports_received_total",
    "auditor_reports_rejected_total",
    "auditor_steps_audited_total",
    "auditor_faults_total",
    "auditor_cp_disagreement_sigma",
    "auditor_applied_error_sigma",
    "auditor_last_audited_step",
    "auditor_ingest_duration_seconds",
)


class ServiceMetrics:
    """The process-local metrics, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry):
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


class AuditCollector:
    """Exports audit results from the database at scrape time.

    ``load(since)`` returns the per-series rows of :meth:`auditor.db.store.Store.metric_series`.
    """

    def __init__(self, load: Callable[[float], list[dict]], retention_seconds: float):
        self._load = load
        self._retention = retention_seconds

    def collect(self) -> Iterable[Metric]:
        rows = self._load(time.time() - self._retention)
        steps = CounterMetricFamily(
            "auditor_steps_audited", "Steps audited, by verdict.", labels=["run", "statistic", "verdict"]
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
        for r in rows:
            labels = [r["run_id"], r["statistic"]]
            for verdict in ("consistent", "inconsistent", "incomplete"):
                steps.add_metric(labels + [verdict], r[f"steps_{verdict}"])
            for kind, n in sorted(r["faults"].items()):
                faults.add_metric(labels + [kind], n)
            if r["cp_disagreement_sigma"] is not None:
                cp.add_metric(labels, r["cp_disagreement_sigma"])
            if r["applied_error_sigma"] is not None:
                err.add_metric(labels, r["applied_error_sigma"])
            if r["last_audited_step"] is not None:
                last.add_metric(labels, r["last_audited_step"])
        yield from (steps, faults, cp, err, last)
