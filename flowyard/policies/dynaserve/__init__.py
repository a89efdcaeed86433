"""DynaServe: the split search that cuts a request into micro-requests on two instances
(`split`, over the pass timeline of `vbatch` and `passes`), output-length prediction
(`lengths`) and the SLO-aware local batch (`local_batch`)."""

from flowyard.policies.dynaserve.builders import dynaserve_policy

__all__ = ["dynaserve_policy"]
