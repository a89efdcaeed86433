"""The cluster core shared by the simulator, the in-process runtime and Ray (see core.py)."""

from flowyard.cluster.core import ClusterCore, Decision, DecisionLog, Ticker, Transport

__all__ = ["ClusterCore", "Decision", "DecisionLog", "Ticker", "Transport"]
