"""Engine instances as Ray actors, one process each: the deployment form of `LocalCluster`.

The driver (the server process) runs the policy's global scheduler; every actor runs its own
`LLMEngine` with the policy's local scheduler for its role. All busy actors step concurrently
(one Ray call each per round). A finished prefill on a PREFILL actor is handed to the decode
actor the global scheduler picks: its request record and KV blocks travel through the Ray
object store, and the destination imports them as soon as it has room.

Snapshots for the global scheduler are the ones each actor returned with its last step, so
they are at most one step old (the simulator can model the same staleness).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

from flowyard.core.request import SLO
from flowyard.engine.llm_engine import EngineConfig, LLMEngine
from flowyard.engine.sampling import RequestOutput, SamplingParams
from flowyard.policies.base import InstanceSnapshot, Role
from flowyard.policies.local import BatchConfig
from flowyard.policies.registry import Policy
from flowyard.runtime.base import ClusterBase

ID_STRIDE = 1 << 40  # each actor numbers its requests from instance * ID_STRIDE: ids never clash


class EngineActor:
    """What runs inside each Ray actor process."""

    def __init__(self, model: str | None, config: EngineConfig, instance: int, role: str,
                 batch: dict, t0: float) -> None:
        import torch

        torch.set_num_threads(max(1, config.threads or 1))
        base = LLMEngine.from_path(model, config)
        self.engine = LLMEngine(base.model, base.tokenizer, config, base.model_name, instance=instance,
                                role=Role(role), batch=BatchConfig(**batch),
                                ids=itertools.count(instance * ID_STRIDE), t0=t0)
        self.pending: list[tuple[Any, list]] = []  # migrations whose KV arrived before the room
        self.rejected: list[RequestOutput] = []  # adds refused here, reported with the next step

    def info(self) -> tuple[str, int]:
        return self.engine.model_name, self.engine.max_model_len

    def tokenizer(self):
        return self.engine.tokenizer

    def add_request(self, rid: str, prompt: list[int], params: SamplingParams, slo: SLO | None) -> None:
        """Called without waiting for the result (so the driver never blocks on a busy
        instance); a refusal comes back with the next step's outputs."""
        try:
            self.engine.add_request(rid, prompt, params, slo)
        except ValueError as e:
            self.rejected.append(RequestOutput(rid, finished=True, finish_reason="rejected", error=str(e)))

    def abort(self, rid: str) -> None:
        t = self.engine.tracked(rid)
        if t is not None:
            self.pending = [(st, kv) for st, kv in self.pending if st.id != t.state.id]
        self.engine.abort(rid)

    def step(self) -> tuple[list[RequestOutput], list[tuple[str, Any]], InstanceSnapshot, bool]:
        outputs, self.rejected = self.rejected, []
        if self.engine.has_unfinished():
            outputs += self.engine.step()
        handoffs = [(self.engine.tracked_by_id(st.id).request_id, st) for st in self.engine.handoffs]
        self.engine.handoffs = []
        self._admit()
        return outputs, handoffs, self.engine.scheduler.snapshot(), self.engine.has_unfinished()

    def snapshot(self) -> InstanceSnapshot:
        return self.engine.scheduler.snapshot()

    def hand_off(self, rid: str) -> Any:
        """Stop running a request here, keeping its KV for a migration (any token position)."""
        t = self.engine.tracked(rid)
        if t is None:
            return None
        return self.engine.scheduler.hand_off(t.state.id)

    def take(self, req_id: int, chunk_blocks: int = 16) -> tuple[dict, list]:
        """Give up a handed-off request: its record and its KV blocks, in chunks of
        `chunk_blocks` blocks (each its own object in the store); the KV is freed here."""
        import ray

        e = self.engine
        t = e.detach(req_id)
        st = t.state
        table = e.kv.block_table(st.id)[: -(-st.num_computed // e.kv.block_size)]
        kv = [ray.put(e.runner.export_kv(table[i:i + chunk_blocks])) for i in range(0, len(table), chunk_blocks)]
        e.scheduler.release(st.id)
        record = {"request_id": t.request_id, "state": st, "params": t.params, "text": t.text,
                  "emitted": t.emitted, "emitted_tokens": t.emitted_tokens,
                  "generator": None if t.generator is None else t.generator.get_state(),
                  "detok": (t.detok.ids, t.detok.prefix_offset, t.detok.read_offset, t.detok.text)}
        return record, kv

    def put(self, payload: tuple[dict, list]) -> None:
        """Take in a migrated request (the result of the source's `take`, passed by reference
        so the driver never waits for either side)."""
        import torch

        record, kv = payload

        from flowyard.engine.llm_engine import TrackedRequest
        from flowyard.engine.tokenizer import IncrementalDetokenizer

        e = self.engine
        st = record["state"]
        detok = IncrementalDetokenizer(e.tokenizer)
        detok.ids, detok.prefix_offset, detok.read_offset, detok.text = record["detok"]
        gen = None
        if record["generator"] is not None:
            gen = torch.Generator()
            gen.set_state(record["generator"])
        t = TrackedRequest(record["request_id"], st, record["params"], detok, gen, text=record["text"],
                     emitted=record["emitted"], emitted_tokens=record["emitted_tokens"])
        e.attach(t)
        e.scheduler.add_migration(st, e.now())
        self.pending.append((st, kv))
        self._admit()

    def _admit(self) -> None:
        e = self.engine
        kv_of = {st.id: kv for st, kv in self.pending}
        import ray

        for st in e.scheduler.admit_migrations(e.now()):
            table = e.kv.block_table(st.id)
            start = 0
            for ref in kv_of.pop(st.id):  # chunk by chunk, in block order
                chunk = ray.get(ref)
                e.runner.import_kv(table[start:start + chunk.shape[2]], chunk)
                start += chunk.shape[2]
            e.scheduler.migration_arrived(st, e.now())
        self.pending = [(st, kv) for st, kv in self.pending if st.id in kv_of]


class RayCluster(ClusterBase):
    """`LocalCluster`'s surface over Ray actors (what `AsyncLLMEngine` and the server drive)."""

    def __init__(self, model: str | None, policy: Policy, config: EngineConfig = EngineConfig(),
                 address: str | None = None) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
        self._ray = ray
        self.policy = policy
        self.config = config
        t0 = time.monotonic()
        self._t0_for_spawn = t0
        self._actor_cls = ray.remote(num_cpus=0)(EngineActor)
        self._model = model
        self.actors = [self._spawn(i) for i in range(len(policy.roles))]
        infos = ray.get([a.info.remote() for a in self.actors])
        self.model_name = infos[0][0]
        self.max_model_len = min(i[1] for i in infos)
        # The driver tokenises prompts: it takes the tokenizer from an actor rather than
        # loading (and dequantising) the whole checkpoint a second time.
        self.tokenizer = ray.get(self.actors[0].tokenizer.remote())
        self._t0 = t0
        self._snaps = ray.get([a.snapshot.remote() for a in self.actors])
        self._busy = [False] * len(self.actors)
        self._where: dict[str, int] = {}
        self._inputs: dict[str, tuple[list[int], SamplingParams, SLO | None]] = {}  # until 1st token
        self._down: dict[int, Any] = {}  # instance -> ObjectRef of its replacement's start-up
        self._inflight: dict[int, Any] = {}  # instance -> ObjectRef of the step it is running
        self._sent_during_step: set[int] = set()  # got work after its in-flight step started
        self.migrations = 0
        self.failures = 0

    def _spawn(self, i: int):
        role = self.policy.roles[i]
        return self._actor_cls.remote(self._model, self.config, i, role.value,
                                      dataclasses.asdict(self.policy.configs[role]), self._t0_for_spawn)

    @property
    def health_detail(self) -> str:
        return ", ".join(f"instance {i} is down (restarting)" for i in sorted(self._down))

    def now(self) -> float:
        return time.monotonic() - self._t0

    def instances(self, role: Role | None = None) -> list[int]:
        return [i for i, r in enumerate(self.policy.roles)
                if (role is None or r is role) and i not in self._down]

    def snapshot(self, instance: int) -> InstanceSnapshot:
        return self._snaps[instance]

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    slo: SLO | None = None, arrival: float | None = None) -> None:
        """arrival is accepted for the engine interface; actors stamp their own arrival."""
        dst = self._route(request_id, prompt_ids, params, slo)
        self.actors[dst].add_request.remote(request_id, prompt_ids, params, slo)
        self._where[request_id] = dst
        self._inputs[request_id] = (prompt_ids, params, slo)
        self._mark_busy(dst)
        snap = self._snaps[dst]  # count it in until the instance's next snapshot (vLLM does too)
        snap.num_waiting += 1
        snap.waiting_tokens += len(prompt_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        where = self._where.pop(request_id, None)
        if where is None:
            return None
        self.actors[where].abort.remote(request_id)
        return RequestOutput(request_id, finished=True, finish_reason="abort")

    def has_unfinished(self) -> bool:
        return any(self._busy) or bool(self._inflight)

    def snapshots(self) -> list[InstanceSnapshot]:
        return self._snaps

    def step(self) -> list[RequestOutput]:
        """Apply whichever instance steps have finished (waiting for at least one) and start
        the next step of each such instance at once: instances progress independently, a
        short decode step never waits for a long prefill step elsewhere."""
        self._check_restarts()
        self._periodic(self.has_unfinished())
        for i, busy in enumerate(self._busy):
            if busy and i not in self._down and i not in self._inflight:
                self._inflight[i] = self.actors[i].step.remote()
        if not self._inflight:
            return []
        refs = list(self._inflight.values())
        ready, rest = self._ray.wait(refs, num_returns=1)
        if rest:
            ready += self._ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        by_ref = {ref: i for i, ref in self._inflight.items()}
        outputs: list[RequestOutput] = []
        for ref in ready:
            i = by_ref[ref]
            del self._inflight[i]
            try:
                outs, handoffs, snap, still_busy = self._ray.get(ref)
            except self._ray.exceptions.RayActorError:
                outputs += self._instance_died(i)
                continue
            # Work sent while this step ran is not in its report: stay busy for it.
            self._snaps[i], self._busy[i] = snap, still_busy or i in self._sent_during_step
            self._sent_during_step.discard(i)
            outputs += outs
            for o in outs:
                self._inputs.pop(o.request_id, None)  # started: its KV now matters
                if o.finished:
                    self._where.pop(o.request_id, None)
            for rid, st in handoffs:
                self._hand_off(i, rid, st)
        return outputs

    def _instance_died(self, i: int) -> list[RequestOutput]:
        """Re-dispatch what had not started there; fail, with a clear error, what had (its KV
        is gone); start a replacement, which rejoins once it has loaded."""
        self.failures += 1
        self._inflight.pop(i, None)
        self._down[i] = None
        self._busy[i] = False
        outputs = []
        for rid in [r for r, where in self._where.items() if where == i]:
            del self._where[rid]
            inputs = self._inputs.pop(rid, None)
            if inputs is not None and self.instances(self.policy.roles[i]):
                try:
                    self.add_request(rid, *inputs)
                    continue
                except ValueError:
                    pass
            outputs.append(RequestOutput(rid, finished=True, finish_reason="error",
                                         error=f"instance {i} died; the request's KV cache was lost"))
        self.actors[i] = self._spawn(i)
        self._down[i] = self.actors[i].info.remote()
        return outputs

    def _check_restarts(self) -> None:
        for i, ref in list(self._down.items()):
            ready, _ = self._ray.wait([ref], timeout=0)
            if ready:
                del self._down[i]
                self._snaps[i] = self._ray.get(self.actors[i].snapshot.remote())

    def migrate(self, request_id: str, dst: int) -> bool:
        """Move a running request to instance `dst` at whatever token it has reached; it
        continues there without recomputation. False if it is not running anywhere (yet)."""
        src = self._where.get(request_id)
        if src is None or src == dst or dst in self._down:
            return False
        st = self._ray.get(self.actors[src].hand_off.remote(request_id))
        if st is None:
            return False
        self._hand_off(src, request_id, st, dst)
        return True

    def _hand_off(self, src: int, request_id: str, st: Any, dst: int | None = None) -> None:
        """Move a request whose KV sits on `src`: the destination's `put` receives the
        source's `take` by reference, so neither call blocks the driver."""
        if dst is None:
            dst = self.policy.global_scheduler.route_decode(st, src, self, self.now())
        self.actors[dst].put.remote(self.actors[src].take.remote(st.id))
        self._where[request_id] = dst
        self._mark_busy(dst)
        self.migrations += 1

    def _mark_busy(self, i: int) -> None:
        self._busy[i] = True
        if i in self._inflight:
            self._sent_during_step.add(i)

    def shutdown(self) -> None:
        for a in self.actors:
            self._ray.kill(a)
