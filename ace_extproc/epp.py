"""The Gateway API Inference Extension's endpoint-picker protocol (kubernetes-sigs/
gateway-api-inference-extension, docs/proposals/004-endpoint-picker-protocol, v1.0.0),
the parts read from Envoy's messages:

* **the subset** the data plane allows: filter metadata ``envoy.lb.subset_hint`` /
  ``x-gateway-destination-endpoint-subset``, a list of ``ip:port`` (or the request
  header of that name, comma-separated). The picker must pick only among them; an
  empty list, or one naming none of the pods, is answered 503.
* **the endpoint served**, which the data plane reports with the response in
  ``metadata_context`` ``envoy.lb`` / ``x-gateway-destination-endpoint-served``
  (after retries, it may be a fallback rather than the first endpoint named).

What the picker tells the data plane (``x-gateway-destination-endpoint``, header and
``envoy.lb`` metadata) is ``mutate.py``'s.
"""

from __future__ import annotations

from collections.abc import Mapping

from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

from ace_extproc.config import canonical_host

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"


def canonical_endpoint(value: str) -> str:
    """``ip:port`` (or ``[v6]:port``) spelled as ``Pod.endpoint`` spells it, so the two
    compare; anything else is returned stripped and will match no pod."""
    value = value.strip()
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        return value
    host = canonical_host(host.strip("[]"))
    return f"[{host}]:{int(port)}" if ":" in host else f"{host}:{int(port)}"


def subset(
    msg: ProcessingRequest, headers: Mapping[str, str], *, header: bool = True
) -> frozenset[str] | None:
    """The endpoints this request may go to, or None where the data plane set no
    subset. The metadata wins over the header where both are given; ``header``
    False: the header is not read (cluster mode names no endpoints)."""
    hint = msg.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is not None and SUBSET_KEY in hint.fields:
        value = hint.fields[SUBSET_KEY]
        kind = value.WhichOneof("kind")
        if kind == "list_value":
            items = [v.string_value for v in value.list_value.values]
        elif kind == "string_value":  # a single entry, or a comma-separated one
            items = value.string_value.split(",")
        else:
            items = []
        return frozenset(canonical_endpoint(i) for i in items if i.strip())
    value = headers.get(SUBSET_KEY) if header else None
    if value is None:
        return None
    return frozenset(canonical_endpoint(i) for i in value.split(",") if i.strip())


def served(msg: ProcessingRequest) -> str:
    """The endpoint the data plane says served the request, or ""."""
    lb = msg.metadata_context.filter_metadata.get(SERVED_NAMESPACE)
    if lb is None or SERVED_KEY not in lb.fields:
        return ""
    return canonical_endpoint(lb.fields[SERVED_KEY].string_value)
