"""The engine's vocabulary: parallel dims, the statistic spec, fault kinds, reports and verdicts.

Plain dataclasses and enums; nothing here validates input (the wire schema,
:mod:`auditor.contract`, does that and converts its spec into :class:`Spec`).
"""

from __future__ import annotations

import bisect
import enum
import itertools
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from auditor import layout

#: The parallel dimensions, in wire order: data, context, tensor, pipeline parallel.
DIMS: tuple[str, ...] = ("dp", "cp", "tp", "pp")
#: The expert factorisation of the same world (DESIGN.md §3.1): expert data, expert
#: model, expert tensor parallel and the shared pipeline dim.
EXPERT_DIMS: tuple[str, ...] = layout.EXPERT_DIMS

#: A rank's coordinates (dp, cp, tp, pp).
Coord = tuple[int, int, int, int]

#: Statistic kinds (DESIGN.md §3 table).
KINDS: tuple[str, ...] = ("moments", "sum", "norm", "fingerprint")

#: Step verdicts, in the order reports and metrics list them. ``audit_error``: the engine
#: raised on the step (recorded by the service, never returned by :func:`audit_step`).
#: ``unverified``: no fault found, but the layout is unknown and the values do not establish
#: which group each rank should have reduced over (:mod:`auditor.core.layoutless`).
VERDICTS: tuple[str, ...] = ("consistent", "inconsistent", "incomplete", "audit_error", "unverified")
#: Verdicts a re-audit may replace (recorded while reports were missing).
REPLACEABLE: tuple[str, ...] = ("incomplete", "inconsistent", "audit_error", "unverified")


class FaultKind(str, enum.Enum):
    """The verdict vocabulary (DESIGN.md §5). A ``str``: compares, sorts, formats and
    serialises as its value (``FaultKind.WRONG_GROUP == "wrong_group"``)."""

    CP_DISAGREEMENT = "cp_disagreement"
    GROUP_MISMATCH = "group_mismatch"
    WRONG_GROUP = "wrong_group"
    SKIPPED_COLLECTIVE = "skipped_collective"
    MISSING_REPORT = "missing_report"
    REPLICA_DIVERGENCE = "replica_divergence"
    REPLICA_OVERCOUNT = "replica_overcount"
    VARIANCE_CONVENTION = "variance_convention"
    PRECISION_LOSS = "precision_loss"
    NON_FINITE = "non_finite"
    EMPTY_GLOBAL = "empty_global"
    STALE_STATISTIC = "stale_statistic"
    REDUCTION_OP = "reduction_op"
    #: Not decided by the engine: the service records it as a step's one fault (verdict
    #: ``audit_error``) when the engine raised on that step.
    AUDIT_ERROR = "audit_error"

    __str__ = str.__str__
    __format__ = str.__format__


@dataclass(frozen=True, slots=True)
class Spec:
    """How a statistic must be reduced (DESIGN.md §3), as the engine reads it.

    ``reduce_over``: dims whose ranks form one reduction group (a rank's expected group is
    every rank equal to it on the other dims). ``replicas``: dims along which ranks hold the
    same data, counted once. ``variance``: ``sample`` (Bessel-corrected) or ``population``.
    ``over_microbatches``: a ``sum`` statistic is summed over all microbatches of the step.
    ``placement``: (dim, coordinates) pairs where the statistic lives (negative coordinates
    count from the end; empty: every rank). ``replicated_along``: dims along which a
    ``norm``'s ``replicated_sum_sq`` is identical (None: the whole group). DESIGN.md §3.1.
    Dims keep the order they were given in (it shows in messages and evidence).

    Kind ``fingerprint`` (:mod:`auditor.core.drift`): ``replicate_over`` (dims) or
    ``replica_groups`` (tuples of ranks), the replica group a tensor must agree over;
    ``agreement`` (``bitwise``/``rounding``/None: bitwise when digests are sent), ``k``
    projections and their ``seed``. None for the other kinds.
    """

    reduce_over: tuple[str, ...] = ("dp", "cp")
    replicas: tuple[str, ...] = ("tp",)
    variance: str = "sample"
    over_microbatches: bool = False
    placement: tuple[tuple[str, tuple[int, ...]], ...] = ()
    replicated_along: tuple[str, ...] | None = None
    replicate_over: tuple[str, ...] | None = None
    replica_groups: tuple[tuple[int, ...], ...] | None = None
    agreement: str | None = None
    k: int | None = None
    seed: int | None = None

    @property
    def factorisation(self) -> str:
        """``"expert"`` when the spec names edp, ep or etp, else ``"dense"``."""
        named = (set(self.reduce_over) | set(self.replicas) | set(self.replicated_along or ())
                 | set(self.replicate_over or ()) | {d for d, _ in self.placement})
        return "expert" if named & layout.EXPERT_ONLY else "dense"

    @property
    def dims(self) -> tuple[str, ...]:
        """The dims of the statistic's factorisation, in wire order."""
        return EXPERT_DIMS if self.factorisation == "expert" else DIMS

    def placed(self, sizes: Mapping[str, int]) -> dict[str, list[int]]:
        """``placement`` with negative coordinates resolved against ``sizes`` ({dim: sorted
        coordinates}). Raises ValueError naming the dim for a coordinate outside [-size, size)."""
        out = {}
        for d, sel in self.placement:
            n = sizes.get(d, 1)
            bad = [c for c in sel if not -n <= c < n]
            if bad:
                raise ValueError(f"spec.placement.{d} holds {bad[0]}, outside the {n} coordinates of {d}")
            out[d] = sorted({c % n for c in sel})
        return out


@dataclass(frozen=True, slots=True)
class RankReport:
    """The stored fields of one report that the audit reads (names as the DB columns)."""

    rank: int
    microbatch: int
    dp: int
    cp: int
    tp: int
    pp: int
    dtype: str
    local_count: float | None
    local_sum: float | None
    local_sum_sq: float | None
    local_min: float | None = None
    local_max: float | None = None
    local_replicated_sum_sq: float | None = None
    applied: bool = True
    applied_count: float | None = None
    applied_sum: float | None = None
    applied_sum_sq: float | None = None
    applied_mean: float | None = None
    applied_var: float | None = None
    #: the members of the rank's all-reduce group: a tuple of ranks, or their compressed text
    #: (:func:`compress_ranks`, e.g. ``"0-3,8-11"``) as stored; reports read from the store
    #: carry the text, so a step's memory does not grow as ranks × group size. None: not sent.
    group_ranks: tuple[int, ...] | str | None = None
    non_finite: str | None = None
    edp: int = 0
    ep: int = 0
    etp: int = 0
    #: kind ``fingerprint``: the fingerprint as stored, JSON text (NaN/Inf as strings) or a
    #: sequence of floats; None for the other kinds
    fingerprint: str | Sequence[float] | None = None
    #: the rank's host, if its report named it
    host: str | None = None

    @property
    def coords(self) -> Coord:
        return (self.dp, self.cp, self.tp, self.pp)

    def non_finite_fields(self) -> list[str]:
        """Fields that were NaN or Inf on the wire (NaN is stored as NULL, so the store keeps
        their names in ``non_finite``)."""
        names = ["local_count", "local_sum", "local_sum_sq", "local_min", "local_max"]
        if self.applied:
            names += ["applied_count", "applied_sum", "applied_sum_sq", "applied_mean", "applied_var"]
        found = {n for n in names if (v := getattr(self, n)) is not None and not math.isfinite(v)}
        found.update(filter(None, (self.non_finite or "").split(",")))
        return sorted(found)


@dataclass(slots=True)
class Fault:
    """One finding of a step: its kind (DESIGN.md §5), a sentence an engineer can act on,
    the ranks it concerns and the numbers behind it."""

    kind: FaultKind
    message: str
    ranks: list[int] = field(default_factory=list)
    evidence: dict = field(default_factory=dict)


@dataclass(slots=True)
class RankRow:
    """One line of the per-rank table of a step."""

    rank: int
    microbatch: int
    coords: dict[str, int]
    local_count: float | None
    local_mean: float | None
    applied_mean: float | None
    applied_std: float | None
    correct_mean: float | None
    correct_std: float | None
    error_sigma: float | None
    faults: list[FaultKind] = field(default_factory=list)
    #: ``sum``/``norm``: |applied − correct| / |correct| (local/applied/correct values sit in
    #: the ``*_mean`` columns; the ``*_std`` and ``error_sigma`` columns stay None).
    relative_error: float | None = None


@dataclass(slots=True)
class GroupStat:
    """The correct statistic of one expected group (one microbatch)."""

    key: tuple
    microbatch: int
    ranks: list[int]
    count: float
    mean: float
    var: float


@dataclass(slots=True)
class StepVerdict:
    """Outcome of auditing one step: ``consistent``, ``inconsistent`` or ``incomplete``."""

    verdict: str
    faults: list[Fault]
    rows: list[RankRow]
    groups: list[GroupStat]
    cp_disagreement_sigma: float | None
    applied_error_sigma: float | None
    #: ``moments``: the largest applied-error σ a correct reduction in the reported dtype can
    #: show at this step (the gap of the worst corner of the rounding bounds, docs/tolerance.md
    #: §2); CP peers may differ by up to about twice it. None when nothing was judged.
    tolerance_sigma: float | None = None

    @property
    def fault_kinds(self) -> list[str]:
        return sorted({f.kind for f in self.faults})


def placed_count(world: int, sizes: Iterable[int], dims: Iterable[str], placed: Mapping[str, list[int]]) -> int:
    """Ranks that hold a placed statistic: world · Π_d |S_d| / size_d (DESIGN.md §3.1)."""
    n = world
    for d, size in zip(dims, sizes):
        if d in placed:
            n = n // size * len(placed[d])
    return n


def compress_ranks(ranks: Iterable[int]) -> str:
    """Compact text of a rank set: ``[0, 1, 2, 5, 7, 8]`` → ``"0-2,5,7-8"``; a
    :class:`RankSpans` gives its text as is."""
    if isinstance(ranks, RankSpans):
        return ranks.text
    out: list[str] = []
    for _, run in itertools.groupby(enumerate(sorted(set(ranks))), lambda p: p[1] - p[0]):
        run = [r for _, r in run]
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


#: Memo of :func:`compress_ranks_shared`: id → (the rank list, its text); the list is held,
#: so its id cannot be reused while it is here. Bounded by the ranks and entries it holds.
_SHARED: dict[int, tuple[object, str]] = {}
_SHARED_RANKS = [0]
_SHARED_MAX_RANKS = 1 << 20
_SHARED_MAX_ENTRIES = 4096  # lists that are not shared (pydantic decodes one per report) come and go


def compress_ranks_shared(ranks: Sequence[int]) -> str:
    """:func:`compress_ranks` of a rank list that nobody mutates and that many reports
    share (the fast decoder gives every report of a batch with the same ``group_ranks`` text
    one list): the text is computed once per list object. A 1,024-rank group costs ~230 µs
    to compress; a repeated one a dict lookup."""
    hit = _SHARED.get(id(ranks))
    if hit is not None and hit[0] is ranks:
        return hit[1]
    text = compress_ranks(ranks)
    if _SHARED_RANKS[0] + len(ranks) + 1 > _SHARED_MAX_RANKS or len(_SHARED) >= _SHARED_MAX_ENTRIES:
        _SHARED.clear()
        _SHARED_RANKS[0] = 0
    _SHARED[id(ranks)] = (ranks, text)
    _SHARED_RANKS[0] += len(ranks) + 1  # an empty list costs its entry
    return text


def expand_ranks(text: str | None) -> tuple[int, ...] | None:
    """Inverse of :func:`compress_ranks`; None stays None."""
    if text is None:
        return None
    return tuple(r for lo, hi in zip(*_spans(text)) for r in range(lo, hi + 1))


def _spans(text: str) -> tuple[list[int], list[int]]:
    """The (first, last) ranks of each ``a`` or ``a-b`` part of a rank text, as two lists.
    Raises ValueError for a part that is not an integer range."""
    lo: list[int] = []
    hi: list[int] = []
    for part in filter(None, text.split(",")):
        a, _, b = part.partition("-")
        lo.append(int(a))
        hi.append(int(b or a))
    return lo, hi


class RankSpans:
    """A rank set held as its ranges, not its members: what the engine makes of a stored
    ``group_ranks`` text (:func:`compress_ranks`), so that a step whose ranks name
    different large groups (rank i names every rank but i: a short text, ~world members)
    costs its texts' size, not ranks × group size.

    Behaves as the sorted tuple of its members where the engine uses one: ``len`` (members),
    iteration (ascending, lazily), ``in`` and :meth:`index` (O(log ranges)), truth (not
    empty). Equal and hashed by ``text``, which is canonical (ascending, runs merged): two
    sets are equal exactly when their texts are. ``<`` is the order of the member tuples
    (:func:`_spans_cmp`). Immutable.

    Raises ValueError for a text that is not a rank list (``int`` of a part fails).
    """

    __slots__ = ("text", "_lo", "_hi", "_start", "_n")

    def __init__(self, text: str):
        lo, hi = _spans(text)
        if any(b < a for a, b in zip(lo, hi)) or any(lo[i] <= hi[i - 1] + 1 for i in range(1, len(lo))):
            # not canonical (not written by compress_ranks): its canonical form
            text = compress_ranks(r for a, b in zip(lo, hi) for r in range(a, b + 1))
            lo, hi = _spans(text)
        self.text = text
        self._lo, self._hi = lo, hi
        start, n = [], 0
        for a, b in zip(lo, hi):
            start.append(n)
            n += b - a + 1
        self._start, self._n = start, n

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def __iter__(self):
        for a, b in zip(self._lo, self._hi):
            yield from range(a, b + 1)

    def _span(self, rank: int) -> int:
        i = bisect.bisect_right(self._lo, rank) - 1
        return i if i >= 0 and rank <= self._hi[i] else -1

    def __contains__(self, rank) -> bool:
        return isinstance(rank, int) and self._span(rank) >= 0

    def index(self, rank: int) -> int:
        """The position of ``rank`` among the members (ascending); ValueError if absent."""
        i = self._span(rank)
        if i < 0:
            raise ValueError(f"{rank} is not in {self.text!r}")
        return self._start[i] + rank - self._lo[i]

    def minus(self, other: "RankSpans") -> "RankSpans":
        """The members of ``self`` not in ``other``, computed on the ranges (O(ranges))."""
        out: list[str] = []
        blo, bhi = other._lo, other._hi
        j = 0
        for lo, hi in zip(self._lo, self._hi):
            while j < len(blo) and bhi[j] < lo:
                j += 1
            cur, k = lo, j
            while k < len(blo) and blo[k] <= hi:
                if blo[k] > cur:
                    out.append(_span_text(cur, blo[k] - 1))
                cur = max(cur, bhi[k] + 1)
                k += 1
            if cur <= hi:
                out.append(_span_text(cur, hi))
        return RankSpans(",".join(out))

    def __eq__(self, other) -> bool:
        return isinstance(other, RankSpans) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __lt__(self, other: "RankSpans") -> bool:
        return _spans_cmp(self, other) < 0

    def __repr__(self) -> str:
        return f"RankSpans({self.text!r})"


def _span_text(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _spans_cmp(x: RankSpans, y: RankSpans) -> int:
    """-1, 0 or 1 as the member tuples of ``x`` and ``y`` compare (lexicographically; a
    prefix first), in O(ranges)."""
    xl, xh, yl, yh = x._lo, x._hi, y._lo, y._hi
    i = j = 0
    xa = ya = None
    xb = yb = 0
    while True:
        if xa is None and i < len(xl):
            xa, xb = xl[i], xh[i]
            i += 1
        if ya is None and j < len(yl):
            ya, yb = yl[j], yh[j]
            j += 1
        if xa is None or ya is None:
            return (xa is not None) - (ya is not None)
        if xa != ya:
            return -1 if xa < ya else 1
        k = min(xb, yb)  # xa..k is common to both
        xa = None if k == xb else k + 1
        ya = None if k == yb else k + 1
