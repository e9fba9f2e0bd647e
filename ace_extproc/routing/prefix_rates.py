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
        # prefix key -> (decayed count, when it was last decayed, when first asked for)
        self._counts: dict[int, tuple[float, float, float]] = {}

    def seen(self, key: int) -> float:
        """Count a request for ``key``; the requests a second asked for it before this
        one. Over the time it has been asked for, up to the time constant: a prefix that
        turns hot is hot from its first few requests, not a time constant later."""
        now = self.clock()
        counts, tau = self._counts, self._tau
        count, at, first = counts.pop(key, (0.0, now, now))
        if now > at:
            count *= math.exp((at - now) / tau)
        counts[key] = (count + 1.0, now, first)
        if len(counts) > self._remembered:
            del counts[next(iter(counts))]
        # A steady rate r seen for ``age`` seconds leaves a decayed count of
        # r * tau * (1 - exp(-age / tau)).
        window = tau * -math.expm1((first - now) / tau)
        return count / window if window > 0 else 0.0
