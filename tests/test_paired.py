"""Paired tests (adept_ext.evaluation.paired): McNemar's exact p against scipy's binomial test and known values, the
paired bootstrap interval against scipy's bootstrap, and the per-metric verdict of paired_difference."""
import numpy as np
import pytest
from scipy import stats

from adept_ext.evaluation.paired import mcnemar_exact, paired_bootstrap, paired_difference


@pytest.mark.parametrize("b,c", [(0, 0), (0, 6), (6, 0), (3, 3), (1, 9), (12, 30), (40, 41), (7, 120), (250, 199)])
def test_mcnemar_equals_scipys_exact_binomial_test(b, c):
    want = 1.0 if b + c == 0 else stats.binomtest(min(b, c), b + c, 0.5).pvalue
    assert mcnemar_exact(b, c) == pytest.approx(want, rel=1e-12, abs=1e-300)


def test_mcnemar_known_values_and_bad_counts():
    assert mcnemar_exact(0, 6) == 2 / 64  # both tails of Bin(6, 1/2) at 0
    assert mcnemar_exact(1, 4) == 2 * 6 / 32  # P(X <= 1) = 6/32
    assert mcnemar_exact(5, 5) == 1.0
    with pytest.raises(ValueError, match=">= 0"):
        mcnemar_exact(-1, 3)


def test_bootstrap_interval_agrees_with_scipys_percentile_bootstrap():
    rng = np.random.default_rng(1)
    d = rng.choice([-1.0, 0.0, 1.0], p=[0.15, 0.75, 0.10], size=200)
    ours = paired_bootstrap(d)
    theirs = stats.bootstrap((d,), np.mean, n_resamples=10_000, method="percentile", rng=np.random.default_rng(2))
    lo, hi = theirs.confidence_interval
    assert ours[0] < d.mean() < ours[1]
    assert (ours[1] - ours[0]) / (hi - lo) == pytest.approx(1, abs=0.05)
    assert ours == pytest.approx([lo, hi], abs=0.006)
    assert paired_bootstrap(d) == ours  # seeded: a report is reproducible
    assert paired_bootstrap([0.25] * 9) == [0.25, 0.25]


@pytest.mark.parametrize("bad", [[], [[1.0, 2.0]], [1.0, float("nan")]])
def test_bootstrap_refuses_empty_or_non_finite_input(bad):
    with pytest.raises(ValueError, match="paired_bootstrap"):
        paired_bootstrap(bad)


def test_paired_difference_of_accuracies_uses_mcnemar():
    # 200 items: 20 only the base gets right, 5 only the final model, 100 both, 75 neither.
    base = [1] * 20 + [0] * 5 + [1] * 100 + [0] * 75
    final = [0] * 20 + [1] * 5 + [1] * 100 + [0] * 75
    got = paired_difference(base, final)
    assert (got["n"], got["base_only"], got["final_only"]) == (200, 20, 5)
    assert got["delta"] == pytest.approx(-15 / 200)
    assert got["p_value"] == pytest.approx(stats.binomtest(5, 25, 0.5).pvalue)
    assert got["significant"] is True and got["interval"][1] < 0
    d = np.array(final) - np.array(base)
    assert got["detectable"] == pytest.approx(1.96 * d.std(ddof=1) / np.sqrt(200))
    # Independent-samples rule on the same numbers: the combined stderr of two accuracies of 200 items.
    se = np.sqrt(sum(p * (1 - p) / 199 for p in (np.mean(base), np.mean(final))))
    assert got["detectable"] < abs(got["delta"]) < 2 * se  # paired: real; independent: not beyond 2 se
    weak = paired_difference([1] * 8 + [0] * 4, [0] * 8 + [1] * 4)  # 8 against 4 discordant: p = 0.39
    assert weak["p_value"] == pytest.approx(stats.binomtest(4, 12, 0.5).pvalue) and weak["significant"] is False


def test_paired_difference_of_a_continuous_metric_uses_the_interval():
    got = paired_difference([0.5, 0.7, 0.2, 0.9], [0.6, 0.8, 0.3, 1.0])
    assert got["p_value"] is None and got["base_only"] is None
    assert got["interval"] == pytest.approx([0.1, 0.1]) and got["significant"] is True
    assert paired_difference([0.5, 0.7], [0.7, 0.5])["significant"] is False
    assert paired_difference([], []) is None
    with pytest.raises(ValueError, match="2 base items against 1"):
        paired_difference([1, 0], [1])
