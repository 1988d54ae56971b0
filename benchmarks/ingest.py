"""Ingest throughput at every step shape: reports/s into a real ``auditor serve`` process over
HTTP, next to MLflow in the same run.

For each database kind (SQLite file, PostgreSQL), step shape (``--shapes``: ranks per step,
dp × cp = ranks/2 × 2), client count and batch size, client processes POST pre-encoded
``{"reports": [...]}`` bodies of a *correct* run as fast as the service answers. Steps
complete as their ranks report, so every step is audited inside the ingest transaction
(audit on). Each client process sends its own run of whole steps (the volume per client is
rounded up to a whole number of steps). Throughput = reports stored / wall time from the
first request to the last answer; "server µs/report" is the CPU time of the server's
process tree (the database server's own processes not counted) per stored report. A 503
(database busy, e.g. SQLite's write lock held past its busy timeout) is retried after its
``Retry-After`` and counted.

The same volume then goes to an ``mlflow server`` (default server and workers) on the same
database kind as MLflow ``log-batch`` requests, one metric per report (the applied mean,
key ``<statistic>/rank<rank>``, at the report's step) or, with
``--mlflow-metrics-per-report 10``, each of a report's ten numbers as its own metric; at
most 1,000 metrics per request (MLflow's limit). Bodies are encoded before the clock starts
for both services; warm-up requests go first to both.

    python benchmarks/ingest.py --quick                 # small volume, every shape
    python benchmarks/ingest.py --shapes 2,8,64,1024,4096   # the issue-11 matrix
    python benchmarks/ingest.py --shapes 256 --backends postgresql --workers 2 --no-mlflow
    AUDITOR_BENCH_PYTHON=/work/wt-before/.venv/bin/python python benchmarks/ingest.py ...  # other code

The last table is the shapes matrix: reports/s per (database, clients, batch) and shape,
with the slowest shape over the fastest and the smallest auditor/MLflow ratio of the row.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    auditor_code, auditor_python, auditor_service, batches, cpu_seconds, database, encode_batch, load, machine,
    mlflow_batches, mlflow_service, post_retrying_busy, report_stream, rss_kib, tree_pids,
)


def _client(url: str, path: str, bodies: list[bytes], start, out) -> None:
    with httpx.Client(base_url=url, timeout=600, headers={"content-type": "application/json"}) as http:
        start.wait()
        t0 = time.perf_counter()
        accepted = audited = busy = 0
        for b in bodies:
            r, waited = post_retrying_busy(http, path, b)
            busy += waited
            if r.status_code != 200:
                out.put(("error", f"{r.status_code} {r.text[:300]}"))
                return
            if path == "/v1/reports":
                j = r.json()
                accepted += j["accepted"]
                audited += j["steps_audited"]
        out.put(("ok", t0, time.perf_counter(), accepted, audited, busy))


def drive(url: str, path: str, per_client: list[list[bytes]], server_pid: int | None = None) -> dict:
    """Send each client's bodies from its own process; return wall seconds, totals, 503s and
    the CPU seconds the server process tree used meanwhile (database processes not included)."""
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(url, path, b, start, out)) for b in per_client]
    for p in procs:
        p.start()
    time.sleep(0.3)
    pids = tree_pids(server_pid) if server_pid else []
    cpu0 = cpu_seconds(pids)
    start.set()
    res = [out.get(timeout=7200) for _ in procs]
    cpu = cpu_seconds(pids) - cpu0
    for p in procs:
        p.join(30)
    errors = [r[1] for r in res if r[0] == "error"]
    if errors:
        raise RuntimeError(f"{path}: {errors[0]}")
    t0 = min(r[1] for r in res)
    t1 = max(r[2] for r in res)
    return {"seconds": t1 - t0, "accepted": sum(r[3] for r in res), "audited": sum(r[4] for r in res),
            "busy": sum(r[5] for r in res), "cpu": cpu}


class RssSampler:
    """Samples the peak and last RSS of a set of processes every 0.2 s."""

    def __init__(self, pids: list[int]):
        self.pids, self.samples, self._stop = pids, [], threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(sum(rss_kib(p) for p in self.pids))
            time.sleep(0.2)

    def __enter__(self) -> "RssSampler":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def per_client(n: int, clients: int, world: int) -> int:
    """Reports per client: ``n / clients`` rounded up to whole steps of ``world`` ranks."""
    steps = max(1, -(-n // (clients * world)))
    return steps * world


def auditor_case(url: str, tag: str, clients: int, batch: int, n: int, world: int, group_ranks: bool,
                 server_pid: int | None = None) -> dict:
    per = per_client(n, clients, world)
    bodies = [[encode_batch(b) for b in batches(
        report_stream(f"{tag}-w{world}-c{clients}-b{batch}-{i}", per, world, group_ranks=group_ranks), batch)]
        for i in range(clients)]
    load_before = load()
    r = drive(url, "/v1/reports", bodies, server_pid)
    r.update(rate=r["accepted"] / r["seconds"], load=load_before, per_cpu=r["accepted"] / max(r["cpu"], 1e-9),
             steps=clients * per // world)
    if r["accepted"] != per * clients:
        raise RuntimeError(f"stored {r['accepted']} of {per * clients} reports")
    if r["audited"] != r["steps"]:
        raise RuntimeError(f"audited {r['audited']} of {r['steps']} complete steps")
    return r


def mlflow_case(url: str, tag: str, clients: int, batch: int, n: int, world: int,
                server_pid: int | None = None, per_report: int = 1) -> dict:
    """``n`` reports as MLflow metrics; rates are in reports (= metrics / ``per_report``).
    With one metric per report, the stored history of up to 64 rank keys per run is checked."""
    per = per_client(n, clients, world)
    with httpx.Client(base_url=url, timeout=60) as http:
        exp = http.post("/api/2.0/mlflow/experiments/create",
                        json={"name": f"{tag}-w{world}-c{clients}-b{batch}-{time.time_ns()}"}).json()["experiment_id"]
        runs = [http.post("/api/2.0/mlflow/runs/create",
                          json={"experiment_id": exp, "start_time": int(time.time() * 1000)}).json()
                ["run"]["info"]["run_id"] for _ in range(clients)]
    bodies = []
    for i, rid in enumerate(runs):
        b = []
        for chunk in batches(report_stream(f"m{i}", per, world), batch):
            b += mlflow_batches(chunk, rid, per_report)
        bodies.append(b)
    load_before = load()
    r = drive(url, "/api/2.0/mlflow/runs/log-batch", bodies, server_pid)
    r.update(rate=per * clients / r["seconds"], load=load_before, per_cpu=per * clients / max(r["cpu"], 1e-9))
    if per_report == 1:  # every sampled key holds one point per step
        keys = sorted(set(range(min(world, 32))) | set(range(max(0, world - 32), world)))
        with httpx.Client(base_url=url, timeout=60) as http:
            stored = sum(len(http.get("/api/2.0/mlflow/metrics/get-history",
                                      params={"run_id": rid, "metric_key": f"advantages/rank{k}"}).json()
                             .get("metrics", []))
                         for rid in runs for k in keys)
        want = len(runs) * len(keys) * (per // world)
        if stored != want:
            raise RuntimeError(f"MLflow stored {stored} of {want} sampled metrics")
    return r


def _us(r: dict) -> float:
    return 1e6 * r["cpu"] / max(r["accepted"], 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small volume (20k reports, 4k MLflow metrics per case)")
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--shapes", default="2,8,64,1024,4096", help="ranks per step (dp × cp = n/2 × 2), comma-separated")
    ap.add_argument("--world", type=int, help="one shape (same as --shapes N)")
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--batches", default="1000,10000")
    ap.add_argument("--reports", type=int, default=200_000,
                    help="reports per auditor case (rounded up to whole steps per client)")
    ap.add_argument("--mlflow-reports", type=int, default=20_000, help="metrics per MLflow case")
    ap.add_argument("--mlflow-shapes", help="shapes MLflow is measured at (default: every shape)")
    ap.add_argument("--workers", type=int, default=1, help="auditor server processes (uvicorn --workers)")
    ap.add_argument("--auditor-python", help="interpreter of the auditor code under test "
                                             "(default $AUDITOR_BENCH_PYTHON, else this one)")
    ap.add_argument("--repeat", type=int, default=1, help="median of this many auditor runs per case")
    ap.add_argument("--group-ranks", action="store_true", help="send group_ranks (all world ranks) too")
    ap.add_argument("--no-mlflow", action="store_true")
    ap.add_argument("--mlflow-metrics-per-report", type=int, default=1, choices=(1, 10),
                    help="1: one metric per report (its applied mean); 10: each of its ten numbers")
    a = ap.parse_args(argv)
    if a.quick:
        a.reports, a.mlflow_reports = 20_000, 4_000
    shapes = [a.world] if a.world else [int(x) for x in a.shapes.split(",")]
    ml_shapes = set(shapes if not a.mlflow_shapes else map(int, a.mlflow_shapes.split(",")))
    python = auditor_python(a.auditor_python)
    m = machine()
    print(f"machine: {m['nproc']} × {m['cpu']}, Python {m['python']}, load {m['load']}")
    print(f"auditor code: {auditor_code(python)}; shapes {shapes} ranks/step; {a.reports:,} reports per auditor "
          f"case, {a.mlflow_reports:,} metrics per MLflow case; auditor workers {a.workers}"
          f"{', group_ranks on' if a.group_ranks else ''}", flush=True)
    cases = [(int(c), int(b)) for c in a.clients.split(",") for b in a.batches.split(",")]
    ours: dict = {}
    theirs: dict = {}
    peak: dict = {}
    for kind in a.backends.split(","):
        with database(kind, "bench_ingest") as (url, _):
            with auditor_service(url, workers=a.workers, python=python) as svc:
                auditor_case(svc.url, "warmup", 1, 1000, 5000, 256, a.group_ranks)
                with RssSampler(svc.pids) as rss:
                    for world in shapes:
                        for c, b in cases:
                            runs = [auditor_case(svc.url, f"r{k}", c, b, a.reports, world, a.group_ranks,
                                                 svc.proc.pid) for k in range(a.repeat)]
                            o = ours[(kind, world, c, b)] = sorted(runs, key=lambda r: r["rate"])[len(runs) // 2]
                            print(f"  auditor {kind:10s} ranks={world:>5} clients={c} batch={b:>6}: "
                                  f"{o['rate']:>9,.0f} reports/s, {_us(o):6.1f} server µs/report, "
                                  f"{o['busy']} × 503 (load {o['load']})", flush=True)
            smp = [x / 1024 for x in rss.samples if x] or [0]
            peak[kind] = max(smp)
            print(f"  auditor {kind}: server RSS over the run, MiB: first {smp[0]:.0f}, 25% {smp[len(smp) // 4]:.0f}, "
                  f"50% {smp[len(smp) // 2]:.0f}, 75% {smp[3 * len(smp) // 4]:.0f}, last {smp[-1]:.0f}, "
                  f"peak {max(smp):.0f}", flush=True)
        if a.no_mlflow:
            continue
        with database(kind, "bench_mlflow") as (url, _):
            with mlflow_service(url) as svc:
                mlflow_case(svc.url, "warmup", 4, 1000, 4000, 8)  # every worker serves a few
                for world in shapes:
                    if world not in ml_shapes:
                        continue
                    for c, b in cases:
                        t = theirs[(kind, world, c, b)] = mlflow_case(
                            svc.url, "bench", c, b, a.mlflow_reports, world, svc.proc.pid, a.mlflow_metrics_per_report)
                        print(f"  mlflow  {kind:10s} ranks={world:>5} clients={c} batch={b:>6}: {t['rate']:>9,.0f} "
                              f"reports/s as {a.mlflow_metrics_per_report} metric(s) each (load {t['load']})",
                              flush=True)

    unit = "metrics" if a.mlflow_metrics_per_report == 1 else f"reports ({a.mlflow_metrics_per_report} metrics each)"
    print()
    print(f"| database | ranks/step | clients | batch | auditor reports/s | steps audited | 503s | server µs/report "
          f"| MLflow {unit}/s | ratio | auditor reports per server CPU-s | MLflow {unit} per server CPU-s "
          "| CPU ratio | load (1/5/15 min) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for (kind, world, c, b), o in ours.items():
        t = theirs.get((kind, world, c, b))
        mrate, ratio, mcpu, cratio = (
            (f"{t['rate']:,.0f}", f"{o['rate'] / t['rate']:.1f}×", f"{t['per_cpu']:,.0f}",
             f"{o['per_cpu'] / t['per_cpu']:.1f}×") if t else ("–",) * 4)
        print(f"| {kind} | {world:,} | {c} | {b:,} | {o['rate']:,.0f} | {o['audited']:,} | {o['busy']} | "
              f"{_us(o):.1f} | {mrate} | {ratio} | {o['per_cpu']:,.0f} | {mcpu} | {cratio} | {o['load']} |")
    print()
    print("Shapes (auditor reports/s; slowest/fastest shape of the row; smallest ratio to MLflow in the row):")
    print()
    print("| database | clients | batch | " + " | ".join(f"{w:,} ranks" for w in shapes)
          + " | slowest/fastest | min × MLflow | load range |")
    print("|---|---:|---:|" + "---:|" * len(shapes) + "---:|---:|---|")
    for kind in a.backends.split(","):
        for c, b in cases:
            row = [ours[(kind, w, c, b)] for w in shapes]
            rates = [o["rate"] for o in row]
            ratios = [ours[(kind, w, c, b)]["rate"] / theirs[(kind, w, c, b)]["rate"]
                      for w in shapes if (kind, w, c, b) in theirs]
            loads = sorted(float(o["load"].split()[0]) for o in row)
            print(f"| {kind} | {c} | {b:,} | " + " | ".join(f"{r:,.0f}" for r in rates)
                  + f" | {min(rates) / max(rates):.2f} | {f'{min(ratios):.1f}×' if ratios else '–'} "
                  f"| {loads[0]:.2f}–{loads[-1]:.2f} |")
    print(f"\nserver peak RSS MiB: " + ", ".join(f"{k} {v:,.0f}" for k, v in peak.items()))
    print(f"load after: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
