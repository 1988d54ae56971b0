#!/usr/bin/env python
"""What one `auditor serve` process holds under hostile input (issue 9), as a table.

Starts the service (SQLite, default limits, under RLIMIT_DATA so a runaway cannot take the
machine) and, one after the other, sends: the largest accepted body (10,000 reports near the
16 MiB cap), a step at the expected-count limit (4,096 ranks × 64 microbatches) left for the
sweep, a 15 MB body of invalid reports from 4 clients at once while /healthz is timed, a
declared 500 MB body, and 1,000 idle connections. It prints the server's peak RSS (VmHWM)
after each, the /healthz latency, and the time to each answer, with the machine's load.

    .venv/bin/python benchmarks/limits.py [--memory-limit-mib 1536]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from auditor.server import free_port, wait_healthy
from auditor.testing.server import limited_argv


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory-limit-mib", type=int, default=1536)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="auditor-limits-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    limit = args.memory_limit_mib * 2**20

    env = {**os.environ, "AUDITOR_DATABASE_URL": f"sqlite:///{tmp / 'a.db'}", "AUDITOR_GRACE_SECONDS": "1",
           "AUDITOR_SWEEP_INTERVAL_SECONDS": "0.2"}
    proc = subprocess.Popen(limited_argv(["-m", "auditor", "serve", "--port", str(port), "--log-level", "warning"],
                                         data=limit),
                            env=env, stdout=open(tmp / "server.log", "wb"), stderr=subprocess.STDOUT)
    rows = []
    try:
        wait_healthy(url, 60)
        rows.append(("started", "", f"{peak_rss_mib(proc.pid):.0f}"))
        http = httpx.Client(timeout=120, headers={"content-type": "application/json"})

        world = 250
        reports = [{"run_id": "big", "statistic": "n", "kind": "sum", "step": s, "rank": r, "world_size": world,
                    "sizes": {"dp": world}, "coords": {"dp": r}, "local": {"sum": 1.0},
                    "applied": {"sum": float(world)}, "group_ranks": list(range(world))}
                   for s in range(40) for r in range(world)]
        body = json.dumps({"reports": reports}, separators=(",", ":")).encode()
        t0 = time.perf_counter()
        r = http.post(f"{url}/v1/reports", content=body)
        rows.append((f"largest accepted body ({len(body) / 2**20:.1f} MiB, 10,000 reports)",
                     f"{r.status_code} in {time.perf_counter() - t0:.2f} s", f"{peak_rss_mib(proc.pid):.0f}"))

        bomb = {"run_id": "bomb", "statistic": "a", "step": 0, "rank": 7, "world_size": 4096,
                "sizes": {"dp": 4096}, "coords": {"dp": 7}, "num_microbatches": 64,
                "local": {"count": 1.0, "sum": 1.0, "sum_sq": 1.0}, "applied": {"count": 1.0, "sum": 1.0,
                                                                                "sum_sq": 1.0}}
        r = http.post(f"{url}/v1/reports", json={"reports": [bomb]})
        t0 = time.perf_counter()
        while http.get(f"{url}/v1/runs/bomb").json()["steps_audited"] == 0 and time.perf_counter() - t0 < 60:
            time.sleep(0.1)
        rows.append(("step expecting 262,144 reports, swept with 1", f"{r.status_code}; swept within "
                     f"{time.perf_counter() - t0 + 1:.1f} s", f"{peak_rss_mib(proc.pid):.0f}"))
        r = http.post(f"{url}/v1/reports", json={"reports": [dict(bomb, num_microbatches=1_048_576, run_id="b2")]})
        rows.append(("the issue's bomb: 4,096 × 1,048,576", f"{r.status_code} {r.json()['errors'][0]['field']}",
                     f"{peak_rss_mib(proc.pid):.0f}"))

        bad = json.dumps({"reports": [{"run_id": "x", "step": -1, "rank": 0}] * 400_000}).encode()
        stop = threading.Event()
        statuses = []

        def flood():
            with httpx.Client(timeout=120, headers={"content-type": "application/json"}) as c:
                while not stop.is_set():
                    statuses.append(c.post(f"{url}/v1/reports", content=bad).status_code)

        threads = [threading.Thread(target=flood) for _ in range(4)]
        for t in threads:
            t.start()
        lat = []
        for _ in range(100):
            t0 = time.perf_counter()
            http.get(f"{url}/healthz")
            lat.append(time.perf_counter() - t0)
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join()
        lat.sort()
        rows.append((f"4 clients × {len(bad) / 2**20:.1f} MB invalid bodies ({len(statuses)} sent)",
                     f"{sorted(set(statuses))}; /healthz p50 {lat[49] * 1000:.1f} ms, max {lat[-1] * 1000:.1f} ms",
                     f"{peak_rss_mib(proc.pid):.0f}"))

        with socket.create_connection(("127.0.0.1", port)) as s:
            t0 = time.perf_counter()
            s.sendall(b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nContent-Length: 500000000\r\n\r\n")
            answer = s.recv(100)
            rows.append(("declared 500 MB body", f"{answer.split(b' ')[1].decode()} in "
                         f"{(time.perf_counter() - t0) * 1000:.1f} ms", f"{peak_rss_mib(proc.pid):.0f}"))

        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(1100)]
        time.sleep(0.5)
        t0 = time.perf_counter()
        ok = http.get(f"{url}/v1/runs").status_code
        took = time.perf_counter() - t0
        for s in socks:
            s.close()
        rows.append(("1,100 idle connections open", f"GET /v1/runs {ok} in {took * 1000:.1f} ms",
                     f"{peak_rss_mib(proc.pid):.0f}"))
    finally:
        proc.terminate()
        proc.wait(30)
    load = os.getloadavg()
    print(f"| case | answer | server peak RSS, MiB |\n|---|---|---:|")
    for case, answer, rss in rows:
        print(f"| {case} | {answer} | {rss} |")
    print(f"\nRLIMIT_DATA {args.memory_limit_mib} MiB; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} "
          f"on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
