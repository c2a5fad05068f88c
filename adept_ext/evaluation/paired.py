"""Paired tests of two models' scores on the same benchmark items (docs/evaluation.md, "Paired
comparison").

The base and the adapted model answer the same questions, so their difference is judged item by item:
for a 0/1 metric (accuracy) by McNemar's exact test, which looks only at the discordant items (b: the
base right and the final model wrong, c: the reverse), p = min(1, 2·P(X ≤ min(b, c))), X ~ Bin(b + c, ½);
for any metric by a paired bootstrap interval of the mean difference, resampling items (not models).
A difference is real at 5 % where McNemar's p < 0.05 (0/1 metrics) or, for other metrics, where the
95 % interval excludes 0.
"""
import math
from typing import Dict, List, Optional, Sequence

import numpy as np

LEVEL = 0.05
RESAMPLES = 10_000


def mcnemar_exact(base_only: int, final_only: int) -> float:
    """McNemar's exact two-sided p-value from the discordant counts: `base_only` items only the base
    model got right (b), `final_only` items only the final model got right (c); 1.0 when b + c = 0."""
    if base_only < 0 or final_only < 0:
        raise ValueError(f"discordant counts must be >= 0, got {base_only} and {final_only}")
    n, k = base_only + final_only, min(base_only, final_only)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1))
    return min(1.0, 2 * tail / 2 ** n)  # exact integer ratio, rounded once


def paired_bootstrap(differences: Sequence[float], resamples: int = RESAMPLES, seed: int = 0,
                     confidence: float = 1 - LEVEL) -> List[float]:
    """The percentile bootstrap interval [lo, hi] of mean(differences): `resamples` means of the items
    drawn with replacement (a seeded numpy generator, so a report is reproducible)."""
    d = np.asarray(differences, dtype=np.float64)
    if d.ndim != 1 or d.size == 0:
        raise ValueError(f"paired_bootstrap needs a non-empty 1-D sequence of differences, got shape {d.shape}")
    if not np.isfinite(d).all():
        raise ValueError("paired_bootstrap: the differences hold NaN or Inf")
    means = np.empty(resamples)
    rng = np.random.default_rng(seed)
    chunk = max(1, 2_000_000 // d.size)  # bounded memory for large n
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        means[start:stop] = d[rng.integers(0, d.size, size=(stop - start, d.size))].mean(axis=1)
    alpha = 1 - confidence
    return [float(np.quantile(means, alpha / 2)), float(np.quantile(means, 1 - alpha / 2))]


def is_binary(values: Sequence[float]) -> bool:
    return all(v in (0, 1) for v in values)


def paired_difference(base: Sequence[float], final: Sequence[float]) -> Optional[Dict]:
    """The paired comparison of one metric's per-item values (the same items in the same order):
    {"n", "delta", "base_only", "final_only", "p_value", "interval", "detectable", "significant"}.
    `p_value` (McNemar) and the counts are None for a metric that is not 0/1; `detectable` is the
    smallest |delta| a normal paired test would call real at 5 % given these items' spread,
    1.96·sd(d)/√n. None when there are no items."""
    if len(base) != len(final):
        raise ValueError(f"paired_difference: {len(base)} base items against {len(final)} final ones")
    if not base:
        return None
    d = np.asarray(final, dtype=np.float64) - np.asarray(base, dtype=np.float64)
    interval = paired_bootstrap(d)
    detectable = float(1.96 * d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else None
    entry = {"n": len(d), "delta": float(d.mean()), "base_only": None, "final_only": None, "p_value": None,
             "interval": interval, "detectable": detectable}
    if is_binary(base) and is_binary(final):
        entry["base_only"] = int((d < 0).sum())
        entry["final_only"] = int((d > 0).sum())
        entry["p_value"] = mcnemar_exact(entry["base_only"], entry["final_only"])
        entry["significant"] = entry["p_value"] < LEVEL
    else:
        entry["significant"] = not (interval[0] <= 0 <= interval[1])
    return entry
