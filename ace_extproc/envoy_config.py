"""Render the Envoy bootstrap that puts ace-extproc in front of a fleet.

The shape, and why each piece is there, is explained in ``envoy/README.md``. In short:
ext_proc (fail-open) picks a pod and sets ``x-ace-upstream`` plus ``clear_route_cache``;
the first route sends the request to the single-host cluster that header names; the
second route sends everything else to the default destination's cluster of all pods.

Endpoint mode (``upstream_mode="endpoint"``) instead has one cluster per destination
whose ``override_host`` load-balancing policy takes the host from ``x-ace-upstream``
(``ip:port[,fallback,...]``) or the Gateway API Inference Extension's ``envoy.lb``
metadata, and falls back to ordinary load balancing when neither names a host.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from ace_extproc import config as cfg
from ace_extproc import peer
from ace_extproc.mutate import PINNED_HEADER, SERVED_BY_HEADER, TRACE_HEADER
from ace_extproc.outcome import UPSTREAM_HEADER
from ace_extproc.request import RESPONSES_PATH

# Headers only ace-extproc or Envoy may set: a client-supplied copy is removed before
# routing (early header mutation), or a client could pin any pod while ext_proc is down.
STRIPPED_REQUEST_HEADERS = (UPSTREAM_HEADER, "x-ace-served-by", "x-gateway-destination-endpoint")
EXT_PROC_CLUSTER = "ace_extproc"
# The service ace-extproc's gRPC health answers for (and Envoy's health checks ask).
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# What the observe-only filter (usage capture) asks Envoy to attach to each response:
# the host that answered, whose usage it is (observe.py).
RESPONSE_ATTRIBUTES = ("upstream.address",)
# Envoy's gRPC access log to ace-extproc (access_log.py): the name its stream gives, and
# when each worker sends what it has buffered: every 0.1 s (Envoy's default is 1 s, too
# slow for passive health), or once this much is held. Envoy drops entries once the
# buffer is full while its stream is backed up (a saturated ace-extproc, the stream
# sharing its connection with the routing streams' bodies); 64 KiB (about 140 entries)
# rides that out where Envoy's default 16 KiB dropped up to 3% (bench/results/als-ab).
ACCESS_LOG_SERVICE_NAME = "ace"
ACCESS_LOG_FLUSH_INTERVAL = "0.1s"
ACCESS_LOG_BUFFER_BYTES = 65536
# Namespaces of the dynamic metadata ext_proc may return; any other is silently dropped.
METADATA_NAMESPACES = ("ace", "envoy.lb")
# Where each pod's endpoint carries its Pod.key (``pod``), for the served-by header.
ENDPOINT_NAMESPACE = "ace"
# Response headers Envoy adds itself, saving ext_proc a response-phase round trip: the
# trace and the pod ace-extproc pinned from the metadata it returned; the pod that
# served (after a retry, not the pinned one; in any mode) from the endpoint Envoy used.
# A pod found by discovery is known to Envoy by address alone: no served-by for it.
RESPONSE_HEADERS = {
    TRACE_HEADER: "%DYNAMIC_METADATA(ace:trace)%",
    PINNED_HEADER: "%DYNAMIC_METADATA(ace:served_by)%",
    SERVED_BY_HEADER: f'%UPSTREAM_METADATA(["{ENDPOINT_NAMESPACE}", "pod"])%',
}
# Generations run for minutes and a non-streamed one sends nothing until it is done: no
# overall route timeout, only a generous idle timeout (it replaces the HCM's 5 min one).
ROUTE_IDLE_TIMEOUT = "900s"
CONNECT_TIMEOUT = "1s"
# Envoy load-balancing policies the default (fail-open) cluster may use; they need no hash
# policy on the route. LEAST_REQUEST is the default; ROUND_ROBIN is the benchmarks' baseline.
LB_POLICIES = ("LEAST_REQUEST", "ROUND_ROBIN", "RANDOM")

# How ext_proc names the pod: "cluster": a per-pod cluster in x-ace-upstream; "endpoint":
# the ip:port of a host of the destination's one cluster (override_host policy).
UPSTREAM_MODES = ("cluster", "endpoint")
# Endpoint mode. The Gateway API Inference Extension's endpoint-picker protocol: the
# picked "ip:port[,ip:port...]" in this header and in envoy.lb dynamic metadata.
GIE_HEADER = "x-gateway-destination-endpoint"
GIE_NAMESPACE = "envoy.lb"
# The destination cluster, set by ext_proc; routes to it when the fleet has several.
DESTINATION_HEADER = "x-ace-destination"
# The typed extensions for each LB_POLICIES entry, as override_host's fallback policy.
_FALLBACK_POLICIES = {
    "LEAST_REQUEST": ("least_request", "least_request.v3.LeastRequest"),
    "ROUND_ROBIN": ("round_robin", "round_robin.v3.RoundRobin"),
    "RANDOM": ("random", "random.v3.Random"),
}
_LB_EXT = "envoy.load_balancing_policies."
_LB_TYPE = "type.googleapis.com/envoy.extensions.load_balancing_policies."

_SKIP_RESPONSE = {
    "response_header_mode": "SKIP",
    "response_body_mode": "NONE",
    "response_trailer_mode": "SKIP",
}
PROCESSING_MODES: dict[str, dict[str, str]] = {
    # Headers, then the whole body in one message; the answer to the body sets the header.
    "buffered": {
        "request_header_mode": "SEND",
        "request_body_mode": "BUFFERED",
        "request_trailer_mode": "SKIP",
        **_SKIP_RESPONSE,
    },
    # One stream for the body, no buffer limit; Envoy requires trailers SEND with it.
    # Not fail-open once a body chunk has gone out (Envoy keeps no copy): see envoy/README.md.
    "full_duplex": {
        "request_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        **_SKIP_RESPONSE,
    },
}

# Envoy's access log: one JSON object a line per request, with ace-extproc's decision
# from the dynamic metadata it returned (a key it did not set is null): mode, action, the
# pod it picked (``ace_pod``, in any mode), the pod it pinned (``ace_served_by``, prod),
# the prefix key and the whole trace. ``upstream_host`` is where the last try went.
ACCESS_LOG_FIELDS: dict[str, str] = {
    "start_time": "%START_TIME%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%",
    "protocol": "%PROTOCOL%",
    "status": "%RESPONSE_CODE%",
    "response_flags": "%RESPONSE_FLAGS%",
    "response_code_details": "%RESPONSE_CODE_DETAILS%",
    "bytes_received": "%BYTES_RECEIVED%",
    "bytes_sent": "%BYTES_SENT%",
    "duration_ms": "%DURATION%",
    # Request start to the upstream's first byte: the time to first token when streaming.
    "upstream_first_byte_ms": "%RESPONSE_DURATION%",
    # The request's last byte in to its first byte out to the pod: what routing held it
    # (the ext_proc's answer, Envoy's route and connection), where a pod was reached.
    "routing_hold_us": "%COMMON_DURATION(DS_RX_END:US_TX_BEG:us)%",
    "upstream_cluster": "%UPSTREAM_CLUSTER%",
    "upstream_host": "%UPSTREAM_HOST%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "ace_mode": "%DYNAMIC_METADATA(ace:mode)%",
    "ace_action": "%DYNAMIC_METADATA(ace:action)%",
    "ace_pod": "%DYNAMIC_METADATA(ace:pod)%",
    "ace_served_by": "%DYNAMIC_METADATA(ace:served_by)%",
    "ace_prefix_key": "%DYNAMIC_METADATA(ace:prefix_key)%",
    "ace_trace": "%DYNAMIC_METADATA(ace:trace)%",
}
# Endpoint mode also logs the list ext_proc named (upstream_host is where the last try went).
ENDPOINT_ACCESS_LOG_FIELDS: dict[str, str] = {
    **ACCESS_LOG_FIELDS,
    "ace_endpoints": f"%DYNAMIC_METADATA({GIE_NAMESPACE}:{GIE_HEADER})%",
}
# Where the access log goes: Envoy's stdout (the default), its stderr, a file path, or off.
ACCESS_LOG_STREAMS = ("stdout", "stderr")


# The helpers below build fresh dicts on each call: callers may mutate what render returns
# (json_format.ParseDict does), and a shared dict would leak that into the next render.


def _http2_options() -> dict[str, Any]:
    # gRPC needs HTTP/2 to the ext_proc server.
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }


def _circuit_breakers() -> dict[str, Any]:
    # Envoy's defaults allow 1024 concurrent requests per cluster. LLM streams are
    # long-lived and the default cluster holds a whole destination, so raise them.
    # Retries get a budget (a share of the requests in flight) instead of the default
    # flat 3, which a burst of connect timeouts to a busy pod used up at once
    # (bench.overhead, 220 KB bodies at concurrency 150).
    limit = 100_000
    return {
        "thresholds": [
            {
                "priority": "DEFAULT",
                "max_connections": limit,
                "max_pending_requests": limit,
                "max_requests": limit,
                "retry_budget": {"budget_percent": {"value": 25.0}, "min_retry_concurrency": 16},
            }
        ]
    }


# ---------------------------------------------------------------- addresses


def split_host_port(value: str, what: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ConfigError names ``what``."""
    host, sep, port_s = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise cfg.ConfigError(f"{what}: expected host:port, got {value!r}")
    return host, int(port_s)


def _socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _bind_address(value: str, what: str) -> dict[str, Any]:
    """Envoy binds listeners only to IP addresses, never to names."""
    host, port = split_host_port(value, what)
    host = "127.0.0.1" if host == "localhost" else host
    if not cfg.is_ip(host):
        raise cfg.ConfigError(f"{what}: {host!r} is not an IP address")
    return _socket_address(host, port)


def _duration(seconds: float, what: str) -> str:
    if seconds <= 0:
        raise cfg.ConfigError(f"{what}: must be positive, got {seconds!r}")
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


# ---------------------------------------------------------------- upstream TLS

# Where CA bundles live, for upstreams reached over https when router.upstream_ca_file
# names none: Python's OpenSSL default first, then the usual distribution paths.
_CA_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu, Alpine
    "/etc/pki/tls/certs/ca-bundle.crt",  # RHEL, Fedora
    "/etc/ssl/cert.pem",  # macOS, some BSDs
)


def upstream_ca_file(settings: cfg.Settings) -> str:
    """The CA bundle Envoy checks https upstreams against: the setting, else the
    system's. ConfigError when neither exists (Envoy would refuse the file)."""
    if settings.upstream_ca_file:  # checked to be a file when the settings were read
        return settings.upstream_ca_file
    defaults = ssl.get_default_verify_paths()
    for path in (defaults.cafile, defaults.openssl_cafile, *_CA_BUNDLES):
        if path and os.path.isfile(path):
            return path
    raise cfg.ConfigError(
        "a destination is https and no system CA bundle was found: set router.upstream_ca_file"
    )


def _tls(dest: cfg.Destination, ca_file: str | None, pod: cfg.Pod | None = None) -> dict[str, Any]:
    """The cluster fields for reaching ``dest`` (or one pod of it) over TLS, if https:
    the certificate checked against ``ca_file`` and, given a name, against the name."""
    if not dest.tls or ca_file is None:
        return {}
    validation: dict[str, Any] = {"trusted_ca": {"filename": ca_file}}
    tls: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": {"validation_context": validation},
    }
    if (name := dest.server_name(pod)) is not None:
        tls["sni"] = name
        validation["match_typed_subject_alt_names"] = [
            {"san_type": "DNS", "matcher": {"exact": name}}
        ]
    return {"transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": tls}}


def _upstream_key(dest: cfg.Destination) -> dict[str, Any]:
    """The cluster fields that put ``dest``'s own key (``api_key_env``) on every request
    Envoy sends it, in place of the client's: pinned or not, so a request that fails
    open (ace-extproc down, a bypass) carries it too. Envoy reads the variable from its
    own environment (``%ENVIRONMENT()%``); the key is never in the rendered file."""
    if not dest.api_key_env:
        return {}
    mutation = {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3."
            "HeaderMutation",
            "mutations": {
                "request_mutations": [
                    {
                        "append": {
                            "header": {
                                "key": "authorization",
                                "value": f"Bearer %ENVIRONMENT({dest.api_key_env})%",
                            },
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                        }
                    }
                ]
            },
        },
    }
    codec = {
        "name": "envoy.filters.http.upstream_codec",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3."
            "UpstreamCodec"
        },
    }
    options = {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http_protocol_options": {}},
        "http_filters": [mutation, codec],
    }
    return {
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": options
        }
    }


# ---------------------------------------------------------------- clusters


class Host(NamedTuple):
    """A cluster endpoint; ``pod`` its ``Pod.key`` where it is one of the fleet's pods,
    kept in its metadata so that Envoy can name the pod that served a request."""

    host: str
    port: int
    weight: int | None = None
    pod: str | None = None


def _lb_endpoints(hosts: Sequence[Host]) -> list[dict[str, Any]]:
    out = []
    for h in hosts:
        ep: dict[str, Any] = {"endpoint": {"address": _socket_address(h.host, h.port)}}
        if h.weight is not None:
            ep["load_balancing_weight"] = h.weight
        if h.pod is not None:
            ep["metadata"] = {"filter_metadata": {ENDPOINT_NAMESPACE: {"pod": h.pod}}}
        out.append(ep)
    return out


def _cluster(
    name: str, hosts: Sequence[Host], *, standby: Sequence[Host] = (), **extra: Any
) -> dict[str, Any]:
    """A cluster of ``hosts``: STATIC when all are IPs, else STRICT_DNS (which resolves
    each name and keeps every address it returns). ``standby`` hosts sit at priority 1:
    no traffic while a priority-0 host is healthy, only retries that skip priority 0
    (``previous_priorities``)."""
    static = all(cfg.is_ip(h.host) for h in [*hosts, *standby])
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC" if static else "STRICT_DNS",
        "connect_timeout": CONNECT_TIMEOUT,
    }
    if not static:
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    cluster.update(extra)
    localities: list[dict[str, Any]] = [{"lb_endpoints": _lb_endpoints(hosts)}]
    if standby:
        localities.append({"priority": 1, "lb_endpoints": _lb_endpoints(standby)})
    cluster["load_assignment"] = {"cluster_name": name, "endpoints": localities}
    return cluster


def _pod_hosts(dest: cfg.Destination) -> list[Host]:
    """A destination's pods as hosts; weights only where the pods' differ (Envoy's are
    integers >= 1)."""
    pods = dest.pods
    if all(p.weight == pods[0].weight for p in pods):
        return [Host(p.host, p.port, None, p.key) for p in pods]
    top = max(p.weight for p in pods)
    return [Host(p.host, p.port, max(1, round(100 * p.weight / top)), p.key) for p in pods]


def _pod_clusters(fleet: cfg.Fleet, lb_policy: str, ca_file: str | None) -> list[dict[str, Any]]:
    clusters = []
    for dest in fleet.destinations:
        hosts = _pod_hosts(dest)
        clusters.append(
            _cluster(
                dest.cluster,
                hosts,
                lb_policy=lb_policy,
                circuit_breakers=_circuit_breakers(),
                **_tls(dest, ca_file),
                **_upstream_key(dest),
            )
        )
        for pod, host in zip(dest.pods, hosts, strict=True):
            # The destination's other pods stand by, so a retry of a request pinned to a
            # pod that is down lands on one of them (see _route_config).
            clusters.append(
                _cluster(
                    pod.cluster,
                    [host._replace(weight=None)],
                    standby=[h for h in hosts if h is not host],
                    circuit_breakers=_circuit_breakers(),
                    **_tls(dest, ca_file, pod),
                    **_upstream_key(dest),
                )
            )
    return clusters


def _override_host_policy(lb_policy: str) -> dict[str, Any]:
    """override_host: the host named by x-ace-upstream, else by the envoy.lb metadata
    (GIE gateways' ext_procs), else ``lb_policy`` picks (no header: fail-open). A list
    ``primary,fallback,...`` gives each retry the next entry. It does not check health:
    a named host that is down is still tried, so ext_proc must track pod health."""
    ext, proto = _FALLBACK_POLICIES[lb_policy]
    fallback = {
        "name": _LB_EXT + ext,
        "typed_config": {"@type": _LB_TYPE + proto},
    }
    override = {
        "name": _LB_EXT + "override_host",
        "typed_config": {
            "@type": _LB_TYPE + "override_host.v3.OverrideHost",
            "override_host_sources": [
                {"header": UPSTREAM_HEADER},
                {"metadata": {"key": GIE_NAMESPACE, "path": [{"key": GIE_HEADER}]}},
            ],
            "fallback_policy": {"policies": [{"typed_extension_config": fallback}]},
        },
    }
    return {"policies": [{"typed_extension_config": override}]}


def _original_dst_cluster(dest: cfg.Destination, ca_file: str | None) -> dict[str, Any]:
    """ORIGINAL_DST: Envoy connects to whatever ip:port x-gateway-destination-endpoint
    names (the header ace-extproc sets; a client's is stripped before routing), so pods
    found by discovery need no headless Service for Envoy to know them. It cannot fall
    back: a request ace-extproc names no pod for gets 503 (UH); nor read a list, so one
    endpoint is named. Hosts are made per address and dropped after cleanup_interval."""
    return {
        "name": dest.cluster,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": CONNECT_TIMEOUT,
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": GIE_HEADER},
        "circuit_breakers": _circuit_breakers(),
        **_tls(dest, ca_file),
        **_upstream_key(dest),
    }


def _endpoint_clusters(
    fleet: cfg.Fleet, lb_policy: str, ca_file: str | None, original_dst: bool = False
) -> list[dict[str, Any]]:
    clusters = []
    for dest in fleet.destinations:
        if original_dst and not dest.hosted:  # a hosted API has no pod to name
            clusters.append(_original_dst_cluster(dest, ca_file))
            continue
        for pod in dest.pods:
            if not cfg.is_ip(pod.host) and not dest.hosted:
                # Envoy names hosts by ip:port; a DNS name could never be matched. A hosted
                # API is the exception: there is no host of its to pin, the header names
                # none Envoy knows, and its cluster's own balancing picks (as fail-open).
                raise cfg.ConfigError(
                    f"pod {pod.key}: endpoint mode needs pods given by IP address "
                    f"(as from EndpointSlices), got {pod.host!r}; use upstream mode cluster"
                )
        hosts = _pod_hosts(dest)
        extra: dict[str, Any] = {}
        if (found := dest.discovery) is not None:
            # Pods found at run time: Envoy resolves the same name, every address a
            # host, so the ip:port ace-extproc names is one Envoy knows (until its next
            # refresh it is not: override_host's fallback then picks, fail-open).
            if not found.hostname:
                raise cfg.ConfigError(
                    f"destination {dest.id}: pods found by label selector have no name for "
                    "Envoy to resolve: give discovery.hostname (a headless Service), or set "
                    "router.endpoint_cluster: original_dst"
                )
            if found.port is None:
                raise cfg.ConfigError(
                    f"destination {dest.id}: discovery by port_name needs 'port' too, "
                    "for the port Envoy connects to"
                )
            hosts.append(Host(found.hostname.rstrip("."), found.port))
            extra["dns_refresh_rate"] = f"{found.interval_s if found.type == 'dns' else 5.0:g}s"
        clusters.append(
            _cluster(
                dest.cluster,
                hosts,
                load_balancing_policy=_override_host_policy(lb_policy),
                # Below Envoy's default 50% healthy, the fallback would spread traffic
                # onto unhealthy hosts (panic mode); never do that.
                common_lb_config={"healthy_panic_threshold": {"value": 0}},
                circuit_breakers=_circuit_breakers(),
                **extra,
                **_tls(dest, ca_file),
                **_upstream_key(dest),
            )
        )
    return clusters


def _ext_proc_cluster(
    settings: cfg.Settings, uds: str | None, replicas: Sequence[str] = ()
) -> dict[str, Any]:
    if uds:
        return {
            "name": EXT_PROC_CLUSTER,
            "type": "STATIC",
            "connect_timeout": CONNECT_TIMEOUT,
            "typed_extension_protocol_options": _http2_options(),
            "load_assignment": {
                "cluster_name": EXT_PROC_CLUSTER,
                "endpoints": [
                    {"lb_endpoints": [{"endpoint": {"address": {"pipe": {"path": uds}}}}]}
                ],
            },
        }
    endpoints: list[Host] = []
    for address in replicas or [settings.listen]:
        host, port = split_host_port(address, "router.listen")
        # The server may bind a wildcard; Envoy must dial a concrete loopback address.
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
        endpoints.append(Host(host, port))
    extra: dict[str, Any] = {}
    if len(endpoints) > 1 or not cfg.is_ip(endpoints[0].host):
        extra = _replica_health()
    # Several servers (listed, or a DNS name resolving to several): each stream to the
    # less busy of two drawn at random. Not round robin: with the observe-only filter
    # (usage capture) every request opens two streams, and with an even number of
    # servers round robin would send every routing stream to the same half of them.
    return _cluster(
        EXT_PROC_CLUSTER,
        endpoints,
        lb_policy="LEAST_REQUEST",
        typed_extension_protocol_options=_http2_options(),
        **extra,
        **_ext_proc_tls(settings.ext_proc_tls),
    )


def _replica_health() -> dict[str, Any]:
    """Keep streams off a replica that is down. A dead one fails each stream at once,
    so to least-request it looks the least busy and would take most of them: gRPC
    health checks take it out within a second, and outlier detection at the first
    failed connections, before the next check. No panic mode: with every replica out
    a request fails as ``failure_mode`` says rather than go to a dead one."""
    return {
        "health_checks": [
            {
                "timeout": "0.5s",
                "interval": "1s",
                "unhealthy_threshold": 1,
                "healthy_threshold": 1,
                "no_traffic_interval": "1s",
                "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
            }
        ],
        "outlier_detection": {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 2,
            "consecutive_gateway_failure": 2,
            "interval": "1s",
            "base_ejection_time": "2s",
            "max_ejection_percent": 100,
        },
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
    }


def _ext_proc_tls(tls: cfg.ExtProcTLS | None) -> dict[str, Any]:
    """Envoy's side of mTLS to ace-extproc (``router.ext_proc_tls``): its client
    certificate, and ace-extproc's checked against the CA (and name, if given)."""
    if tls is None:
        return {}
    if not tls.client_cert_file:
        raise cfg.ConfigError(
            "router.ext_proc_tls: Envoy needs client_cert_file and client_key_file"
        )
    validation: dict[str, Any] = {"trusted_ca": {"filename": tls.ca_file}}
    context: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": {
            "tls_certificates": [
                {
                    "certificate_chain": {"filename": tls.client_cert_file},
                    "private_key": {"filename": tls.client_key_file},
                }
            ],
            "alpn_protocols": ["h2"],
            "validation_context": validation,
        },
    }
    if tls.server_name:
        context["sni"] = tls.server_name
        validation["match_typed_subject_alt_names"] = [
            {"san_type": "DNS", "matcher": {"exact": tls.server_name}}
        ]
    return {"transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": context}}


# ---------------------------------------------------------------- HTTP connection manager


def _grpc_service(settings: cfg.Settings) -> dict[str, Any]:
    """How the ext_proc filters and the access logger reach ace-extproc, with the
    token that says the stream is Envoy's (peer.py)."""
    service: dict[str, Any] = {"envoy_grpc": {"cluster_name": EXT_PROC_CLUSTER}}
    token = peer.token(settings)
    if token is not None:
        service["initial_metadata"] = [{"key": peer.METADATA_KEY, "value": token}]
    return service


def _ext_proc_filter(
    settings: cfg.Settings, processing_mode: str, message_timeout_s: float
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": _grpc_service(settings),
        "stat_prefix": "ace",
        # Fail-open: if ace-extproc is down or slow, the request goes on unpinned
        # (fully so in buffered mode only; see envoy/README.md). Closed where tenants or
        # keys are configured (router.failure_mode): such a request would go on
        # neither checked nor salted, so it is refused with a 503.
        "failure_mode_allow": not settings.fails_closed,
        "processing_mode": dict(PROCESSING_MODES[processing_mode]),
        "message_timeout": _duration(message_timeout_s, "message_timeout"),
        # ext_proc may switch response processing on for a single request.
        "allow_mode_override": True,
        "metadata_options": {"receiving_namespaces": {"untyped": list(METADATA_NAMESPACES)}},
    }
    if settings.fails_closed:
        config["status_on_error"] = {"code": "ServiceUnavailable"}
    return {"name": "envoy.filters.http.ext_proc", "typed_config": config}


OBSERVE_FILTER = "ace.observe"
# The observe-only filter's processing: response headers, then the body as it streams.
_OBSERVE_MODE = {
    "request_header_mode": "SKIP",
    "request_body_mode": "NONE",
    "request_trailer_mode": "SKIP",
    "response_header_mode": "SEND",
    "response_body_mode": "STREAMED",
    "response_trailer_mode": "SKIP",
}


def _observe_filter(settings: cfg.Settings) -> dict[str, Any]:
    """The observe-only filter (observe.py): Envoy sends it each response and its body
    without waiting for an answer, with the routing filter's ``ace`` metadata and the
    host that answered, so it delays nothing. It costs a stream a request: only where
    a body must be read (the access log does the rest). With usage capture, every
    response's; without, only the Responses API's (for the ids of stored responses:
    ``_observing_responses`` turns it on for that path alone)."""
    return {
        "name": OBSERVE_FILTER,
        "disabled": not settings.usage_capture,
        "typed_config": {
            "@type": "type.googleapis.com/"
            "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": _grpc_service(settings),
            "stat_prefix": "ace_observe",
            "observability_mode": True,
            "failure_mode_allow": True,
            "processing_mode": dict(_OBSERVE_MODE),
            "metadata_options": {"forwarding_namespaces": {"untyped": ["ace"]}},
            "response_attributes": list(RESPONSE_ATTRIBUTES),
        },
    }


def _access_log_service(settings: cfg.Settings) -> dict[str, Any]:
    """Envoy's gRPC access log to ace-extproc (access_log.py): one entry per request,
    with its ``ace`` metadata, the host that answered, status, flags and attempts,
    batched on one stream per worker: passive health and the ledger, for far less
    than a stream a request. On the connection manager, not the router's
    ``upstream_log``: one entry a request, Envoy's own replies included, and the
    final host with the attempt count already says a pin was retried away from."""
    return {
        "name": "envoy.access_loggers.http_grpc",
        "typed_config": {
            "@type": "type.googleapis.com/"
            "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": ACCESS_LOG_SERVICE_NAME,
                "grpc_service": _grpc_service(settings),
                "transport_api_version": "V3",
                "buffer_flush_interval": ACCESS_LOG_FLUSH_INTERVAL,
                "buffer_size_bytes": ACCESS_LOG_BUFFER_BYTES,
            },
        },
    }


def _previous_hosts() -> list[dict[str, Any]]:
    return [
        {
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions."
                "retry.host.previous_hosts.v3.PreviousHostsPredicate"
            },
        }
    ]


def _endpoint_routes(config: cfg.Config) -> list[dict[str, Any]]:
    """Endpoint mode: straight to the destination cluster, whose override_host policy
    picks the host; no header (ext_proc down, shadow, a bypass) means its fallback
    policy picks (fail-open). With several destinations, ext_proc's x-ace-destination
    first chooses the cluster (routes matching pod IPs would not follow a changing
    fleet; destinations change rarely)."""

    def action() -> dict[str, Any]:  # fresh per route: callers may mutate the result
        return {
            "timeout": "0s",
            "idle_timeout": ROUTE_IDLE_TIMEOUT,
            **_host_rewrite(config),
            "retry_policy": {
                # Each retry takes the next host of the list; past its end, the fallback
                # policy picks one not tried yet (previous_hosts acts only there). 502-504
                # (an overloaded or draining engine) move on; a 500 would repeat, so no.
                "retry_on": "connect-failure,refused-stream,reset,gateway-error",
                "num_retries": 2,
                "retry_host_predicate": _previous_hosts(),
                "host_selection_retry_max_attempts": 3,
            },
        }

    routes: list[dict[str, Any]] = []
    if len(config.fleet.destinations) > 1:
        routes.append(
            {
                "name": "destination",
                "match": {
                    "prefix": "/",
                    "headers": [{"name": DESTINATION_HEADER, "present_match": True}],
                },
                "route": {"cluster_header": DESTINATION_HEADER, **action()},
            }
        )
    routes.append(
        {
            "name": "default",
            "match": {"prefix": "/"},
            "route": {"cluster": config.fleet.default.cluster, **action()},
        }
    )
    return routes


def _observing_responses(routes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``routes``, each first also as a copy for the Responses API's path that turns the
    observe-only filter on (disabled elsewhere without usage capture), so the ids of
    stored responses are read (observe.py) at no cost to any other path. Envoy matches
    the normalized path without its query, as the engine's server does."""
    enable = {
        OBSERVE_FILTER: {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3."
            "ExtProcPerRoute",
            "overrides": {"processing_mode": dict(_OBSERVE_MODE)},
        }
    }
    observed = []
    for route in routes:
        match = {k: v for k, v in route["match"].items() if k != "prefix"}
        observed.append(
            {
                **route,
                "name": f"{route['name']}_responses",
                "match": {"path": RESPONSES_PATH, **match},
                "typed_per_filter_config": enable,
            }
        )
    return [*observed, *routes]


def _host_rewrite(config: cfg.Config) -> dict[str, Any]:
    """An https upstream by name (a hosted API) must be asked for by its own name, not
    the gateway's: Host is rewritten to the chosen host's name. Hosts given by IP have
    none, so their requests keep the client's Host."""
    named = any(d.tls and d.server_name() is not None for d in config.fleet.destinations)
    return {"auto_host_rewrite": True} if named else {}


def _route_config(
    config: cfg.Config, upstream_mode: str, observe_responses_api: bool = False
) -> dict[str, Any]:
    retry = {"retry_on": "connect-failure,reset", "num_retries": 1}
    # A pinned request whose pod fails to connect or resets retries on a standby pod of
    # the pod's cluster (priority 1), never the same pod again.
    pinned_retry = {
        "retry_on": "connect-failure,refused-stream,reset",
        "num_retries": 2,
        "retry_priority": {
            "name": "envoy.retry_priorities.previous_priorities",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.retry.priority."
                "previous_priorities.v3.PreviousPrioritiesConfig",
                "update_frequency": 1,
            },
        },
        "retry_host_predicate": _previous_hosts(),
        "host_selection_retry_max_attempts": 3,
    }
    no_timeout = {"timeout": "0s", "idle_timeout": ROUTE_IDLE_TIMEOUT, **_host_rewrite(config)}
    cluster_routes = [
        {
            # Pinned by ext_proc: the header names a single-pod cluster.
            "name": "pinned",
            "match": {
                "prefix": "/",
                "headers": [{"name": UPSTREAM_HEADER, "present_match": True}],
            },
            "route": {
                "cluster_header": UPSTREAM_HEADER,
                **no_timeout,
                "retry_policy": pinned_retry,
            },
        },
        {
            # Fail-open: ext_proc down, shadow mode, or no decision.
            "name": "default",
            "match": {"prefix": "/"},
            "route": {
                "cluster": config.fleet.default.cluster,
                **no_timeout,
                "retry_policy": {**retry, "retry_host_predicate": _previous_hosts()},
            },
        },
    ]
    routes = _endpoint_routes(config) if upstream_mode == "endpoint" else cluster_routes
    if observe_responses_api:
        routes = _observing_responses(routes)
    return {
        "name": "ace",
        # On the route_config, so Envoy's own error replies carry them too. An absent
        # metadata key renders as an empty value, and empty headers are not added.
        "response_headers_to_add": [
            {"header": {"key": k, "value": v}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            for k, v in RESPONSE_HEADERS.items()
        ],
        "virtual_hosts": [
            {
                "name": "ace",
                "domains": ["*"],
                # BUFFERED bodies are limited by this (Envoy's default is ~1 MiB: 413 above).
                "request_body_buffer_limit": config.settings.max_body_bytes,
                "routes": routes,
            }
        ],
    }


def _access_log(target: str, endpoint: bool) -> list[dict[str, Any]]:
    """The HCM's access loggers: JSON lines to ``target`` (see ``ACCESS_LOG_STREAMS``)."""
    if target == "off":
        return []
    fields = ENDPOINT_ACCESS_LOG_FIELDS if endpoint else ACCESS_LOG_FIELDS
    log_format = {"json_format": dict(fields)}
    prefix = "type.googleapis.com/envoy.extensions.access_loggers."
    if target in ACCESS_LOG_STREAMS:
        kind = target.capitalize()
        logger = {
            "name": f"envoy.access_loggers.{target}",
            "typed_config": {
                "@type": f"{prefix}stream.v3.{kind}AccessLog",
                "log_format": log_format,
            },
        }
    else:
        logger = {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": f"{prefix}file.v3.FileAccessLog",
                "path": target,
                "log_format": log_format,
            },
        }
    return [logger]


def _http_connection_manager(
    config: cfg.Config,
    processing_mode: str,
    message_timeout_s: float,
    ext_proc: bool,
    upstream_mode: str,
    access_log: str,
) -> dict[str, Any]:
    endpoint = upstream_mode == "endpoint"
    stripped = (
        (*STRIPPED_REQUEST_HEADERS, DESTINATION_HEADER) if endpoint else STRIPPED_REQUEST_HEADERS
    )
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
        },
    }
    s = config.settings
    filters = [_ext_proc_filter(s, processing_mode, message_timeout_s)] if ext_proc else []
    loggers = _access_log(access_log, endpoint)
    observing = ext_proc and s.observe_responses
    if observing:
        loggers.append(_access_log_service(s))
        filters.append(_observe_filter(s))  # only a filter can read the response body
    if s.tenants.header is not None:  # only an auth filter of Envoy's may set it
        stripped = (*stripped, s.tenants.header)
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network."
            "http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "ace_ingress",
            "codec_type": "AUTO",
            # The path as the engine will serve it, before any filter or route looks:
            # /v1/%63hat/completions, //v1/chat/./completions and /v1%2Fchat%2Fcompletions
            # are the chat path to an engine's server, so they must be to ace-extproc.
            "normalize_path": True,
            "merge_slashes": True,
            # A client can quote the id its access-log entry carries.
            "always_set_request_id_in_response": True,
            "path_with_escaped_slashes_action": "UNESCAPE_AND_FORWARD",
            # Runs before route selection; the header_mutation *filter* would be too late
            # for cluster_header routing (the route is already chosen by then).
            "early_header_mutation_extensions": [
                {
                    "name": "envoy.http.early_header_mutation.header_mutation",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.http."
                        "early_header_mutation.header_mutation.v3.HeaderMutation",
                        "mutations": [{"remove": h} for h in stripped],
                    },
                }
            ],
            "access_log": loggers,
            "route_config": _route_config(config, upstream_mode, observing and not s.usage_capture),
            "http_filters": [*filters, router],
        },
    }


# ---------------------------------------------------------------- public API


class _Dumper(yaml.SafeDumper):
    """Writes shared sub-dicts out in full: anchors and aliases make the file hard to read."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render(
    config: cfg.Config,
    *,
    listen: str = "127.0.0.1:8080",
    admin: str = "127.0.0.1:9901",
    processing_mode: str = "buffered",
    message_timeout_s: float = 1.0,
    ext_proc_uds: str | None = None,
    ext_proc: bool = True,
    lb_policy: str = "LEAST_REQUEST",
    upstream_mode: str | None = None,
    access_log: str = "stdout",
    ext_proc_replicas: Sequence[str] = (),
) -> dict[str, Any]:
    """The Envoy bootstrap for ``config`` as a dict. ``ext_proc_uds`` (else
    ``settings.uds``) makes Envoy reach ace-extproc over a unix socket instead of
    ``settings.listen``; ``ext_proc_replicas`` (host:port each) spreads requests over
    several ace-extproc servers instead. ``ext_proc=False`` leaves out the ext_proc filter and its
    cluster: plain Envoy, the baseline that gateway-overhead benchmarks subtract.
    ``lb_policy`` (one of ``LB_POLICIES``) balances each destination's default
    cluster; ``ext_proc=False, lb_policy="ROUND_ROBIN"`` is plain round-robin Envoy.
    ``upstream_mode`` (one of ``UPSTREAM_MODES``; default ``settings.upstream_mode``)
    must match the server's, which reads the same setting. ``access_log``: JSON lines
    to Envoy's ``stdout`` (default) or ``stderr``, to a file path, or ``off``. Raises
    ConfigError on a bad address, mode, policy or timeout, or a pod given by name in
    endpoint mode."""
    upstream_mode = upstream_mode or config.settings.upstream_mode
    if upstream_mode not in UPSTREAM_MODES:
        raise cfg.ConfigError(
            f"upstream mode {upstream_mode!r}: expected one of {', '.join(UPSTREAM_MODES)}"
        )
    if processing_mode not in PROCESSING_MODES:
        raise cfg.ConfigError(
            f"processing mode {processing_mode!r}: expected one of {', '.join(PROCESSING_MODES)}"
        )
    if lb_policy not in LB_POLICIES:
        raise cfg.ConfigError(f"lb_policy {lb_policy!r}: expected one of {', '.join(LB_POLICIES)}")
    if not access_log or (access_log not in (*ACCESS_LOG_STREAMS, "off") and "/" not in access_log):
        raise cfg.ConfigError(
            f"access log {access_log!r}: expected stdout, stderr, off or a file path with a /"
        )
    cfg.check_discovery_mode(config.fleet, upstream_mode)
    https = any(d.tls for d in config.fleet.destinations)
    ca_file = upstream_ca_file(config.settings) if https else None
    s = config.settings
    if upstream_mode == "endpoint" and s.endpoint_cluster == "original_dst" and s.mode != "prod":
        raise cfg.ConfigError(
            "router.endpoint_cluster: original_dst routes only to the endpoint "
            "ace-extproc names, which it does in router.mode: prod only (a request it "
            "names none for gets 503)"
        )
    if upstream_mode == "endpoint":
        original_dst = s.endpoint_cluster == "original_dst"
        clusters = _endpoint_clusters(config.fleet, lb_policy, ca_file, original_dst)
    else:
        clusters = _pod_clusters(config.fleet, lb_policy, ca_file)
    if ext_proc:
        clusters.insert(
            0,
            _ext_proc_cluster(
                config.settings, ext_proc_uds or config.settings.uds, ext_proc_replicas
            ),
        )
    return {
        "admin": {"address": _bind_address(admin, "admin")},
        "static_resources": {
            "listeners": [
                {
                    "name": "ace",
                    "address": _bind_address(listen, "listen"),
                    "filter_chains": [
                        {
                            "filters": [
                                _http_connection_manager(
                                    config,
                                    processing_mode,
                                    message_timeout_s,
                                    ext_proc,
                                    upstream_mode,
                                    access_log,
                                )
                            ]
                        }
                    ],
                }
            ],
            "clusters": clusters,
        },
    }


def render_yaml(
    config: cfg.Config,
    *,
    listen: str = "127.0.0.1:8080",
    admin: str = "127.0.0.1:9901",
    processing_mode: str = "buffered",
    message_timeout_s: float = 1.0,
    ext_proc_uds: str | None = None,
    ext_proc: bool = True,
    lb_policy: str = "LEAST_REQUEST",
    upstream_mode: str | None = None,
    access_log: str = "stdout",
    ext_proc_replicas: Sequence[str] = (),
) -> str:
    """``render`` as YAML, with a header saying where it came from."""
    doc = render(
        config,
        ext_proc_replicas=ext_proc_replicas,
        listen=listen,
        admin=admin,
        processing_mode=processing_mode,
        message_timeout_s=message_timeout_s,
        ext_proc_uds=ext_proc_uds,
        ext_proc=ext_proc,
        lb_policy=lb_policy,
        upstream_mode=upstream_mode,
        access_log=access_log,
    )
    what = f"processing mode: {processing_mode}" if ext_proc else "no ext_proc"
    if (upstream_mode or config.settings.upstream_mode) == "endpoint":
        what += ", upstream mode: endpoint"
    if lb_policy != "LEAST_REQUEST":
        what += f", default cluster {lb_policy}"
    header = (
        f"# Envoy bootstrap rendered by `ace-extproc envoy-config` ({what}).\n"
        "# Do not edit by hand: re-render it (see envoy/README.md).\n"
    )
    return header + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=100)


# ---------------------------------------------------------------- stats listener

STATS_CLUSTER = "envoy_admin"
STATS_PATH = "/stats/prometheus"


def with_stats_listener(text: str, stats_listen: str, admin: str) -> str:
    """The rendered bootstrap ``text`` with one more listener on ``stats_listen`` that
    serves only the admin's ``/stats/prometheus`` (every other path: 404), so a scraper
    can reach Envoy's stats without the admin port, which can also drain or stop it."""
    doc = yaml.safe_load(text)
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
        },
    }
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
        "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "envoy_stats",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "stats",
                    "domains": ["*"],
                    "routes": [
                        {"match": {"path": STATS_PATH}, "route": {"cluster": STATS_CLUSTER}}
                    ],
                }
            ]
        },
        "http_filters": [router],
    }
    doc["static_resources"]["listeners"].append(
        {
            "name": "envoy_stats",
            "address": _bind_address(stats_listen, "--stats-listen"),
            "filter_chains": [
                {
                    "filters": [
                        {
                            "name": "envoy.filters.network.http_connection_manager",
                            "typed_config": hcm,
                        }
                    ]
                }
            ],
        }
    )
    admin_address = _bind_address(admin, "admin")
    doc["static_resources"]["clusters"].append(
        {
            "name": STATS_CLUSTER,
            "type": "STATIC",
            "connect_timeout": CONNECT_TIMEOUT,
            "load_assignment": {
                "cluster_name": STATS_CLUSTER,
                "endpoints": [{"lb_endpoints": [{"endpoint": {"address": admin_address}}]}],
            },
        }
    )
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    return header + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=100)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fleet", metavar="FILE", help="fleet YAML (default: the built-in 4-pod simulated fleet)"
    )
    parser.add_argument(
        "--listen",
        default="127.0.0.1:8080",
        metavar="IP:PORT",
        help="Envoy's HTTP listener (default: %(default)s)",
    )
    parser.add_argument(
        "--admin",
        default="127.0.0.1:9901",
        metavar="IP:PORT",
        help="Envoy's admin listener (default: %(default)s)",
    )
    parser.add_argument(
        "--processing-mode",
        choices=tuple(PROCESSING_MODES),
        default="buffered",
        help="how the request body reaches ext_proc (default: buffered)",
    )
    parser.add_argument(
        "--message-timeout",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="ext_proc per-message timeout, buffered mode; on expiry the request fails open "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--ext-proc-uds",
        metavar="PATH",
        help="reach ace-extproc over this unix socket (default: router.uds, else router.listen)",
    )
    parser.add_argument(
        "--upstream-mode",
        choices=UPSTREAM_MODES,
        help="how ext_proc names the pod: a per-pod cluster, or ip:port in one cluster per "
        "destination (override_host; IP pods only) (default: router.upstream_mode, else cluster)",
    )
    parser.add_argument(
        "--access-log",
        default="stdout",
        metavar="stdout|stderr|off|PATH",
        help="where Envoy writes its JSON access log, with ace-extproc's decision "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--stats-listen",
        metavar="IP:PORT",
        help="a listener serving only the admin's /stats/prometheus (default: none)",
    )
    parser.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")


def run(args: argparse.Namespace) -> int:
    try:
        text = render_yaml(
            cfg.load(args.fleet),
            listen=args.listen,
            admin=args.admin,
            processing_mode=args.processing_mode,
            message_timeout_s=args.message_timeout,
            ext_proc_uds=args.ext_proc_uds,
            upstream_mode=args.upstream_mode,
            access_log=args.access_log,
        )
        if getattr(args, "stats_listen", None):
            text = with_stats_listener(text, args.stats_listen, args.admin)
    except ValueError as exc:  # ConfigError, and the ValueError of an unknown ttft_model
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as exc:
            print(f"error: {args.output}: {exc.strerror}", file=sys.stderr)
            return 2
    else:
        sys.stdout.write(text)
    return 0
