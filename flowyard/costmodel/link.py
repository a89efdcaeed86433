"""KV-cache transfer links: a bandwidth and a latency, priced the way the simulator needs.

Disaggregated designs (DistServe, Arrow, DynaServe's micro-requests) move a request's KV
from one instance to another. Within a node that rides NVLink (cudaMemcpy peer-to-peer or
NCCL send/recv), across nodes the GPU's share of the network. A transfer of n bytes takes
latency + n / bandwidth; sent as k chunks (DynaServe overlaps chunks with compute) it pays
the latency k times.

Link efficiency: Vidur's NCCL send/recv on DGX nodes (profiles/vidur/network_*_send_recv)
reaches ~0.76-0.77 of per-direction NVLink bandwidth on both A100 and H100 for 32-128 MB
messages (reading its `size` as both directions' elements; otherwise it exceeds the link),
with 5-8 us latency intra-node and 17-24 us across nodes. We use 0.75 for both link kinds.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowyard.costmodel.base import CostModel
from flowyard.costmodel.hardware import HardwareSpec, get_hardware

LINK_EFFICIENCY = 0.75


@dataclass(frozen=True)
class Link:
    """A point-to-point path with sustained bandwidth (bytes/s) and per-message latency (s)."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_per_s <= 0 or self.latency_s < 0:
            raise ValueError(f"bad link: {self}")

    def transfer_time(self, nbytes: float) -> float:
        """Seconds to move nbytes as one message (0 for an empty transfer)."""
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def chunked_transfer_time(self, nbytes: float, chunks: int) -> float:
        """Seconds to move nbytes as `chunks` back-to-back messages, each paying latency."""
        if nbytes <= 0:
            return 0.0
        return max(1, chunks) * self.latency_s + nbytes / self.bandwidth_bytes_per_s

    @classmethod
    def nvlink(cls, hw: HardwareSpec | str, efficiency: float = LINK_EFFICIENCY) -> "Link":
        """GPU to GPU inside a node (per direction)."""
        hw = get_hardware(hw)
        return cls(hw.nvlink_bw * efficiency, hw.nvlink_latency_s)

    @classmethod
    def network(cls, hw: HardwareSpec | str, efficiency: float = LINK_EFFICIENCY) -> "Link":
        """GPU to GPU across nodes, over the GPU's own NIC (RDMA)."""
        hw = get_hardware(hw)
        return cls(hw.net_bw * efficiency, hw.net_latency_s)


def kv_transfer_time(cost_model: CostModel, num_tokens: float, link: Link,
                     chunks: int = 1) -> float:
    """Seconds to move the KV of num_tokens tokens between two instances of this cost model.

    With TP the source and destination GPUs pair up shard by shard and send in parallel, so
    one GPU's shard (kv_bytes_per_token, which is per GPU) over one link is the time."""
    nbytes = cost_model.kv_bytes_per_token() * num_tokens
    return link.chunked_transfer_time(nbytes, chunks)
