"""How a Ray actor imports a migrated request's KV (`ray_actor.import_kv_chunks`), without Ray:
the blocks it was admitted with and no more. DynaServe's waited-too-long path admits a
migration without its KV (num_computed 0, recomputed here, one block reserved); the actor used
to import every chunk the source sent into that one-block table, which raised, and the request
failed ("KV cache was lost in transfer") instead of being recomputed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowyard.core.kvcache import KVCacheManager
from flowyard.runtime.ray_actor import import_kv_chunks
from flowyard.runtime.ray_reports import kv_payload, kv_tensor


class Runner:
    """The two things import_kv_chunks uses of a ModelRunner, over a small KV tensor."""

    def __init__(self, blocks: int, bs: int = 4) -> None:
        self.bs = bs
        self.kv_cache = torch.zeros(2, 2, blocks, bs, 1, 2)

    def import_kv(self, blocks: list[int], data: torch.Tensor) -> None:
        self.kv_cache[:, :, blocks] = data


def source_chunks(blocks: int, per_chunk: int) -> list[torch.Tensor]:
    data = torch.arange(2 * 2 * blocks * 4 * 2, dtype=torch.float32).reshape(2, 2, blocks, 4, 1, 2) + 1
    return [data[:, :, i:i + per_chunk] for i in range(0, blocks, per_chunk)]


def test_a_migration_admitted_without_its_kv_imports_nothing():
    kv, runner = KVCacheManager(16, 4), Runner(16)
    assert kv.allocate(7, 1)  # what Migrations.admit reserves when patience runs out
    fetched = []
    n = import_kv_chunks(runner, kv.block_table(7), source_chunks(5, 2), 0, lambda c: fetched.append(c) or c)
    assert n == 0 and fetched == [] and runner.kv_cache.abs().sum() == 0


def test_a_migration_imports_the_blocks_of_its_computed_tokens():
    kv, runner = KVCacheManager(16, 4), Runner(16)
    assert kv.allocate(7, 19)  # 18 computed tokens + the next: 5 blocks
    chunks = source_chunks(5, 2)
    table = kv.block_table(7)
    assert import_kv_chunks(runner, table, chunks, 18, lambda c: c) == 5
    whole = torch.cat(chunks, dim=2)
    assert torch.equal(runner.kv_cache[:, :, table], whole)
    # a source that sent more blocks than the destination admitted: only the admitted ones
    kv2, runner2 = KVCacheManager(16, 4), Runner(16)
    assert kv2.allocate(8, 9)
    assert import_kv_chunks(runner2, kv2.block_table(8), chunks, 8, lambda c: c) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_a_kv_chunk_crosses_the_object_store_bit_for_bit(dtype):
    """A chunk travels as its bits in a NumPy array (Ray pickles that out of band, four times
    faster to put than a tensor) and comes back as the same tensor, whatever the KV dtype."""
    import pickle

    chunk = torch.randn(2, 2, 3, 4, 1, 8).to(dtype)  # layers, k/v, blocks, block, kv heads, head dim
    back = kv_tensor(pickle.loads(pickle.dumps(kv_payload(chunk), protocol=5)))
    assert back.dtype == dtype and back.shape == chunk.shape
    assert torch.equal(back.view(torch.uint8), chunk.view(torch.uint8))
    assert isinstance(kv_payload(chunk)[1], np.ndarray)
