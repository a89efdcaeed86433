"""Sampling parameters (OpenAI's plus vLLM's extensions) and the sampler itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing this module must not load torch
    import torch

MAX_LOGPROBS = 20  # vLLM's default cap


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop, per request.

    temperature 0 means greedy. seed makes a sampled request reproducible on its own,
    whatever else is in the batch. stop strings end generation and are not returned.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # as vLLM: the top-N log-probabilities of each output token, plus its own

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (no limit) or positive, got {self.top_k}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(slots=True)
class RequestOutput:
    """One increment of a request's output, as the engine streams it to a client."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None  # per new token: token id -> log-probability
    # set on an error that is not the request's fault (its instance died, none can take it):
    # seconds after which a retry should succeed; the server answers 503 with Retry-After
    retry_after: float | None = None
    # on the final output: seconds in each of vLLM's request phases, "queue" (arrival -> first
    # scheduled), "prefill" (-> first token), "decode" (-> last token), "inference" (scheduled -> last)
    phases: dict[str, float] | None = None


def top_logprobs(logits: "torch.Tensor", rows: list[int], ks: list[int],
                 chosen: list[int]) -> list[dict[int, float]]:
    """For each row, the `k` most likely tokens and the chosen one with their log-probabilities
    under the model's distribution (before temperature and bans, as vLLM reports them)."""
    import torch

    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    top = torch.topk(lp, max(ks), dim=-1) if max(ks) else None
    out = []
    for i, (k, tok) in enumerate(zip(ks, chosen)):
        d = {} if top is None else dict(zip(top.indices[i, :k].tolist(), top.values[i, :k].tolist()))
        d[tok] = float(lp[i, tok])
        out.append(d)
    return out


def sample(
    logits: "torch.Tensor",
    params: list[SamplingParams],
    generators: list["torch.Generator | None"],
    banned: list[tuple[int, ...]],
) -> list[int]:
    """Pick one token per row of logits (rows, vocab).

    banned[i]: token ids that row i may not produce yet (EOS and stop ids before min_tokens).
    A row with its own generator (a request with a seed) draws from it alone, so its tokens
    do not depend on what else shares the batch.

    The sampled rows are one batch of tensor operations, and each draw takes one uniform number
    (inverse CDF: a cumulative sum and a binary search): a loop over rows with a multinomial
    draw each, which generates a random number per vocabulary entry on a CPU, cost milliseconds
    a row and made a decode step of many sampled requests dearer than the forward pass the
    profile times. A seeded row takes its uniform from its own generator.
    """
    import torch

    for i, ids in enumerate(banned):
        if ids:
            logits[i, list(ids)] = float("-inf")
    out = logits.argmax(dim=-1)
    hot = [i for i, p in enumerate(params) if not p.greedy]
    if not hot:
        return out.tolist()
    rows = logits[hot] if len(hot) < len(params) else logits
    temps = torch.tensor([params[i].temperature for i in hot], dtype=rows.dtype, device=rows.device)
    rows = rows / temps[:, None]
    ks = [params[i].top_k if 0 < params[i].top_k < rows.shape[-1] else 0 for i in hot]
    if any(ks):  # keep each row's k largest (a row without a limit keeps them all)
        k = torch.tensor(ks, device=rows.device)
        kth = torch.topk(rows, max(ks), dim=-1).values
        cut = kth.gather(-1, (k - 1).clamp(min=0)[:, None]).masked_fill((k == 0)[:, None], float("-inf"))
        rows = rows.masked_fill(rows < cut, float("-inf"))
    probs = torch.softmax(rows, dim=-1)
    tops = torch.tensor([params[i].top_p for i in hot], dtype=probs.dtype, device=probs.device)
    if bool((tops < 1.0).any()):  # nucleus: the smallest prefix of the sorted row reaching top_p
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        drop = torch.cumsum(sorted_p, dim=-1) - sorted_p >= tops[:, None]  # always keeps the top token
        probs = probs.scatter(-1, idx, sorted_p.masked_fill(drop, 0.0))
    u = torch.empty(len(hot), 1, dtype=probs.dtype, device=probs.device)
    seeded = [j for j, i in enumerate(hot) if generators[i] is not None]
    if len(seeded) < len(hot):
        u.uniform_()
    for j in seeded:
        u[j].uniform_(generator=generators[hot[j]])
    cdf = probs.cumsum(dim=-1)
    # inverse CDF: the first token whose cumulative mass reaches (1 - u) of the row's, u in [0, 1),
    # so the target is above 0 and a token of zero mass (banned, cut) is never the first to reach it
    picked = torch.searchsorted(cdf, (1.0 - u) * cdf[:, -1:]).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
    out[hot] = picked
    return out.tolist()
