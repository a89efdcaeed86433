"""The regime controller of `flowyard` (`flowyard.router`): every `period` it prices
colocation and every split of Arrow's pools (`flowyard.regime.RegimePricer`) from what the
router has seen, votes, and flips instances between the pools to the split it wants.

A mixin of `FlowyardRouter` rather than an object of its own: the dispatcher and the
controller read and write the same state (the regime, the split, the arrival statistics the
router records on every dispatch), and the executors call both through one object.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol

from flowyard.core.request import RequestState
from flowyard.policies.arrow.router import ArrowRouter
from flowyard.policies.arrow.pools import DECODE_SIDE, PREFILL_SIDE
from flowyard.policies.framework.contracts import ClusterView
from flowyard.policies.flowyard.regime import Choice, Load, RegimePricer, rate as _rate

if TYPE_CHECKING:
    from flowyard.policies.flowyard.router import FlowyardConfig


class _RouterState(Protocol):
    """What `RegimeControl` uses of the router it is mixed into (`FlowyardRouter`)."""

    cfg: FlowyardConfig
    arrow: ArrowRouter
    pricer: RegimePricer
    regime: str
    n_prefill: int
    switches: list[tuple[float, str]]
    estimates: list[tuple[float, str, int]]
    splits: list[tuple[float, int]]
    _votes: int
    _tpots: deque[float]
    _prompts: deque[int]
    _urgency: deque[float]
    _ttfts: deque[float]
    _arrivals: deque[float]
    _outputs: deque[int]

    def steady_decodes(self, observed: int, step: float, now: float) -> float: ...

    def load(self, view: ClusterView, now: float) -> Load | None: ...

    def wanted(self, view: ClusterView, now: float) -> Choice: ...

    def _backlogged(self, view: ClusterView, n_prefill: int) -> bool: ...

    def _resize(self, view: ClusterView, now: float, n_prefill: int) -> None: ...


class RegimeControl:
    """Mixed into `FlowyardRouter` (see the module docstring); `_RouterState` is what it uses."""

    def on_finished(self: _RouterState, state: RequestState, now: float) -> None:
        """Learn the mean output length (executors call this for every finished request)."""
        if state.num_output:
            self._outputs.append(state.num_output)

    def steady_decodes(self: _RouterState, observed: int, step: float, now: float) -> float:
        """Decodes the cluster holds once prefill keeps up with arrivals: at least those
        running now, and at least arrival rate (last `window` seconds) x mean output of the
        requests finished recently x time per token (Little's law). The decodes running now lag
        behind when prefill is the bottleneck: a starved prefill admits few decodes, so a
        colocated cluster would look as if its steps had room to spare. (The mean output is
        biased low early on, when only short outputs have finished: a lower bound still.)"""
        if not self._outputs:
            return float(observed)
        rate = _rate(self._arrivals, now, self.cfg.window)
        return max(float(observed), rate * sum(self._outputs) / len(self._outputs) * step)

    def load(self: _RouterState, view: ClusterView, now: float) -> Load | None:
        """What the pricing needs, from the recent arrivals and the instances' snapshots."""
        if not self._tpots or len(self._arrivals) < self.cfg.min_arrivals:
            return None  # no TPOT SLO, or too few arrivals to price anything yet: stay as configured
        snaps = [view.snapshot(i) for i in view.instances()]
        running = sum(s.num_running for s in snaps)
        tpot = min(self._tpots)
        decodes = self.steady_decodes(sum(s.num_decoding for s in snaps), tpot * self.cfg.headroom, now)
        length = max(1.0, sum(self._prompts) / len(self._prompts)) if self._prompts else float(self.cfg.chunk)
        urgency = sum(self._urgency) / len(self._urgency) if self._urgency else length / self.cfg.ttft_slo
        return Load(len(snaps), _rate(self._arrivals, now, self.cfg.window), length, decodes,
                    sum(s.running_tokens for s in snaps) / running if running else 0.0, tpot, urgency)

    def wanted(self: _RouterState, view: ClusterView, now: float) -> Choice:
        """The option with the largest sustainable load scale (`flowyard.regime`)."""
        load = self.load(view, now)
        if load is None:
            return Choice("colocated", 0, {})
        current = 0 if self.regime == "colocated" else (self.n_prefill or load.instances // 2)
        choice = self.pricer.choose(load, current)
        if choice.regime == "disaggregated" and 0 < choice.n_prefill < current and self._backlogged(view, choice.n_prefill):
            choice = Choice("disaggregated", current, choice.scores)
        if self.cfg.mode == "disaggregated" and choice.regime == "colocated":
            dis = {k: v for k, v in choice.scores.items() if k} or {current or load.instances // 2: 0.0}
            best = max(dis, key=lambda k: dis[k])
            choice = Choice("disaggregated", best, choice.scores)
        self.estimates.append((now, choice.regime, choice.n_prefill))
        return choice

    def _backlogged(self: _RouterState, view: ClusterView, n_prefill: int) -> bool:
        """Whether the prefill pool's queued work, spread over n_prefill instances, would take
        more than `shrink_backlog` of the recent arrivals' mean TTFT SLO."""
        share, pools = self.cfg.shrink_backlog, self.arrow.pools
        if share is None or pools is None or self.regime != "disaggregated":
            return False
        ttft = sum(self._ttfts) / len(self._ttfts) if self._ttfts else self.cfg.ttft_slo
        work = sum(self.arrow.delay(view.snapshot(i)) for i in pools.members(*PREFILL_SIDE))
        return work / n_prefill > share * ttft

    def tick(self: _RouterState, view: ClusterView, now: float) -> None:
        if self.cfg.mode != "colocated":
            want = self.wanted(view, now)
            if not self.cfg.elastic and want.regime == "disaggregated":
                want = Choice(want.regime, max(1, len(view.instances()) // 2), want.scores)
            differs = want.regime != self.regime or (want.regime == "disaggregated" and want.n_prefill != self.n_prefill)
            self._votes = self._votes + 1 if differs else 0
            if self._votes >= self.cfg.patience:
                self._votes = 0
                if want.regime != self.regime:
                    self.regime = want.regime
                    self.switches.append((now, want.regime))
                if want.regime == "disaggregated":
                    self._resize(view, now, want.n_prefill)
        if self.regime == "disaggregated" and self.arrow.period is not None:
            self.arrow.tick(view, now)  # Arrow's monitor (creates the pools on first use)

    def _resize(self: _RouterState, view: ClusterView, now: float, n_prefill: int) -> None:
        """Flip instances between Arrow's pools until `n_prefill` take prefills: to decode the
        prefill-side instance with the least queued prefill, to prefill the decode-side one
        with the fewest running tokens (zero-wait flips: the pools are bookkeeping)."""
        pools = self.arrow._refresh(view, now)
        while True:
            pre = pools.members(*PREFILL_SIDE)
            if len(pre) > n_prefill and len(pre) > 1:
                i = min(pre, key=lambda k: (view.snapshot(k).waiting_tokens, k))
                pools.flip_to_decode(i, view.snapshot(i), now)
            elif len(pre) < n_prefill and len(pools.members(*DECODE_SIDE)) > 1:
                dec = pools.members(*DECODE_SIDE)
                i = min(dec, key=lambda k: (view.snapshot(k).running_tokens, k))
                pools.flip_to_prefill(i, view.snapshot(i), now)
            else:
                break
        self.n_prefill = len(pools.members(*PREFILL_SIDE))
        if not self.splits or self.splits[-1][1] != self.n_prefill:
            self.splits.append((now, self.n_prefill))
