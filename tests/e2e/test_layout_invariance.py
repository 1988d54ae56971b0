"""Layout invariance on real gloo worlds (issue 26): one workload at several (dp, cp) layouts,
each layout a world of dp·cp ranks with Megatron-core groups reporting through the real hooks
and client (:mod:`auditor.testing.layouts`; workloads in tests/e2e/layout_workloads.py) to the
pytest plugin's in-process service.

* the fixed whitening is invariant across the seed's six layouts (0 findings), through the
  plugin's one-liner ``audited.layouts``; the seed's bug is flagged per run as before;
* four data-sharding faults, each consistent within its own run (every run's audit is
  ``consistent``), are flagged only by the comparison, with their diagnosis: a CP slice that
  drops the chunks of prompt-heavy sequences (tokens dropped), a denominator divided by dp
  twice (×dp), DP shards that overlap by one sample (tokens duplicated), a loss normalised
  per micro-batch (1 against 4 micro-batches: another sum, its ratio).

The layouts' worlds are forked from one preloaded server (~8 s once, then ~1 s a world).
"""

from __future__ import annotations

import re
import uuid

import numpy as np
import pytest

import layout_workloads as lw
from auditor.demo.reference import whiten_reference
from auditor.testing.layouts import SEED_LAYOUTS, check_layouts, run_layouts, workload_findings

pytestmark = pytest.mark.multiprocess

#: The whitened advantage of each of lw.SAMPLES on one rank, float64 (whiten_reference), to 6 decimals.
BASELINE = {0: 2.020621, 1: -2.820451, 2: -4.030719, 3: 0.205219}

#: (name, per-rank function, args, layouts) of the fault workloads.
FAULTS = {
    "drop": (lw.whiten_dropping_chunk, (), [(1, 1), (1, 2), (2, 2), (1, 4)]),
    "dp-twice": (lw.token_mean_loss, (lw.SAMPLES, True), [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1)]),
    "overlap": (lw.whiten_overlapping, (), [(1, 1), (2, 1), (2, 2), (4, 1)]),
    "microbatch": (lw.microbatch_mean_loss, (), [(1, 1, 1), (1, 1, 4)]),
}


@pytest.fixture(scope="module")
def faults(auditor_service):
    """Every fault workload at its layouts: {name: (workload, runs)}; the steps settled."""
    tag = uuid.uuid4().hex[:8]
    out = {}
    for name, (body, args, layouts) in FAULTS.items():
        workload = f"{name}-{tag}"
        out[name] = (workload, run_layouts(body, layouts, url=auditor_service.url, workload=workload, args=args))
    auditor_service.settle()
    return out


def _findings(service, workload: str) -> list[dict]:
    """The findings of ``GET /v1/workloads/{workload}``; its verdict says the same."""
    doc = service.reader.workload_json(workload)
    found = workload_findings(doc)
    assert doc["verdict"] == ("variant" if found else "invariant"), doc["reason"]
    return found


def _by_run(findings: list[dict]) -> dict[str, dict]:
    found = {}
    for f in findings:
        assert f["run"] not in found, f"two findings for run {f['run']}: {findings}"
        found[f["run"]] = f
    return found


def test_fixed_whitening_is_invariant_across_the_six_layouts(audited):
    """The CI one-liner: the seed's whitening over the DP group with CP at (1,1) (2,1) (1,2)
    (2,2) (1,4) (4,1): every run consistent, 0 findings; every rank's whitened value of each
    sample it holds is the single-rank baseline (float64) to 1e-6."""
    workload = f"fixed-{uuid.uuid4().hex[:8]}"
    runs = audited.layouts(lw.whiten_seed, SEED_LAYOUTS, workload=workload)
    assert [r.layout.name for r in runs] == ["1x1", "2x1", "1x2", "2x2", "1x4", "4x1"]
    baseline = whiten_reference(lw.SAMPLES, 1, 1, 0, 0)
    assert {i: round(v, 6) for i, v in baseline.items()} == BASELINE
    for run in runs:
        held = {i for rank in run.results for i in rank}
        assert held == {0, 1, 2, 3}, run.layout
        for rank in run.results:
            for i, value in rank.items():
                assert value == pytest.approx(baseline[i], abs=1e-6), (run.layout, i)
    assert _findings(audited.service, workload) == []


def test_the_seed_bug_is_flagged_per_run_and_by_the_comparison(auditor_service):
    """The seed's bug (the DP group without CP) at the six layouts: the runs with cp > 1 are
    inconsistent (wrong_group), those with cp = 1 consistent — the per-run audit, unchanged;
    the comparison finds their data the same (count, mean, var agree) but what they applied
    not (``applied_differs``: each CP rank applied the count of its own slice; rank 0's, compared,
    is that of CP rank 0: 1,065 tokens at cp = 2, 1,023 at cp = 4, against 1,150)."""
    workload = f"buggy-{uuid.uuid4().hex[:8]}"
    runs = run_layouts(lw.whiten_seed, SEED_LAYOUTS, url=auditor_service.url, workload=workload,
                       args=(lw.SAMPLES, False))
    auditor_service.settle()
    ids = {r.layout.name: r.run_id for r in runs}
    for run in runs:
        (stat,) = auditor_service.reader.report(run.run_id).statistics
        assert ("wrong_group" in stat.faults) == (run.layout.cp > 1), (run.layout, stat.faults)
    found = _by_run(_findings(auditor_service, workload))
    assert set(found) == {ids["1x2"], ids["2x2"], ids["1x4"]}
    for name, applied in (("1x2", 1065), ("2x2", 1065), ("1x4", 1023)):
        f = found[ids[name]]
        assert (f["moment"], f["diagnosis"], f["reference"]) == ("applied_count", "applied_differs", ids["1x1"])
        assert (f["evidence"]["run_value"], f["evidence"]["reference_value"]) == (applied, 1150)
    # check_layouts with the bug expected: the runs pass as inconsistent, the comparison does not
    problems = check_layouts(auditor_service.reader, workload, runs,
                             expect_inconsistent=[ids[n] for n in ("1x2", "2x2", "1x4")])
    assert [p.split(" (run ")[0] for p in problems] == ["layout dp=1, cp=2", "layout dp=1, cp=4",
                                                        "layout dp=2, cp=2"], problems
    # at 1×2 each CP rank whitens with its own slice's statistics (the seed's table, here with
    # the prompt-heavy fourth sequence, whose tokens all sit on CP rank 0)
    for c, rank in enumerate(runs[2].results):
        expected = whiten_reference(lw.SAMPLES, 1, 2, 0, c, over_cp=False)
        assert rank.keys() == expected.keys()
        for i, value in rank.items():  # float32 whitening against float64: |error| < 1e-5 at |values| < 6
            assert value == pytest.approx(expected[i], abs=1e-5), (c, i)
    halves = [rank[0] for rank in runs[2].results]
    assert abs(halves[0] - halves[1]) > 0.5, halves  # sequence 0's two halves, as in the seed


def test_every_fault_run_is_consistent_on_its_own(faults, auditor_service):
    """Each fault is invisible to the audit of its run: every run of every fault workload is
    consistent, all reports delivered."""
    runs = [r for _, rs in faults.values() for r in rs]
    assert len(runs) == 15
    for run in runs:
        assert run.delivered, (run.run_id, run.stats)
        report = auditor_service.reader.report(run.run_id)
        assert report.status == "consistent", (run.run_id, report.status)


def test_a_cp_slice_that_drops_chunks_is_tokens_dropped(faults, auditor_service):
    """The CP split that skips a sequence whose first chunk is all prompt: at cp = 2 the
    prompt-heavy (9000, 1000) loses its 1000 response tokens (all in CP rank 0's second chunk)
    and (40, 12) its 9 + 3; at cp = 4 also 7 of (64, 48): 1,012 and 1,019 tokens dropped
    against the 1×1 run, at step 0; the 1×1 run itself is the reference."""
    workload, runs = faults["drop"]
    found = _by_run(_findings(auditor_service, workload))
    ids = {r.layout.name: r.run_id for r in runs}
    assert set(found) == {ids["1x2"], ids["2x2"], ids["1x4"]}
    for name, dropped in (("1x2", 1012), ("2x2", 1012), ("1x4", 1019)):
        f = found[ids[name]]
        assert (f["statistic"], f["moment"], f["diagnosis"], f["first_step"]) == ("advantages", "count",
                                                                                  "tokens_dropped", 0)
        assert f["reference"] == ids["1x1"]
        assert f["evidence"]["tokens_dropped"] == dropped and f["evidence"]["tokens_duplicated"] == 0
        assert f["evidence"]["reference_value"] == 1150 and f["evidence"]["run_value"] == 1150 - dropped
        assert f"counts {dropped:,} tokens fewer" in f["message"]


def test_a_denominator_divided_by_dp_twice_is_a_factor_of_dp(faults, auditor_service):
    """The token-mean loss whose denominator is divided by dp once more: ×2 at dp = 2 (= dp,
    and = cp at 2×2), ×4 at dp = 4, nothing at dp = 1 (1×2 agrees); the token count itself
    (``loss_tokens``) agrees at every layout."""
    workload, runs = faults["dp-twice"]
    found = _by_run(_findings(auditor_service, workload))
    ids = {r.layout.name: r.run_id for r in runs}
    assert set(found) == {ids["2x1"], ids["2x2"], ids["4x1"]}
    loss = _token_mean_loss()
    for name, k, text in (("2x1", 2, "×2 = dp"), ("2x2", 2, "×2 = dp = cp"), ("4x1", 4, "×4 = dp")):
        f = found[ids[name]]
        assert (f["statistic"], f["moment"], f["diagnosis"], f["first_step"]) == ("loss", "sum", "sum_factor", 0)
        assert f["evidence"]["factor"] == k and f["evidence"]["factor_dims"][0] == "dp"
        assert text in f["message"]
        assert f["evidence"]["reference_value"] == pytest.approx(loss, abs=1e-6)
        assert f["evidence"]["run_value"] == pytest.approx(k * loss, abs=1e-5)


def test_dp_shards_that_overlap_by_one_sample_are_tokens_duplicated(faults, auditor_service):
    """Contiguous DP shards each taking the next shard's first sample: at dp = 2 sample 2
    (12 response tokens) is counted twice, at dp = 4 samples 1, 2, 3 (90 + 12 + 1000)."""
    workload, runs = faults["overlap"]
    found = _by_run(_findings(auditor_service, workload))
    ids = {r.layout.name: r.run_id for r in runs}
    assert set(found) == {ids["2x1"], ids["2x2"], ids["4x1"]}
    for name, duplicated in (("2x1", 12), ("2x2", 12), ("4x1", 1102)):
        f = found[ids[name]]
        assert (f["moment"], f["diagnosis"], f["first_step"]) == ("count", "tokens_duplicated", 0)
        assert f["evidence"]["tokens_duplicated"] == duplicated and f["evidence"]["tokens_dropped"] == 0
        assert f"counts {duplicated:,} tokens more" in f["message"]


def test_a_loss_normalised_per_microbatch_differs_with_four_microbatches(faults, auditor_service):
    """The loss as a mean of per-micro-batch token-means: one micro-batch gives the token mean,
    four (one sample each) the mean of the samples' token-means — another sum, not an integer
    factor, with the ratio of the two means."""
    workload, runs = faults["microbatch"]
    (f,) = _findings(auditor_service, workload)
    ids = {r.layout.name: r.run_id for r in runs}
    assert (f["run"], f["reference"]) == (ids["1x1-mb4"], ids["1x1"])
    assert (f["statistic"], f["moment"], f["diagnosis"], f["first_step"]) == ("loss", "sum", "different_sum", 0)
    token_mean = _token_mean_loss()
    mean_of_means = float(np.mean([lw.token_losses(i, s.response).mean(dtype=np.float64)
                                   for i, s in enumerate(lw.SAMPLES)]))
    assert f["evidence"]["reference_value"] == pytest.approx(token_mean, abs=1e-6)
    assert f["evidence"]["run_value"] == pytest.approx(mean_of_means, abs=1e-6)
    assert f["evidence"]["relative"] == pytest.approx(mean_of_means / token_mean - 1, abs=1e-6)


def test_the_failure_text_names_the_layout_and_the_step(faults, auditor_service):
    """check_layouts on the overlapping shards: one line per differing layout, naming it, its
    run, the reference layout and the step; every run consistent, so nothing else."""
    workload, runs = faults["overlap"]
    problems = check_layouts(auditor_service.reader, workload, runs)
    assert len(problems) == 3
    first = next(p for p in problems if p.startswith("layout dp=2, cp=1 "))
    assert first.startswith(f"layout dp=2, cp=1 (run '{runs[1].run_id}') differs from layout dp=1, cp=1 at step 0 "
                            f"(advantages, count: tokens_duplicated): ")


def _token_mean_loss() -> float:
    """The step's token-mean loss of lw.SAMPLES, float64."""
    losses = [lw.token_losses(i, s.response).astype(np.float64) for i, s in enumerate(lw.SAMPLES)]
    return float(sum(x.sum() for x in losses) / sum(len(x) for x in losses))


#: The seed's table at 1x1, 2x1, 1x2, 2x2 (columns: 1x1, 2x1, 1x2 cp0, 1x2 cp1, 2x2 cp0, 2x2 cp1).
#: CURRENT: at cp = 2 each CP rank whitens with its own slice's statistics (the seed's
#: +1.707037 / +1.273883; at 2x2 the DP group without CP joins the two replicas' slices of one
#: CP rank: the same tokens as 1x2's); FIXED: the single-rank value everywhere.
DEMO_TABLES = {
    "CURRENT": [["+1.439168", "+1.439168", "+1.707037", "+1.273883", "+1.707037", "+1.273883"],
                ["-0.616786", "-0.616786", "-0.457986", "-0.740629", "-0.457986", "-0.740629"],
                ["-1.130775", "-1.130775", "-0.999241", "-1.244257", "-0.999241", "-1.244257"]],
    "FIXED": [["+1.439168"] * 6, ["-0.616786"] * 6, ["-1.130775"] * 6],
}


def test_auditor_demo_layouts_prints_the_seed_table_and_the_verdicts(auditor_service):
    """`auditor demo --layouts 1x1,2x1,1x2,2x2 --url …` as a user runs it: both tables to 6
    decimals, each run's verdict (the buggy ones inconsistent exactly at cp = 2) and each
    workload's comparison."""
    from auditor.testing.cli import run_auditor

    out = run_auditor("demo", "--layouts", "1x1,2x1,1x2,2x2", "--url", auditor_service.url, clean=True,
                      timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    for title, rows in DEMO_TABLES.items():
        table = text[text.index(f"Whitened advantage per sequence — {title}"):]
        header = next(ln for ln in table.splitlines() if "seq" in ln and "(T, R)" in ln)
        assert [c.strip() for c in header.split("┃")[4:-1]] == ["1x1", "2x1", "1x2 cp0", "1x2 cp1", "2x2 cp0",
                                                                 "2x2 cp1"]
        body = [ln for ln in table.splitlines() if ln.startswith("│")][:3]
        assert [[c.strip() for c in ln.split("│")[4:-1]] for ln in body] == rows, table
    assert "buggy: runs 1x1 consistent, 2x1 consistent, 1x2 INCONSISTENT, 2x2 INCONSISTENT" in text
    assert "fixed: runs 1x1 consistent, 2x1 consistent, 1x2 consistent, 2x2 consistent" in text
    prefix = re.search(r"workloads (\S+)-buggy, ", text)[1]
    buggy = text[text.index("buggy: runs"):text.index("fixed: runs")].splitlines()
    assert buggy[1] == f"  workload {prefix}-buggy: VARIANT: statistic(s) advantages differ between layouts"
    for line, name in zip(buggy[2:], ("1x2", "2x2")):  # each CP rank applied the count of its own slice
        assert line.startswith(f"    advantages: run '{prefix}-{name}-buggy' ") and ": 65 against 150," in line, line
    fixed = text[text.index("fixed: runs"):]
    assert fixed.splitlines()[1].startswith(f"  workload {prefix}-fixed: invariant: "), fixed
