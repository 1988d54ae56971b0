"""Plotly figures of a run page, built as plain JSON dicts (plotly.js's figure schema).

Inputs are the service's JSON documents: a step summary list (``GET .../steps``) and a step
detail (``GET .../steps/{step}``); outputs are ``{"data": [...], "layout": {...}}`` dicts
that ``Plotly.newPlot`` draws. Pure functions, no I/O: the HTML page, the self-contained
``auditor report --format html`` file and the tests use the same figures.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

#: Most points one per-step line carries. Longer runs are reduced to the largest value of
#: each bucket of consecutive steps (so a spike is never averaged away).
MAX_POINTS = 4000

#: One colour per verdict and per fault kind (kinds outside the table get grey).
VERDICT_COLOURS = {"consistent": "#2e7d32", "inconsistent": "#c62828", "incomplete": "#ef6c00", "unverified": "#6a1b9a",
                   "pending": "#757575"}
FAULT_COLOURS = {
    "cp_disagreement": "#d62728", "group_mismatch": "#9467bd", "wrong_group": "#e377c2",
    "skipped_collective": "#8c564b", "missing_report": "#ff7f0e", "replica_divergence": "#bcbd22",
    "replica_overcount": "#17becf", "variance_convention": "#1f77b4", "precision_loss": "#7f7f7f",
    "non_finite": "#000000", "empty_global": "#aec7e8", "stale_statistic": "#ffbb78",
}
OK_COLOUR = "#2e7d32"
CORRECT_COLOUR = "#424242"

#: What the value columns of a rank row hold, per statistic kind (DESIGN.md §3 table).
VALUE_LABELS = {
    "moments": ("mean μ", "std σ"),
    "sum": ("sum Σ", None),
    "norm": ("squared norm ‖g‖²", None),
    "fingerprint": ("replica gap", None),
}

_LAYOUT = {"margin": {"l": 60, "r": 20, "t": 40, "b": 50}, "height": 320,
           "legend": {"orientation": "h", "y": -0.25}, "hovermode": "closest",
           "font": {"family": "DejaVu Sans, Arial, sans-serif", "size": 12}}


def finite_only(obj: Any) -> Any:
    """``obj`` (figures: nested dicts/lists) with every NaN/±Inf float replaced by None, which
    plotly leaves out of traces and axis ranges: a non-finite value never becomes a point
    or an "Infinity"/"NaN" tick (nor invalid JSON in the page)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_only(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_only(v) for v in obj]
    return obj


#: Up to this many steps on an axis, every step is a tick (plotly's automatic ticks would
#: put some at half steps: −0.5, 0.5); beyond it, automatic ticks are whole numbers anyway.
STEP_TICKS_LISTED = 20


def step_axis(steps: Sequence[int]) -> dict:
    """A step axis: whole-number ticks only (a step is an integer)."""
    axis: dict[str, Any] = {"title": {"text": "step"}, "zeroline": False, "tickformat": "d"}
    distinct = sorted(set(steps))
    if distinct and distinct[-1] - distinct[0] <= STEP_TICKS_LISTED:
        axis.update(tickmode="array", tickvals=list(range(distinct[0], distinct[-1] + 1)))
    return axis


def fault_colour(kind: str | None) -> str:
    """Colour of a fault kind (``None``: no fault)."""
    return OK_COLOUR if kind is None else FAULT_COLOURS.get(kind, "#999999")


class MaxBuckets:
    """A line of (step, value) points downsampled as it grows, one point at a time, in memory
    bounded by ``max_points``.

    Points arrive in step order; null and non-finite values are dropped. Until more than
    ``max_points`` points have arrived every point is kept; past that, each kept point is the largest of a bucket of ``width``
    consecutive points (with its own step; the first of equals), ``width`` doubling
    whenever the buckets outgrow ``max_points`` — so a one-step spike is never averaged or
    thinned away, and :meth:`points` never returns more than ``max_points`` points."""

    __slots__ = ("max_points", "width", "xs", "ys", "_fill", "_px", "_py")

    def __init__(self, max_points: int = MAX_POINTS):
        if max_points < 2:
            raise ValueError("max_points must be at least 2")
        self.max_points, self.width = max_points, 1
        self.xs: list[int] = []
        self.ys: list[float] = []
        self._fill, self._px, self._py = 0, 0, 0.0

    def add(self, x: int, y: float | None) -> None:
        if y is None:
            return
        y = float(y)
        if not math.isfinite(y):
            return
        if self._fill == 0 or y > self._py:
            self._px, self._py = x, y
        self._fill += 1
        if self._fill == self.width:
            self.xs.append(self._px)
            self.ys.append(self._py)
            self._fill = 0
            if len(self.xs) > self.max_points:
                self._halve()

    def _halve(self) -> None:
        """Merge neighbouring buckets in pairs (the larger value stays); an odd last bucket
        becomes the partly filled bucket of the doubled width."""
        xs, ys, n = self.xs, self.ys, len(self.xs)
        pairs = [i if ys[i] >= ys[i + 1] else i + 1 for i in range(0, n - 1, 2)]
        if n % 2:
            self._px, self._py, self._fill = xs[-1], ys[-1], self.width
        self.xs, self.ys = [xs[i] for i in pairs], [ys[i] for i in pairs]
        self.width *= 2

    def points(self) -> tuple[list[int], list[float]]:
        """(steps, values) kept so far (at most ``max_points``)."""
        xs, ys = list(self.xs), list(self.ys)
        if self._fill:
            if len(xs) < self.max_points:
                xs.append(self._px)
                ys.append(self._py)
            elif self._py > ys[-1]:  # no room for a bucket more: fold it into the last one
                xs[-1], ys[-1] = self._px, self._py
        return xs, ys


#: The σ lines of a ``moments`` statistic: (name, step-summary field, colour, dash).
SIGMA_SERIES = (
    ("CP disagreement σ", "cp_disagreement_sigma", "#d62728", "solid"),
    ("applied error σ", "applied_error_sigma", "#1f77b4", "solid"),
    ("rounding tolerance σ", "tolerance_sigma", "#616161", "dash"),
)
#: The line of a ``fingerprint`` statistic: each step's largest replica gap ‖x_r − x_ref‖/‖x_ref‖
#: (kept in the step's ``applied_error_sigma``: :mod:`auditor.core.drift`).
GAP_SERIES = (("largest replica gap", "applied_error_sigma", "#bcbd22", "solid"),)
#: Rows (ranks) and columns (steps) of a drift heat strip at most.
STRIP_RANKS, STRIP_STEPS = 64, 1000


class StepHistory:
    """What the run page plots of one statistic's step summaries (``GET .../steps``),
    accumulated one summary at a time, in step order: the σ lines and the fault timeline,
    each downsampled as it grows (:class:`MaxBuckets`). Its memory is bounded by
    ``max_points`` per line whatever the number of steps, so a page of a 100,000-step run
    never holds its step summaries (:func:`auditor.web.gather_run_page` streams them in
    page by page). A run of at most ``max_points`` steps plots every step."""

    def __init__(self, max_points: int = MAX_POINTS):
        self.max_points = max_points
        #: step summaries seen; first and last step (the axes' range)
        self.count = 0
        self.first: int | None = None
        self.last: int | None = None
        self.sigma = {key: MaxBuckets(max_points) for _, key, _, _ in SIGMA_SERIES}
        #: smallest positive σ of any line (before downsampling): the log axis's floor
        self.min_positive: float | None = None
        self.ok = MaxBuckets(max_points)
        self.kinds: dict[str, MaxBuckets] = {}

    @classmethod
    def of(cls, steps: Iterable[dict[str, Any]], max_points: int = MAX_POINTS) -> "StepHistory":
        """The history of ``steps`` (an iterator is consumed once, in its order)."""
        return cls(max_points).extend(steps)

    def extend(self, steps: Iterable[dict[str, Any]]) -> "StepHistory":
        for s in steps:
            self.add(s)
        return self

    def add(self, s: dict[str, Any]) -> None:
        step = s["step"]
        self.count += 1
        self.first = step if self.first is None else min(self.first, step)
        self.last = step if self.last is None else max(self.last, step)
        for key, line in self.sigma.items():
            v = s.get(key)
            if v is None:
                continue
            v = float(v)
            if math.isfinite(v) and v > 0 and (self.min_positive is None or v < self.min_positive):
                self.min_positive = v
            line.add(step, v)
        kinds = s.get("fault_kinds") or ()
        if s.get("verdict") == "incomplete" and not kinds:
            kinds = ("incomplete",)
        if not kinds and s.get("verdict") == "consistent":
            self.ok.add(step, 0.0)
        for k in kinds:
            line = self.kinds.get(k)
            if line is None:
                line = self.kinds[k] = MaxBuckets(self.max_points)
            line.add(step, 0.0)

    def _axis(self) -> dict:
        return step_axis([] if self.first is None else [self.first, self.last])

    def sigma_figure(self, statistic: str, series: tuple = SIGMA_SERIES, title: str = "σ per step",
                     unit: str = "σ of the correct statistic") -> dict:
        """Per-step CP-disagreement σ and applied-error σ of a ``moments`` statistic (log
        scale), with the rounding tolerance of each step as a dashed line when the steps carry
        one (``tolerance_sigma``). Zero is not drawable on a log axis: exact zeros are drawn
        at a floor one decade below the smallest positive value (hover shows the true value).
        A series without any point (no step carried it) is left out, legend entry included.
        ``series``/``title``/``unit``: other lines of the step summaries (a ``fingerprint``
        statistic's largest replica gap, :data:`GAP_SERIES`)."""
        floor = self.min_positive / 10 if self.min_positive is not None else 1e-12
        data = []
        for name, key, colour, dash in series:
            x, y = self.sigma[key].points()
            if not x:  # no legend entry for a series with no point
                continue
            data.append({
                "type": "scatter", "mode": "lines+markers" if len(x) <= 200 else "lines", "name": name,
                "x": x, "y": [max(v, floor) for v in y], "customdata": y,
                "line": {"color": colour, "dash": dash, "width": 1.5 if dash == "dash" else 2},
                "marker": {"size": 5},
                "hovertemplate": f"step %{{x}}<br>{name} %{{customdata:.6g}}<extra></extra>",
            })
        return {"data": data, "layout": {
            **_LAYOUT, "title": {"text": f"{statistic}: {title}", "font": {"size": 14}},
            "xaxis": self._axis(),
            "yaxis": {"title": {"text": unit}, "type": "log", "exponentformat": "power"},
        }}

    def timeline_figure(self, statistic: str) -> dict:
        """One row per fault kind (and ``incomplete``), a marker at every step it occurred in:
        the steps where a run went bad, at a glance. Consistent steps appear as a thin green
        rug along the bottom row ``ok``. Rows of more than ``max_points`` markers keep one per
        bucket of consecutive occurrences (:class:`MaxBuckets`)."""
        data = []
        ok, _ = self.ok.points()
        if ok:
            data.append({"type": "scatter", "mode": "markers", "name": "ok", "x": ok, "y": ["ok"] * len(ok),
                         "marker": {"symbol": "line-ns-open", "size": 10, "color": OK_COLOUR},
                         "hovertemplate": "step %{x}: consistent<extra></extra>"})
        for kind in sorted(self.kinds):
            x, _ = self.kinds[kind].points()
            data.append({"type": "scatter", "mode": "markers", "name": kind, "x": x, "y": [kind] * len(x),
                         "marker": {"symbol": "square", "size": 9, "color": fault_colour(kind)},
                         "hovertemplate": f"step %{{x}}: {kind}<extra></extra>"})
        rows = (["ok"] if ok else []) + sorted(self.kinds)
        return {"data": data, "layout": {
            **_LAYOUT, "height": 120 + 28 * max(1, len(rows)), "showlegend": False,
            "title": {"text": f"{statistic}: faults per step", "font": {"size": 14}},
            "xaxis": self._axis(),
            "yaxis": {"type": "category", "categoryorder": "array", "categoryarray": rows, "automargin": True},
        }}


def drift_strip(bad_steps: Iterable[dict[str, Any]], statistic: str, max_ranks: int = STRIP_RANKS,
                max_steps: int = STRIP_STEPS) -> dict | None:
    """Heat strip of a ``fingerprint`` statistic: ranks × steps, each cell the gap
    ‖x_r − x_ref‖/‖x_ref‖ of a rank out of line at a bad step (its ``replica_divergence``
    finding's ``gap``; 0: in line at that step), from the report's bad steps (step details).
    Bounded: the first ``max_ranks`` ranks named and the first ``max_steps`` bad steps (the
    title says when more exist); None without a ``replica_divergence`` finding. Log colour
    scale: the cell holds log10 of the gap, hover the gap itself."""
    cells: dict[tuple[int, int], float] = {}
    steps: set[int] = set()
    named: set[int] = set()
    for d in bad_steps:
        for f in d.get("faults") or ():
            if f.get("kind") != "replica_divergence":
                continue
            g = (f.get("evidence") or {}).get("gap")
            g = math.inf if g in ("inf", "Infinity") else float(g) if g is not None else math.nan
            steps.add(d["step"])
            for r in f.get("ranks") or ():
                named.add(r)
                cells[(r, d["step"])] = max(cells.get((r, d["step"]), 0.0), g)
    if not cells:
        return None
    ranks, xs = sorted(named)[:max_ranks], sorted(steps)[:max_steps]
    finite = [v for v in cells.values() if math.isfinite(v) and v > 0]
    floor = min(finite) / 10 if finite else 1e-12
    top = max(finite) * 10 if finite else 1.0

    def cell(r: int, s: int) -> tuple[float, str]:
        v = cells.get((r, s), 0.0)
        shown = top if not math.isfinite(v) else max(v, floor)
        return math.log10(shown), ("non-finite" if not math.isfinite(v) else f"{v:.3g}")

    z, text = [], []
    for r in ranks:
        row = [cell(r, s) for s in xs]
        z.append([c[0] for c in row])
        text.append([c[1] for c in row])
    more = []
    if len(named) > len(ranks):
        more.append(f"first {len(ranks)} of {len(named)} ranks")
    if len(steps) > len(xs):
        more.append(f"first {len(xs)} of {len(steps)} bad steps")
    first = xs[0]
    title = f"{statistic}: replica gap, ranks × steps (first drifting step {first}" + (
        f"; {', '.join(more)})" if more else ")")
    return {"data": [{
        "type": "heatmap", "x": xs, "y": [str(r) for r in ranks], "z": z, "text": text, "colorscale": "YlOrRd",
        "colorbar": {"title": {"text": "log10 gap"}},
        "hovertemplate": "step %{x}, rank %{y}<br>gap %{text}<extra></extra>",
    }], "layout": {
        **_LAYOUT, "height": 140 + 16 * len(ranks), "title": {"text": title, "font": {"size": 14}},
        "xaxis": {**step_axis(xs), "type": "category"},
        "yaxis": {"title": {"text": "rank"}, "type": "category", "automargin": True},
    }}


#: Which of a rank's fault kinds colours it: diagnoses (the cause) before symptoms, the
#: generic ``group_mismatch`` last.
FAULT_PRIORITY = ("non_finite", "wrong_group", "replica_overcount", "variance_convention", "stale_statistic",
                  "skipped_collective", "missing_report", "empty_global", "replica_divergence", "precision_loss",
                  "cp_disagreement", "group_mismatch")


def primary_fault(kinds: Iterable[str]) -> str | None:
    """The fault kind a rank is coloured by: the first of :data:`FAULT_PRIORITY` it has
    (unknown kinds after those), ``None`` without faults."""
    kinds = list(kinds)
    if not kinds:
        return None
    rank = {k: i for i, k in enumerate(FAULT_PRIORITY)}
    return min(kinds, key=lambda k: rank.get(k, len(rank)))


def _rank_label(row: dict) -> str:
    mb = f"/mb{row['microbatch']}" if row.get("microbatch") else ""
    return f"{row['rank']}{mb}"


def rank_figure(detail: dict[str, Any], statistic: str, kind: str) -> dict:
    """Per-rank chart of one step: what each rank applied (markers coloured by its
    :func:`primary_fault`, green when it has none) against the correct value of its expected group
    (grey bars). ``moments``: two panels, mean and standard deviation; ``sum``/``norm``:
    one panel of the value (sum, or squared norm). ``detail`` is a step detail
    (``GET .../steps/{step}``); one point per rank row (rank, microbatch)."""
    rows = detail.get("ranks") or []
    labels = [_rank_label(r) for r in rows]
    value_label, spread_label = VALUE_LABELS.get(kind, VALUE_LABELS["moments"])
    panels = [("mean", "applied_mean", "correct_mean", value_label)]
    if spread_label is not None:
        panels.append(("std", "applied_std", "correct_std", spread_label))
    data: list[dict] = []
    groups: dict[str | None, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(primary_fault(r.get("faults") or ()), []).append(i)
    for p, (_, applied, correct, label) in enumerate(panels):
        axis = "" if p == 0 else str(p + 1)
        data.append({
            "type": "bar", "name": "correct (expected group)", "legendgroup": "correct", "showlegend": p == 0,
            "x": labels, "y": [r.get(correct) for r in rows], "xaxis": f"x{axis}", "yaxis": f"y{axis}",
            "marker": {"color": "rgba(66,66,66,0.25)", "line": {"color": CORRECT_COLOUR, "width": 1}},
            "hovertemplate": f"rank %{{x}}<br>correct {label} %{{y:.6f}}<extra></extra>",
        })
        for fault, idx in groups.items():
            name = f"applied — {fault or 'no fault'}"
            data.append({
                "type": "scatter", "mode": "markers", "name": name, "legendgroup": name, "showlegend": p == 0,
                "x": [labels[i] for i in idx], "y": [rows[i].get(applied) for i in idx],
                "xaxis": f"x{axis}", "yaxis": f"y{axis}",
                "marker": {"color": fault_colour(fault), "size": 11, "symbol": "diamond",
                           "line": {"color": "white", "width": 1}},
                "customdata": [", ".join(rows[i].get("faults") or []) or "none" for i in idx],
                "hovertemplate": f"rank %{{x}}<br>applied {label} %{{y:.6f}}<br>faults: %{{customdata}}<extra></extra>",
            })
    layout: dict[str, Any] = {
        **_LAYOUT, "height": 360, "barmode": "overlay",
        "title": {"text": f"{statistic} step {detail.get('step')}: applied vs correct per rank", "font": {"size": 14}},
    }
    n = len(panels)
    for p, (_, _, _, label) in enumerate(panels):
        axis = "" if p == 0 else str(p + 1)
        lo, hi = p / n + (0.04 if p else 0), (p + 1) / n - (0.04 if p < n - 1 else 0)
        layout[f"xaxis{axis}"] = {"domain": [lo, hi], "type": "category", "title": {"text": "rank"},
                                  "anchor": f"y{axis}"}
        layout[f"yaxis{axis}"] = {"title": {"text": label}, "anchor": f"x{axis}", "zeroline": True}
    return {"data": data, "layout": layout}


def count_points(figure: dict) -> int:
    """Points a figure draws (the sum of its traces' x lengths): what the browser tests compare
    against the plotted DOM."""
    return sum(len(t.get("x") or ()) for t in figure["data"])


def bad_steps_of(steps: Iterable[dict[str, Any]]) -> list[int]:
    """Steps whose verdict is not consistent, ascending."""
    return sorted(s["step"] for s in steps if s.get("verdict") in ("inconsistent", "incomplete"))


#: Colours of the runs of a workload figure, in run-id order (cycled).
RUN_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def workload_figure(stat: dict[str, Any], curves: dict[str, dict[str, list]]) -> dict:
    """One statistic of a workload comparison (``GET /v1/workloads/{workload}``'s
    ``statistics[i]``): every run's correct statistic per step overlaid (``curves``: per run
    id, ``step`` and ``value`` lists — the mean of a ``moments`` statistic, the value of a
    ``sum``/``norm``), at most :data:`MAX_POINTS` points a run (evenly strided), and each
    finding's differing steps (``at``) marked on its run's line with a red ×."""
    data, steps_seen = [], []
    label = "mean μ" if stat.get("kind", "moments") == "moments" else VALUE_LABELS.get(stat.get("kind"), ("value",))[0]
    for i, run_id in enumerate(sorted(curves)):
        c = curves[run_id]
        stride = max(1, math.ceil(len(c["step"]) / MAX_POINTS))
        x, y = c["step"][::stride], c["value"][::stride]
        steps_seen += x
        name = run_id + (" (reference)" if run_id == stat.get("reference") else "")
        data.append({"type": "scatter", "mode": "lines+markers", "name": name, "x": x, "y": y,
                     "line": {"color": RUN_COLOURS[i % len(RUN_COLOURS)], "width": 1.5}, "marker": {"size": 4}})
    for f in stat.get("findings") or []:
        c = curves.get(f["run"]) or {"step": [], "value": []}
        where = dict(zip(c["step"], c["value"]))
        at = [s for s in f.get("at") or [] if s in where][:MAX_POINTS]
        data.append({"type": "scatter", "mode": "markers", "name": f"{f['run']}: {f['diagnosis']} ({f['moment']})",
                     "x": at, "y": [where[s] for s in at], "hovertext": f["message"][:300],
                     "marker": {"symbol": "x", "size": 10, "color": "#c62828"}})
    layout = {**_LAYOUT, "title": {"text": f"{stat['statistic']}: {label} per step, every run"},
              "xaxis": step_axis(steps_seen), "yaxis": {"title": {"text": label}, "exponentformat": "e"}}
    return {"data": data, "layout": layout}
