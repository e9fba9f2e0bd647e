"""Pieces of hand-built Envoy bootstraps, for the tests that configure the real Envoy as
another gateway would (GIE's, Envoy Gateway's): static hosts, an ``override_host``
load-balancing policy, a plaintext or TLS HTTP/2 cluster for the ext_proc server, and a
listener whose connection manager routes everything to one cluster."""

from __future__ import annotations

from typing import Any

T = "type.googleapis.com/"
LB = T + "envoy.extensions.load_balancing_policies."
HCM = T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


def hosts(ports: list[int]) -> list[dict[str, Any]]:
    """Endpoints on 127.0.0.1 at ``ports``."""
    return [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
        for p in ports
    ]


def static_cluster(name: str, ports: list[int]) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "5s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": hosts(ports)}]},
    }


def override_host(sources: list[dict[str, Any]], fallback: str) -> dict[str, Any]:
    """A cluster's ``load_balancing_policy``: the host the sources name, else
    ``fallback`` (``round_robin``, ``least_request``)."""
    words = fallback.split("_")
    fallback_type = f"{LB}{fallback}.v3.{''.join(w.title() for w in words)}"
    policy = {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": LB + "override_host.v3.OverrideHost",
            "override_host_sources": sources,
            "fallback_policy": {
                "policies": [
                    {
                        "typed_extension_config": {
                            "name": f"envoy.load_balancing_policies.{fallback}",
                            "typed_config": {"@type": fallback_type},
                        }
                    }
                ]
            },
        },
    }
    return {"policies": [{"typed_extension_config": policy}]}


def grpc_cluster(name: str, port: int, *, tls: bool = False) -> dict[str, Any]:
    """The ext_proc server's cluster: HTTP/2, plaintext or TLS with the certificate not
    checked (a picker's self-signed one)."""
    cluster = static_cluster(name, [port])
    cluster["typed_extension_protocol_options"] = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }
    if tls:
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": T + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {"alpn_protocols": ["h2"]},
            },
        }
    return cluster


def bootstrap(
    listen: int,
    admin: int,
    http_filters: list[dict[str, Any]],
    route_cluster: str,
    clusters: list[dict[str, Any]],
) -> dict[str, Any]:
    """A listener on ``listen`` whose HTTP filters are ``http_filters`` then the router,
    every request routed to ``route_cluster``."""
    hcm = {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": HCM,
            "stat_prefix": "test",
            "route_config": {
                "virtual_hosts": [
                    {
                        "name": "all",
                        "domains": ["*"],
                        "routes": [
                            {
                                "match": {"prefix": "/"},
                                "route": {"cluster": route_cluster, "timeout": "60s"},
                            }
                        ],
                    }
                ]
            },
            "http_filters": [
                *http_filters,
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": {"@type": T + "envoy.extensions.filters.http.router.v3.Router"},
                },
            ],
        },
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "listener",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                    "filter_chains": [{"filters": [hcm]}],
                }
            ],
            "clusters": clusters,
        },
    }
