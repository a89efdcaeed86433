"""How `RayCluster` lives with dying actors (issue 29), kept apart from its normal operation.

Every actor has a `watch` call outstanding that returns (with RayActorError) only when the
actor dies, so a death is noticed by `poll`, which the serving loop calls when idle, or by
`step`, without any traffic. Then: requests that had not started there are dispatched again;
requests whose KV was there fail with a retryable error (`RequestOutput.retry_after`, which
the server answers with 503 + Retry-After); the cluster core routes nothing more to the
instance (`ClusterCore._live_substitute`); a replacement starts and rejoins once it has
loaded. Deaths and rejoins are decisions ("down", "up") and timeline events; requests ended
here get their spans.
"""

from __future__ import annotations


from flowyard.engine.protocol import EngineUnavailableError
from flowyard.engine.sampling import RequestOutput
from flowyard.policies.framework.contracts import Role
from flowyard.runtime.ray_state import RayState


class RayFaults(RayState):
    """A part of `RayCluster` (state: `RayState`): deaths, re-dispatch and replacements."""

    def _instance_died(self, i: int) -> list[RequestOutput]:
        """Re-dispatch what had not started there; fail, with a retryable error, what had (its
        KV is gone); start a replacement, which rejoins once it has loaded."""
        self.failures += 1
        self._inflight.pop(i, None)
        self._sent_during_step.discard(i)
        self._down[i] = None
        self._busy[i] = False
        self._wake_at[i] = None
        self._event("down", i, "actor died")
        q, h = self._prefix.pop(i, (0, 0))  # keep what it counted: its replacement starts at 0
        self._prefix_retired = (self._prefix_retired[0] + q, self._prefix_retired[1] + h)
        outputs = []
        self.turns.ready = type(self.turns.ready)(j for j in self.turns.ready if j != i)
        self.turns.timers.pop(i, None)
        for k in [k for k, home in self._kv_home.items() if home == i]:
            del self._kv_home[k]  # its KV is gone with it: the destination's import fails clearly
        for rid in [r for r, where in self._where.items() if where == i]:
            del self._where[rid]
            self._released([(k, i) for k, v in self._rid.items() if v == rid])  # a source kept its KV
            inputs = self._inputs.pop(rid, None)
            if inputs is not None and self.instance_ids():
                prompt, params, slo, arrival, session, task, priority = inputs
                try:
                    self.add_request(rid, prompt, params, slo, arrival, session=session, task=task,
                                     priority=priority)
                    continue
                except (ValueError, EngineUnavailableError):
                    pass
            for k in [k for k, v in self._rid.items() if v == rid]:
                self._ended(k, "failed")
            outputs.append(RequestOutput(rid, finished=True, finish_reason="error", retry_after=self.RETRY_AFTER_S,
                                         error=f"instance {i} died; the request's KV cache was lost; retry"))
        self.actors[i] = self._spawn(i)
        self._down[i] = self.actors[i].info.remote()
        return outputs

    def _check_restarts(self) -> None:
        for i, ref in list(self._down.items()):
            if ref is None:
                continue
            ready, _ = self._ray.wait([ref], timeout=0)
            if not ready:
                continue
            try:
                self._ray.get(ref)
                snap = self._ray.get(self._call(i, "snapshot"))
            except self._ray.exceptions.RayActorError:  # the replacement died too: try again
                self._instance_died(i)
                continue
            del self._down[i]
            self._snaps[i] = snap
            self.restarts += 1
            self._event("up", i, "replacement loaded")

    def _check_deaths(self) -> list[RequestOutput]:
        """Instances whose `watch` call ended: their actor died (no traffic needed)."""
        live = {ref: i for i, ref in self._watch.items() if i not in self._down}
        if not live:
            return []
        ready, _ = self._ray.wait(list(live), num_returns=len(live), timeout=0)
        for ref in ready:
            self._failed += self._instance_died(live[ref])
        return []

    def poll(self) -> list[RequestOutput]:
        """Look after the instances while nothing else runs: notice deaths and rejoins, tick."""
        self._check_deaths()
        self._check_restarts()
        self._periodic()  # the periodic ticks go on while idle (`flowyard.cluster.ticks`)
        outputs, self._failed = self._failed, []
        return outputs

    def _event(self, kind: str, i: int, detail: str) -> None:
        if self.decisions is not None:
            self.decisions.add(self.now(), kind, -1, src=i, dst=i, detail=detail)
        if self.timeline is not None:
            self.timeline.instance_event(i, kind, self.now(), detail)

    def _ended(self, req_id: int, status: str) -> None:
        """A request the driver ended (an instance's death): its span on the timeline."""
        self._rid.pop(req_id, None)
        st = self._states.pop(req_id, None)
        if self.timeline is not None and st is not None:
            self.timeline.ended(st, self.now(), status)

    @property
    def accepting(self) -> bool:
        """Some live instance can take a new request (health checks read this)."""
        return any(self.policy.roles[i] is not Role.DECODE for i in self.instance_ids())

    def instance_states(self) -> list[dict]:
        out = []
        for i, role in enumerate(self.policy.roles):
            s = self._snaps[i]
            out.append({"instance": i, "role": role.value, "state": "restarting" if i in self._down else "serving",
                        "running": s.num_running, "waiting": s.num_waiting, "kv_usage": round(s.kv_usage, 4)})
        return out
