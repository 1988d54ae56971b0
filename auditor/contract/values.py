"""The value rules of a report's ``local`` and ``applied`` blocks (DESIGN.md §3): pure
functions of the block's numbers, shared by both decoders. The pydantic models
(:mod:`auditor.contract.models`) run them on each block and word their :class:`RuleError`
as a 422 at the field it blames; the fast decoder (:mod:`auditor.contract.fast`) runs them
on the reports its array tests flag. NaN and Inf pass every rule: they are a training fault
the audit reports (``non_finite``), not a client error.
"""

from __future__ import annotations

import math

import numpy as np

from auditor.core.stats import SUBNORMAL_SPACING, UNIT_ROUNDOFF, mean_var_tolerance, reduction_gamma


class RuleError(ValueError):
    """A broken wire rule: the ValueError of the message, and ``loc``, the path of the wire
    field it blames relative to the object the rule judges (``("count",)`` in a ``local``
    block, ``("coords", "cp")`` or ``("local", "sum_sq")`` in a report). The model
    validators raise it as a pydantic error at that field (:func:`auditor.contract.models.located`), so a 422's
    ``field``/``loc`` name it (``reports[3].local.count``), not the block or the report."""

    def __init__(self, msg: str, *loc: str):
        super().__init__(msg)
        self.loc = loc


_INF, _NEG_INF = math.inf, -math.inf
_isfinite = math.isfinite


def local_rules(loc) -> None:
    """The rules of a ``local`` block (:class:`~auditor.contract.models.LocalStats` or its
    fast-decoder twin): raises :class:`RuleError` naming the field. A rule added here (or to
    :func:`applied_rules`, :func:`auditor.contract.rules.report_rules`) must also be flagged
    by the array tests of :func:`auditor.contract.fast.batch_holds`, or the fast decoder
    accepts what it breaks."""
    # ``x < 0`` is False for NaN and +Inf; ``x != -inf`` leaves -Inf out: "finite and < 0"
    # without a call per value (this runs once per report on the ingest hot path).
    c = loc.count
    if c is not None and c < 0 and c != _NEG_INF:
        raise RuleError(f"count must be >= 0, got {c}", "count")
    for name in ("sum_sq", "replicated_sum_sq"):
        v = getattr(loc, name)
        if v is not None and v < 0 and v != _NEG_INF:
            raise RuleError(f"{name} must be >= 0, got {v}", name)
    if c == 0:  # an empty mask: min/max by range_error below
        for name in ("sum", "sum_sq"):
            v = getattr(loc, name)
            if v is not None and v != 0 and _isfinite(v):
                raise RuleError(empty_sum_error(name, v), name)
    lo, hi = loc.min, loc.max
    if lo is not None or hi is not None:
        w = loc.weighted
        msg = range_error("min", lo, loc.count, loc.sum, loc.sum_sq, weighted=w)
        if msg:
            raise RuleError(msg, "min")
        msg = range_error("max", hi, loc.count, loc.sum, loc.sum_sq, lo, weighted=w)
        if msg:
            raise RuleError(msg, "max")


def empty_sum_error(name: str, v: float) -> str:
    """The message of ``local.<name>`` (``sum`` or ``sum_sq``) not 0 beside ``count`` 0.

    The rule (:func:`local_rules`, every kind): ``count = Σm`` with weights ``m >= 0`` is 0
    only when every weight is 0, so each term ``m·v`` (``m·v²``) is ±0 for finite ``v`` and
    their sum is exactly 0 in any precision and summation order (IEEE 754: x + (±0) = x;
    no rounding). A non-zero finite sum beside it is not rounding: no masked data makes it.
    NaN/±Inf stay accepted (``0·NaN`` is NaN: a masked-out NaN poisons ``Σm·v``; the audit
    flags it ``non_finite``)."""
    return (f"{name} must be 0 when count is 0, got {v!r}: count = Σm = 0 leaves no element masked in, and a "
            "sum of no terms is exactly 0 in any precision")


#: Slack of the range rules (:func:`range_error`): the loosest rounding of any dtype a report
#: may name (bfloat16's unit roundoff 2^-8), so no correct float32/16 accumulation trips them.
RANGE_REL = max(UNIT_ROUNDOFF.values())
#: Slack of the mean rule: float32's unit roundoff (local sums are float64 or float32
#: accumulations); past ``MEAN_COUNT`` terms γ_n no longer bounds anything and the rule is off.
MEAN_REL, MEAN_ABS = UNIT_ROUNDOFF["float32"], 2.0**-126
MEAN_COUNT = 0.25 / UNIT_ROUNDOFF["float32"]
#: Below this magnitude a value's square may underflow (float16: sqrt of its smallest normal,
#: 2^-14), so the sum of squares says nothing about it.
RANGE_ABS = 2.0**-7
#: Weighted masks: ``count`` = Σm is not the number of terms summed, so the mean rule's
#: slack assumes at least this many (float32 γ_n ≈ 2^-8 relative; float64 sums of any length
#: stay far inside it), and ``count``'s own rounding is added in (:func:`range_error`).
WEIGHTED_TERMS = 2.0**16


def is_empty_identity(side: str, v: float, count) -> bool:
    """Whether ``local.<side>`` (``"min"`` or ``"max"``) value ``v`` is the identity of its
    reduction beside ``count`` 0: ``min = +inf`` or ``max = -inf``, what a trainer's
    ``x.masked_fill(~mask, inf).min()`` (``-inf`` and ``.max()``) returns for an all-masked
    tensor. Such a value means "no min/max", exactly as null: :class:`~auditor.contract.models.LocalStats` turns it
    into None at decode (the stored row holds NULL, ``non_finite`` stays empty, the audit
    sees an absent min/max; an empty set has none, :func:`range_error`). JSON has no
    infinity: the wire carries it as the ``Infinity``/``-Infinity`` tokens (Python's
    ``json.dumps``, the client's encoding) or a number beyond float range (``1e400``); msgspec
    reads neither, so such a body always takes the pydantic path (:func:`auditor.contract.parse.parse_report_batch`)
    and a :class:`~auditor.contract.fast.FastLocal` never holds one
    (``auditor.contract.fast.FastReport.values_finite``).

    Each side on its own (a trainer may send only one). Not identities, and unchanged (stored,
    flagged ``non_finite`` by the audit): ``min = -inf`` or ``max = +inf`` with count 0 (the
    opposite identity: not what any reduction of nothing returns), any infinity beside a
    count > 0 or a count that is absent, NaN or non-zero (there were elements: an infinite
    min/max is a value), and NaN."""
    return count == 0 and v == (_INF if side == "min" else _NEG_INF)


def range_error(side: str, v, count, total, total_sq, lo=None, weighted: bool = False) -> str | None:
    """The message of the first rule ``local.<side>`` (``"min"`` or ``"max"``, value ``v``)
    breaks against the other moments of its block, else None. Shared by :class:`~auditor.contract.models.LocalStats`
    (a field validator per side, so the 422 names ``reports[i].local.min`` or ``.max``) and
    the fast decoder (:func:`local_rules`): both refuse the same bodies.

    Rules, on finite values only (NaN/±Inf go on to the audit as ``non_finite``):

    * ``count == 0``: no value at all. min/max are over the elements with ``m != 0``
      (DESIGN.md §3), and ``count = Σm = 0`` with ``m >= 0`` leaves none: an empty set has
      no min or max (:class:`auditor.core.stats.Moments`: ``nan`` when N == 0; the hooks'
      ``masked_moments`` sends null). A finite one is not what any masked data gives. The
      reductions' identities ``min = +inf``/``max = -inf`` mean null and never get here
      (:func:`is_empty_identity`); the opposite infinities stay ``non_finite``.
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
        if abs(v) > root * (1.0 + RANGE_REL) + RANGE_ABS:
            return (f"|{side}| ({abs(v):.6g}) is larger than √sum_sq allows for a 0/1 mask (√sum_sq = "
                    f"{root:.6g}; min and max are those of the elements counted in count/sum/sum_sq); if the mask "
                    f"weights elements, set local.weighted=true")
    if (count is not None and total is not None and _isfinite(count) and _isfinite(total)
            and 0 < count < MEAN_COUNT):
        mean = total / count
        n = max(count, WEIGHTED_TERMS) * 2.0 if weighted else count
        slack = (n + 1.0) * MEAN_REL * (abs(mean) + 2.0 * abs(v)) + (n + 1.0) * MEAN_ABS
        if (side == "min" and mean < v - slack) or (side == "max" and mean > v + slack):
            return (f"the mean sum/count ({mean:.6g}) lies {'below min' if side == 'min' else 'above max'} "
                    f"({v:.6g}): a mean of the masked-in elements lies between their min and max")
    return None


def applied_rules(a) -> None:
    """The rules of an ``applied`` block (:class:`~auditor.contract.models.AppliedStats` or its fast-decoder twin)."""
    c, ss = a.count, a.sum_sq
    if c is not None and c < 0 and c != _NEG_INF:
        raise RuleError(f"count must be >= 0, got {c}", "count")
    if ss is not None and ss < 0 and ss != _NEG_INF:
        raise RuleError(f"sum_sq must be >= 0, got {ss}", "sum_sq")



#: The smallest positive normal number of each wire dtype (tf32 and bfloat16 keep float32's
#: 8-bit exponent): below it a square or a partial sum may be subnormal or flushed to zero.
SMALLEST_NORMAL = {"float64": 2.0**-1022, "float32": 2.0**-126, "tf32": 2.0**-126, "bfloat16": 2.0**-126,
                    "float16": 2.0**-14}
assert set(SMALLEST_NORMAL) == set(UNIT_ROUNDOFF)


def check_cauchy_schwarz(where: str, count, total, total_sq, dtype: str, weighted: bool = False) -> None:
    """Reject a rank's local ``sum_sq < sum²/count`` beyond what rounding and underflow can
    produce (never ``applied``'s: see :func:`auditor.contract.rules.report_rules`): no real data has negative
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
      against ``7γ`` ≥ 28u (tests/contract/test_decode.py, tests/server/test_trust.py). The rule was
      ``64u·max(log2 n, 1)`` relative, 2.3–8× looser than this, a model of its own.
      ``reduction_gamma`` rather than the tighter ``accumulated_gamma_array`` (torch's
      float32 accumulator for bfloat16/float16): sums formed in bfloat16 arithmetic are
      correct data too.
    * ``abs = 2·(n + 1)·tiny``, ``tiny`` the dtype's smallest normal (:data:`SMALLEST_NORMAL`):
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
    n = max(count, WEIGHTED_TERMS) if weighted or count != int(count) else count
    with np.errstate(all="ignore"):  # sum² beyond float range: floor and slack are inf, nothing refused
        gamma = reduction_gamma(dtype, n, 1)
        _, tv = mean_var_tolerance(gamma, count, total / count, 0.0, "population",
                                   spacing=SUBNORMAL_SPACING[dtype], ranks=1.0)
        slack = count * float(tv) + 2.0 * (n + 1.0) * SMALLEST_NORMAL[dtype]
    if floor - total_sq > slack:
        raise RuleError(
            f"{where}.sum_sq ({total_sq!r}) is below {where}.sum²/{where}.count ({floor!r}) "
            f"beyond {dtype} rounding: the values would have negative variance", where, "sum_sq")



#: The ``local`` fields each kind requires.
REQUIRED_LOCAL: dict[str, tuple[str, ...]] = {
    "moments": ("count", "sum", "sum_sq"),
    "sum": ("sum",),
    "norm": ("sum_sq",),
    "fingerprint": ("fingerprint",),
}
#: The ``applied`` field a ``sum`` or ``norm`` requires (``moments``: :func:`auditor.contract.rules.report_rules`).
REQUIRED_APPLIED: dict[str, str] = {"sum": "sum", "norm": "sum_sq"}
