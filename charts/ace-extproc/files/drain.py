"""The pod's stop sequence (the chart's preStop hooks), standard library only.

``envoy``: ask Envoy (its admin, on loopback) to drain its listeners gracefully, wait
until no downstream request is active (every stream finished) or ``--timeout`` passes,
then write ``--flag``. The kubelet's SIGTERM follows, and Envoy exits with nothing left
in flight.

``extproc``: wait for that flag (at most ``--timeout``): ace-extproc serves each request's
ext_proc stream until its response ends, so it must outlive Envoy's last request. Its
SIGTERM then stops it gracefully (router.shutdown_grace_s).

Envoy's image may have neither curl nor a shell worth the name; it has the Python that
runs ace-extproc, which is all this needs."""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request
from pathlib import Path


def active_requests(admin: str) -> int:
    """Downstream requests in flight on every HTTP connection manager but the admin's
    and the stats listener's (a scrape is no request to wait for)."""
    url = f"http://{admin}/stats?filter=downstream_rq_active$"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    total = 0
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.startswith("http.") and not name.startswith(("http.admin.", "http.envoy_stats.")):
            total += int(value.strip() or 0)
    return total


def drain_envoy(admin: str, delay: float, timeout: float, flag: Path, poll: float) -> int:
    deadline = time.monotonic() + timeout
    flag.unlink(missing_ok=True)  # one left by an earlier stop (a liveness restart)
    # Keep taking new requests while the endpoint leaves the Service's EndpointSlices.
    time.sleep(delay)
    post = urllib.request.Request(f"http://{admin}/drain_listeners?graceful", method="POST")
    with urllib.request.urlopen(post, timeout=5):
        pass
    left = -1
    while time.monotonic() < deadline:
        try:
            left = active_requests(admin)
        except OSError:
            break  # Envoy is gone: nothing left to wait for
        if left == 0:
            break
        time.sleep(poll)
    flag.parent.mkdir(parents=True, exist_ok=True)
    flag.write_text(f"{left}\n")
    print(f"envoy drained: {max(left, 0)} request(s) left", file=sys.stderr)
    return 0


def wait_for_flag(flag: Path, timeout: float, poll: float) -> int:
    """Until this stop's flag is written (one older than this wait does not count)."""
    started = time.time()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if flag.stat().st_mtime >= started:
                break
        except FileNotFoundError:
            pass
        time.sleep(poll)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", choices=["envoy", "extproc"])
    parser.add_argument("--admin", default="127.0.0.1:9901", help="Envoy's admin host:port")
    parser.add_argument("--flag", type=Path, default=Path("/run/ace/envoy-drained"))
    parser.add_argument("--delay", type=float, default=5.0, help="seconds before draining")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--poll", type=float, default=1.0)
    args = parser.parse_args(argv)
    if args.which == "envoy":
        return drain_envoy(args.admin, args.delay, args.timeout, args.flag, args.poll)
    return wait_for_flag(args.flag, args.timeout + args.delay, args.poll)


if __name__ == "__main__":
    sys.exit(main())
