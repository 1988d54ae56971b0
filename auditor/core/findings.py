"""Where a step's findings are recorded: :meth:`Findings.flag`, once per finding.

A finding is a fault kind for some elements of a step. ``flag`` tags each element's row
with the kind (the per-rank table) and folds the finding into one :class:`Fault` per
(kind, diagnosis) — one step yields a handful of faults, not one per rank. Also the words
the messages share.
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from auditor.core.types import Fault, FaultKind, RankSpans, compress_ranks

#: What a rank did with the statistic, and what the statistic is, per kind (messages).
VERB = {"moments": "whitened with", "sum": "divided by", "norm": "clipped with", "fingerprint": "holds"}
WHAT = {"moments": "statistic", "sum": "denominator", "norm": "gradient norm"}


def dims_text(dims: Iterable[str]) -> str:
    """``['dp', 'cp']``; the microbatch axis reads "and all microbatches"."""
    dims = list(dims)
    text = "[" + ", ".join(repr(d) for d in dims if d != "mb") + "]"
    return text + (" and all microbatches of the step" if "mb" in dims else "")


def dtypes_text(reports) -> str:
    """The reported dtypes of a step, e.g. ``float32`` or ``bfloat16/float32``."""
    return "/".join(sorted({r.dtype for r in reports}))


def ranks_text(ranks) -> str:
    """The text "rank 3" or "ranks 0-1,4" (:func:`compress_ranks`): the noun agrees with the
    count. ``ranks``: an iterable of ints or a :class:`RankSpans` (read as is, not expanded)."""
    if not isinstance(ranks, RankSpans):
        ranks = set(ranks)
    return f"rank{'' if len(ranks) == 1 else 's'} {compress_ranks(ranks)}"


Message = str | Callable[[list[int]], str]


class Findings:
    """The findings of one step of ``n`` elements whose global ranks are ``rank``."""

    def __init__(self, rank: np.ndarray) -> None:
        self._rank = rank
        #: per element, the kinds flagged on it, in the order they were found
        self.of: list[list[FaultKind]] = [[] for _ in range(len(rank))]
        self._by: dict[tuple, dict] = {}

    def flag(self, kind: FaultKind, detail: tuple, elements, message: Message, evidence: dict | None = None) -> None:
        """Record ``kind`` for ``elements`` (an index, an index array or a boolean mask).

        Each element's row lists ``kind`` once. Findings with the same ``(kind, detail)``
        fold into one fault over all their ranks: ``message`` is a string or a callable of
        the sorted rank list (called once, at the end); ``evidence`` is merged, first value
        wins except ``max_*`` keys, which keep the largest. Nothing is recorded for no elements.
        """
        idx = np.flatnonzero(elements) if isinstance(elements, np.ndarray) and elements.dtype == bool \
            else np.atleast_1d(np.asarray(elements, dtype=np.int64))
        if not len(idx):
            return
        for i in idx.tolist():
            if kind not in self.of[i]:
                self.of[i].append(kind)
        slot = self._by.setdefault((kind, detail), {"ranks": set(), "message": message, "evidence": {}})
        slot["ranks"].update(self._rank[idx].tolist())
        for k, v in (evidence or {}).items():
            old = slot["evidence"].get(k)
            if old is None or (k.startswith("max_") and v > old):
                slot["evidence"][k] = v

    def faults(self) -> list[Fault]:
        """One :class:`Fault` per (kind, diagnosis), in the order first found."""
        out = []
        for (kind, _), slot in self._by.items():
            ranks = sorted(slot["ranks"])
            msg = slot["message"](ranks) if callable(slot["message"]) else slot["message"]
            out.append(Fault(kind, msg, ranks, slot["evidence"]))
        return out
