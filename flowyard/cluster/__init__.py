"""The cluster core shared by the simulator, the in-process runtime and Ray (see core.py)."""

from flowyard.cluster.core import ClusterCore, Decision, DecisionLog, Transport
from flowyard.cluster.ticks import Ticks
from flowyard.cluster.turns import Turns

__all__ = ["ClusterCore", "Decision", "DecisionLog", "Ticks", "Transport", "Turns"]
