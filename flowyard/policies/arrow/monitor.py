"""Arrow's instance monitor (§5.5): the flips `ArrowRouter.tick` makes every `period`.

From the paper, towards decode:

- case 2: the average token interval of decoding instances stays over the TPOT threshold for
  `monitor_periods` ticks in a row: Alg. 4 flips the prefill instance with the least queueing
  delay to decode;
- case 3: prefill instances idle while decode is busy (ρ ≥ `decode_busy`) flip to decode.

Ours, towards prefill: **stranded prefill work**. In the paper the only path from decode to
prefill is Alg. 1, which runs on arrivals. Alg. 4 and case 2 flip the prefill instance with the
*least* queueing delay, which after a burst may still hold a long prompt queue: it becomes
P→D, keeps those prompts (queued prefills are never re-dispatched: the executor contract has no
way to take a queued request off an instance), keeps the decodes of every prompt it finishes
(Alg. 2: no KV to move) and takes other decodes as well (Alg. 2's t2). Each step then carries
decodes ahead of the prefill chunk (decode-first batching), so the stranded prompts' TTFT
grows, and if no request arrives nothing ever flips the instance back. So on each tick, a
P→D instance whose queued prompts' predicted delay (Eq. 1-2, `ArrowRouter.delay`) exceeds the
TTFT threshold is flipped back towards prefill (to D→P while it still decodes, else P): Alg. 2
then moves the decodes of its prompts away and sends it no new ones, and its chunks run
without growing decode batches in front of them. The paper's guards apply, as for Alg. 3:

- overload rule (favours decode): no flip unless ρ of the D pool is at most `decode_low`:
  its running tokens within that share of Max Running Tokens and its worst token interval
  within that share of the TPOT threshold, so the decodes Alg. 2 now sends there (it tries D
  first) keep the TPOT threshold and a flip towards decode is not forced at once. P→D
  instances are left out of ρ: their token interval counts the prefill chunks that run in
  their steps, which says nothing about decode load (and which the flip cures). The
  monitor's average counts them too, so the rule runs before case 2: flipping yet another
  prefill instance to decode would not help decodes slowed by prefill chunks;
- a D instance must exist (Alg. 3 keeps at least one other instance on the decode side);
- hysteresis: the monitor flips no instance, either way, that any rule flipped less than
  `flip_cooldown` seconds ago. Without it, case 2 (whose average still counts the other P→D
  instances' prefill-laden steps) takes the instance just flipped back (Alg. 4 prefers D→P)
  on the next tick, and P→D→P cycles every tick or two. The flips of Alg. 1-4 on dispatch
  keep the paper's rules and ignore the cool-down.

Stranded work on P instances with idle D instances beside them is *not* helped: flipping an
idle D instance towards prefill would move none of the queued prompts onto it, and Alg. 1
already flips one, at zero wait, when a prompt arrives that needs it. Draining such queues
sooner needs queued-work re-dispatch in the executors (simulator, LocalCluster, Ray).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from flowyard.policies.arrow.pools import DECODE_SIDE, ElasticPools, Pool, has_prefill_work
from flowyard.policies.framework.contracts import ClusterView, InstanceSnapshot

if TYPE_CHECKING:
    from flowyard.policies.arrow.router import ArrowConfig


class _ArrowHost(Protocol):
    """What `InstanceMonitor` uses of the router it is mixed into (`ArrowRouter`)."""

    cfg: ArrowConfig
    pools: ElasticPools | None
    _tpot: float
    _ttft: float
    _over: int
    _last_tick: float | None

    def _refresh(self, view: ClusterView, now: float) -> ElasticPools: ...

    def delay(self, s: InstanceSnapshot) -> float: ...

    def decode_load(self, snaps: list[InstanceSnapshot], tpot: float, spare: int = 0) -> float: ...

    def try_move_prefill_to_decode(self, view: ClusterView, now: float,
                                   only: list[int] | None = None) -> int | None: ...

    def unstrand(self: _ArrowHost, view: ClusterView, now: float) -> int | None: ...


class InstanceMonitor:
    """Mixed into `ArrowRouter`: the periodic controller (`tick`)."""

    def tick(self: _ArrowHost, view: ClusterView, now: float) -> None:
        """Monitor-triggered flips (module docstring): a P→D instance holding stranded prefill
        work back towards prefill, else towards decode (§5.5 cases 2 and 3)."""
        self._last_tick = now
        pools = self._refresh(view, now)
        side = [view.snapshot(i) for i in pools.members(*DECODE_SIDE)]
        decoding = [s for s in side if s.num_decoding]
        avg = sum(s.token_interval for s in decoding) / len(decoding) if decoding else 0.0
        self._over = self._over + 1 if avg > self._tpot else 0
        if self.cfg.unstrand and self.unstrand(view, now) is not None:
            return  # the average counted it; the next tick sees the decode side without it
        cool = self.cfg.flip_cooldown
        settled = [i for i in pools.members(Pool.D2P, Pool.P) if pools.since_flip(i, now) >= cool]
        if self._over >= self.cfg.monitor_periods:
            d2p = [i for i in settled if pools.of[i] is Pool.D2P]  # Alg. 4 takes D→P first
            if self.try_move_prefill_to_decode(view, now, only=d2p or settled) is not None:
                self._over = 0
            return
        if side and self.decode_load(side, self._tpot) >= self.cfg.decode_busy:
            idle = [i for i in settled if pools.of[i] is Pool.P and view.snapshot(i).num_requests == 0]
            if idle:
                self.try_move_prefill_to_decode(view, now, only=idle)

    def unstrand(self: _ArrowHost, view: ClusterView, now: float) -> int | None:
        """Flip the P→D instance with the most stranded prefill work (predicted queueing delay
        over the TTFT threshold) back towards prefill, if decode can spare it. Returns it."""
        pools = self.pools
        assert pools is not None
        d, p2d = pools.members(Pool.D), pools.members(Pool.P2D)
        if not d or not p2d:
            return None  # Alg. 2 must keep a D instance to send the instance's decodes to
        snaps = {i: view.snapshot(i) for i in d + p2d}
        delay = {i: self.delay(snaps[i]) for i in p2d if has_prefill_work(snaps[i])}
        cands = [i for i, t in delay.items()
                 if t > self._ttft and pools.since_flip(i, now) >= self.cfg.flip_cooldown]
        if not cands or self.decode_load([snaps[i] for i in d], self._tpot) > self.cfg.decode_low:
            return None  # nothing stranded, or the overload rule: decode keeps its instances
        pick = min(cands, key=lambda i: (-delay[i], snaps[i].running_tokens, i))
        pools.flip_to_prefill(pick, snaps[pick], now)
        return pick
