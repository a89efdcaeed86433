"""Session affinity (PLA-Serve §3.3), one part for every router that uses it (`pla.router`,
`flowyard.router`): remember where each session's last turn went, and send a later turn back
there unless that home is clearly worse than the router's own pick, since the home holds the
turn's history in its prefix cache and elsewhere the history is prefilled again."""

from __future__ import annotations

from collections import OrderedDict


class SessionHomes:
    """Each session's home: the instance its last turn went to and the prompt tokens that turn
    left there, least recently used forgotten past `capacity`; counts the later turns sent
    home and away."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._homes: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self.sent_home = self.sent_away = 0

    def __len__(self) -> int:
        return len(self._homes)

    def home(self, session: str) -> tuple[int, int] | None:
        """(instance, prompt tokens held there) of `session`'s last turn, or None."""
        return self._homes.get(session)

    def remember(self, session: str, instance: int, prompt_len: int) -> None:
        """`session`'s turn of `prompt_len` tokens went to `instance`: its new home."""
        self._homes[session] = (instance, prompt_len)
        self._homes.move_to_end(session)
        if len(self._homes) > self.capacity:
            self._homes.popitem(last=False)

    def choose(self, home: int, elsewhere: int, t_home: float, t_elsewhere: float, tolerance: float) -> int:
        """Home unless its predicted time to first token exceeds elsewhere's by more than
        `tolerance` seconds; counts the choice."""
        if t_home > t_elsewhere + tolerance:
            self.sent_away += 1  # clearly worse: recompute the history elsewhere
            return elsewhere
        self.sent_home += 1
        return home

    def away(self) -> None:
        """Count a later turn sent away without a comparison (home unusable for it)."""
        self.sent_away += 1

    def stayed(self) -> None:
        """Count a later turn whose home is also the router's own pick."""
        self.sent_home += 1


def cached_prefix(history: int, prompt_len: int, block_size: int) -> int:
    """Tokens of a turn's history a home can serve from its prefix cache: whole blocks, and
    never the prompt's last token (it is computed to sample the first output)."""
    return min(history, prompt_len - 1) // block_size * block_size
