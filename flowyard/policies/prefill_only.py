"""What every prefill-instance scheduler of a PD policy shares (FlowPrefill's, PLA-Serve's):
admission with prefix caching, the end of a prefill (finish or hand off with the KV held until
the transfer is done), and refusing migrations, which only decode instances take."""

from __future__ import annotations

from flowyard.core.kvcache import KVCacheManager
from flowyard.core.plan import PrefillSlice, StepOutput, StepPlan
from flowyard.core.request import RequestState, Status
from flowyard.policies.base import LocalScheduler, Role, StepResult


class PrefillOnlyScheduler(LocalScheduler):
    """Base of prefill-instance schedulers; subclasses own their queues and `schedule`."""

    policy_name = "this policy"

    def __init__(self, instance: int, role: Role, kv: KVCacheManager) -> None:
        if role is not Role.PREFILL:
            raise ValueError(f"{self.policy_name} schedules prefill instances (PD disaggregation)")
        self.instance, self.role, self.kv = instance, role, kv
        self.max_model_len = kv.capacity_tokens
        self._handed_off: dict[int, RequestState] = {}

    def _fits(self, state: RequestState) -> bool:
        """Reject (with the reason set) a prompt this instance can never hold."""
        if state.req.prompt_len + 1 <= self.max_model_len:
            state.instance = self.instance
            state.status = Status.WAITING
            return True
        state.status = Status.REJECTED
        state.reject_reason = (f"prompt of {state.req.prompt_len} tokens does not fit this "
                               f"instance (max_model_len {self.max_model_len})")
        return False

    def _admit(self, st: RequestState, n: int, plan: StepPlan) -> bool:
        """Add a slice of the next n tokens of st (after any cached prefix). KV is reserved for
        the whole prompt at once: a chunked prompt that went back to a queue between chunks
        then never waits for KV that later arrivals took, so a full cache cannot deadlock."""
        cached = self.kv.match_prefix(st) if st.num_computed == 0 else 0
        st.num_computed += cached
        n = min(n, st.uncomputed)
        if not self.kv.allocate(st.id, st.seq_len):
            if cached:
                self.kv.free(st.id)
                st.num_computed = 0
            return False
        st.status = Status.RUNNING
        plan.prefills.append(PrefillSlice(st, st.num_computed, n))
        return True

    def _prefilled(self, st: RequestState, out: StepOutput, result: StepResult) -> None:
        """st's prompt is done and sampled its first token: finish it or hand it off."""
        st.record_tokens(out.end_times[:1])
        if out.sampled is not None:
            st.output_tokens.extend(out.sampled.get(st.id, ()))
        if st.done or st.id in out.stopped:
            st.status = Status.FINISHED
            st.finish_time = float(out.end_times[0])
            self.kv.free(st.id)
            result.finished.append(st)
        else:
            st.status = Status.MIGRATING
            self._handed_off[st.id] = st
            result.handoffs.append(st)

    def add_migration(self, state: RequestState, now: float) -> None:
        raise ValueError(f"a {self.policy_name} prefill instance does not take migrations")

    def admit_migrations(self, now: float) -> list[RequestState]:
        return []

    def migration_arrived(self, state: RequestState, now: float) -> None:
        raise ValueError(f"a {self.policy_name} prefill instance does not take migrations")

    def release(self, req_id: int) -> None:
        del self._handed_off[req_id]
        self.kv.free(req_id)
