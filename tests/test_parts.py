"""Scheduling policies as composable parts (issue 13, items 2 and 3): every registry policy is
one local core plus parts and one composed global scheduler; a policy that is not in the
registry can be written from the same parts and runs in the simulator."""

from __future__ import annotations

import cloudpickle
import numpy as np
import pytest

from conftest import FixedLink, LinearCost, make_requests
from flowyard.core.kvcache import KVCacheManager
from flowyard.core.plan import StepOutput
from flowyard.core.request import SLO, Request, RequestState, Status
from flowyard.policies.arrow.router import ArrowRouter
from flowyard.policies.framework.contracts import Role
from flowyard.policies.framework.compose import Composed, LeastScoreDispatch, RoundRobinDispatch
from flowyard.policies.framework.local_core import LocalCore
from flowyard.policies.dynaserve.split import DynaServeConfig, DynaServeRouter
from flowyard.policies.dynaserve.lengths import OracleLengthPredictor
from flowyard.policies.flowprefill.scheduler import FlowPrefillConfig, FlowPrefillSelector
from flowyard.policies.framework.continuous_batching import BatchConfig, BatchScheduler
from flowyard.policies.framework.order import QueueOrder
from flowyard.policies.pla.selector import PLAConfig, PLASelector, length_model_of, pla_scheduler
from flowyard.policies.pla.router import PLARouter
from flowyard.policies.framework.capabilities import Capabilities
from flowyard.policies.framework.policy import Policy
from flowyard.policies.registry import POLICY_NAMES, PolicyOptions, build_policy, policy_requires_predictor
from flowyard.policies.framework.chunked import ChunkedSelector
from flowyard.policies.framework.slack import TTFTPredictor
from flowyard.sim.cluster import Topology
from flowyard.sim.simulator import Simulator

COST = LinearCost(capacity=50_000)
TOPO = Topology(1, FixedLink(), FixedLink())


def opts(**kw) -> PolicyOptions:
    return PolicyOptions(num_instances=4, num_prefill=2, predictor=COST, **kw)


def req(i: int, arrival: float, prompt: int, out: int = 4, ttft: float | None = 1.0) -> Request:
    return Request(id=i, arrival=arrival, prompt_len=prompt, output_len=out, slo=SLO(ttft=ttft))


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_is_a_core_with_parts_and_a_composed_global_scheduler(name):
    pol = build_policy(name, opts())
    assert isinstance(pol.global_scheduler, Composed)
    for i in range(4):
        sched = pol.make_local(i, KVCacheManager(500, 16), max_model_len=1000, single_step=True)
        assert isinstance(sched, LocalCore) and sched.role is pol.roles[i]
        assert sched.max_model_len == 1000 and sched.max_repeats == 1  # the engine's promise


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_policies_pickle_and_rebuild_their_local_schedulers(name):
    """On Ray the driver ships the policy to actors: the copy builds working schedulers."""
    pol = cloudpickle.loads(cloudpickle.dumps(build_policy(name, opts())))
    sched = pol.make_local(0, KVCacheManager(500, 16), max_model_len=2000)
    st = RequestState(req(0, 0.0, 40))
    assert sched.add_request(st, 0.0) and sched.has_work()


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_what_a_policy_needs_is_declared_and_enforced(name):
    needs = policy_requires_predictor(name)
    if needs:
        with pytest.raises(ValueError, match="predictor"):
            build_policy(name, PolicyOptions(num_instances=4, num_prefill=2))
    else:
        build_policy(name, PolicyOptions(num_instances=4, num_prefill=2))
    assert needs == (name not in ("vllm", "prefill-first", "round-robin", "least-load", "distserve", "distserve-cp2k",
                                  "distserve-cp8k"))


def test_queue_orders_rank_as_named():
    a, b, c = req(0, 0.0, 100, ttft=5.0), req(1, 0.1, 100, ttft=0.5), req(2, 0.2, 100, ttft=None)
    states = [RequestState(r) for r in (a, b, c)]
    hat = {0: 0.1, 1: 0.9, 2: 0.1}  # b cannot meet its deadline any more

    def rank(name):
        o = QueueOrder(name)
        return [s.id for s in sorted(states, key=lambda s: o.key(s, 0.2, lambda s: hat[s.id]))]

    assert rank("fcfs") == [0, 1, 2]
    assert rank("edf") == [1, 0, 2]  # no SLO: an infinite deadline
    assert rank("s-edf") == [0, 2, 1]  # the hopeless one after every feasible one
    assert rank("d-edf") == [1, 0, 2]  # past its deadline? not yet
    with pytest.raises(ValueError, match="queue order"):
        QueueOrder("lifo")
    with pytest.raises(ValueError, match="TTFT predictor"):
        ChunkedSelector(order="s-edf")
    with pytest.raises(ValueError, match="order"):
        BatchConfig(order="random")


def test_s_edf_on_a_colocated_core_serves_feasible_requests_first():
    """A queue order from FlowPrefill on vLLM's chunked selector: composition, not a subclass."""
    predict = TTFTPredictor(COST)
    sched = BatchScheduler(0, Role.MIXED, KVCacheManager(1000, 16),
                           BatchConfig(max_num_batched_tokens=64, order="s-edf"), ttft_hat=predict.request)
    hopeless = RequestState(req(0, 0.0, 60, ttft=0.001))
    fine = RequestState(req(1, 0.0, 60, ttft=10.0))
    sched.add_request(hopeless, 0.0)
    sched.add_request(fine, 0.0)
    plan = sched.schedule(0.01)
    assert [s.state.id for s in plan.prefills][0] == 1


def test_selectors_refuse_roles_they_cannot_serve():
    with pytest.raises(ValueError, match="prefill instances"):
        LocalCore(0, Role.MIXED, KVCacheManager(100, 16), FlowPrefillSelector(FlowPrefillConfig(), COST))
    with pytest.raises(ValueError, match="MIXED"):
        pla_scheduler(0, Role.DECODE, KVCacheManager(100, 16), PLAConfig(), COST, length_model_of(COST))
    with pytest.raises(ValueError, match="score"):
        LeastScoreDispatch("random")
    with pytest.raises(ValueError, match="migrations"):
        BatchScheduler(0, Role.PREFILL, KVCacheManager(100, 16), BatchConfig()).add_migration(
            RequestState(req(0, 0.0, 10)), 0.0)


@pytest.mark.parametrize("selector", ["flowprefill", "pla"])
def test_a_prefill_instance_finishes_a_request_that_reaches_the_context_limit(selector):
    """Bug (the old prefill-only schedulers): a prompt whose first token reached max_model_len
    was handed off, and the decode instance generated past the context limit."""
    kv = KVCacheManager(100, 16)
    sel = FlowPrefillSelector(FlowPrefillConfig(), COST) if selector == "flowprefill" else \
        PLASelector(PLAConfig(awd=PLAConfig().awd.__class__(w_max=0.0)), COST, length_model_of(COST))
    core = LocalCore(0, Role.PREFILL, kv, sel, max_model_len=64)
    st = RequestState(req(0, 0.0, 63, out=10))
    assert core.add_request(st, 0.0)
    plan = core.schedule(0.0)
    res = core.update_from_output(plan, StepOutput(end_times=np.array([0.1])))
    assert res.finished == [st] and not res.handoffs and st.status is Status.FINISHED
    assert kv.num_free_blocks == 100


def test_aborting_a_queued_prompt_between_chunks_frees_its_kv():
    kv = KVCacheManager(400, 16)
    core = LocalCore(0, Role.PREFILL, kv, FlowPrefillSelector(FlowPrefillConfig(chunk_size=64), COST))
    st = RequestState(req(0, 0.0, 1000))
    core.add_request(st, 0.0)
    plan = core.schedule(0.0)
    core.update_from_output(plan, StepOutput(end_times=np.array([0.1])))
    assert st.status is Status.WAITING and kv.num_free_blocks < 400  # KV for the whole prompt
    assert core.abort(0) is st and st.status is Status.ABORTED and kv.num_free_blocks == 400
    assert not core.has_work()


class Ticks:
    def __init__(self, period: float) -> None:
        self.period, self.at = period, []

    def tick(self, view, now: float) -> None:
        self.at.append(now)


class Learns:
    capabilities = Capabilities(learns=True)

    def __init__(self) -> None:
        self.seen = []

    def route(self, req, view, now):
        return 0

    def on_finished(self, state, now):
        self.seen.append(state.id)


def test_composed_ticks_each_controller_on_its_own_period_and_tells_learners():
    fast, slow, learner = Ticks(0.5), Ticks(1.0), Learns()
    gs = Composed("x", learner, controllers=[fast, slow])
    assert gs.period == 0.5 and not gs.routes_decode
    for k in range(5):
        gs.tick(None, 0.5 * k)
    assert fast.at == [0.0, 0.5, 1.0, 1.5, 2.0] and slow.at == [0.0, 1.0, 2.0]
    gs.on_finished(RequestState(req(7, 0.0, 10)), 1.0)
    assert learner.seen == [7]


def test_a_policy_outside_the_registry_is_written_from_parts():
    """Arrow's pools and monitor, PLA-Serve's length classes... here: PLA's dispatcher (length
    pools, session affinity) with its pressure controller, DynaServe's split search, and S-EDF
    queues on colocated cores that decode what they prefill. Every request completes."""
    lengths = length_model_of(COST)
    pla = PLARouter(lengths, COST, spatial=True, affinity=0.05)
    split = DynaServeRouter(COST, OracleLengthPredictor(), DynaServeConfig(min_segment=8))
    gs = Composed("composed", pla, splitter=split, controllers=[pla])
    predict = TTFTPredictor(COST)

    def local(instance, role, kv, batch):
        sel = ChunkedSelector(batch.max_num_batched_tokens, order="s-edf", ttft_hat=predict.request)
        return LocalCore(instance, role, kv, sel, max_model_len=batch.max_model_len, max_repeats=batch.max_repeats)

    pol = Policy("composed", gs, [Role.MIXED] * 4, {Role.MIXED: BatchConfig(512)}, {Role.MIXED: local})
    reqs = make_requests(n=80, rate=40.0, prompt=(16, 1500), out=(2, 60))
    res = Simulator(reqs, pol, COST, TOPO).run()
    assert all(s.status is Status.FINISHED and s.num_output == s.req.output_len for s in res.states)
    assert split.last is not None and pla.pools is not None and gs.pools is pla.pools


def test_arrow_and_pla_share_one_pool_model():
    pol_a = build_policy("arrow", opts())
    pol_p = build_policy("pla-spatial", opts())
    reqs = make_requests(n=40, rate=30.0, prompt=(16, 3000), out=(2, 40))
    for pol in (pol_a, pol_p):
        Simulator(reqs, pol, COST, TOPO).run()
        pools = pol.global_scheduler.pools
        assert type(pools).__mro__[-2].__name__ == "Pools"
        assert sorted(pools.of) == list(range(4 if pol is pol_a else 2))
        for t, i, frm, to in pol.global_scheduler.pool_moves():
            assert isinstance(frm, str) and isinstance(to, str)
    assert isinstance(pol_a.global_scheduler.dispatcher, ArrowRouter)


def test_round_robin_dispatch_visits_entry_instances_in_turn():
    class View:
        def instances(self, role=None):
            return [0, 1, 2] if role in (None, Role.MIXED) else []

    rr = RoundRobinDispatch()
    assert [rr.route(req(i, 0.0, 10), View(), 0.0) for i in range(5)] == [0, 1, 2, 0, 1]
