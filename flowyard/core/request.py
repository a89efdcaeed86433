"""Requests: the immutable description of what a client asked for, and its mutable progress.

A `Request` is what a trace row or an HTTP call becomes; it never changes once made, so the
same object can be replayed through several policies. Everything that changes while it is
served lives in `RequestState`, owned by exactly one instance's local scheduler at a time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency objectives in seconds; None means the request does not carry that objective.

    ttft: first token no later than arrival + ttft.
    tpot: mean time per output token after the first, (last - first) / (n - 1).
    tbt:  every gap between consecutive output tokens (the strict per-token form).
    """

    ttft: float | None = None
    tpot: float | None = None
    tbt: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot", "tbt"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"SLO {name} must be a positive number of seconds, got {v!r}")

    @property
    def empty(self) -> bool:
        return self.ttft is None and self.tpot is None and self.tbt is None


NO_SLO = SLO()


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request.

    prompt_len is always set; prompt_tokens only when real token ids exist (the engine).
    output_len is the number of tokens the request will produce when a trace says so (the
    simulator stops it there); the real engine stops on EOS/stop strings or max_tokens.
    history_len counts the leading prompt tokens that are an earlier turn of the same session
    (cacheable for re-prefill). block_hashes are prefix-block hashes (Mooncake `hash_ids`),
    each covering hash_block_size tokens; equal leading hashes mean a shareable prefix.
    """

    id: int
    arrival: float
    prompt_len: int
    output_len: int | None = None
    max_tokens: int | None = None
    slo: SLO = NO_SLO
    task: str | None = None
    session: str | None = None
    turn: int = 0
    history_len: int = 0
    prompt_tokens: tuple[int, ...] | None = None
    block_hashes: tuple[int, ...] = ()
    hash_block_size: int = 0
    priority: int = 0  # vLLM's semantics: lower runs earlier where a policy orders by priority

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"request {self.id}: prompt_len must be >= 1, got {self.prompt_len}")
        if self.output_len is not None and self.output_len < 1:
            raise ValueError(f"request {self.id}: output_len must be >= 1, got {self.output_len}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"request {self.id}: max_tokens must be >= 1, got {self.max_tokens}")
        if self.output_len is None and self.max_tokens is None:
            raise ValueError(f"request {self.id}: needs output_len or max_tokens")
        if not 0 <= self.history_len <= self.prompt_len:
            raise ValueError(f"request {self.id}: history_len must be in [0, prompt_len]")

    @property
    def target_output(self) -> int:
        """Tokens this request produces: the trace's length capped by max_tokens."""
        if self.output_len is None:
            return self.max_tokens  # type: ignore[return-value]
        if self.max_tokens is None:
            return self.output_len
        return min(self.output_len, self.max_tokens)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    MIGRATING = "migrating"
    FINISHED = "finished"
    REJECTED = "rejected"
    ABORTED = "aborted"


@dataclass(slots=True, eq=False)
class RequestState:
    """Progress of one request.

    num_computed: tokens of the sequence (prompt, then outputs) whose KV exists. A step that
    brings num_computed up to seq_len samples one new output token.
    num_output: output tokens produced so far. After a recompute preemption the outputs are
    kept and num_computed drops to 0, so the prefill covers prompt + outputs again (vLLM).
    token_times: the emission time of every output token, kept as a list of numpy chunks so
    that one multi-step decode run shares a single array among its whole batch.
    """

    req: Request
    num_computed: int = 0
    num_output: int = 0
    status: Status = Status.WAITING
    first_token_time: float | None = None
    finish_time: float | None = None
    first_scheduled: float | None = None  # when a step first took some of its prompt (vLLM's queue end)
    token_times: list[np.ndarray] = field(default_factory=list)
    preemptions: int = 0
    instance: int | None = None
    prefill_instance: int | None = None
    reject_reason: str | None = None
    output_tokens: list[int] = field(default_factory=list)
    prefix_keys: list = field(default_factory=list)  # cache of prefix_cache.block_keys
    # A micro-request plan (DynaServe): once the first split_at tokens of the sequence have KV
    # on the instance that started the request, it moves to instance split_to and goes on there.
    split_at: int | None = None
    split_to: int | None = None

    @property
    def id(self) -> int:
        return self.req.id

    @property
    def seq_len(self) -> int:
        """Length of the sequence whose KV must exist before the next token: prompt + outputs."""
        return self.req.prompt_len + self.num_output

    @property
    def uncomputed(self) -> int:
        """Tokens of the sequence still without KV. A step that computes all of them samples
        the next token; a decode is the case of exactly one (the last output token)."""
        return self.seq_len - self.num_computed

    @property
    def in_prefill(self) -> bool:
        """True while the next step has more than one token to compute (prompt or recompute)."""
        return self.uncomputed > 1 or self.num_output == 0

    @property
    def done(self) -> bool:
        return self.num_output >= self.req.target_output

    @property
    def remaining_output(self) -> int:
        return self.req.target_output - self.num_output

    def record_tokens(self, times: np.ndarray) -> None:
        """Record output tokens emitted at `times` (already sorted)."""
        if len(times) == 0:
            return
        if self.first_token_time is None:
            self.first_token_time = float(times[0])
        self.token_times.append(times)
        self.num_output += len(times)

    def compact(self) -> None:
        """Keep the token times in one array of their own (same values). While a request runs,
        its chunks are views of arrays shared with its batch, each keeping its whole array (the
        steps of a decode run cut short included) alive; a finished request needs only its own
        times, and a view object per chunk costs more than the times it holds."""
        tt = self.token_times
        if len(tt) > 1 or (tt and tt[0].base is not None):
            self.token_times = [np.concatenate(tt) if len(tt) > 1 else tt[0].copy()]

    def all_token_times(self) -> np.ndarray:
        if not self.token_times:
            return np.empty(0)
        if len(self.token_times) == 1:
            return np.asarray(self.token_times[0], dtype=float)
        return np.concatenate(self.token_times)
