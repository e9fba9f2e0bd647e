"""Where this process sent each recent prefix, for the admin API's ``LookupPrefix``.

The index cannot answer that: it knows block hashes, and a prefix key is a hash of
them, not a way back. So the processor notes each pick here (``note``, well under a
microsecond). No gRPC here: the request path imports this, the admin API reads it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any


class PrefixPlacements:
    """Where this process sent each recent prefix: ``prefix_key`` -> the pods picked
    for it, for ``LookupPrefix``. The index cannot answer that (it knows block hashes,
    and a prefix key is a hash of them, not a way back), so whoever picks notes each
    pick here. A bounded LRU of the last ``capacity`` prefixes (about 300 bytes each);
    ``note`` runs on the request path and costs well under a microsecond.
    """

    __slots__ = ("_entries", "capacity")

    def __init__(self, capacity: int = 16384) -> None:
        self.capacity = max(1, capacity)
        # prefix_key -> [slots bitmask, picks, last slot, last pick (monotonic)]. An
        # OrderedDict: evicting from the front of a plain dict slows down as deleted
        # entries pile up there.
        self._entries: OrderedDict[str, list[Any]] = OrderedDict()

    def note(self, prefix_key: str, slot: int) -> None:
        """A pod was picked for this prefix."""
        entries = self._entries
        entry = entries.get(prefix_key)
        if entry is None:
            if len(entries) >= self.capacity:
                entries.popitem(last=False)  # the least recently picked
            entries[prefix_key] = [1 << slot, 1, slot, time.monotonic()]
            return
        entries.move_to_end(prefix_key)
        entry[0] |= 1 << slot
        entry[1] += 1
        entry[2] = slot
        entry[3] = time.monotonic()

    def forget_slot(self, slot: int) -> None:
        """The slot's pod is gone and another takes the slot: placements there are
        no longer anywhere (an entry left with none is dropped)."""
        bit = 1 << slot
        for key, entry in list(self._entries.items()):
            if entry[0] & bit:
                entry[0] &= ~bit
                if not entry[0]:
                    del self._entries[key]
                elif entry[2] == slot:
                    entry[2] = -1

    def get(self, prefix_key: str) -> tuple[int, int, int, float] | None:
        """``(slots bitmask, picks, last slot, seconds since the last pick)``, or None."""
        entry = self._entries.get(prefix_key.lower())
        if entry is None:
            return None
        mask, picks, last, at = entry
        return mask, picks, last, max(0.0, time.monotonic() - at)

    def __len__(self) -> int:
        return len(self._entries)
