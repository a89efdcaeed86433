"""Instances kept in score order, so a global policy finds its least-loaded instance in
O(log n) instead of reading every instance's snapshot on every arrival.

A `RankedInstances` holds a set of instances ordered by (score of the instance's snapshot,
instance id): exactly the order `min(ids, key=lambda i: (score(snapshot(i)), i))` uses, so
asking it gives the same answer as the scan it replaces. It is kept up to date lazily: the
executor `touch`es an instance whenever its local scheduler changes (a request queued, a step
planned or applied, a KV transfer landed), and the next query re-scores only the instances
touched since. This is exact for scores that change only when the scheduler does (request
counts, queued prompt work). Scores that also grow with the passage of time inside a
multi-step decode run (running tokens) use `least_growing`, which re-reads members in the
order of their last keys (lower bounds) until no later one can win; scores that may shrink
with time alone (free KV) must keep scanning.

Executors that cannot say when an instance changes (a remote Ray actor) offer no index; a
policy then falls back to the scan (`least`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from sortedcontainers import SortedList

from flowyard.policies.framework.contracts import InstanceSnapshot

Score = Callable[[InstanceSnapshot], Any]
# Below this many candidates a scan of cached snapshots is cheaper than keeping an index up to
# date on every change (the answer is the same either way).
INDEX_MIN = 32


class RankedInstances:
    """A set of instances ordered by (score(snapshot), id), re-scored lazily on touch."""

    __slots__ = ("score", "snapshot", "_key", "_order", "_pending")

    def __init__(self, score: Score, snapshot: Callable[[int], InstanceSnapshot], ids: Iterable[int] = ()) -> None:
        self.score, self.snapshot = score, snapshot
        self._key: dict[int, tuple] = {}  # member -> its current key in _order (absent: unscored)
        self._order: SortedList = SortedList()
        self._pending: set[int] = set()
        for i in ids:
            self.add(i)

    def __contains__(self, i: int) -> bool:
        return i in self._key or i in self._pending

    def __len__(self) -> int:
        self._refresh()
        return len(self._order)

    def touch(self, i: int) -> None:
        """Instance i changed: re-score it before the next answer (if it is a member)."""
        if i in self._key:
            self._pending.add(i)

    def add(self, i: int) -> None:
        if i not in self._key:
            self._key[i] = ()
            self._pending.add(i)

    def discard(self, i: int) -> None:
        key = self._key.pop(i, None)
        if key is None:
            return
        self._pending.discard(i)
        if key:
            self._order.remove(key)

    def set_members(self, ids: Iterable[int]) -> None:
        """Make the members exactly `ids` (adding and dropping the difference)."""
        new = set(ids)
        for i in [i for i in self._key if i not in new]:
            self.discard(i)
        for i in new:
            self.add(i)

    def _refresh(self) -> None:
        pending = self._pending
        if not pending:
            return
        order, keys, score, snapshot = self._order, self._key, self.score, self.snapshot
        for i in sorted(pending):  # in id order: snapshots commit decode runs as a scan would
            old = keys[i]
            if old:
                order.remove(old)
            key = (score(snapshot(i)), i)
            keys[i] = key
            order.add(key)
        pending.clear()

    def least(self) -> int | None:
        """The member with the lowest (score, id), or None if there are none."""
        self._refresh()
        return self._order[0][1] if self._order else None

    def least_key(self) -> tuple | None:
        """(score, id) of the least member, or None."""
        self._refresh()
        return self._order[0] if self._order else None

    def ordered(self) -> SortedList:
        """All members' ((score, id)) keys in order, up to date as of now; read-only (members
        touched later, e.g. by reading their snapshots, are re-keyed at the next query)."""
        self._refresh()
        return self._order

    def least_growing(self) -> tuple | None:
        """(score, id) of the least member now, for a score that may grow between touches
        but never shrinks (running tokens during a multi-step decode run): the kept keys are
        lower bounds, so members are re-read in their order until the best current key is
        below the next kept one; no member after that can beat it. Same answer as a scan."""
        self._refresh()
        best = None
        score, snapshot = self.score, self.snapshot
        for key in self._order:
            if best is not None and best < key:
                break
            now = (score(snapshot(key[1])), key[1])
            if best is None or now < best:
                best = now
        return best


class Touched:
    """The indexes of one executor, told of every instance change (the executor's side)."""

    def __init__(self, snapshot: Callable[[int], InstanceSnapshot]) -> None:
        self.snapshot = snapshot
        self.indexes: dict[str, RankedInstances] = {}

    def ranked(self, name: str, score: Score, ids: Callable[[], Iterable[int]] = tuple) -> RankedInstances:
        """The index called `name` (created with members `ids()` on first use; a policy keeps
        the membership of a dynamic one with add/discard/set_members)."""
        idx = self.indexes.get(name)
        if idx is None:
            idx = self.indexes[name] = RankedInstances(score, self.snapshot, ids())
        return idx

    def touch(self, i: int) -> None:
        for idx in self.indexes.values():
            idx.touch(i)


def least(view, name: str, score: Score, ids: Callable[[], Iterable[int]]) -> int | None:
    """The instance of `ids()` with the lowest (score, id): from the executor's index when it
    keeps one (`view.ranked`), else by reading every snapshot. ids() must be the same set every
    time a given name is asked for (use `RankedInstances` directly for dynamic sets)."""
    ranked = getattr(view, "ranked", None)
    memo: dict[str, list[int]] | None = getattr(view, "least_members", None) if ranked is not None else None
    members = memo.get(name) if memo is not None else None
    if members is None:  # a fixed set per name with an index: listed once, not per arrival
        members = list(ids())
        if memo is not None:
            memo[name] = members
    if ranked is not None and len(members) >= INDEX_MIN:
        return ranked(name, score, lambda: members).least()
    ids = members
    return min(ids, key=lambda i: (score(view.snapshot(i)), i)) if ids else None
