"""Attribution of a step's reduction faults (issue 27 §3, the pattern of
:mod:`auditor.core.replicas` applied to the faults of ``moments``/``sum``/``norm`` steps):
whether the ranks a fault names are one rank among correct peers or a whole slice along a dim.

* ``isolated``: the fault names one rank, and at least two other members of its expected
  group are not named (they reduced correctly): suspect that rank — its device or host, or
  a code path only it takes — rather than the reduction everyone runs.
* ``along_dim``: the fault names two or more ranks, and they are exactly the ranks at some
  coordinates of one dim (every rank at ``tp = 1``, every stage but the first): the fault
  follows that dim (a group or reduction built wrong along it), not one device.

Anything else (every rank named, a pair, a scattered set) gets no attribution: the fault's
own message says what is known. Only faults about ranks' values are read (:data:`KINDS`);
an unknown topology (no coordinates) is never attributed. The attribution is added to the
fault's evidence (``attribution``: ``{"pattern", "dim", "coords"}`` or ``{"pattern",
"peers", "hosts"}``) and one sentence to its message; kinds, ranks and verdicts are
unchanged.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from auditor.core.findings import ranks_text
from auditor.core.types import Fault, FaultKind

#: Kinds whose diagnosis names a software cause (the value is another group's, an earlier
#: step's, another op's or convention's): one rank isolated is that rank's own code path.
DIAGNOSED = frozenset({FaultKind.WRONG_GROUP, FaultKind.REPLICA_OVERCOUNT, FaultKind.STALE_STATISTIC,
                       FaultKind.REDUCTION_OP, FaultKind.VARIANCE_CONVENTION})
#: Fault kinds whose ranks hold a wrong (or missing) value of their own.
KINDS = frozenset({
    FaultKind.GROUP_MISMATCH, FaultKind.WRONG_GROUP, FaultKind.REPLICA_OVERCOUNT, FaultKind.STALE_STATISTIC,
    FaultKind.REDUCTION_OP, FaultKind.VARIANCE_CONVENTION, FaultKind.SKIPPED_COLLECTIVE, FaultKind.NON_FINITE,
    FaultKind.REPLICA_DIVERGENCE, FaultKind.CP_DISAGREEMENT,
})


def annotated(faults: Sequence[Fault], st) -> list[Fault]:
    """``faults`` of a step (:class:`auditor.core.step.Step` ``st``, known topology), each of
    :data:`KINDS` with the attribution its ranks allow added (module docstring)."""
    if st.by_group_ranks or not st.n:
        return list(faults)
    ranks = st.rank
    out = []
    for f in faults:
        a = None
        if f.kind in KINDS and f.ranks:
            a = _pattern(st, np.isin(ranks, np.asarray(f.ranks, dtype=np.int64)), f.kind in DIAGNOSED)
        if a is None:
            out.append(f)
            continue
        evidence, sentence = a
        out.append(Fault(f.kind, f"{f.message}. {sentence}" if not f.message.endswith(".") else
                         f"{f.message} {sentence}", f.ranks, {**f.evidence, "attribution": evidence}))
    return out


def _pattern(st, named: np.ndarray, diagnosed: bool) -> tuple[dict, str] | None:
    """(evidence, sentence) of the pattern of the elements ``named`` (bool per element), or None."""
    if named.all() or not named.any():
        return None
    distinct = sorted(set(int(r) for r in st.rank[named].tolist()))
    if len(distinct) == 1:
        return _isolated(st, named, distinct[0], diagnosed)
    for i, d in enumerate(st.dims):
        if st.expected_sizes[i] < 2:
            continue
        inside = set(st.coords[named, i].tolist())
        outside = set(st.coords[~named, i].tolist())
        if inside.isdisjoint(outside):
            coords = sorted(int(c) for c in inside)
            where = f"{d}={','.join(map(str, coords))}"
            return ({"pattern": "along_dim", "dim": d, "coords": coords},
                    f"Attribution: the ranks named are exactly those at {where} (along {d}): the fault follows {d} "
                    f"— a group or reduction built wrong along {d} — not one device.")
    return None


def _isolated(st, named: np.ndarray, rank: int, diagnosed: bool) -> tuple[dict, str] | None:
    """``isolated`` when at least two other members of the rank's expected group are right;
    ``diagnosed``: the fault's diagnosis names a software cause (:data:`DIAGNOSED`), which
    then lies in that rank's own path, not in its device."""
    axes = tuple(a for a in st.axes if a in st.spec.reduce_over or (a == "mb" and st.spec.over_microbatches))
    p = st.part(axes, dedupe=False)
    element = int(np.flatnonzero(named)[0])
    peers = [r for r in p.members(st, element) if r != rank]
    if len(peers) < 2:
        return None
    host = next((r.host for r in st.reports if r.rank == rank and r.host), None)
    where = f" on host {host}" if host else ""
    why = ("the cause diagnosed lies in a path only that rank takes (its own group or call), not in the code every "
           "rank runs" if diagnosed else
           "suspect that rank — its device or host, or a code path only it takes — not the reduction every rank runs")
    return ({"pattern": "isolated", "peers": peers[:64], "peers_total": len(peers), "hosts": [host]},
            f"Attribution: only rank {rank}{where} is out of line while {ranks_text(peers)} of its group are "
            f"right, along no dim: {why}.")
