"""What a client and a load balancer see when an instance dies (issue 29), at the HTTP layer:
503 + Retry-After before the first token, an OpenAI-style error event and a clean [DONE]
after it, /health 503 with each instance's state when nothing can take work; and the cluster
core never sends work to an instance the transport reports down."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from test_server import C, P, FakeEngine, chat_body, cmpl_body, sse
from flowyard.cluster.core import ClusterCore, DecisionLog
from flowyard.core.request import SLO, Request, RequestState
from flowyard.engine.protocol import EngineStats, EngineUnavailableError
from flowyard.policies.framework.contracts import InstanceSnapshot, Role, StepResult
from flowyard.policies.registry import POLICY_NAMES, PolicyOptions, build_policy
from flowyard.server import build_app


class DyingEngine(FakeEngine):
    """Fails its request with EngineUnavailableError after `after` tokens (0: before any)."""

    def __init__(self, after: int, **kw) -> None:
        super().__init__(**kw)
        self.after = after
        self.instances = [{"instance": 0, "role": "mixed", "state": "serving"}]

    async def _run(self, rid, prompt_ids, params):
        n = 0
        async for out in super()._run(rid, prompt_ids, params):
            if n == self.after:
                raise EngineUnavailableError("instance 0 died; the request's KV cache was lost; retry", 2.0)
            n += 1
            yield out

    def stats(self) -> EngineStats:
        s = super().stats()
        s.instances = self.instances
        return s


def test_death_before_the_first_token_is_503_with_retry_after():
    client = TestClient(build_app(DyingEngine(after=0)), raise_server_exceptions=False)
    for body, path in ((chat_body(), C), (cmpl_body(stream=True), P)):
        r = client.post(path, json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
        err = r.json()["error"]
        assert err["type"] == "service_unavailable_error" and err["code"] == "instance_unavailable"
        assert "retry" in err["message"]
    t = client.get("/metrics").text
    assert 'vllm:request_success_total{finished_reason="error",model_name="fake-model"} 2.0' in t


def test_death_mid_stream_is_an_error_event_and_a_clean_end():
    engine = DyingEngine(after=3)
    client = TestClient(build_app(engine), raise_server_exceptions=False)
    r = client.post(P, json=cmpl_body(stream=True))
    assert r.status_code == 200
    events = sse(r.text)
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == "Hel"
    assert events[-2]["error"]["type"] == "service_unavailable_error" and events[-1] == "[DONE]"
    r = client.post(C, json=chat_body())  # not streaming: the status can still say it
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert not engine.active


def test_health_is_503_with_instance_states_when_nothing_can_take_work():
    engine = DyingEngine(after=0)
    client = TestClient(build_app(engine))
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["instances"][0]["state"] == "serving"
    engine.healthy = False
    engine.instances = [{"instance": 0, "role": "mixed", "state": "restarting"}]
    h = client.get("/health")
    assert h.status_code == 503 and h.headers["retry-after"] == "1"
    assert h.json()["instances"] == [{"instance": 0, "role": "mixed", "state": "restarting"}]


# ---- the cluster core with one instance down -------------------------------------------------


class HalfDown:
    """A transport whose instance `dead` is down: records every add and move."""

    def __init__(self, roles: list[Role], dead: int) -> None:
        self.roles, self.dead = roles, dead
        self.adds: list[int] = []
        self.moves: list[tuple[int, int]] = []
        self.failed: list[str] = []
        self.moves_in_place = True

    def instance_ids(self, role: Role | None = None):
        return [i for i, r in enumerate(self.roles) if i != self.dead and (role is None or r is role)]

    def snapshot(self, instance: int) -> InstanceSnapshot:
        return InstanceSnapshot(instance=instance, role=self.roles[instance], num_running=0, num_waiting=0,
                                waiting_tokens=0, running_tokens=0, kv_free_blocks=100, kv_total_blocks=100,
                                block_size=16)

    def add(self, instance, st, now):
        self.adds.append(instance)
        return True

    def hand_off(self, instance, st):
        return True

    def move(self, src, dst, st, now):
        self.moves.append((src, dst))

    def fail(self, instance, st, reason):
        self.failed.append(reason)


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("dead", [0, 1, 2])
def test_no_policy_sends_work_to_a_dead_instance(name, dead):
    """Three instances, one down from the start or dying after the policy formed its pools:
    no arrival, split, hand-off or decode route reaches it."""
    from flowyard.costmodel import make_cost_model

    policy = build_policy(name, PolicyOptions(num_instances=3, predictor=make_cost_model("smollm2-135m", "cpu")))
    t = HalfDown(policy.roles, dead=-1)
    core = ClusterCore(policy, t, DecisionLog())
    routed = 0
    for k in range(12):
        st = RequestState(Request(id=k, arrival=0.01 * k, prompt_len=50 + 40 * k, output_len=8, slo=SLO(ttft=1.0)))
        if k == 3:
            t.dead = dead  # dies after the policy has seen every instance (pools formed)
        dst = core.arrive(st, 0.01 * k)
        if dst is None:
            assert "retry" in (st.reject_reason or ""), (name, st.reject_reason)
            continue
        routed += 1
        assert k < 3 or dst != dead, (name, k, dst)
        # the step after its prefill: a hand-off (PD, a split) or a decode route (stateless)
        handoffs = [st] if (st.split_to is not None or policy.roles[dst] is Role.PREFILL) else []
        prefilled = [] if handoffs else [st]
        moves = core.stepped(dst, StepResult(handoffs=handoffs, prefilled=prefilled), 0.01 * k + 0.005)
        assert k < 3 or all(d != dead for _, d in moves), (name, k, moves)
    assert all("retry" in f for f in t.failed), t.failed
    live_prefill = [i for i, r in enumerate(policy.roles) if i != dead and r is not Role.DECODE]
    assert routed == 12 if live_prefill else routed == 3, (name, routed)
