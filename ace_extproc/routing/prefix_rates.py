"""How often each prefix is asked for: requests a second, decayed exponentially.

A hot prefix's pod queues behind its own popularity; warming another pod for it costs
one cold prefill, which the requests that follow share (``pipeline.PrefillCost``). The
rate says how many follow. Bounded: the prefixes least recently asked for go first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

# The rate's memory: a prefix not asked for in a few of these counts as cold again.
TIME_CONSTANT_S = 1.0


class PrefixRates:
    def __init__(
        self,
        remembered: int = 16_384,
        time_constant_s: float = TIME_CONSTANT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self._tau = time_constant_s
        self._remembered = remembered
        # prefix key -> (decayed count, when it was last decayed)
        self._counts: dict[int, tuple[float, float]] = {}

    def seen(self, key: int) -> float:
        """Count a request for ``key``; the requests a second asked for it before this
        one."""
        now = self.clock()
        counts = self._counts
        count, at = counts.pop(key, (0.0, now))
        if now > at:
            count *= math.exp((at - now) / self._tau)
        counts[key] = (count + 1.0, now)
        if len(counts) > self._remembered:
            del counts[next(iter(counts))]
        return count / self._tau
