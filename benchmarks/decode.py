"""Decode cost of ``POST /v1/reports`` bodies (issue 11 §2): µs per report of the pydantic
models (:func:`auditor.contract.parse.validate_report_batch`, every body before the change) and of
the msgspec fast path (:func:`auditor.contract.fast.decode_report_batch`), in this process, no
HTTP, no database.

    python benchmarks/decode.py [--repeat 5] [--batches 1000,10000] [--shapes 2,1024]

Bodies are those ``benchmarks/ingest.py`` sends (a correct run, dp × cp = ranks/2 × 2), as
bytes, once plain and once as a trainer sends them (``group_ranks`` of the whole world and
``order``, which add a list of ``ranks`` integers and the order rules to every report).
Each cell is the best of ``--repeat`` decodes of the whole body divided by its reports,
in CPU time of the decoding thread (``time.thread_time``: on the shared 2-core machine
wall time mostly measures the neighbours), with the collector off during the clock (as
the service's tuned GC mostly is); the msgspec column's reports are checked equal to
pydantic's first.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import encode_batch, load, machine, report_stream  # noqa: E402

from auditor.contract.fast import decode_report_batch  # noqa: E402
from auditor.contract.parse import validate_report_batch  # noqa: E402


def best_us(fn, body: bytes, n: int, repeat: int) -> float:
    """Best CPU µs per report over ``repeat`` calls of ``fn(body)``."""
    best = float("inf")
    for _ in range(repeat):
        gc.disable()
        t0 = time.thread_time()
        out = fn(body)
        dt = time.thread_time() - t0
        gc.enable()
        assert out is not None
        del out
        best = min(best, dt)
    return best / n * 1e6


def body_of(batch: int, world: int, trainer: bool) -> bytes:
    reports = list(report_stream("bench-decode", batch, world, group_ranks=trainer))
    if trainer:
        for r in reports:
            r["order"] = "tp-cp-dp-pp"
    return encode_batch(reports)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--batches", default="1000,10000", help="reports per body, comma-separated")
    ap.add_argument("--shapes", default="2,1024", help="ranks per step, comma-separated")
    a = ap.parse_args(argv)
    m = machine()
    print(f"# decode CPU µs/report — {m['cpu']}, {m['nproc']} cores, Python {m['python']}, load {m['load']}")
    print("| body | ranks/step | batch | bytes/report | pydantic µs/report | msgspec µs/report | speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for trainer in (False, True):
        for world in (int(x) for x in a.shapes.split(",")):
            for batch in (int(x) for x in a.batches.split(",")):
                body = body_of(batch, world, trainer)
                slow = validate_report_batch(body, 100)[0]
                fast = decode_report_batch(body)
                assert slow is not None and fast is not None and len(fast) == len(slow) == batch
                assert all(f.local == f.local.__class__(**s.local.model_dump()) and f.step == s.step
                           for f, s in zip(fast, slow))
                del slow, fast
                p = best_us(lambda b: validate_report_batch(b, 100)[0], body, batch, a.repeat)
                f = best_us(decode_report_batch, body, batch, a.repeat)
                kind = "group_ranks+order" if trainer else "plain"
                print(f"| {kind} | {world:,} | {batch:,} | {len(body) // batch:,} | {p:.2f} | {f:.2f} | "
                      f"{p / f:.1f}× |", flush=True)
    print(f"# load after: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
