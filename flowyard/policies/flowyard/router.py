"""`flowyard`: the four designs composed into one policy (issue 16).

Every instance is stateless (`Role.MIXED`, Arrow §5.2), so whether the cluster runs colocated or
disaggregated is a decision of the global scheduler, not of the deployment, and it can change
while the cluster runs. The parts:

- **Regime controller (ours: `flowyard.control`, priced by `flowyard.regime`).** Every
  `period` it prices colocation and every split of Arrow's pools (1 to N-1 prefill
  instances) by the load scale each could sustain, from the recent arrival rate, mean prompt,
  the decodes held in steady state (Little's law on the mean output of finished requests, so
  a prefill-starved cluster does not look decode-light) and the cost model: prefill tokens/s
  against arrivals, decodes within the TPOT SLO (and the KV cache) against decodes. Loose TPOT
  keeps the cluster colocated outright; decode-heavy loads at tight TPOT (short prompts, long
  outputs) stay colocated, where every instance decodes; prompt-heavy ones split, with as
  many prefill instances as the balance of the two bottlenecks asks. A change needs `patience` ticks in a row and a 5 % better score.
- **Disaggregated regime: Arrow's pools, sized by the controller.** Zero-wait flips between
  P and D (`arrow.ArrowRouter` over the shared pool model: a flip is bookkeeping on stateless
  instances) and Arrow's minimal-load dispatch (`pools="minload"`, Fig. 8). Arrow's own
  per-request SLO-aware flips and monitor (`pools="slo"`) are off by default (they fight the
  priced split); `elastic=False` pins the split at half and half (ablation).
- **Colocated regime: SLO-aware least decode load.** Among the instances where the prompt's
  predicted TTFT (Arrow's quadratic predictor over the prefill work S-EDF ranks ahead of it,
  plus its own prefill) stays well within its SLO, the one whose decode step would be shortest
  with it added; if none, the least predicted delay. Work S-EDF puts behind the prompt (due
  later, or hopeless) does not count: an instance holding a long prompt that can no longer
  make its deadline is free for new ones (`delay_ahead`).
- **Session affinity (PLA-Serve §3.3).** In both regimes a session's later turn goes back to
  the instance that holds its history (its KV is cached there) unless that instance's predicted
  delay plus the cached fill is worse than the best alternative plus the full fill by more than
  `affinity` seconds (`pla.affinity.SessionHomes`, the part PLA-Serve's router uses too).
- **Local scheduling** (`flowyard.selector`): FlowPrefill's S-EDF queue order and DynaServe's
  TBT-bounded step budgets on every instance; the budgets may spend the TPOT slack the decodes
  have banked (TPOT is a mean, so long outputs amortise whole prefill chunks as in vLLM).
  Prompts may be prefilled ahead of a free decode place (`park`): what Arrow's pools do
  through their migration queues, on a colocated instance. Four rules of ours for overload
  and contention: in a burst S-EDF gives up the prompts Moore-Hodgson picks (`shed`: the
  most requests on time, each prompt timed at the rate it gets beside the step's decodes,
  `shed_rate`), a started prompt's chunk waits for KV instead of recompute-preempting another
  (`prefill_preempts`), a step may take a larger budget to save a prompt's TTFT when few of
  its decodes pay for it (`rescue`), and when parked requests wait the decode places go to
  the least banked TPOT slack (`places`), so the wait rotates over all.

- **One device under every instance (`shared_device`).** Instances that take turns on one
  device share its steps: a decode waits for every instance's step, not only its own, and each
  step pays its own pass over the weights, so spreading work (colocated on N instances, or
  split into pools) only adds steps, and each instance's TPOT budget, sized as if its steps
  were the only ones, is broken by the others'. There the controller is off and the dispatch
  fills the first instance whose KV cache and batch still hold the request, spilling to the
  next only when they do not (`dispatch.consolidated`).

`mode` "colocated" or "disaggregated" pins the regime (ablations); the other knobs switch the
other parts off one at a time (`flowyard reproduce flowyard` measures what each earns).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from flowyard.core.plan import BatchShape
from flowyard.costmodel.roofline import RooflineCostModel
from flowyard.core.request import Request, RequestState
from flowyard.costmodel.base import CostModel
from flowyard.policies.arrow.router import ArrowConfig, ArrowRouter
from flowyard.policies.arrow.pools import PREFILL_SIDE
from flowyard.policies.framework.capabilities import Capabilities
from flowyard.policies.framework.contracts import ClusterView
from flowyard.policies.flowyard.control import RegimeControl
from flowyard.policies.flowyard.dispatch import consolidated, indexed_pick
from flowyard.policies.flowyard.regime import MonitorFlips, RegimePricer
from flowyard.policies.flowyard.selector import PLACES, SHED_RATES
from flowyard.policies.pla.affinity import SessionHomes, cached_prefix
from flowyard.policies.framework.slack import deadline

MODES = ("auto", "colocated", "disaggregated")
MAX_SESSIONS = 65536
VECTOR_MIN = 16  # instances from which the colocated dispatch prices decode steps in one array call


@dataclass(frozen=True, slots=True)
class FlowyardConfig:
    mode: str = "auto"  # "auto": the regime controller decides; else pinned
    pools: str = "minload"  # Arrow's dispatch in the disaggregated regime: "minload", or "slo" (with flips)
    dispatch_flips: bool = True  # Arrow's Alg. 1/2 may flip an instance per request; False: the monitor only
    order: str = "s-edf"  # local queue order (FlowPrefill); "fcfs" ablates it
    shed: bool = True  # S-EDF gives up the prompts Moore-Hodgson picks in an overload (flowyard.selector)
    shed_rate: str = "shared"  # ... timing each prompt at the instance's rate beside its decodes; "alone"
    prefill_preempts: bool = False  # a chunk may recompute-preempt for KV (vLLM); False: it waits
    rescue: float | None = 0.1  # TTFT rescue: a step may break the banked TPOT slack of this share of its decodes
    tbt_budget: bool = True  # DynaServe's TBT-bounded step budgets; False: a fixed chunk
    slack: bool = True  # budgets may spend the decodes' banked TPOT slack (flowyard.selector)
    delay_tolerance: float = 0.02  # ... whose delay is within this share of the TTFT SLO of the least
    dispatch: str = "decode"  # colocated: least decode step among TTFT-safe instances; "delay": least delay
    delay_ahead: bool = True  # dispatch counts only the queued work S-EDF ranks ahead of the prompt
    affinity: float | None = 0.05  # session affinity tolerance (s); None: off
    chunk: int = 2048  # most prefill tokens in one step
    period: float = 0.5  # controller period (s)
    flip_cooldown: float = 1.0  # Arrow's monitor leaves instances flipped this recently (s)
    patience: int = 2  # ticks in a row before the regime switches
    ttft_slo: float = 3.0  # what requests without SLOs are taken to have (Arrow's defaults)
    tpot_slo: float = 0.1
    headroom: float = 0.9  # share of the TPOT SLO a colocated step may use
    decode_headroom: float = 0.85  # share of it a decode instance's steps may use (KV hand-off gaps, bursts)
    ttft_share: float = 0.3  # colocated chunks of the mean prompt may take this share of its TTFT SLO
    max_num_seqs: int = 256
    park: float = 1.5  # prompts may start while park x max_num_seqs run; decode batches stay <= max_num_seqs
    places: str = "slack"  # who takes the decode places when parked requests wait: least banked TPOT slack; "fcfs"
    elastic: bool = True  # the controller sizes the pools; False: half prefill, half decode
    shrink_backlog: float | None = 0.25  # no fewer prefill instances while their backlog is above this x TTFT
    min_arrivals: int = 8  # arrivals seen before the controller first prices the regimes
    window: float = 10.0  # seconds of arrivals and prefill completions the controller's rates cover

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"flowyard mode must be one of {MODES}, got {self.mode!r}")
        if self.chunk < 1 or self.patience < 1 or not self.period > 0:
            raise ValueError("chunk, patience and period must be positive")
        if self.park < 1:
            raise ValueError(f"park must be >= 1 (a multiple of max_num_seqs), got {self.park}")
        if self.places not in PLACES:
            raise ValueError(f"flowyard places must be one of {PLACES}, got {self.places!r}")
        if self.shed_rate not in SHED_RATES:
            raise ValueError(f"flowyard shed_rate must be one of {SHED_RATES}, got {self.shed_rate!r}")


class FlowyardRouter(RegimeControl):
    """Dispatcher, decode router and controller of `flowyard` (module docstring)."""

    # asked where every MIXED prefill decodes (stay, or Arrow's Alg. 2); learns output lengths
    capabilities = Capabilities(routes_mixed=True, learns=True, has_pools=True)

    def __init__(self, predictor: CostModel, cfg: FlowyardConfig | None = None, name: str = "flowyard",
                 shared_device: bool = False) -> None:
        self.cfg = c = cfg or FlowyardConfig()
        self.predictor = predictor
        # one device under every instance, regime left to us: serve from as few as hold the work
        self.consolidate = shared_device and c.mode == "auto"
        self.arrow = (ArrowRouter if c.dispatch_flips else MonitorFlips)(predictor, ArrowConfig(mode=c.pools, ttft_slo=c.ttft_slo, tpot_slo=c.tpot_slo, chunk_size=c.chunk,
                                                        max_num_seqs=c.max_num_seqs, flip_cooldown=c.flip_cooldown),
                                 name)
        self.regime = "disaggregated" if c.mode == "disaggregated" else "colocated"
        self.period: float | None = c.period if c.mode != "colocated" and not self.consolidate else None
        self.switches: list[tuple[float, str]] = []  # (time, regime switched to)
        self.sessions = SessionHomes(MAX_SESSIONS)  # where each session's last turn went
        self._tpots: deque[float] = deque(maxlen=256)  # TPOT SLOs of recent arrivals
        self._prompts: deque[int] = deque(maxlen=256)  # their new (uncached) prompt tokens
        self._urgency: deque[float] = deque(maxlen=256)  # their new prompt tokens / TTFT SLO
        self._ttfts: deque[float] = deque(maxlen=256)  # their TTFT SLOs
        self._arrivals: deque[float] = deque(maxlen=256)  # their arrival times (the rate)
        self._outputs: deque[int] = deque(maxlen=256)  # output tokens of recently finished requests
        self.estimates: list[tuple[float, str, int]] = []  # (time, regime, prefill instances) wanted per tick
        self.splits: list[tuple[float, int]] = []  # (time, prefill instances) of the disaggregated regime
        self.n_prefill = 0  # prefill-side instances while disaggregated
        self.pricer = RegimePricer(predictor, self.arrow.ttft, chunk=c.chunk, headroom=c.headroom,
                                   decode_headroom=c.decode_headroom, amortised=c.slack and c.tbt_budget,
                                   ttft_share=c.ttft_share, max_num_seqs=c.max_num_seqs,
                                   rescue=c.rescue is not None and c.tbt_budget)
        self._votes = 0  # consecutive ticks that disagreed with the regime

    @property
    def pools(self):
        return self.arrow.pools

    # -- dispatch ----------------------------------------------------------------------------
    def route(self, req: Request, view: ClusterView, now: float) -> int | None:
        if req.slo.tpot is not None:
            self._tpots.append(req.slo.tpot)
        self._prompts.append(req.prompt_len - req.history_len)
        if req.slo.ttft is not None:
            self._urgency.append((req.prompt_len - req.history_len) / max(1e-3, req.slo.ttft))
            self._ttfts.append(req.slo.ttft)
        self._arrivals.append(now)
        if self.regime == "disaggregated":
            pick = self.arrow.route(req, view, now)
            cands = self.arrow.pools.members(*PREFILL_SIDE) if self.arrow.pools is not None else []
        else:
            cands = list(view.instances())
            if self.consolidate:
                cands = consolidated(req, view, cands, self.cfg.max_num_seqs * self.cfg.park)
            pick = self._colocated_pick(req, view, cands, now)
        pick = self._affine(req, view, pick, cands)
        if req.session is not None and pick is not None:
            self.sessions.remember(req.session, pick, req.prompt_len)
        return pick

    def _colocated_pick(self, req: Request, view: ClusterView, cands: list[int], now: float) -> int:
        """Among the instances where the prompt's predicted TTFT (queue delay plus its own
        prefill) stays within `ttft_share` x 2 of its SLO, the one whose decode step would be
        shortest with it added (TPOT is decided by decode steps once prompts are served in
        time); if none, the least predicted delay. On many instances the answer comes from
        indexes (`flowyard.dispatch`: the same pick without reading every snapshot)."""
        pick = indexed_pick(self, req, view, cands, now)
        if pick is not None:
            return pick
        snaps = {i: view.snapshot(i) for i in cands}
        ttft = req.slo.ttft if req.slo.ttft is not None else self.cfg.ttft_slo
        delay = self._delays(req, snaps, now)
        own = self.arrow.ttft(max(1, req.prompt_len - req.history_len))
        best = min(delay.values())
        ok = [i for i in cands if delay[i] + own <= 2 * self.cfg.ttft_share * ttft
              and delay[i] <= best + self.cfg.delay_tolerance * ttft]
        if not ok or self.cfg.dispatch == "delay":
            return min(cands, key=lambda i: (delay[i], snaps[i].running_tokens + snaps[i].incoming_tokens, i))
        steps = self._decode_steps([snaps[i] for i in ok], req.prompt_len)
        return min(zip(steps, (delay[i] for i in ok), ok))[2]

    def _delays(self, req: Request, snaps: dict, now: float) -> dict[int, float]:
        """Predicted wait of req's prefill on each instance: the work its queue order puts
        ahead of it (S-EDF: only feasible work due no later, `QuadraticTTFT.delay_ahead`)."""
        if self.cfg.order != "s-edf" or not self.cfg.delay_ahead:
            return {i: self.arrow.delay(s) for i, s in snaps.items()}
        due = deadline(req)  # inf without a TTFT SLO: S-EDF ranks it after everything queued
        ahead, chunk = self.arrow.ttft.delay_ahead, self.cfg.chunk
        # an empty prefill queue waits for nothing (most instances, most of the time)
        return {i: ahead(s, chunk, due, now) if s.prefill_queue else 0.0 for i, s in snaps.items()}

    def _decode_steps(self, snaps: list, prompt: int) -> list[float]:
        """`_decode_step` of each snapshot; one element-wise roofline call for many instances
        (the same float expression per element, so the same numbers as one call each)."""
        if len(snaps) < VECTOR_MIN or type(self.predictor) is not RooflineCostModel:
            return [self._decode_step(s, prompt) for s in snaps]
        n = np.fromiter((s.num_running + s.num_waiting + s.num_migrating_in + 1 for s in snaps), dtype=np.int64,
                        count=len(snaps))
        ctx = np.fromiter((float(s.running_tokens + s.waiting_tokens + s.incoming_tokens + prompt) for s in snaps),
                          dtype=float, count=len(snaps))
        return self.predictor.step_time(BatchShape(decode_seqs=n, decode_ctx=ctx)).tolist()

    def _decode_step(self, s, prompt: int) -> float:
        """Predicted decode step of an instance once everything on it (and this prompt) decodes."""
        n = s.num_running + s.num_waiting + s.num_migrating_in + 1
        ctx = s.running_tokens + s.waiting_tokens + s.incoming_tokens + prompt
        return self._decode_step_nc(n, ctx)

    def _decode_step_nc(self, n: int, ctx: int) -> float:
        """Predicted decode step of n sequences holding ctx tokens of context."""
        return float(self.predictor.step_time(BatchShape(decode_seqs=n, decode_ctx=float(ctx))))

    def _affine(self, req: Request, view: ClusterView, pick: int | None, cands: list[int]) -> int | None:
        """A later turn of a session to its home, unless home is clearly worse (PLA-Serve)."""
        if self.cfg.affinity is None or req.session is None or not req.history_len or pick is None:
            return pick
        known = self.sessions.home(req.session)
        home = known[0] if known is not None else None
        if home is None or home == pick or home not in cands:
            return pick
        h, p = view.snapshot(home), view.snapshot(pick)
        cached = cached_prefix(req.history_len, req.prompt_len, h.block_size)
        t_home = self.arrow.delay(h) + self.arrow.ttft.remaining(cached, req.prompt_len - cached)
        t_pick = self.arrow.delay(p) + self.arrow.ttft(req.prompt_len)
        return self.sessions.choose(home, pick, t_home, t_pick, self.cfg.affinity)

    def route_decode(self, state: RequestState, src: int, view: ClusterView, now: float) -> int:
        if self.regime == "colocated":
            return src  # decode where it prefilled: no KV moves
        return self.arrow.route_decode(state, src, view, now)
