"""The profiled attention model: the work PyTorch's CPU flash kernel does, and a fit that
holds on prompt lengths the profile did not sample (committed measurements, no timing here)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowyard.core.plan import BatchShape
from flowyard.costmodel.profiled import KEY_BLOCK, ProfiledCostModel, prefill_work

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import attention_fit  # noqa: E402

RESULTS = Path(__file__).parent.parent / "benchmarks/results"


def _tiled(n: int) -> int:
    """Brute force: each query row computes every key block up to the one holding its diagonal."""
    if n < KEY_BLOCK:
        return n * n
    return sum(min(n, KEY_BLOCK * math.ceil((q + 1) / KEY_BLOCK)) for q in range(n))


@given(st.integers(1, 3000))
def test_prefill_work_of_a_fresh_prompt_is_the_kernels_block_count(n):
    assert prefill_work(BatchShape.of([(0, n)], [])) == pytest.approx(_tiled(n))


@given(st.integers(1, 600), st.integers(1, 2000), st.integers(1, 4))
def test_a_chunk_after_history_computes_every_pair_and_equal_slices_add(n, h, k):
    assert prefill_work(BatchShape.of([(h, n)] * k, [])) == pytest.approx(k * n * (h + n))
    assert prefill_work(BatchShape.of([(0, n)] * k, [])) == pytest.approx(k * _tiled(n))
    assert prefill_work(BatchShape.of([], [h])) == 0


def test_vectorised_over_a_run_of_shapes():
    s = BatchShape(prefill_tokens=np.array([256.0, 1024.0]), prefill_seqs=np.array([1, 1]),
                   prefill_attn=np.array([0.0, 0.0]), prefill_kv=np.array([256.0, 1024.0]))
    assert list(prefill_work(s)) == [256 * 256, _tiled(1024)]


def test_a_quick_profile_prices_prompt_lengths_it_did_not_sample():
    """Fitted on a run's quick profile, the attention of fresh prompts of 512 and 2,048 tokens
    and of a 256-token chunk after 1,024 cached ones, measured by a full profile of the same
    machine that day; pairs alone missed them by a quarter to a third."""
    profile = json.loads((RESULTS / "real_cluster_64/profile-local.json").read_text())
    quick = ProfiledCostModel(profile)
    full = json.loads((RESULTS / "attention_fit/profile-full-local.json").read_text())
    checked = 0
    for s in attention_fit.held_out(profile, full):
        sh = s["shape"]
        if sh["decode_seqs"] or sh["prefill_tokens"] < 256:
            continue
        got = float(quick.layer_op_times(BatchShape(**sh))["attn"])
        assert got == pytest.approx(s["times"]["attn"], rel=0.15), sh
        checked += 1
    assert checked >= 3


def test_the_benchmark_reports_both_models_on_the_held_out_shapes():
    quick = json.loads((RESULTS / "real_cluster_64/profile-local.json").read_text())
    full = json.loads((RESULTS / "attention_fit/profile-full-local.json").read_text())
    text = "\n".join(attention_fit.section(2, quick, full, (1.0, 2.0)))
    assert "| pairs | attention |" in text and "| kernel work | whole step |" in text
    assert "| prefill 2048 | 36.231 |" in text  # a held-out shape, with its measured time
