"""Engine time of one fully wrong step: :func:`auditor.core.audit_step` on a step whose every
rank whitened with moments reduced over dp only (``auditor.testing.steps.dp_only_step``:
one ``wrong_group`` fault covering every rank, plus ``group_mismatch`` and
``cp_disagreement``), for world sizes up to 16,384 ranks. In-process, no service, no
database: the worst case of the exact path's diagnosis (tests/core/test_audit.py pins the
verdict of the 4,096-rank step; it was diagnosed in under a second when the test timed it).

    python benchmarks/audit_step.py
    python benchmarks/audit_step.py --repeats 20 --sizes 512x2x4 2048x2x4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine  # noqa: E402

from auditor import core  # noqa: E402
from auditor.testing.steps import dp_only_step  # noqa: E402

#: dp×cp×tp of the worlds timed by default (pp 1): 64 to 16,384 ranks.
SIZES = ("8x2x4", "64x2x4", "512x2x4", "2048x2x4")


def measure(sizes: tuple[int, int, int, int], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` ``audit_step`` calls (after one warm-up) on the step."""
    reps = dp_only_step(sizes)
    verdict = core.audit_step(reps, sizes, core.Spec())
    kinds = {f.kind for f in verdict.faults}
    if kinds != {"wrong_group", "group_mismatch", "cp_disagreement"}:
        raise RuntimeError(f"{sizes}: unexpected faults {sorted(kinds)}")
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        core.audit_step(reps, sizes, core.Spec())
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), help="Worlds as DPxCPxTP (pp 1).")
    ap.add_argument("--repeats", type=int, default=5, help="Timed calls per world (after one warm-up).")
    a = ap.parse_args(argv)
    m = machine()
    print(f"machine: {m['nproc']} × {m['cpu']}, python {m['python']}, load {m['load']}", flush=True)
    print("| ranks | dp×cp×tp | median ms | min ms | max ms | repeats |")
    print("|---:|---|---:|---:|---:|---:|")
    for spec in a.sizes:
        dp, cp, tp = (int(x) for x in spec.lower().split("x"))
        times = measure((dp, cp, tp, 1), a.repeats)
        print(f"| {dp * cp * tp:,} | {dp}×{cp}×{tp} | {statistics.median(times) * 1e3:.1f} | "
              f"{min(times) * 1e3:.1f} | {max(times) * 1e3:.1f} | {a.repeats} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
