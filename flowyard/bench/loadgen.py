"""Prompts and request bodies of given token lengths, without the server's tokenizer.

A trace gives only token counts. The benchmark must hit any server, and loading that
server's tokenizer (which may not even exist on the client machine) is what `vllm bench`
needs and we avoid: prompts are made of common English words that are one token in the BPE
vocabularies of the served families (Llama, Qwen, SmolLM, GPT), and a two-probe calibration
against the server's own `usage.prompt_tokens` fits tokens = overhead + slope * words, which
absorbs the chat template's fixed tokens and any word that splits in two. The server-reported
counts are what the report uses, so a residual mismatch never leaks into the metrics.

Output length is forced with `max_tokens` = the trace's length plus `ignore_eos` and
`min_tokens` (vLLM and SGLang extensions), so a model that would stop early still produces
the trace's decode load.

Words are drawn per request from a seeded generator, so prompts differ (no accidental prefix
cache hits) yet are the same on every run. Requests that carry Mooncake-style prefix block
hashes get the same words for the same hash, so shared prefixes stay shared on the server.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import httpx
import numpy as np

from flowyard.bench.client import BenchError, api_root, stream_request
from flowyard.core.request import Request
from flowyard.workloads import Workload

WORDS: tuple[str, ...] = tuple("""
the of and to in is that for it as was with be by on not he this are or his from at which but
have an had they you were their one all we can her has there been if more when will would who
so no time day water house world people year way man good new first last long great little own
other old right big high small large next early young few public bad same able city school
light night road river tree green blue red black white book door room table window garden
music money paper story song game team food market field power point place hand head word home
""".split())

PROBE_WORDS = (16, 272)  # two probe sizes: a short one for the offset, a long one for the slope


@dataclass(frozen=True, slots=True)
class PromptBuilder:
    """Maps a target token count to a word count: words = (tokens - overhead) / slope.

    overhead: tokens the server adds around the text (chat template, BOS); slope: tokens
    per word. The uncalibrated default (0, 1) is exact for servers that count whitespace
    words and close for BPE models on this word list."""

    overhead: float = 0.0
    slope: float = 1.0
    seed: int = 0

    def words_for(self, tokens: int) -> int:
        return max(1, int(round((tokens - self.overhead) / self.slope)))

    def _draw(self, key: list[int], n: int) -> list[str]:
        rng = np.random.default_rng(key)
        return [WORDS[i] for i in rng.integers(0, len(WORDS), n)]

    def prompt(self, req: Request) -> str:
        """Text whose server-side length is close to req.prompt_len."""
        n = self.words_for(req.prompt_len)
        if not (req.block_hashes and req.hash_block_size):
            return " ".join(self._draw([self.seed, req.id], n))
        words: list[str] = []
        per_block = max(1, int(round(req.hash_block_size / self.slope)))
        for h in req.block_hashes:  # same hash → same words → shared server-side prefix
            if len(words) >= n:
                break
            words += self._draw([self.seed, 1, h & 0xFFFFFFFF], min(per_block, n - len(words)))
        if len(words) < n:
            words += self._draw([self.seed, req.id], n - len(words))
        return " ".join(words)


def request_body(endpoint: str, model: str, prompt: str, max_tokens: int, *,
                 ignore_eos: bool = True) -> dict[str, Any]:
    """OpenAI streaming body for "chat" or "completions" that asks for exactly max_tokens.

    `max_tokens` (not `max_completion_tokens`) because every OpenAI-compatible server accepts
    it; `include_usage` makes the server report its own token counts."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    elif endpoint == "completions":
        body["prompt"] = prompt
    else:
        raise ValueError(f"unknown endpoint {endpoint!r}; expected 'chat' or 'completions'")
    if ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = max_tokens
    return body


def endpoint_url(base_url: str, endpoint: str) -> str:
    """Full URL of the chat or completions route under `base_url`."""
    return api_root(base_url) + ("/chat/completions" if endpoint == "chat" else "/completions")


async def calibrate(client: httpx.AsyncClient, base_url: str, endpoint: str, model: str, *,
                    headers: dict[str, str] | None = None, timeout: float = 60.0,
                    seed: int = 0, ignore_eos: bool = True) -> PromptBuilder:
    """Fit overhead and slope from two one-token requests, reading usage.prompt_tokens.

    Doubles as vLLM's "initial test run": if the probe fails, the benchmark would fail for
    every request, so BenchError says why instead. A server that reports no usage keeps the
    uncalibrated mapping."""
    base = PromptBuilder(seed=seed)
    url = endpoint_url(base_url, endpoint)
    counts: list[int] = []
    for i, n in enumerate(PROBE_WORDS):
        text = " ".join(base._draw([seed, 2, i], n))
        out = await stream_request(client, url, request_body(endpoint, model, text, 1, ignore_eos=ignore_eos),
                                   headers=headers, timeout=timeout)
        if out.error:
            raise BenchError(f"initial test request to {url} failed: {out.error}")
        if out.prompt_tokens is None:
            return base
        counts.append(out.prompt_tokens)
    slope = (counts[1] - counts[0]) / (PROBE_WORDS[1] - PROBE_WORDS[0])
    slope = float(np.clip(slope, 0.5, 4.0))  # guard against a server that counts oddly
    overhead = max(0.0, counts[0] - slope * PROBE_WORDS[0])
    return PromptBuilder(overhead=overhead, slope=slope, seed=seed)


def cap_lengths(w: Workload, max_input_len: int | None = None,
                max_output_len: int | None = None) -> Workload:
    """Clamp prompt and output lengths (`--max-input-len/--max-output-len`) so a trace made
    for a big model fits a small local one; arrivals and order are unchanged."""
    for name, v in (("max_input_len", max_input_len), ("max_output_len", max_output_len)):
        if v is not None and v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if max_input_len is None and max_output_len is None:
        return w
    out = []
    for r in w.requests:
        p = r.prompt_len if max_input_len is None else min(r.prompt_len, max_input_len)
        o = r.target_output if max_output_len is None else min(r.target_output, max_output_len)
        hist = min(r.history_len, p)
        out.append(replace(r, prompt_len=p, output_len=o, max_tokens=None, history_len=hist))
    return w.derive(out, normalize_order=False)


__all__ = ["PROBE_WORDS", "PromptBuilder", "WORDS", "calibrate", "cap_lengths", "endpoint_url",
           "request_body"]
