"""Prefix caching on top of the paged KV manager (vLLM v1's design, in small).

Every full block of a sequence gets a key chained from its predecessor's key and its own
tokens, so equal keys mean equal prefixes. When a block's KV is computed it is registered
under its key. Freed blocks keep their key and stay findable until the allocator needs them
(least recently freed first), so a later turn of a conversation, or another request with the
same system prompt, finds its history already in KV and prefills only the rest.

Requests with token ids (the engine) hash their tokens; trace requests hash Mooncake-style
`block_hashes`, each covering `hash_block_size` tokens; turns of a multi-turn session (trace
requests without tokens) key block j of their sequence as (session, j), since every turn's
prompt extends the previous turn's prompt and reply; other requests never hit.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from flowyard.core.kvcache import KVCacheManager
from flowyard.core.request import RequestState


def block_keys(st: RequestState, block_size: int, upto: int) -> list[Hashable]:
    """Keys of the full blocks among the first `upto` tokens of the sequence (maybe fewer).
    Keys only depend on tokens before them, so they are computed once and kept on the state."""
    keys = st.prefix_keys
    n_full = upto // block_size
    if len(keys) >= n_full:
        return keys[:n_full]
    req = st.req
    if req.prompt_tokens is not None:
        tokens = req.prompt_tokens
        if n_full * block_size > len(tokens):
            tokens = tuple(tokens) + tuple(st.output_tokens[: n_full * block_size - len(tokens)])
        prev: Hashable = keys[-1] if keys else None
        for j in range(len(keys), min(n_full, len(tokens) // block_size)):
            prev = hash((prev, tokens[j * block_size:(j + 1) * block_size]))
            keys.append(prev)
    elif req.block_hashes and req.hash_block_size:
        hbs = req.hash_block_size
        limit = min(req.prompt_len, len(req.block_hashes) * hbs)
        for j in range(len(keys), min(n_full, limit // block_size)):
            t = j * block_size
            if (j + 1) * block_size > (t // hbs + 1) * hbs:
                break  # a block that straddles two hash blocks: stop matching here
            keys.append((req.block_hashes[t // hbs], t % hbs))
    elif req.session is not None:  # a conversation only appends: block j is the same in every
        # turn, replies included (the next turn's prompt is this prompt + this reply + more)
        for j in range(len(keys), n_full):
            keys.append((req.session, j))
    return keys[:n_full]


class PrefixCachingKVManager(KVCacheManager):
    """KVCacheManager whose freed blocks remain reusable by key until evicted."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        super().__init__(num_blocks, block_size)
        self._free_q: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._free = []  # the parent's list is replaced by the ordered queue
        self._ref = [0] * num_blocks
        self._key_of: list[Hashable | None] = [None] * num_blocks
        self._cached: dict[Hashable, int] = {}
        self._registered: dict[int, int] = {}  # req_id -> full blocks registered so far
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of which found in cache

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_q)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_q)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def _take(self) -> int:
        block, _ = self._free_q.popitem(last=False)
        key = self._key_of[block]
        if key is not None:  # evict: its old content is about to be overwritten
            self._key_of[block] = None
            if self._cached.get(key) == block:
                del self._cached[key]
        self._ref[block] = 1
        return block

    def _drop(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._free_q[block] = None

    def can_allocate(self, req_id: int, total_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(req_id, total_tokens) + reserve <= len(self._free_q)

    def allocate(self, req_id: int, total_tokens: int) -> bool:
        need = self.blocks_needed(req_id, total_tokens)
        if need > len(self._free_q):
            return False
        table = self._tables.setdefault(req_id, [])
        for _ in range(need):
            table.append(self._take())
        return True

    def trim(self, req_id: int, total_tokens: int) -> None:
        table = self._tables.get(req_id)
        if not table:
            return
        keep = max(-(-total_tokens // self.block_size), 0)
        while len(table) > keep:
            self._drop(table.pop())
        self._registered[req_id] = min(self._registered.get(req_id, 0), keep)

    def free(self, req_id: int) -> int:
        table = self._tables.pop(req_id, None)
        self._registered.pop(req_id, None)
        if not table:
            return 0
        for block in reversed(table):  # tail blocks are evicted first
            self._drop(block)
        return len(table)

    # -- prefix matching ---------------------------------------------------------------------
    def match_prefix(self, st: RequestState) -> int:
        """Attach the longest cached prefix of a request that holds no blocks yet; returns the
        tokens it covers. At least one token is always left to compute (it yields the logits)."""
        if self._tables.get(st.id):
            return 0
        keys = block_keys(st, self.block_size, st.seq_len - 1)
        self.queries += st.req.prompt_len
        table: list[int] = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            if self._ref[block] == 0:
                del self._free_q[block]
            self._ref[block] += 1
            table.append(block)
        if table:
            self._tables[st.id] = table
            self._registered[st.id] = len(table)
        hit = len(table) * self.block_size
        self.hits += min(hit, st.req.prompt_len)
        return hit

    def peek_prefix(self, st: RequestState) -> int:
        """Tokens `match_prefix` would attach now, without attaching or counting anything
        (schedulers size batches by what is really left to compute)."""
        if self._tables.get(st.id):
            return 0
        n = 0
        for key in block_keys(st, self.block_size, st.seq_len - 1):
            if key not in self._cached:
                break
            n += 1
        return n * self.block_size

    def register(self, st: RequestState) -> None:
        """Publish the request's newly computed full blocks under their keys."""
        table = self._tables.get(st.id)
        if not table:
            return
        done = self._registered.get(st.id, 0)
        full = min(st.num_computed // self.block_size, len(table))
        if full <= done:
            return
        keys = block_keys(st, self.block_size, full * self.block_size)
        for j in range(done, len(keys)):
            block = table[j]
            if keys[j] not in self._cached and self._key_of[block] is None:
                self._cached[keys[j]] = block
                self._key_of[block] = keys[j]
        self._registered[st.id] = full
