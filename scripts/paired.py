"""Paired comparisons of replays: the median of per-draw ratios with a bootstrap 95% interval.

One place for the interval the project's reports print (scripts/model-report, scripts/proxies-table),
so a figure read in one report means the same in the other: 2,000 resamples of the ratios, a fixed
seed (the same ratios give the same interval), the 2.5th and 97.5th percentiles of the resampled
medians.
"""

import random
import statistics


def median_ci(ratios):
    """(median, low, high) of `ratios` and the bootstrap 95% interval of that median; infinite and
    NaN ratios are left out; all three NaN when none is left."""
    r = [x for x in ratios if x == x and x not in (float("inf"), float("-inf"))]
    if not r:
        return (float("nan"),) * 3
    rng = random.Random(0xB007)
    meds = sorted(statistics.median(rng.choices(r, k=len(r))) for _ in range(2000))
    return statistics.median(r), meds[50], meds[1949]
