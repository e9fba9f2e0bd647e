"""Configuration: the fleet (``destinations:`` in the product's ``fleet.yaml`` format,
extended with the pods behind each destination) and the router's own settings.

One YAML file may hold both: ``destinations:`` and an optional ``router:`` section.
Everything has a default, so ``ace-extproc serve --fleet fleet.yaml`` is enough.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from ace_extproc.latency import DEFAULT_MODEL, get_model


class ConfigError(ValueError):
    """A configuration file or value that cannot be used; the message names the field."""


class Mode(StrEnum):
    OFF = "off"  # no decision at all: pass through
    SHADOW = "shadow"  # decide and report in the trace, but neither pin nor rewrite
    PROD = "prod"  # pin the pod and rewrite the body

    @classmethod
    def parse(cls, value: str) -> Mode:
        try:
            return cls(value.strip().lower())
        except ValueError:
            raise ConfigError(f"unknown mode {value!r}; expected off, shadow or prod") from None


_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
PROVIDERS = ("vllm", "sglang", "openai")


@dataclass(frozen=True, slots=True)
class Pod:
    """One engine process (a vLLM or SGLang server) behind a destination."""

    destination: str
    id: str
    host: str
    port: int
    weight: float = 1.0

    @property
    def key(self) -> str:
        """``destination/pod``: the id reported in ``x-ace-served-by``."""
        return f"{self.destination}/{self.id}"

    @property
    def cluster(self) -> str:
        """The Envoy cluster that holds exactly this pod (the ``x-ace-upstream`` value)."""
        return f"ace_pod.{self.destination}.{self.id}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.address}"


@dataclass(frozen=True, slots=True)
class Destination:
    """A model deployment: one or more interchangeable pods serving the same models."""

    id: str
    provider: str
    base_url: str
    weight: float
    pods: tuple[Pod, ...]
    models: tuple[str, ...] = ()  # empty: serves any model

    @property
    def cluster(self) -> str:
        """The Envoy cluster of all this destination's pods (the fail-open route)."""
        return f"ace_default.{self.id}"

    def serves(self, model: str) -> bool:
        return not self.models or model in self.models


@dataclass(frozen=True, slots=True)
class Fleet:
    destinations: tuple[Destination, ...]

    @property
    def pods(self) -> tuple[Pod, ...]:
        return tuple(p for d in self.destinations for p in d.pods)

    @property
    def default(self) -> Destination:
        """Where requests go when no pod is pinned (fail-open): the first destination."""
        return self.destinations[0]

    def destination_for(self, model: str) -> Destination | None:
        for d in self.destinations:
            if d.serves(model):
                return d
        return None


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """How a request's tenant is found. API keys are held only as SHA-256 digests."""

    key_digests: Mapping[bytes, str] = field(default_factory=dict)
    header: str | None = None  # a header set by a trusted upstream auth filter
    anonymous: str = "anon"
    require_key: bool = False  # reject requests without a bearer token (401)

    @property
    def has_key_map(self) -> bool:
        return bool(self.key_digests)


@dataclass(frozen=True, slots=True)
class Settings:
    mode: Mode = Mode.PROD
    allow_mode_override: bool = True
    # Prefix blocks are 512 bytes of canonical prompt (~128 tokens at ~4 bytes a token):
    # fine enough to tell conversations apart, coarse enough that a 32K-token prompt
    # hashes in ~40 us (see README "Block size").
    block_bytes: int = 512
    bytes_per_token: float = 4.0
    max_body_bytes: int = 8 * 1024 * 1024
    # Router blocks remembered per pod until its real KV capacity is known (scraped from
    # vllm:cache_config_info, or a destination's kv_capacity_tokens).
    index_blocks_per_pod: int = 200_000
    ttft_model: str = DEFAULT_MODEL
    policy: str = "cost"  # the picking policy (routing.policies)
    upstream_mode: str = "cluster"  # "cluster": per-pod Envoy clusters; "endpoint": ip:port
    scrape_interval_s: float = 0.1  # pods' /metrics
    probe_interval_s: float = 1.0  # pods' /health
    probe_timeout_s: float = 0.5
    unhealthy_after: int = 2  # consecutive failures that take a pod out
    healthy_after: int = 2  # consecutive successes that bring it back
    salt_secret: bytes = b""
    tenants: TenantConfig = field(default_factory=TenantConfig)
    listen: str = "127.0.0.1:50051"
    uds: str | None = None
    admin_listen: str | None = None
    grpc_max_message_bytes: int = 64 * 1024 * 1024
    shutdown_grace_s: float = 10.0


@dataclass(frozen=True, slots=True)
class Config:
    fleet: Fleet
    settings: Settings


# ---------------------------------------------------------------- parsing


def _req(obj: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise ConfigError(f"{where}: missing required field {key!r}")
    return obj[key]


def _check_id(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise ConfigError(
            f"{where}: id {value!r} must be 1-63 characters of letters, digits, '_', '.', '-'"
        )
    return value


def _host_port(url: Any, where: str) -> tuple[str, int]:
    if not isinstance(url, str):
        raise ConfigError(f"{where}: expected a URL string, got {type(url).__name__}")
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}: {url!r} is not an http(s) URL")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ConfigError(f"{where}: {url!r} has an invalid port") from None
    return parts.hostname, port


def _weight(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{where}: weight must be a positive number, got {value!r}")
    return float(value)


def parse_fleet(doc: Mapping[str, Any]) -> Fleet:
    raw = doc.get("destinations")
    if not isinstance(raw, list) or not raw:
        raise ConfigError("fleet: 'destinations' must be a non-empty list")
    dests: list[Destination] = []
    seen: set[str] = set()
    for i, d in enumerate(raw):
        where = f"destinations[{i}]"
        if not isinstance(d, Mapping):
            raise ConfigError(f"{where}: expected a mapping")
        did = _check_id(_req(d, "id", where), where)
        if did in seen:
            raise ConfigError(f"{where}: duplicate destination id {did!r}")
        seen.add(did)
        provider = d.get("provider", "vllm")
        if provider not in PROVIDERS:
            raise ConfigError(f"{where}: provider {provider!r} is not one of {PROVIDERS}")
        base_url = _req(d, "base_url", where)
        _host_port(base_url, f"{where}.base_url")
        weight = _weight(d.get("weight", 1), f"{where}.weight")
        models = d.get("models", [])
        if isinstance(models, str):
            models = [models]
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise ConfigError(f"{where}.models: expected a list of model names")
        raw_pods = d.get("pods") or [{"id": "pod-0", "base_url": base_url}]
        if not isinstance(raw_pods, list):
            raise ConfigError(f"{where}.pods: expected a list")
        pods: list[Pod] = []
        pod_ids: set[str] = set()
        for j, p in enumerate(raw_pods):
            pw = f"{where}.pods[{j}]"
            if not isinstance(p, Mapping):
                raise ConfigError(f"{pw}: expected a mapping")
            pid = _check_id(_req(p, "id", pw), pw)
            if pid in pod_ids:
                raise ConfigError(f"{pw}: duplicate pod id {pid!r}")
            pod_ids.add(pid)
            host, port = _host_port(_req(p, "base_url", pw), f"{pw}.base_url")
            pods.append(Pod(did, pid, host, port, _weight(p.get("weight", 1), f"{pw}.weight")))
        dests.append(Destination(did, provider, base_url, weight, tuple(pods), tuple(models)))
    return Fleet(tuple(dests))


def _key_digest(entry: str) -> bytes:
    # Keys may be given as "sha256:<hex>" so the file never holds a raw key.
    if entry.startswith("sha256:"):
        try:
            digest = bytes.fromhex(entry[7:])
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ConfigError("router.tenants.api_keys: a 'sha256:' key needs 64 hex digits")
        return digest
    return hashlib.sha256(entry.encode()).digest()


def parse_tenants(raw: Any) -> TenantConfig:
    if raw is None:
        return TenantConfig()
    if not isinstance(raw, Mapping):
        raise ConfigError("router.tenants: expected a mapping")
    keys = raw.get("api_keys", {}) or {}
    if not isinstance(keys, Mapping):
        raise ConfigError("router.tenants.api_keys: expected a mapping of API key -> tenant")
    digests: dict[bytes, str] = {}
    for key, tenant in keys.items():
        if not isinstance(key, str) or not key:
            raise ConfigError("router.tenants.api_keys: keys must be non-empty strings")
        digests[_key_digest(key)] = _check_id(tenant, "router.tenants.api_keys (a tenant)")
    header = raw.get("header")
    if header is not None and (not isinstance(header, str) or not header):
        raise ConfigError("router.tenants.header: expected a header name")
    anonymous = _check_id(raw.get("anonymous", "anon"), "router.tenants.anonymous")
    return TenantConfig(
        key_digests=digests,
        header=header.lower() if header else None,
        anonymous=anonymous,
        require_key=bool(raw.get("require_key", False)),
    )


_SETTING_TYPES: dict[str, type] = {
    "allow_mode_override": bool,
    "block_bytes": int,
    "bytes_per_token": float,
    "max_body_bytes": int,
    "index_blocks_per_pod": int,
    "ttft_model": str,
    "policy": str,
    "upstream_mode": str,
    "scrape_interval_s": float,
    "probe_interval_s": float,
    "probe_timeout_s": float,
    "unhealthy_after": int,
    "healthy_after": int,
    "listen": str,
    "uds": str,
    "admin_listen": str,
    "grpc_max_message_bytes": int,
    "shutdown_grace_s": float,
}


def parse_settings(raw: Any, env: Mapping[str, str] | None = None) -> Settings:
    env = os.environ if env is None else env
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError("router: expected a mapping")
    values: dict[str, Any] = {}
    for name, value in raw.items():
        if name in ("mode", "tenants", "salt_secret", "salt_secret_env"):
            continue
        kind = _SETTING_TYPES.get(name)
        if kind is None:
            raise ConfigError(f"router.{name}: unknown setting")
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ConfigError(f"router.{name}: expected {kind.__name__}, got {value!r}")
        values[name] = value
    if "mode" in raw:
        values["mode"] = Mode.parse(str(raw["mode"]))
    values["tenants"] = parse_tenants(raw.get("tenants"))
    values["salt_secret"] = _salt_secret(raw, env)
    settings = Settings(**values)
    if settings.block_bytes < 16 or settings.block_bytes > 65536:
        raise ConfigError("router.block_bytes: expected 16..65536")
    if settings.max_body_bytes <= 0 or settings.index_blocks_per_pod <= 0:
        raise ConfigError("router: max_body_bytes and index_blocks_per_pod must be positive")
    if settings.upstream_mode not in ("cluster", "endpoint"):
        raise ConfigError("router.upstream_mode: expected cluster or endpoint")
    try:
        get_model(settings.ttft_model)
    except ValueError as exc:
        raise ConfigError(f"router.ttft_model: {exc}") from None
    return settings


def _salt_secret(raw: Mapping[str, Any], env: Mapping[str, str]) -> bytes:
    """The HMAC key of per-tenant cache salts. Every replica must share it, or each
    replica salts a tenant differently and the engines' caches split between them."""
    if "salt_secret" in raw:
        return str(raw["salt_secret"]).encode()
    name = str(raw.get("salt_secret_env", "ACE_SALT_SECRET"))
    value = env.get(name)
    if value:
        return value.encode()
    return secrets.token_bytes(32)


def load(path: str | Path | None, env: Mapping[str, str] | None = None) -> Config:
    """Load a fleet (and optional ``router:`` settings) from a YAML file, or the
    built-in four-pod simulated fleet when ``path`` is None."""
    if path is None:
        return Config(default_fleet(), parse_settings({}, env))
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{path}: expected a mapping with 'destinations:'")
    return Config(parse_fleet(doc), parse_settings(doc.get("router"), env))


def default_fleet(pods: int = 4, first_port: int = 8001, host: str = "127.0.0.1") -> Fleet:
    """The embedded fleet of ``ace-extproc up``: simulated pods on consecutive ports."""
    return sim_fleet([f"{host}:{first_port + i}" for i in range(pods)])


def sim_fleet(addresses: Sequence[str], destination: str = "sim") -> Fleet:
    pods = []
    for i, addr in enumerate(addresses):
        host, port = _host_port(addr, f"pod {addr}")
        pods.append(Pod(destination, f"pod-{i}", host, port))
    dest = Destination(destination, "vllm", pods[0].base_url, 1.0, tuple(pods))
    return Fleet((dest,))


def fleet_to_dict(fleet: Fleet) -> dict[str, Any]:
    """The fleet in ``fleet.yaml`` form (``parse_fleet`` reads it back unchanged)."""
    return {
        "destinations": [
            {
                "id": d.id,
                "provider": d.provider,
                "base_url": d.base_url,
                "weight": d.weight,
                **({"models": list(d.models)} if d.models else {}),
                "pods": [{"id": p.id, "base_url": p.base_url, "weight": p.weight} for p in d.pods],
            }
            for d in fleet.destinations
        ]
    }
