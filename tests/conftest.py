"""Shared test fixtures: a tiny linear cost model so simulator tests don't depend on the roofline."""

from __future__ import annotations

import numpy as np
import pytest

from flowyard.core.plan import BatchShape
from flowyard.core.request import SLO, Request
from flowyard.costmodel.base import CostModel


class LinearCost(CostModel):
    """step = base + per_token * tokens + per_ctx * decode_ctx: easy to compute by hand."""

    num_layers = 1

    def __init__(self, base=0.01, per_token=1e-4, per_ctx=1e-6, capacity=100_000, kv_bytes=1000):
        self.base, self.per_token, self.per_ctx = base, per_token, per_ctx
        self.capacity, self.kv_bytes = capacity, kv_bytes

    def layer_op_times(self, shape: BatchShape):
        return {"qkv_proj": self.per_token * shape.tokens, "attn": self.per_ctx * shape.decode_ctx}

    def step_overhead(self, shape: BatchShape):
        return {"overhead": self.base + 0 * np.asarray(shape.decode_ctx, dtype=float)}

    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes

    def kv_capacity_tokens(self) -> int:
        return self.capacity


class FixedLink:
    def __init__(self, seconds_per_byte=1e-9, latency=1e-4):
        self.spb, self.latency = seconds_per_byte, latency

    def transfer_time(self, nbytes: float) -> float:
        return self.latency + nbytes * self.spb


@pytest.fixture
def linear_cost() -> LinearCost:
    return LinearCost()


def make_requests(n=50, seed=0, rate=20.0, prompt=(16, 2000), out=(1, 200), slo=SLO(ttft=1.0)):
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    t -= t[0]
    return [
        Request(id=i, arrival=float(t[i]), prompt_len=int(rng.integers(*prompt)),
                output_len=int(rng.integers(*out)), slo=slo)
        for i in range(n)
    ]
