"""HTML views of the auditor: the run list and the run page (Jinja2 templates, plotly.js).

One renderer for two uses: the service's pages (``GET /``, ``GET /runs/{run_id}``; plotly.js
and our CSS/JS served by the package itself under ``/static``) and the self-contained file of
``auditor report --format html`` (the same page with every asset inlined). Nothing here
talks to the service or the database: callers pass the service's JSON documents. No asset
comes from a CDN, so air-gapped clusters see the plots.
"""

from __future__ import annotations

import functools
import math
import re
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, Sequence

import jinja2

from auditor import status as statuses
from auditor.web import plots

STATIC_DIR = Path(__file__).parent / "static"
TEMPLATE_DIR = Path(__file__).parent / "templates"
#: Our own assets, served under ``/static/<name>`` (plotly.js comes from the plotly package).
ASSETS = ("auditor.css", "run.js")
_END_TAG = re.compile(r"</(script|style)", re.IGNORECASE)


def plotly_js_path() -> Path:
    """plotly.min.js as shipped inside the ``plotly`` Python package (``package_data``).

    Raises ``FileNotFoundError`` when the installed plotly does not ship it."""
    path = Path(str(resources.files("plotly") / "package_data" / "plotly.min.js"))
    if not path.is_file():
        raise FileNotFoundError(f"plotly.min.js not found at {path}; reinstall plotly")
    return path


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    """The Jinja2 environment of the pages (autoescaping on; ``num``/``sigma`` filters)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
                             autoescape=jinja2.select_autoescape(default=True),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["num"] = fixed
    env.filters["ts"] = _timestamp
    env.filters["sigma"] = _sigma
    env.globals["fault_colour"] = plots.fault_colour
    env.globals["topology_text"] = topology_text
    env.globals["shown_sizes"] = shown_sizes
    env.globals["status_of"] = statuses.status_of
    env.globals["refused_line"] = statuses.refused_line
    env.globals["dropped_line"] = statuses.dropped_line
    env.globals["incomplete_line"] = statuses.incomplete_line
    env.globals["unverified_line"] = statuses.unverified_line
    env.globals["reports_missing"] = statuses.reports_missing
    env.globals["how_to_verify"] = statuses.HOW_TO_VERIFY
    return env


#: The expert-parallel dims: shown only for a run with expert parallelism.
EXPERT_DIMS = ("edp", "ep", "etp")


def shown_sizes(run: Mapping[str, Any]) -> dict[str, int]:
    """The sizes of a run worth showing: none for an unknown topology (placeholders of 1,
    not a 1×1×1×1 layout), and without ``edp``/``ep``/``etp`` when ``ep`` and ``etp`` are 1
    (no expert parallelism: ``edp`` is only dp×cp again)."""
    if run.get("topology") == "unknown":
        return {}
    sizes = dict(run.get("sizes") or {})
    if sizes.get("ep", 1) == 1 and sizes.get("etp", 1) == 1:
        for d in EXPERT_DIMS:
            sizes.pop(d, None)
    return sizes


def topology_text(run: Mapping[str, Any]) -> str:
    """A run's topology in words: ``dp=2 cp=2 tp=1 pp=1`` (expert sizes too with expert
    parallelism, :func:`shown_sizes`), or ``unknown topology (world 8)`` for a run whose
    ranks declared none."""
    if run.get("topology") == "unknown":
        return f"unknown topology (world {run.get('world_size')})"
    return " ".join(f"{k}={v}" for k, v in shown_sizes(run).items())


#: Magnitudes :func:`fixed` writes in scientific notation: from 1e9 up (a fixed-point 1e300
#: is a 300-digit string that overflows a table cell), and non-zero ones below 1e-6 (which
#: would read 0.000000).
SCIENTIFIC_ABOVE, SCIENTIFIC_BELOW = 1e9, 1e-6


def fixed(x: Any, digits: int = 6, sign: bool = False) -> str:
    """A number in fixed point with ``digits`` decimals (``+`` shown when ``sign``), in
    scientific notation (``max(digits, 3)`` decimals of the mantissa) when
    ``|x| >= 1e9`` or ``0 < |x| < 1e-6``; '—' for null, NaN/Inf spelled out. One formatter
    for the pages and the terminal report."""
    if x is None:
        return "—"
    x = float(x)
    if not math.isfinite(x):
        return str(x)
    plus = "+" if sign else ""
    if abs(x) >= SCIENTIFIC_ABOVE or 0 < abs(x) < SCIENTIFIC_BELOW:
        return f"{x:{plus}.{max(digits, 3)}e}"
    return f"{x:{plus}.{digits}f}"


def _sigma(x: Any) -> str:
    """A σ figure: 3 decimals, or 3 significant digits below 0.001 (so 4e-7 does not read 0)
    and from 1e9 up (so no 300-digit number)."""
    if x is None:
        return "—"
    x = float(x)
    if not math.isfinite(x):
        return str(x)
    return f"{x:.3g}" if 0 < abs(x) < 1e-3 or abs(x) >= SCIENTIFIC_ABOVE else f"{x:.3f}"


def _timestamp(x: Any) -> str:
    import datetime as dt

    if x is None:
        return "—"
    return dt.datetime.fromtimestamp(float(x), dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _assets(inline: bool) -> dict[str, Any]:
    if not inline:
        return {"inline": False}
    texts = {"plotly_js": plotly_js_path().read_text(encoding="utf-8"),
             **{name.replace(".", "_"): (STATIC_DIR / name).read_text(encoding="utf-8") for name in ASSETS}}
    # "</script" inside an inlined script would end the element early; "<\/script" means the
    # same inside a JS string or regex literal (the only places it can occur)
    return {"inline": True, **{k: _END_TAG.sub(r"<\\/\1", v) for k, v in texts.items()}}


#: Rows of the selected step's per-rank table a run page reads and shows
#: (``?statistic=&step=``): a 16,384-rank step would otherwise be read, charted and put in
#: the HTML whole. The rest in pages of as many rows, in (rank, microbatch) order
#: (``&from_rank=&from_mb=``); the step endpoint has every row.
PAGE_RANK_ROWS = 2000
#: Step summaries a page reads at a time (``GET .../steps`` pages, or the service's own
#: reads, ``auditor.service.LocalReader``): ~1 KB each as rows and dicts, so a page of them
#: costs ~2 MB whatever the run's length.
PAGE_STEPS = 2000


def history_of(steps: "Iterable[dict] | plots.StepHistory | None") -> plots.StepHistory:
    """``steps`` as a :class:`plots.StepHistory`: as given, or built from step summaries (a
    list or tuple is sorted by step first; any other iterable is consumed once, in step
    order, without being held)."""
    if isinstance(steps, plots.StepHistory):
        return steps
    if isinstance(steps, (list, tuple)):
        steps = sorted(steps, key=lambda s: s["step"])
    return plots.StepHistory.of(steps or ())


def page_model(report: Mapping[str, Any], steps: Mapping[str, "Iterable[dict] | plots.StepHistory"],
               details: Mapping[str, Mapping[int, dict]] | None = None,
               selected: tuple[str, int] | None = None) -> dict[str, Any]:
    """What the run page shows, per statistic: the report's summary, its σ and fault figures
    and, for each step with a detail (the report's bad steps plus ``details``), the per-rank
    figure. The initially shown step is ``selected`` if given, else the first inconsistent
    step. Also the JSON embedded in the page (``figures``) for ``run.js``. ``steps``: per
    statistic, its step summaries or their :class:`plots.StepHistory`."""
    details = details or {}
    statistics, figures = [], {}
    for i, stat in enumerate(report.get("statistics") or []):
        name, kind = stat["statistic"], stat.get("kind", "moments")
        history = history_of(steps.get(name))
        shown: dict[int, dict] = {d["step"]: d for d in stat.get("bad_steps") or []}
        shown.update({int(k): v for k, v in (details.get(name) or {}).items()})
        order = sorted(shown)
        first = selected[1] if selected and selected[0] == name and selected[1] in shown else (
            order[0] if order else None)
        key = f"s{i}"
        figures[key] = {
            "sigma": history.sigma_figure(name) if kind == "moments" else history.sigma_figure(
                name, plots.GAP_SERIES, "largest replica gap per step", "‖x_r − x_ref‖ / ‖x_ref‖")
            if kind == "fingerprint" else None,
            "drift": plots.drift_strip(stat.get("bad_steps") or (), name) if kind == "fingerprint" else None,
            "timeline": history.timeline_figure(name),
            "steps": {str(s): plots.rank_figure(shown[s], name, kind) for s in order},
            "selected": None if first is None else str(first),
        }
        statistics.append({
            "key": key, "stat": stat, "kind": kind, "labels": plots.VALUE_LABELS.get(kind, plots.VALUE_LABELS["moments"]),
            "steps_plotted": history.count, "details": [shown[s] for s in order], "selected": first,
            "bad_not_shown": max(0, int(stat.get("bad_steps_total") or 0) - len(order)),
        })
    return {"statistics": statistics, "figures": plots.finite_only(figures)}


def render_run_page(report: Mapping[str, Any], steps: Mapping[str, "Iterable[dict] | plots.StepHistory"], *,
                    details: Mapping[str, Mapping[int, dict]] | None = None,
                    selected: tuple[str, int] | None = None, inline_assets: bool = False,
                    root_path: str = "") -> str:
    """The run page as one HTML document.

    Parameters
    ----------
    report:
        ``GET /v1/runs/{run_id}/report`` (its ``bad_steps`` give the per-rank details).
    steps:
        Per statistic, the step summaries of ``GET /v1/runs/{run_id}/statistics/{s}/steps``
        (every page) or their :class:`plots.StepHistory` (what :func:`gather_run_page`
        streams them into): the per-step σ lines and the fault timeline.
    details:
        Extra step details per statistic and step (``GET .../steps/{step}``), e.g. a step
        the reader asked for that is not among the report's bad steps.
    selected:
        (statistic, step) shown first in that statistic's per-rank chart.
    inline_assets:
        True: plotly.js, CSS and JS inlined (a self-contained file, ~5 MB, that opens with no
        server and no network); False: linked from the service's ``/static``.
    root_path:
        Prefix of the service's URLs (ASGI ``root_path``) for links and assets.
    """
    model = page_model(report, steps, details, selected)
    return environment().get_template("run.html").render(
        report=report, root=root_path, assets=_assets(inline_assets), **model)


class PageSource(Protocol):
    """Where a run page's documents come from: the service over HTTP
    (:class:`auditor.reader.Reader`) or a database (:class:`auditor.service.LocalReader`). Each
    method returns the JSON of the endpoint it names and raises on an unknown run."""

    def report_json(self, run_id: str, *, bad_steps: int = 20) -> dict:
        """``GET /v1/runs/{run_id}/report``."""

    def steps_json(self, run_id: str, statistic: str, *, page_size: int) -> Iterable[dict]:
        """Every item of ``GET /v1/runs/{run_id}/statistics/{statistic}/steps``, in step
        order, read ``page_size`` at a time (:data:`PAGE_STEPS`: the page never holds them all)."""

    def step_json(self, run_id: str, statistic: str, step: int, *, limit: int | None = None,
                  after: tuple[int, int] | None = None) -> dict:
        """``GET /v1/runs/{run_id}/statistics/{statistic}/steps/{step}``: its rank rows in
        (rank, microbatch) order after ``after``, at most ``limit`` (a source may return
        more, or all: :func:`gather_run_page` cuts them), ``ranks_total`` in all."""


#: Largest microbatch index (the wire's bound is 2**20): ``(rank, MAX_MICROBATCH)`` comes
#: after every row of ``rank``.
MAX_MICROBATCH = 2**31 - 1


def gather_run_page(source: PageSource, run_id: str, *, statistic: str | None = None, step: int | None = None,
                    bad_steps: int = 20, rank_rows: int = PAGE_RANK_ROWS,
                    from_row: tuple[int, int] | None = None) -> dict[str, Any]:
    """Read what :func:`render_run_page` needs for ``run_id`` from ``source``: the report
    (with up to ``bad_steps`` bad-step details per statistic), each statistic's step
    summaries streamed into a :class:`plots.StepHistory` (bounded memory whatever the
    number of steps) and, if ``statistic`` and ``step`` are given, that step's detail
    (selected) with at most ``rank_rows`` rows of its per-rank table in (rank, microbatch)
    order, from row ``from_row`` = (rank, microbatch) on (the first row when None); when
    more rows follow, the detail's ``next_row`` is the first of them.
    Returns the keyword arguments of :func:`render_run_page` (without the rendering options).
    Raises what ``source`` raises for an unknown run, statistic or step."""
    report = source.report_json(run_id, bad_steps=bad_steps)
    steps = {s["statistic"]: plots.StepHistory.of(source.steps_json(run_id, s["statistic"], page_size=PAGE_STEPS))
             for s in report["statistics"]}
    details: dict[str, dict[int, dict]] = {}
    selected = None
    if statistic is not None and step is not None:
        details[statistic] = {step: _rank_page(source, run_id, statistic, step, rank_rows, from_row)}
        selected = (statistic, step)
    return {"report": report, "steps": steps, "details": details, "selected": selected}


def _rank_page(source: PageSource, run_id: str, statistic: str, step: int, rank_rows: int,
               from_row: tuple[int, int] | None) -> dict:
    """A step's detail with ``rank_rows`` rows of its table from ``from_row`` on; one row
    more is read to name the next page's first (``next_row``)."""
    after = None
    if from_row is not None and from_row != (0, 0):
        rank, mb = from_row
        after = (rank, mb - 1) if mb > 0 else (rank - 1, MAX_MICROBATCH)
    detail = source.step_json(run_id, statistic, step, limit=rank_rows + 1, after=after)
    rows = detail.get("ranks") or []
    if after is not None:  # a source that ignored ``after``: its rows from the start
        rows = [r for r in rows if (r["rank"], r.get("microbatch", 0)) > after]
    detail.pop("next_cursor", None)
    total = detail.get("ranks_total")
    if total is None:
        total = detail["ranks_total"] = len(rows)
    next_row = (rows[rank_rows]["rank"], rows[rank_rows].get("microbatch", 0)) if len(rows) > rank_rows else None
    detail["ranks"] = rows[:rank_rows]
    detail.update(next_row=next_row, from_row=from_row, ranks_truncated=len(detail["ranks"]) < total)
    return detail


def render_runbook(*, root_path: str = "") -> str:
    """The alert runbook (docs/alerts.md, shipped as ``auditor/web/runbook.md``) as an HTML
    page whose sections carry the anchors the alerts' ``runbook_url`` point to
    (``#auditordown``: the heading text, lower case, alphanumerics only)."""
    from markdown_it import MarkdownIt

    text = (Path(__file__).parent / "runbook.md").read_text(encoding="utf-8")
    html = MarkdownIt("commonmark").enable("table").render(text)
    html = _HEADING.sub(lambda m: f'<h{m[1]} id="{_anchor(m[2])}">{m[2]}</h{m[1]}>', html)
    return environment().get_template("runbook.html").render(body=html, root=root_path, assets=_assets(False))


_HEADING = re.compile(r"<h([23])>(.*?)</h\1>")


def _anchor(heading_html: str) -> str:
    return re.sub(r"[^a-z0-9]", "", re.sub(r"<[^>]+>", "", heading_html).lower())


def render_login(*, next: str = "/", error: str | None = None, root_path: str = "") -> str:
    """The sign-in form (``GET /login``): the token is posted to ``/login``, which keeps it in a
    cookie and returns to ``next``."""
    return environment().get_template("login.html").render(next=next, error=error, root=root_path,
                                                           assets=_assets(False))


def render_error(*, status: int, title: str, detail: str, retry_after: str | None = None,
                 root_path: str = "") -> str:
    """The HTML page of an error of a page (``status`` and ``title`` of the problem details,
    its ``detail``): the site's header and a link to all runs."""
    return environment().get_template("error.html").render(status=status, title=title, detail=detail,
                                                           retry_after=retry_after, root=root_path,
                                                           assets=_assets(False))


def render_runs_page(runs: Sequence[Mapping[str, Any]], *, next_cursor: str | None = None,
                     status: str | None = None, root_path: str = "") -> str:
    """The run list (``GET /``): one row per run of ``GET /v1/runs``, linked to its page."""
    return environment().get_template("runs.html").render(
        runs=runs, next_cursor=next_cursor, status=status, root=root_path, assets=_assets(False))
