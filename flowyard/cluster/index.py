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

A score may also say how to read itself straight off an instance's local scheduler: a callable
attribute `direct` (scheduler -> the same value score(snapshot) would give). An executor that
holds its schedulers in process (`Touched(..., scheduler=...)`) then re-scores a touched
instance without building its whole snapshot, which is most of a routing decision's cost when
many instances change between arrivals. Scores without it are read from snapshots.
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

    __slots__ = ("score", "snapshot", "read", "source", "_key", "_order", "_pending")

    def __init__(self, score: Score, snapshot: Callable[[int], InstanceSnapshot], ids: Iterable[int] = (),
                 read: Callable[[int], Any] | None = None, source: "Touched | None" = None) -> None:
        self.score, self.snapshot = score, snapshot
        self.source = source  # the executor's touches, pulled in before each answer
        # instance -> its current score (from the snapshot unless the executor reads it directly)
        self.read: Callable[[int], Any] = read if read is not None else lambda i: score(snapshot(i))
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

    def touch_all(self, ids: Iterable[int]) -> None:
        """Every instance of ids changed (members only are re-scored)."""
        keys, pending = self._key, self._pending
        for i in ids:
            if i in keys:
                pending.add(i)

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
        if self.source is not None:
            self.source.pull()
        pending = self._pending
        if not pending:
            return
        order, keys, read = self._order, self._key, self.read
        for i in sorted(pending):  # in id order: snapshots commit decode runs as a scan would
            old = keys[i]
            if old:
                order.remove(old)
            key = (read(i), i)
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
        read = self.read
        for key in self._order:
            if best is not None and best < key:
                break
            now = (read(key[1]), key[1])
            if best is None or now < best:
                best = now
        return best


class Touched:
    """The indexes of one executor, told of every instance change (the executor's side).

    A touch only notes the instance (an executor touches on every scheduler change, several
    times per event); the indexes take the noted ones in when one of them is next asked."""

    def __init__(self, snapshot: Callable[[int], InstanceSnapshot],
                 scheduler: Callable[[int], Any] | None = None) -> None:
        self.snapshot = snapshot
        # instance -> its local scheduler, brought up to date as snapshot() would (for `direct` scores)
        self.scheduler = scheduler
        self.indexes: dict[str, RankedInstances] = {}
        self.recent: set[int] = set()  # touched since the indexes last pulled

    def ranked(self, name: str, score: Score, ids: Callable[[], Iterable[int]] = tuple) -> RankedInstances:
        """The index called `name` (created with members `ids()` on first use; a policy keeps
        the membership of a dynamic one with add/discard/set_members)."""
        idx = self.indexes.get(name)
        if idx is None:
            direct, scheduler = getattr(score, "direct", None), self.scheduler
            read = None
            if direct is not None and scheduler is not None:
                def read(i: int) -> Any:
                    return direct(scheduler(i))
            self.pull()  # what was touched before this index existed is no news to it
            idx = self.indexes[name] = RankedInstances(score, self.snapshot, ids(), read, self)
        return idx

    def touch(self, i: int) -> None:
        self.recent.add(i)

    def pull(self) -> None:
        """Hand the instances touched since the last pull to every index."""
        recent = self.recent
        if recent:
            for idx in self.indexes.values():
                idx.touch_all(recent)
            recent.clear()


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
