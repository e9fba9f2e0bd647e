"""Before ``ace-extproc up`` starts anything: the addresses it will listen on are free.

Envoy binds its listener with SO_REUSEPORT, so a second stack on a port already in use
would start silently and take a share of the first one's traffic. A plain bind (no
SO_REUSEPORT) fails on a port anyone listens on, which is what we want to know."""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping


def in_use(host: str, port: int) -> bool:
    """Whether something listens on (or holds) ``host:port``."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no owner
        try:
            s.bind((host.strip("[]"), port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def busy(addresses: Mapping[str, str]) -> list[str]:
    """Of ``{what: "host:port"}``, a line for each address already in use."""
    lines = []
    for what, address in addresses.items():
        host, _, port = address.rpartition(":")
        if port.isdigit() and int(port) > 0 and in_use(host or "0.0.0.0", int(port)):
            lines.append(f"{address} ({what}) is already in use")
    return lines
