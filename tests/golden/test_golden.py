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
