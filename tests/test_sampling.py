"""The sampler: draws follow the distribution its parameters define, one row at a time or in a
batch, and a seeded row's draws are its own."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from flowyard.engine.sampling import SamplingParams, sample  # noqa: E402

P = [0.1, 0.2, 0.3, 0.4]


def _logits(rows: int) -> "torch.Tensor":
    return torch.tensor([math.log(p) for p in P]).repeat(rows, 1)


def _freq(tokens: list[int]) -> list[float]:
    return [tokens.count(t) / len(tokens) for t in range(len(P))]


def test_draws_follow_the_distribution():
    torch.manual_seed(0)
    n = 20_000
    got = _freq(sample(_logits(n), [SamplingParams()] * n, [None] * n, [()] * n))
    assert all(abs(g - p) < 0.015 for g, p in zip(got, P)), got


def test_temperature_top_k_and_top_p_shape_the_draws():
    torch.manual_seed(1)
    n = 4_000
    cold = _freq(sample(_logits(n), [SamplingParams(temperature=0.25)] * n, [None] * n, [()] * n))
    assert cold[3] > 0.6  # p^4 renormalised: 0.4^4 / sum = 0.72
    top2 = sample(_logits(n), [SamplingParams(top_k=2)] * n, [None] * n, [()] * n)
    assert set(top2) == {2, 3} and abs(_freq(top2)[3] - 0.4 / 0.7) < 0.03
    nucleus = sample(_logits(n), [SamplingParams(top_p=0.5)] * n, [None] * n, [()] * n)
    assert set(nucleus) == {2, 3}  # 0.4 alone is short of 0.5, so 0.3 joins it


def test_each_row_keeps_its_own_parameters_in_a_mixed_batch():
    torch.manual_seed(2)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(top_k=3),
              SamplingParams(top_p=0.3), SamplingParams()] * 400
    n = len(params)
    got = sample(_logits(n), params, [None] * n, [()] * n)
    by = [got[i::5] for i in range(5)]
    assert set(by[0]) == {3} and set(by[1]) == {3}  # greedy, and top_k 1 is greedy
    assert set(by[2]) == {1, 2, 3} and set(by[3]) == {3}  # top 3; 0.4 alone reaches 0.3
    assert set(by[4]) == {0, 1, 2, 3}


def test_banned_tokens_are_never_drawn():
    torch.manual_seed(3)
    n = 2_000
    got = sample(_logits(n), [SamplingParams()] * n, [None] * n, [(3, 2)] * n)
    assert set(got) == {0, 1}
    assert sample(_logits(1), [SamplingParams(temperature=0)], [None], [(3,)]) == [2]


def test_a_seeded_row_draws_the_same_tokens_whatever_shares_its_batch():
    def draws(batch: int) -> list[int]:
        g = torch.Generator().manual_seed(7)
        out = []
        for _ in range(30):
            params = [SamplingParams(seed=7)] + [SamplingParams(top_p=0.9)] * (batch - 1)
            out.append(sample(_logits(batch), params, [g] + [None] * (batch - 1), [()] * batch)[0])
        return out

    torch.manual_seed(4)
    alone = draws(1)
    torch.manual_seed(5)
    assert draws(6) == alone and len(set(alone)) > 1
