"""Bundled traces by name (`--trace azure-conv`) or any file by path.

The bundled files are gzip copies of ../shared/traces (see data/traces/ATTRIBUTION.md), shipped
as package data and located with importlib.resources, so `flowyard simulate --trace NAME`
works from an installed wheel with no network and no checkout.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from flowyard.workloads.loaders import load_file
from flowyard.workloads.workload import Workload

# name → (file under flowyard/data/traces, one-line description)
_BUNDLED: dict[str, tuple[str, str]] = {
    "azure-code": ("azure_llm_2023_code.csv.gz", "Azure LLM inference 2023, code: 8,819 req, 1 h, prompt-heavy"),
    "azure-conv": ("azure_llm_2023_conv.csv.gz", "Azure LLM inference 2023, conversation: 19,366 req, 1 h"),
    "burstgpt": ("burstgpt_v3_head400.csv.gz", "BurstGPT v3, first 400 rows: sessions, ChatGPT/GPT-4 tasks"),
    "burstgpt-v1": ("burstgpt_v1_head400.csv.gz", "BurstGPT v1, first 400 rows: ChatGPT/GPT-4 tasks"),
    "mooncake-conv": ("mooncake_conversation_trace.jsonl.gz", "Mooncake conversation: 12,031 req, 1 h, prefix hashes"),
    "sharegpt": ("sharegpt_8k_lengths_llama2.csv.gz", "ShareGPT lengths (Llama-2 tokens): 30,731 req, synthetic arrivals"),
    "arxiv": ("arxiv_summarization_lengths_llama2.csv.gz", "arXiv summarization lengths: 28,257 req, synthetic arrivals"),
    "azure-code-vidur": ("vidur_splitwise_code.csv.gz", "Azure 2023 code as Vidur splitwise CSV (relative seconds)"),
    "azure-conv-vidur": ("vidur_splitwise_conv.csv.gz", "Azure 2023 conv as Vidur splitwise CSV (relative seconds)"),
}

#: Valid bundled trace names (lower case; lookup is case-insensitive).
TRACE_NAMES: tuple[str, ...] = tuple(_BUNDLED)


class UnknownTraceError(ValueError):
    """Neither a bundled trace name nor an existing file; the message lists valid names."""


def describe_traces() -> dict[str, str]:
    """Bundled name → one-line description (for `--help` and error messages)."""
    return {k: d for k, (_, d) in _BUNDLED.items()}


def trace_file(name: str) -> Path:
    """Filesystem path of a bundled trace (package data)."""
    key = name.strip().lower()
    if key not in _BUNDLED:
        raise UnknownTraceError(_unknown_msg(name))
    res = resources.files("flowyard") / "data" / "traces" / _BUNDLED[key][0]
    return Path(str(res))


def _unknown_msg(name: str) -> str:
    return (
        f"unknown trace {name!r}: not a bundled trace name and not an existing file; "
        f"bundled traces: {', '.join(TRACE_NAMES)}"
    )


def load_trace(
    name_or_path: str | Path,
    *,
    rate: float | None = None,
    arrival: str = "poisson",
    cv: float = 1.0,
    seed: int | None = 0,
    num_requests: int | None = None,
) -> Workload:
    """Load a bundled trace by name (case-insensitive) or a trace file by path.

    A bundled name wins over a same-named file in the working directory. For length-only
    traces (sharegpt, arxiv) the arrivals are synthetic: `arrival` ("poisson" | "gamma" with
    `cv`) at `rate` req/s (arrivals.DEFAULT_RATE if None) with `seed`, and `num_requests`
    caps how many are generated. Timed traces keep their real arrivals (rescaled to mean
    `rate` when one is given) and `num_requests` keeps the first N.
    """
    key = str(name_or_path).strip().lower()
    kw = dict(rate=rate, arrival=arrival, cv=cv, seed=seed, num_requests=num_requests)
    if key in _BUNDLED:
        ref = resources.files("flowyard") / "data" / "traces" / _BUNDLED[key][0]
        with resources.as_file(ref) as path:
            return load_file(path, name=key, **kw)  # type: ignore[arg-type]
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return load_file(path, **kw)  # type: ignore[arg-type]
    raise UnknownTraceError(_unknown_msg(str(name_or_path)))


__all__ = ["TRACE_NAMES", "UnknownTraceError", "describe_traces", "trace_file", "load_trace"]
