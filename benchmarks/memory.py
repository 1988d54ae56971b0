"""Server memory over a long ingest: ``--reports`` (default 10,000,000) wire reports of a
correct run sent over HTTP by ``--clients`` client processes into one real ``auditor serve``
on a SQLite file (or ``--backend postgresql``), while the server's resident set size (RSS,
``/proc/<pid>/status`` ``VmRSS``, summed over its process tree) is sampled every
``--interval`` seconds.

Each client sends its own run (``--world`` ranks per step, dp × cp = world/2 × 2) in batches
of ``--batch-size`` reports, each step audited in the transaction that completes it; 503s
are retried after ``Retry-After`` and counted. Reports are encoded from a few templates of
steps (``_common.step_reports``) with the step number spliced in, so the clients spend
little CPU next to the server on a 2-core machine. Prints the RSS at 0/25/50/75/100 % of the
reports stored (with the elapsed time and the load average), the peak, the database size,
and checks afterwards that every step of every run was audited.

    python benchmarks/memory.py                                  # 10 M reports, 4 clients
    python benchmarks/memory.py --reports 1000000 --clients 2    # a quick look
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    auditor_code, auditor_python, auditor_service, database, database_bytes, load, machine, post_retrying_busy, rss_kib,
    step_reports, tree_pids,
)

#: Steps of distinct values a client cycles through (consecutive steps differ).
PERIOD = 7


def _step_templates(run_id: str, world: int) -> list[list[tuple[bytes, bytes]]]:
    """Per step ``k`` < :data:`PERIOD`: each rank's encoded report split around its step number."""
    out = []
    for k in range(PERIOD):
        reps = []
        for r in step_reports(run_id, k, world):
            line = json.dumps(r, separators=(",", ":")).encode()
            head, tail = line.split(b'"step":%d,' % k)
            reps.append((head + b'"step":', b"," + tail))
        out.append(reps)
    return out


def _bodies(run_id: str, n: int, world: int, batch: int):
    """``n`` reports of consecutive steps (whole steps), as request bodies of ``batch`` reports."""
    templates = _step_templates(run_id, world)
    lines: list[bytes] = []
    step = 0
    while step * world < n:
        for head, tail in templates[step % PERIOD]:
            lines.append(head + str(step).encode() + tail)
            if len(lines) == batch:
                yield b'{"reports":[' + b",".join(lines) + b"]}", len(lines)
                lines = []
        step += 1
    if lines:
        yield b'{"reports":[' + b",".join(lines) + b"]}", len(lines)


def _client(url: str, run_id: str, n: int, world: int, batch: int, start, stored, out) -> None:
    try:
        busy = 0
        with httpx.Client(base_url=url, timeout=600, headers={"content-type": "application/json"}) as http:
            start.wait()
            for body, k in _bodies(run_id, n, world, batch):
                r, waited = post_retrying_busy(http, "/v1/reports", body)
                busy += waited
                if r.status_code != 200:
                    out.put(("error", f"{r.status_code} {r.text[:300]}"))
                    return
                with stored.get_lock():
                    stored.value += r.json()["accepted"]
        out.put(("ok", busy))
    except Exception as e:  # noqa: BLE001 - reported by the parent
        out.put(("error", f"{type(e).__name__}: {e}"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reports", type=int, default=10_000_000)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--world", type=int, default=256, help="ranks per step")
    ap.add_argument("--batch-size", type=int, default=10_000, help="reports per request (10,000: the most in flight)")
    ap.add_argument("--backend", default="sqlite", choices=["sqlite", "postgresql"])
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between RSS samples")
    ap.add_argument("--auditor-python", help="interpreter of the auditor code under test")
    a = ap.parse_args(argv)
    python = auditor_python(a.auditor_python)
    m = machine()
    print(f"machine: {m['nproc']} × {m['cpu']}, Python {m['python']}, load {m['load']}")
    print(f"auditor code: {auditor_code(python)}", flush=True)
    per = -(-a.reports // (a.clients * a.world)) * a.world  # whole steps per client
    total = per * a.clients
    ctx = mp.get_context("fork")
    with database(a.backend, "bench_memory") as (url, where), auditor_service(url, python=python) as svc:
        pids = tree_pids(svc.proc.pid)
        start, out, stored = ctx.Event(), ctx.Queue(), ctx.Value("q", 0)
        runs = [f"memory-{i}" for i in range(a.clients)]
        procs = [ctx.Process(target=_client, args=(svc.url, run, per, a.world, a.batch_size, start, stored, out))
                 for run in runs]
        for p in procs:
            p.start()
        time.sleep(0.5)
        samples: list[tuple[float, int, int]] = []  # (elapsed s, reports stored, server RSS KiB)
        done = threading.Event()
        t0 = time.perf_counter()

        def sample() -> None:
            while True:
                samples.append((time.perf_counter() - t0, stored.value, sum(rss_kib(p) for p in pids)))
                if done.wait(a.interval):
                    samples.append((time.perf_counter() - t0, stored.value, sum(rss_kib(p) for p in pids)))
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        load0 = load()
        marks = {}
        start.set()
        next_report = time.monotonic() + 60
        results = []
        while len(results) < len(procs):
            try:
                results.append(out.get(timeout=1))
            except Exception:  # noqa: BLE001 - queue.Empty: report progress now and then
                pass
            if time.monotonic() > next_report:
                el, st, rss = samples[-1]
                print(f"  {st:,} of {total:,} reports stored after {el:.0f} s, server RSS {rss / 1024:,.0f} MiB "
                      f"(load {load()})", flush=True)
                next_report += 60
            for q in (0.25, 0.5, 0.75):
                if q not in marks and stored.value >= q * total:
                    marks[q] = load()
        elapsed = time.perf_counter() - t0
        done.set()
        sampler.join()
        for p in procs:
            p.join(30)
        errors = [r[1] for r in results if r[0] == "error"]
        if errors:
            raise RuntimeError(errors[0])
        busy = sum(r[1] for r in results)
        audited = sum(httpx.get(f"{svc.url}/v1/runs/{run}", timeout=120).json()["steps_audited"] for run in runs)
        db_mib = database_bytes(a.backend, where) / 2**20
        load1 = load()

    if stored.value != total or audited != total // a.world:
        raise RuntimeError(f"stored {stored.value:,} of {total:,} reports, audited {audited:,} of "
                           f"{total // a.world:,} steps")
    print(f"\n{total:,} reports ({a.clients} clients × {per:,}; {a.world} ranks per step, batches of "
          f"{a.batch_size:,}) into `auditor serve` on {a.backend} in {elapsed:,.0f} s ({total / elapsed:,.0f} "
          f"reports/s); {audited:,} steps audited; {busy} 503s retried; database {db_mib:,.0f} MiB\n")
    print("| share | reports stored | elapsed s | server RSS MiB | load (1/5/15 min) |")
    print("|---:|---:|---:|---:|---|")
    for q in (0.0, 0.25, 0.5, 0.75, 1.0):
        el, st, rss = next((s for s in samples if s[1] >= q * total), samples[-1])
        ld = load0 if q == 0 else load1 if q == 1 else marks.get(q, "?")
        print(f"| {q:.0%} | {st:,} | {el:,.0f} | {rss / 1024:,.0f} | {ld} |")
    peak = max(samples, key=lambda s: s[2])
    print(f"\npeak server RSS {peak[2] / 1024:,.0f} MiB at {peak[1]:,} reports ({peak[0]:,.0f} s); "
          f"{len(samples)} samples every {a.interval} s; load after {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
