"""Reports the trainers' clients dropped at hand-over (issue 24, wire field ``dropped``), as
an ingest learns of them: each report's tally (count, first_step, last_step) is kept by the
report's key (``report_drops``) and counted on its series in the ingest's own transaction
(a crash after its commit loses nothing).

A tally only grows: the client adds the drops it still has to tell to a report it sends
again (:meth:`auditor.trainer.handover.Gaps.attach`). So a re-sent report (:func:`compare`)
with the same tally as the stored one is a duplicate; with a higher one (a higher count,
its steps covering the stored ones; or one where none was stored) it is a duplicate whose
growth is counted (count difference, steps widened) and kept as the report's tally; any
other tally is a contradiction, a 409 ``conflicting_report`` naming the ``dropped`` fields
(:func:`auditor.service.errors.dropped_conflict`), as for the report's other fields. Two
copies of a report in one batch keep the higher tally, else a 409 too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from auditor.db.drops import MAX_DROPPED
from auditor.db.store import Store
from auditor.service import errors

if TYPE_CHECKING:
    from auditor.service.ingest import Stored, Txn

Tally = tuple[int, int, int]


def tally(dropped: Any) -> Tally | None:
    """A report's ``dropped`` block as ``(count, first_step, last_step)``; None: none."""
    return None if dropped is None else (dropped.count, dropped.first_step, dropped.last_step)


def compare(had: Tally | None, sent: Tally | None) -> Literal["same", "higher", "conflict"]:
    """How the tally ``sent`` with a report relates to the tally ``had`` of the same report
    stored (or sent earlier in the batch): ``same``, ``higher`` (more drops, the steps
    widened: ``had`` None, or a higher count over steps covering ``had``'s) or ``conflict``."""
    if had == sent:
        return "same"
    if sent is not None and (had is None or (sent[0] > had[0] and sent[1] <= had[1] and sent[2] >= had[2])):
        return "higher"
    return "conflict"


def within_batch(t: "Txn", key: tuple, i: int) -> None:
    """Report ``i`` of the batch re-sends ``key``, identical in its values to the copy at
    ``t.index_of[key]``: keep the copy with the higher tally (its index becomes the key's),
    or raise a 409 when neither tally grows from the other."""
    j = t.index_of[key]
    mine, theirs = tally(t.batch[i].dropped), tally(t.batch[j].dropped)
    if compare(theirs, mine) == "higher":
        t.index_of[key] = i
        if theirs is None:
            t.told.append(key)
    elif compare(mine, theirs) == "conflict":
        raise errors.dropped_conflict([(i, theirs, mine)], t.batch, within=j)


def settle(store: Store, t: "Txn", stored: "Stored") -> dict[int, Tally]:
    """The batch's tallies, in the ingest's transaction: those of the reports it inserted
    stored and counted whole, those of its re-sends compared with the stored ones
    (:func:`compare`: a growth stored and counted, a contradiction a 409). Returns the
    counts per series id (count, first step, last step) for
    :meth:`auditor.db.store.Store.record_verdicts` (or :meth:`~auditor.db.store.Store.count_drops`)
    to add to the series in its id-ordered pass. Reads nothing for a batch that inserted
    every report and carries no tally."""
    inserted = stored.keys
    rows: list[tuple[tuple, Tally]] = [(k, tally(t.batch[t.index_of[k]].dropped)) for k in t.told if k in inserted]
    growth = [(k[0], *d) for k, d in rows]  # series id, count, first step, last step
    leftover = [] if stored.all_new else [k for k in t.rows if k not in inserted]
    if leftover:
        have = store.report_drops(t.conn, leftover)
        clashes = []
        for k in sorted(leftover):
            had, sent = have.get(k), tally(t.batch[t.index_of[k]].dropped)
            verdict = compare(had, sent)
            if verdict == "higher":
                rows.append((k, sent))
                growth.append((k[0], sent[0] - (had[0] if had else 0), sent[1], sent[2]))
            elif verdict == "conflict":
                clashes.append((t.index_of[k], had, sent))
        if clashes:
            raise errors.dropped_conflict(sorted(clashes), t.batch)
    store.store_drops(t.conn, rows)
    per: dict[int, Tally] = {}
    for sid, n, lo, hi in growth:
        was = per.get(sid)
        per[sid] = (n, lo, hi) if was is None else (min(was[0] + n, MAX_DROPPED), min(was[1], lo), max(was[2], hi))
    return per
