"""How many CPU threads a step runs on, chosen from measured step times.

Each decode step runs ~150 small OpenMP regions, and every region ends at a barrier that
waits for all of torch's threads. With the cores to itself the engine is fastest on all of
them; when another process holds one of the cores, the thread that shares it is descheduled
for whole scheduler slices and every barrier waits for it. Measured on the 2-core VM with a
simulation holding one core: `bash scripts/demo.sh` at 2 threads gave a mean TPOT of 506 ms
and 0 % SLO attainment, pinned to 1 thread 110 ms and 100 %.

No static choice is right on both a quiet and a shared machine, so the engine measures. A
probe runs `pairs` pairs of back-to-back steps of about the same shape (`shape_key`), the
first at the current thread count and the second at a candidate (half it, or double it back
up to the maximum). It moves to the candidate only when the candidate's step was faster by
`margin` in every pair, so one noisy pair keeps the count. Only a pair's second step runs at
the candidate: when the shapes change every step (two instances stepped in turn by one
process), an earlier version that alternated which count went first ran 22 steps in a row
on one thread, prompts' steps at twice the time, and the two-instance benchmark's mean TPOT
went from 69 to 96 ms.

When to probe: at the first decode steps (a server may start on a busy machine), when a decode
step takes `surge` times what steps of its shape took at this count (another process arrived),
and otherwise after a period that starts at `period` and doubles, up to `max_period`, each
time a probe keeps the count. The doubling matters on a busy machine: there the candidate
(every thread) is the slow one, and a probe every 5 s at 4-5x the step time cost 24 % of the
throughput (demo TPOT 256 ms instead of 110).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable

log = logging.getLogger(__name__)


def _set_torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


@dataclass
class ThreadTuner:
    """The thread count of one process's steps: `begin(shape)` before a step, `end()` after."""

    max_threads: int
    period: float = 5.0  # seconds from a probe that moved the count to the next probe ...
    max_period: float = 80.0  # ... doubled after each probe that kept it, up to this
    pairs: int = 3  # paired steps a probe compares
    margin: float = 0.8  # the candidate wins when its step takes below margin x the current's in every pair
    surge: float = 3.0  # a step this many times its shape's usual time starts a probe
    patience: int = 24  # steps a probe waits for its pairs before it gives up
    set_threads: Callable[[int], None] = _set_torch_threads
    clock: Callable[[], float] = time.perf_counter
    current: int = field(init=False)
    switches: int = field(default=0, init=False)  # how often the count changed (stats, tests)
    _wait: float = field(init=False)  # the period in force
    _next_probe: float = field(init=False)
    _usual: dict[Hashable, float] = field(default_factory=dict, init=False)  # shape -> recent time at `current`
    _probe: list[float] | None = field(default=None, init=False)  # candidate/current ratios so far
    _steps: int = field(default=0, init=False)  # steps since the probe began
    _leg: tuple[Hashable, float] | None = field(default=None, init=False)  # a pair's first step (at `current`): key, s
    _step: tuple[Hashable, int, float] | None = field(default=None, init=False)  # the step in flight
    _applied: int = field(init=False)  # the count last set

    def __post_init__(self) -> None:
        if self.max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {self.max_threads}")
        self.current = self._applied = self.max_threads
        self._wait = self.period
        self._next_probe = -float("inf")

    @property
    def candidate(self) -> int:
        if self.current == self.max_threads:
            return max(1, self.max_threads // 2)
        return min(self.max_threads, 2 * self.current)

    def begin(self, key: Hashable | None) -> None:
        """Before a step of shape `key` (None: a step that neither probes nor is watched)."""
        now = self.clock()
        if self._probe is None and self.max_threads > 1 and now >= self._next_probe and key is not None:
            self._probe, self._steps, self._leg = [], 0, None
        n = self.current
        if key is not None and self._probe is not None and self._leg is not None and self._leg[0] == key:
            n = self.candidate  # the pair's second step; a first step always runs at the current count,
            # so a probe never runs more than `pairs` steps at the candidate, however the shapes come
        self._apply(n)
        self._step = (key, n, now)

    def end(self) -> None:
        """After the step `begin` announced: learn from its time."""
        if self._step is None:
            return
        key, n, start = self._step
        self._step = None
        if key is None:
            return
        took = self.clock() - start
        if self._probe is None:
            usual = self._usual.get(key)
            if usual is not None and took > self.surge * usual:
                self._next_probe = -float("inf")
            self._usual[key] = took if usual is None else 0.8 * usual + 0.2 * took
            return
        self._steps += 1
        if n != self.current:  # the second step of the pair `_leg` opened (see `begin`)
            first = self._leg[1]  # type: ignore[index]
            self._probe.append(took / first if first > 0 else 1.0)
            self._leg = None
        else:
            self._leg = (key, took)
        if len(self._probe) >= self.pairs or self._steps >= self.patience:
            self._decide()

    def _apply(self, n: int) -> None:
        if n != self._applied:
            self.set_threads(n)
            self._applied = n

    def _decide(self) -> None:
        ratios, self._probe, self._leg = self._probe or [], None, None
        if len(ratios) >= self.pairs and max(ratios) < self.margin:
            log.warning("engine threads %d -> %d: steps at %d took %s of those at %d", self.current, self.candidate,
                        self.candidate, "/".join(f"{r:.2f}" for r in ratios), self.current)
            self.current = self.candidate
            self.switches += 1
            self._usual.clear()
            self._wait = self.period
        else:
            self._wait = min(self.max_period, 2 * self._wait)
        self._apply(self.current)
        self._next_probe = self.clock() + self._wait


def shape_key(instance: int, prompt_tokens: int, decodes: int) -> tuple[int, int] | None:
    """Steps that pair in a probe: decode-only steps of one instance with decodes within a power
    of two (a batch that gains or loses a request between two steps still pairs). None for a
    step with prompt tokens: its time follows the prompt, and one run at fewer threads (twice
    the time on the 2-core VM) holds up every decode in its batch."""
    return None if prompt_tokens else (instance, decodes.bit_length())


_SHARED: ThreadTuner | None = None


def shared_tuner() -> ThreadTuner:
    """The process's tuner: torch's thread count is per process, so the engines that one
    process steps (an in-process cluster) share it; pairs are keyed by instance."""
    global _SHARED
    if _SHARED is None:
        import torch

        _SHARED = ThreadTuner(torch.get_num_threads())
    return _SHARED
