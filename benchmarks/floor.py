"""What a report costs before the audit: the floor under ``benchmarks/ingest.py``'s numbers.

Issue 11 asks for 100,000 reports/s at every step shape from one server process on this
2-core machine. This script measures, with the client of ``ingest.py`` (same bodies, same
process-per-client driver, same HTTP stack), servers that do *less* than ``auditor serve``:

* ``http``: uvicorn with the auditor's own protocol and limits
  (:func:`auditor.server.run.uvicorn_options`), a FastAPI route that reads the body and
  answers ``{"accepted": n, "steps_audited": 0}``, ``n`` counted by a byte search (no
  decoding);
* ``http+decode``: the same route decoding the body with the service's msgspec decoder
  (:func:`auditor.schemas.decode_report_batch`, every wire rule checked) in a worker
  thread, as the service does;
* ``auditor``: the real ``auditor serve`` on a SQLite file (decode, store, audit, verdicts);

and, in this process, the SQLite insert alone: the report rows of the same bodies written by
:meth:`auditor.db.store.Store.insert_all_new` (the service's bulk insert) into a fresh
database, CPU µs per report (``time.thread_time``).

    python benchmarks/floor.py                       # shapes 2 and 1,024, batches of 10,000
    python benchmarks/floor.py --shapes 2,8,1024 --batch 1000 --clients 4

If ``http+decode`` alone is below a target rate, no storage or audit work can reach it in
one process on this machine.
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
    from auditor.schemas import decode_report_batch
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
    from auditor.schemas import decode_report_batch

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="2,1024", help="ranks per step, comma-separated")
    ap.add_argument("--batch", type=int, default=10_000, help="reports per request")
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--reports", type=int, default=200_000, help="reports per case")
    args = ap.parse_args(argv)
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
