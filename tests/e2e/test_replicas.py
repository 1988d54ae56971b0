"""Several replicas, one truth: two `auditor serve` processes on one PostgreSQL database give
exactly the verdicts one process gives, and concurrent replicas start up on an empty database.

Reports are synthetic but realistic: a 16-rank job (dp=2 × cp=4 × tp=2) whitening advantages,
with steps that are correct, reduced over the DP group without CP (the reference bug),
skip the collective on one rank, sum the TP replicas, carry a NaN, or lose reports (audited
by the sweep after the grace period).
"""

from __future__ import annotations

import json
import math
import queue
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import sqlalchemy as sa

from auditor.core import stats
from auditor.db.engine import head_revision, make_engine
from auditor.db.tables import faults, series, step_audits
from auditor.testing.postgres import database
from auditor.testing.server import ServerProcess

SIZES = {"dp": 2, "cp": 4, "tp": 2, "pp": 1}
WORLD = 16
STEPS = 200
CLIENTS = 8
#: Long enough for every complete step to get all its reports before the sweep looks at it
#: (the whole ingest takes a few seconds), short enough to keep the test quick.
GRACE_SECONDS = 8.0
SWEEP_INTERVAL = 0.2
WINDOW = 40
STATISTIC = "advantages"
#: Step kinds and their weights.
KINDS = {"ok": 60, "wrong_group": 10, "skipped": 6, "overcount": 6, "nan": 6, "missing": 8, "missing_bug": 4}


def coords_of(rank: int) -> dict[str, int]:
    """Megatron order: tp fastest, then cp, then dp."""
    tp, rest = rank % SIZES["tp"], rank // SIZES["tp"]
    cp, dp = rest % SIZES["cp"], rest // SIZES["cp"]
    return {"dp": dp, "cp": cp, "tp": tp, "pp": 0}


def _applied(count: float, total: float, total_sq: float) -> dict:
    mean, var = stats.one_pass_mean_var(count, total, total_sq)
    return {"count": count, "sum": total, "sum_sq": total_sq, "mean": mean, "var": var}


def step_reports(run_id: str, step: int, kind: str, rng: random.Random) -> list[dict]:
    """The 16 reports of one step of the given kind (``missing*`` drop 1–3 of them)."""
    local = {}
    for dp in range(SIZES["dp"]):
        for cp in range(SIZES["cp"]):
            n = float(rng.randint(20, 400))
            mu, sd = rng.uniform(-1, 1), rng.uniform(0.5, 2.0)
            local[(dp, cp)] = (n, n * mu, n * (sd * sd + mu * mu))

    def total(keys) -> tuple[float, float, float]:
        ms = [local[k] for k in keys]
        return tuple(math.fsum(m[i] for m in ms) for i in range(3))

    out = []
    for rank in range(WORLD):
        c = coords_of(rank)
        n, s, ss = local[(c["dp"], c["cp"])]
        if kind in ("wrong_group", "missing_bug"):  # reduced over dp only: CP excluded
            applied = _applied(*total([(d, c["cp"]) for d in range(SIZES["dp"])]))
        elif kind == "overcount":  # TP replicas summed too: every datum counted twice
            applied = _applied(*(2 * x for x in total(local)))
        else:
            applied = _applied(*total(local))
        out.append({
            "run_id": run_id, "statistic": STATISTIC, "step": step, "rank": rank, "world_size": WORLD,
            "coords": c, "sizes": SIZES, "local": {"count": n, "sum": s, "sum_sq": ss},
            "applied": applied, "dtype": "float32",
        })
    if kind == "skipped":
        out[rng.randrange(WORLD)]["applied"] = None
    elif kind == "nan":
        out[rng.randrange(WORLD)]["applied"]["mean"] = math.nan
    elif kind.startswith("missing"):
        for r in sorted(rng.sample(range(WORLD), rng.randint(1, 3)), reverse=True):
            del out[r]
    return out


def make_run(run_id: str, seed: int) -> tuple[dict[int, str], list[dict]]:
    """(kind of each step, all reports); every step kind occurs at least 4 times."""
    rng = random.Random(seed)
    kinds = [k for k, w in KINDS.items() for _ in range(4)]
    kinds += rng.choices(list(KINDS), weights=list(KINDS.values()), k=STEPS - len(kinds))
    rng.shuffle(kinds)
    by_step = dict(enumerate(kinds))
    reports = [r for step, k in by_step.items() for r in step_reports(run_id, step, k, rng)]
    return by_step, reports


def _post(http: httpx.Client, url: str, batch: list[dict]) -> dict:
    # json.dumps writes NaN as the bare token NaN, which the service accepts (non_finite).
    r = http.post(f"{url}/v1/reports", content=json.dumps({"reports": batch}),
                  headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code == 200, f"{url}: {r.status_code} {r.text[:2000]}"
    return r.json()


def verdicts(database_url: str, run_id: str) -> dict[int, dict]:
    """Every recorded verdict of the run, straight from the database: per step the verdict,
    fault kinds, both sigma figures, report counts and the fault rows (kind, ranks, message)."""
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            sid = conn.execute(sa.select(series.c.id).where(series.c.run_id == run_id)).scalar_one()
            rows = conn.execute(sa.select(step_audits).where(step_audits.c.series_id == sid)).mappings().all()
            frows = conn.execute(
                sa.select(faults.c.step, faults.c.kind, faults.c.ranks, faults.c.message)
                .where(faults.c.series_id == sid).order_by(faults.c.step, faults.c.kind, faults.c.ranks)
            ).all()
            srow = conn.execute(sa.select(series).where(series.c.id == sid)).mappings().one()
    finally:
        engine.dispose()
    by_step: dict[int, list] = {}
    for f in frows:
        by_step.setdefault(f.step, []).append((f.kind, f.ranks, f.message))
    out = {
        r["step"]: {
            "verdict": r["verdict"], "fault_kinds": r["fault_kinds"],
            "cp_disagreement_sigma": r["cp_disagreement_sigma"], "applied_error_sigma": r["applied_error_sigma"],
            "received": r["received"], "expected": r["expected"], "faults": by_step.get(r["step"], []),
        }
        for r in rows
    }
    out["_series"] = {k: srow[k] for k in ("steps_consistent", "steps_inconsistent", "steps_incomplete",
                                          "first_bad_step", "last_bad_step", "last_audited_step")}
    return out


def wait_all_audited(database_url: str, run_id: str, n: int, timeout: float) -> dict[int, dict]:
    deadline = time.monotonic() + timeout
    while True:
        got = verdicts(database_url, run_id)
        if sum(1 for k, v in got.items() if k != "_series" and v["verdict"] is not None) >= n:
            return got
        if time.monotonic() > deadline:
            pending = sorted(k for k, v in got.items() if k != "_series" and v["verdict"] is None)
            raise AssertionError(f"{len(pending)} step(s) still unaudited after {timeout} s: {pending[:20]}")
        time.sleep(0.5)


def metric_lines(url: str, run_id: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if f'run="{run_id}"' in ln and not ln.startswith("#")}


@pytest.fixture
def servers(tmp_path):
    """Factory of `auditor serve` processes (grace 8 s, sweep every 0.2 s); all stopped at the end."""
    started: list[ServerProcess] = []

    def make(database_url: str, name: str) -> ServerProcess:
        s = ServerProcess(database_url, tmp_path / f"{name}.log",
                          AUDITOR_GRACE_SECONDS=str(GRACE_SECONDS),
                          AUDITOR_SWEEP_INTERVAL_SECONDS=str(SWEEP_INTERVAL))
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(reference database, shared database, the reference process on the first, two replicas
    on the second), started once for every seed (grace 8 s, sweep every 0.2 s): each seed
    posts its own run id, whose verdicts, counters and metric series are its own."""
    logs = tmp_path_factory.mktemp("replicas")
    with database("auditor_test_ref") as ref_db, database("auditor_test_shared") as shared_db:
        procs = [ServerProcess(db, logs / f"{name}.log", AUDITOR_GRACE_SECONDS=str(GRACE_SECONDS),
                               AUDITOR_SWEEP_INTERVAL_SECONDS=str(SWEEP_INTERVAL))
                 for db, name in ((ref_db, "reference"), (shared_db, "replica0"), (shared_db, "replica1"))]
        try:
            with ThreadPoolExecutor(3) as pool:
                list(pool.map(lambda s: s.start(), procs))
            yield ref_db, shared_db, procs[0], procs[1:]
        finally:
            for s in procs:
                s.stop()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_two_replicas_give_the_single_process_verdicts(cluster, seed):
    """2 replicas on one PostgreSQL database; 8 concurrent clients post the 3200 reports of
    200 steps × 16 ranks, shuffled (within windows of 40 steps) and cut into random batches
    (1–48 reports), each batch to a random replica. Exactly 200 verdicts are recorded, each identical (verdict,
    fault kinds, both sigma values, fault rows with ranks and messages, report counts) to the
    verdict one process gives for the same reports posted in step order; incomplete steps
    are audited once by the sweeps both replicas run. The per-series counters, the fault
    table and both replicas' /metrics agree with those 200 verdicts (nothing audited twice),
    and no request fails (no deadlock, no 503)."""
    run_id = f"replicas-{seed}"
    kinds, reports = make_run(run_id, seed)
    complete_steps = {s for s, k in kinds.items() if not k.startswith("missing")}
    rng = random.Random(1000 + seed)

    ref_db, shared_db, reference, replicas = cluster

    # Reference: one process, one client, reports in step order.
    errors: list[BaseException] = []

    def post_reference() -> None:
        try:
            with httpx.Client() as http:
                for i in range(0, len(reports), 64):
                    _post(http, reference.url, reports[i:i + 64])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ref_thread = threading.Thread(target=post_reference)
    ref_thread.start()

    # Replicas: reports shuffled within windows of WINDOW steps (so a step's reports arrive
    # within a fraction of the grace period even on a loaded machine), random batch sizes,
    # random replica per batch, 8 clients taking batches from one queue.
    shuffled = []
    for w in range(0, STEPS, WINDOW):
        window = [r for r in reports if w <= r["step"] < w + WINDOW]
        rng.shuffle(window)
        shuffled += window
    work: queue.Queue = queue.Queue()
    i = 0
    while i < len(shuffled):
        n = rng.randint(1, 48)
        work.put((rng.randrange(2), shuffled[i:i + n]))
        i += n
    accepted = [0] * CLIENTS
    audited_by_ingest = [0] * CLIENTS

    def client(c: int) -> None:
        try:
            with httpx.Client() as http:
                while True:
                    try:
                        replica, batch = work.get_nowait()
                    except queue.Empty:
                        return
                    out = _post(http, replicas[replica].url, batch)
                    accepted[c] += out["accepted"]
                    audited_by_ingest[c] += out["steps_audited"]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    ingest_seconds = time.monotonic() - t0
    ref_thread.join(120)
    assert not errors, errors[0]
    assert sum(accepted) == len(reports)
    assert ingest_seconds < 5 * GRACE_SECONDS, f"ingest took {ingest_seconds:.1f} s"
    # Every complete step is audited by the ingest transaction that completed it, once.
    assert sum(audited_by_ingest) == len(complete_steps)

    expected = wait_all_audited(ref_db, run_id, STEPS, timeout=GRACE_SECONDS + 30)
    got = wait_all_audited(shared_db, run_id, STEPS, timeout=GRACE_SECONDS + 30)

    steps = sorted(k for k in got if k != "_series")
    assert steps == list(range(STEPS))
    assert sum(1 for s in steps if got[s]["verdict"] is not None) == STEPS
    mismatches = {s: (got[s], expected[s]) for s in steps if got[s] != expected[s]}
    assert not mismatches, f"{len(mismatches)} step(s) differ from the single process, e.g. {next(iter(mismatches.items()))}"

    # The verdicts are the ones the step kinds call for.
    for s in steps:
        v, k = got[s], kinds[s]
        fk = set((v["fault_kinds"] or "").split(",")) - {""}
        if k == "ok":
            assert (v["verdict"], fk) == ("consistent", set()), (s, v)
        elif k == "wrong_group":
            assert v["verdict"] == "inconsistent" and {"cp_disagreement", "wrong_group"} <= fk, (s, v)
            assert v["cp_disagreement_sigma"] > 0.01
        elif k == "skipped":
            assert v["verdict"] == "inconsistent" and "skipped_collective" in fk, (s, v)
        elif k == "overcount":
            assert v["verdict"] == "inconsistent" and "replica_overcount" in fk, (s, v)
        elif k == "nan":
            assert v["verdict"] == "inconsistent" and "non_finite" in fk, (s, v)
        elif k == "missing":
            assert (v["verdict"], fk) == ("incomplete", {"missing_report"}), (s, v)
            assert v["received"] < v["expected"] == WORLD
        else:  # missing_bug: the sweep audits what arrived (how far the engine diagnoses an
            # incomplete step is the engine's business; the equality above pins it)
            assert v["verdict"] != "consistent" and "missing_report" in fk, (s, v)
            assert v["received"] < v["expected"] == WORLD

    # Aggregates: each verdict counted once, whichever replica (or sweep) recorded it.
    counts = {verdict: sum(1 for s in steps if got[s]["verdict"] == verdict)
              for verdict in ("consistent", "inconsistent", "incomplete")}
    assert got["_series"] == expected["_series"]
    assert (got["_series"]["steps_consistent"], got["_series"]["steps_inconsistent"],
            got["_series"]["steps_incomplete"]) == (counts["consistent"], counts["inconsistent"], counts["incomplete"])
    assert sum(counts.values()) == STEPS
    assert got["_series"]["last_audited_step"] == STEPS - 1
    fault_kind_totals: dict[str, int] = {}
    for s in steps:
        for kind, _, _ in got[s]["faults"]:
            fault_kind_totals[kind] = fault_kind_totals.get(kind, 0) + 1
    per_replica = [metric_lines(r.url, run_id) for r in replicas]
    assert per_replica[0] == per_replica[1]
    m = per_replica[0]
    for verdict, n in counts.items():
        assert m[f'auditor_steps_audited_total{{run="{run_id}",statistic="{STATISTIC}",verdict="{verdict}"}}'] == n
    for kind, n in fault_kind_totals.items():
        assert m[f'auditor_faults_total{{kind="{kind}",run="{run_id}",statistic="{STATISTIC}"}}'] == n
    assert m[f'auditor_last_audited_step{{run="{run_id}",statistic="{STATISTIC}"}}'] == STEPS - 1


def test_replicas_starting_at_once_migrate_an_empty_database_once(pg_databases, servers):
    """3 replicas started at the same moment on an empty PostgreSQL database all come up
    healthy (the Alembic upgrade runs under a PostgreSQL advisory lock, so only the first
    migrates and the others find the schema at head), the schema is at head with exactly one
    alembic_version row, and every replica serves the same data."""
    db = pg_databases("migrate")
    procs = [servers(db, f"start{i}") for i in range(3)]
    barrier = threading.Barrier(3)

    def start(s: ServerProcess) -> None:
        barrier.wait()
        s.start()

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(start, procs))
    for s in procs:
        h = s.get("/healthz").json()
        assert h["status"] == "ok" and h["schema_revision"] == head_revision()
    engine = make_engine(db)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all() == [head_revision()]
    finally:
        engine.dispose()
    _, reports = make_run("startup", 7)
    with httpx.Client() as http:
        _post(http, procs[0].url, [r for r in reports if r["step"] == 0])
    runs = [s.get("/v1/runs").json()["runs"] for s in procs]
    assert runs[0] == runs[1] == runs[2] and runs[0][0]["run_id"] == "startup"

