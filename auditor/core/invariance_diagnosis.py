"""The diagnosis of a disagreement between two runs of one workload
(:mod:`auditor.core.invariance`): what kind it is (a count off by a factor of some dims,
tokens dropped or duplicated, other data, a sum off by a factor, applied values that differ
where the correct ones agree), its evidence and the sentence that says it. Pure numpy.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from auditor.layout import ALL_DIMS

if TYPE_CHECKING:
    from auditor.core.invariance import Reference, RunLayout, _Run

#: A mean or variance within this relative distance of an integer multiple k ≥ 2 of the
#: reference's, with k the size of some dims of the run, names them as a hint (values divided
#: by a count per micro-batch or per shard scale by about their number; not a proof: the
#: counts agree, so only the values differ).
NEAR_FACTOR = 0.01


def factor_dims(k: int, layout: RunLayout) -> list[str]:
    """The dims of ``layout`` (or products of several, ``dp·cp``) and its micro-batches whose
    size is ``k``, smallest products first: ``factor_dims(2, dp=2, cp=2)`` → ``['dp', 'cp']``."""
    dims = [d for d in ALL_DIMS if layout.sizes.get(d, 1) > 1]
    found = []
    for n in range(1, len(dims) + 1):
        for combo in itertools.combinations(dims, n):
            if math.prod(layout.sizes[d] for d in combo) == k:
                found.append("·".join(combo))
    if layout.microbatches == k:
        found.append("micro-batches")
    return found


def _factor(a: np.ndarray, r: np.ndarray, ta: np.ndarray, tr: np.ndarray) -> tuple[int, int]:
    """(k, direction) when ``a`` = k·``r`` (direction 1) or ``r`` = k·``a`` (−1) at every
    element, the same integer k ≥ 2, within the scaled bounds; else (0, 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = a / r
    if not len(q) or not np.all(np.isfinite(q)) or np.any(q == 0):
        return 0, 0
    up = np.abs(q) >= 1.0
    if not (up.all() or not up.any()):
        return 0, 0
    direction = 1 if up[0] else -1
    big, small, tb, ts = (a, r, ta, tr) if direction == 1 else (r, a, tr, ta)
    k = np.rint(big / small)
    if k[0] < 2 or np.any(k != k[0]) or np.any(np.abs(big - k * small) > tb + k * ts):
        return 0, 0
    return int(k[0]), direction


def _factor_text(k: int, direction: int, a: RunLayout, r: RunLayout) -> tuple[str, list[str]]:
    """``×2 = dp`` / ``÷4 = dp`` and the dims named (the run's, else the reference's)."""
    dims = factor_dims(k, a)
    where = ""
    if not dims:
        dims = factor_dims(k, r)
        where = " of the reference" if dims else ""
    sign = "×" if direction > 0 else "÷"
    if not dims:
        return f"{sign}{k} (no dim of either layout has size {k})", []
    return f"{sign}{k} = " + " = ".join(dims) + where, dims


_COUNT_TAIL = {
    "tokens_dropped": "tokens dropped — a data shard (a CP chunk, a DP slice) loses part of the step's batch",
    "tokens_duplicated": ("tokens duplicated — shards overlap (a DP or CP slice boundary off by one) or data are "
                          "counted twice"),
    "tokens_dropped_and_duplicated": ("tokens dropped at some steps and duplicated at others — the sharding does "
                                      "not partition the batch"),
}


def _num(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() and abs(x) < 1e15 else f"{x:.6g}"


@dataclass(slots=True)
class _Case:
    """One moment of run ``a`` differing from the reference run ``r``: the values (``x``, ``y``)
    and bounds (``ta``, ``tr``) at the differing steps, the words naming the run (``who``),
    the reference (``against``) and the steps (``where``), and the evidence so far."""

    r: _Run
    a: _Run
    name: str
    ia: np.ndarray
    ib: np.ndarray
    x: np.ndarray
    y: np.ndarray
    ta: np.ndarray
    tr: np.ndarray
    stat: str
    who: str
    against: str
    where: str
    evidence: dict


def diagnose(ref: Reference, r: _Run, a: _Run, name: str, steps: np.ndarray, ia: np.ndarray, ib: np.ndarray,
             compared: int) -> tuple[str, str, dict]:
    """(diagnosis, message, evidence) of run ``a`` differing from the reference run ``r`` in
    ``name`` at ``steps`` (positions ``ia`` in ``a``, ``ib`` in ``r``; ``compared`` steps
    both audited)."""
    x, y = a.values[name][ia], r.values[name][ib]
    ta, tr = a.tol[name][ia], r.tol[name][ib]
    first = int(steps[0])
    n = len(steps)
    where = (f"at step {first} ({n} of the {compared} steps both audited differ)" if n > 1
             else f"at step {first} (1 of the {compared} steps both audited)")
    evidence = {"run_value": float(x[0]), "reference_value": float(y[0]), "bound": float(ta[0] + tr[0]),
                "run_layout": a.layout.text(), "reference_layout": r.layout.text(), "reference_rule": ref.rule,
                "reference_tied_with": list(ref.tied_with)}
    c = _Case(r, a, name, ia, ib, x, y, ta, tr, a.series.statistic, f"run {a.layout.run_id!r} ({a.layout.text()})",
              f"the reference {r.layout.run_id!r} ({r.layout.text()}; {ref.text()})", where, evidence)
    if name == "count":
        diagnosis, message = _count(c)
    elif name in ("mean", "var"):
        diagnosis, message = _moment(c)
    elif name in ("sum", "norm"):
        diagnosis, message = _sum(c)
    else:
        diagnosis, message = _applied(c)
    return diagnosis, message, evidence


def _count(c: _Case) -> tuple[str, str]:
    """Counts differ: by an integer factor that some dims' size explains, else tokens
    dropped, duplicated or both."""
    x, y, evidence = c.x, c.y, c.evidence
    n = len(x)
    delta = x - y
    k, direction = _factor(x, y, c.ta, c.tr)
    evidence.update(tokens=float(delta[0]), tokens_dropped=float(np.maximum(-delta, 0.0).sum()),
                    tokens_duplicated=float(np.maximum(delta, 0.0).sum()))
    span = (f", {_num(np.abs(delta).min())}–{_num(np.abs(delta).max())} each" if n > 1
            and np.abs(delta).min() != np.abs(delta).max() else "")
    if k:
        text, dims = _factor_text(k, direction, c.a.layout, c.r.layout)
        evidence.update(factor=k if direction > 0 else 1.0 / k, factor_dims=dims)
        diagnosis = "count_factor"
        counted = f"every token counted {k} times" if direction > 0 else f"only 1/{k} of the tokens counted"
        tail = f"the count is {text}: {counted} — a reduction over the wrong dims, or replicas counted"
    else:
        diagnosis = ("tokens_dropped" if (delta < 0).all() else "tokens_duplicated" if (delta > 0).all()
                     else "tokens_dropped_and_duplicated")
        tail = _COUNT_TAIL[diagnosis]
    d0 = float(delta[0])
    return diagnosis, (
        f"{c.stat}: {c.who} counts {_num(abs(d0))} tokens {'fewer' if d0 < 0 else 'more'} than {c.against} "
        f"{c.where}{span}; {_num(evidence['tokens_dropped'])} dropped and {_num(evidence['tokens_duplicated'])} "
        f"duplicated in all: {tail}")


def _moment(c: _Case) -> tuple[str, str]:
    """A mean or variance differs with the same count: different data, with a hint when the
    ratio is near the size of some dims."""
    x, y, evidence, name = c.x, c.y, c.evidence, c.name
    sd = math.sqrt(max(float(c.r.values["var"][c.ib[0]]), 0.0))
    gap = abs(float(x[0] - y[0]))
    unit = sd if name == "mean" else sd * sd
    evidence.update(difference=float(x[0] - y[0]), reference_sd=sd,
                    difference_sigma=gap / unit if unit > 0 else math.inf,
                    bound_sigma=float(c.ta[0] + c.tr[0]) / unit if unit > 0 else math.inf,
                    ratio=float(x[0] / y[0]) if y[0] != 0 else math.inf,
                    count=float(c.a.values["count"][c.ia[0]]))
    scale = "σ" if name == "mean" else "σ²"
    hint = ""
    ratio = evidence["ratio"]
    if math.isfinite(ratio) and ratio != 0:
        k = round(abs(ratio)) if abs(ratio) >= 1 else round(1 / abs(ratio))
        near = abs(ratio) / k if abs(ratio) >= 1 else 1 / (abs(ratio) * k)
        dims = factor_dims(k, c.a.layout) if k >= 2 and abs(near - 1) <= NEAR_FACTOR else []
        if dims:  # a hint, not a proof: values divided by a count per shard scale by about the shards' number
            evidence["near_factor_dims"] = dims
            hint = (f"; it is {ratio:.6f}× the reference's, about {'×' if abs(ratio) >= 1 else '÷'}{k} = "
                    + " = ".join(dims) + " of the run — a normalisation by a count per such shard?")
    return "different_data", (
        f"{c.stat}: {c.who} sees another {'mean' if name == 'mean' else 'variance'} than {c.against} with the "
        f"same token count ({_num(evidence['count'])}) {c.where}: {x[0]:.6g} against {y[0]:.6g}, "
        f"{evidence['difference_sigma']:.3g}{scale} of the reference where the two runs' rounding allows "
        f"{evidence['bound_sigma']:.2g}{scale}: different data or weights — the same tokens with other values "
        f"(a normalisation per micro-batch or per shard, another order of samples, another seed){hint}")


def _sum(c: _Case) -> tuple[str, str]:
    """A sum or squared norm differs: by an integer factor (a normalisation or reduction
    applied once more or less), else different data."""
    x, y, evidence = c.x, c.y, c.evidence
    k, direction = _factor(x, y, c.ta, c.tr)
    evidence.update(difference=float(x[0] - y[0]),
                    relative=float((x[0] - y[0]) / y[0]) if y[0] else math.inf)
    what = "sum" if c.name == "sum" else "squared norm"
    if k:
        text, dims = _factor_text(k, direction, c.a.layout, c.r.layout)
        evidence.update(factor=k if direction > 0 else 1.0 / k, factor_dims=dims)
        tail = (f"{text}: the run {'multiplies by' if direction > 0 else 'divides by'} that size once more than "
                f"the reference (a normalisation applied twice, or a reduction over it missing or doubled)")
        return "sum_factor", (f"{c.stat}: {c.who} gives a {what} {k}× {'larger' if direction > 0 else 'smaller'} "
                              f"than {c.against} {c.where}: {x[0]:.6g} against {y[0]:.6g}, {tail}")
    return "different_sum", (
        f"{c.stat}: {c.who} gives another {what} than {c.against} {c.where}: {x[0]:.6g} against {y[0]:.6g} "
        f"({evidence['relative']:+.3g} relative, where the two runs' rounding allows "
        f"{float(c.ta[0] + c.tr[0]) / abs(y[0]) if y[0] else math.inf:.2g}), not an integer factor: "
        f"different data (terms dropped or counted twice, another normalisation)")


def _applied(c: _Case) -> tuple[str, str]:
    """An applied value differs where the correct statistics agree: the reductions differ."""
    x, y = c.x, c.y
    base = c.name.removeprefix("applied_")
    c.evidence.update(difference=float(x[0] - y[0]))
    return "applied_differs", (
        f"{c.stat}: {c.who} applied another {base} than {c.against} {c.where} although their correct statistics "
        f"agree: {x[0]:.6g} against {y[0]:.6g}, where the two runs' rounding allows "
        f"{float(c.ta[0] + c.tr[0]):.2g} — the runs' reductions differ, not their data (see their step audits)")
