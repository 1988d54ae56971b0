"""The workload page (``/workloads/{workload}``): the runs of one workload at their layouts,
each statistic's verdict and findings, and every run's statistic overlaid per step with the
differing steps marked (:func:`auditor.web.plots.workload_figure`). Drawn by ``run.js`` (the
figures as the run page embeds its σ figures)."""

from __future__ import annotations

from typing import Any, Mapping

from auditor.web import _assets, environment, plots


def render_workload_page(doc: Mapping[str, Any], *, root_path: str = "", inline_assets: bool = False) -> str:
    """The page of a workload comparison: ``doc`` is the ``GET /v1/workloads/{workload}``
    document as JSON with ``curves`` (:meth:`auditor.service.Service.workload_page`)."""
    curves = doc.get("curves") or {}
    figures = {f"w{i}": {"sigma": plots.workload_figure(s, curves.get(s["statistic"], {})), "timeline": None,
                         "steps": {}, "selected": None}
               for i, s in enumerate(doc.get("statistics") or [])}
    return environment().get_template("workload.html").render(
        doc=doc, root=root_path, assets=_assets(inline_assets), figures=plots.finite_only(figures))
