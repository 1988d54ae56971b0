"""Issue 27, the service half of replica drift: ``kind: fingerprint`` reports (fingerprints
computed by :func:`auditor.trainer.fingerprint.fingerprint` on CPU tensors) posted over real
HTTP to a real ``auditor serve`` on SQLite and PostgreSQL, judged when a step's reports are
complete: identical replicas are consistent, one rank's tensor changed at step 5 is
``isolated`` (rank and host named, first drifting step 5), a tp slice off is ``along_dim``
tp, two replicas are ``undecidable``, bitwise agreement reads the digests, a group of one
rank is ``unverified``; malformed fingerprints are 422s naming the field."""

from __future__ import annotations

import math
import re

import pytest
import torch

from auditor.testing.http import assert_problem, only_series, post_reports, post_reports_non_finite, post_reports_ok
from auditor.trainer.fingerprint import fingerprint

N = 4096


def _weights(seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _report(run_id: str, step: int, rank: int, tensor: torch.Tensor, *, sizes: dict, coords: dict,
            spec: dict | None, exact: bool = False, host: str | None = None, statistic: str = "ln.weight") -> dict:
    r = {"run_id": run_id, "statistic": statistic, "kind": "fingerprint", "step": step, "rank": rank,
         "world_size": math.prod(sizes.values()), "sizes": sizes, "coords": coords,
         "dtype": str(tensor.dtype).removeprefix("torch."),
         "local": {"fingerprint": fingerprint(tensor, exact=exact).tolist()}}
    if spec is not None:
        r["spec"] = spec
    if host is not None:
        r["host"] = host
    return r


def _dp_world(run_id: str, steps: int, world: int = 4, odd: tuple[int, int] | None = None, exact: bool = False,
              spec: dict | None = None) -> list[dict]:
    """``world`` DDP replicas of one weight over ``steps`` steps; ``odd`` = (rank, step):
    from that step on, that rank's copy has element 100 changed by 1e-2 (its replicas agree)."""
    out = []
    for s in range(steps):
        w = _weights(s)
        for r in range(world):
            t = w.clone()
            if odd is not None and r == odd[0] and s >= odd[1]:
                t[100] += 1e-2
            out.append(_report(run_id, s, r, t, sizes={"dp": world}, coords={"dp": r}, spec=spec, exact=exact,
                               host=f"node-{r // 2}"))
    return out


def _steps(server, run_id: str, statistic: str = "ln.weight") -> list[dict]:
    return server.get(f"/v1/runs/{run_id}/statistics/{statistic}/steps").json()["steps"]


def _step(server, run_id: str, step: int, statistic: str = "ln.weight") -> dict:
    return server.get(f"/v1/runs/{run_id}/statistics/{statistic}/steps/{step}").json()


def test_identical_replicas_are_consistent(server, run_id):
    """Four DP replicas sending the same fingerprint for 6 steps (no spec: replicate_over
    ['dp'] by default): 6 consistent steps, no fault."""
    assert post_reports_ok(server, _dp_world(run_id, 6)) == {"accepted": 24, "duplicates": 0, "steps_audited": 6}
    s = only_series(server, run_id)
    assert (s["kind"], s["steps_audited"], s["steps_consistent"], s["faults"]) == ("fingerprint", 6, 6, {})


def test_one_rank_changed_at_step_5_is_isolated_naming_rank_and_host(server, run_id):
    """Rank 2 (host node-1) of four DP replicas holds a different element from step 5: steps
    0–4 consistent, 5–7 inconsistent with one ``replica_divergence`` each, attributed
    ``isolated``, rank 2 and node-1 named, reference ranks 0, 1, 3; the gap is |Δx|/‖x‖ to
    1e-6; the series' first bad step is 5."""
    post_reports_ok(server, _dp_world(run_id, 6, odd=(2, 5), spec={"replicate_over": ["dp"]}))
    post_reports_ok(server, _dp_world(run_id, 8, odd=(2, 5), spec={"replicate_over": ["dp"]})[24:])  # a later batch
    s = only_series(server, run_id)
    assert (s["steps_consistent"], s["steps_inconsistent"], s["first_bad_step"]) == (5, 3, 5)
    assert s["faults"] == {"replica_divergence": 3}
    d = _step(server, run_id, 5)
    assert d["verdict"] == "inconsistent"
    (f,) = d["faults"]
    ev = f["evidence"]
    assert (f["kind"], f["ranks"], ev["attribution"], ev["reference_ranks"], ev["hosts"]) == (
        "replica_divergence", [2], "isolated", [0, 1, 3], ["node-1"])
    w = _weights(5)
    assert ev["gap"] == pytest.approx(1e-2 / float(w.double().norm()), rel=1e-3)
    assert "rank 2 on host node-1" in f["message"] and "device or host" in f["message"]
    assert (ev["first_step"], ev["steps"]) == (5, 1) and "at step 5, the first step it drifted" in f["message"]
    (f7,) = _step(server, run_id, 7)["faults"]  # the same drift, carried on: its first step stays 5
    assert (f7["evidence"]["first_step"], f7["evidence"]["steps"]) == (5, 3)
    assert "since step 5 (3 audited steps, this one 7)" in f7["message"]
    m = server.get("/metrics").text
    labels = f'run="{run_id}",statistic="ln.weight"'
    assert f"auditor_replica_divergence_steps_total{{{labels}}} 3.0" in m
    gauge = float(re.search(rf"auditor_replica_gap_ratio{{{labels}}} (\S+)", m).group(1))
    assert gauge == pytest.approx(f7["evidence"]["gap"], rel=1e-9)
    assert gauge == pytest.approx(1e-2 / float(_weights(7).double().norm()), rel=1e-3)
    assert f"auditor_applied_error_sigma{{{labels}}}" not in m  # not a σ: the gap has its own gauge


def test_a_tp_slice_off_is_along_dim_tp(server, run_id):
    """tp = 2 × dp = 2, a LayerNorm weight replicated over tp: from step 3 every tp = 1 rank
    holds another weight (its TP all-reduce missing). Both groups diverge, one finding
    ``along_dim`` tp naming the tp = 1 ranks and the likely fix."""
    sizes = {"dp": 2, "tp": 2}
    reports = []
    for s in range(5):
        for dp in range(2):
            for tp in range(2):
                w = _weights(s) if (tp == 0 or s < 3) else _weights(s) * 1.001
                rank = dp * 2 + tp
                reports.append(_report(run_id, s, rank, w, sizes=sizes, coords={"dp": dp, "tp": tp},
                                       spec={"replicate_over": ["tp"]}))
    post_reports_ok(server, reports)
    s = only_series(server, run_id)
    assert (s["steps_consistent"], s["steps_inconsistent"], s["first_bad_step"]) == (3, 2, 3)
    (f,) = _step(server, run_id, 3)["faults"]
    assert (f["ranks"], f["evidence"]["attribution"], f["evidence"]["dim"]) == ([1, 3], "along_dim", "tp")
    assert "_allreduce_layernorm_grads" in f["message"]


def test_two_replicas_are_undecidable(server, run_id):
    """Two DP replicas that differ: ``undecidable`` naming both."""
    post_reports_ok(server, _dp_world(run_id, 2, world=2, odd=(1, 1)))
    (f,) = _step(server, run_id, 1)["faults"]
    assert (f["ranks"], f["evidence"]["attribution"]) == ([0, 1], "undecidable")
    assert "cannot be told" in f["message"]


def test_bitwise_agreement_reads_the_digests(server, run_id):
    """A one-ulp change of one element is below the rounding tolerance (rounding: consistent)
    but changes the digests (bitwise: isolated)."""
    def world(rid, agreement):
        out = []
        for r in range(3):
            t = _weights(0)
            if r == 1:
                t[7] = torch.nextafter(t[7], torch.tensor(math.inf))
            out.append(_report(rid, 0, r, t, sizes={"dp": 3}, coords={"dp": r}, exact=True,
                               spec={"replicate_over": ["dp"], "agreement": agreement}))
        return out

    post_reports_ok(server, world(run_id, "rounding"))
    assert _step(server, run_id, 0)["verdict"] == "consistent"
    post_reports_ok(server, world(run_id + "-b", "bitwise"))
    (f,) = _step(server, run_id + "-b", 0)["faults"]
    assert (f["ranks"], f["evidence"]["attribution"], f["evidence"]["tolerance"]) == ([1], "isolated", 0.0)


def test_a_group_of_one_rank_is_unverified_never_consistent(server, run_id):
    """replica_groups [[0, 1], [2]]: rank 2's tensor has no replica to compare with, so the
    step is ``unverified`` (not consistent) even with every report in."""
    spec = {"replica_groups": [[0, 1], [2]]}
    post_reports_ok(server, [_report(run_id, 0, r, _weights(0), sizes={"dp": 3}, coords={"dp": r}, spec=spec)
                             for r in range(3)])
    s = only_series(server, run_id)
    assert (s["steps_unverified"], s["steps_consistent"]) == (1, 0)


def test_tied_embedding_groups_count_only_their_ranks(server, run_id):
    """A tied embedding on the first and last of 3 pp stages (ranks 0 and 2): the step is
    complete with their two reports and judged; the last stage out of line is found."""
    spec = {"replica_groups": [[0, 2]]}
    reports = [_report(run_id, 0, r, _weights(0) * (1.0 if r == 0 else 1.01), sizes={"pp": 3}, coords={"pp": r},
                       spec=spec, statistic="embedding") for r in (0, 2)]
    assert post_reports_ok(server, reports)["steps_audited"] == 1
    (f,) = _step(server, run_id, 0, "embedding")["faults"]
    assert (f["ranks"], f["evidence"]["attribution"]) == ([0, 2], "undecidable")


@pytest.mark.parametrize("change, field, words", [
    ({"local": {"fingerprint": [4096.5, 1.0, 2.0] + [0.0] * 8}}, "reports[0].local.fingerprint", "numel"),
    ({"local": {"fingerprint": [4096, 1.0, 2.0] + [0.0] * 7}}, "reports[0].local.fingerprint", "k=8"),
    ({"local": {"fingerprint": [4096, 1.0, 2.0] + [0.0] * 8 + [1, 2**31]}}, "reports[0].local.fingerprint",
     "digest"),
    ({"spec": {"replicate_over": ["dp"], "agreement": "bitwise"}}, "reports[0].local.fingerprint", "digests"),
    ({"spec": {"replica_groups": [[0, 1], [1, 2]]}}, "reports[0].spec.replica_groups.1", "disjoint"),
    ({"spec": {"replica_groups": [[0, 9]]}}, "reports[0].spec.replica_groups", "outside the world"),
    ({"spec": {"replicate_over": ["dp"], "k": 14}}, "reports[0].spec.k", "13"),
    ({"spec": {"replicate_over": ["dp"], "reduce_over": ["dp"]}}, "reports[0].spec.reduce_over", "reduction"),
    ({"local": {"fingerprint": [4096, 1.0, 2.0] + [0.0] * 8, "sum": 1.0}}, "reports[0].local.sum", "fingerprint"),
    ({"kind": "norm", "local": {"sum_sq": 1.0, "fingerprint": [1, 1, 1, 1]}}, "reports[0].local.fingerprint",
     "kind 'fingerprint' only"),
    ({"host": "node 1"}, "reports[0].host", "pattern"),
])
def test_malformed_fingerprints_are_422_naming_the_field(server, run_id, change, field, words):
    r = {**_report(run_id, 0, 0, _weights(0), sizes={"dp": 3}, coords={"dp": 0}, spec=None), **change}
    body = assert_problem(post_reports(server, [r]), 422, "validation")
    fields = [e["field"] for e in body["errors"]]
    assert field in fields, body
    msg = next(e["msg"] for e in body["errors"] if e["field"] == field)
    assert words in msg, msg


def test_the_run_page_shows_the_first_drifting_step_and_a_heat_strip(server, run_id):
    """Rank 2 out of line from step 5 of 8: the run page names the first drifting step (5),
    plots each step's largest gap (0 on steps 0–4: drawn at the floor, the true value on
    hover) and a heat strip of ranks × steps holding rank 2 at steps 5, 6, 7, each cell
    log10 of that step's gap."""
    from factory import page_figures

    post_reports_ok(server, _dp_world(run_id, 8, odd=(2, 5)))
    html = server.get(f"/runs/{run_id}").text
    assert "first drifting step" in html and "largest replica gap" in html
    (fig,) = page_figures(html).values()
    (strip,) = fig["drift"]["data"]
    assert (strip["type"], strip["x"], strip["y"]) == ("heatmap", [5, 6, 7], ["2"])
    gaps = [_step(server, run_id, s)["faults"][0]["evidence"]["gap"] for s in (5, 6, 7)]
    assert strip["z"] == [[pytest.approx(math.log10(g), abs=1e-9) for g in gaps]]
    assert "first drifting step 5" in fig["drift"]["layout"]["title"]["text"]
    (line,) = fig["sigma"]["data"]
    assert line["x"] == list(range(8)) and line["customdata"][:5] == [0.0] * 5
    assert line["customdata"][5:] == [pytest.approx(g, rel=1e-12) for g in gaps]


def test_the_heat_strip_is_bounded():
    """200 ranks out of line over 1,500 bad steps: 64 rows, 1,000 columns, and the title says so."""
    from auditor.web.plots import drift_strip

    steps = [{"step": s, "faults": [{"kind": "replica_divergence", "ranks": list(range(200)),
                                     "evidence": {"gap": 0.5}}]} for s in range(1500)]
    fig = drift_strip(steps, "w")
    (t,) = fig["data"]
    assert (len(t["y"]), len(t["x"]), len(t["z"]), len(t["z"][0])) == (64, 1000, 64, 1000)
    assert "first 64 of 200 ranks, first 1000 of 1500 bad steps" in fig["layout"]["title"]["text"]
    assert drift_strip([{"step": 0, "faults": [{"kind": "group_mismatch", "ranks": [1], "evidence": {}}]}], "w") is None


def test_an_infinite_gap_stays_the_worst_gap_on_report_page_and_metrics(server, run_id):
    """Rank 2 of four DP replicas holds an Inf at step 1 (a non-finite pair: gap ∞), every
    replica agrees again at step 2: the worst gap was stored as null and read 0.0 after the
    ∞ step. It reads ``"inf"`` (JSON has no Infinity) at step 1 on the report and the step
    listing, ``inf`` on the run page; a last step at ∞ is +Inf on the gap gauge."""
    reports = _dp_world(run_id, 3)
    bad = _weights(1)
    bad[7] = math.inf
    reports[4 + 2] = _report(run_id, 1, 2, bad, sizes={"dp": 4}, coords={"dp": 2}, spec=None, host="node-1")
    assert post_reports_non_finite(server, reports).status_code == 200
    s = only_series(server, run_id)
    assert (s["steps_inconsistent"], s["first_bad_step"]) == (1, 1)
    assert (s["worst_applied_error_sigma"], s["worst_applied_error_step"], s["applied_error_sigma"]) == ("inf", 1, 0.0)
    assert [x["applied_error_sigma"] for x in _steps(server, run_id)] == [0.0, "inf", 0.0]
    assert _step(server, run_id, 1)["applied_error_sigma"] == "inf"
    html = server.get(f"/runs/{run_id}").text
    card = html[html.index("largest replica gap</div>"):][:400]
    assert '<div class="value">inf</div>' in card and "(step 1)" in card, card
    last = [_report(run_id, 3, r, bad if r == 2 else _weights(1), sizes={"dp": 4}, coords={"dp": r}, spec=None)
            for r in range(4)]
    assert post_reports_non_finite(server, last).status_code == 200
    m = server.get("/metrics").text
    assert f'auditor_replica_gap_ratio{{run="{run_id}",statistic="ln.weight"}} +Inf' in m
    s = only_series(server, run_id)
    assert (s["worst_applied_error_sigma"], s["worst_applied_error_step"], s["applied_error_sigma"]) == ("inf", 1, "inf")
