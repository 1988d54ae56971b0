"""Post-hoc audits of spools: ``auditor audit SPOOL`` (no service) and ``auditor import`` (to a
service), timed end to end as the commands a user runs.

A spool of ``--reports`` wire reports of a correct run with ``--world`` ranks per step
(dp × cp = world/2 × 2) is generated once per shape and layout and kept in ``--spool-dir``:

* ``per-rank`` (default; what trainers leave behind): one JSONL file per rank, as
  ``AuditorClient`` writes them (``rank<r>-...jsonl``), each in step order — a step is
  complete only once the files of all its ranks have been read;
* ``interleaved``: one file, the ranks of a step next to each other (a step completes
  within one batch).

Cases (``--cases``):

* ``audit`` — ``python -m auditor audit DIR --format json`` into its default temporary
  SQLite file, and ``--database-url`` of a throw-away PostgreSQL database; checks that every
  step was audited consistent;
* ``import`` — ``python -m auditor import DIR --url`` into a fresh ``auditor serve`` on each
  database; checks the service's step counts afterwards.

Wall time, reports/s, the command's CPU time and peak RSS (``wait4``), for ``import`` also
the server's CPU time, and the load average are printed per case. ``--timeout`` stops a
case that runs longer (reported as ``> timeout``).

    python benchmarks/offline.py                                  # 1,000,000 reports × 8 ranks
    python benchmarks/offline.py --reports 100000 --cases audit --backends sqlite
    AUDITOR_BENCH_PYTHON=/work/wt-before/.venv/bin/python python benchmarks/offline.py ...
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    auditor_code, auditor_python, auditor_service, cpu_seconds, database, load, machine, report_stream, tree_pids,
)

RUN_ID = "offline-bench"


def make_spool(root: Path, n: int, world: int, layout: str) -> tuple[Path, int, int]:
    """The spool directory of ``n`` reports (rounded up to whole steps), generated once:
    ``(directory, reports, steps)``."""
    steps = -(-n // world)
    n = steps * world
    d = root / f"spool-w{world}-n{n}-{layout}"
    done = d / ".complete"
    if done.exists():
        return d, n, steps
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob("*.jsonl"):
        old.unlink()
    t0 = time.perf_counter()
    files: dict[int, object] = {}
    try:
        for r in report_stream(RUN_ID, n, world):
            k = r["rank"] if layout == "per-rank" else 0
            f = files.get(k)
            if f is None:
                name = f"rank{k:05d}-bench.jsonl" if layout == "per-rank" else "all-ranks.jsonl"
                f = files[k] = open(d / name, "wb", buffering=1 << 20)
            f.write(json.dumps(r, separators=(",", ":")).encode() + b"\n")  # as the client spools it
    finally:
        for f in files.values():
            f.close()
    done.write_text(f"{n} reports, {steps} steps of {world} ranks, {layout}\n")
    size = sum(p.stat().st_size for p in d.glob("*.jsonl"))
    print(f"  generated {d} ({n:,} reports, {size / 2**20:,.0f} MiB) in {time.perf_counter() - t0:.0f} s", flush=True)
    return d, n, steps


def run_timed(argv: list[str], env: dict | None = None, timeout: float | None = None) -> dict:
    """Run ``argv``; wall seconds, CPU seconds and peak RSS (MiB) of the process and its
    children (``wait4``), its stdout, and whether it finished before ``timeout``."""
    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=out, stderr=err, env={**os.environ, **(env or {})}, start_new_session=True)
    deadline = None if timeout is None else t0 + timeout
    finished = True
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if deadline is not None and time.perf_counter() > deadline:
            os.killpg(p.pid, signal.SIGKILL)
            pid, status, ru = os.wait4(p.pid, 0)
            finished = False
            break
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    out.seek(0)
    err.seek(0)
    return {"seconds": wall, "cpu": ru.ru_utime + ru.ru_stime, "rss_mib": ru.ru_maxrss / 1024,
            "stdout": out.read().decode(), "stderr": err.read().decode(), "rc": p.returncode, "finished": finished}


def audit_case(python: str, spool: Path, kind: str, steps: int, timeout: float | None) -> dict:
    with database(kind, "bench_offline") as (url, _):
        argv = [python, "-P", "-m", "auditor", "audit", str(spool), "--format", "json"]
        if kind != "sqlite":  # sqlite: the command's own temporary file, as a user runs it
            argv += ["--database-url", url]
        ld = load()
        r = run_timed(argv, timeout=timeout)
    r["load"] = ld
    if r["finished"]:
        if r["rc"] != 0:
            raise RuntimeError(f"auditor audit exited {r['rc']}: {r['stderr'][-2000:]}")
        rep = json.loads(r["stdout"])
        st = rep[0]["statistics"][0]
        if st["steps_consistent"] != steps or st["steps_audited"] != steps:
            raise RuntimeError(f"audited {st['steps_audited']} ({st['steps_consistent']} consistent) of {steps} steps")
        r["audited"] = st["steps_audited"]
    return r


def import_case(python: str, spool: Path, kind: str, steps: int, timeout: float | None, batch: int) -> dict:
    for side in spool.glob("*.offset"):
        side.unlink()
    with database(kind, "bench_import") as (url, _), auditor_service(url, python=python) as svc:
        pids = tree_pids(svc.proc.pid)
        cpu0 = cpu_seconds(pids)
        ld = load()
        r = run_timed([python, "-P", "-m", "auditor", "import", str(spool), "--url", svc.url, "--batch-size", str(batch)],
                      timeout=timeout)
        r["server_cpu"] = cpu_seconds(pids) - cpu0
        r["load"] = ld
        if r["finished"]:
            if r["rc"] != 0:
                raise RuntimeError(f"auditor import exited {r['rc']}: {r['stderr'][-2000:]}")
            run = httpx.get(f"{svc.url}/v1/runs/{RUN_ID}", timeout=60).json()
            if run["steps_audited"] != steps:
                raise RuntimeError(f"service audited {run['steps_audited']} of {steps} steps")
            r["audited"] = run["steps_audited"]
    for side in spool.glob("*.offset"):
        side.unlink()
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reports", type=int, default=1_000_000, help="reports in the spool (whole steps)")
    ap.add_argument("--world", type=int, default=8, help="ranks per step")
    ap.add_argument("--layouts", default="per-rank", help="per-rank, interleaved, or both comma-separated")
    ap.add_argument("--cases", default="audit,import")
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--batch-size", type=int, default=10_000, help="auditor import --batch-size")
    ap.add_argument("--timeout", type=float, help="stop a case after this many seconds")
    ap.add_argument("--spool-dir", default=str(Path(tempfile.gettempdir()) / "auditor-bench-spools"),
                    help="where generated spools are kept (reused across runs)")
    ap.add_argument("--auditor-python", help="interpreter of the auditor code under test "
                                             "(default $AUDITOR_BENCH_PYTHON, else this one)")
    a = ap.parse_args(argv)
    python = auditor_python(a.auditor_python)
    m = machine()
    print(f"machine: {m['nproc']} × {m['cpu']}, Python {m['python']}, load {m['load']}")
    print(f"auditor code: {auditor_code(python)}", flush=True)
    rows = []
    for layout in a.layouts.split(","):
        spool, n, steps = make_spool(Path(a.spool_dir), a.reports, a.world, layout)
        for case in a.cases.split(","):
            for kind in a.backends.split(","):
                if case == "audit":
                    r = audit_case(python, spool, kind, steps, a.timeout)
                else:
                    r = import_case(python, spool, kind, steps, a.timeout, a.batch_size)
                rows.append((case, kind, layout, n, r))
                rate = f"{n / r['seconds']:,.0f} reports/s" if r["finished"] else f"stopped after {r['seconds']:.0f} s"
                print(f"  {case:6s} {kind:10s} {layout:11s} {n:,} reports × {a.world} ranks: {r['seconds']:.1f} s, "
                      f"{rate} (load {r['load']})", flush=True)
    print()
    print("| command | database | layout | reports | ranks/step | wall s | reports/s | command CPU s | server CPU s "
          "| command peak RSS MiB | load (1/5/15 min) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for case, kind, layout, n, r in rows:
        wall = f"{r['seconds']:.1f}" if r["finished"] else f"> {r['seconds']:.0f}"
        rate = f"{n / r['seconds']:,.0f}" if r["finished"] else "–"
        scpu = f"{r['server_cpu']:.1f}" if "server_cpu" in r else "–"
        print(f"| auditor {case} | {kind} | {layout} | {n:,} | {a.world} | {wall} | {rate} | {r['cpu']:.1f} | {scpu} "
              f"| {r['rss_mib']:,.0f} | {r['load']} |")
    print(f"\nload after: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
