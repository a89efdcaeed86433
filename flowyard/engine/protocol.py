"""What the HTTP server needs from an engine: the seam between `server` and `engine`.

The server only talks to an `EngineClient`; the in-process engine, a multi-instance runtime
or a test double can stand behind it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Protocol, Sequence

from flowyard.core.request import SLO
from flowyard.engine.sampling import RequestOutput, SamplingParams

if TYPE_CHECKING:  # it imports torch; the protocol does not need it at run time
    from flowyard.engine.preemption import PreemptionStats


class TokenizerLike(Protocol):
    @property
    def eos_token_ids(self) -> Sequence[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...


@dataclass(slots=True)
class EngineStats:
    """Gauges for /metrics and /health (vLLM's meanings)."""

    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks in use
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, ever
    prefix_cache_hits: int = 0  # of which found
    healthy: bool = True
    detail: str = ""
    # each instance: {"instance", "role", "state" ("serving" | "restarting"), "running", "waiting",
    # "kv_usage"}: what /health shows a load balancer or an operator
    instances: list[dict] = field(default_factory=list)
    preemption: PreemptionStats | None = None  # when the engine preempts
    cpu_threads: int | None = None  # threads the steps run on, where they run in this process


class QueueFullError(RuntimeError):
    """The engine's bounded queue is full: the server answers 503 + Retry-After."""


class EngineUnavailableError(RuntimeError):
    """The request failed, or cannot start, because an instance died or none can take work
    now; not the request's fault, so a retry after `retry_after` seconds should succeed. The
    server answers 503 with Retry-After (load balancers and clients retry on it)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineClient(Protocol):
    model_name: str
    max_model_len: int

    @property
    def tokenizer(self) -> TokenizerLike: ...

    def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, slo: SLO | None = None,
        session: str | None = None, task: str | None = None, priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; raises QueueFullError at once if it cannot be queued.
        Cancelling the iteration (client gone) aborts the request and frees its KV."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...
