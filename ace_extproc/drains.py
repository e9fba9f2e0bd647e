"""Operator drains that outlive the process (``router.drain_file``).

A drain is an operator's decision (``ace-extproc ctl drain``): a restart of
ace-extproc, or a crash and its restart by the supervisor, must not undo it. The
drained pods' keys are kept in a small JSON file, rewritten whole on each change
(written aside, then renamed over, so a crash leaves the old or the new one). At
start the drains it names are applied, those of pods not in the fleet yet (found
later by discovery) as they join.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

from ace_extproc.routing.fleet import ADDED, FleetState

log = logging.getLogger("ace_extproc.drains")


class DrainFile:
    def __init__(self, path: str, fleet: FleetState) -> None:
        self.path = Path(path) if path else None
        self.fleet = fleet
        self._waiting: set[str] = set()  # drained pods not in the fleet (yet)
        fleet.on_change.append(self._joined)

    def load(self) -> None:
        """Apply the drains the file names. A missing file is no drains; an unreadable
        one is said, and ignored: drains are an operator's, not the data path's."""
        if self.path is None or not self.path.exists():
            return
        try:
            keys = json.loads(self.path.read_text())["drained"]
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise ValueError("'drained' is not a list of pod keys")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("drains: cannot read %s (%s); starting with none", self.path, exc)
            return
        for key in keys:
            slot = self.fleet.slot_of(key)
            if slot is None:
                self._waiting.add(key)
            else:
                self.fleet.drain(slot)
        if keys:
            log.info("drains: %s still drained (%s)", ", ".join(keys), self.path)

    async def save(self) -> None:
        """Write the drains as they are now, off the event loop."""
        if self.path is None:
            return
        fleet = self.fleet
        keys = sorted({fleet.pods[s].key for s in range(len(fleet.pods)) if fleet.is_drained(s)})
        keys = sorted({*keys, *self._waiting})
        try:
            await asyncio.to_thread(_write, self.path, json.dumps({"drained": keys}) + "\n")
        except OSError as exc:
            log.warning("drains: cannot write %s (%s): a restart will forget them", self.path, exc)

    def _joined(self, slot: int, change: str) -> None:
        if change == ADDED:
            key = self.fleet.pods[slot].key
            if key in self._waiting:
                self._waiting.discard(key)
                self.fleet.drain(slot)


def _write(path: Path, text: str) -> None:
    aside = path.with_name(path.name + ".tmp")
    aside.write_text(text)
    os.replace(aside, path)
