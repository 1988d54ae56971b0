"""Ingest throughput: reports/s into a real ``auditor serve`` process over HTTP, next to MLflow.

For each database kind (SQLite file, PostgreSQL), client count and batch size, client
processes POST pre-encoded ``{"reports": [...]}`` bodies of a *correct* run (world of
``--world`` ranks, dp × cp = world/2 × 2) as fast as the service answers. Steps complete as
their ranks report, so every step is audited inside the ingest transaction (audit on).
Each client process sends its own run. Throughput = reports stored / wall time from the
first request to the last answer.

The same volume then goes to an ``mlflow server`` (default server and workers) on the same
database kind as MLflow ``log-batch`` requests, one metric per report (the applied mean,
key ``<statistic>/rank<rank>``, at the report's step) or, with
``--mlflow-metrics-per-report 10``, each of a report's ten numbers as its own metric; at
most 1,000 metrics per request (MLflow's limit). The table shows the ratio, in wall time and
per CPU-second of the server's process tree. Bodies are encoded before the clock starts for
both services; warm-up requests go first to both.

    python benchmarks/ingest.py --quick          # ~1 min: small volume
    python benchmarks/ingest.py                  # full matrix
    python benchmarks/ingest.py --backends postgresql --workers 2 --no-mlflow   # scale-out
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
    auditor_service, batches, cpu_seconds, database, encode_batch, load, machine, mlflow_batches,
    mlflow_service, report_stream, rss_kib, tree_pids,
)


def _client(url: str, path: str, bodies: list[bytes], start, out) -> None:
    with httpx.Client(base_url=url, timeout=600, headers={"content-type": "application/json"}) as http:
        start.wait()
        t0 = time.perf_counter()
        accepted = audited = 0
        for b in bodies:
            r = http.post(path, content=b)
            if r.status_code != 200:
                out.put(("error", f"{r.status_code} {r.text[:300]}"))
                return
            if path == "/v1/reports":
                j = r.json()
                accepted += j["accepted"]
                audited += j["steps_audited"]
        out.put(("ok", t0, time.perf_counter(), accepted, audited))


def drive(url: str, path: str, per_client: list[list[bytes]], server_pid: int | None = None) -> dict:
    """Send each client's bodies from its own process; return wall seconds, totals and the CPU
    seconds the server process tree used meanwhile (database server processes not included)."""
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(url, path, b, start, out)) for b in per_client]
    for p in procs:
        p.start()
    time.sleep(0.3)
    pids = tree_pids(server_pid) if server_pid else []
    cpu0 = cpu_seconds(pids)
    start.set()
    res = [out.get(timeout=1800) for _ in procs]
    cpu = cpu_seconds(pids) - cpu0
    for p in procs:
        p.join(30)
    errors = [r[1] for r in res if r[0] == "error"]
    if errors:
        raise RuntimeError(f"{path}: {errors[0]}")
    t0 = min(r[1] for r in res)
    t1 = max(r[2] for r in res)
    return {"seconds": t1 - t0, "accepted": sum(r[3] for r in res), "audited": sum(r[4] for r in res), "cpu": cpu}


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


def auditor_case(url: str, tag: str, clients: int, batch: int, n: int, world: int, group_ranks: bool,
                 server_pid: int | None = None) -> dict:
    per = n // clients
    bodies = [[encode_batch(b) for b in batches(
        report_stream(f"{tag}-c{clients}-b{batch}-{i}", per, world, group_ranks=group_ranks), batch)]
        for i in range(clients)]
    load_before = load()
    r = drive(url, "/v1/reports", bodies, server_pid)
    r.update(rate=r["accepted"] / r["seconds"], load=load_before, per_cpu=r["accepted"] / max(r["cpu"], 1e-9))
    if r["accepted"] != per * clients:
        raise RuntimeError(f"stored {r['accepted']} of {per * clients} reports")
    return r


def mlflow_case(url: str, tag: str, clients: int, batch: int, n: int, world: int,
                server_pid: int | None = None, per_report: int = 1) -> dict:
    """``n`` reports as MLflow metrics; rates are in reports (= metrics / ``per_report``)."""
    per = n // clients
    with httpx.Client(base_url=url, timeout=60) as http:
        exp = http.post("/api/2.0/mlflow/experiments/create",
                        json={"name": f"{tag}-c{clients}-b{batch}-{time.time_ns()}"}).json()["experiment_id"]
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
    with httpx.Client(base_url=url, timeout=60) as http:  # check that MLflow stored every metric
        stored = 0 if per_report != 1 else sum(len(http.get("/api/2.0/mlflow/metrics/get-history",
                                  params={"run_id": rid, "metric_key": f"advantages/rank{k}"}).json().get("metrics", []))
                     for rid in runs for k in range(min(world, per)))
    if per_report == 1 and stored != per * clients:
        raise RuntimeError(f"MLflow stored {stored} of {per * clients} metrics")
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small volume (20k reports, 4k MLflow metrics)")
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--batches", default="1000,10000")
    ap.add_argument("--reports", type=int, default=200_000, help="reports per case (auditor)")
    ap.add_argument("--mlflow-reports", type=int, default=20_000, help="metrics per case (MLflow)")
    ap.add_argument("--world", type=int, default=256, help="ranks per step")
    ap.add_argument("--workers", type=int, default=1, help="auditor server processes (uvicorn --workers)")
    ap.add_argument("--repeat", type=int, default=1, help="median of this many auditor runs per case")
    ap.add_argument("--group-ranks", action="store_true", help="send group_ranks (all world ranks) too")
    ap.add_argument("--no-mlflow", action="store_true")
    ap.add_argument("--mlflow-metrics-per-report", type=int, default=1, choices=(1, 10),
                    help="1: one metric per report (its applied mean); 10: each of its ten numbers")
    a = ap.parse_args(argv)
    if a.quick:
        a.reports, a.mlflow_reports = 20_000, 4_000
    m = machine()
    print(f"machine: {m['nproc']} × {m['cpu']}, Python {m['python']}, load {m['load']}")
    print(f"world {a.world} ranks/step, {a.reports:,} reports per auditor case, "
          f"{a.mlflow_reports:,} metrics per MLflow case, auditor workers {a.workers}"
          f"{', group_ranks on' if a.group_ranks else ''}")
    rows = []
    for kind in a.backends.split(","):
        cases = [(int(c), int(b)) for c in a.clients.split(",") for b in a.batches.split(",")]
        ours: dict = {}
        with database(kind, "bench_ingest") as (url, _):
            with auditor_service(url, workers=a.workers) as svc:
                auditor_case(svc.url, "warmup", 1, 1000, 5000, a.world, a.group_ranks)
                with RssSampler(svc.pids) as rss:
                    for c, b in cases:
                        runs = [auditor_case(svc.url, f"r{k}", c, b, a.reports, a.world, a.group_ranks, svc.proc.pid)
                                for k in range(a.repeat)]
                        ours[(c, b)] = sorted(runs, key=lambda r: r["rate"])[len(runs) // 2]
                        print(f"  auditor {kind:10s} clients={c} batch={b:>6}: {ours[(c, b)]['rate']:>9,.0f} "
                              f"reports/s (load {ours[(c, b)]['load']})", flush=True)
                peak_rss = max(rss.samples) / 1024 if rss.samples else 0
            smp = [x / 1024 for x in rss.samples if x] or [0]
            print(f"  auditor {kind}: server RSS over the run, MiB: first {smp[0]:.0f}, 25% {smp[len(smp) // 4]:.0f}, "
                  f"50% {smp[len(smp) // 2]:.0f}, 75% {smp[3 * len(smp) // 4]:.0f}, last {smp[-1]:.0f}, "
                  f"peak {max(smp):.0f}", flush=True)
        theirs: dict = {}
        if not a.no_mlflow:
            with database(kind, "bench_mlflow") as (url, _):
                with mlflow_service(url) as svc:
                    mlflow_case(svc.url, "warmup", 4, 1000, 4000, a.world)  # every worker serves a few
                    for c, b in cases:
                        theirs[(c, b)] = mlflow_case(svc.url, "bench", c, b, a.mlflow_reports, a.world, svc.proc.pid,
                                                     a.mlflow_metrics_per_report)
                        print(f"  mlflow  {kind:10s} clients={c} batch={b:>6}: {theirs[(c, b)]['rate']:>9,.0f} "
                              f"reports/s as {a.mlflow_metrics_per_report} metric(s) each "
                              f"(load {theirs[(c, b)]['load']})", flush=True)
        for c, b in cases:
            o, t = ours[(c, b)], theirs.get((c, b))
            rows.append((kind, c, b, o["rate"], o["audited"], t["rate"] if t else None,
                         o["rate"] / t["rate"] if t else None, o["load"], peak_rss, o["per_cpu"],
                         t["per_cpu"] if t else None))
    print()
    unit = "metrics" if a.mlflow_metrics_per_report == 1 else f"reports ({a.mlflow_metrics_per_report} metrics each)"
    print(f"| database | clients | batch | auditor reports/s | steps audited | MLflow {unit}/s | ratio "
          f"| auditor reports per server CPU-s | MLflow {unit} per server CPU-s | CPU ratio "
          "| load (1/5/15 min) | server peak RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for kind, c, b, rate, aud, mrate, ratio, ld, rss, pc, mpc in rows:
        print(f"| {kind} | {c} | {b:,} | {rate:,.0f} | {aud:,} | "
              f"{f'{mrate:,.0f}' if mrate else '–'} | {f'{ratio:.1f}×' if ratio else '–'} | {pc:,.0f} | "
              f"{f'{mpc:,.0f}' if mpc else '–'} | {f'{pc / mpc:.1f}×' if mpc else '–'} | {ld} | {rss:,.0f} |")
    print(f"\nload after: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
