"""flowyard's own policy: Arrow's stateless pools under a regime controller that picks
colocation or a PD split (`control`, priced by `regime`), an indexed colocated dispatch
(`dispatch`), the router that holds them together (`router`) and DynaServe's SLO-aware local
batch extended with parking, shedding and rescue (`selector`)."""

from flowyard.policies.flowyard.builders import flowyard_policy

__all__ = ["flowyard_policy"]
