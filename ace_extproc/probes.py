"""What the kubelet asks a running ace-extproc, on the metrics port: is it alive
(``/healthz``: its event loop still turns) and ready (``/readyz``: serving, and
alive). The ext_proc port itself stays closed to the cluster (a Unix socket in the
pod, or loopback), so the probes cannot be gRPC health checks on it.

The answers come from the metrics server's thread, so a wedged event loop cannot
hold them up; that is why liveness is a heartbeat the loop writes, not a question
put to the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

# A heartbeat this old means the loop is stuck (its beats come every 50 ms: stalls.py).
STALE_S = 10.0

StartResponse = Callable[..., Any]
App = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


class Heartbeat(Protocol):
    last_beat: float  # when the event loop last beat (the probes' clock)


class Probes:
    def __init__(
        self, clock: Callable[[], float] = time.monotonic, heartbeat: Heartbeat | None = None
    ) -> None:
        """``heartbeat``: the event loop's (``stalls.LoopWatchdog``, which beats on the
        loop); without one, the loop is taken as last seen when these were made."""
        self._clock = clock
        self.serving = False  # set once ext_proc serves; cleared as it stops
        self.last_beat = clock()
        self._heartbeat: Heartbeat = heartbeat if heartbeat is not None else self

    def alive(self) -> bool:
        return self._clock() - self._heartbeat.last_beat < STALE_S

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
