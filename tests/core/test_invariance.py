"""Layout invariance (issue 26, :mod:`auditor.core.invariance`) on data sharded as trainers shard it.

One workload: per step ~10⁷ tokens in 256 sequences, values μ = 100, σ = 1 (|mean|/σ = 10²,
the tolerance model's own limits, docs/tolerance.md §4). Each layout shards it as a trainer
would — samples split contiguously over dp, each rank's samples into micro-batches, each
sequence into 2·cp zigzag chunks (CP rank c holds chunks c and 2cp − 1 − c) — and each
shard's local sums are float32 pairwise sums (numpy's ``np.sum``, like torch's cascade sum),
the applied values a sequential float32 ring add of the partials. The auditor's correct
statistic is the float64 Chan merge of the local moments (:func:`stats.merge_arrays`).

Statistics: ``advantages`` (moments of the values), ``loss_terms`` (moments of value /
tokens of the step: a token-mean loss's terms) and ``loss_denominator`` (sum: the step's
token count, summed over all micro-batches).

Contracts pinned:
A. Correct runs at five layouts (world 1, dp2·cp2, dp4·cp2, dp4 × 4 micro-batches, dp2·cp2·tp2
   × 2 micro-batches in bfloat16) give no finding.
B. Each injected data-sharding fault gives exactly its finding, with its numbers: a CP slice
   that drops a chunk (tokens dropped, how many), a denominator divided by dp twice (÷4 = dp),
   dp shards overlapping by one sample (tokens duplicated, how many), normalisation per
   micro-batch (another mean, equal counts).
C. Reference choice without a world-size-1 run (majority, ties said), applied values,
   input errors, and 100,000 steps in well under a second.
"""

from __future__ import annotations


import numpy as np
import pytest

from auditor.core import invariance as inv
from auditor.core import stats

MU, SIGMA = 100.0, 1.0
SEQS = 256
STEPS = 2
SEED = 26


def _bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest, ties to even), kept as float32."""
    bits = x.astype(np.float32).view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


@pytest.fixture(scope="module")
def workload() -> list[tuple[np.ndarray, np.ndarray]]:
    return make_workload()


def make_workload() -> list[tuple[np.ndarray, np.ndarray]]:
    """Per step: the sequence lengths (int64, 256, summing to 10⁷) and the token values
    (float32, one per token)."""
    rng = np.random.default_rng(SEED)
    out = []
    for _ in range(STEPS):
        lengths = rng.integers(20_000, 60_000, SEQS)
        lengths = lengths * 10_000_000 // int(lengths.sum())
        lengths[-1] += 10_000_000 - int(lengths.sum())
        values = (MU + SIGMA * rng.standard_normal(int(lengths.sum()))).astype(np.float32)
        out.append((lengths, values))
    return out


def _shards(lengths: np.ndarray, dp: int, cp: int, mb: int, fault: str | None) -> dict[tuple, list[tuple[int, int]]]:
    """(dp rank, cp rank, micro-batch) → the token slices [start, end) it holds.

    ``fault``: ``cp_drop`` — the last CP rank forgets its second zigzag chunk;
    ``dp_overlap`` — each DP rank's sample range ends one sample late (off by one)."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    edges = np.linspace(0, len(lengths), dp + 1).astype(int)
    out: dict[tuple, list[tuple[int, int]]] = {}
    for d in range(dp):
        end = edges[d + 1] + (1 if fault == "dp_overlap" and d < dp - 1 else 0)
        for m, seqs in enumerate(np.array_split(np.arange(edges[d], end), mb)):
            for c in range(cp):
                chunks = (c, 2 * cp - 1 - c) if not (fault == "cp_drop" and c == cp - 1) else (c,)
                out[(d, c, m)] = [(int(starts[j] + lengths[j] * k // (2 * cp)),
                                   int(starts[j] + lengths[j] * (k + 1) // (2 * cp)))
                                  for j in seqs for k in chunks]
    return out


def _ring(parts: list) -> np.float32:
    """A sequential float32 all-reduce (ring) of the partials, in rank order."""
    acc = np.float32(0.0)
    for p in parts:
        acc = np.float32(acc + np.float32(p))
    return acc


def _run(workload, run_id: str, world: int, sizes: dict, mb: int = 1, dtype: str = "float32",
         fault: str | None = None) -> tuple[inv.RunLayout, list[inv.Series]]:
    """One run of the workload at a layout: its layout and its three series."""
    dp, cp = sizes.get("dp", 1), sizes.get("cp", 1)
    layout = inv.RunLayout(run_id, world, sizes, mb, dtype)
    cols: dict[str, list] = {k: [] for k in ("adv", "adv_applied", "loss", "loss_applied", "den", "den_applied")}
    for lengths, values in workload:
        if dtype == "bfloat16":
            values = _bfloat16(values)
        shards = _shards(lengths, dp, cp, mb, fault)
        keys = sorted(shards, key=lambda k: (k[2], k[0], k[1]))
        data = {k: np.concatenate([values[a:b] for a, b in shards[k]]) for k in keys}
        count = {k: float(len(data[k])) for k in keys}
        total = sum(count.values())
        per_mb = {m: sum(n for k, n in count.items() if k[2] == m) for m in range(mb)}
        for name, scale in (("adv", None), ("loss", "loss")):
            n, s, ss = [], [], []
            for k in keys:
                v = data[k]
                if scale:  # a token-mean loss's terms: value / tokens of the step (of the micro-batch: the fault)
                    v = v / np.float32(per_mb[k[2]] if fault == "per_microbatch" else total)
                n.append(count[k])
                s.append(float(np.sum(v, dtype=np.float32)))
                ss.append(float(np.sum(v * v, dtype=np.float32)))
            N, mean, m2 = stats.merge_arrays(*stats.moments_from_sums_array(np.array(n), np.array(s), np.array(ss)))
            S, SS, NN = _ring(s), _ring(ss), _ring(n)
            am = np.float32(S / NN)
            av = np.float32((np.float32(SS / NN) - am * am) * np.float32(NN / (NN - np.float32(1))))
            cols[name].append((N, mean, m2 / N))
            cols[name + "_applied"].append((float(NN), float(am), float(av)))
        locals_ = [np.float32(count[k] / dp) if fault == "dp_twice" else np.float32(count[k]) for k in keys]
        cols["den"].append((float(np.sum(np.array(locals_, dtype=np.float64))), total))
        cols["den_applied"].append(float(_ring(locals_)))
    steps = np.arange(STEPS)
    ranks = float(dp * cp * mb)
    out: list[inv.Series] = []
    for name, stat in (("adv", "advantages"), ("loss", "loss_terms")):
        c, a = np.array(cols[name]), np.array(cols[name + "_applied"])
        out.append(inv.MomentSeries(run_id, stat, steps, c[:, 0], c[:, 1], c[:, 2], ranks,
                                    applied_count=a[:, 0], applied_mean=a[:, 1], applied_var=a[:, 2]))
    den = np.array(cols["den"])
    out.append(inv.SumSeries(run_id, "loss_denominator", steps, den[:, 0], ranks, terms=den[:, 1],
                             applied=np.array(cols["den_applied"])))
    return layout, out


CORRECT = [
    ("ws1", 1, {}, 1, "float32"),
    ("dp2-cp2", 4, {"dp": 2, "cp": 2}, 1, "float32"),
    ("dp4-cp2", 8, {"dp": 4, "cp": 2}, 1, "float32"),
    ("dp4-mb4", 4, {"dp": 4}, 4, "float32"),
    ("dp2-cp2-tp2-mb2-bf16", 8, {"dp": 2, "cp": 2, "tp": 2}, 2, "bfloat16"),
]


@pytest.fixture(scope="module")
def correct(workload):
    """The five correct runs: (layouts, series)."""
    layouts, series = [], []
    for spec in CORRECT:
        lay, ser = _run(workload, *spec)
        layouts.append(lay)
        series.extend(ser)
    return layouts, series


def _with(correct, workload, *run) -> list[inv.InvarianceFinding]:
    lay, ser = _run(workload, *run[:-1], fault=run[-1])
    return inv.compare_workload(correct[0] + [lay], correct[1] + ser)


def _summary(findings) -> list[tuple]:
    return [(f.statistic, f.run, f.moment, f.diagnosis, f.first_step, f.steps) for f in findings]


# ---------------------------------------------------------------- A. correct runs

def test_correct_layouts_agree_within_the_two_run_bound(workload, correct):
    """No finding on five correct layouts at 10⁷ tokens and |mean|/σ = 10²: float32 sums
    that differ only by summation order (and a bfloat16 run) stay within the sum of the two
    runs' bounds. The worst float32 pair uses 1 % of its bound (the worst case of the model;
    random rounding errors grow as √, not as the depth)."""
    lengths, values = workload[0]
    assert int(lengths.sum()) == 10_000_000
    assert float(np.mean(values, dtype=np.float64) / np.std(values, dtype=np.float64)) == pytest.approx(100.0, rel=1e-2)
    layouts, series = correct
    assert inv.compare_workload(layouts, series) == []
    by = {(s.run_id, s.statistic): s for s in series}
    lay = {x.run_id: x for x in layouts}
    worst = 0.0
    for (run, stat), s in by.items():
        if run == "ws1" or lay[run].dtype != "float32":
            continue
        r = by[("ws1", stat)]
        va, vr = inv.series_values(s), inv.series_values(r)
        ta, tr = inv.series_tolerance(lay[run], s), inv.series_tolerance(lay["ws1"], r)
        for m in va:
            if m.endswith("count"):  # whole counts below 2²⁴: exact, bound 0
                assert np.array_equal(va[m], vr[m]) and not ta[m].any()
                continue
            worst = max(worst, float(np.max(np.abs(va[m] - vr[m]) / (ta[m] + tr[m]))))
    assert 0.0 < worst < 0.02
    # the numbers behind it: the reference's step 0, and the bound of its mean
    ref = by[("ws1", "advantages")]
    assert ref.count[0] == 10_000_000
    assert ref.mean[0] == pytest.approx(100.000282, abs=1e-6)
    assert ref.var[0] == pytest.approx(0.999424, abs=1e-6)
    assert inv.series_tolerance(lay["ws1"], ref)["mean"][0] == pytest.approx(0.000322, abs=1e-6)


# ---------------------------------------------------------------- B. injected faults

def test_cp_slice_that_drops_a_chunk(workload, correct):
    """The last CP rank forgets its second zigzag chunk (chunk 2 of 4 under cp = 2): every
    statistic of the run loses those tokens. advantages and loss_terms: ``count``, tokens
    dropped, exactly Σ over sequences of the chunk's length; the denominator: another sum,
    not an integer factor."""
    findings = _with(correct, workload, "dp2-cp2-drop", 4, {"dp": 2, "cp": 2}, 1, "float32", "cp_drop")
    assert _summary(findings) == [
        ("advantages", "dp2-cp2-drop", "count", "tokens_dropped", 0, 2),
        ("loss_denominator", "dp2-cp2-drop", "sum", "different_sum", 0, 2),
        ("loss_terms", "dp2-cp2-drop", "count", "tokens_dropped", 0, 2),
    ]
    lengths = [w[0] for w in workload]
    dropped = [int(np.sum(3 * L // 4 - 2 * L // 4)) for L in lengths]
    f = findings[0]
    assert f.reference == "ws1" and f.evidence["tokens"] == -dropped[0]
    assert f.evidence["tokens_dropped"] == sum(dropped) == 4_999_930
    assert f.evidence["tokens_duplicated"] == 0
    assert f.message == (
        "advantages: run 'dp2-cp2-drop' (world 4: dp=2, cp=2, float32) counts 2,499,966 tokens fewer than the "
        "reference 'ws1' (world 1: float32; the world-size-1 run) at step 0 (2 of the 2 steps both audited differ), "
        "2,499,964–2,499,966 each; 4,999,930 dropped and 0 duplicated in all: tokens dropped — a data shard "
        "(a CP chunk, a DP slice) loses part of the step's batch")
    assert findings[1].evidence["relative"] == pytest.approx(-0.249997, abs=1e-6)


def test_denominator_divided_by_dp_twice(workload, correct):
    """Each rank's denominator already divided by dp = 4: the run's sum is ÷4 of the
    reference's, and 4 is the run's dp (not cp = 2, not the world 8)."""
    findings = _with(correct, workload, "dp4-cp2-dpx2", 8, {"dp": 4, "cp": 2}, 1, "float32", "dp_twice")
    assert _summary(findings) == [("loss_denominator", "dp4-cp2-dpx2", "sum", "sum_factor", 0, 2)]
    f = findings[0]
    assert f.evidence["factor"] == 0.25 and f.evidence["factor_dims"] == ["dp"]
    assert f.evidence["reference_value"] == 10_000_000 and f.evidence["run_value"] == 2_500_000
    assert "gives a sum 4× smaller than the reference 'ws1'" in f.message
    assert "÷4 = dp: the run divides by that size once more than the reference" in f.message


def test_dp_shards_overlapping_by_one_sample(workload, correct):
    """DP rank 0's sample range ends one sample late: the first sample of rank 1 is counted
    twice — count +its length (tokens duplicated), in both moments statistics."""
    findings = _with(correct, workload, "dp2-overlap", 2, {"dp": 2}, 1, "float32", "dp_overlap")
    assert _summary(findings) == [
        ("advantages", "dp2-overlap", "count", "tokens_duplicated", 0, 2),
        ("loss_denominator", "dp2-overlap", "sum", "different_sum", 0, 2),
        ("loss_terms", "dp2-overlap", "count", "tokens_duplicated", 0, 2),
    ]
    duplicated = [int(w[0][SEQS // 2]) for w in workload]
    f = findings[0]
    assert f.evidence["tokens"] == duplicated[0] and f.evidence["tokens_duplicated"] == sum(duplicated)
    assert f.evidence["tokens_dropped"] == 0 and sum(duplicated) == 84_459
    assert "counts 30,524 tokens more than the reference 'ws1'" in f.message
    assert "30,524–53,935 each; 0 dropped and 84,459 duplicated in all: tokens duplicated — shards overlap" in f.message
    assert findings[1].evidence["relative"] == pytest.approx(0.003052, abs=1e-6)


def test_normalisation_per_microbatch(workload, correct):
    """The loss terms divided by the micro-batch's tokens instead of the step's: with 4
    micro-batches the mean is ~4× the reference's (1 micro-batch) with the same count —
    different data, the near factor named as a hint; advantages and the denominator are
    untouched."""
    findings = _with(correct, workload, "dp2-mb4-permb", 2, {"dp": 2}, 4, "float32", "per_microbatch")
    assert _summary(findings) == [("loss_terms", "dp2-mb4-permb", "mean", "different_data", 0, 2)]
    f = findings[0]
    assert f.evidence["count"] == 10_000_000
    assert f.evidence["reference_value"] == pytest.approx(1e-5, rel=1e-5)
    assert f.evidence["ratio"] == pytest.approx(4.000000, abs=1e-6)
    assert f.evidence["difference_sigma"] == pytest.approx(300.189971, abs=1e-6)
    assert f.evidence["bound_sigma"] < 0.01
    assert f.evidence["near_factor_dims"] == ["micro-batches"]
    assert "sees another mean than the reference 'ws1'" in f.message
    assert "with the same token count (10,000,000)" in f.message
    assert ("it is 4.000000× the reference's, about ×4 = micro-batches of the run — a normalisation by a count "
            "per such shard?") in f.message


# ---------------------------------------------------------------- C. the rules

def _moments(run_id, mean, count=1000.0, steps=3, applied_mean=None, ranks=2.0):
    k = np.arange(steps)
    return inv.MomentSeries(run_id, "adv", k, np.full(steps, count), np.full(steps, mean), np.ones(steps), ranks,
                            applied_mean=None if applied_mean is None else np.full(steps, applied_mean))


def test_majority_reference_without_a_world_size_1_run():
    """No world-size-1 run: the reference is the run most others agree with; the odd one out
    is the finding. Two runs that disagree tie: the smaller world size wins, and the message says
    it was a tie."""
    lays = [inv.RunLayout("a", 4, {"dp": 4}), inv.RunLayout("b", 2, {"dp": 2}), inv.RunLayout("c", 8, {"dp": 8})]
    findings = inv.compare_workload(lays, [_moments("a", 0.0), _moments("b", 0.5), _moments("c", 0.0)])
    assert _summary(findings) == [("adv", "b", "mean", "different_data", 0, 3)]
    assert findings[0].reference == "a" and findings[0].evidence["reference_rule"] == "majority"
    assert "agreeing with 2 of 3 runs" in findings[0].message
    tie = inv.compare_workload(lays[:2], [_moments("a", 0.0), _moments("b", 0.5)])
    assert [(f.reference, f.run) for f in tie] == [("b", "a")]
    assert tie[0].evidence["reference_tied_with"] == ["a"]
    assert "tied with 'a', chosen by smallest world size, then fewest micro-batches, then run id" in tie[0].message
    # two world-size-1 runs: the one the others agree with
    ones = [inv.RunLayout("w1-bad", 1), inv.RunLayout("w1-good", 1), inv.RunLayout("b", 2, {"dp": 2})]
    findings = inv.compare_workload(ones, [_moments("w1-bad", 0.5), _moments("w1-good", 0.0), _moments("b", 0.0)])
    assert [(f.reference, f.run) for f in findings] == [("w1-good", "w1-bad")]
    assert "(world 1: float32; the world-size-1 run agreeing with 2 of 3 runs)" in findings[0].message


def test_common_steps_and_the_detail():
    """Runs compare at the steps both audited (here 3 of 5), in any order given; the detail
    names each statistic's reference and the steps each run shares with it. A run that
    shares no step with another does not count as agreeing with it."""
    lays = [inv.RunLayout("one", 1), inv.RunLayout("two", 2, {"dp": 2})]
    late = inv.MomentSeries("two", "adv", np.array([6, 5, 4, 3, 2]), np.array([1000.0, 1000, 1000, 999, 1000]),
                            np.zeros(5), np.ones(5), 2.0)
    detail = inv.compare_workload_detail(lays, [_moments("one", 0.0, steps=5), late])
    assert _summary(detail.findings) == [("adv", "two", "count", "tokens_dropped", 3, 1)]
    assert detail.findings[0].compared == 3 and detail.findings[0].evidence["tokens"] == -1
    assert detail.references["adv"].run_id == "one" and detail.references["adv"].rule == "world size 1"
    assert detail.compared == {("adv", "one"): 5, ("adv", "two"): 3}
    apart = [_moments("a", 0.0, steps=2), inv.MomentSeries("b", "adv", np.array([7, 8]), np.full(2, 1000.0),
                                                           np.zeros(2), np.ones(2), 2.0)]
    ref = inv.compare_workload_detail([inv.RunLayout("a", 2), inv.RunLayout("b", 4)], apart).references["adv"]
    assert (ref.run_id, ref.agreeing, ref.tied_with) == ("a", 1, ("b",))


def test_applied_value_differs_where_data_agree():
    """Correct statistics agree, the applied mean does not: ``applied_mean``."""
    lays = [inv.RunLayout("one", 1), inv.RunLayout("two", 2, {"dp": 2})]
    series = [_moments("one", 0.0, applied_mean=0.0), _moments("two", 0.0, applied_mean=0.25)]
    findings = inv.compare_workload(lays, series)
    assert _summary(findings) == [("adv", "two", "applied_mean", "applied_differs", 0, 3)]


def test_count_factor_names_the_dims():
    """A count exactly twice the reference's in a tp = 2 run: ×2 = tp (replicas counted)."""
    lays = [inv.RunLayout("one", 1), inv.RunLayout("tp2", 4, {"dp": 2, "tp": 2})]
    findings = inv.compare_workload(lays, [_moments("one", 0.0), _moments("tp2", 0.0, count=2000.0)])
    assert findings[0].diagnosis == "count_factor"
    assert findings[0].evidence["factor_dims"] == ["dp", "tp"]
    assert "the count is ×2 = dp = tp: every token counted 2 times" in findings[0].message
    assert inv.factor_dims(4, inv.RunLayout("x", 8, {"dp": 2, "cp": 2, "tp": 2})) == ["dp·cp", "dp·tp", "cp·tp"]


def test_input_errors():
    lay = [inv.RunLayout("a", 1)]
    with pytest.raises(ValueError, match="run 'b' has no layout"):
        inv.compare_workload(lay, [_moments("b", 0.0)])
    bad = inv.MomentSeries("a", "adv", np.array([0, 0]), np.ones(2), np.zeros(2), np.ones(2), 1.0)
    with pytest.raises(ValueError, match="step 0 given twice"):
        inv.compare_workload(lay, [bad])
    with pytest.raises(ValueError, match="given twice"):
        inv.compare_workload(lay, [_moments("a", 0.0), _moments("a", 0.0)])
    with pytest.raises(ValueError, match="run 'a' given two layouts"):
        inv.compare_workload(lay + lay, [])
    with pytest.raises(ValueError, match="is 'moments' in run 'a' and 'sum' in run 'b'"):
        inv.compare_workload(lay + [inv.RunLayout("b", 2)],
                             [_moments("a", 0.0), inv.SumSeries("b", "adv", np.arange(3), np.ones(3), 2.0)])
    with pytest.raises(ValueError, match="run .a., statistic .adv.: mean holds 2 values for 3 steps"):
        inv.compare_workload(lay, [inv.MomentSeries("a", "adv", np.arange(3), np.ones(3), np.zeros(2), np.ones(3), 1.0)])


def test_100k_steps_of_four_runs_name_the_one_run_that_dropped_a_token():
    """4 runs × 100,000 steps × (a moments statistic with applied values and a sum): one run
    drops a token from step 500 on — one finding, from that step, for every later step
    (vectorised over steps: ~0.07 s on an idle core; speed is not asserted here)."""
    k = 100_000
    rng = np.random.default_rng(1)
    lays = [inv.RunLayout("a", 1), inv.RunLayout("b", 4, {"dp": 2, "cp": 2}),
            inv.RunLayout("c", 8, {"dp": 4, "cp": 2}), inv.RunLayout("d", 4, {"dp": 4}, 4)]
    series = []
    for lay in lays:
        step, c, v = np.arange(k), np.full(k, 1e7), np.ones(k)
        m = 100.0 + 1e-9 * rng.standard_normal(k)
        p = lay.world_size * lay.microbatches
        series += [inv.MomentSeries(lay.run_id, "adv", step, c, m, v, p, c, m, v),
                   inv.SumSeries(lay.run_id, "den", step, c, p, terms=c)]
    series[-2] = inv.MomentSeries("d", "adv", np.arange(k), np.where(np.arange(k) >= 500, 1e7 - 1, 1e7), m, v, 16.0)
    findings = inv.compare_workload(lays, series)
    assert _summary(findings) == [("adv", "d", "count", "tokens_dropped", 500, k - 500)]


def test_two_run_bound_of_the_docs_example():
    """docs/tolerance.md §6's example: float32, N = 10⁷, rms² = 1 + 10⁴, world 1 against
    P = 8 — γ₁ = 1.609·10⁻⁶, γ₈ = 2.556·10⁻⁶, mean 8.3·10⁻⁴, variance 0.29, count 0."""
    one, eight = inv.RunLayout("one", 1), inv.RunLayout("eight", 8, {"dp": 8})
    a = inv.series_tolerance(one, _moments("one", 100.0, count=1e7, steps=1, ranks=1.0))
    b = inv.series_tolerance(eight, _moments("eight", 100.0, count=1e7, steps=1, ranks=8.0))
    assert stats.reduction_gamma("float32", 1e7, 1) == pytest.approx(1.609325e-6, abs=1e-12)
    assert stats.reduction_gamma("float32", 1e7, 8) == pytest.approx(2.555520e-6, abs=1e-12)
    assert a["count"][0] == b["count"][0] == 0.0
    assert float(a["mean"][0] + b["mean"][0]) == pytest.approx(0.000833, abs=1e-6)
    assert float(a["var"][0] + b["var"][0]) == pytest.approx(0.291568, abs=1e-6)
