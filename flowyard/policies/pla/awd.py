"""PLA-Serve's Adaptive Wait-Depth batching of short prefills (PLA-Serve §3.1-3.2, Alg. 1).

Short (memory-bound) prefills gain from being batched into a captured (L, B) shape: one graph
launch instead of hundreds of kernel launches, and a weight stream shared by more requests.
AWD waits a little to let a batch fill, but never past what a deadline allows:

    W(t) = clip(min(W_SLA, W_GR, W_adapt), [W_min, W_max])
    W_SLA = max(0, min_i (DDL_i - t - S_hat) - delta)      last safe moment to wait
    W_GR  = max(0, D - depth) / max(r_hat, eps)            expected time to reach depth D

and dispatches at once when the batch reaches the target depth D, when the tightest slack
min_i (DDL_i - (t + S_hat)) <= sigma, or when the head of the line has waited T_max. After
each dispatch W and D adapt (Alg. 1 l. 12-15): a full batch sets W to the time it took to
fill; a short one lowers D to its depth. Ours adds the way back up: a full batch raises D one
captured depth, so a burst after a lull is not held to a small D forever.

This module is pure decision logic over plain numbers; `pla.PLASelector` owns the
queues and the KV.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AWDConfig:
    lengths: tuple[int, ...] = (8, 16, 32, 64, 128, 256)  # captured prompt-length buckets
    depths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # captured batch-size buckets
    memory_budget: int = 8192  # M: padded tokens of one short batch
    w_min: float = 0.0
    w_max: float = 0.02  # seconds
    sigma: float = 0.01  # dispatch at once when the tightest slack is this small
    delta: float = 0.002  # safety margin of W_SLA
    t_max: float = 0.05  # longest head-of-line wait
    rate_halflife: float = 1.0  # seconds; EWMA of the short-request arrival rate

    def __post_init__(self) -> None:
        if not self.lengths or not self.depths or list(self.lengths) != sorted(self.lengths) \
                or list(self.depths) != sorted(self.depths) or self.lengths[0] < 1 or self.depths[0] < 1:
            raise ValueError("lengths and depths must be non-empty ascending positive buckets")
        if not 0 <= self.w_min <= self.w_max:
            raise ValueError(f"need 0 <= w_min <= w_max, got {self.w_min}, {self.w_max}")
        for name in ("sigma", "delta", "t_max", "rate_halflife"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.memory_budget < self.lengths[0]:
            raise ValueError("memory_budget must hold at least one smallest bucket")

    def bucket(self, length: int) -> int | None:
        """The captured length a prompt of `length` tokens pads to (None: longer than all)."""
        i = bisect.bisect_left(self.lengths, length)
        return self.lengths[i] if i < len(self.lengths) else None

    def graph(self, max_len: int, depth: int) -> tuple[int, int] | None:
        """Nearest captured (L, B) shape holding the batch, or None (run eagerly)."""
        lb = self.bucket(max_len)
        i = bisect.bisect_left(self.depths, depth)
        if lb is None or i == len(self.depths) or lb * self.depths[i] > self.memory_budget:
            return None
        return lb, self.depths[i]

    def max_depth(self) -> int:
        """D_0: the deepest captured batch of the smallest bucket that fits the budget."""
        fit = [d for d in self.depths if d * self.lengths[0] <= self.memory_budget]
        return fit[-1] if fit else self.depths[0]


class AWDState:
    """The adaptive thresholds W and D and the arrival-rate estimate r_hat."""

    def __init__(self, cfg: AWDConfig) -> None:
        self.cfg = cfg
        self.window = cfg.w_max  # W_adapt
        self.depth = cfg.max_depth()  # D
        self.rate = 0.0  # r_hat, short requests per second
        self._last_arrival: float | None = None
        self.opened: float | None = None  # when the batch now filling began to wait

    def arrived(self, now: float) -> None:
        """Update r_hat (EWMA of inter-arrival rates) and open the window if it is closed."""
        if self._last_arrival is not None:
            gap = max(now - self._last_arrival, 1e-6)
            w = 0.5 ** (gap / self.cfg.rate_halflife) if self.cfg.rate_halflife > 0 else 0.0
            self.rate = w * self.rate + (1 - w) / gap
        self._last_arrival = now
        if self.opened is None:
            self.opened = now

    def window_end(self, now: float, depth: int, min_slack: float | None) -> float:
        """Absolute time the current window closes (W measured from when it opened)."""
        c = self.cfg
        w = self.window
        if self.rate > 0:
            w = min(w, max(0.0, self.depth - depth) / self.rate)
        if min_slack is not None:  # W_SLA, measured from now
            w = min(w, (now - (self.opened or now)) + max(0.0, min_slack - c.delta))
        w = min(max(w, c.w_min), c.w_max)
        return (self.opened if self.opened is not None else now) + w

    def ready(self, now: float, depth: int, min_slack: float | None, hol_arrival: float) -> bool:
        """Dispatch now? True at (or within rounding of) the time `wake` returned, so a wake-up
        can never find the batch not ready and ask to be woken at the same instant again."""
        return depth >= self.depth or self.wake(now, depth, min_slack, hol_arrival) <= now + 1e-9

    def wake(self, now: float, depth: int, min_slack: float | None, hol_arrival: float) -> float:
        """When `ready` turns true if nothing arrives: the earliest of window end, HoL bound
        and the moment the tightest slack reaches sigma."""
        t = min(self.window_end(now, depth, min_slack), hol_arrival + self.cfg.t_max)
        if min_slack is not None:
            t = min(t, now + min_slack - self.cfg.sigma)
        return max(t, now)

    def dispatched(self, now: float, depth: int, still_waiting: bool) -> None:
        """Alg. 1 lines 12-15, plus growth of D after a full batch."""
        c = self.cfg
        fill = now - (self.opened if self.opened is not None else now)
        if depth >= self.depth:
            self.window = min(max(fill, c.w_min), c.w_max)
            i = bisect.bisect_right(c.depths, self.depth)
            if i < len(c.depths) and c.depths[i] * c.lengths[0] <= c.memory_budget:
                self.depth = c.depths[i]
        else:
            self.depth = max(1, depth)
        self.opened = now if still_waiting else None
