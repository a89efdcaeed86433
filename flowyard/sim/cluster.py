"""Where simulated instances sit, and which link a KV transfer between two of them crosses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class LinkLike(Protocol):
    def transfer_time(self, nbytes: float) -> float: ...


@dataclass(frozen=True, slots=True)
class Topology:
    """Instance i holds GPUs [i*tp, (i+1)*tp); GPUs fill nodes of `gpus_per_node` in order.
    Transfers inside a node use `intra` (NVLink), across nodes `inter` (the network)."""

    tp: int
    intra: LinkLike
    inter: LinkLike
    gpus_per_node: int = 8

    def node(self, instance: int) -> int:
        return instance * self.tp // self.gpus_per_node

    def link(self, src: int, dst: int) -> LinkLike:
        return self.intra if self.node(src) == self.node(dst) else self.inter
