"""One pool model for every global policy: which pool each instance belongs to now.

An instance's role (PREFILL, DECODE, MIXED) is fixed when the cluster starts; a pool is what
the global policy uses it for and may change while it runs (a flip). Arrow's four elastic pools
(P, D, P→D, D→P, `arrow.pools`) and PLA-Serve's short and long prefill pools (`pla.router`)
are both this model with their own labels and rules for moving, so a composed policy can put
Arrow's pools and PLA's length classes over the same instances and log every move the same way.

A move is a flip (the policy changed the instance's purpose: it starts the cool-down that
`since_flip` measures) or a settle (a transitional pool drained: bookkeeping only).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Hashable, Sequence


def label(pool: Hashable) -> str:
    """A pool's name in logs: an enum's value, else its str()."""
    return str(pool.value) if isinstance(pool, enum.Enum) else str(pool)


@dataclass
class Pools:
    """Pool membership of every instance and the history of moves (for tests and reports)."""

    of: dict[int, Hashable] = field(default_factory=dict)
    home: dict[int, Hashable] = field(default_factory=dict)  # pool in the initial split
    moves: list[tuple[float, int, Hashable, Hashable]] = field(default_factory=list)  # (t, inst, from, to)
    flipped_at: dict[int, float] = field(default_factory=dict)  # last flip (not settle) of each
    # sorted members of each asked-for combination of pools, until the next move: policies ask
    # on every arrival, and a sort of every instance each time grows with the cluster
    _members: dict[tuple, list[int]] = field(default_factory=dict, repr=False, compare=False)
    version: int = 0  # moves so far (flips and settles): indexes over pools follow it

    @classmethod
    def split(cls, ids: Sequence[int], sizes: Sequence[tuple[Hashable, int]]) -> "Pools":
        """The initial static split: the first instances (in `ids` order) to the first pool,
        up to its size, and so on; the last pool takes whatever is left."""
        of: dict[int, Hashable] = {}
        k = 0
        for n, (pool, size) in enumerate(sizes):
            take = len(ids) - k if n == len(sizes) - 1 else max(0, size)
            for i in ids[k:k + take]:
                of[i] = pool
            k += take
        return cls(of, dict(of))

    def members(self, *pools: Hashable) -> list[int]:
        return list(self._sorted(pools))

    def count(self, *pools: Hashable) -> int:
        return len(self._sorted(pools))

    def _sorted(self, pools: tuple) -> list[int]:
        cached = self._members.get(pools)
        if cached is None:
            cached = self._members[pools] = sorted(i for i, p in self.of.items() if p in pools)
        return cached

    def move(self, i: int, to: Hashable, now: float, flip: bool = True) -> Hashable:
        """Put instance i in pool `to` (recorded if it changes); a flip restarts its cool-down."""
        frm = self.of[i]
        if frm != to:
            if flip:
                self.flipped_at[i] = now
            self.of[i] = to
            self.moves.append((now, i, frm, to))
            self._members.clear()
            self.version += 1
        return to

    def since_flip(self, i: int, now: float) -> float:
        """Seconds since instance i was last flipped (inf if never); settling does not count."""
        t = self.flipped_at.get(i)
        return float("inf") if t is None else now - t

    def logged(self) -> list[tuple[float, int, str, str]]:
        """Every move as (time, instance, from, to) with pool names: executors log them."""
        return [(t, i, label(frm), label(to)) for t, i, frm, to in self.moves]
