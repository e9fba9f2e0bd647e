"""Who may talk to the ext_proc port: Envoy, and only Envoy.

Everything on that port is trusted: a routing stream adds to the pods' load and
index, and an observe stream's report of a 5xx counts against a pod. So besides
keeping the port private (a Unix socket in the pod, loopback, mTLS across hosts, a
NetworkPolicy), each stream must present a token in its gRPC metadata, which Envoy
adds from its bootstrap (``grpc_service.initial_metadata``). The token is derived
from the salt secret, which every replica and the Envoy renderer already share, so
there is no other secret to distribute; knowing the token reveals nothing of the
secret (an HMAC). Where the secret was generated at start, nobody else can know it:
no token is asked for (``serve`` warns about that secret already).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from ace_extproc.config import Settings

METADATA_KEY = "x-ace-peer-token"
_LABEL = b"ace-extproc ext_proc peer"


def token(settings: Settings) -> str | None:
    """The token Envoy must present, or None where none is asked for."""
    if (
        not settings.require_peer_token
        or settings.salt_secret_generated
        or settings.endpoint_picker is not None  # a gateway's Envoy sends no token
    ):
        return None
    return hmac.new(settings.salt_secret, _LABEL, hashlib.sha256).hexdigest()


def presented(metadata: Iterable[tuple[str, str | bytes]], expected: str) -> bool:
    """Whether a stream's invocation metadata carries the expected token."""
    for key, value in metadata:
        if key == METADATA_KEY:
            given = value.encode() if isinstance(value, str) else value
            return hmac.compare_digest(given, expected.encode())
    return False
