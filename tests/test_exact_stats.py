"""`exact_stats` gives numpy's own mean and percentiles, bit for bit, from values fed in
batches: whatever the batch cuts, for lengths around numpy's block sizes, with ties, and down
to the last radix pass."""

import numpy as np
import pytest

from flowyard.core import exact_stats
from flowyard.core.exact_stats import PairwiseSum, order_statistics, percentiles

LENGTHS = [1, 2, 7, 8, 9, 16, 17, 127, 128, 129, 136, 255, 256, 257, 1000, 4099, 70001]


def _values(kind: int, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == 0:
        return rng.random(n) * 0.05  # step gaps
    if kind == 1:
        return rng.choice([0.01, 0.02, 0.0137], n)  # many ties
    if kind == 2:
        return rng.standard_normal(n)  # negative values too
    return np.round(rng.random(n) * 100) / 7


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kind", [0, 1, 2, 3])
def test_same_floats_as_numpy(n: int, kind: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(n * 4 + kind)
    a = _values(kind, n, rng)
    parts = np.split(a, np.sort(rng.integers(0, n + 1, 4)))
    for keep in (1, 64, 1 << 21):  # 1: resolve every bit by histograms; large: keep and sort
        monkeypatch.setattr(exact_stats, "KEEP", keep)
        total = PairwiseSum(n)
        for p in parts:
            total.feed(p)
        assert total.total() / n == float(np.mean(a))
        got = percentiles(lambda: iter(parts), n, [50.0, 90.0, 99.0])
        assert got.tolist() == np.percentile(a, [50.0, 90.0, 99.0]).tolist()


def test_order_statistics_and_errors() -> None:
    a = np.array([3.0, -1.0, 2.0, 2.0, 0.0])
    assert order_statistics(lambda: iter([a[:2], a[2:]]), 5, [0, 2, 4]).tolist() == [-1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="out of range"):
        order_statistics(lambda: iter([a]), 5, [5])
    total = PairwiseSum(3)
    total.feed(np.ones(2))
    with pytest.raises(ValueError, match="expected 3"):
        total.total()
    with pytest.raises(ValueError, match="expected 3"):
        total.feed(np.ones(2))
