#!/usr/bin/env python
"""Recompute the golden corpus and show what changed.

    .venv/bin/python tests/golden/regenerate.py            # rewrite corpus.jsonl.gz, print the diff
    .venv/bin/python tests/golden/regenerate.py --check    # print the diff, exit 1 if any (writes nothing)

The corpus (:mod:`generate`) is every step of :data:`CASES` seeded cases with the full
serialised ``StepVerdict`` the engine gives it. A change of verdicts must be intended: run
this script, read the diff it prints (one block per changed step: the case, then a unified
diff of the verdict JSON), and put that diff in the commit message with the new corpus.
"""

from __future__ import annotations

import argparse
import difflib
import gzip
import io
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import generate  # noqa: E402

SEED = 20260412
CASES = 1500
CORPUS = HERE / "corpus.jsonl.gz"
FORMAT = 1


def core_spec(d: dict):
    """A case's spec (a dict of the generator) as the engine's :class:`auditor.core.Spec`,
    built directly rather than through the wire's ``StatisticSpec``: the corpus records the
    engine on every case, also on the specs the wire refuses (a replica dim inside the
    reduction, ``schemas.replicas_rule``): engine-only inputs, as the NaN-raw cases."""
    from auditor.core import Spec

    return Spec(tuple(d["reduce_over"]), tuple(d["replicas"]), d["variance"], d["over_microbatches"])


def engine():
    """(audit_step, report type, spec from a dict) of the audit engine under test."""
    from auditor.core import RankReport, audit_step

    return audit_step, RankReport, core_spec


def compute(cases: int = CASES, seed: int = SEED) -> list[dict]:
    """Every step's record: ``id``, ``case`` (description), ``inputs`` (digest), ``verdict``."""
    audit_step, report, spec = engine()
    return [{"id": i, "case": desc, "inputs": digest, "verdict": v}
            for i, desc, digest, v in generate.run_corpus(generate.cases(seed, cases), audit_step, report, spec)]


def header(records: list[dict], seed: int = SEED, cases: int = CASES) -> dict:
    return {"format": FORMAT, "seed": seed, "cases": cases, "steps": len(records)}


def write(records: list[dict], path: Path = CORPUS) -> None:
    """One JSON line per step after a header line; gzip with mtime 0 (same bytes for the same corpus)."""
    text = "\n".join(generate.dumps(r) for r in [header(records)] + records) + "\n"
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=9) as f:
        f.write(text.encode())
    path.write_bytes(buf.getvalue())


def read(path: Path = CORPUS) -> tuple[dict, list[dict]]:
    """(header, records) of a stored corpus; records keep their text for exact comparison."""
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    return json.loads(lines[0]), [json.loads(line) for line in lines[1:]]


def diff(old: list[dict], new: list[dict], limit: int = 20) -> list[str]:
    """Readable differences, one block per changed step (at most ``limit`` blocks shown)."""
    before = {r["id"]: r for r in old}
    after = {r["id"]: r for r in new}
    out: list[str] = []
    changed = 0
    for rid in list(after) + [k for k in before if k not in after]:
        a, b = before.get(rid), after.get(rid)
        if a is not None and b is not None and generate.dumps(a) == generate.dumps(b):
            continue
        changed += 1
        if changed > limit:
            continue
        if a is None or b is None:
            out.append(f"--- {rid}: {'added' if a is None else 'removed'} ({(a or b)['case']})")
            continue
        if a["inputs"] != b["inputs"]:
            out.append(f"--- {rid}: the generator's inputs changed ({a['inputs']} -> {b['inputs']}): {b['case']}")
            continue
        out.append(f"--- {rid}: {b['case']}")
        pa = json.dumps(a["verdict"], indent=1, allow_nan=True).splitlines()
        pb = json.dumps(b["verdict"], indent=1, allow_nan=True).splitlines()
        out.extend(difflib.unified_diff(pa, pb, "stored", "now", n=2, lineterm=""))
    if changed > limit:
        out.append(f"... and {changed - limit} more changed step(s)")
    if changed:
        out.insert(0, f"{changed} of {len(new)} step(s) differ from {CORPUS.name}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 on any difference")
    ap.add_argument("--limit", type=int, default=20, help="changed steps shown in full")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    new = compute()
    took = time.perf_counter() - t0
    old = read()[1] if CORPUS.exists() else []
    lines = diff(old, new, args.limit)
    print("\n".join(lines) if lines else f"no change: {len(new)} steps identical to {CORPUS.name}")
    kinds: dict[str, int] = {}
    for r in new:
        for f in r["verdict"]["faults"]:
            kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
    verdicts: dict[str, int] = {}
    for r in new:
        verdicts[r["verdict"]["verdict"]] = verdicts.get(r["verdict"]["verdict"], 0) + 1
    print(f"{len(new)} steps of {CASES} cases in {took:.1f} s; verdicts {verdicts}; faults {dict(sorted(kinds.items()))}")
    if args.check:
        return 1 if lines else 0
    if lines or not CORPUS.exists():
        write(new)
        print(f"wrote {CORPUS} ({CORPUS.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
