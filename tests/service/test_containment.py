"""Issue 9 §2 as a kind: no input that passes validation can make ingest, audit, sweep or
report raise, on SQLite and PostgreSQL; an exception of the engine on one step is contained
to that step (verdict ``audit_error``), and missing reports are summarised as ranges.

The service runs in-process on the real databases; hypothesis draws valid reports of every
kind and topology with NaN, ±Inf, huge and subnormal values, duplicates and gaps.
"""

from __future__ import annotations

import math
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from auditor import core
from auditor.core import VERDICTS
from auditor.db.engine import ensure_schema, make_engine
from auditor.contract.models import Report
from auditor.service import ConflictError, Service
from factory import reference_reports


@pytest.fixture(scope="module")
def service(database_url):
    engine = make_engine(database_url)
    ensure_schema(engine, database_url)
    yield Service.from_engine(engine)
    engine.dispose()


def _reports(dicts: list[dict]) -> list[Report]:
    return [Report.model_validate(d, strict=True) for d in dicts]


def test_an_engine_exception_is_contained_to_its_step(service, monkeypatch):
    """The engine raising on step 1 of a 3-step batch: the batch is stored, steps 0 and 2
    get their verdicts, step 1 is recorded ``audit_error`` with the exception in its one
    fault, the run is not reported consistent, and the step still reads back. The batched
    pass over clean steps (``clean_columns``) raising too only sends every step to the exact
    engine."""
    run_id = f"contain-{uuid.uuid4().hex[:8]}"
    real = core.audit_step

    def boom(*args, **kwargs):
        raise RuntimeError("synthetic batched-engine bug")

    monkeypatch.setattr(core.batch, "clean_columns", boom)

    def flaky(reports, *args, **kwargs):
        if reports and all(r.local_count == 65.0 or r.local_count == 85.0 for r in reports) and flaky.step == 1:
            raise ZeroDivisionError("synthetic engine bug")
        return real(reports, *args, **kwargs)

    batch = []
    for step in range(3):
        batch += reference_reports(run_id, buggy=False, step=step)
    out = None
    for step in range(3):  # one step per call, so the patched engine knows which one it audits
        flaky.step = step
        monkeypatch.setattr(core, "audit_step", flaky)
        out = service.ingest(_reports([r for r in batch if r["step"] == step]))
        assert out.accepted == 2 and len(out.audited) == 1
    monkeypatch.setattr(core, "audit_step", real)
    rep = service.report(run_id)
    (s,) = rep.statistics
    assert (s.steps_consistent, s.steps_audit_error, s.steps_audited) == (2, 1, 3)
    assert rep.consistent is False and s.faults == {"audit_error": 1}
    (bad,) = s.bad_steps
    assert bad.step == 1 and bad.verdict == "audit_error"
    assert "ZeroDivisionError: synthetic engine bug" in bad.faults[0].message
    assert service.step(run_id, "advantages", 1)[0].verdict == "audit_error"
    (row,) = [r for r in service.metric_series(0.0) if r["run_id"] == run_id]
    assert row["steps"]["audit_error"] == 1 and row["faults"] == {"audit_error": 1}


def test_missing_reports_of_a_huge_step_are_ranges_not_pairs():
    """A step of 65,536 ranks × 4,096 microbatches (2^28 expected reports) holding two
    reports is audited in well under a second: the missing ones are counted and named as
    rank and microbatch ranges, never listed one by one."""
    world, nmb = 65_536, 4096
    reps = [core.RankReport(rank=r, microbatch=mb, dp=r, cp=0, tp=0, pp=0, dtype="float32",
                             local_count=1.0, local_sum=1.0, local_sum_sq=1.0, applied_count=2.0,
                             applied_sum=2.0, applied_sum_sq=2.0)
            for r, mb in ((5, 0), (9, 3))]
    from auditor.contract.models import StatisticSpec

    t0 = time.perf_counter()
    v = core.audit_step(reps, (world, 1, 1, 1), StatisticSpec().to_core(), num_microbatches=nmb)
    assert time.perf_counter() - t0 < 1.0
    (f,) = [f for f in v.faults if f.kind == "missing_report"]
    assert f.evidence == {"missing": world * nmb - 2, "expected": world * nmb, "microbatches": "0-4095"}
    assert f"{world * nmb - 2} of {world * nmb}" in f.message and "ranks 0-65535" in f.message


# ------------------------------------------------------------------ property: never raises
SPECIAL = st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0, 0.0, 1e-300, 3.0e38])
FINITE = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@st.composite
def step_batches(draw) -> list[dict]:
    """Reports of 1–3 steps of one run: a random topology (≤ 8 ranks), kind, spec and dtype;
    each rank's local moments from a few values, with random fields replaced by NaN, ±Inf,
    huge or subnormal values; applied values correct, wrong, missing or null; some ranks and
    microbatches left out, some reports duplicated."""
    sizes = {d: draw(st.integers(1, 2)) for d in ("dp", "cp", "tp", "pp")}
    world = sizes["dp"] * sizes["cp"] * sizes["tp"] * sizes["pp"]
    kind = draw(st.sampled_from(["moments", "sum", "norm"]))
    nmb = draw(st.integers(1, 2))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float64"]))
    spec = draw(st.one_of(st.none(), st.fixed_dictionaries({
        "reduce_over": st.lists(st.sampled_from(["dp", "cp", "tp", "pp"]), unique=True, max_size=4),
        "replicas": st.lists(st.sampled_from(["dp", "cp", "tp", "pp"]), unique=True, max_size=2),
        "variance": st.sampled_from(["sample", "population"]),
        "over_microbatches": st.booleans()})))
    run = f"prop-{uuid.uuid4().hex[:10]}"
    out = []
    for step in range(draw(st.integers(1, 3))):
        for rank in range(world):
            coords, rest = {}, rank
            for d in ("dp", "cp", "tp", "pp"):
                coords[d], rest = rest % sizes[d], rest // sizes[d]
            for mb in range(nmb):
                if draw(st.integers(0, 9)) == 0:
                    continue  # a missing report
                vals = draw(st.lists(FINITE, min_size=0, max_size=4))
                n = float(len(vals))
                local = {"count": n, "sum": math.fsum(vals), "sum_sq": math.fsum(v * v for v in vals)}
                if vals:
                    local.update(min=min(vals), max=max(vals))
                if kind == "norm" and draw(st.booleans()):
                    local["replicated_sum_sq"] = draw(st.floats(0, 1e6))
                for key in list(local):
                    if draw(st.integers(0, 7)) == 0:
                        local[key] = draw(SPECIAL)
                applied = draw(st.one_of(
                    st.none(),
                    st.just({"count": n * world, "sum": local["sum"] * world, "sum_sq": abs(local["sum_sq"]) * world}),
                    st.fixed_dictionaries({"mean": st.one_of(FINITE, SPECIAL), "var": st.one_of(FINITE, SPECIAL)}),
                    st.fixed_dictionaries({"count": st.floats(0, 1e6), "sum": st.one_of(FINITE, SPECIAL),
                                           "sum_sq": st.floats(0, 1e12)}),
                ))
                r = {"run_id": run, "statistic": "s", "step": step, "rank": rank, "world_size": world,
                     "coords": coords, "sizes": sizes, "microbatch": mb, "num_microbatches": nmb,
                     "local": local, "applied": applied, "dtype": dtype, "kind": kind}
                if spec is not None:
                    r["spec"] = spec
                if draw(st.integers(0, 5)) == 0:
                    r["group_ranks"] = sorted(draw(st.sets(st.integers(0, world - 1), min_size=1)))
                out.append(r)
                if draw(st.integers(0, 15)) == 0:
                    out.append(r)  # an identical re-send
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(batch=step_batches())
def test_no_valid_input_makes_ingest_audit_sweep_or_report_raise(service, batch):
    """Whatever valid reports arrive: ingest answers (or raises only ConflictError, a 409),
    the sweep audits what is left, every step gets a verdict of the vocabulary and never
    ``audit_error`` (the engine has no failure mode on valid input), and the report and
    every step read back."""
    reports = []
    for d in batch:
        try:
            reports.append(Report.model_validate(d, strict=True))
        except ValidationError:
            pass  # the wire schema refuses it: a 422, not this property's business
    if not reports:
        return
    try:
        service.ingest(reports)
    except ConflictError:
        return
    service.sweep(grace_seconds=0.0, now=time.time() + 1.0)
    run_id = reports[0].run_id
    rep = service.report(run_id, bad_steps_limit=1000)
    (s,) = rep.statistics
    assert s.steps_pending == 0
    assert s.steps_audit_error == 0, [f for b in s.bad_steps for f in b.faults if f.kind == "audit_error"]
    for step in {r.step for r in reports}:
        assert service.step(run_id, "s", step)[0].verdict in VERDICTS
