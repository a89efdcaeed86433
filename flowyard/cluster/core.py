"""The cluster core: what a cluster does around its schedulers, written once for every executor.

A request arrives: the global scheduler routes it (it sees the real `Request`: session,
history, task, SLO), may split it into micro-requests, and the chosen instance's local
scheduler queues it. After each executed step an instance reports a `StepResult`; the core
tells the global scheduler which requests finished, picks where each hand-off continues (its
micro-request plan, else the decode router) and where each prefill that just ended decodes
(stateless instances), and starts those moves. Periodic ticks run the global scheduler's
controllers, on one grid for every executor (`flowyard.cluster.ticks`). Every decision goes to an optional `DecisionLog`, which is how the two-executor
guard compares a simulated run with a real one.

What differs between executors is only a clock (passed in as `now`) and a `Transport`: where
the local schedulers live and how a request and its KV move. The simulator prices steps and
KV links with a cost model; `LocalCluster` copies KV between in-process engines; `RayCluster`
ships it between actor processes through the object store.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Protocol, Sequence

from flowyard.cluster.ticks import Ticks
from flowyard.core.request import RequestState
from flowyard.policies.framework.contracts import GlobalScheduler, InstanceSnapshot, Role, StepResult


class Transport(Protocol):
    """An executor's instances, as the core drives them."""

    def instance_ids(self, role: Role | None = None) -> Sequence[int]:
        """Live instances (of one role)."""

    def snapshot(self, instance: int) -> InstanceSnapshot: ...

    def add(self, instance: int, st: RequestState, now: float) -> bool:
        """Queue a new request there (its micro-request plan, if any, is set on st); False if
        it was refused (st.reject_reason says why)."""

    def hand_off(self, instance: int, st: RequestState) -> bool:
        """Stop running st there, keeping its KV for a move; False if it is not running."""

    def move(self, src: int, dst: int, st: RequestState, now: float) -> None:
        """Continue st, whose KV sits on src, on dst: dst admits it when it has room, then
        its KV is copied and src releases it."""

    def fail(self, instance: int, st: RequestState, reason: str) -> None:
        """End st, held on instance, with an error that says `reason` (nowhere to go on)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """One scheduling decision. kind: route, reject, split, handoff, decode, migrate, flip,
    preempt, reroute (the policy chose a dead instance; src is it, dst where the work went
    instead), down and up (an instance died / its replacement rejoined). request: the request
    id (-1 for instance decisions such as flips); src/dst: instances; detail: the split point,
    a pool name, ..."""

    t: float
    kind: str
    request: int
    src: int | None = None
    dst: int | None = None
    detail: str = ""


class DecisionLog:
    """The decisions of one run in the order they were taken (the last `limit` of them, for a
    server that runs for days; `total` counts them all, so a reader can ask for what is new)."""

    def __init__(self, limit: int | None = None) -> None:
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=limit)
        self.total = 0

    def add(self, t: float, kind: str, request: int, src: int | None = None, dst: int | None = None,
            detail: object = "") -> None:
        self.decisions.append(Decision(t, kind, request, src, dst, str(detail)))
        self.total += 1

    def since(self, seen: int) -> list[Decision]:
        """The decisions after the first `seen` ones (those still kept)."""
        kept = list(self.decisions)
        return kept[max(0, len(kept) - (self.total - seen)):] if seen < self.total else []

    def kinds(self) -> set[str]:
        return {d.kind for d in self.decisions}

    def without_time(self, *kinds: str) -> list[tuple]:
        """The decisions (of these kinds; all if none given) without their times: what two
        executors must agree on even where their clocks differ in the last digits."""
        return [(d.kind, d.request, d.src, d.dst, d.detail) for d in self.decisions
                if not kinds or d.kind in kinds]


class ClusterCore:
    """The orchestration every executor shares; also the `ClusterView` policies read."""

    def __init__(self, policy, transport: Transport, log: DecisionLog | None = None) -> None:
        self.policy = policy
        self.gs: GlobalScheduler = policy.global_scheduler
        self.transport = transport
        self.log = log
        # the ClusterView calls go straight to the transport: policies call them on every arrival
        self.instances = transport.instance_ids  # type: ignore[method-assign]
        self.snapshot = transport.snapshot  # type: ignore[method-assign]
        # an executor that knows when each instance changes keeps score-ordered indexes
        # (`flowyard.cluster.index`); policies fall back to scanning snapshots without one
        self.ranked = getattr(transport, "ranked", None)
        # `index.least`'s member list per index name (those sets are fixed when indexed)
        self.least_members: dict[str, list[int]] = {}
        self._decode_role = Role.DECODE in policy.roles
        self._moves_seen = 0  # pool moves of the global scheduler already logged as flips
        # a transport that answers "is i live" without listing its instances (no scan per arrival)
        self._live = getattr(transport, "is_live", None)
        self.ticks = Ticks(self.gs.period)  # when the periodic ticks are due (`flowyard.cluster.ticks`)

    # -- ClusterView --------------------------------------------------------------------------
    def instances(self, role: Role | None = None) -> Sequence[int]:
        return self.transport.instance_ids(role)

    def snapshot(self, instance: int) -> InstanceSnapshot:
        return self.transport.snapshot(instance)

    # -- arrival ------------------------------------------------------------------------------
    def arrive(self, st: RequestState, now: float) -> int | None:
        """Route a new request, split it if the policy says so, and queue it. Returns the
        instance, or None when it was rejected (st.reject_reason says why)."""
        gs, log = self.gs, self.log
        self.ticks.start(st.req.arrival)
        self.catch_up(now)
        if not any(self.policy.roles[i] is not Role.DECODE for i in self.transport.instance_ids()):
            st.reject_reason = "no live instance can take a new request (one is restarting); retry"
            if log is not None:
                log.add(now, "reject", st.id, detail=st.reject_reason)
            return None
        dst, split = gs.dispatch(st.req, self, now)
        self._log_flips()
        if dst is not None and not self._is_live(dst):  # a policy that kept its own view (pools)
            dst = self._live_substitute(st, dst, now, arrival=True)
        if split and not self._is_live(split[1]):
            split = None  # the partner is down: the request runs whole where it starts
        if dst is None:
            st.reject_reason = st.reject_reason or "rejected by the global scheduler"
            if log is not None:
                log.add(now, "reject", st.id, detail=st.reject_reason)
            return None
        if split:
            st.split_at, st.split_to = split
        if log is not None:
            log.add(now, "route", st.id, dst=dst)
            if split:
                log.add(now, "split", st.id, src=dst, dst=split[1], detail=split[0])
        if not self.transport.add(dst, st, now):
            if log is not None:
                log.add(now, "reject", st.id, dst=dst, detail=st.reject_reason or "refused")
            return None
        return dst

    # -- after a step -------------------------------------------------------------------------
    def stepped(self, instance: int, result: StepResult, now: float) -> list[tuple[RequestState, int]]:
        """Apply what one executed step of `instance` produced: finished requests reach the
        global scheduler (it learns output lengths from them), hand-offs continue where their
        micro-request plan or the decode router says, and, for stateless instances, a prefill
        that just ended decodes where the global scheduler says. All destinations are chosen
        before any move starts (each sees the cluster as the step left it). Returns the moves."""
        gs, log = self.gs, self.log
        self.catch_up(now)
        for st in result.finished:
            gs.on_finished(st, now)
        planned = [(st, self._continue_at(st, instance, now)) for st in result.handoffs]
        for st, to in planned:
            if to is None:
                self.transport.fail(instance, st, "every instance that could continue this request is down "
                                                  "(restarting); retry")
        moves = [(st, to) for st, to in planned if to is not None]
        if gs.routes_decode:
            for st in result.prefilled:
                dst = gs.route_decode(st, instance, self, now)
                if not self._is_live(dst):  # decode where it prefilled rather than on a dead instance
                    self._reroute(st, dst, instance, now)
                    dst = instance
                if dst != instance and self.transport.hand_off(instance, st):
                    moves.append((st, dst))
                    if log is not None:
                        log.add(now, "decode", st.id, src=instance, dst=dst)
        self._log_flips()
        for st, dst in moves:
            st.prefill_instance = instance
            self.transport.move(instance, dst, st, now)
        return moves

    def _continue_at(self, st: RequestState, src: int, now: float) -> int | None:
        """Where a handed-off request continues: its micro-request plan, else the decode router
        (None: the policy has decode instances and none of them is up)."""
        if st.split_to is not None:
            planned, st.split_to = st.split_to, None
        elif self._decode_role and not self.transport.instance_ids(Role.DECODE):
            return None
        else:
            planned = self.gs.route_decode(st, src, self, now)
        dst = planned if self._is_live(planned) else self._live_substitute(st, planned, now, src=src)
        if dst is None:
            return None
        if self.log is not None:
            self.log.add(now, "handoff", st.id, src=src, dst=dst)
        return dst

    # -- failures: a policy must never send work to a dead instance ----------------------------
    def _is_live(self, i: int) -> bool:
        live = self._live
        return live(i) if live is not None else i in self.transport.instance_ids()

    def _live_substitute(self, st: RequestState, dead: int, now: float, *, arrival: bool = False,
                         src: int | None = None) -> int | None:
        """The least loaded live instance that can do what `dead` was chosen for: one of its
        role; failing that, for a new request, any live instance that prefills (not a decode
        instance); for a hand-off, any other live instance that decodes (not a prefill one).
        None: nothing live can (the caller rejects or fails the request, retryably)."""
        roles = self.policy.roles
        live = [i for i in self.transport.instance_ids() if i != src]
        cands = [i for i in live if roles[i] is roles[dead]]
        if not cands:
            banned = Role.DECODE if arrival else Role.PREFILL
            cands = [i for i in live if roles[i] is not banned]
        if not cands and src is not None and roles[src] is not Role.PREFILL \
                and getattr(self.transport, "moves_in_place", False):
            cands = [src]  # the only live one: it goes on where its KV is
        if not cands:
            st.reject_reason = f"instance {dead} is down (restarting) and no live instance can take its place; retry"
            return None
        dst = min(cands, key=lambda i: (self.transport.snapshot(i).num_requests, i))
        self._reroute(st, dead, dst, now)
        return dst

    def _reroute(self, st: RequestState, dead: int, dst: int, now: float) -> None:
        if self.log is not None:
            self.log.add(now, "reroute", st.id, src=dead, dst=dst, detail=f"instance {dead} is down")

    # -- migration and ticks -------------------------------------------------------------------
    def migrate(self, st: RequestState, src: int, dst: int, now: float, handed_off: bool = False) -> bool:
        """Move a running request to dst at whatever token it has reached (handed_off: the
        executor has already taken it off src, as a driver must to read a remote state)."""
        if src == dst or not (handed_off or self.transport.hand_off(src, st)):
            return False
        if self.log is not None:
            self.log.add(now, "migrate", st.id, src=src, dst=dst)
        self.transport.move(src, dst, st, now)
        return True

    def tick(self, now: float) -> None:
        """The global scheduler's periodic work (pool controllers, instance monitors)."""
        self.gs.tick(self, now)
        self._log_flips()

    def tick_due(self, now: float) -> bool:
        """Run the periodic tick if one is due at `now` (an executor asks whenever its clock
        may have passed one); returns whether it ran."""
        if self.ticks.due(now):
            self.tick(now)
            return True
        return False

    def catch_up(self, now: float) -> None:
        """A tick due strictly before `now` runs before the core acts on an event at now, as
        an executor that delivers every tick at its time would have run it."""
        if self.ticks.next is not None and self.ticks.due(now, before=True):
            self.tick(now)

    def refused(self, instance: int, st: RequestState, reason: str, now: float) -> None:
        """An instance refused a request after `arrive` had queued it there (an executor
        that hears of it later, such as a Ray actor, reports it here): logged as `arrive`
        logs a refusal it sees at once."""
        if self.log is not None:
            self.log.add(now, "reject", st.id, dst=instance, detail=reason or "refused")

    def preempted(self, instance: int, now: float, detail: object = "") -> None:
        """A local scheduler suspended its running plan (an executor saw it happen)."""
        if self.log is not None:
            self.log.add(now, "preempt", -1, src=instance, detail=detail)

    def _log_flips(self) -> None:
        if self.log is None:
            return
        moves = self.gs.pool_moves()
        for t, inst, frm, to in moves[self._moves_seen:]:
            self.log.add(t, "flip", -1, src=inst, dst=inst, detail=f"{frm}->{to}")
        self._moves_seen = len(moves)

