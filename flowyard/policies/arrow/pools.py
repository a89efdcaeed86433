"""Arrow's elastic instance pools (§5.2, Fig. 5) and its TTFT predictor (§5.3).

Instances are stateless (all `Role.MIXED`): whether one does prefill or decode work is only its
membership in one of four pools, so a flip is a bookkeeping move with no restart and no wait.

    P ──flip to decode──▶ P→D  (still has prefill work)  ──prefill drained──▶ D
    P ──flip to decode──▶ D    (nothing left to prefill)
    D ──flip to prefill─▶ D→P  (still has decodes)       ──decodes drained──▶ P
    D ──flip to prefill─▶ P    (nothing left to decode)

An instance in a transitional pool can be flipped back (Alg. 3 takes P→D instances first, Alg. 4
D→P ones); the same rule applies: it lands in the pure pool of its new kind if it holds no work
of the other kind, else in the transitional pool towards it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from flowyard.core.plan import BatchShape
from flowyard.costmodel.base import CostModel
from flowyard.policies.framework.contracts import InstanceSnapshot
from flowyard.policies.framework.pools import Pools


class Pool(enum.Enum):
    P = "P"
    D = "D"
    P2D = "P→D"
    D2P = "D→P"


PREFILL_SIDE = (Pool.P, Pool.D2P)  # pools that take new prefills (Alg. 1)
DECODE_SIDE = (Pool.D, Pool.P2D)  # pools that take decodes (Alg. 2)


def has_prefill_work(s: InstanceSnapshot) -> bool:
    return s.waiting_tokens > 0


def has_decode_work(s: InstanceSnapshot) -> bool:
    return s.num_decoding > 0 or s.num_migrating_in > 0


class ElasticPools(Pools):
    """Arrow's rules over the shared pool model (`pools.Pools`): the four pools and their edges."""

    @classmethod
    def split(cls, ids: Sequence[int], num_prefill: int) -> "ElasticPools":  # type: ignore[override]
        """The initial static split: the first `num_prefill` instances in P, the rest in D."""
        of = {i: (Pool.P if k < num_prefill else Pool.D) for k, i in enumerate(ids)}
        return cls(of, dict(of))

    def flip_to_decode(self, i: int, snap: InstanceSnapshot, now: float) -> Pool:
        return self.move(i, Pool.P2D if has_prefill_work(snap) else Pool.D, now)  # type: ignore[return-value]

    def flip_to_prefill(self, i: int, snap: InstanceSnapshot, now: float) -> Pool:
        return self.move(i, Pool.D2P if has_decode_work(snap) else Pool.P, now)  # type: ignore[return-value]

    def settle(self, i: int, snap: InstanceSnapshot, now: float) -> Pool:
        """Leave a transitional pool once the old kind of work has drained (black edges)."""
        p = self.of[i]
        if p is Pool.P2D and not has_prefill_work(snap):
            self.move(i, Pool.D, now, flip=False)
        elif p is Pool.D2P and not has_decode_work(snap):
            self.move(i, Pool.P, now, flip=False)
        return self.of[i]  # type: ignore[return-value]


def chunked_prefill_time(cost: CostModel, length: int, chunk: int) -> float:
    """Time of a lone prompt of `length` tokens prefilled in `chunk`-token steps."""
    t, done = 0.0, 0
    while done < length:
        n = min(chunk, length - done)
        t += cost.prefill_time(n, history=done)
        done += n
    return t


@dataclass(frozen=True, slots=True)
class QuadraticTTFT:
    """TTFT predictor: prefill time ≈ a·L² + b·L + c, fitted once at start-up from the predictor
    cost model (the paper profiles the instance; our cost model is that profile), so each
    dispatch costs a few multiplications, not a cost-model call per queued request."""

    a: float
    b: float
    c: float

    @classmethod
    def fit(cls, cost: CostModel, chunk: int, max_len: int, samples: int = 24) -> "QuadraticTTFT":
        lens = np.unique(np.linspace(16, max(32, max_len), samples).astype(int))
        times = np.array([chunked_prefill_time(cost, int(n), chunk) for n in lens])
        # weights 1/t: minimise relative error, so short prompts are not drowned by long ones
        a, b, c = np.polyfit(lens.astype(float), times, 2, w=1.0 / times)
        return cls(float(a), float(b), float(c))

    def __call__(self, length: float) -> float:
        return max(0.0, (self.a * length + self.b) * length + self.c)

    def remaining(self, done: int, todo: int) -> float:
        """Predicted time still needed by a prefill with `done` of done + `todo` tokens computed."""
        if done <= 0:
            return self(todo)
        return max(0.0, self(done + todo) - self(done))

    def queue_delay(self, s: InstanceSnapshot, chunk: int) -> float:
        """Eq. 1-2: a new prompt waits for every prefill queued or running ahead of it. Decodes
        share each step's token budget (they go first), so a prefill advances only by the rest
        of the budget: the delay stretches by chunk / (chunk − decodes)."""
        return _stretched(sum(self.remaining(h, n) for h, n in s.prefill_queue), s, chunk)

    def delay_ahead(self, s: InstanceSnapshot, chunk: int, due: float, now: float) -> float:
        """`queue_delay` under a slack-aware order (S-EDF, re-ranked every step): a prompt due at
        `due` waits only for the queued work due no later that can still make its own deadline;
        hopeless prompts and later deadlines go behind it. An instance holding a hopeless long
        prompt is not busy for new arrivals (plain `queue_delay` would steer them away and leave
        it idle but for the prompt S-EDF has given up on). Without deadlines: `queue_delay`."""
        if len(s.prefill_deadlines) != len(s.prefill_queue):
            return self.queue_delay(s, chunk)
        delay = 0.0
        for (h, n), d in zip(s.prefill_queue, s.prefill_deadlines):
            if d <= due:
                t = self.remaining(h, n)
                if d - now >= t:
                    delay += t
        return _stretched(delay, s, chunk)


def _stretched(delay: float, s: InstanceSnapshot, chunk: int) -> float:
    """Prefill time on an instance whose decodes take their share of every step's budget
    first: it stretches by chunk / (chunk - decodes) (Eq. 1-2's queueing delay)."""
    if s.num_decoding:
        delay *= chunk / max(1, chunk - s.num_decoding)
    return delay


def max_running_tokens(cost: CostModel, tpot: float, kv_tokens: int, max_num_seqs: int,
                       mean_context: int, kv_headroom: float) -> int:
    """Alg. 2's Max Running Tokens: the largest decode-batch token count T whose step time
    stays within the TPOT threshold (a batch of T / mean_context sequences, capped at
    max_num_seqs) and whose KV fits in `kv_headroom` of the instance's capacity."""
    cap = int(kv_tokens * kv_headroom)

    def fits(t: int) -> bool:
        seqs = int(min(max_num_seqs, max(1, t // mean_context)))
        return float(cost.step_time(BatchShape(decode_seqs=seqs, decode_ctx=t))) <= tpot

    if fits(cap):
        return cap
    lo, hi = 0, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
