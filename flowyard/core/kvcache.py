"""Paged KV-cache accounting: a pool of fixed-size blocks and one block table per request.

Both executors use this same manager, so a policy sees the same KV pressure in simulation as
on the engine. Block ids are real (the engine indexes its cache tensors with them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flowyard.core.request import RequestState


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Free blocks are the never-used ids [_fresh, num_blocks), handed out lowest first, then
        # the returned ones in `_free` (a stack): the order of the stack [num_blocks-1 .. 0]
        # this manager once built in full, without a list per instance of a 1,000-instance run.
        self._fresh = 0
        self._free: list[int] = []
        self._tables: dict[int, list[int]] = {}

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._fresh + len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self._fresh - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def block_table(self, req_id: int) -> list[int]:
        return self._tables.get(req_id, [])

    def num_held(self, req_id: int) -> int:
        return len(self._tables.get(req_id, ()))

    def blocks_needed(self, req_id: int, total_tokens: int) -> int:
        """Extra blocks required for the request's table to cover total_tokens."""
        return max(0, cdiv(total_tokens, self.block_size) - self.num_held(req_id))

    def can_allocate(self, req_id: int, total_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(req_id, total_tokens) + reserve <= self.num_free_blocks

    # -- mutations -----------------------------------------------------------------------
    def allocate(self, req_id: int, total_tokens: int) -> bool:
        """Grow the request's table to cover total_tokens; False (and no change) if full."""
        need = self.blocks_needed(req_id, total_tokens)
        if need > self.num_free_blocks:
            return False
        table = self._tables.setdefault(req_id, [])
        if need:
            free = self._free
            fresh = need - len(free)
            if fresh <= 0:
                table.extend(free[-need:])
                del free[-need:]
            else:  # the stack's bottom is the untouched ids, highest first
                k = self._fresh
                table.extend(range(k + fresh - 1, k - 1, -1))
                table.extend(free)
                free.clear()
                self._fresh = k + fresh
        return True

    def trim(self, req_id: int, total_tokens: int) -> None:
        """Give back blocks beyond what total_tokens needs (unused reservations)."""
        table = self._tables.get(req_id)
        if not table:
            return
        keep = cdiv(total_tokens, self.block_size)
        if len(table) > keep:
            self._free.extend(table[keep:])
            del table[keep:]

    def free(self, req_id: int) -> int:
        table = self._tables.pop(req_id, None)
        if not table:
            return 0
        self._free.extend(table)
        return len(table)

    # -- prefix caching hooks (no-ops here; see prefix_cache.PrefixCachingKVManager) -------
    def match_prefix(self, st: "RequestState") -> int:
        """Attach cached prefix blocks to a request with no blocks; tokens covered."""
        return 0

    def peek_prefix(self, st: "RequestState") -> int:
        """Tokens match_prefix would attach now, changing nothing."""
        return 0

    def register(self, st: "RequestState") -> None:
        """Publish a request's newly computed full blocks for reuse."""

    def leaked(self) -> dict[int, int]:
        """Requests that still hold blocks (for end-of-run conservation checks)."""
        return {rid: len(t) for rid, t in self._tables.items() if t}
