"""Several engine instances in one process, under one policy: the real-clock cluster.

The policy is the very object the simulator runs (`flowyard.policies.registry.build_policy`):
its global scheduler routes each request and, for PD disaggregation, picks the decode
instance when a prefill finishes; each instance's local scheduler is the policy's
`BatchScheduler` for its role. KV moves between instances by block range (an in-process copy
here; the interface is the same for a transport between processes).

`LocalCluster` has the surface `AsyncLLMEngine` drives (add_request, abort, step,
has_unfinished, ...), so the OpenAI server serves a cluster exactly as it serves one engine.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable
from flowyard.core.kvcache import cdiv
from flowyard.core.request import SLO, RequestState
from flowyard.engine.llm_engine import EngineConfig, LLMEngine
from flowyard.engine.model import CausalLM
from flowyard.engine.preemption import PreemptionStats
from flowyard.engine.sampling import RequestOutput, SamplingParams
from flowyard.engine.tokenizer import Tokenizer
from flowyard.policies.base import InstanceSnapshot, Role
from flowyard.policies.registry import Policy
from flowyard.runtime.base import ClusterBase


class LocalCluster(ClusterBase):
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, policy: Policy,
                 config: EngineConfig = EngineConfig(), name: str = "model") -> None:
        ids, t0 = itertools.count(), time.monotonic()
        self.policy = policy
        self.config = config
        self.model_name = name
        self.tokenizer = tokenizer
        self.engines = [
            LLMEngine(model, tokenizer, config, name, instance=i, role=role, ids=ids, t0=t0,
                      scheduler=lambda kv, max_len, i=i: policy.make_local(
                          i, kv, max_model_len=max_len, single_step=True))
            for i, role in enumerate(policy.roles)
        ]
        for e in self.engines:
            e.collect_prefilled = policy.global_scheduler.routes_decode
        self.max_model_len = min(e.max_model_len for e in self.engines)
        self._where: dict[str, int] = {}  # request id -> instance that tracks it
        self._kv_home: dict[int, int] = {}  # migrating request (int id) -> instance holding its KV
        self.migrations = 0

    # -- ClusterView for the global scheduler ------------------------------------------------
    def instances(self, role: Role | None = None) -> list[int]:
        return [e.instance for e in self.engines if role is None or e.scheduler.role is role]

    def snapshot(self, instance: int) -> InstanceSnapshot:
        return self.engines[instance].scheduler.snapshot()

    # -- the engine surface ---------------------------------------------------------------------
    def now(self) -> float:
        return self.engines[0].now()

    def wake_delay(self) -> float | None:
        """The soonest any instance has something to run (see LLMEngine.wake_delay)."""
        delays = [d for e in self.engines if e.has_unfinished() and (d := e.wake_delay()) is not None]
        if (tick := self._tick_delay()) is not None and self.has_unfinished():
            delays.append(tick)
        return min(delays) if delays else None

    @property
    def preemption_stats(self) -> PreemptionStats:
        return PreemptionStats.merged([e.preemption_stats for e in self.engines])

    @property
    def boundary_hook(self) -> Callable[[], None] | None:
        return self.engines[0].boundary_hook

    @boundary_hook.setter
    def boundary_hook(self, hook: Callable[[], None] | None) -> None:
        for e in self.engines:
            e.boundary_hook = hook

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    slo: SLO | None = None, arrival: float | None = None) -> None:
        dst = self._route(request_id, prompt_ids, params, slo)
        engine = self.engines[dst]
        engine.add_request(request_id, prompt_ids, params, slo, arrival)
        self._where[request_id] = dst
        st = engine.tracked(request_id).state  # type: ignore[union-attr]
        split = self.policy.global_scheduler.split_point(st.req, dst, self, self.now())
        if split:  # a micro-request plan (DynaServe): the rest runs elsewhere after token s
            st.split_at, st.split_to = split

    def abort(self, request_id: str) -> RequestOutput | None:
        where = self._where.pop(request_id, None)
        if where is None:
            return None
        engine = self.engines[where]
        tracked = engine.tracked(request_id)
        if tracked is not None and tracked.state.id in self._kv_home:  # KV still at the source
            self.engines[self._kv_home.pop(tracked.state.id)].scheduler.abort(tracked.state.id)
        return engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines)

    def snapshots(self) -> list[InstanceSnapshot]:
        return [e.scheduler.snapshot() for e in self.engines]

    def prefix_hit_rate(self) -> float:
        return sum(getattr(e.kv, "hit_rate", 0.0) for e in self.engines) / len(self.engines)

    def step(self) -> list[RequestOutput]:
        """One step of every instance that has work, then the hand-offs it produced."""
        outputs: list[RequestOutput] = []
        self._periodic(self.has_unfinished())
        for engine in self.engines:
            if not engine.has_unfinished():
                continue
            outputs += engine.step()
            for out in outputs:
                if out.finished:
                    self._where.pop(out.request_id, None)
            handoffs, engine.handoffs = engine.handoffs, []
            prefilled, engine.prefilled = engine.prefilled, []
            for st in handoffs:
                self._hand_off(engine, st)
            if self.policy.global_scheduler.routes_decode:  # Arrow: decode where the policy says
                for st in prefilled:
                    dst = self.policy.global_scheduler.route_decode(st, engine.instance, self, self.now())
                    if dst != engine.instance and engine.scheduler.hand_off(st.id) is not None:
                        st.prefill_instance = engine.instance
                        self._move(engine, self.engines[dst], st)
            self._admit(engine)
        return outputs

    # -- KV migration ---------------------------------------------------------------------------
    def migrate(self, request_id: str, dst: int) -> bool:
        """Move a running request to instance `dst` now, at whatever token it has reached
        (mid-prefill, at the end of prefill, mid-decode); it continues there without
        recomputation. Call between steps. False if it is not running anywhere (yet)."""
        where = self._where.get(request_id)
        if where is None or where == dst:
            return False
        src = self.engines[where]
        tracked = src.tracked(request_id)
        if tracked is None or src.scheduler.hand_off(tracked.state.id) is None:
            return False
        self._move(src, self.engines[dst], tracked.state)
        return True

    def _hand_off(self, src: LLMEngine, st: RequestState) -> None:
        """A prefill finished on `src`: the request continues on the decode instance the
        global scheduler picks; its KV stays on src until the destination has room."""
        if st.split_to is not None:  # the second segment of a micro-request
            dst, st.split_to = self.engines[st.split_to], None
        else:
            dst = self.engines[self.policy.global_scheduler.route_decode(st, src.instance, self, self.now())]
        self._move(src, dst, st)

    def _move(self, src: LLMEngine, dst: LLMEngine, st: RequestState) -> None:
        tracked = src.detach(st.id)
        dst.attach(tracked)
        self._where[tracked.request_id] = dst.instance
        self._kv_home[st.id] = src.instance
        dst.scheduler.add_migration(st, self.now())
        self._admit(dst)

    def _admit(self, dst: LLMEngine) -> None:
        for st in dst.scheduler.admit_migrations(self.now()):
            src = self.engines[self._kv_home.pop(st.id)]
            n = cdiv(st.num_computed, src.kv.block_size)
            data = src.runner.export_kv(src.kv.block_table(st.id)[:n])
            dst.runner.import_kv(dst.kv.block_table(st.id)[:n], data)
            src.scheduler.release(st.id)
            dst.scheduler.migration_arrived(st, self.now())
            self.migrations += 1
