"""Hang localisation: for a step audited with reports missing, which ranks reached which
step, and the sentence that says it ("ranks 0,2-3 stopped at step 39; rank 1 at 41")."""

from __future__ import annotations

import itertools
from collections import defaultdict

import sqlalchemy as sa

from auditor import core, layout
from auditor.contract.reads import Progress, ProgressAt
from auditor.core import EXPERT_DIMS
from auditor.db.store import Store
from auditor.service.model import SeriesInfo, Topology

#: Newest steps of a series read to tell which ranks reached which step (hang localisation).
PROGRESS_WINDOW = 16
#: Hang localisation: "sent nothing" (no report of the series at all) is told from "sent
#: nothing since before step N" by looking at the reports before the window while those
#: steps hold at most this many reports of the expected ranks (a bounded index range).
PROGRESS_LOOKBACK_REPORTS = 1 << 16


def localise(store: Store, conn: sa.Connection, info: SeriesInfo, topo: Topology, unstored=()) -> Progress:
    """Hang localisation: which ranks reached which step, from the newest
    :data:`PROGRESS_WINDOW` steps of the series. The ranks expected are the placed ranks
    (the world; by rank number when the placement and order allow), plus any that
    reported. A :class:`Progress` (stored as its ``to_json()`` with the step's verdict), e.g. summary "ranks 0,2-3 stopped at step 39; rank 1 at 41"; a rank that sent nothing
    in the window sent nothing "since before" its first step, or "sent nothing" when it
    has no report of the series at all (looked up while the steps before the window hold
    at most :data:`PROGRESS_LOOKBACK_REPORTS` reports of the expected ranks; beyond, the
    "since before" form)."""
    lo, last = store.rank_progress(conn, info.id, PROGRESS_WINDOW, unstored)
    expected: set[int] = set(last)
    expected |= _expected_ranks(info, topo)
    newest = max(last.values(), default=lo)
    by_step: dict[int | None, list[int]] = defaultdict(list)
    for r in expected:
        by_step[last.get(r)].append(r)
    never: set[int] = set()
    if by_step.get(None):
        seen = store.ranks_reported_before(conn, info.id, lo, by_step[None],
                                           max(1, PROGRESS_LOOKBACK_REPORTS // max(len(expected), 1)))
        never = set() if seen is None else set(by_step[None]) - seen
    at, parts = _where(by_step, never, lo, newest)
    behind = sum(len(rs) for s, rs in by_step.items() if s is None or s < newest)
    return Progress(newest_step=newest, ranks_behind=behind, at=at, summary="; ".join(parts))


def _expected_ranks(info: SeriesInfo, topo: Topology) -> set[int]:
    """The ranks expected to report the series: the placed ranks by rank number when the
    placement and order allow, the world without a placement, else none (only those that
    reported are known)."""
    placed = topo.placed(info.engine_spec)
    if placed and topo.order:
        dims, sizes = topo.dims_sizes(info.engine_spec)
        fact = "expert" if dims == EXPERT_DIMS else "dense"
        sz = dict(zip(dims, sizes))
        axes = [placed[d] if d in placed else range(n) for d, n in zip(dims, sizes)]
        return {layout.rank_of(dict(zip(dims, c)), sz, topo.order, fact) for c in itertools.product(*axes)}
    if not placed:
        return set(range(topo.world_size))
    return set()


def _where(by_step: dict[int | None, list[int]], never: set[int], lo: int,
           newest: int) -> tuple[list[ProgressAt], list[str]]:
    """``at`` (per step, the ranks whose newest step it is) and the summary's parts, e.g.
    "ranks 0,2-3 stopped at step 39", "rank 1 at 41", "rank 4 sent nothing since before
    step 30"."""
    at, parts = [], []
    for s, rs in sorted(by_step.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        ranks = core.compress_ranks(rs)
        at.append(ProgressAt(step=s, ranks=ranks))
        if s is None:
            earlier = [r for r in rs if r not in never]
            if never:
                parts.append(f"{core.ranks_text(never)} sent nothing")
            if earlier:
                parts.append(f"{core.ranks_text(earlier)} sent nothing since before step {lo}")
            continue
        who = core.ranks_text(rs)
        parts.append(f"{who} stopped at step {s}" if s < newest else f"{who} at {s}")
    return at, parts
