"""Verdict latency: time from the last rank's report of a step to the stored verdict.

For each world size, every step's reports except one are POSTed first (in batches of at
most 10,000); then the last rank's report is POSTed alone and the clock runs from just
before that request until its answer. The service audits a step inside the transaction
that completes it, so the answer (``steps_audited == 1``, checked) arrives after the
verdict is committed: the round trip *is* the report-to-stored-verdict latency, HTTP
included. ``--load-clients N`` keeps N other client processes ingesting another run at
full speed meanwhile (latency under load); ``--workers 2`` runs two server processes.

    python benchmarks/audit_latency.py --quick
    python benchmarks/audit_latency.py --backends postgresql --workers 2 --load-clients 2
    AUDITOR_BENCH_PYTHON=/work/wt-before/.venv/bin/python python benchmarks/audit_latency.py  # other code
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    auditor_code, auditor_python, auditor_service, batches, database, encode_batch, load, machine, percentile,
    report_stream, step_reports,
)


def _background(url: str, tag: str, world: int, stop) -> None:
    """Ingest a separate run in batches of 1,000 until ``stop`` is set."""
    step = 0
    with httpx.Client(base_url=url, timeout=600, headers={"content-type": "application/json"}) as http:
        while not stop.is_set():
            for b in batches(report_stream(tag, 10 * world, world, first_step=step), 1000):
                http.post("/v1/reports", content=encode_batch(b)).raise_for_status()
            step += 10


def measure(url: str, world: int, steps: int, run_id: str) -> list[float]:
    lat = []
    with httpx.Client(base_url=url, timeout=600, headers={"content-type": "application/json"}) as http:
        for step in range(steps + 2):  # two warm-up steps
            reps = step_reports(run_id, step, world)
            for b in batches(reps[:-1], 10_000):
                http.post("/v1/reports", content=encode_batch(b)).raise_for_status()
            last = encode_batch(reps[-1:])
            t0 = time.perf_counter()
            r = http.post("/v1/reports", content=last)
            dt = time.perf_counter() - t0
            r.raise_for_status()
            if r.json()["steps_audited"] != 1:
                raise RuntimeError(f"step {step} not audited by its last report: {r.text}")
            if step >= 2:
                lat.append(dt)
    return lat


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20 steps per world size")
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--worlds", default="64,1024,4096")
    ap.add_argument("--steps", type=int, default=100, help="measured steps per world size")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--load-clients", type=int, default=0, help="background ingest clients")
    ap.add_argument("--auditor-python", help="interpreter of the auditor code under test "
                                             "(default $AUDITOR_BENCH_PYTHON, else this one)")
    a = ap.parse_args(argv)
    if a.quick:
        a.steps = 20
    python = auditor_python(a.auditor_python)
    m = machine()
    print(f"machine: {m['nproc']} × {m['cpu']}, load {m['load']}; workers {a.workers}, "
          f"background ingest clients {a.load_clients}")
    print(f"auditor code: {auditor_code(python)}", flush=True)
    rows = []
    for kind in a.backends.split(","):
        with database(kind, "bench_latency") as (url, _), \
                auditor_service(url, workers=a.workers, python=python) as svc:
            ctx = mp.get_context("fork")
            stop = ctx.Event()
            bg = [ctx.Process(target=_background, args=(svc.url, f"bg{i}", 256, stop), daemon=True)
                  for i in range(a.load_clients)]
            for p in bg:
                p.start()
            try:
                for world in map(int, a.worlds.split(",")):
                    ld = load()
                    lat = measure(svc.url, world, a.steps, f"lat-{world}")
                    rows.append((kind, world, len(lat), 1e3 * percentile(lat, 0.5), 1e3 * percentile(lat, 0.99),
                                 1e3 * max(lat), ld))
                    print(f"  {kind:10s} {world:>5} ranks: p50 {rows[-1][3]:.1f} ms  p99 {rows[-1][4]:.1f} ms "
                          f"(load {ld})", flush=True)
            finally:
                stop.set()
                for p in bg:
                    p.join(60)
    print()
    print("| database | ranks/step | steps | p50 ms | p99 ms | max ms | workers | background clients | load |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for kind, world, n, p50, p99, mx, ld in rows:
        print(f"| {kind} | {world:,} | {n} | {p50:.1f} | {p99:.1f} | {mx:.1f} | {a.workers} | {a.load_clients} | {ld} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
