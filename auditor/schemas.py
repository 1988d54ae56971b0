"""Wire contract v1 (DESIGN.md §3): pydantic models of what trainers send and what the API returns.

Validation here is the only place that decides whether a report is well-formed; every
error names the field (pydantic's ``loc``) and the rule. NaN and Inf are accepted in every
statistic: they are a training fault the audit reports (``non_finite``), not a client error.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import re
from typing import Annotated, ClassVar, Literal, Mapping

import msgspec
import numpy as np
import pydantic_core
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from auditor import layout
from auditor.config import WIRE_MAX_SIZE
from auditor.core.findings import dims_text
from auditor.core.stats import SUBNORMAL_SPACING, UNIT_ROUNDOFF, mean_var_tolerance, reduction_gamma
from auditor.core.types import DIMS, EXPERT_DIMS, Spec
Dim = Literal["dp", "cp", "tp", "pp", "edp", "ep", "etp"]
Kind = Literal["moments", "sum", "norm"]
DType = Literal["float64", "float32", "tf32", "float16", "bfloat16"]
assert set(DType.__args__) == set(UNIT_ROUNDOFF)  # type: ignore[attr-defined]

def addressable(name: str) -> str:
    """``name`` if every ``/``-separated part of it holds a character other than ``.``, else
    ValueError: a run id or statistic is a URL path segment (a statistic may span several,
    ``policy/grad_norm``), and an empty, ``.`` or ``..`` part is dropped or resolved away
    by clients and proxies, so such a name could be stored but never read back."""
    for part in name.split("/"):
        if not part.strip("."):
            raise ValueError(f"{name!r}: every '/'-separated part must hold a character other than '.' "
                             "(no empty, '.' or '..' part: it cannot be addressed in a URL)")
    return name


RUN_ID_PATTERN = r"^[A-Za-z0-9._:-]+$"
RunId = Annotated[str, Field(min_length=1, max_length=128, pattern=RUN_ID_PATTERN), AfterValidator(addressable)]
STATISTIC_PATTERN = r"^[A-Za-z0-9._:/-]+$"
StatisticName = Annotated[str, Field(min_length=1, max_length=128, pattern=STATISTIC_PATTERN),
                          AfterValidator(addressable)]
_MAX_INT, _MAX_STEP, _MAX_SIZE = 2**31 - 1, 2**62, WIRE_MAX_SIZE
NonNegInt = Annotated[int, Field(ge=0, le=_MAX_INT)]
#: Steps are BIGINT in the database; 2^62 leaves room and is exact in float64 JSON parsers.
Step = Annotated[int, Field(ge=0, le=_MAX_STEP)]
PosInt = Annotated[int, Field(ge=1, le=_MAX_SIZE)]
#: Bounds of Report.group_ranks and Report.order.
_MAX_GROUP, _MAX_ORDER = WIRE_MAX_SIZE, 32
#: ``topology_source``: printable ASCII, at most 96 characters (DESIGN.md §3.1).
_SOURCE_PATTERN = r"^[ -~]{1,96}$"


class RuleError(ValueError):
    """A broken wire rule: the ValueError of the message, and ``loc``, the path of the wire
    field it blames relative to the object the rule judges (``("count",)`` in a ``local``
    block, ``("coords", "cp")`` or ``("local", "sum_sq")`` in a report). The model
    validators raise it as a pydantic error at that field (:func:`_located`), so a 422's
    ``field``/``loc`` name it (``reports[3].local.count``), not the block or the report."""

    def __init__(self, msg: str, *loc: str):
        super().__init__(msg)
        self.loc = loc


def _located(title: str, rules, obj, *args) -> None:
    """Run ``rules(obj, *args)``; a :class:`RuleError` becomes a ``value_error`` at its
    ``loc`` (a ValidationError raised in a validator keeps its locations, under the
    validated object's own: pydantic-core >= 2.x), worded as the ValueError it was."""
    try:
        rules(obj, *args)
    except RuleError as e:
        value = obj
        for part in e.loc:
            value = getattr(value, part, None)
        raise ValidationError.from_exception_data(title, [{"type": "value_error", "loc": e.loc, "input": value,
                                                           "ctx": {"error": ValueError(str(e))}}]) from None


class _Strict(BaseModel):
    # strict: "1" or true is not a step, 2.5 is not a rank (floats still accept integers)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _CoordsAPI:
    """What the service reads of a report's coordinates, shared by :class:`Coords` and the
    fast decoder's struct."""

    __slots__ = ()

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.dp, self.cp, self.tp, self.pp)

    def expert_tuple(self) -> tuple[int, int, int, int]:
        return (self.edp, self.ep, self.etp, self.pp)

    @property
    def is_origin(self) -> bool:
        """Every coordinate 0 (what a report without ``coords`` has)."""
        return not (self.dp or self.cp or self.tp or self.pp or self.edp or self.ep or self.etp)


class Coords(_Strict, _CoordsAPI):
    """A rank's coordinate along each parallel dimension (0-based): dense dp, cp, tp, pp
    and, with expert parallelism, expert edp, ep, etp (DESIGN.md §3.1)."""

    dp: NonNegInt = 0
    cp: NonNegInt = 0
    tp: NonNegInt = 0
    pp: NonNegInt = 0
    edp: NonNegInt = 0
    ep: NonNegInt = 0
    etp: NonNegInt = 0


class _SizesAPI:
    """What the service reads of a report's sizes, shared by :class:`Sizes` and the fast
    decoder's struct."""

    __slots__ = ()

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.dp, self.cp, self.tp, self.pp)

    @property
    def has_expert(self) -> bool:
        return self.edp is not None or self.ep is not None or self.etp is not None

    def expert_tuple(self) -> tuple[int, int, int, int] | None:
        """(edp, ep, etp, pp), or None without the expert factorisation."""
        if not self.has_expert:
            return None
        return (self.edp or 1, self.ep or 1, self.etp or 1, self.pp)

    def as_dict(self) -> dict[str, int]:
        """Every given size (expert ones only with the expert factorisation)."""
        out = {"dp": self.dp, "cp": self.cp, "tp": self.tp, "pp": self.pp}
        e = self.expert_tuple()
        if e is not None:
            out.update(edp=e[0], ep=e[1], etp=e[2])
        return out

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def is_default(self) -> bool:
        """All dense sizes 1 and no expert factorisation (what a report without ``sizes`` has)."""
        return self.dp == self.cp == self.tp == self.pp == 1 and not self.has_expert


class Sizes(_Strict, _SizesAPI):
    """Size of each parallel dimension; world_size is the product dp·cp·tp·pp, and also
    edp·ep·etp·pp when any expert size is given (the expert factorisation, DESIGN.md §3.1)."""

    dp: PosInt = 1
    cp: PosInt = 1
    tp: PosInt = 1
    pp: PosInt = 1
    edp: PosInt | None = None
    ep: PosInt | None = None
    etp: PosInt | None = None


# The spec rules (DESIGN.md §3 "Specs the engine cannot judge"): each a pure function of the
# engine's :class:`Spec` (and, for the placement, the run's sizes), raising a RuleError at
# the spec field it blames (``loc`` relative to the spec). Both decoders reach them through
# the same calls: :class:`StatisticSpec` (a report's ``spec``, decoded by pydantic on both
# paths, :func:`_spec_of`; a registration's), :func:`_spec_kind_rules` and
# :func:`spec_topology_rules` (:func:`_extended_rules` for a report, :class:`RunRegistration`
# for a registration). Each excludes a combination the checks and diagnoses of
# :mod:`auditor.core` take as impossible, whose audit would report findings that are not true.


def replicas_rule(spec: Spec, replicas_given: bool = True) -> None:
    """No dim both in ``reduce_over`` and in ``replicas``. The engine reads a reduced dim as
    one whose ranks hold different data (summed) and a replica dim as one whose ranks hold
    the same data (counted once, and compared: ``replica_divergence``); a dim that is both
    makes the correct value one rank's own and every sum over it a ``replica_overcount``
    that the diagnosis also calls a ``wrong_group`` ("divided by their local count only").
    RuleError at ``replicas``; ``replicas_given`` False words the default (``["tp"]``)."""
    both = [d for d in spec.replicas if d in spec.reduce_over]
    if both:
        default = "" if replicas_given else " (replicas defaults to ['tp'] when not given: send replicas)"
        raise RuleError(
            f"replicas {dims_text(spec.replicas)} and reduce_over {dims_text(spec.reduce_over)} both name "
            f"{dims_text(both)}{default}: a dim is reduced over (its ranks hold different data, summed) or a "
            "replica dim (its ranks hold the same data, counted once), not both; the audit could not tell a "
            f"correct reduction over {dims_text(both)} from replicas summed. Remove {dims_text(both)} from "
            "one of them", "replicas")


def replicated_along_rule(spec: Spec) -> None:
    """``replicated_along`` lies inside ``reduce_over``: it names the dims of the reduction
    group along which a ``norm``'s ``replicated_sum_sq`` is identical, so that it is counted
    once per class of the group (DESIGN.md §3.1); a dim outside the group has no two members
    of one group along it, and ``replica_divergence`` would compare ranks of different groups.
    RuleError at ``replicated_along``."""
    if spec.replicated_along is None:
        return
    outside = [d for d in spec.replicated_along if d not in spec.reduce_over]
    if outside:
        raise RuleError(
            f"replicated_along {dims_text(spec.replicated_along)} names {dims_text(outside)}, outside reduce_over "
            f"{dims_text(spec.reduce_over)}: it lists the dims of the reduction group along which "
            "replicated_sum_sq is identical (counted once); use a subset of reduce_over, or null (the whole group)",
            "replicated_along")


def placement_rule(spec: Spec, sizes: Mapping[str, int]) -> None:
    """Every placed coordinate lies inside its dim, and a dim the spec reduces over is placed
    on all its coordinates or not at all: an all-reduce over a dim hands its result to every
    rank along it, so all of them hold (and report) the statistic; with a placement along it
    the engine would count the group's unplaced members out and the service would refuse
    their reports (``placement_conflict``). ``sizes``: {dim: size} of the run's
    factorisations (a dim not in it has size 1). RuleError at ``placement.<dim>``."""
    try:
        placed = spec.placed(sizes)
    except ValueError as exc:  # "spec.placement.<dim> holds ..."
        m = re.match(r"spec\.placement\.(\w+)", str(exc))
        raise RuleError(str(exc), "placement", *([m.group(1)] if m else [])) from None
    for d, sel in placed.items():
        n = sizes.get(d, 1)
        if d in spec.reduce_over and len(sel) < n:
            raise RuleError(
                f"placement.{d} places the statistic on {d} coordinates {sel} of {n}, but reduce_over "
                f"{dims_text(spec.reduce_over)} reduces over {d}: an all-reduce over {d} hands its result to every "
                f"{d} rank, so all {n} hold the statistic. Place it along dims outside reduce_over, or drop {d} "
                "from reduce_over", "placement", d)


def _prefixed(rules, prefix: tuple[str, ...], *args) -> None:
    """``rules(*args)``, its RuleError re-raised with ``prefix`` before its ``loc`` (a spec
    rule blames a field of the spec; the caller knows where the spec sits)."""
    try:
        rules(*args)
    except RuleError as e:
        raise RuleError(str(e), *prefix, *e.loc) from None


def spec_topology_rules(spec: Spec, sizes: Mapping[str, int], has_expert: bool) -> None:
    """The spec against a known topology (a report's own, or a registered run's): expert dims
    need the expert factorisation (``has_expert``), and :func:`placement_rule` on ``sizes``
    (the run's dims, expert ones included). RuleError with ``loc`` relative to the spec."""
    if spec.factorisation == "expert" and not has_expert:
        raise RuleError("spec names expert dims (edp, ep, etp) but sizes carry no expert factorisation")
    placement_rule(spec, sizes)


class StatisticSpec(_Strict):
    """How a statistic must be reduced (DESIGN.md §3).

    ``reduce_over``: dims whose ranks form one reduction group (a rank's expected group is
    every rank equal to it on the other dims). ``replicas``: dims along which ranks hold the
    same data, counted once. ``variance``: Bessel-corrected (``sample``) or ``population``.
    ``over_microbatches``: a ``sum`` statistic is summed over all microbatches of the step.
    """

    reduce_over: list[Dim] = Field(default_factory=lambda: ["dp", "cp"], max_length=len(DIMS))
    replicas: list[Dim] = Field(default_factory=lambda: ["tp"], max_length=len(DIMS))
    variance: Literal["sample", "population"] = "sample"
    over_microbatches: bool = False
    #: Where the statistic lives (DESIGN.md §3.1): dim → coordinates; "first"/"last" are
    #: stored as [0]/[-1]; negative coordinates count from the end. {} = every rank.
    placement: dict[Dim, Literal["first", "last"] | Annotated[list[Annotated[int, Field(ge=-(1 << 20), le=1 << 20)]],
                                                             Field(min_length=1, max_length=1 << 12)]] = Field(
        default_factory=dict)
    #: ``norm``: dims along which ``replicated_sum_sq`` is identical; None = the whole group (v1).
    replicated_along: list[Dim] | None = None

    @model_validator(mode="after")
    def _unique_dims(self) -> "StatisticSpec":
        _located("StatisticSpec", StatisticSpec._spec_rules, self)
        return self

    def _spec_rules(self) -> None:
        """No dim twice in a list, placement normalised, one factorisation, then
        :func:`replicas_rule` and :func:`replicated_along_rule`; RuleError naming the field."""
        for name in ("reduce_over", "replicas", "replicated_along"):
            dims = getattr(self, name) or []
            if len(set(dims)) != len(dims):
                raise RuleError(f"{name} lists a dimension twice: {dims}", name)
        if self.placement:
            norm = {}
            for d, sel in self.placement.items():
                sel = [0] if sel == "first" else [-1] if sel == "last" else sorted(set(sel))
                norm[d] = sel
            object.__setattr__(self, "placement", norm)
        named = set(self.reduce_over) | set(self.replicas) | set(self.replicated_along or ()) | set(self.placement)
        if named & layout.EXPERT_ONLY and named & layout.DENSE_ONLY:
            # blamed: the first field naming an expert dim
            field = next(f for f in ("reduce_over", "replicas", "replicated_along", "placement")
                         if set(getattr(self, f) or ()) & layout.EXPERT_ONLY)
            raise RuleError(
                f"the spec mixes dense dims {sorted(named & layout.DENSE_ONLY)} with expert dims "
                f"{sorted(named & layout.EXPERT_ONLY)}: a statistic is judged in one factorisation, "
                "(dp, cp, tp, pp) or (edp, ep, etp, pp)", field)
        core = self.to_core()
        replicas_rule(core, "replicas" in self.model_fields_set)
        replicated_along_rule(core)

    def to_core(self) -> Spec:
        """The audit engine's :class:`auditor.core.types.Spec` (dims in the order given)."""
        return Spec(tuple(self.reduce_over), tuple(self.replicas), self.variance, self.over_microbatches,
                    tuple((d, tuple(sel)) for d, sel in self.placement.items()),
                    None if self.replicated_along is None else tuple(self.replicated_along))

    @property
    def factorisation(self) -> str:
        """``"expert"`` when the spec names edp, ep or etp, else ``"dense"``."""
        return self.to_core().factorisation

    def placed(self, sizes: dict[str, int]) -> dict[str, list[int]]:
        """``placement`` with negative coordinates resolved against ``sizes``; raises
        ValueError naming the dim for a coordinate outside [-size, size)."""
        return self.to_core().placed(sizes)


DEFAULT_SPECS: dict[str, StatisticSpec] = {
    "moments": StatisticSpec(),
    "sum": StatisticSpec(),
    "norm": StatisticSpec(reduce_over=["tp", "pp"], replicas=["dp", "cp"]),
}


_INF, _NEG_INF = math.inf, -math.inf
_isfinite = math.isfinite



def _local_rules(loc) -> None:
    """The rules of a ``local`` block (:class:`LocalStats` or its fast-decoder twin):
    raises ValueError naming the field. A rule added here (or to :func:`_applied_rules`,
    :func:`_report_rules`) must also be flagged by :func:`_batch_holds`' array tests, or
    the fast decoder accepts what it breaks."""
    # ``x < 0`` is False for NaN and +Inf; ``x != -inf`` leaves -Inf out: "finite and < 0"
    # without a call per value (this runs once per report on the ingest hot path).
    c = loc.count
    if c is not None and c < 0 and c != _NEG_INF:
        raise RuleError(f"count must be >= 0, got {c}", "count")
    for name in ("sum_sq", "replicated_sum_sq"):
        v = getattr(loc, name)
        if v is not None and v < 0 and v != _NEG_INF:
            raise RuleError(f"{name} must be >= 0, got {v}", name)
    if c == 0:  # an empty mask: min/max by _range_error below
        for name in ("sum", "sum_sq"):
            v = getattr(loc, name)
            if v is not None and v != 0 and _isfinite(v):
                raise RuleError(_empty_sum_error(name, v), name)
    lo, hi = loc.min, loc.max
    if lo is not None or hi is not None:
        w = loc.weighted
        msg = _range_error("min", lo, loc.count, loc.sum, loc.sum_sq, weighted=w)
        if msg:
            raise RuleError(msg, "min")
        msg = _range_error("max", hi, loc.count, loc.sum, loc.sum_sq, lo, weighted=w)
        if msg:
            raise RuleError(msg, "max")


def _empty_sum_error(name: str, v: float) -> str:
    """The message of ``local.<name>`` (``sum`` or ``sum_sq``) not 0 beside ``count`` 0.

    The rule (:func:`_local_rules`, every kind): ``count = Σm`` with weights ``m >= 0`` is 0
    only when every weight is 0, so each term ``m·v`` (``m·v²``) is ±0 for finite ``v`` and
    their sum is exactly 0 in any precision and summation order (IEEE 754: x + (±0) = x;
    no rounding). A non-zero finite sum beside it is not rounding: no masked data makes it.
    NaN/±Inf stay accepted (``0·NaN`` is NaN: a masked-out NaN poisons ``Σm·v``; the audit
    flags it ``non_finite``)."""
    return (f"{name} must be 0 when count is 0, got {v!r}: count = Σm = 0 leaves no element masked in, and a "
            "sum of no terms is exactly 0 in any precision")


#: Slack of the range rules (:func:`_range_error`): the loosest rounding of any dtype a report
#: may name (bfloat16's unit roundoff 2^-8), so no correct float32/16 accumulation trips them.
_RANGE_REL = max(UNIT_ROUNDOFF.values())
#: Slack of the mean rule: float32's unit roundoff (local sums are float64 or float32
#: accumulations); past ``_MEAN_COUNT`` terms γ_n no longer bounds anything and the rule is off.
_MEAN_REL, _MEAN_ABS = UNIT_ROUNDOFF["float32"], 2.0**-126
_MEAN_COUNT = 0.25 / UNIT_ROUNDOFF["float32"]
#: Below this magnitude a value's square may underflow (float16: sqrt of its smallest normal,
#: 2^-14), so the sum of squares says nothing about it.
_RANGE_ABS = 2.0**-7
#: Weighted masks: ``count`` = Σm is not the number of terms summed, so the mean rule's
#: slack assumes at least this many (float32 γ_n ≈ 2^-8 relative; float64 sums of any length
#: stay far inside it), and ``count``'s own rounding is added in (:func:`_range_error`).
_WEIGHTED_TERMS = 2.0**16


def _is_empty_identity(side: str, v: float, count) -> bool:
    """Whether ``local.<side>`` (``"min"`` or ``"max"``) value ``v`` is the identity of its
    reduction beside ``count`` 0: ``min = +inf`` or ``max = -inf``, what a trainer's
    ``x.masked_fill(~mask, inf).min()`` (``-inf`` and ``.max()``) returns for an all-masked
    tensor. Such a value means "no min/max", exactly as null: :class:`LocalStats` turns it
    into None at decode (the stored row holds NULL, ``non_finite`` stays empty, the audit
    sees an absent min/max; an empty set has none, :func:`_range_error`). JSON has no
    infinity: the wire carries it as the ``Infinity``/``-Infinity`` tokens (Python's
    ``json.dumps``, the client's encoding) or a number beyond float range (``1e400``); msgspec
    reads neither, so such a body always takes the pydantic path (:func:`parse_report_batch`)
    and a :class:`FastLocal` never holds one (``FastReport.values_finite``).

    Each side on its own (a trainer may send only one). Not identities, and unchanged (stored,
    flagged ``non_finite`` by the audit): ``min = -inf`` or ``max = +inf`` with count 0 (the
    opposite identity: not what any reduction of nothing returns), any infinity beside a
    count > 0 or a count that is absent, NaN or non-zero (there were elements: an infinite
    min/max is a value), and NaN."""
    return count == 0 and v == (_INF if side == "min" else _NEG_INF)


def _range_error(side: str, v, count, total, total_sq, lo=None, weighted: bool = False) -> str | None:
    """The message of the first rule ``local.<side>`` (``"min"`` or ``"max"``, value ``v``)
    breaks against the other moments of its block, else None. Shared by :class:`LocalStats`
    (a field validator per side, so the 422 names ``reports[i].local.min`` or ``.max``) and
    the fast decoder (:func:`_local_rules`): both refuse the same bodies.

    Rules, on finite values only (NaN/±Inf go on to the audit as ``non_finite``):

    * ``count == 0``: no value at all. min/max are over the elements with ``m != 0``
      (DESIGN.md §3), and ``count = Σm = 0`` with ``m >= 0`` leaves none: an empty set has
      no min or max (:class:`auditor.core.stats.Moments`: ``nan`` when N == 0; the hooks'
      ``masked_moments`` sends null). A finite one is not what any masked data gives. The
      reductions' identities ``min = +inf``/``max = -inf`` mean null and never get here
      (:func:`_is_empty_identity`); the opposite infinities stay ``non_finite``.
    * ``max >= min`` (``lo`` is ``min`` when checking ``max``).
    * ``|v| <= sqrt(sum_sq)·(1 + 2^-8) + 2^-7``: every masked-in element's square is a term
      of ``sum_sq = Σ m·v²``. Rounding is monotone, so a float sum of non-negative terms,
      in any order and precision, is ``>= fl(v²) >= v²(1 − u)`` for each term whose square
      is a normal number; ``2^-8`` covers ``u`` of every dtype (bfloat16 the loosest) and
      ``2^-7`` the values whose square underflows (float16). It holds for 0/1 masks
      (DESIGN.md §4), not for weights below 1 (``masked_moments`` accepts weighted masks:
      values (3, 0) with weights (0.5, 0.5) give ``sum_sq`` 4.5 < 3²). So it is skipped
      when the report says ``local.weighted`` (the hooks set it for a floating mask with an
      entry outside {0, 1}), and also when ``count`` is not a whole number (no 0/1 mask
      gives one: a weighted report of a client that predates the flag). Its message says
      to set the flag.
    * the mean ``sum/count`` lies in ``[min, max]`` up to
      ``(n + 1)·2^-24·(|mean| + 2·|min or max|)`` (+ float32's smallest normal per term):
      a weighted mean with non-negative weights lies within its values. The slack bounds
      the rounding of a float32 recursive sum of ``n`` terms (Higham's ``γ_n·Σ|m·v|``, and
      ``Σ|m·v|/count <= |mean| + 2·|min|`` on the min side, likewise for max). 0/1 masks:
      ``n = count`` (exact), checked for ``0 < count < 2^22`` (beyond, γ_n bounds nothing).
      Weighted: ``n`` is unknown, taken as ``max(count, 2^16)`` and the slack doubled (the
      count Σm is rounded too), checked for ``0 < count < 2^22``.

    What these rules exclude is what made an audit meaningless: ``min/max = ∓1e308`` with
    ``sum_sq ≈ 170`` gave a consistent step an applied-error σ of 7.8e299."""
    if v is None or not _isfinite(v):
        return None
    if count == 0:
        return (f"{side} must be null when count is 0, got {v!r}: no element is masked in, so there is no {side} "
                "(masked_moments sends null)")
    if side == "max" and lo is not None and _isfinite(lo) and lo > v:
        return f"min ({lo}) must be <= max ({v})"
    if not weighted and count is not None and not (_isfinite(count) and count == int(count)):
        weighted = True  # no 0/1 mask has a fractional count
    if not weighted and total_sq is not None and _isfinite(total_sq) and total_sq >= 0:
        root = math.sqrt(total_sq)
        if abs(v) > root * (1.0 + _RANGE_REL) + _RANGE_ABS:
            return (f"|{side}| ({abs(v):.6g}) is larger than √sum_sq allows for a 0/1 mask (√sum_sq = "
                    f"{root:.6g}; min and max are those of the elements counted in count/sum/sum_sq); if the mask "
                    f"weights elements, set local.weighted=true")
    if (count is not None and total is not None and _isfinite(count) and _isfinite(total)
            and 0 < count < _MEAN_COUNT):
        mean = total / count
        n = max(count, _WEIGHTED_TERMS) * 2.0 if weighted else count
        slack = (n + 1.0) * _MEAN_REL * (abs(mean) + 2.0 * abs(v)) + (n + 1.0) * _MEAN_ABS
        if (side == "min" and mean < v - slack) or (side == "max" and mean > v + slack):
            return (f"the mean sum/count ({mean:.6g}) lies {'below min' if side == 'min' else 'above max'} "
                    f"({v:.6g}): a mean of the masked-in elements lies between their min and max")
    return None


def _applied_rules(a) -> None:
    """The rules of an ``applied`` block (:class:`AppliedStats` or its fast-decoder twin)."""
    c, ss = a.count, a.sum_sq
    if c is not None and c < 0 and c != _NEG_INF:
        raise RuleError(f"count must be >= 0, got {c}", "count")
    if ss is not None and ss < 0 and ss != _NEG_INF:
        raise RuleError(f"sum_sq must be >= 0, got {ss}", "sum_sq")


class LocalStats(_Strict):
    """This rank's own masked statistics before the all-reduce (float64 recommended).

    ``moments``: count, sum, sum_sq required (min, max optional). ``sum``: sum required.
    ``norm``: sum_sq required, replicated_sum_sq optional. With count 0, ``min = +Infinity``
    and ``max = -Infinity`` (the identities of min/max reductions) are read as null
    (:func:`_is_empty_identity`).
    """

    count: float | None = None
    sum: float | None = None
    sum_sq: float | None = None
    #: Declared before min/max: their validators read it.
    weighted: bool = Field(False, description=(
        "true when the mask weights elements (a floating mask with an entry other than 0 or 1: count = Σm, "
        "sum = Σm·v, sum_sq = Σm·v², min/max over m != 0). It turns off the ingest rule "
        "|min|, |max| <= √sum_sq, which holds only for 0/1 masks (values (3, 0) with weights (0.5, 0.5) have "
        "sum_sq 4.5 < 3²); min <= max and the mean within [min, max] still apply. Not stored. The hooks "
        "(masked_moments) set it."))
    min: float | None = None
    max: float | None = None
    replicated_sum_sq: float | None = None

    @field_validator("min", "max")
    @classmethod
    def _range(cls, v: float | None, info: ValidationInfo) -> float | None:
        d = info.data
        if v is not None and _is_empty_identity(info.field_name, v, d.get("count")):
            return None  # no min/max, as null (stored NULL, not non_finite)
        msg = _range_error(info.field_name, v, d.get("count"), d.get("sum"), d.get("sum_sq"), d.get("min"),
                           weighted=d.get("weighted", False))
        if msg:
            raise ValueError(msg)
        return v

    @model_validator(mode="after")
    def _rules(self) -> "LocalStats":
        _located("LocalStats", _local_rules, self)
        return self


class AppliedStats(_Strict):
    """What the rank's all-reduce returned, and optionally the mean/var it whitened with."""

    count: float | None = None
    sum: float | None = None
    sum_sq: float | None = None
    mean: float | None = None
    var: float | None = None

    @model_validator(mode="after")
    def _rules(self) -> "AppliedStats":
        _located("AppliedStats", _applied_rules, self)
        return self


#: The smallest positive normal number of each wire dtype (tf32 and bfloat16 keep float32's
#: 8-bit exponent): below it a square or a partial sum may be subnormal or flushed to zero.
_SMALLEST_NORMAL = {"float64": 2.0**-1022, "float32": 2.0**-126, "tf32": 2.0**-126, "bfloat16": 2.0**-126,
                    "float16": 2.0**-14}
assert set(_SMALLEST_NORMAL) == set(UNIT_ROUNDOFF)


def _check_cauchy_schwarz(where: str, count, total, total_sq, dtype: str, weighted: bool = False) -> None:
    """Reject a rank's local ``sum_sq < sum²/count`` beyond what rounding and underflow can
    produce (never ``applied``'s: see :func:`_report_rules`): no real data has negative
    variance (Cauchy–Schwarz, ``(Σm·v)² <= Σm · Σm·v²`` for weights ``m >= 0``). Raises
    :class:`RuleError` at ``<where>.sum_sq``; no rule for a count ``<= 0`` or a non-finite
    value (NaN/Inf go on to the audit).

    The variance the sums imply, ``var = sum_sq/count − (sum/count)²``, is refused when it is
    below ``−(tv + abs/count)``, i.e. when ``sum²/count − sum_sq > count·tv + abs``:

    * ``tv``: the engine's bound on the rounding of a correct one-pass variance whose true
      value is 0 (:func:`auditor.core.stats.mean_var_tolerance` with M2 = 0, population
      convention, one rank: ``7γ·μ² + τ_var``, μ = sum/count; Chan, Golub & LeVeque 1983, §2;
      Higham 2002, §1.9 and eq. 4.6), with the γ the engine's tolerances use for a reduction
      in the reported dtype (:func:`auditor.core.stats.reduction_gamma`:
      ``u·(⌈log2 n⌉ + 3)``, every operation at the dtype's ``u``). So the wire refuses no
      sums the engine would call a correctly rounded reduction of real data. Sums that cancel
      (|mean|/std ≳ 1/√(7γ), ~400 for 2,000 float32 values: the true variance σ² is below
      the bound, and rounding may leave ``sum²/count > sum_sq``) are stored, and the audit
      says what the cancellation costs (``precision_loss``,
      :func:`auditor.core.stats.one_pass_variance_error`, whose numerator is this bound at
      σ = 0). Measured with torch 2.13 CPU float32 ``.sum()`` (n from 2 to 4·10⁶, |mean|/std
      from 1e2 to 1e4, masked 2-D tensors too): ``sum²/count − sum_sq`` at most 2.6u·sum²/count,
      against ``7γ`` ≥ 28u (tests/test_decode.py, tests/server/test_trust.py). The rule was
      ``64u·max(log2 n, 1)`` relative, 2.3–8× looser than this, a model of its own.
      ``reduction_gamma`` rather than the tighter ``accumulated_gamma_array`` (torch's
      float32 accumulator for bfloat16/float16): sums formed in bfloat16 arithmetic are
      correct data too.
    * ``abs = 2·(n + 1)·tiny``, ``tiny`` the dtype's smallest normal (:data:`_SMALLEST_NORMAL`):
      flush-to-zero, which the engine's underflow floor τ does not cover. The square of an
      element ``|v| < √tiny`` (~1.1e-19 in float32) is subnormal or, with flush-to-zero
      (GPUs), 0, so each of the ``n`` squares may lose up to ``tiny`` (``v² < tiny``) that the
      relative bound does not see, and each of the ``n − 1`` additions may lose up to ``tiny``
      more when a partial sum is subnormal and flushed. Meanwhile ``sum²/count`` (computed
      here in float64) stays positive: float32 values of magnitude 1e-31 give ``sum_sq`` 0
      but ``sum²/count`` ~1e-62. What ``sum``'s own flushes add to ``sum²/count``
      (< ``2·|sum|·tiny + n·tiny²``) is below the relative part (≥ 28u·sum²/count) unless
      ``|sum| < n·tiny/(14u)``, and then below ``tiny``: the ``+ 1``.

    ``n`` (the terms summed) is ``count`` for a 0/1 mask; a weighted mask (``weighted``, or a
    fractional count) sums an unknown number of terms, taken as ``max(count, 2^16)`` as in
    the mean rule, in γ and in ``abs``.
    """
    if (count is None or total is None or total_sq is None or not count > 0
            or not (_isfinite(count) and _isfinite(total) and _isfinite(total_sq))):
        return
    floor = total * total / count
    if total_sq >= floor:  # the common case; the slack below is >= 0
        return
    n = max(count, _WEIGHTED_TERMS) if weighted or count != int(count) else count
    with np.errstate(all="ignore"):  # sum² beyond float range: floor and slack are inf, nothing refused
        gamma = reduction_gamma(dtype, n, 1)
        _, tv = mean_var_tolerance(gamma, count, total / count, 0.0, "population",
                                   spacing=SUBNORMAL_SPACING[dtype], ranks=1.0)
        slack = count * float(tv) + 2.0 * (n + 1.0) * _SMALLEST_NORMAL[dtype]
    if floor - total_sq > slack:
        raise RuleError(
            f"{where}.sum_sq ({total_sq!r}) is below {where}.sum²/{where}.count ({floor!r}) "
            f"beyond {dtype} rounding: the values would have negative variance", where, "sum_sq")


_REQUIRED_APPLIED: dict[str, str] = {"sum": "sum", "norm": "sum_sq"}

_REQUIRED_LOCAL: dict[str, tuple[str, ...]] = {
    "moments": ("count", "sum", "sum_sq"),
    "sum": ("sum",),
    "norm": ("sum_sq",),
}

#: Megatron order strings parsed once each (a bad one raises its ValueError every time).
_parse_order = functools.lru_cache(maxsize=256)(layout.parse_order)


@functools.lru_cache(maxsize=1 << 14)
def _order_coords(rank: int, order: str, dp: int, cp: int, tp: int, pp: int,
                  edp: int | None, ep: int | None, etp: int | None) -> tuple[tuple[str, int], ...]:
    """``layout.coords_of`` of a rank (memoised: the ranks of a run repeat every step)."""
    sizes = {"dp": dp, "cp": cp, "tp": tp, "pp": pp}
    if edp is not None or ep is not None or etp is not None:
        sizes.update(edp=edp or 1, ep=ep or 1, etp=etp or 1)
    return tuple(layout.coords_of(rank, sizes, order).items())


def _ranks_facts(ranks: list[int]) -> tuple[bool, int]:
    """(no rank twice, the largest rank or -1) of a group_ranks list."""
    return len(set(ranks)) == len(ranks), max(ranks, default=-1)


def _report_rules(r, core_spec: Spec | None = None, ranks_facts: tuple[bool, int] | None = None) -> None:
    """The cross-field rules of one report (:class:`Report`, or the fast decoder's struct
    whose ``spec`` is already a :class:`StatisticSpec`); raises ValueError naming the
    fields (the first rule broken, in this order). ``core_spec``: ``r.spec.to_core()``,
    ``ranks_facts``: ``_ranks_facts(r.group_ranks)`` if the caller has them at hand."""
    _shape_rules(r, core_spec)
    loc, kind = r.local, r.kind
    if not (kind == "moments" and loc.count is not None and loc.sum is not None and loc.sum_sq is not None):
        missing = [f for f in _REQUIRED_LOCAL[kind] if getattr(loc, f) is None]
        if missing:
            raise RuleError(f"{', '.join('local.' + f for f in missing)} required for kind '{kind}'", "local",
                            missing[0])
    _group_rules(r, ranks_facts)
    _check_cauchy_schwarz("local", loc.count, loc.sum, loc.sum_sq, r.dtype, loc.weighted)
    a = r.applied
    if a is not None:
        if kind == "moments":
            if a.mean is None and (a.count is None or a.sum is None or a.sum_sq is None):
                raise RuleError("applied must carry count, sum and sum_sq (what the all-reduce returned) or "
                                "mean (and var, what the rank whitened with) for kind 'moments': nothing "
                                "else can be checked",
                                "applied", "mean" if a.var is not None else
                                next(f for f in ("count", "sum", "sum_sq") if getattr(a, f) is None))
        elif getattr(a, _REQUIRED_APPLIED[kind]) is None:
            raise RuleError(f"applied.{_REQUIRED_APPLIED[kind]} required for kind '{kind}' "
                            "(use applied: null when the rank skipped the collective)", "applied",
                            _REQUIRED_APPLIED[kind])
    # No Cauchy–Schwarz rule on ``applied``: it is what the all-reduce returned, and a wrong
    # reduction can return sums no data has (global count and sum beside a local sum_sq).
    # That is a finding for the audit (group_mismatch), not a 422 that drops the statistic.


def _shape_rules(r, core_spec: Spec | None = None) -> None:
    """The rules of :func:`_report_rules` on a report's place in the world: topology,
    sizes against world_size, rank, coords, microbatch (and :func:`_extended_rules`). With
    :func:`_group_rules` they read only ``world_size``, ``rank``, ``microbatch``,
    ``num_microbatches``, ``sizes``, ``coords``, ``order``, ``topology``, ``spec`` and
    ``group_ranks``: the fast decoder checks each distinct combination once per batch."""
    # Runs once per report on the pydantic path: plain attribute tests first, the
    # messages only when a rule fails.
    s, c = r.sizes, r.coords
    if (r.topology == "unknown" or r.order is not None or r.spec is not None or s.has_expert
            or c.edp or c.ep or c.etp):
        _extended_rules(r, core_spec)
    if r.topology == "unknown":
        pass
    elif s.dp * s.cp * s.tp * s.pp != r.world_size:
        raise RuleError(
            f"world_size ({r.world_size}) must equal the product of sizes "
            f"dp*cp*tp*pp = {s.world_size}", "world_size")
    if r.rank >= r.world_size:
        raise RuleError(f"rank ({r.rank}) must be < world_size ({r.world_size})", "rank")
    if c.dp >= s.dp or c.cp >= s.cp or c.tp >= s.tp or c.pp >= s.pp:
        for dim, ci, si in zip(DIMS, c.as_tuple(), s.as_tuple()):
            if ci >= si:
                raise RuleError(f"coords.{dim} ({ci}) must be < sizes.{dim} ({si})", "coords", dim)
    if r.microbatch >= r.num_microbatches:
        raise RuleError(
            f"microbatch ({r.microbatch}) must be < num_microbatches ({r.num_microbatches}); "
            "send num_microbatches with every report of a step that has several microbatches", "microbatch")


def _group_rules(r, ranks_facts: tuple[bool, int] | None = None) -> None:
    """``group_ranks`` (if given) lists no rank twice and none >= world_size."""
    gr = r.group_ranks
    if gr is not None:
        unique, top = _ranks_facts(gr) if ranks_facts is None else ranks_facts
        if not unique:
            raise RuleError("group_ranks lists a rank twice", "group_ranks")
        if top >= r.world_size:
            bad = [x for x in gr if x >= r.world_size]
            raise RuleError(f"group_ranks holds ranks >= world_size ({r.world_size}): {bad[:5]}", "group_ranks")


def _spec_kind_rules(kind: str, spec: "StatisticSpec") -> None:
    """What a spec may say for a statistic of ``kind`` (DESIGN.md §3): only a ``sum`` is
    reduced over the microbatches of its step, only a ``norm`` has a replicated part
    (``replicated_along``; the engine reads it for no other kind). RuleError at
    ``spec.over_microbatches`` or ``spec.replicated_along``."""
    if spec.over_microbatches and kind != "sum":
        raise RuleError(f"spec.over_microbatches applies to kind 'sum' only; a {kind!r} statistic is judged per "
                        "microbatch (each microbatch's reports form their own groups): send one statistic per "
                        "microbatch, or sums", "spec", "over_microbatches")
    if spec.replicated_along is not None and kind != "norm":
        raise RuleError(f"spec.replicated_along applies to kind 'norm' only (the dims along which "
                        f"replicated_sum_sq is identical); a {kind!r} statistic has no replicated part: send "
                        "kind 'norm', or leave replicated_along out", "spec", "replicated_along")


def _extended_rules(r, core_spec: Spec | None) -> None:
    """The DESIGN.md §3.1 rules: unknown topology, expert sizes, order, spec dims."""
    s, c, spec = r.sizes, r.coords, r.spec
    if spec is not None:
        _spec_kind_rules(r.kind, spec)
    if r.topology == "unknown":
        if not s.is_default or not c.is_origin or r.order is not None:
            raise RuleError("topology 'unknown': omit coords, sizes and order (they would be a guess)",
                            "coords" if not c.is_origin else "sizes" if not s.is_default else "order")
        if r.group_ranks is None:
            raise RuleError("group_ranks required when topology is 'unknown': the service judges each rank "
                            "against the group it reduced over", "group_ranks")
        if r.rank not in r.group_ranks:
            raise RuleError(f"group_ranks must include the reporting rank ({r.rank})", "group_ranks")
        if spec is not None and spec.placement:
            raise RuleError("spec.placement needs a known topology", "spec", "placement")
        return
    e = s.expert_tuple()
    if e is not None:
        if e[0] * e[1] * e[2] * e[3] != r.world_size:
            raise RuleError(f"world_size ({r.world_size}) must equal the product of expert sizes "
                            f"edp*ep*etp*pp = {e[0] * e[1] * e[2] * e[3]}", "world_size")
        for dim, ci, si in zip(EXPERT_DIMS, c.expert_tuple(), e):
            if ci >= si:
                raise RuleError(f"coords.{dim} ({ci}) must be < sizes.{dim} ({si})", "coords", dim)
    elif c.edp or c.ep or c.etp:
        raise RuleError("coords carry expert dims but sizes do not: give sizes.edp, sizes.ep, sizes.etp", "coords",
                        next(d for d in ("edp", "ep", "etp") if getattr(c, d)))
    if r.order is not None:
        try:
            tokens = _parse_order(r.order)
        except ValueError as exc:
            raise RuleError(f"order: {exc}", "order") from None
        if e is not None and e[1] > 1 and "ep" not in tokens:
            raise RuleError(f"order {r.order!r} lacks ep but sizes.ep = {e[1]}", "order")
        for dim, ci in _order_coords(r.rank, r.order, s.dp, s.cp, s.tp, s.pp, s.edp, s.ep, s.etp):
            if getattr(c, dim) != ci:
                raise RuleError(f"coords.{dim} ({getattr(c, dim)}) is not what order {r.order!r} gives rank "
                                f"{r.rank} ({ci})", "coords", dim)
    if spec is not None:
        _prefixed(spec_topology_rules, ("spec",), spec.to_core() if core_spec is None else core_spec, s.as_dict(),
                  e is not None)


class Report(_Strict):
    """One rank's statistics of one (run, statistic, step, microbatch); see DESIGN.md §3.

    ``applied`` is ``null`` when the rank did not take part in the collective
    (``skipped_collective``). ``group_ranks`` is ``dist.get_process_group_ranks(group)`` of
    the group the rank reduced over, if the client knows it.
    """

    run_id: RunId
    statistic: StatisticName
    step: Step
    microbatch: NonNegInt = 0
    num_microbatches: PosInt = 1
    rank: NonNegInt
    world_size: PosInt
    coords: Coords = Field(default_factory=Coords)
    sizes: Sizes = Field(default_factory=Sizes)
    local: LocalStats
    applied: AppliedStats | None = None
    group_ranks: list[NonNegInt] | None = Field(default=None, max_length=_MAX_GROUP)
    dtype: DType = "float32"
    kind: Kind = "moments"
    spec: StatisticSpec | None = None
    #: Megatron's rank order, fastest-varying dim first (DESIGN.md §3.1); optional.
    order: Annotated[str, Field(max_length=_MAX_ORDER)] | None = None
    #: "unknown": the trainer does not know its coordinates; judged from group_ranks alone.
    topology: Literal["known", "unknown"] = "known"
    #: Where the rank's layout came from (``megatron.core.parallel_state``, ``megatron.core.mpu``,
    #: ``device_mesh``, ``AUDITOR_TOPOLOGY``, ... or why none: DESIGN.md §3.1); informational.
    topology_source: Annotated[str, Field(pattern=_SOURCE_PATTERN)] | None = None
    #: Not a field: whether every float of the report is known to be finite (no: the
    #: pydantic path reads NaN and Infinity; :class:`FastReport` says yes).
    values_finite: ClassVar[bool] = False

    @model_validator(mode="after")
    def _topology(self) -> "Report":
        _located("Report", _report_rules, self)
        return self

    @property
    def effective_spec(self) -> StatisticSpec:
        return self.spec or DEFAULT_SPECS[self.kind]


def expected_reports(r: WireReport) -> int:
    """Reports a step expects, from one of its reports: one per rank and microbatch
    (``world_size × num_microbatches``). The one place that says it: the ingest limits
    (``max_reports_per_step``) and the step's completion both read it."""
    return r.world_size * r.num_microbatches


def limit_errors(reports: list[WireReport], *, max_world_size: int, max_num_microbatches: int,
                 max_reports_per_step: int) -> list[dict]:
    """The configured limits (``auditor.config.Settings``) a validated batch breaks, as
    field errors (``type`` ``limit_exceeded``, ``loc`` naming the report and field); empty
    when it breaks none. The static bounds of the models above are hard ceilings; these are
    the deployment's own, checked before anything is stored."""
    out = []

    def add(i: int, name: str, msg: str) -> None:
        out.append({"loc": ("reports", i, name), "msg": msg, "type": "limit_exceeded"})

    for i, r in enumerate(reports):
        if r.world_size > max_world_size:
            add(i, "world_size", f"world_size ({r.world_size}) is above the limit {max_world_size} "
                                 "(AUDITOR_MAX_WORLD_SIZE)")
        elif r.num_microbatches > max_num_microbatches:
            add(i, "num_microbatches", f"num_microbatches ({r.num_microbatches}) is above the limit "
                                       f"{max_num_microbatches} (AUDITOR_MAX_NUM_MICROBATCHES)")
        elif expected_reports(r) > max_reports_per_step:
            add(i, "num_microbatches", f"a step of world_size {r.world_size} × num_microbatches "
                                       f"{r.num_microbatches} expects {expected_reports(r)} reports, above the "
                                       f"limit {max_reports_per_step} (AUDITOR_MAX_REPORTS_PER_STEP)")
    return out


class ReportBatch(_Strict):
    """Body of ``POST /v1/reports``: 1 to ``max_batch`` (default 10,000) reports."""

    reports: list[Report] = Field(min_length=1)


# ------------------------------------------------------------------ fast decode (msgspec)
# The same contract as the pydantic models above, as msgspec structs: a ``POST /v1/reports``
# body is decoded straight into them (no intermediate dicts, ~5x less CPU per report than
# pydantic; docs/performance.md "Decode") and checked by the same rule functions. A body they
# refuse, for whatever reason, is validated again by pydantic, which words the errors: the
# pydantic models stay the one source of the messages and of the OpenAPI schema, and these
# structs accept exactly the bodies pydantic accepts, with equal values
# (tests/test_decode.py checks both on random bodies). msgspec refuses a few bodies
# pydantic accepts (``NaN``/``Infinity`` tokens, numbers beyond float range): those take
# the pydantic path, as every body did before.

def _search_pattern(pattern: str) -> str:
    """A pydantic pattern (Rust regex: ``$`` is the end of the text) for msgspec (Python
    ``re.search``: ``$`` also matches before a final newline)."""
    assert pattern.startswith("^") and pattern.endswith("$")
    return pattern[:-1] + r"\Z"


#: run_id and statistic: their length bounds here, their patterns in :func:`_batch_holds`
#: against the names already matched (a regex search per name costs more than the rest of
#: the report's decode).
_FName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
_RUN_ID_RE = re.compile(_search_pattern(RUN_ID_PATTERN))
_STATISTIC_RE = re.compile(_search_pattern(STATISTIC_PATTERN))
_RUN_IDS: set[str] = set()
_STATISTICS: set[str] = set()
_SOURCE_RE = re.compile(_search_pattern(_SOURCE_PATTERN))
_SOURCES: set[str | None] = {None}


def _check_names(names, seen: set[str], rx: re.Pattern) -> None:
    """Raise ValueError unless every name (run ids, or statistics) matches its wire pattern
    ``rx`` and is :func:`addressable`; remember in ``seen`` those that do (at most 2^16)."""
    for name in names:
        if name not in seen:
            if rx.search(name) is None:
                raise ValueError(f"{name!r} does not match {rx.pattern}")
            addressable(name)
            if len(seen) >= 1 << 16:
                seen.clear()
            seen.add(name)
_FNonNeg = Annotated[int, msgspec.Meta(ge=0, le=_MAX_INT)]
_FStep = Annotated[int, msgspec.Meta(ge=0, le=_MAX_STEP)]
_FPos = Annotated[int, msgspec.Meta(ge=1, le=_MAX_SIZE)]


class _Fast(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """Base of the fast decoder's structs: unknown fields refused (``extra="forbid"``), not
    tracked by the cyclic GC (they make no reference cycles)."""


class FastCoords(_Fast, _CoordsAPI, frozen=True, kw_only=True):
    """:class:`Coords` as decoded by :func:`decode_report_batch`."""

    dp: _FNonNeg = 0
    cp: _FNonNeg = 0
    tp: _FNonNeg = 0
    pp: _FNonNeg = 0
    edp: _FNonNeg = 0
    ep: _FNonNeg = 0
    etp: _FNonNeg = 0


class FastSizes(_Fast, _SizesAPI, frozen=True, kw_only=True):
    """:class:`Sizes` as decoded by :func:`decode_report_batch`."""

    dp: _FPos = 1
    cp: _FPos = 1
    tp: _FPos = 1
    pp: _FPos = 1
    edp: _FPos | None = None
    ep: _FPos | None = None
    etp: _FPos | None = None


class FastLocal(_Fast, frozen=True, kw_only=True):
    """:class:`LocalStats` as decoded by :func:`decode_report_batch` (integers become floats,
    as in pydantic). Its rules (:func:`_local_rules`) are checked for the whole batch by
    :func:`_batch_holds`, not on construction."""

    count: float | None = None
    sum: float | None = None
    sum_sq: float | None = None
    weighted: bool = False
    min: float | None = None
    max: float | None = None
    replicated_sum_sq: float | None = None


class FastApplied(_Fast, frozen=True, kw_only=True):
    """:class:`AppliedStats` as decoded by :func:`decode_report_batch` (rules: :func:`_batch_holds`)."""

    count: float | None = None
    sum: float | None = None
    sum_sq: float | None = None
    mean: float | None = None
    var: float | None = None


class _TextCache:
    """Decoded values by their JSON text, bounded in entries and in text bytes (a body may
    hold megabytes of one field): emptied when either bound would be passed; a text longer
    than a quarter of the bytes is decoded every time. Dict operations only, safe across
    the worker threads that decode bodies (their races can only blur the byte count)."""

    def __init__(self, entries: int, text_bytes: int):
        self.entries, self.text_bytes = entries, text_bytes
        self.values: dict[bytes, tuple] = {}
        self.held = 0

    def get(self, key: bytes, make) -> tuple:
        hit = self.values.get(key)
        if hit is None:
            hit = make(key)
            if len(key) <= self.text_bytes // 4:
                if len(self.values) >= self.entries or self.held + len(key) > self.text_bytes:
                    self.values.clear()
                    self.held = 0
                self.values[key] = hit
                self.held += len(key)
        return hit


def _make_spec(text: bytes) -> tuple[StatisticSpec | None, Spec | None]:
    obj = pydantic_core.from_json(text, allow_inf_nan=True)
    spec = None if obj is None else StatisticSpec.model_validate(obj, strict=True)
    return spec, None if spec is None else spec.to_core()


#: A run's reports repeat one spec (a few distinct ones).
_SPECS = _TextCache(256, 4 << 20)


def _spec_of(raw: msgspec.Raw) -> tuple[StatisticSpec | None, Spec | None]:
    """The :class:`StatisticSpec` (validated by pydantic, strict, as in a :class:`Report`)
    and its engine spec of a report's raw ``spec`` JSON; ``(None, None)`` for ``null``."""
    return _SPECS.get(bytes(raw), _make_spec)


_RANKS_LIST = msgspec.json.Decoder(Annotated[list[_FNonNeg], msgspec.Meta(max_length=_MAX_GROUP)] | None)


def _make_ranks(text: bytes) -> tuple[list[int] | None, tuple[bool, int] | None]:
    ranks = _RANKS_LIST.decode(text)
    return ranks, None if ranks is None else _ranks_facts(ranks)


#: The reports of a step mostly carry one group (4 kB of JSON at 1,024 ranks).
_RANKS = _TextCache(256, 32 << 20)


def _ranks_of(raw: msgspec.Raw) -> tuple[list[int] | None, tuple[bool, int] | None]:
    """A report's raw ``group_ranks`` JSON as its list (one list object per distinct text:
    not to be changed) and :func:`_ranks_facts`; ``(None, None)`` for ``null``. Raises
    msgspec.ValidationError for anything but null or a list of ranks."""
    return _RANKS.get(bytes(raw), _make_ranks)


class FastReport(_Fast, kw_only=True):
    """:class:`Report` as decoded by :func:`decode_report_batch`: the same attributes (and
    ``coords``/``sizes`` methods) the service reads; ``spec`` is a :class:`StatisticSpec`
    (or None) once decoded. The rules are :class:`Report`'s, checked for the whole batch by
    :func:`_batch_holds` (not on construction: a struct made by hand is not checked)."""

    run_id: _FName
    statistic: _FName
    step: _FStep
    microbatch: _FNonNeg = 0
    num_microbatches: _FPos = 1
    rank: _FNonNeg
    world_size: _FPos
    coords: FastCoords = FastCoords()
    sizes: FastSizes = FastSizes()
    local: FastLocal
    applied: FastApplied | None = None
    #: Decoded as the raw JSON text (``null`` too), replaced by its list (or None) by
    #: :func:`_batch_holds`: the reports of a step mostly carry the same group, decoded and
    #: checked once and shared (a 1,024-rank group is 4 kB of JSON per report).
    group_ranks: msgspec.Raw = None  # type: ignore[assignment]
    dtype: DType = "float32"
    kind: Kind = "moments"
    #: Decoded as the raw JSON text (``null`` too); :func:`_batch_holds` replaces it with
    #: its :class:`StatisticSpec` or None.
    spec: msgspec.Raw = None  # type: ignore[assignment]
    order: Annotated[str, msgspec.Meta(max_length=_MAX_ORDER)] | None = None
    topology: Literal["known", "unknown"] = "known"
    #: its pattern checked in :func:`_batch_holds`, once per distinct text (as the names')
    topology_source: str | None = None
    #: Not a field: msgspec reads no NaN or Infinity token nor a number beyond float range,
    #: so every float of a fast-decoded report is finite (:func:`auditor.db.store.report_row`
    #: need not look for non-finite values).
    values_finite: ClassVar[bool] = True


#: What :func:`parse_report_batch` returns: pydantic reports or their fast-decoded twins,
#: read by the service through the same attributes.
WireReport = Report | FastReport


class _FastBatch(_Fast, kw_only=True):
    reports: Annotated[list[FastReport], msgspec.Meta(min_length=1)]


_FAST_BATCH = msgspec.json.Decoder(_FastBatch)


def decode_report_batch(body: bytes) -> list[FastReport] | None:
    """The reports of a valid ``POST /v1/reports`` body, decoded by msgspec and checked by
    :func:`_batch_holds`; None when the body breaks any rule or msgspec cannot read it
    (``NaN`` tokens, numbers beyond float range): :func:`parse_report_batch` then validates
    it with pydantic, which words the errors."""
    try:
        reports = _FAST_BATCH.decode(body).reports
        return reports if _batch_holds(reports) else None
    except Exception:  # whatever the reason: pydantic decides and words it
        return None


_get_run_id, _get_statistic = operator.attrgetter("run_id"), operator.attrgetter("statistic")
_get_source = operator.attrgetter("topology_source")
_get_spec, _get_group_ranks = operator.attrgetter("spec"), operator.attrgetter("group_ranks")
_get_order = operator.attrgetter("order")
#: Rows of tuples as one flat iterator (``np.fromiter`` reads None as NaN and bools as 0/1).
_chain = itertools.chain.from_iterable
_get_local, _get_applied, _get_kind = operator.attrgetter("local"), operator.attrgetter("applied"), operator.attrgetter("kind")
#: What :func:`_shape_rules` and :func:`_group_rules` read of a report, besides spec and group_ranks.
_SHAPE = operator.attrgetter("world_size", "rank", "microbatch", "num_microbatches", "sizes", "coords", "order",
                             "topology", "kind")
_LOCAL_VALUES = operator.attrgetter("count", "sum", "sum_sq", "min", "max", "replicated_sum_sq", "weighted")
_APPLIED_VALUES = operator.attrgetter("count", "sum", "sum_sq", "mean")
_NO_APPLIED_VALUES = (0.0, 0.0, 0.0, 0.0)
#: Below this many reports a batch's rules are checked report by report (~2.5 µs each)
#: rather than by the array tests (~40 µs a batch, then ~1 µs a report).
_BATCH_RULES_MIN = 32


def _batch_holds(reports: list[FastReport]) -> bool:
    """Whether freshly decoded reports keep every rule of :class:`Report` (and of its
    ``local``/``applied`` blocks); replaces each ``spec`` and ``group_ranks`` raw text by
    its value on the way. False (or an exception) when a rule is broken: the caller then
    lets pydantic validate the body, so this may refuse more than the models do, never less.

    The rules are checked per batch rather than per report (the per-report Python rules
    cost ~2 µs of the ~2.8 µs decode, docs/performance.md "Decode"):

    * names, specs and rank groups once per distinct text (the ``_TextCache`` caches);
    * :func:`_shape_rules` and :func:`_group_rules` once per distinct combination of the
      fields they read (a step's ranks repeat every step);
    * the value rules (:func:`_local_rules`, :func:`_applied_rules`, the fields each kind
      requires and :func:`_check_cauchy_schwarz`) as numpy array tests over the batch that
      flag every report that could break one; each flagged report is then checked by the
      exact rule functions. msgspec reads only finite floats, so a NaN in these columns is
      a field that was absent (None), and the tests repeat the rules' own float
      operations (IEEE: the same results); where they would need ``log2`` (Cauchy-Schwarz)
      or could differ at all, they flag more (``Q < S²/C`` instead of the slack).
    """
    n = len(reports)
    # Names and texts: once per distinct value.
    if not _RUN_IDS.issuperset(map(_get_run_id, reports)):
        _check_names(set(map(_get_run_id, reports)), _RUN_IDS, _RUN_ID_RE)
    if not _STATISTICS.issuperset(map(_get_statistic, reports)):
        _check_names(set(map(_get_statistic, reports)), _STATISTICS, _STATISTIC_RE)
    if not _SOURCES.issuperset(map(_get_source, reports)):
        for source in set(map(_get_source, reports)) - _SOURCES:
            if _SOURCE_RE.search(source) is None:
                raise ValueError(f"topology_source {source!r} does not match {_SOURCE_RE.pattern}")
            if len(_SOURCES) < 1 << 12:
                _SOURCES.add(source)
    specs = list(map(_get_spec, reports))
    ranks = list(map(_get_group_ranks, reports))
    cores: dict[int, Spec] = {}  # id(StatisticSpec) -> its engine spec
    facts: dict[int, tuple[bool, int]] = {}  # id(group_ranks list) -> _ranks_facts
    if specs.count(None) != n:
        last = spec = None
        for i, raw in enumerate(specs):
            if raw is not None:
                if raw != last:  # mostly the text of the report before (compared, not hashed)
                    spec, core = _spec_of(raw)
                    last = raw
                    if spec is not None:
                        cores[id(spec)] = core
                reports[i].spec = specs[i] = spec
    if ranks.count(None) != n:
        last = gr = None
        for i, raw in enumerate(ranks):
            if raw is not None:
                if raw != last:
                    gr, f = _ranks_of(raw)
                    last = raw
                    if gr is not None:
                        facts[id(gr)] = f
                reports[i].group_ranks = ranks[i] = gr

    def exact(r: FastReport) -> None:  # every rule of one report, by the exact functions
        _local_rules(r.local)
        if r.applied is not None:
            _applied_rules(r.applied)
        _report_rules(r, None if r.spec is None else cores[id(r.spec)],
                      None if r.group_ranks is None else facts[id(r.group_ranks)])

    if n < _BATCH_RULES_MIN:  # the array tests cost ~40 µs a batch: each report by the exact rules
        for r in reports:
            exact(r)
        return True

    # The shape rules: with an order, a spec or groups (the extended rules, ~0.8 µs a
    # report) once per distinct combination of what they read; specs and ranks hold
    # objects the reports keep alive, so their ids are theirs for the whole check. Plain
    # reports are cheaper to check one by one than to hash.
    if cores or facts or list(map(_get_order, reports)).count(None) != n:
        keys = zip(map(_SHAPE, reports), map(id, specs), map(id, ranks))
        for i in dict(zip(keys, range(n))).values():  # an index of each distinct combination
            r = reports[i]
            _shape_rules(r, None if r.spec is None else cores[id(r.spec)])
            if r.group_ranks is not None:
                _group_rules(r, facts[id(r.group_ranks)])
    else:
        for r in reports:  # no spec, no group_ranks
            _shape_rules(r)

    # The value rules: arrays over the batch flag the reports that could break one.
    locs = list(map(_get_local, reports))
    L = np.fromiter(_chain(map(_LOCAL_VALUES, locs)), dtype=np.float64, count=7 * n).reshape(n, 7)
    count, total, total_sq, lo, hi, rep_sq, weighted = L.T
    has_count, has_sum, has_sq = ~np.isnan(count), ~np.isnan(total), ~np.isnan(total_sq)
    with np.errstate(all="ignore"):
        suspect = (count < 0) | (total_sq < 0) | (rep_sq < 0) | (lo > hi)
        # an empty mask: sum and sum_sq 0, no min/max (NaN, an absent field, compares False)
        suspect |= (count == 0) & ((np.abs(total) > 0) | (total_sq > 0) | np.isfinite(lo) | np.isfinite(hi))
        # |min|, |max| <= sqrt(sum_sq)·(1 + 2^-8) + 2^-7 unless weighted (flag or fractional count)
        wt = (weighted != 0) | (has_count & (np.floor(count) != count))
        lim = np.sqrt(total_sq) * (1.0 + _RANGE_REL) + _RANGE_ABS
        suspect |= ~wt & ((np.abs(lo) > lim) | (np.abs(hi) > lim))
        # the mean sum/count within [min, max] up to its slack
        on = (count > 0) & (count < _MEAN_COUNT) & has_sum
        if on.any():
            mean = total / count
            terms = np.where(wt, np.maximum(count, _WEIGHTED_TERMS) * 2.0, count) + 1.0
            slack_lo = terms * _MEAN_REL * (np.abs(mean) + 2.0 * np.abs(lo)) + terms * _MEAN_ABS
            slack_hi = terms * _MEAN_REL * (np.abs(mean) + 2.0 * np.abs(hi)) + terms * _MEAN_ABS
            suspect |= on & ((mean < lo - slack_lo) | (mean > hi + slack_hi))
        # Cauchy-Schwarz: its slack needs log2, so every report below the exact floor is flagged
        suspect |= (count > 0) & has_sum & has_sq & ~(total_sq >= total * total / count)
        apps = list(map(_get_applied, reports))
        missing = apps.count(None)
        if missing != n:  # an absent applied block reads as zeros: no rule applies to it
            A = np.fromiter(_chain([_NO_APPLIED_VALUES if a is None else _APPLIED_VALUES(a) for a in apps] if missing
                                   else map(_APPLIED_VALUES, apps)), dtype=np.float64, count=4 * n).reshape(n, 4)
            a_count, a_sum, a_sq, a_mean = A.T
            has_a_sum, has_a_sq = ~np.isnan(a_sum), ~np.isnan(a_sq)
            suspect |= (a_count < 0) | (a_sq < 0)
        # the fields each kind requires (applied: moments its mean, or count, sum and sum_sq)
        kinds = list(map(_get_kind, reports))
        moments = slice(None) if kinds.count("moments") == n else np.array(kinds, dtype=object) == "moments"
        suspect[moments] |= ~(has_count & has_sum & has_sq)[moments]
        if missing != n:
            suspect[moments] |= (np.isnan(a_mean) & (np.isnan(a_count) | ~has_a_sum | ~has_a_sq))[moments]
        if not isinstance(moments, slice):
            k = np.array(kinds, dtype=object)
            suspect |= (k == "sum") & ~has_sum
            suspect |= (k == "norm") & ~has_sq
            if missing != n:
                suspect |= (k == "sum") & ~has_a_sum
                suspect |= (k == "norm") & ~has_a_sq
    for i in np.flatnonzero(suspect).tolist():
        exact(reports[i])
    return True


#: Reports validated per pydantic call by :func:`parse_report_batch`.
_CHUNK = 500
_REPORT_LIST = TypeAdapter(list[Report])


def parse_report_batch(body: bytes, max_errors: int) -> tuple[list[WireReport] | None, list[dict], int]:
    """Decode and validate a ``POST /v1/reports`` body: ``(reports or None, errors, number of
    reports)``. A valid body is decoded by msgspec (:func:`decode_report_batch`, into
    :class:`FastReport`); any other, and one msgspec cannot read, is validated by pydantic
    (:func:`validate_report_batch`, into :class:`Report`), whose errors are the answer."""
    fast = decode_report_batch(body)
    if fast is not None:
        return fast, [], len(fast)
    return validate_report_batch(body, max_errors)


def validate_report_batch(body: bytes, max_errors: int) -> tuple[list[Report] | None, list[dict], int]:
    """Decode and validate a ``POST /v1/reports`` body with the pydantic models: ``(reports
    or None, errors, number of reports)``.

    Validation errors cost memory (pydantic-core collects every one: a 15 MB body of
    invalid reports made 1.6 million errors and took 2.4 GB), so the reports are validated
    in chunks of ``_CHUNK`` and validation stops once ``max_errors`` errors are collected;
    the errors are those the whole-body :class:`ReportBatch` validation gives (same ``loc``,
    ``type`` and message), and the first ones of them. Peak memory is then the decoded body
    (~10× its size) plus one chunk's errors. ``NaN``/``Infinity`` tokens are accepted.
    """
    try:
        obj = pydantic_core.from_json(body, allow_inf_nan=True)
    except ValueError as e:
        return None, [{"loc": (), "msg": f"invalid JSON: {e}", "type": "json_invalid"}], 1
    items = obj.get("reports") if isinstance(obj, dict) else None
    if not isinstance(items, list) or not items or len(obj) != 1:
        try:  # the envelope is wrong: its errors, with each report validated as usual
            ReportBatch.model_validate(obj if not isinstance(items, list) else {**obj, "reports": items[:_CHUNK]},
                                       strict=True)
        except ValidationError as e:
            return None, e.errors(include_url=False, include_input=False)[:max_errors], \
                max(1, len(items) if isinstance(items, list) else 1)
    reports: list[Report] = []
    errors: list[dict] = []
    for start in range(0, len(items), _CHUNK):
        try:
            chunk = _REPORT_LIST.validate_python(items[start:start + _CHUNK], strict=True)
        except ValidationError as e:
            for err in e.errors(include_url=False, include_input=False):
                err["loc"] = ("reports", start + err["loc"][0], *err["loc"][1:])
                errors.append(err)
            if len(errors) >= max_errors:
                return None, errors[:max_errors], len(items)
            continue
        if not errors:
            reports.extend(chunk)
    return (None if errors else reports), errors, len(items)


class StatisticRegistration(_Strict):
    kind: Kind = "moments"
    spec: StatisticSpec | None = None

    @model_validator(mode="after")
    def _kind_and_spec(self) -> "StatisticRegistration":
        if self.spec is not None:
            _located("StatisticRegistration", lambda reg: _spec_kind_rules(reg.kind, reg.spec), self)
        return self


class RunRegistration(_Strict):
    """Body of ``PUT /v1/runs/{run_id}``: fixes the topology (and optionally statistic specs)."""

    world_size: PosInt
    sizes: Sizes = Field(default_factory=Sizes)
    order: Annotated[str, Field(max_length=32)] | None = None
    topology: Literal["known", "unknown"] = "known"
    statistics: dict[StatisticName, StatisticRegistration] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _world(self) -> "RunRegistration":
        _located("RunRegistration", RunRegistration._world_rules, self)
        return self

    def _world_rules(self) -> None:
        """The topology's rules; RuleError naming the field."""
        if self.topology == "unknown":
            if self.sizes != Sizes() or self.order is not None:
                raise RuleError("topology 'unknown': omit sizes and order",
                                "sizes" if self.sizes != Sizes() else "order")
            self._spec_rules()
            return
        if self.sizes.world_size != self.world_size:
            raise RuleError(
                f"world_size ({self.world_size}) must equal the product of sizes "
                f"dp*cp*tp*pp = {self.sizes.world_size}", "world_size")
        e = self.sizes.expert_tuple()
        if e is not None and e[0] * e[1] * e[2] * e[3] != self.world_size:
            raise RuleError(f"world_size ({self.world_size}) must equal the product of expert sizes "
                            f"edp*ep*etp*pp = {e[0] * e[1] * e[2] * e[3]}", "world_size")
        if self.order is not None:
            try:
                layout.parse_order(self.order)
            except ValueError as exc:
                raise RuleError(f"order: {exc}", "order") from None
        self._spec_rules()

    def _spec_rules(self) -> None:
        """Each statistic's spec against the registered topology, as a report's spec is
        judged against its own (:func:`_extended_rules`): a placement needs a known topology
        and coordinates inside its dims, expert dims need the expert factorisation. A
        registration that broke them was stored, and every report of the statistic was then
        a 500 (the ingest resolves the placement against the run's sizes). RuleError at
        ``statistics.<name>.spec...``."""
        for name, st in self.statistics.items():
            spec = st.spec
            if spec is None:
                continue
            if self.topology == "unknown":
                if spec.placement:
                    raise RuleError("spec.placement needs a known topology", "statistics", name, "spec", "placement")
                continue
            _prefixed(spec_topology_rules, ("statistics", name, "spec"), spec.to_core(), self.sizes.as_dict(),
                      self.sizes.has_expert)


class IngestResult(BaseModel):
    """Answer to ``POST /v1/reports``."""

    accepted: int = Field(description="Reports stored by this request.")
    duplicates: int = Field(description="Identical re-sends of stored reports (no-ops).")
    steps_audited: int = Field(description="Steps this request completed and audited.")
