"""FlowPrefill: S-EDF with operator-level preemption of prefills on PD-disaggregated instances
(`scheduler`; the slack-ordered queue and TTFT predictor are shared, in `framework.slack`)."""

from flowyard.policies.flowprefill.builders import flowprefill_colocated_policy, flowprefill_policy

__all__ = ["flowprefill_colocated_policy", "flowprefill_policy"]
