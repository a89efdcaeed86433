"""The `Workload` container and the error every loader raises.

A workload is a plain, sorted list of immutable `Request`s plus where it came from. It is
deliberately not a lazy or columnar object: the simulator walks the list once, and every
transform builds a new list, so the same workload can be replayed through several policies
without anyone mutating it.

Invariants (kept by `normalize`, relied on by the simulator and the transforms):
requests are sorted by arrival, ids are 0..n-1 in that order, and the first arrival is 0.0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Iterator

import numpy as np

from flowyard.core.request import Request


class WorkloadError(ValueError):
    """A trace file that cannot be read: the message names the file, the 1-based line and why.

    `path`, `line` and `reason` are kept as attributes so callers (the CLI) can format them.
    """

    def __init__(self, path: str, line: int | None, reason: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        where = f"{self.path}: line {line}" if line is not None else self.path
        super().__init__(f"{where}: {reason}")


@dataclass(slots=True)
class Workload:
    """A replayable list of requests.

    name: short label for reports (catalog name or file stem).
    requests: sorted by arrival, ids 0..n-1, first arrival 0.0 (see module docstring).
    source: the file it was read from ("" for synthetic workloads).
    dropped: rows of the source that were skipped (failed or empty requests), for reports.
    format: the detected file format ("azure", "burstgpt", ...), "" when synthetic.
    """

    name: str
    requests: list[Request]
    source: str = ""
    dropped: int = 0
    format: str = ""

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    @property
    def duration(self) -> float:
        """Seconds from the first to the last arrival (0.0 for fewer than two requests)."""
        return self.requests[-1].arrival if self.requests else 0.0

    @property
    def rate(self) -> float:
        """Mean arrival rate in req/s, (n - 1) / duration; 0.0 when it is undefined."""
        d = self.duration
        return (len(self.requests) - 1) / d if d > 0 else 0.0

    def arrivals(self) -> np.ndarray:
        return np.fromiter((r.arrival for r in self.requests), float, len(self.requests))

    def prompt_lens(self) -> np.ndarray:
        return np.fromiter((r.prompt_len for r in self.requests), np.int64, len(self.requests))

    def output_lens(self) -> np.ndarray:
        """Output lengths (target_output: trace length capped by max_tokens)."""
        return np.fromiter((r.target_output for r in self.requests), np.int64, len(self.requests))

    def summary(self) -> dict[str, float | int | str]:
        """Headline numbers for logs and reports."""
        n = len(self.requests)
        p, o = self.prompt_lens(), self.output_lens()
        return {
            "name": self.name,
            "requests": n,
            "dropped": self.dropped,
            "duration_s": self.duration,
            "rate_rps": self.rate,
            "prompt_mean": float(p.mean()) if n else 0.0,
            "prompt_p99": float(np.percentile(p, 99)) if n else 0.0,
            "output_mean": float(o.mean()) if n else 0.0,
            "output_p99": float(np.percentile(o, 99)) if n else 0.0,
        }

    def derive(self, requests: Iterable[Request], *, normalize_order: bool = True) -> Workload:
        """A new workload with the same labels and `requests`, re-normalised."""
        reqs = normalize(list(requests)) if normalize_order else list(requests)
        return Workload(self.name, reqs, self.source, self.dropped, self.format)


def normalize(requests: list[Request]) -> list[Request]:
    """Sort by arrival (stable), rebase the first arrival to 0.0 and renumber ids 0..n-1.

    Requests that already satisfy the invariant are reused, not copied, so normalising an
    already normal list costs one pass.
    """
    if not requests:
        return []
    reqs = requests
    if any(a.arrival > b.arrival for a, b in zip(reqs, reqs[1:])):
        reqs = sorted(reqs, key=lambda r: r.arrival)  # sorted() is stable
    t0 = reqs[0].arrival
    out: list[Request] = []
    for i, r in enumerate(reqs):
        a = r.arrival - t0
        if r.id != i or a != r.arrival:
            r = replace(r, id=i, arrival=a)
        out.append(r)
    return out


def build_requests(
    arrivals: np.ndarray | list[float],
    prompt: list[int],
    output: list[int],
    *,
    task: list[str | None] | None = None,
    session: list[str | None] | None = None,
    block_hashes: list[tuple[int, ...]] | None = None,
    hash_block_size: int = 0,
) -> list[Request]:
    """Column lists → normalised requests.

    Sessions get `turn` numbered 0, 1, ... per session in arrival order (after sorting),
    which is how BurstGPT's session ids become chained turns.
    """
    t = np.asarray(arrivals, dtype=float)
    n = len(t)
    order = np.argsort(t, kind="stable") if n and np.any(np.diff(t) < 0) else range(n)
    t0 = float(t[order[0]]) if n else 0.0
    turns: dict[str, int] = {}
    out: list[Request] = []
    for i, j in enumerate(order):
        sess = session[j] if session is not None else None
        turn = 0
        if sess is not None:
            turn = turns.get(sess, 0)
            turns[sess] = turn + 1
        out.append(
            Request(
                id=i,
                arrival=float(t[j]) - t0,
                prompt_len=prompt[j],
                output_len=output[j],
                task=task[j] if task is not None else None,
                session=sess,
                turn=turn,
                block_hashes=block_hashes[j] if block_hashes is not None else (),
                hash_block_size=hash_block_size if block_hashes is not None else 0,
            )
        )
    return out


__all__ = ["Workload", "WorkloadError", "normalize", "build_requests"]
