"""The KV manager's lazily built free stack hands out exactly the block ids the full list did."""

import random

from flowyard.core.kvcache import KVCacheManager, cdiv


class ListKV:
    """The former manager: the whole free stack as a list from the start."""

    def __init__(self, n: int, bs: int) -> None:
        self.bs, self.free, self.tables = bs, list(range(n - 1, -1, -1)), {}

    def allocate(self, rid: int, total: int) -> bool:
        t = self.tables.setdefault(rid, [])
        need = max(0, cdiv(total, self.bs) - len(t))
        if need > len(self.free):
            return False
        if need:
            t.extend(self.free[-need:])
            del self.free[-need:]
        return True

    def trim(self, rid: int, total: int) -> None:
        t = self.tables.get(rid)
        keep = cdiv(total, self.bs)
        if t and len(t) > keep:
            self.free.extend(t[keep:])
            del t[keep:]

    def release(self, rid: int) -> None:
        self.free.extend(self.tables.pop(rid, []))


def test_same_block_ids_as_the_full_free_list() -> None:
    rng = random.Random(7)
    kv, ref = KVCacheManager(97, 4), ListKV(97, 4)
    for _ in range(3000):
        rid, op = rng.randrange(12), rng.random()
        if op < 0.55:
            total = kv.num_held(rid) * 4 + rng.randrange(0, 40)
            assert kv.allocate(rid, total) == ref.allocate(rid, total)
        elif op < 0.75:
            total = rng.randrange(0, 30)
            kv.trim(rid, total)
            ref.trim(rid, total)
        else:
            kv.free(rid)
            ref.release(rid)
        assert kv.block_table(rid) == ref.tables.get(rid, [])
        assert kv.num_free_blocks == len(ref.free)
        assert kv.num_used_blocks == 97 - len(ref.free)
