"""The golden corpus through the service's flows: each step's reports, validated by the
wire schema and ingested in one batch by :class:`auditor.service.Service` (then the
missing-report sweep with grace 0), come back from :meth:`Service.step` with the corpus's verdict, faults (kind, ranks, message,
evidence), σ figures and per-rank rows — on SQLite and PostgreSQL.

The service hands the engine the history the store built from the verdicts it stored, so
``stale_statistic`` findings must match too. Rows it serves are recomputed
without history, so they are compared on steps without a ``stale_statistic`` finding.
Cases the wire rejects (the generator can perturb sums past Cauchy–Schwarz, and a replica
dim inside the reduction is a spec the wire refuses: ``schemas.replicas_rule``) or that hand
raw NaN to the engine are skipped; the test asserts how many steps it covered.
"""

from __future__ import annotations

import math
import os
import time

import generate
import pytest
import regenerate
from pydantic import ValidationError

from auditor.db.engine import ensure_schema, make_engine
from auditor.contract.models import Report
from auditor.service import Service

#: Cases sent through the store (the first ones of the corpus), bounded for the suite's time;
#: ``AUDITOR_GOLDEN_SERVICE_CASES=1500`` sends the whole corpus.
CASES = int(os.environ.get("AUDITOR_GOLDEN_SERVICE_CASES", "300"))


def _safe(obj):
    """What the store's JSON columns make of a value (NaN/Inf as strings, tuples as lists)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_safe(v) for v in obj]
    return obj


def _finite_or_none(x):
    return x if x is None or math.isfinite(x) else None


@pytest.fixture
def service(fresh_database_url):
    engine = make_engine(fresh_database_url)
    ensure_schema(engine, fresh_database_url)
    yield Service.from_engine(engine)
    engine.dispose()


def test_stored_verdicts_equal_the_golden_corpus(service):
    """Every covered step's stored verdict equals the corpus's; most steps are covered."""
    _, stored = regenerate.read()
    expected = {r["id"]: r["verdict"] for r in stored}
    covered = total = 0
    for case in generate.cases(regenerate.SEED, CASES):
        total += len(case.steps)
        if case.raw:
            continue
        run_id = f"golden-{case.id}"
        try:
            batches = [[Report.model_validate(b) for b in generate.wire_reports(case, s, run_id)] for s in case.steps]
        except ValidationError as e:
            if set(case.spec["reduce_over"]) & set(case.spec["replicas"]):  # refused for its spec, at replicas
                assert ("spec", "replicas") in {x["loc"][:2] for x in e.errors()}, case.describe()
            continue
        for step, batch in zip(case.steps, batches):
            service.ingest(batch)
            service.sweep(grace_seconds=0.0, now=time.time() + 10)
            got = service.step(run_id, "golden", step.index)[0].to_json()  # compared with the corpus as JSON
            want = expected[f"{case.id}/s{step.index}"]
            where = f"{case.describe()} step {step.index}"
            assert got["verdict"] == want["verdict"], where
            # the step endpoint lists every rank of a fault and says so (04ba817)
            assert all(f.pop("ranks_total") == len(f["ranks"]) and f.pop("ranks_truncated") is False
                       for f in got["faults"]), where
            assert got["faults"] == [_safe(f) for f in want["faults"]], where
            # an incomplete step shows no CP σ (a peer is missing: the engine's figure covers only
            # the complete CP groups and would read as a measured value); the engine's is stored
            want_cp = None if want["verdict"] == "incomplete" else _finite_or_none(want["cp_disagreement_sigma"])
            assert got["cp_disagreement_sigma"] == want_cp, where
            assert got["applied_error_sigma"] == _finite_or_none(want["applied_error_sigma"]), where
            if not any(f["kind"] == "stale_statistic" for f in want["faults"]):
                # the step endpoint lists rows in (rank, microbatch) order (04ba817)
                rows = sorted(want["rows"], key=lambda r: (r["rank"], r["microbatch"]))
                assert got["ranks"] == _safe(rows), where
            covered += 1
    assert covered >= 0.85 * total


#: Cases per batch of the many-steps test: every batch mixes runs, topologies, kinds, clean
#: and faulty steps (several needing the series' history), incomplete steps and the sweep.
BATCH_CASES = 40


def _stored(service, prefix: str) -> dict:
    """Every step row and series row of the runs ``<prefix>-*``, keyed by (case, statistic,
    step) and (case, statistic), without ids and times."""
    import sqlalchemy as sa

    from auditor.db.tables import series, step_audits

    drop = {"id", "series_id", "run_id", "first_seen", "audited_at", "updated_at", "created_at"}
    with service.store.read() as conn:
        srows = conn.execute(sa.select(series).where(series.c.run_id.like(f"{prefix}-%"))).mappings().all()
        of = {r["id"]: (r["run_id"].split("-", 1)[1], r["statistic"]) for r in srows}
        steps = conn.execute(sa.select(step_audits).where(step_audits.c.series_id.in_(list(of)))).mappings().all()
    return {"series": {of[r["id"]]: {k: v for k, v in r.items() if k not in drop} for r in srows},
            "steps": {(*of[r["series_id"]], r["step"]): {k: v for k, v in r.items() if k not in drop} for r in steps}}


def test_many_steps_per_batch_store_what_the_general_path_stores(service, monkeypatch):
    """The corpus's cases sent :data:`BATCH_CASES` cases per batch: steps completed in hand
    (their clean ones recorded as columns, ``CleanSteps``) leave the same step rows
    (verdict, σ figures, fault kinds, groups, counts) and series rows as the general path
    (step row upserted, then its verdict UPDATEd), the sweep included."""
    inserted = []
    clean_rows = service.store._clean_step_rows
    monkeypatch.setattr(service.store, "_clean_step_rows",
                        lambda cur, clean, now: (inserted.append(sum(len(c.steps) for c in clean)),
                                                 clean_rows(cur, clean, now))[1])
    cases = [c for c in generate.cases(regenerate.SEED, CASES) if not c.raw]
    tag = f"{time.time_ns()}"
    for prefix, in_hand in ((f"cols{tag}", True), (f"general{tag}", False)):
        for lo in range(0, len(cases), BATCH_CASES):
            batch = []
            for case in cases[lo:lo + BATCH_CASES]:
                try:
                    batch += [Report.model_validate(b) for s in case.steps
                              for b in generate.wire_reports(case, s, f"{prefix}-{case.id}")]
                except ValidationError:
                    continue
            service.ingest(batch) if in_hand else service._ingest_retrying(batch, None, in_hand=False)
        service.sweep(grace_seconds=0.0, now=time.time() + 10)
    cols, general = _stored(service, f"cols{tag}"), _stored(service, f"general{tag}")
    assert len(cols["steps"]) >= 0.85 * sum(len(c.steps) for c in cases)
    assert sum(inserted) >= 150  # clean steps recorded as columns (173 of them)
    assert cols["series"] == general["series"]
    assert cols["steps"] == general["steps"]
