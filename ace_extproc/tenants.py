"""Tenants: who a request belongs to, and the cache salt that keeps tenants apart.

A tenant comes from the bearer token (looked up by its SHA-256 digest, so no raw
key is held beyond the request, logged or echoed), or from a header set by a
trusted auth filter in Envoy (stripped from what clients send before any filter
runs: ``envoy_config.py``), or else is the anonymous tenant. A presented key is
checked first and settles it: an unknown one is refused whatever the header says.

The cache salt is ``HMAC-SHA256(secret, tenant)`` in hex: 64 characters of
``[0-9a-f]``, within vLLM's rules (1..128 characters, no ``@ / \\`` or NUL). Engines
mix it into block 0's hash, so tenants never share a cached block; because it is
keyed, a client cannot compute another tenant's salt.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from ace_extproc.config import TenantConfig

_TENANT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class UnknownKey(Exception):
    """A bearer token not in the configured key map (answered with 401)."""


class MissingKey(Exception):
    """No bearer token where the configuration requires one (answered with 401)."""


class Tenants:
    def __init__(self, config: TenantConfig, salt_secret: bytes) -> None:
        self._config = config
        self._secret = salt_secret
        self._salts: dict[str, str] = {}

    def resolve(self, authorization: str | None, trusted: str | None) -> str:
        """The tenant id of a request, from its ``authorization`` header value and the
        value of the trusted tenant header (None when absent or not configured)."""
        cfg = self._config
        token = _bearer(authorization)
        if token is not None and cfg.has_key_map:
            tenant = cfg.key_digests.get(hashlib.sha256(token.encode()).digest())
            if tenant is None:  # never overridden by the trusted header
                raise UnknownKey
            return tenant
        if trusted is not None and cfg.header is not None and _TENANT_ID.match(trusted):
            return trusted  # vouched for by the auth filter that set it
        if cfg.require_key and token is None:
            raise MissingKey
        return cfg.anonymous

    def salt(self, tenant: str) -> str:
        salt = self._salts.get(tenant)
        if salt is None:
            if len(self._salts) > 65536:
                self._salts.clear()
            salt = hmac.new(self._secret, tenant.encode(), hashlib.sha256).hexdigest()
            self._salts[tenant] = salt
        return salt


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token
