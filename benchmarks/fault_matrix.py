"""Print the fault matrix: every fault of DESIGN.md §5 injected by real gloo ranks.

Usage::

    python benchmarks/fault_matrix.py [--url http://127.0.0.1:8000]

Without ``--url`` a throw-away ``auditor serve`` on a temporary SQLite file is started (grace
period 2 s, so ``missing_report`` resolves quickly). Spawns 8 ranks (dp=2, cp=2, tp=2,
Megatron-core groups), runs every scenario of :data:`auditor.demo.faults.SCENARIOS` through
the real client, and prints fault × detected × diagnosis correct. Exit status 1 if any cell
is wrong. tests/test_fault_injection.py asserts the same matrix.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time


def main() -> int:
    from auditor.demo.faults import format_matrix, run_matrix
    from auditor.server import free_port, wait_healthy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="an auditor service to report to (default: start one)")
    ap.add_argument("--timeout", type=float, default=240.0, help="bound on the multi-process run, seconds")
    args = ap.parse_args()
    server = None
    url = args.url
    if url is None:
        tmp = tempfile.mkdtemp(prefix="fault-matrix-")
        port = free_port()
        env = {**os.environ, "AUDITOR_DATABASE_URL": f"sqlite:///{tmp}/auditor.db",
               "AUDITOR_GRACE_SECONDS": "2", "AUDITOR_SWEEP_INTERVAL_SECONDS": "0.2"}
        server = subprocess.Popen([sys.executable, "-m", "auditor", "serve", "--port", str(port),
                                   "--log-level", "warning"], env=env)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 60)
    try:
        t0 = time.monotonic()
        rows, _, _ = run_matrix(url, timeout=args.timeout)
        print(format_matrix(rows))
        print(f"\n{len(rows)} scenarios, {time.monotonic() - t0:.1f} s; "
              f"{sum(r.detected and r.diagnosis_correct for r in rows)}/{len(rows)} detected with the right diagnosis")
        return 0 if all(r.detected and r.diagnosis_correct for r in rows) else 1
    finally:
        if server is not None:
            server.terminate()
            server.wait(15)


if __name__ == "__main__":
    sys.exit(main())
