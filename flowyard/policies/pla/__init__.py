"""PLA-Serve: the compute/memory length boundary (`boundary`), Adaptive Wait-Depth batching of
short prefills (`awd`), the short/long prefill selector (`selector`) and the router with session
affinity and the pressure controller over short and long pools (`router`)."""

from flowyard.policies.pla.builders import pla_policy, pla_spatial_policy

__all__ = ["pla_policy", "pla_spatial_policy"]
