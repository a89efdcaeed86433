"""Requests that continue here with KV computed on another instance: a part of the local core.

A migration first waits (`pending`) until KV for its sequence can be reserved here and the
batch has room, then its transfer is in flight (`incoming`) until the executor says the KV has
arrived. With `patience` (DynaServe): micro-requests migrate both ways between the instances of
a pair, and a handed-off request keeps its KV at the source until the destination admits it,
so two full instances can wait on each other forever; a migration that has waited `patience`
seconds for KV here is admitted without its KV and recomputed here (as after a recompute
preemption), so its source frees its KV.
"""

from __future__ import annotations

from flowyard.core.kvcache import KVCacheManager
from flowyard.core.request import RequestState, Status


class Migrations:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, patience: float | None = None) -> None:
        self.kv, self.max_num_seqs, self.patience = kv, max_num_seqs, patience
        self.pending: list[RequestState] = []  # want to come here, no KV reserved yet
        self.incoming: dict[int, RequestState] = {}  # KV reserved, transfer in flight
        self._since: dict[int, float] = {}  # pending id -> when it asked to come here
        self.recomputed = 0  # migrations taken without their KV (patience ran out)

    def add(self, st: RequestState, now: float) -> None:
        st.status = Status.MIGRATING
        self.pending.append(st)
        if self.patience is not None:
            self._since[st.id] = now

    def fits(self, running: int) -> bool:
        """Whether a pending migration could be admitted at the end of the next step; if so the
        scheduler must get control back then, so no multi-step run is promised. With patience,
        any waiting migration counts: its patience is measured in steps as they end."""
        if not self.pending:
            return False
        if self.patience is not None:
            return True
        head = self.pending[0]
        if running + len(self.incoming) >= self.max_num_seqs:
            return False
        return self.kv.blocks_needed(head.id, head.num_computed + 1) <= self.kv.num_free_blocks

    def admit(self, running: int, now: float) -> list[RequestState]:
        """Pending migrations for which KV is reserved now, in arrival order (`running`: the
        requests running here, which share max_num_seqs with those in flight)."""
        admitted = []
        while self.pending and running + len(self.incoming) < self.max_num_seqs:
            st = self.pending[0]
            if not self.kv.allocate(st.id, st.num_computed + 1):
                break
            self.pending.pop(0)
            self.incoming[st.id] = st
            admitted.append(st)
        if self.patience is None:
            return admitted
        if self.pending and running + len(self.incoming) < self.max_num_seqs:
            head = self.pending[0]
            if now - self._since.get(head.id, now) >= self.patience and self.kv.allocate(head.id, 1):
                self.pending.pop(0)
                head.num_computed = 0  # nothing moves; the source frees its KV when it "lands"
                head.preemptions += 1
                self.incoming[head.id] = head
                admitted.append(head)
                self.recomputed += 1
        for st in admitted:
            self._since.pop(st.id, None)
        return admitted

    def arrived(self, st: RequestState) -> None:
        del self.incoming[st.id]

    def remove(self, req_id: int) -> RequestState | None:
        """Take a request out (abort); the caller frees its KV."""
        st = next((r for r in self.pending if r.id == req_id), None)
        if st is not None:
            self.pending.remove(st)
        else:
            st = self.incoming.pop(req_id, None)
        self._since.pop(req_id, None)
        return st

    def __len__(self) -> int:
        return len(self.pending) + len(self.incoming)

    def tokens(self) -> int:
        return sum(r.seq_len for r in self.pending) + sum(r.seq_len for r in self.incoming.values())
