"""Paired differences over seeds and their 95% intervals."""

import math


T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t975(df):
    """Student's t 0.975 quantile: a table to 30 degrees of freedom, then the
    Cornish-Fisher expansion to its second term (Abramowitz & Stegun 26.7.5)."""
    if df <= len(T975):
        return T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def mean_sd(values):
    n = len(values)
    mean = sum(values) / n
    sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5 if n > 1 else float("nan")
    return mean, sd


def paired(norm_values, base_values):
    """Mean difference over seeds and its 95% interval (t), from {seed: value} pairs."""
    seeds = sorted(set(norm_values) & set(base_values))
    diffs = [norm_values[s] - base_values[s] for s in seeds if math.isfinite(norm_values[s] - base_values[s])]
    if len(diffs) < 2:
        return None
    mean, sd = mean_sd(diffs)
    half = t975(len(diffs) - 1) * sd / len(diffs) ** 0.5
    low, high = mean - half, mean + half
    return dict(n=len(diffs), mean=mean, low=low, high=high, evidence=not low <= 0 <= high)
