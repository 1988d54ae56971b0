"""Consistency-report latency on a big run, database size per million reports, loader memory.

Loads a run of ``--steps`` steps × ``--ranks`` ranks (default 10,000 × 256 = 2.56 M reports;
every ``--bad-every``-th step inconsistent) straight through :meth:`auditor.service.Service.ingest`
(the service's own ingest and audit code, without HTTP; reports are built with pydantic's
``model_construct`` since they are known to be valid), sampling the loader's RSS as it goes.
Then it starts ``auditor serve`` on that database and times ``GET /v1/runs/{run}/report``
(default ``bad_steps=20``: per statistic, aggregates plus at most 20 bad steps with their
faults and per-rank tables).

    python benchmarks/report.py --quick              # 500 steps × 256 ranks
    python benchmarks/report.py                      # 10,000 × 256 on SQLite and PostgreSQL
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    auditor_service, database, database_bytes, load, machine, rss_kib, step_reports,
)

from auditor.db.engine import ensure_schema, make_engine  # noqa: E402
from auditor.service import Service  # noqa: E402
from auditor.contract.models import AppliedStats, Coords, LocalStats, Report, Sizes  # noqa: E402


def construct(d: dict) -> Report:
    """A :class:`Report` from a known-valid dict without validating it (loader only)."""
    return Report.model_construct(
        run_id=d["run_id"], statistic=d["statistic"], step=d["step"], rank=d["rank"],
        world_size=d["world_size"], coords=Coords.model_construct(**d["coords"]),
        sizes=Sizes.model_construct(**d["sizes"]), local=LocalStats.model_construct(**d["local"]),
        applied=AppliedStats.model_construct(**d["applied"]), dtype=d["dtype"],
    )


def load_run(url: str, run_id: str, steps: int, ranks: int, bad_every: int, batch: int) -> dict:
    import os

    engine = make_engine(url)
    ensure_schema(engine, url)
    svc = Service.from_engine(engine)
    pid = os.getpid()
    rss, buf, audited, t0 = [], [], 0, time.perf_counter()
    for step in range(steps):
        buf += [construct(d) for d in step_reports(run_id, step, ranks, buggy=bad_every > 0 and step % bad_every == 7)]
        if len(buf) >= batch or step == steps - 1:
            audited += len(svc.ingest(buf).audited)
            buf = []
            rss.append(rss_kib(pid) / 1024)
    dt = time.perf_counter() - t0
    engine.dispose()
    n = steps * ranks
    return {"reports": n, "seconds": dt, "rate": n / dt, "audited": audited,
            "rss_first": rss[0], "rss_peak": max(rss), "rss_last": rss[-1],
            "rss_mid": rss[len(rss) // 2]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="500 steps")
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--bad-every", type=int, default=500, help="every N-th step is inconsistent (0: none)")
    ap.add_argument("--batch", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)
    if a.quick:
        a.steps = 500
    m = machine()
    print(f"machine: {m['nproc']} × {m['cpu']}, load {m['load']}")
    rows = []
    for kind in a.backends.split(","):
        with database(kind, "bench_report") as (url, where):
            ld_load = load()
            r = load_run(url, "big", a.steps, a.ranks, a.bad_every, a.batch)
            size = database_bytes(kind, where)
            print(f"  {kind}: loaded {r['reports']:,} reports in {r['seconds']:.0f} s ({r['rate']:,.0f}/s, "
                  f"load {ld_load}); loader RSS first/mid/last/peak {r['rss_first']:.0f}/{r['rss_mid']:.0f}/"
                  f"{r['rss_last']:.0f}/{r['rss_peak']:.0f} MiB; database {size / 2**20:.0f} MiB", flush=True)
            with auditor_service(url) as svc, httpx.Client(base_url=svc.url, timeout=600) as http:
                times = []
                ld = load()
                for _ in range(a.repeat + 1):
                    t0 = time.perf_counter()
                    resp = http.get("/v1/runs/big/report")
                    times.append(time.perf_counter() - t0)
                    resp.raise_for_status()
                times = times[1:]  # the first request warms caches
                rep = resp.json()["statistics"][0]
                rows.append((kind, r, size, statistics.median(times), min(times), max(times), rep, ld, len(resp.content)))
                print(f"  {kind}: report median {1e3 * rows[-1][3]:.0f} ms (load {ld}); steps audited "
                      f"{rep['steps_audited']:,}, inconsistent {rep['steps_inconsistent']}, shown "
                      f"{rep['bad_steps_shown']}", flush=True)
    print()
    print("| database | reports | report median ms | min–max ms | response KiB | steps audited | inconsistent "
          "| DB MiB | MiB per M reports | load rate reports/s | loader RSS first→last (peak) MiB | load |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|")
    for kind, r, size, med, lo, hi, rep, ld, nbytes in rows:
        print(f"| {kind} | {r['reports']:,} | {1e3 * med:.0f} | {1e3 * lo:.0f}–{1e3 * hi:.0f} | {nbytes / 1024:.0f} "
              f"| {rep['steps_audited']:,} | {rep['steps_inconsistent']} | {size / 2**20:.0f} "
              f"| {size / 2**20 / (r['reports'] / 1e6):.0f} | {r['rate']:,.0f} "
              f"| {r['rss_first']:.0f}→{r['rss_last']:.0f} ({r['rss_peak']:.0f}) | {ld} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
