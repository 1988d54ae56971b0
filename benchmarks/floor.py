"""What a report costs before the audit: the floor under ``benchmarks/ingest.py``'s numbers.

Issue 11 asks for 100,000 reports/s at every step shape from one server process on this
2-core machine. This script measures, with the client of ``ingest.py`` (same bodies, same
process-per-client driver, same HTTP stack), servers that do *less* than ``auditor serve``:

* ``http``: uvicorn with the auditor's own protocol and limits
  (:func:`auditor.server.run.uvicorn_options`), a FastAPI route that reads the body and
  answers ``{"accepted": n, "steps_audited": 0}``, ``n`` counted by a byte search (no
  decoding);
* ``http+decode``: the same route decoding the body with the service's msgspec decoder
  (:func:`auditor.contract.fast.decode_report_batch`, every wire rule checked) in a worker
  thread, as the service does;
* ``auditor``: the real ``auditor serve`` on a SQLite file (decode, store, audit, verdicts);

and, in this process, the SQLite insert alone: the report rows of the same bodies written by
:meth:`auditor.db.store.Store.insert_all_new` (the service's bulk insert) into a fresh
database, CPU µs per report (``time.thread_time``).

    python benchmarks/floor.py                       # shapes 2 and 1,024, batches of 10,000
    python benchmarks/floor.py --shapes 2,8,1024 --batch 1000 --clients 4

If ``http+decode`` alone is below a target rate, no storage or audit work can reach it in
one process on this machine.

``--step-rows``: instead, what storing a step row costs on each schema revision of
``--revisions`` (default ``0006,head``: before and after the partial sweep indexes of 0007),
on SQLite and PostgreSQL, in this process through the store's own step-row statements: µs
per step row of a 2-rank step inserted with its verdict (``fresh``: one multi-row INSERT per
chunk on SQLite, one INSERT over ``unnest`` per ``--step-batch`` steps on PostgreSQL), and of
a split step (its arrivals' upsert, then its verdict UPDATE). The CPU time of whoever executes
them, commit included: this thread on SQLite, the PostgreSQL backend
(``/proc/PID/schedstat``, ns) on PostgreSQL; the verdict values are prepared outside the
timer and the first 100 steps of each kind (warm-up) are not counted. Every case on a fresh
database of ``--steps`` step rows; the revisions interleaved, ``--repeats`` rounds (the
machine is shared: medians, and the ratio of each round's pair)::

    python benchmarks/floor.py --step-rows --repeats 5
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import (  # noqa: E402
    Service, auditor_service, batches, database, encode_batch, free_port, load, machine, report_stream,
)
from ingest import drive, per_client  # noqa: E402

_APP = textwrap.dedent('''
    import sys, uvicorn
    from fastapi import FastAPI, Request
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import Response
    from auditor.config import Settings
    from auditor.contract.fast import decode_report_batch
    from auditor.server.run import uvicorn_options

    mode, port = sys.argv[1], int(sys.argv[2])
    app = FastAPI()

    def count(body: bytes) -> int:
        if mode == "http":
            return body.count(b'"run_id"')
        return len(decode_report_batch(body))

    @app.get("/healthz")
    def healthz():
        return {"status": "ok"}

    @app.post("/v1/reports")
    async def reports(request: Request):
        n = await run_in_threadpool(count, await request.body())
        return Response(b'{"accepted":%d,"steps_audited":0}' % n, media_type="application/json")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", **uvicorn_options(Settings()))
''')


def stub(mode: str) -> Service:
    port = free_port()
    script = Path(tempfile.mkstemp(prefix="auditor-floor-", suffix=".py")[1])
    script.write_text(_APP)
    return Service([sys.executable, str(script), mode, str(port)], f"http://127.0.0.1:{port}", "/healthz")


def insert_us(bodies: list[bytes]) -> float:
    """CPU µs per report of :meth:`Store.insert_all_new` of the bodies' rows, fresh SQLite file."""
    from auditor.db import tables
    from auditor.db.engine import make_engine, upgrade
    from auditor.db.store import Store, report_row
    from auditor.contract.fast import decode_report_batch

    with tempfile.TemporaryDirectory() as d:
        url = f"sqlite:///{d}/floor.sqlite"
        upgrade(url)
        engine = make_engine(url)
        store = Store(engine)
        cpu = n = 0
        with engine.begin() as conn:
            conn.execute(tables.runs.insert().values(run_id="floor", world_size=1, dp=1, cp=1, tp=1, pp=1,
                                                     created_at=0.0))
            sid = conn.execute(tables.series.insert().values(run_id="floor", statistic="advantages", kind="moments",
                                                             spec={}, created_at=0.0, updated_at=0.0)
                               .returning(tables.series.c.id)).scalar()
        for body in bodies:
            rows = sorted(report_row(r, sid, 0.0) for r in decode_report_batch(body))
            with engine.begin() as conn:
                t0 = time.thread_time()
                assert store.insert_all_new(conn, rows)
                cpu += time.thread_time() - t0
            n += len(rows)
        engine.dispose()
    return 1e6 * cpu / n


def _cpu_ns(conn) -> Callable[[], int]:
    """A clock of the CPU time (ns) that executes ``conn``'s statements: the PostgreSQL
    backend's (Linux ``/proc/PID/schedstat``), or this thread's (SQLite)."""
    if conn.dialect.name != "postgresql":
        return time.thread_time_ns
    stat = Path(f"/proc/{conn.exec_driver_sql('SELECT pg_backend_pid()').scalar()}/schedstat")
    return lambda: int(stat.read_text().split()[0])


def step_rows_us(kind: str, revision: str, steps: int, batch: int) -> dict[str, float]:
    """µs per step row of the store's step-row statements on a fresh ``kind`` database
    migrated to ``revision``: ``{"fresh": ..., "split": ...}`` (``--step-rows`` in the module
    docstring). ``steps`` rows of each kind, one transaction per ``batch`` steps."""
    from auditor import core
    from auditor.db.engine import make_engine, upgrade
    from auditor.db.store import Store, VerdictItem

    verdict = core.StepVerdict("consistent", [], [], [core.GroupStat((0,), 0, [], 2.0, 0.5, 1.25)], 0.1, 0.2, 0.01)
    out = {"fresh": 0.0, "split": 0.0}
    with database(kind, "steprows") as (url, _):
        upgrade(url, revision)
        engine = make_engine(url)
        store = Store(engine)
        pg = store.dialect == "postgresql"
        with store.write() as conn:
            store.ensure_run(conn, "steprows", 2, (1, 2, 1, 1), 0.0)
            sid = store.ensure_series(conn, "steprows", "advantages", "moments", {}, 0.0).id
        # the first 100 steps of each kind warm the connection up (catalogs, plans): not timed
        for path, first in (("fresh", 0), ("split", steps + 100)):
            for start in [first] + list(range(first + 100, first + 100 + steps, batch)):
                end = first + 100 if start == first else min(start + batch, first + 100 + steps)
                keys = [(sid, st) for st in range(start, end)]
                items = [VerdictItem(sid, st, verdict, fresh=path == "fresh", expected=2, received=2) for _, st in keys]
                order, won = list(range(len(items))), [False] * len(items)
                values = {i: store._verdict_values(it) for i, it in enumerate(items)}
                with store.write() as conn:
                    cpu = _cpu_ns(conn)
                    t0 = cpu()
                    cur = conn.connection.driver_connection.cursor()
                    if path == "split":
                        store.count_arrivals(conn, dict.fromkeys(keys, 2), dict.fromkeys(keys, 2), 1.0)
                    if pg:
                        store._pg_step_rows(cur, items, order, values, 2.0, won)
                    else:
                        store._sqlite_step_rows(conn, cur, items, order, values, 2.0, won)
                    cur.close()
                if start != first:  # the commit included
                    out[path] += cpu() - t0
                assert all(won), f"{path}: {won.count(False)} step rows not written"
        engine.dispose()
    return {k: v / 1e3 / steps for k, v in out.items()}


def step_rows_main(args) -> int:
    """``--step-rows``: the table of :func:`step_rows_us`, revisions interleaved."""
    import statistics

    revisions = args.revisions.split(",")
    kinds = args.backends.split(",")
    got: dict[tuple[str, str], list[dict]] = {(k, r): [] for k in kinds for r in revisions}
    loads: dict[str, list[str]] = {k: [] for k in kinds}
    for rnd in range(args.repeats):
        for kind in kinds:
            for rev in (revisions if rnd % 2 == 0 else revisions[::-1]):
                loads[kind].append(load().split()[0])
                us = step_rows_us(kind, rev, args.steps, args.step_batch)
                got[(kind, rev)].append(us)
                print(f"  round {rnd + 1} {kind:<10} {rev:<5} fresh {us['fresh']:6.2f} split {us['split']:6.2f} "
                      f"µs/row (load {load()})", file=sys.stderr)
    print(f"\n# step rows: {args.steps:,} of each kind per case, {args.step_batch:,} per transaction, "
          f"{args.repeats} rounds; median µs/row (min-max); SQLite: this thread's CPU, PostgreSQL: the backend's")
    print("| database | revision | inserted with the verdict | split (arrivals + verdict UPDATE) | load (1 min) |")
    print("|---|---|---:|---:|---|")
    for kind in kinds:
        for rev in revisions:
            cells = []
            for path in ("fresh", "split"):
                xs = [u[path] for u in got[(kind, rev)]]
                cells.append(f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})")
            print(f"| {kind} | {rev} | {' | '.join(cells)} | {min(loads[kind])}-{max(loads[kind])} |")
        if len(revisions) == 2:
            a, b = (got[(kind, r)] for r in revisions)
            ratios = [statistics.median(y[p] / x[p] for x, y in zip(a, b)) for p in ("fresh", "split")]
            print(f"| {kind} | {revisions[1]} / {revisions[0]}, median of the rounds' ratios | "
                  f"{ratios[0]:.3f} | {ratios[1]:.3f} | |")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="2,1024", help="ranks per step, comma-separated")
    ap.add_argument("--batch", type=int, default=10_000, help="reports per request")
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--reports", type=int, default=200_000, help="reports per case")
    ap.add_argument("--step-rows", action="store_true",
                    help="only the cost of a step row per schema revision (module docstring)")
    ap.add_argument("--revisions", default="0006,head", help="--step-rows: schema revisions to compare")
    ap.add_argument("--backends", default="sqlite,postgresql", help="--step-rows: databases")
    ap.add_argument("--steps", type=int, default=150_000, help="--step-rows: step rows of each kind per case")
    ap.add_argument("--step-batch", type=int, default=5_000, help="--step-rows: steps per transaction")
    ap.add_argument("--repeats", type=int, default=5, help="--step-rows: rounds")
    args = ap.parse_args(argv)
    if args.step_rows:
        return step_rows_main(args)
    m = machine()
    print(f"# {m['nproc']} CPUs, {m['cpu']}; batches of {args.batch:,}, {args.clients} client(s), "
          f"{args.reports:,} reports per case")
    rows = []
    for world in [int(s) for s in args.shapes.split(",")]:
        per = per_client(args.reports, args.clients, world)
        bodies = [[encode_batch(b) for b in batches(report_stream(f"floor-{world}-{i}", per, world), args.batch)]
                  for i in range(args.clients)]
        rates = {}
        for mode in ("http", "http+decode", "auditor"):
            with database("sqlite", "floor") as (url, _):
                svc = auditor_service(url) if mode == "auditor" else stub(mode)
                with svc:
                    ld = load()
                    r = drive(svc.url, "/v1/reports", bodies, svc.proc.pid)
                    if r["accepted"] != per * args.clients:
                        raise RuntimeError(f"{mode}: {r['accepted']} of {per * args.clients} reports")
                    rates[mode] = (r["accepted"] / r["seconds"], 1e6 * r["cpu"] / r["accepted"], ld)
            print(f"  {world:>5} ranks/step {mode:<12} {rates[mode][0]:>10,.0f} reports/s "
                  f"{rates[mode][1]:6.1f} server µs/report (load {ld})", file=sys.stderr)
        ins = insert_us(bodies[0])
        rows.append((world, rates, ins))
    print()
    print("| ranks/step | HTTP only: reports/s | server µs/report | HTTP + decode: reports/s | server µs/report "
          "| auditor serve: reports/s | server µs/report | SQLite insert alone µs/report | load |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for world, rates, ins in rows:
        cells = " | ".join(f"{rates[k][0]:,.0f} | {rates[k][1]:.1f}" for k in ("http", "http+decode", "auditor"))
        print(f"| {world:,} | {cells} | {ins:.1f} | {rates['auditor'][2]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
