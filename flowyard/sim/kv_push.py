"""KV transfer timing in the simulator: whole hand-offs, and DynaServe's chunked push.

KV transfers take `topology.link(src, dst)`'s time for the bytes moved, and links are not
shared (each transfer has its own). A micro-request (`RequestState.split_at`, DynaServe §4.3)
pushes its first segment's KV chunk by chunk: every step that computes tokens of the segment
sends their KV at once, back to back on the request's link, so at the hand-off only the last
chunk is still in flight. With `chunked=False` the whole segment goes after the hand-off
instead, as for a PD hand-off; requests without a split always move that way, so other
policies are unchanged. `exposed` records, per micro-request hand-off, the seconds from the
transfer's start to its landing that computation did not hide.
"""

from __future__ import annotations

import numpy as np

from flowyard.core.request import RequestState
from flowyard.sim.cluster import Topology


class KVPush:
    def __init__(self, topology: Topology, kv_bytes_per_token: int, chunked: bool) -> None:
        self.topology, self.kv_bytes, self.chunked = topology, kv_bytes_per_token, chunked
        self.exposed: list[float] = []
        self._pushed: dict[int, tuple[int, float]] = {}  # request id -> (tokens sent, link free at)
        self._micro: set[int] = set()  # micro-requests handed off, transfer not started yet
        self._splitting: dict[int, RequestState] = {}  # micro-requests before their hand-off

    def split(self, st: RequestState) -> None:
        """st was just split into micro-requests: its first segment's KV will be pushed."""
        self._splitting[st.id] = st

    def finished(self, st: RequestState) -> None:
        if self._splitting:
            self._splitting.pop(st.id, None)
            self._pushed.pop(st.id, None)

    def handed_off(self, st: RequestState) -> None:
        """st leaves its instance; for a micro-request, its first segment is done."""
        if self._splitting.pop(st.id, None) is not None:
            self._micro.add(st.id)

    def computed(self, src: int, ends: np.ndarray) -> None:
        """A plan on `src` ended at `ends`: micro-requests whose first segment runs there send
        the KV it computed, one chunk per step, each leaving when its step ends or when the
        request's previous chunk has left, whichever is later (f_k = max(f_k-1, end_k) + tau_k)."""
        if not (self._splitting and self.chunked):
            return
        for st in self._splitting.values():
            if st.instance != src or st.split_to is None:
                continue
            sent, free = self._pushed.get(st.id, (0, -np.inf))
            new = st.num_computed - sent
            if new <= 0:
                continue
            link = self.topology.link(src, st.split_to)
            if len(ends) == 1:  # one chunk: this step's tokens
                free = max(free, float(ends[-1])) + link.transfer_time(new * self.kv_bytes)
            else:  # a decode run: one token per step
                tau = link.transfer_time(self.kv_bytes)
                k = np.arange(len(ends), 0, -1)  # chunks from step i to the last, inclusive
                free = max(free + new * tau, float(np.max(ends + k * tau)))
            self._pushed[st.id] = (st.num_computed, free)

    def landing(self, st: RequestState, src: int, dst: int, now: float) -> float:
        """When the KV of st, admitted on `dst` at `now`, has all arrived from `src`."""
        link = self.topology.link(src, dst)
        pushed = self._pushed.pop(st.id, None)
        if pushed is None:  # the whole KV moves now (PD hand-off, or chunking off)
            t = now + link.transfer_time(st.num_computed * self.kv_bytes)
        else:  # earlier chunks are on their way or there: only the rest goes now
            sent, free = pushed
            rest = st.num_computed - sent
            t = max(now, free) + (link.transfer_time(rest * self.kv_bytes) if rest > 0 else 0.0)
        if st.id in self._micro:
            self._micro.discard(st.id)
            self.exposed.append(t - now)
        return t
