"""Configuration: the fleet (``destinations:`` in the product's ``fleet.yaml`` format,
extended with the pods behind each destination) and the router's own settings.

One YAML file may hold both: ``destinations:`` and an optional ``router:`` section.
Everything has a default, so ``ace-extproc serve --fleet fleet.yaml`` is enough.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from ace_extproc.latency import DEFAULT_MODEL, TTFTModel, get_model


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


DISCOVERY_TYPES = ("dns", "kubernetes")
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
KUBERNETES_API = "https://kubernetes.default.svc"


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

    type: str  # "dns" | "kubernetes"
    port: int | None = None
    interval_s: float = 5.0
    hostname: str = ""  # dns; kubernetes: what Envoy resolves
    namespace: str = ""  # kubernetes
    service: str = ""
    port_name: str | None = None
    api_url: str = KUBERNETES_API
    token_path: str = f"{SERVICE_ACCOUNT}/token"
    ca_path: str = f"{SERVICE_ACCOUNT}/ca.crt"


def default_cluster(destination: str) -> str:
    """The Envoy cluster of all of destination ``destination``'s pods."""
    return f"ace_default.{destination}"


@dataclass(frozen=True, slots=True)
class Destination:
    """A model deployment: one or more interchangeable pods serving the same models."""

    id: str
    provider: str
    base_url: str
    weight: float
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


FAILURE_MODES = ("auto", "open", "closed")


@dataclass(frozen=True, slots=True)
class PassiveHealth:
    """Pods taken out for failing the requests they serve (``router.passive_health``;
    ``routing/outlier.py``), with Envoy's outlier detection's defaults."""

    consecutive_5xx: int = 5  # the pod's 5xx answers in a row
    consecutive_gateway_failure: int = 5  # 502/503/504, or unreachable, in a row
    max_ejection_percent: int = 10  # of a destination's pods out at once (at least one)
    base_ejection_time_s: float = 30.0  # out for this times the times it was out
    max_ejection_time_s: float = 300.0


def _passive_health(raw: Any) -> PassiveHealth:
    where = "router.passive_health"
    if raw is None:
        return PassiveHealth()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping")
    fields = PassiveHealth.__dataclass_fields__
    values: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in fields:
            raise ConfigError(f"{where}.{name}: unknown setting")
        whole = name != "base_ejection_time_s" and name != "max_ejection_time_s"
        if isinstance(value, bool) or not isinstance(value, int if whole else int | float):
            raise ConfigError(f"{where}.{name}: expected a number, got {value!r}")
        if value <= 0 or (name == "max_ejection_percent" and value > 100):
            raise ConfigError(f"{where}.{name}: out of range: {value!r}")
        values[name] = value if whole else float(value)
    return PassiveHealth(**values)


@dataclass(frozen=True, slots=True)
class ExtProcTLS:
    """mTLS between Envoy and ace-extproc (``router.ext_proc_tls``). ace-extproc serves
    with ``cert_file`` and ``key_file`` and admits only clients with a certificate
    ``ca_file`` signed; the rendered Envoy presents ``client_cert_file`` and
    ``client_key_file`` and checks ace-extproc's certificate against ``ca_file`` (and
    its name against ``server_name``, where given). Each side reads only its files."""

    ca_file: str
    cert_file: str = ""
    key_file: str = ""
    client_cert_file: str = ""
    client_key_file: str = ""
    server_name: str = ""


@dataclass(frozen=True, slots=True)
class Settings:
    mode: Mode = Mode.PROD
    # Who may send ``x-ace-skill-override`` (or an envelope's mode): True, anyone where no
    # tenants are configured, else any tenant that authenticated (a key, the trusted
    # header); a tuple of tenant ids, those alone; False, nobody.
    allow_mode_override: bool | tuple[str, ...] = True
    # What Envoy does with a request when ace-extproc does not answer it (down, slow):
    # "open" sends it on unrouted, "closed" refuses it (503). "auto": closed where
    # tenants or keys are configured, since an unanswered request is neither checked
    # nor salted; open otherwise (see docs/security.md).
    failure_mode: str = "auto"
    # Prefix blocks are 512 bytes of canonical prompt (~128 tokens at ~4 bytes a token):
    # fine enough to tell conversations apart, coarse enough that a 32K-token prompt
    # hashes in ~40 us (see README "Block size").
    block_bytes: int = 512
    bytes_per_token: float = 4.0
    max_body_bytes: int = 8 * 1024 * 1024
    # Router blocks remembered per pod until its real KV capacity is known (scraped from
    # vllm:cache_config_info or SGLang's max_total_num_tokens, or configured: a
    # destination's kv_capacity_tokens).
    index_blocks_per_pod: int = 200_000
    ttft_model: str = DEFAULT_MODEL  # the pods' TTFT model, where a destination names none
    # How fast a pod prefills, in uncached prompt tokens a second: the rate at which
    # the prefill this replica sent a pod is taken to drain (routing/monitor.py).
    # 0: its destination's TTFT model's (1000 / a_ms; 25,000 for the default). Set it
    # when the pods are faster or slower than the model (`ace-extproc up` sets it for
    # its simulated pods' clock); it then holds for every pod.
    prefill_tokens_per_s: float = 0.0
    policy: str = "cost"  # the picking policy (routing.policies)
    # cost policy: a warm match covering less than this share of the prompt (a system
    # prompt many conversations share) does not steer the pick (routing/pipeline.py);
    # 0 lets any match steer. Requests with session ids are placed by their session
    # anyway; measured in bench/RESULTS.md ("The shallow-match threshold").
    min_match: float = 0.1
    # cost policy: a session's (x-session-id / x-user-id) first request this replica
    # sees is placed by the session, not drawn to a pod by a prefix other sessions share.
    place_sessions: bool = True
    # cost policy: a pod priced within this share plus these milliseconds of the
    # cheapest is a near-tie, and among near-ties the deepest match wins. Wider keeps
    # more requests on the pod holding their prefix (more reuse, less prefill work) at
    # the cost of waiting behind its queue (a higher TTFT tail); measured in
    # bench/RESULTS.md ("The affinity slack").
    affinity_slack: float = 0.10
    affinity_slack_ms: float = 5.0
    upstream_mode: str = "cluster"  # "cluster": per-pod Envoy clusters; "endpoint": ip:port
    # Replicas share their placements through Redis pub/sub (routing/replicas.py), so
    # each prices pods against the whole fleet's traffic and follows the prefixes and
    # sessions the others placed: redis://[:password@]host:port/db, rediss://, or
    # unix:///path. "" (the default): each replica learns only from what it routes.
    share_url: str = ""
    share_channel: str = "ace-extproc:placements"
    # The Redis password, from the environment variable router.share_password_env names
    # (ACE_SHARE_PASSWORD by default), so it can live in a Secret rather than in the
    # fleet file; or in share_url itself. Never printed (ctl config, logs).
    share_password: str = field(default="", repr=False)
    scrape_interval_s: float = 0.1  # pods' /metrics
    probe_interval_s: float = 1.0  # pods' /health
    probe_timeout_s: float = 0.5
    # Scrapes and probes together send at most this many requests a second (0: no
    # bound); a larger fleet has both intervals stretched alike (routing/monitor.py).
    monitor_max_requests_per_s: float = 200.0
    # The CA bundle that https pods' (and hosted APIs') certificates are checked against,
    # by Envoy and by the monitor; "": the system's.
    upstream_ca_file: str = ""
    unhealthy_after: int = 2  # consecutive failed probes (or scrapes) that take a pod out
    healthy_after: int = 2  # consecutive good probes that bring it back
    passive_health: PassiveHealth = field(default_factory=PassiveHealth)
    # Envoy reports each response (its status, the host that answered) to ace-extproc on
    # its gRPC access log, batched, without delaying it: passive health and the ledger.
    observe_responses: bool = True
    # Also read each response body's usage (prompt_tokens_details.cached_tokens), and
    # ask streamed requests for it (stream_options.include_usage; prod only, as shadow
    # never changes a request). Costs a second, observe-only ext_proc stream a request,
    # and a gRPC message per body chunk, off the path.
    usage_capture: bool = False
    salt_secret: bytes = b""
    salt_secret_generated: bool = False  # none configured: a random one, this process's own
    tenants: TenantConfig = field(default_factory=TenantConfig)
    listen: str = "127.0.0.1:50051"
    uds: str | None = None
    # Every ext_proc stream must carry the token Envoy is rendered with (peer.py), so
    # nothing else that reaches the port counts. Off only where another layer (mTLS,
    # a socket only Envoy can open) already keeps everyone else out.
    require_peer_token: bool = True
    # mTLS on the ext_proc port, for an Envoy on another host (ExtProcTLS).
    ext_proc_tls: ExtProcTLS | None = None
    # Operator drains kept across restarts (drains.py): a JSON file; "" keeps none.
    drain_file: str = ""
    # The admin gRPC API (admin.py, ``ace-extproc ctl``): host:port, unix:/path, or "off".
    # Never the ext_proc port; no authentication, so keep it on loopback or a socket.
    admin_listen: str = "127.0.0.1:9091"
    grpc_max_message_bytes: int = 64 * 1024 * 1024
    shutdown_grace_s: float = 10.0
    # Prometheus exposition of the router's own metrics (telemetry.py): host:port, or
    # "off". Port 0 picks a free port.
    metrics_listen: str = "127.0.0.1:9090"
    # A ``tenant`` label on the decision metrics. The tenants the configuration names
    # (router.tenants.api_keys, the anonymous tenant) are always labels; others (a
    # trusted tenant header) get one while fewer than metrics_max_tenants are labelled,
    # then fold into "other".
    metrics_tenant_label: bool = False
    metrics_max_tenants: int = 100
    log_format: str = "json"  # "json": one JSON object a line; "text": for people

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


LOG_FORMATS = ("json", "text")
SHARE_SCHEMES = ("redis", "rediss", "unix")


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


def _base_url(url: Any, where: str) -> tuple[str, int]:
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


def _weight(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{where}: weight must be a positive number, got {value!r}")
    return float(value)


def parse_fleet(doc: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Fleet:
    """The fleet of a ``fleet.yaml`` document; ``env`` (default: the process's) holds
    the destinations' API keys that ``api_key_env`` names."""
    env = os.environ if env is None else env
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
        discovery = (
            parse_discovery(d["discovery"], f"{where}.discovery") if "discovery" in d else None
        )
        if discovery is not None and "base_url" not in d:
            base_url = _discovery_base_url(discovery)
        else:
            base_url = _req(d, "base_url", where)
        _base_url(base_url, f"{where}.base_url")
        tls = urlsplit(base_url).scheme == "https"
        weight = _weight(d.get("weight", 1), f"{where}.weight")
        models = d.get("models", [])
        if isinstance(models, str):
            models = [models]
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise ConfigError(f"{where}.models: expected a list of model names")
        # With discovery, no pods is fine: they come (and go) at run time.
        raw_pods = d.get("pods") or ([] if discovery else [{"id": "pod-0", "base_url": base_url}])
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
            url = _req(p, "base_url", pw)
            host, port = _base_url(url, f"{pw}.base_url")
            if (urlsplit(url).scheme == "https") != tls:
                # One Envoy cluster holds a destination's pods, and TLS is the cluster's.
                raise ConfigError(
                    f"{pw}.base_url: {url!r} and the destination's base_url "
                    f"{base_url!r} must both be http or both https"
                )
            weight_p = _weight(p.get("weight", 1), f"{pw}.weight")
            pods.append(Pod(did, pid, host, port, weight_p, tls))
        key_env = d.get("api_key_env", "")
        if not isinstance(key_env, str):
            raise ConfigError(f"{where}.api_key_env: expected the name of an environment variable")
        # Unset is checked by the server only (check_api_keys): Envoy's renderer, which
        # reads the same file, has no use for the key and need not be given it.
        api_key = env.get(key_env, "") if key_env else ""
        if any(c in api_key for c in "\r\n\0"):
            raise ConfigError(f"{where}.api_key_env: {key_env} holds a line break or NUL")
        ttft_model = d.get("ttft_model", "")
        if not isinstance(ttft_model, str):
            raise ConfigError(f"{where}.ttft_model: expected a TTFT model's name")
        if ttft_model:
            try:
                get_model(ttft_model)
            except ValueError as exc:
                raise ConfigError(f"{where}.ttft_model: {exc}") from None
        kv_tokens = d.get("kv_capacity_tokens", 0)
        if isinstance(kv_tokens, bool) or not isinstance(kv_tokens, int) or kv_tokens < 0:
            raise ConfigError(
                f"{where}.kv_capacity_tokens: expected a number of tokens, got {kv_tokens!r}"
            )
        dest = Destination(did, provider, base_url, weight, tuple(pods), tuple(models), discovery)
        dests.append(
            replace(
                dest,
                api_key_env=key_env,
                api_key=api_key,
                ttft_model=ttft_model,
                kv_capacity_tokens=kv_tokens,
            )
        )
    return Fleet(tuple(dests))


_DISCOVERY_FIELDS = {
    "dns": frozenset({"type", "hostname", "port", "interval_s"}),
    "kubernetes": frozenset(
        {
            "type",
            "namespace",
            "service",
            "hostname",
            "port",
            "port_name",
            "api_url",
            "token_path",
            "ca_path",
            "interval_s",
        }
    ),
}
_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*\.?$"
)
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def _port(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ConfigError(f"{where}: expected a port number 1..65535, got {value!r}")
    return value


def _text(value: Any, where: str, pattern: re.Pattern[str] | None = None) -> str:
    if not isinstance(value, str) or not value or (pattern and not pattern.match(value)):
        raise ConfigError(f"{where}: invalid value {value!r}")
    return value


def parse_discovery(raw: Any, where: str) -> DiscoveryConfig:
    """A destination's ``discovery:`` mapping (``type: dns`` or ``type: kubernetes``)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping with 'type: dns' or 'type: kubernetes'")
    kind = raw.get("type")
    if kind not in DISCOVERY_TYPES:
        raise ConfigError(f"{where}.type: {kind!r} is not one of {DISCOVERY_TYPES}")
    for name in raw:
        if name not in _DISCOVERY_FIELDS[kind]:
            raise ConfigError(f"{where}.{name}: unknown field for type {kind}")
    interval = raw.get("interval_s", 5.0 if kind == "dns" else 1.0)
    if isinstance(interval, bool) or not isinstance(interval, int | float) or interval <= 0:
        raise ConfigError(f"{where}.interval_s: expected a positive number, got {interval!r}")
    if kind == "dns":
        return DiscoveryConfig(
            "dns",
            port=_port(_req(raw, "port", where), f"{where}.port"),
            interval_s=float(interval),
            hostname=_text(_req(raw, "hostname", where), f"{where}.hostname", _HOSTNAME),
        )
    port = _port(raw["port"], f"{where}.port") if "port" in raw else None
    port_name = _text(raw["port_name"], f"{where}.port_name") if "port_name" in raw else None
    if port is None and port_name is None:
        raise ConfigError(f"{where}.port: kubernetes discovery needs 'port' or 'port_name'")
    api_url = raw.get("api_url", KUBERNETES_API)
    _host_port(api_url, f"{where}.api_url")
    namespace = _text(_req(raw, "namespace", where), f"{where}.namespace", _K8S_NAME)
    service = _text(_req(raw, "service", where), f"{where}.service", _K8S_NAME)
    hostname = raw.get("hostname", f"{service}.{namespace}.svc.cluster.local")
    return DiscoveryConfig(
        "kubernetes",
        port=port,
        interval_s=float(interval),
        hostname=_text(hostname, f"{where}.hostname", _HOSTNAME),
        namespace=namespace,
        service=service,
        port_name=port_name,
        api_url=str(api_url).rstrip("/"),
        token_path=_text(raw.get("token_path", f"{SERVICE_ACCOUNT}/token"), f"{where}.token_path"),
        ca_path=_text(raw.get("ca_path", f"{SERVICE_ACCOUNT}/ca.crt"), f"{where}.ca_path"),
    )


def _discovery_base_url(d: DiscoveryConfig) -> str:
    """A destination's ``base_url`` when only discovery is given: the service's name."""
    if d.type == "dns":
        return f"http://{d.hostname.rstrip('.')}:{d.port}"
    return f"http://{d.service}.{d.namespace}.svc:{d.port or 80}"


def discovery_to_dict(d: DiscoveryConfig) -> dict[str, Any]:
    """``discovery:`` in ``fleet.yaml`` form (``parse_discovery`` reads it back)."""
    fields = _DISCOVERY_FIELDS[d.type]
    out: dict[str, Any] = {"type": d.type}
    for name in sorted(fields - {"type"}):
        value = getattr(d, name)
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
    if anonymous in digests.values():
        raise ConfigError(
            f"router.tenants.api_keys: {anonymous!r} is the anonymous tenant; a key's "
            "tenant must be another"
        )
    for name in raw:
        if name not in ("api_keys", "header", "anonymous", "require_key"):
            raise ConfigError(f"router.tenants.{name}: unknown setting")
    return TenantConfig(
        key_digests=digests,
        header=header.lower() if header else None,
        anonymous=anonymous,
        require_key=bool(raw.get("require_key", False)),
    )


_SETTING_TYPES: dict[str, type] = {
    "block_bytes": int,
    "bytes_per_token": float,
    "max_body_bytes": int,
    "index_blocks_per_pod": int,
    "ttft_model": str,
    "prefill_tokens_per_s": float,
    "policy": str,
    "min_match": float,
    "place_sessions": bool,
    "affinity_slack": float,
    "affinity_slack_ms": float,
    "upstream_mode": str,
    "share_url": str,
    "share_channel": str,
    "scrape_interval_s": float,
    "probe_interval_s": float,
    "probe_timeout_s": float,
    "monitor_max_requests_per_s": float,
    "upstream_ca_file": str,
    "unhealthy_after": int,
    "healthy_after": int,
    "observe_responses": bool,
    "usage_capture": bool,
    "listen": str,
    "uds": str,
    "require_peer_token": bool,
    "admin_listen": str,
    "drain_file": str,
    "grpc_max_message_bytes": int,
    "shutdown_grace_s": float,
    "metrics_listen": str,
    "metrics_tenant_label": bool,
    "metrics_max_tenants": int,
    "log_format": str,
}


# router: keys read by parse_settings itself rather than through _SETTING_TYPES.
_PARSED_APART = frozenset(
    {
        "mode",
        "tenants",
        "salt_secret",
        "salt_secret_env",
        "share_password_env",
        "allow_mode_override",
        "failure_mode",
        "ext_proc_tls",
        "passive_health",
    }
)


def _ext_proc_tls(raw: Any) -> ExtProcTLS | None:
    if raw is None:
        return None
    where = "router.ext_proc_tls"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping")
    names = ExtProcTLS.__dataclass_fields__
    for name, value in raw.items():
        if name not in names:
            raise ConfigError(f"{where}.{name}: unknown setting")
        if not isinstance(value, str):
            raise ConfigError(f"{where}.{name}: expected a file path, got {value!r}")
    if not raw.get("ca_file"):
        raise ConfigError(f"{where}.ca_file: required (the CA both sides' certificates chain to)")
    tls = ExtProcTLS(**raw)
    if bool(tls.cert_file) != bool(tls.key_file):
        raise ConfigError(f"{where}: cert_file and key_file go together")
    if bool(tls.client_cert_file) != bool(tls.client_key_file):
        raise ConfigError(f"{where}: client_cert_file and client_key_file go together")
    return tls


def _override_setting(value: Any) -> bool | tuple[str, ...]:
    """``allow_mode_override``: true, false, or a list of tenant ids."""
    if isinstance(value, bool):
        return value
    if isinstance(value, list):
        return tuple(_check_id(t, "router.allow_mode_override (a tenant)") for t in value)
    raise ConfigError(
        f"router.allow_mode_override: expected true, false or a list of tenants, got {value!r}"
    )


def parse_settings(raw: Any, env: Mapping[str, str] | None = None) -> Settings:
    env = os.environ if env is None else env
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError("router: expected a mapping")
    values: dict[str, Any] = {}
    for name, value in raw.items():
        if name in _PARSED_APART:
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
    values["tenants"] = tenants = parse_tenants(raw.get("tenants"))
    if "allow_mode_override" in raw:
        values["allow_mode_override"] = _override_setting(raw["allow_mode_override"])
    failure_mode = raw.get("failure_mode", "auto")
    if failure_mode not in FAILURE_MODES:
        raise ConfigError(
            f"router.failure_mode: expected one of {', '.join(FAILURE_MODES)}, got {failure_mode!r}"
        )
    if failure_mode == "open" and tenants.guarded:
        raise ConfigError(
            "router.failure_mode: open would let requests past the API key check whenever "
            "ace-extproc does not answer; with router.tenants.api_keys or require_key it "
            "must be closed (or auto)"
        )
    values["failure_mode"] = failure_mode
    values["ext_proc_tls"] = _ext_proc_tls(raw.get("ext_proc_tls"))
    values["passive_health"] = _passive_health(raw.get("passive_health"))
    values["salt_secret"], values["salt_secret_generated"] = _salt_secret(raw, env)
    values["share_password"] = env.get(str(raw.get("share_password_env", "ACE_SHARE_PASSWORD")), "")
    settings = Settings(**values)
    if settings.block_bytes < 16 or settings.block_bytes > 65536:
        raise ConfigError("router.block_bytes: expected 16..65536")
    if settings.max_body_bytes <= 0 or settings.index_blocks_per_pod <= 0:
        raise ConfigError("router: max_body_bytes and index_blocks_per_pod must be positive")
    if not 0.0 <= settings.prefill_tokens_per_s < float("inf"):
        raise ConfigError("router.prefill_tokens_per_s: expected a rate >= 0 (0: the model's)")
    if settings.upstream_ca_file and not os.path.isfile(settings.upstream_ca_file):
        raise ConfigError(f"router.upstream_ca_file: {settings.upstream_ca_file!r} is not a file")
    if not 0.0 <= settings.monitor_max_requests_per_s < float("inf"):
        raise ConfigError("router.monitor_max_requests_per_s: expected a rate >= 0 (0: no bound)")
    if not 0.0 <= settings.min_match <= 1.0:
        raise ConfigError("router.min_match: expected a share of the prompt, 0 to 1")
    for name in ("affinity_slack", "affinity_slack_ms"):
        if not 0.0 <= getattr(settings, name) < float("inf"):
            raise ConfigError(f"router.{name}: expected a number >= 0")
    if settings.upstream_mode not in ("cluster", "endpoint"):
        raise ConfigError("router.upstream_mode: expected cluster or endpoint")
    if settings.share_url and urlsplit(settings.share_url).scheme not in SHARE_SCHEMES:
        raise ConfigError(
            f"router.share_url: expected a redis://, rediss:// or unix:// URL, "
            f"got {settings.share_url!r}"
        )
    if not settings.share_channel:
        raise ConfigError("router.share_channel: expected a channel name")
    if settings.share_password and urlsplit(settings.share_url).password is not None:
        raise ConfigError(
            "router.share_url carries a password and so does the environment "
            "(router.share_password_env): give it once"
        )
    check_admin_listen(settings.admin_listen, "router.admin_listen")
    if settings.metrics_listen != "off":
        check_listen(settings.metrics_listen, "router.metrics_listen", allow_off=True)
    if settings.metrics_max_tenants < 1:
        raise ConfigError("router.metrics_max_tenants: expected a positive number")
    if settings.log_format not in LOG_FORMATS:
        raise ConfigError(f"router.log_format: expected one of {', '.join(LOG_FORMATS)}")
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


def _salt_secret(raw: Mapping[str, Any], env: Mapping[str, str]) -> tuple[bytes, bool]:
    """The HMAC key of per-tenant cache salts, and whether it was generated. Every
    replica must share it, or each replica salts a tenant differently and the engines'
    caches split between them."""
    if "salt_secret" in raw:
        return str(raw["salt_secret"]).encode(), False
    name = str(raw.get("salt_secret_env", "ACE_SALT_SECRET"))
    value = env.get(name)
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
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{path}: expected a mapping with 'destinations:'")
    return Config(parse_fleet(doc, env), parse_settings(doc.get("router"), env))


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
    dest = Destination(destination, "vllm", pods[0].base_url, 1.0, tuple(pods))
    return Fleet((dest,))


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
                "weight": d.weight,
                **({"models": list(d.models)} if d.models else {}),
                **({"discovery": discovery_to_dict(d.discovery)} if d.discovery else {}),
                **({"api_key_env": d.api_key_env} if d.api_key_env else {}),
                **({"ttft_model": d.ttft_model} if d.ttft_model else {}),
                **({"kv_capacity_tokens": d.kv_capacity_tokens} if d.kv_capacity_tokens else {}),
                "pods": [{"id": p.id, "base_url": p.base_url, "weight": p.weight} for p in d.pods],
            }
            for d in fleet.destinations
        ]
    }
