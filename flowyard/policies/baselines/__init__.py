"""The baselines: vLLM's colocated chunked prefill behind vLLM's or SGLang's routers, and
DistServe's static PD split."""

from flowyard.policies.baselines.builders import colocated_policy, distserve_policy

__all__ = ["colocated_policy", "distserve_policy"]
