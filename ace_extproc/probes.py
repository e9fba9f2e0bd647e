"""What the kubelet asks a running ace-extproc, on the metrics port: is it alive
(``/healthz``: its event loop still turns) and ready (``/readyz``: serving, and
alive). The ext_proc port itself stays closed to the cluster (a Unix socket in the
pod, or loopback), so the probes cannot be gRPC health checks on it.

The answers come from the metrics server's thread, so a wedged event loop cannot
hold them up; that is why liveness is a heartbeat the loop writes, not a question
put to the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

# The loop beats this often; a beat this old means it is stuck (GC pauses are ms).
BEAT_S = 1.0
STALE_S = 10.0

StartResponse = Callable[..., Any]
App = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


class Probes:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.serving = False  # set once ext_proc serves; cleared as it stops
        self.last_beat = clock()

    async def beat(self) -> None:
        """Until cancelled: the event loop's heartbeat."""
        while True:
            self.last_beat = self._clock()
            await asyncio.sleep(BEAT_S)

    def alive(self) -> bool:
        return self._clock() - self.last_beat < STALE_S

    def ready(self) -> bool:
        return self.serving and self.alive()

    def wrap(self, app: App) -> App:
        """``app`` (the metrics exposition) answering ``/healthz`` and ``/readyz`` too."""

        def routed(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "")
            if path in ("/healthz", "/readyz"):
                ok = self.alive() if path == "/healthz" else self.ready()
                status = "200 OK" if ok else "503 Service Unavailable"
                start_response(status, [("Content-Type", "text/plain")])
                return [b"ok\n" if ok else b"not ready\n"]
            return app(environ, start_response)

        return routed
