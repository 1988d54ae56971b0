"""What the auditor client costs the training thread (issue 5).

    python benchmarks/client_overhead.py [--calls 200000] [--memory-reports 1000000]

Prints:

1. median and p99 of one ``AuditorClient.report()`` call on the calling thread, with the
   service up (a real ``auditor serve`` process on SQLite), slow (a server answering every
   request after 1 s) and down (nothing listening). Goal: ≤ 10 µs median, ≤ 100 µs p99.
   Calls come at ``--rate`` (default 20,000/s: far more than a trainer rank reports, a few
   per step), so the background threads compete for the GIL while they are measured.
2. resident memory growth after 1e6 reports with the service down, in a tight loop and paced
   at 50k reports/s, with what was spooled and dropped.
3. the time the audited whiten adds to a plain one for 1e6 tokens (one-rank gloo world):
   ``auditor.trainer.hooks.distributed_masked_whiten(client=...)`` and
   ``wrap_distributed_whiten`` around slime's function.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from auditor.trainer.client import AuditorClient  # noqa: E402
from auditor.server import free_port, wait_healthy  # noqa: E402


def make_report(i: int, world: int = 8) -> dict:
    rank = i % world
    return {
        "run_id": "bench-client", "statistic": "advantages", "step": i // world, "rank": rank,
        "world_size": world, "coords": {"dp": rank, "cp": 0, "tp": 0, "pp": 0},
        "sizes": {"dp": world, "cp": 1, "tp": 1, "pp": 1},
        "local": {"count": 100.0, "sum": 10.0 + rank, "sum_sq": 200.0, "min": -3.0, "max": 3.0},
        "applied": {"count": 800.0, "sum": 108.0, "sum_sq": 1600.0, "mean": 0.135, "var": 1.98},
        "group_ranks": list(range(world)), "dtype": "float32",
    }


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class SlowServer:
    def __init__(self, delay: float):
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                time.sleep(delay)
                body = b'{"accepted":0,"duplicates":0,"steps_audited":0}'
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def time_calls(client: AuditorClient, n: int, rate: float) -> tuple[float, float, float]:
    """(median µs, p99 µs, p99.9 µs) of client.report over n calls at ``rate`` calls/s
    (report built and pacing sleeps untimed)."""
    perf = time.perf_counter_ns
    out = [0] * n
    start = time.perf_counter()
    gc.disable()
    try:
        for i in range(n):
            if i % 100 == 0:
                ahead = i / rate - (time.perf_counter() - start)
                if ahead > 0:
                    time.sleep(ahead)
            r = make_report(i)
            t0 = perf()
            client.report(r)
            out[i] = perf() - t0
    finally:
        gc.enable()
    out.sort()
    return out[n // 2] / 1e3, out[int(n * 0.99)] / 1e3, out[int(n * 0.999)] / 1e3


def bench_report(n: int, tmp: Path, rate: float) -> list[tuple]:
    rows = []
    port = free_port()
    db = tmp / "svc.db"
    proc = subprocess.Popen([sys.executable, "-m", "auditor", "serve", "--port", str(port), "--log-level", "warning",
                             "--database-url", f"sqlite:///{db}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 60)
        slow = SlowServer(1.0)
        for name, url in (("up", f"http://127.0.0.1:{port}"), ("slow (1 s/request)", slow.url),
                          ("down", f"http://127.0.0.1:{free_port()}")):
            client = AuditorClient(url, spool_dir=tmp / f"spool-{name[:4]}", flush_timeout=2.0, timeout=30.0)
            med, p99, p999 = time_calls(client, n, rate)
            client.close()
            rows.append((name, med, p99, p999, dict(client.stats)))
        slow.close()
    finally:
        proc.terminate()
        proc.wait(15)
    return rows


def bench_memory(n: int, tmp: Path, rate: float | None) -> tuple[float, dict, float]:
    gc.collect()
    before = rss_mb()
    client = AuditorClient(f"http://127.0.0.1:{free_port()}", spool_dir=tmp / f"mem-{rate}", flush_timeout=2.0,
                           spool_after=0.5)
    t0 = time.perf_counter()
    for i in range(n):
        client.report(make_report(i))
        if rate and i % 1000 == 999:
            ahead = (i + 1) / rate - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)
    time.sleep(1.0)
    gc.collect()
    after = rss_mb()
    spool_mb = sum(p.stat().st_size for p in (tmp / f"mem-{rate}").glob("*.jsonl")) / 1e6
    client.close()
    return after - before, dict(client.stats), spool_mb


def bench_whiten(tokens: int, repeats: int, tmp: Path) -> list[tuple[str, float]]:
    import torch
    import torch.distributed as dist

    from auditor.trainer.wrap import wrap_distributed_whiten
    from auditor.trainer.hooks import distributed_masked_whiten

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    values = torch.randn(tokens)
    mask = (torch.rand(tokens) > 0.2).float()
    client = AuditorClient(f"file://{tmp / 'whiten-spool'}", rank=0)
    wrapped = wrap_distributed_whiten(distributed_masked_whiten, client=client, run_id="bench-whiten")

    def med(f) -> float:
        f()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    plain = med(lambda: distributed_masked_whiten(values, mask))
    hooked = med(lambda: distributed_masked_whiten(values, mask, client=client, run_id="bench-whiten"))
    wrapped_t = med(lambda: wrapped(values, mask))
    client.close()
    dist.destroy_process_group()
    return [("plain (slime semantics)", plain), ("torch_hooks(client=...)", hooked), ("wrap_distributed_whiten", wrapped_t)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--rate", type=float, default=20_000.0, help="report() calls per second in part 1")
    ap.add_argument("--memory-reports", type=int, default=1_000_000)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    args = ap.parse_args()
    torch_threads = os.environ.get("OMP_NUM_THREADS", "default")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
          f"torch threads {torch_threads}")
    tmp = Path(tempfile.mkdtemp(prefix="auditor-client-bench-"))
    try:
        print(f"\n1. report() on the calling thread, {args.calls:,} calls at {args.rate:,.0f}/s")
        print(f"{'service':<20} {'median µs':>10} {'p99 µs':>8} {'p99.9 µs':>9}   counters")
        for name, med, p99, p999, st in bench_report(args.calls, tmp, args.rate):
            counters = ", ".join(f"{k}={v}" for k, v in st.items() if v)
            print(f"{name:<20} {med:>10.2f} {p99:>8.2f} {p999:>9.1f}   {counters}")

        print(f"\n2. memory after {args.memory_reports:,} reports, service down")
        print(f"{'pace':<20} {'RSS growth MB':>14} {'spool MB':>9}   counters")
        for rate in (None, 50_000.0):
            grown, st, spool_mb = bench_memory(args.memory_reports, tmp, rate)
            counters = ", ".join(f"{k}={v}" for k, v in st.items() if v)
            print(f"{'tight loop' if rate is None else f'{rate:,.0f}/s':<20} {grown:>14.1f} {spool_mb:>9.1f}   {counters}")

        print(f"\n3. whitening {args.tokens:,} tokens (one-rank gloo world), median of 20")
        rows = bench_whiten(args.tokens, 20, tmp)
        base = rows[0][1]
        for name, ms in rows:
            print(f"{name:<26} {ms:8.2f} ms  (+{ms - base:.2f} ms)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
