"""The golden corpus: every step of the seeded cases of :mod:`generate` gives exactly the
stored verdict — verdict, every fault (kind, ranks, message, evidence), every per-rank row,
every group's correct statistic and both σ figures, float for float.

A change here is a change of behaviour. If it is intended, run
``tests/golden/regenerate.py``, which rewrites the corpus and prints the difference, and
put that difference in the commit message.
"""

from __future__ import annotations

import regenerate


def test_engine_verdicts_equal_the_golden_corpus():
    """Recomputing all ~2,700 steps gives byte-identical serialised verdicts."""
    head, stored = regenerate.read()
    assert head["format"] == regenerate.FORMAT
    new = regenerate.compute(head["cases"], head["seed"])
    assert head == regenerate.header(new)
    lines = regenerate.diff(stored, new, limit=5)
    assert not lines, "\n".join(lines)


def test_the_generators_inputs_do_not_depend_on_numpys_simd_dispatch():
    """The corpus's inputs come out the same with numpy limited to its baseline (no AVX2,
    FMA3 or AVX-512 kernels): SIMD reductions round float32 sums and pick signed zeros by
    vector width, which made the corpus differ between machines twice (e404d3a, 2e8d116)."""
    import hashlib
    import os
    import subprocess
    import sys

    _, stored = regenerate.read()
    want = hashlib.sha256("".join(r["inputs"] for r in stored).encode()).hexdigest()
    code = ("import hashlib, generate, regenerate\n"
            "print(hashlib.sha256(''.join(generate.input_digest(c, s) for c in generate.cases(regenerate.SEED,"
            " regenerate.CASES) for s in c.steps).encode()).hexdigest())")
    env = {**os.environ, "NPY_DISABLE_CPU_FEATURES": "X86_V3 X86_V4 AVX512_ICL AVX512_SPR",
           "PYTHONPATH": os.pathsep.join([str(regenerate.HERE), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == want
