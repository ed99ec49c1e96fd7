"""Means over seeds and their 95% intervals, paired or not (Student's t,
``scipy.stats.t``): the study's report and the tables both use these."""

import math

from scipy import stats


def t975(df):
    """Student's t 0.975 quantile with ``df`` degrees of freedom."""
    return float(stats.t.ppf(0.975, df))


def mean_sd(values):
    n = len(values)
    mean = sum(values) / n
    sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5 if n > 1 else float("nan")
    return mean, sd


def interval(values):
    """(mean, sd, half-width of the mean's 95% interval) of ``values`` (nan where there is one)."""
    mean, sd = mean_sd(values)
    half = t975(len(values) - 1) * sd / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return mean, sd, half


def paired(norm_values, base_values):
    """Mean difference over seeds and its 95% interval (t), from {seed: value} pairs."""
    seeds = sorted(set(norm_values) & set(base_values))
    diffs = [norm_values[s] - base_values[s] for s in seeds if math.isfinite(norm_values[s] - base_values[s])]
    if len(diffs) < 2:
        return None
    mean, _, half = interval(diffs)
    low, high = mean - half, mean + half
    return dict(n=len(diffs), mean=mean, low=low, high=high, evidence=not low <= 0 <= high)
