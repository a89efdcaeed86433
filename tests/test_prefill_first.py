"""The prefill-first scheduler (vLLM V0 without chunked prefill, SGLang without mixed chunks):
a step that can run a prompt runs prompts only, so decodes stall behind every prefill; published
serving runs of those engines are replayed with it (`workload.scheduler`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flowyard.core.kvcache import KVCacheManager
from flowyard.core.plan import StepOutput
from flowyard.core.request import SLO, Request, RequestState
from flowyard.costmodel.published import point_from_dict, published_points
from flowyard.costmodel.replay import replay
from flowyard.costmodel.roofline import RooflineCostModel
from flowyard.policies.framework.contracts import Role
from flowyard.policies.framework.continuous_batching import BatchConfig, BatchScheduler


def core(mix: bool, blocks: int = 400) -> BatchScheduler:
    return BatchScheduler(0, Role.MIXED, KVCacheManager(blocks, 16),
                          BatchConfig(max_num_batched_tokens=512, chunked_prefill=mix, mix_decodes=mix))


def step(c: BatchScheduler, now: float):
    plan = c.schedule(now)
    assert plan is not None
    c.update_from_output(plan, StepOutput(end_times=np.array([now + 0.01])))  # one step of a run
    return plan


def state(i: int, prompt: int) -> RequestState:
    return RequestState(Request(id=i, arrival=0.0, prompt_len=prompt, output_len=50, slo=SLO()))


@pytest.mark.parametrize("mix", [True, False])
def test_a_new_prompt_stalls_the_decodes_only_under_prefill_first(mix):
    c = core(mix)
    c.add_request(state(0, 100), 0.0)
    first = step(c, 0.0)
    assert [s.state.id for s in first.prefills] == [0] and not first.decodes
    assert step(c, 1.0).decodes  # request 0 decodes alone
    c.add_request(state(1, 300), 2.0)
    plan = step(c, 2.0)
    assert [s.state.id for s in plan.prefills] == [1]
    assert bool(plan.decodes) is mix  # prefill-first: the decode of request 0 waits this step
    after = step(c, 3.0)
    assert {d.id for d in after.decodes} == {0, 1} and not after.prefills


def test_prefill_first_runs_the_decodes_when_no_prompt_fits_in_kv():
    """vLLM V0 schedules decodes when no prompt can start; else the instance would idle."""
    c = core(False, blocks=12)  # 192 tokens of KV
    c.add_request(state(0, 100), 0.0)
    step(c, 0.0)
    c.add_request(state(1, 150), 1.0)  # 100 + 150 tokens do not fit
    plan = step(c, 1.0)
    assert not plan.prefills and [d.id for d in plan.decodes] == [0]


def test_a_published_run_of_a_prefill_first_engine_is_replayed_with_its_scheduler():
    """Prefill-first stalls decodes, so the replayed TPOT rises above chunked prefill's."""
    p = next(p for p in published_points() if p.workload.get("scheduler") == "prefill-first"
             and p.metric == "tpot_p50" and p.workload["rate"] == 8)
    small = dataclasses.replace(p, name=p.name + " (test)", workload={**p.workload, "num_requests": 300})
    mixed = dataclasses.replace(small, name=small.name + " mixed", workload={**small.workload, "scheduler": "vllm"})
    cm = RooflineCostModel(p.model, p.hardware, p.tp)
    assert replay(small, cm) > 1.05 * replay(mixed, cm)


def test_an_unknown_scheduler_in_a_published_point_is_refused():
    d = {"name": "x", "family": "f", "engine": "vllm-v1", "kind": "serving", "metric": "tpot_p50",
         "model": "llama-3.1-8b", "hardware": "h100", "tp": 1, "measured": 1.0, "unit": "ms",
         "source": "s", "workload": {"trace": "sharegpt", "rate": 1, "num_requests": 10, "scheduler": "fifo"}}
    with pytest.raises(ValueError, match="scheduler must be one of"):
        point_from_dict(d)
