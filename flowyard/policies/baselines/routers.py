"""Global schedulers of the baselines: data-parallel routers and DistServe's PD dispatch, each
a `compose.Composed` assembly of the baseline parts.

Each reads only `InstanceSnapshot`s, so it runs unchanged over simulated or real instances.
Ties break towards the lowest instance id, which keeps runs deterministic.
"""

from __future__ import annotations

from flowyard.policies.framework.compose import Composed, LeastScoreDispatch, MostFreeKVDecode, RoundRobinDispatch


class RoundRobin(Composed):
    """SGLang router `round_robin`: the next instance in turn, whatever its load."""

    def __init__(self) -> None:
        super().__init__("round-robin", RoundRobinDispatch())


class LeastLoad(Composed):
    """SGLang router's load-based choice: the instance with the fewest requests in flight
    (running, waiting and arriving)."""

    def __init__(self) -> None:
        super().__init__("least-load", LeastScoreDispatch("requests"))


class VllmDataParallel(Composed):
    """vLLM v1's data-parallel load balancer (DPLBAsyncMPClient in vllm/v1/engine/
    core_client.py): score = waiting * 4 + running, lowest score wins."""

    def __init__(self) -> None:
        super().__init__("vllm", LeastScoreDispatch("vllm"))


class DistServeDispatch(Composed):
    """DistServe's static PD dispatch: a new request goes to the prefill instance with the
    shortest queue (in prompt tokens still to compute); a finished prefill goes to the decode
    instance with the most free KV (then the fewest requests)."""

    def __init__(self) -> None:
        super().__init__("distserve", LeastScoreDispatch("waiting-tokens"), decode_router=MostFreeKVDecode())


class RoundRobinPD(Composed):
    """FlowPrefill's proxy: new requests to the prefill instances in turn, whatever their load
    (§4: load balancing across instances is out of the paper's scope); finished prefills to the
    decode instance with the most free KV, as DistServe."""

    def __init__(self) -> None:
        super().__init__("round-robin-pd", RoundRobinDispatch(), decode_router=MostFreeKVDecode())
