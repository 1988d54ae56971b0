"""The columns a step's reports give both the per-step audit (:class:`auditor.core.step.Step`)
and the batched pass (:mod:`auditor.core.batch`), computed by one piece of code so that both
judge the same fields the same way: each element's dtype roundoff and subnormal spacing, the
(mean, var) a rank applied from the applied fields it sent (DESIGN.md §3), and the moments
its judged sums give with their match against the correct group.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from auditor.core import stats


def dtype_columns(dtypes: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per element, float64 arrays (k,) of the unit roundoff u (:data:`stats.UNIT_ROUNDOFF`)
    and the subnormal spacing s (:data:`stats.SUBNORMAL_SPACING`) of its reported dtype;
    float32's for an unknown name. Shared by :class:`Step` and :mod:`auditor.core.batch`."""
    n = len(dtypes)
    if len(set(dtypes)) <= 1:
        name = dtypes[0] if n and dtypes[0] in stats.UNIT_ROUNDOFF else "float32"
        return np.full(n, stats.UNIT_ROUNDOFF[name]), np.full(n, stats.SUBNORMAL_SPACING[name])
    names = [d if d in stats.UNIT_ROUNDOFF else "float32" for d in dtypes]
    return (np.array([stats.UNIT_ROUNDOFF[d] for d in names], dtype=np.float64),
            np.array([stats.SUBNORMAL_SPACING[d] for d in names], dtype=np.float64))


def applied_moments(values: Sequence[np.ndarray], given: Sequence[np.ndarray], variance: str):
    """The applied columns of ``moments`` elements, shared by :class:`Step` and the batched
    pass (:mod:`auditor.core.batch`) so that both judge the same fields the same way.

    ``values``: float64 arrays (k,) of the applied count, sum, sum_sq, mean, var as stored;
    ``given``: bool arrays (k,), the rank sent that field (applied, not None). DESIGN.md §3:
    count/sum/sum_sq are what the all-reduce returned, mean/var what the rank whitened with;
    every field that is sent is judged against the expected group's correct value.

    Returns ``(n, mean, var, var_known, sum, sum_sq, sum_judged, sq_judged)``, arrays (k,):

    * ``n``: the applied count where sent, else NaN (not judged);
    * ``mean``, ``var``: the pair the rank whitened with — the sent mean, else S/N of the
      sent count and sum (slime's form); the sent var, else the one-pass var of the sent
      count, sum and sum_sq in ``variance``'s convention (:func:`stats.one_pass_mean_var_array`);
      NaN where neither. ``var_known``: a var was sent or follows from the sums;
    * ``sum``, ``sum_sq``: the sent values (NaN where not sent);
    * ``sum_judged``: a finite sum was sent that is not the source of ``mean`` (a mean was
      sent too, or no count), so the mean it gives is judged on its own
      (:func:`sums_moments`); ``sq_judged``: likewise a finite sum_sq that is not the
      source of ``var``. A non-finite one is ``non_finite``'s finding.
    """
    count, total, total_sq, mean, var = values
    g_count, g_sum, g_sq, g_mean, g_var = given
    with np.errstate(all="ignore"):
        om, ov = stats.one_pass_mean_var_array(count, total, total_sq, variance)
    mean_from_sums = ~g_mean & g_count & g_sum
    var_from_sums = ~g_var & g_count & g_sum & g_sq
    a_n = np.where(g_count, count, np.nan)
    a_mean = np.where(g_mean, mean, np.where(mean_from_sums, om, np.nan))
    a_var = np.where(g_var, var, np.where(var_from_sums, ov, np.nan))
    with np.errstate(invalid="ignore"):
        sum_judged = g_sum & ~mean_from_sums & np.isfinite(total)
        sq_judged = g_sq & ~var_from_sums & np.isfinite(total_sq)
    return (a_n, a_mean, a_var, g_var | var_from_sums, np.where(g_sum, total, np.nan),
            np.where(g_sq, total_sq, np.nan), sum_judged, sq_judged)


def sums_moments(a_n, a_sum, a_sum_sq, sum_judged, sq_judged, n, mean, m2, convention: str):
    """The (mean, var) that judged applied sums give (:func:`applied_moments`), slime's
    one-pass form in ``convention``: each sum not sent, not judged or (the count) not finite
    is taken as the group's correct one (count ``n``, sum ``n·mean``, sum_sq ``m2 + n·mean²``), so each sent field is
    judged on its own. NaN where no sum is judged. Float64 arrays (k,)."""
    with np.errstate(all="ignore"):
        N = np.where(np.isfinite(a_n), a_n, n)  # a non-finite count is non_finite's finding
        S = np.where(sum_judged, a_sum, n * mean)
        SS = np.where(sq_judged, a_sum_sq, m2 + n * mean * mean)
        s_mean, s_var = stats.one_pass_mean_var_array(N, S, SS, convention)
    judged = sum_judged | sq_judged
    return np.where(judged, s_mean, np.nan), np.where(judged, s_var, np.nan)


def sums_match(s_mean, s_var, sum_judged, sq_judged, mean, var, tm, tv) -> np.ndarray:
    """Where the judged sums' (``s_mean``, ``s_var``) (:func:`sums_moments`) are the correct
    (``mean``, ``var``) within the rounding bounds (``tm``, ``tv``); True where none is judged."""
    with np.errstate(invalid="ignore"):
        return ((~sum_judged | (np.abs(s_mean - mean) <= tm))
                & (~sq_judged | (np.abs(s_var - var) <= tv)))
