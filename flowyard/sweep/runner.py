"""Sweeps of independent simulations: serial, or fanned out over a Ray cluster in rounds.

Sweep code (a goodput search, a paper reproduction) asks for each result with
`sweep.value(key, fn, *args)`. Serially that just calls fn(*args). On Ray the first ask for a
result not yet known raises `Pending`; the sweep's body catches it where the work can go on
without that value (another policy's search, the next point of a grid) and carries on, so one
pass through the body collects every result it can ask for without knowing the missing ones.
`Sweep.run` then computes those in parallel and runs the body again, until a pass asks for
nothing new: that last pass took exactly the decisions a serial run takes, with the same
numbers, so the outcome is identical to the serial one.

Every result also goes to the optional `ResultCache` (revision + key), so a killed sweep
resumes: the rerun finds the finished simulations there.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from flowyard.sweep.cache import ResultCache

Progress = Callable[[int, int], None]  # (results computed, results asked for so far)
_MISS = object()


class Pending(Exception):
    """A result this pass asked for is being computed in parallel (see module docstring)."""


@dataclass
class Sweep:
    """How a sweep runs: `ray` (start a local Ray cluster of `workers` processes), or
    `ray_address` (join an existing cluster: "auto" or host:port); neither: serial."""

    ray: bool = False
    ray_address: str | None = None
    workers: int | None = None
    cache: ResultCache | None = None
    progress: Progress | None = None
    computed: int = 0  # simulations this sweep ran (not from the cache)
    rounds: int = 0
    _memo: dict = field(default_factory=dict, repr=False)
    _wanted: dict = field(default_factory=dict, repr=False)
    _asked: int = 0
    _started_ray: bool = False
    _incomplete: bool = False
    _refs: dict = field(default_factory=dict, repr=False)

    @property
    def parallel(self) -> bool:
        return self.ray or self.ray_address is not None

    def value(self, key: Any, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), known by `key` (a repr-stable tuple of everything the result depends on)."""
        key = repr(key)
        if key in self._memo:
            return self._memo[key]
        if self.cache is not None:
            v = self.cache.get(key, _MISS)
            if v is not _MISS:
                self._memo[key] = v
                return v
        if not self.parallel:
            v = fn(*args)
            self._store(key, v)
            return v
        if key not in self._wanted:
            self._wanted[key] = (fn, args)
            self._asked += 1
        raise Pending(key)

    def run(self, body: Callable[[], Any]) -> Any:
        """Run `body` until it asks for no result that is not known (module docstring). A pass
        that fails on a stand-in value (`attempt`) while results are pending is simply run
        again once they are known; a pass that fails with nothing pending raises."""
        try:
            while True:
                self._wanted, self._incomplete = {}, False
                self.rounds += 1
                try:
                    out = body()
                except Pending:
                    out, self._incomplete = None, True
                except Exception:
                    if not self._wanted:
                        raise
                    out = None
                if not self._wanted:
                    if self._incomplete:
                        raise RuntimeError("a sweep pass waited for a result nothing asked to compute")
                    return out
                self._compute(self._wanted)
        finally:
            self.close()

    def attempt(self, fn: Callable[[], Any], placeholder: Any) -> Any:
        """fn(), or `placeholder` while a result fn needs is pending (the pass goes on to other
        independent work; the stand-in is never part of the final pass)."""
        try:
            return fn()
        except Pending:
            self._incomplete = True
            return placeholder

    def blocked(self) -> None:
        """The caller cannot go on without a pending result (it holds a stand-in)."""
        self._incomplete = True
        raise Pending("blocked")

    def _store(self, key: Any, v: Any) -> None:
        self._memo[key] = v
        self.computed += 1
        if self.cache is not None:
            self.cache.put(key, v)
        if self.progress is not None:
            self.progress(self.computed, max(self._asked, self.computed))

    # -- Ray ----------------------------------------------------------------------------------
    def _compute(self, wanted: dict) -> None:
        from flowyard.optional import require

        ray = require("ray", "sweeps on Ray (--ray, --ray-address)")

        if not ray.is_initialized():
            if self.ray_address is not None:
                ray.init(address=self.ray_address, log_to_driver=False)
            else:
                ray.init(num_cpus=self.workers or os.cpu_count() or 1, include_dashboard=False,
                         log_to_driver=False)
            self._started_ray = True
        task = ray.remote(num_cpus=1)(_call)
        futures = {task.remote(fn, *[self._ref(a) for a in args]): key for key, (fn, args) in wanted.items()}
        try:
            while futures:
                done, _ = ray.wait(list(futures), num_returns=1)
                key = futures.pop(done[0])
                self._store(key, ray.get(done[0]))
        finally:  # the next pass builds its workloads anew: holding these would only leak them
            self._refs.clear()

    def _ref(self, arg: Any) -> Any:
        """Large arguments (workloads, cost models) go to the object store once per round."""
        from flowyard.workloads import Workload

        if not isinstance(arg, Workload):
            return arg
        import ray

        ref = self._refs.get(id(arg))
        if ref is None or ref[0] is not arg:
            ref = self._refs[id(arg)] = (arg, ray.put(arg))
        return ref[1]

    def close(self) -> None:
        self._refs.clear()
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


# the last few workloads hashed, by identity: a sweep asks for the same workload's digest once
# per point, and a whole reproduction builds thousands of workloads (a pass of a Ray sweep
# builds them again), so the memo must not keep them all alive
_digests: OrderedDict[int, tuple[object, str]] = OrderedDict()
DIGEST_MEMO = 64


def digest(workload) -> str:
    """A content hash of a workload's requests (cache keys name workloads by what they hold)."""
    hit = _digests.get(id(workload))
    if hit is not None and hit[0] is workload:
        _digests.move_to_end(id(workload))
        return hit[1]
    h = hashlib.sha256(workload.name.encode())
    for r in workload.requests:
        h.update(repr(r).encode())
    d = h.hexdigest()
    _digests[id(workload)] = (workload, d)
    while len(_digests) > DIGEST_MEMO:
        _digests.popitem(last=False)
    return d


_current = Sweep()


def current() -> Sweep:
    """The sweep the running command set up (serial without a cache by default)."""
    return _current


def use(sweep: Sweep | None) -> Sweep:
    """Make `sweep` the current one (None: a plain serial one); returns the previous."""
    global _current
    prev, _current = _current, (sweep if sweep is not None else Sweep())
    return prev
