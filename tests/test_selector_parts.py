"""Prefill selectors as declared parts (issue 28, deliverable 3): a chunked selector is a budget
rule x order x admission x decode places x shedding, each policy names the parts it takes, and
a budget is a value the rule returns for each step."""

from __future__ import annotations

import pytest

from conftest import LinearCost
from flowyard.core.kvcache import KVCacheManager
from flowyard.core.request import SLO, Request, RequestState
from flowyard.policies.dynaserve.local_batch import TBTBudget, dynaserve_selector
from flowyard.policies.flowyard.selector import (MooreHodgsonShedding, SlackPlaces, TPOTSlackBudget,
                                                 flowyard_selector)
from flowyard.policies.framework.chunked import ChunkedSelector
from flowyard.policies.framework.compose import Composed
from flowyard.policies.framework.contracts import Role
from flowyard.policies.framework.local_core import LocalCore
from flowyard.policies.framework.parts import Admission, FirstAdmitted, FixedBudget, StepBudget

COST = LinearCost(capacity=50_000)


class Sixteen:
    """A budget rule outside the library: 16 prompt tokens beside whatever decodes run."""

    def __init__(self) -> None:
        self.planned_budgets: list[int] = []

    def step(self, decodes, now, core, urgent):
        return StepBudget(decodes, 16, len(decodes) + 16, len(decodes))

    def planned(self, plan, budget, now):
        self.planned_budgets.append(budget.prefill)

    def executed(self, plan, out):
        pass


def test_a_budget_rule_returns_each_steps_budget_to_the_selector():
    rule = Sixteen()
    sel = ChunkedSelector(rule)
    core = LocalCore(0, Role.MIXED, KVCacheManager(100, 16), sel)
    core.add_request(RequestState(Request(id=0, arrival=0.0, prompt_len=40, output_len=4)), 0.0)
    plan = core.schedule(0.0)
    assert [s.n for s in plan.prefills] == [16] and rule.planned_budgets == [16]
    assert sel.step is not None and sel.step.tokens == 16  # the value the rule returned


def test_an_int_budget_is_vllms_fixed_rule_and_the_defaults_are_vllms_parts():
    sel = ChunkedSelector(512)
    assert sel.budget == FixedBudget(512) and sel.admission == Admission()
    assert isinstance(sel.places, FirstAdmitted) and sel.shedding is None and not sel.together
    with pytest.raises(ValueError, match="token budget"):
        ChunkedSelector(0)
    with pytest.raises(ValueError, match="park"):
        Admission(park=0.5)


def test_each_policy_names_its_parts():
    fy = flowyard_selector(COST, park=1.5, shed=True, places="slack", shed_rate="shared", prefill_preempts=False)
    assert isinstance(fy.budget, TPOTSlackBudget) and isinstance(fy.places, SlackPlaces)
    assert isinstance(fy.shedding, MooreHodgsonShedding) and fy.shedding.shared
    assert fy.admission == Admission(park=1.5, chunk_preempts=False, runs_while_queued=False)
    assert fy.together and fy.order.name == "s-edf"
    # Moore-Hodgson times prompts with S-EDF's TTFT predictor: no shedding under another order,
    # and a static order keeps vLLM's started-first rule
    fcfs = flowyard_selector(COST, order="fcfs", shed=True)
    assert fcfs.shedding is None and not fcfs.together
    dyn = dynaserve_selector(COST)
    assert isinstance(dyn.budget, TBTBudget) and dyn.order.name == "fcfs" and not dyn.together
    with pytest.raises(ValueError, match="places"):
        flowyard_selector(COST, places="random")


def test_the_tpot_slack_budget_caps_decodes_at_the_places_and_answers_for_them():
    """More decodes hold KV than there are places (parking): the rule answers for the first
    max_num_seqs in place order and lets only those join the step."""
    rule = TPOTSlackBudget(COST, chunk=256)
    core = LocalCore(0, Role.MIXED, KVCacheManager(1000, 16), ChunkedSelector(rule), max_num_seqs=2)
    decodes = []
    for k in range(3):
        st = RequestState(Request(id=k, arrival=0.0, prompt_len=8, output_len=50, slo=SLO(ttft=1.0, tpot=0.05)))
        st.num_output, st.num_computed, st.first_token_time = 1, 8, 0.0
        decodes.append(st)
    b = rule.step(decodes, 0.01, core, lambda now: None)
    assert list(b.decodes) == decodes[:2] and b.decode_cap == 2 and b.tokens == 2 + b.prefill
    assert 0 < b.prefill <= 256


class Ticks:
    def __init__(self, period: float | None) -> None:
        self.period, self.at = period, []

    def tick(self, view, now: float) -> None:
        self.at.append(now)


class Dispatch:
    def route(self, req, view, now):
        return 0


def test_a_controller_without_a_period_ticks_with_the_composed_scheduler():
    """Bug: beside a controller with a period, one without (period None) raised a TypeError on
    its second tick (None - 1e-9)."""
    every, slow = Ticks(None), Ticks(1.0)
    gs = Composed("x", Dispatch(), controllers=[every, slow])
    assert gs.period == 1.0
    for k in range(3):
        gs.tick(None, 1.0 * k)
    assert every.at == [0.0, 1.0, 2.0] and slow.at == [0.0, 1.0, 2.0]
