"""Configuration: the fleet (``destinations:`` in the product's ``fleet.yaml`` format,
extended with the pods behind each destination) and the router's own settings.

One YAML file may hold both: ``destinations:`` and an optional ``router:`` section.
Everything has a default, so ``ace-extproc serve --fleet fleet.yaml`` is enough.

The file's keys are declared once, as types, in ``fleet_file``; this module decodes a
file into them (``fleet_decode``: a key or value that does not fit is an error naming its
path), checks what types cannot say, and builds the objects the router runs with
(``Fleet``, ``Settings``).
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec
import yaml

from ace_extproc import fleet_file as ff
from ace_extproc.fleet_decode import decode
from ace_extproc.latency import TTFTModel, get_model

# Declared with the file's types; the rest of the code imports them from here.
ConfigError = ff.ConfigError
Mode = ff.Mode
PassiveHealth = ff.PassiveHealth
ExtProcTLS = ff.ExtProcTLS
EndpointPicker = ff.EndpointPicker
PROVIDERS = ff.PROVIDERS
FAILURE_MODES = ff.FAILURE_MODES
LOG_FORMATS = ff.LOG_FORMATS
SERVICE_ACCOUNT = ff.SERVICE_ACCOUNT
KUBERNETES_API = ff.KUBERNETES_API

# Hosted APIs: no /metrics or /health to watch, and no engine fields (cache_salt,
# cache_prefix_id) in their bodies, which they may refuse as unrecognized arguments.
HOSTED_PROVIDERS = frozenset({"openai"})


@dataclass(frozen=True, slots=True)
class Pod:
    """One engine process (a vLLM or SGLang server) behind a destination."""

    destination: str
    id: str
    host: str
    port: int
    weight: float = 1.0
    tls: bool = False  # its base_url is https: Envoy and the monitor speak TLS to it
    kv_events: str = ""  # its KV event publisher (tcp://); empty: asked of the engine
    kv_events_replay: str = ""
    # Derived once (read on every decision): ``destination/pod``, the id reported in
    # ``x-ace-served-by``; the Envoy cluster that holds exactly this pod (the
    # ``x-ace-upstream`` value in cluster mode); and how Envoy names its host
    # (``ip:port``, ``[v6]:port`` in canonical spelling: the endpoint-mode value).
    key: str = field(init=False, repr=False, compare=False)
    cluster: str = field(init=False, repr=False, compare=False)
    endpoint: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self.destination}/{self.id}")
        object.__setattr__(self, "cluster", f"ace_pod.{self.destination}.{self.id}")
        host = canonical_host(self.host)
        endpoint = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        object.__setattr__(self, "endpoint", endpoint)

    @property
    def address(self) -> str:
        """``host:port``, an IPv6 host in brackets: as URLs and Envoy write it."""
        host = self.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.address}"


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """Where a destination's pods are found at run time (``routing.discovery``).

    ``dns``: the A/AAAA records of ``hostname`` (a headless service), re-resolved
    every ``interval_s``, each address a pod on ``port``. ``kubernetes``: the
    EndpointSlices of ``service`` in ``namespace``, listed then watched; the pod port
    is the slice port named ``port_name`` when given, else ``port``; ``interval_s``
    is the first reconnect delay (doubling, at most 30 s).

    Either way ``hostname`` is also the name Envoy resolves for the destination's
    hosts in endpoint mode (a STRICT_DNS cluster, ``envoy_config.py``): for
    ``kubernetes`` it defaults to the service's cluster name, which returns the pods'
    addresses only when the service is headless (``clusterIP: None``)."""

    type: str  # "dns" | "kubernetes" | "kubernetes-pods"
    port: int | None = None
    interval_s: float = 5.0
    hostname: str = ""  # dns; kubernetes: what Envoy resolves
    namespace: str = ""  # kubernetes
    service: str = ""
    port_name: str | None = None
    api_url: str = KUBERNETES_API
    token_path: str = f"{SERVICE_ACCOUNT}/token"
    ca_path: str = f"{SERVICE_ACCOUNT}/ca.crt"
    selector: tuple[tuple[str, str], ...] = ()  # kubernetes-pods: matchLabels, sorted


def default_cluster(destination: str) -> str:
    """The Envoy cluster of all of destination ``destination``'s pods."""
    return f"ace_default.{destination}"


@dataclass(frozen=True, slots=True)
class Destination:
    """A model deployment: one or more interchangeable pods serving the same models."""

    id: str
    provider: str
    base_url: str
    pods: tuple[Pod, ...]
    models: tuple[str, ...] = ()  # empty: serves any model
    discovery: DiscoveryConfig | None = None  # pods found at run time, besides ``pods``
    # The key its API wants (a hosted API's, or vLLM's --api-key): read from the
    # environment variable ``api_key_env`` names, never from the file; sent as
    # ``authorization: Bearer`` in place of the client's on every request pinned here.
    api_key_env: str = ""
    api_key: str = field(default="", repr=False, compare=False)
    # The calibrated TTFT model of its pods (``latency.MODELS``): a fleet may serve an
    # 8B model beside a 70B one, or one model on two kinds of GPU. Empty: the
    # router's ``ttft_model``.
    ttft_model: str = ""
    # Its pods' KV cache in tokens, where their /metrics do not say (an engine without
    # vLLM's cache_config_info or SGLang's max_total_num_tokens): bounds each pod's
    # index from the start. 0: the router's index_blocks_per_pod until a scrape tells.
    # A size the engine reports replaces it.
    kv_capacity_tokens: int = 0
    # Precise routing: its model's tokenizer directory (or "sim"); empty: approximate.
    tokenizer: str = ""

    @property
    def cluster(self) -> str:
        """The Envoy cluster of all this destination's pods (the fail-open route)."""
        return default_cluster(self.id)

    def serves(self, model: str) -> bool:
        return not self.models or model in self.models

    @property
    def hosted(self) -> bool:
        """A hosted API (``provider: openai``), not engine pods of our own."""
        return self.provider in HOSTED_PROVIDERS

    @property
    def tls(self) -> bool:
        """Its base_url is https (so are its pods', discovered ones included)."""
        return urlsplit(self.base_url).scheme == "https"

    def server_name(self, pod: Pod | None = None) -> str | None:
        """The name to ask an https pod for (SNI) and to check its certificate
        against: the pod's host if a name, else the destination's; None for IPs."""
        for host in (pod.host if pod is not None else None, urlsplit(self.base_url).hostname):
            if host and not is_ip(host):
                return host
        return None


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

    @property
    def isolated(self) -> bool:
        """Requests belong to tenants other than the anonymous one (API keys, or the
        trusted header): every request must then reach an engine with its tenant's
        cache salt, and a client's own cache fields never."""
        return self.has_key_map or self.header is not None

    @property
    def guarded(self) -> bool:
        """Some requests must be refused (an unknown key, or a missing one): with
        ace-extproc unable to answer, Envoy must refuse them too."""
        return self.has_key_map or self.require_key


class Settings(ff.RouterBase, frozen=True, kw_only=True):
    """The router's settings as it runs: ``router:``'s own (``fleet_file.RouterBase``,
    where each is described) and what is made of the rest (tenants' key digests, the
    secrets read from the environment)."""

    passive_health: PassiveHealth = PassiveHealth()
    tenants: TenantConfig = msgspec.field(default_factory=TenantConfig)
    salt_secret: bytes = b""
    salt_secret_generated: bool = False  # none configured: a random one, this process's own
    # The Redis password, from the environment variable router.share_password_env names,
    # so it can live in a Secret rather than in the fleet file; or in share_url itself.
    share_password: str = ""

    @property
    def fails_closed(self) -> bool:
        """Envoy refuses what ace-extproc cannot answer (``failure_mode``)."""
        if self.failure_mode == "auto":
            return self.tenants.isolated or self.tenants.guarded
        return self.failure_mode == "closed"

    def may_override(self, tenant: str) -> bool:
        """Whether ``tenant``'s requests may choose their own mode."""
        allowed = self.allow_mode_override
        if isinstance(allowed, tuple):
            return tenant in allowed
        if not allowed:
            return False
        return not self.tenants.isolated or tenant != self.tenants.anonymous

    def __rich_repr__(self) -> list[tuple[str, Any]]:
        # The secrets are never printed (logs, ctl config).
        secret = ("salt_secret", "share_password")
        return [(k, getattr(self, k)) for k in self.__struct_fields__ if k not in secret]

    def __repr__(self) -> str:
        return f"Settings({', '.join(f'{k}={v!r}' for k, v in self.__rich_repr__())})"


SHARE_SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True, slots=True)
class Config:
    fleet: Fleet
    settings: Settings


# ---------------------------------------------------------------- parsing


def _host_port(url: str, where: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}: {url!r} is not an http(s) URL")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ConfigError(f"{where}: {url!r} has an invalid port") from None
    return canonical_host(parts.hostname), port


def is_ip(host: str) -> bool:
    """Whether ``host`` is an IP address (v4 or v6) rather than a name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def canonical_host(host: str) -> str:
    """An IP address in its one canonical spelling (``fd00::7``, as Envoy reports an
    upstream host), so a pod's address compares equal to Envoy's; a name as given."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def _base_url(url: str, where: str) -> tuple[str, int]:
    """A destination's or pod's ``base_url``: its host and port. Requests go upstream
    with the client's own path (``/v1/chat/completions``...), so a path prefix would
    be dropped without a word and every request would 404: refused, bar ``/v1``."""
    host, port = _host_port(url, where)
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.path.rstrip("/") not in ("", "/v1") or parts.query or parts.fragment:
        raise ConfigError(
            f"{where}: {url!r}: a base_url is scheme://host:port (a /v1 suffix allowed); "
            "the pod is sent each request's own path, so a path prefix cannot apply"
        )
    return host, port


def parse_fleet(doc: Any, env: Mapping[str, str] | None = None) -> Fleet:
    """The fleet of a ``fleet.yaml`` document; ``env`` (default: the process's) holds
    the destinations' API keys that ``api_key_env`` names."""
    return build_fleet(decode(doc, ff.FleetFile), env)


def build_fleet(doc: ff.FleetFile, env: Mapping[str, str] | None = None) -> Fleet:
    env = os.environ if env is None else env
    seen: set[str] = set()
    for i, d in enumerate(doc.destinations):
        if d.id in seen:
            raise ConfigError(f"destinations[{i}].id: duplicate destination id {d.id!r}")
        seen.add(d.id)
    return Fleet(
        tuple(_destination(d, f"destinations[{i}]", env) for i, d in enumerate(doc.destinations))
    )


def _destination(d: ff.Destination, where: str, env: Mapping[str, str]) -> Destination:
    discovery = _discovery(d.discovery, f"{where}.discovery") if d.discovery else None
    if d.base_url is not None:
        base_url = d.base_url
    elif discovery is not None:
        base_url = _discovery_base_url(discovery)
    else:
        raise ConfigError(f"{where}.base_url: missing required field (or discovery:)")
    _base_url(base_url, f"{where}.base_url")
    tls = urlsplit(base_url).scheme == "https"
    # With discovery, no pods is fine: they come (and go) at run time.
    listed = d.pods or (() if discovery else (ff.Pod(id="pod-0", base_url=base_url),))
    pods: list[Pod] = []
    pod_ids: set[str] = set()
    for j, p in enumerate(listed):
        pw = f"{where}.pods[{j}]"
        if p.id in pod_ids:
            raise ConfigError(f"{pw}.id: duplicate pod id {p.id!r}")
        pod_ids.add(p.id)
        host, port = _base_url(p.base_url, f"{pw}.base_url")
        if (urlsplit(p.base_url).scheme == "https") != tls:
            # One Envoy cluster holds a destination's pods, and TLS is the cluster's.
            raise ConfigError(
                f"{pw}.base_url: {p.base_url!r} and the destination's base_url "
                f"{base_url!r} must both be http or both https"
            )
        for name in ("kv_events", "kv_events_replay"):
            endpoint = getattr(p, name)
            if endpoint and not endpoint.startswith(("tcp://", "ipc://")):
                raise ConfigError(f"{pw}.{name}: {endpoint!r} is not tcp://host:port")
        pods.append(Pod(d.id, p.id, host, port, p.weight, tls, p.kv_events, p.kv_events_replay))
    # Unset is checked by the server only (check_api_keys): Envoy's renderer, which
    # reads the same file, has no use for the key and need not be given it.
    api_key = env.get(d.api_key_env, "") if d.api_key_env else ""
    if any(c in api_key for c in "\r\n\0"):
        raise ConfigError(f"{where}.api_key_env: {d.api_key_env} holds a line break or NUL")
    if d.ttft_model:
        try:
            get_model(d.ttft_model)
        except ValueError as exc:
            raise ConfigError(f"{where}.ttft_model: {exc}") from None
    return Destination(
        d.id,
        d.provider,
        base_url,
        tuple(pods),
        (d.models,) if isinstance(d.models, str) else d.models,
        discovery,
        api_key_env=d.api_key_env,
        api_key=api_key,
        ttft_model=d.ttft_model,
        kv_capacity_tokens=d.kv_capacity_tokens,
        tokenizer=d.tokenizer,
    )


def _discovery(
    d: ff.DnsDiscovery | ff.KubernetesDiscovery | ff.PodsDiscovery, where: str
) -> DiscoveryConfig:
    if isinstance(d, ff.DnsDiscovery):
        return DiscoveryConfig("dns", d.port, d.interval_s, d.hostname)
    if isinstance(d, ff.PodsDiscovery):
        _host_port(d.api_url, f"{where}.api_url")
        return DiscoveryConfig(
            "kubernetes-pods",
            port=d.port,
            interval_s=d.interval_s,
            hostname=d.hostname or "",
            namespace=d.namespace,
            api_url=d.api_url.rstrip("/"),
            token_path=d.token_path,
            ca_path=d.ca_path,
            selector=tuple(sorted(d.selector.items())),
        )
    if d.port is None and d.port_name is None:
        raise ConfigError(f"{where}.port: kubernetes discovery needs 'port' or 'port_name'")
    _host_port(d.api_url, f"{where}.api_url")
    return DiscoveryConfig(
        "kubernetes",
        port=d.port,
        interval_s=d.interval_s,
        hostname=d.hostname or f"{d.service}.{d.namespace}.svc.cluster.local",
        namespace=d.namespace,
        service=d.service,
        port_name=d.port_name,
        api_url=d.api_url.rstrip("/"),
        token_path=d.token_path,
        ca_path=d.ca_path,
    )


def _discovery_base_url(d: DiscoveryConfig) -> str:
    """A destination's ``base_url`` when only discovery is given: the service's name."""
    if d.type == "dns" or (d.type == "kubernetes-pods" and d.hostname):
        return f"http://{d.hostname.rstrip('.')}:{d.port}"
    if d.type == "kubernetes-pods":  # no name for the pods: their namespace's
        return f"http://pods.{d.namespace}.svc:{d.port}"
    return f"http://{d.service}.{d.namespace}.svc:{d.port or 80}"


def discovery_to_dict(d: DiscoveryConfig) -> dict[str, Any]:
    """``discovery:`` in ``fleet.yaml`` form (``parse_fleet`` reads it back)."""
    kinds = {"dns": ff.DnsDiscovery, "kubernetes-pods": ff.PodsDiscovery}
    kind = kinds.get(d.type, ff.KubernetesDiscovery)
    out: dict[str, Any] = {"type": d.type}
    for name in sorted(kind.__struct_fields__):
        value = getattr(d, name)
        if name == "selector":
            value = dict(value)
        elif name == "hostname" and d.type == "kubernetes-pods" and not value:
            value = None
        if value is not None:
            out[name] = value
    return out


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


def _tenants(doc: ff.Tenants | None) -> TenantConfig:
    if doc is None:
        return TenantConfig()
    digests = {_key_digest(key): tenant for key, tenant in (doc.api_keys or {}).items()}
    if doc.anonymous in digests.values():
        raise ConfigError(
            f"router.tenants.api_keys: {doc.anonymous!r} is the anonymous tenant; a key's "
            "tenant must be another"
        )
    return TenantConfig(
        key_digests=digests,
        header=doc.header.lower() if doc.header else None,
        anonymous=doc.anonymous,
        require_key=doc.require_key,
    )


def _check_ext_proc_tls(tls: ExtProcTLS) -> None:
    where = "router.ext_proc_tls"
    if bool(tls.cert_file) != bool(tls.key_file):
        raise ConfigError(f"{where}: cert_file and key_file go together")
    if bool(tls.client_cert_file) != bool(tls.client_key_file):
        raise ConfigError(f"{where}: client_cert_file and client_key_file go together")


def _check_endpoint_picker(doc: ff.Router) -> None:
    where = "router.endpoint_picker"
    picker = doc.endpoint_picker
    assert picker is not None
    if bool(picker.cert_file) != bool(picker.key_file):
        raise ConfigError(f"{where}: cert_file and key_file go together")
    if doc.ext_proc_tls is not None:
        raise ConfigError(
            f"{where} serves its own TLS (secure_serving, cert_file); drop router.ext_proc_tls"
        )


def parse_settings(raw: Any, env: Mapping[str, str] | None = None) -> Settings:
    """The settings of a ``router:`` section (None: every default)."""
    return build_settings(decode({} if raw is None else raw, ff.Router, "router"), env)


_RATES = (
    "prefill_tokens_per_s",
    "monitor_max_requests_per_s",
    "affinity_slack",
    "affinity_slack_ms",
)


def build_settings(doc: ff.Router, env: Mapping[str, str] | None = None) -> Settings:
    env = os.environ if env is None else env
    tenants = _tenants(doc.tenants)
    if doc.failure_mode == "open" and tenants.guarded:
        raise ConfigError(
            "router.failure_mode: open would let requests past the API key check whenever "
            "ace-extproc does not answer; with router.tenants.api_keys or require_key it "
            "must be closed (or auto)"
        )
    if doc.ext_proc_tls is not None:
        _check_ext_proc_tls(doc.ext_proc_tls)
    if doc.endpoint_picker is not None:
        _check_endpoint_picker(doc)
    salt_secret, generated = _salt_secret(doc, env)
    settings = Settings(
        **{name: getattr(doc, name) for name in ff.RouterBase.__struct_fields__},
        passive_health=doc.passive_health or PassiveHealth(),
        tenants=tenants,
        salt_secret=salt_secret,
        salt_secret_generated=generated,
        share_password=env.get(doc.share_password_env, ""),
    )
    if settings.endpoint_picker is not None:  # a gateway's picker names pods as ip:port
        settings = msgspec.structs.replace(settings, upstream_mode="endpoint")
    # The types bound these below (and refuse NaN); an infinity passes them.
    for name in (
        "prefill_tokens_per_s",
        "monitor_max_requests_per_s",
        "affinity_slack",
        "affinity_slack_ms",
    ):
        if not math.isfinite(getattr(settings, name)):
            raise ConfigError(
                f"router.{name}: expected a finite number, got {getattr(settings, name)!r}"
            )
    if settings.upstream_ca_file and not os.path.isfile(settings.upstream_ca_file):
        raise ConfigError(f"router.upstream_ca_file: {settings.upstream_ca_file!r} is not a file")
    if settings.share_url and urlsplit(settings.share_url).scheme not in SHARE_SCHEMES:
        raise ConfigError(
            f"router.share_url: expected a redis://, rediss:// or unix:// URL, "
            f"got {settings.share_url!r}"
        )
    if settings.share_password and urlsplit(settings.share_url).password is not None:
        raise ConfigError(
            "router.share_url carries a password and so does the environment "
            "(router.share_password_env): give it once"
        )
    check_admin_listen(settings.admin_listen, "router.admin_listen")
    if settings.metrics_listen != "off":
        check_listen(settings.metrics_listen, "router.metrics_listen", allow_off=True)
    try:
        get_model(settings.ttft_model)
    except ValueError as exc:
        raise ConfigError(f"router.ttft_model: {exc}") from None
    return settings


def check_listen(value: str, where: str, allow_off: bool = False) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` (port 0: any free port) -> (host, port)."""
    host, sep, port_s = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port_s.isdigit() or not 0 <= int(port_s) < 65536:
        off = ' or "off"' if allow_off else ""
        raise ConfigError(f"{where}: expected host:port{off}, got {value!r}")
    return host, int(port_s)


def check_admin_listen(value: str, where: str) -> None:
    """``host:port``, ``[v6]:port``, ``unix:/path`` or ``off``."""
    if value == "off":
        return
    if value.startswith("unix:"):
        if len(value) > len("unix:"):
            return
        raise ConfigError(f"{where}: expected unix:/path, got {value!r}")
    host, sep, port_s = value.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 <= int(port_s) < 65536:
        raise ConfigError(f'{where}: expected host:port, unix:/path or "off", got {value!r}')


def _salt_secret(doc: ff.Router, env: Mapping[str, str]) -> tuple[bytes, bool]:
    """The HMAC key of per-tenant cache salts, and whether it was generated. Every
    replica must share it, or each replica salts a tenant differently and the engines'
    caches split between them."""
    if doc.salt_secret is not None:
        return doc.salt_secret.encode(), False
    value = env.get(doc.salt_secret_env)
    if value:
        return value.encode(), False
    return secrets.token_bytes(32), True


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
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a mapping with 'destinations:'")
    doc = decode(raw, ff.FleetFile)
    return Config(build_fleet(doc, env), build_settings(doc.router or ff.Router(), env))


def check_api_keys(fleet: Fleet) -> None:
    """Every ``api_key_env`` a destination names is set: the server must not start and
    send the clients' keys where a destination's own was meant to go."""
    for dest in fleet.destinations:
        if dest.api_key_env and not dest.api_key:
            raise ConfigError(
                f"destination {dest.id}: api_key_env: {dest.api_key_env} is not set (or empty)"
            )


def check_discovery_mode(fleet: Fleet, upstream_mode: str) -> None:
    """Pods found at run time need endpoint mode: cluster mode names each pod's own
    Envoy cluster, and Envoy has none for a pod that was not in the file."""
    if upstream_mode == "endpoint":
        return
    for dest in fleet.destinations:
        if dest.discovery is not None:
            raise ConfigError(
                f"destination {dest.id}: discovery needs router.upstream_mode: endpoint "
                "(in cluster mode Envoy has no cluster for a pod found at run time)"
            )


def default_fleet(pods: int = 4, first_port: int = 8001, host: str = "127.0.0.1") -> Fleet:
    """The embedded fleet of ``ace-extproc up``: simulated pods on consecutive ports."""
    return sim_fleet([f"{host}:{first_port + i}" for i in range(pods)])


def sim_fleet(addresses: Sequence[str], destination: str = "sim") -> Fleet:
    pods = []
    for i, addr in enumerate(addresses):
        host, port = _host_port(addr, f"pod {addr}")
        pods.append(Pod(destination, f"pod-{i}", host, port))
    return Fleet((Destination(destination, "vllm", pods[0].base_url, tuple(pods)),))


def _pod_to_dict(p: Pod) -> dict[str, Any]:
    doc: dict[str, Any] = {"id": p.id, "base_url": p.base_url, "weight": p.weight}
    if p.kv_events:
        doc["kv_events"] = p.kv_events
    if p.kv_events_replay:
        doc["kv_events_replay"] = p.kv_events_replay
    return doc


def ttft_models(fleet: Fleet, settings: Settings) -> dict[str, TTFTModel]:
    """Each destination's calibrated TTFT model: its own ``ttft_model``, else the
    router's (both checked when they were read)."""
    return {d.id: get_model(d.ttft_model or settings.ttft_model) for d in fleet.destinations}


def fleet_to_dict(fleet: Fleet) -> dict[str, Any]:
    """The fleet in ``fleet.yaml`` form (``parse_fleet`` reads it back unchanged)."""
    return {
        "destinations": [
            {
                "id": d.id,
                "provider": d.provider,
                "base_url": d.base_url,
                **({"models": list(d.models)} if d.models else {}),
                **({"discovery": discovery_to_dict(d.discovery)} if d.discovery else {}),
                **({"api_key_env": d.api_key_env} if d.api_key_env else {}),
                **({"ttft_model": d.ttft_model} if d.ttft_model else {}),
                **({"kv_capacity_tokens": d.kv_capacity_tokens} if d.kv_capacity_tokens else {}),
                **({"tokenizer": d.tokenizer} if d.tokenizer else {}),
                "pods": [_pod_to_dict(p) for p in d.pods],
            }
            for d in fleet.destinations
        ]
    }
