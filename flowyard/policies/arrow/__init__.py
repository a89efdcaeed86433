"""Arrow: elastic prefill/decode pools over stateless instances (`pools`), the SLO-aware router
(`router`) and the instance monitor that flips instances between pools (`monitor`)."""

from flowyard.policies.arrow.builders import arrow_policy

__all__ = ["arrow_policy"]
