"""An ``Outcome`` as Envoy ext_proc responses: header and body mutations, the
route-cache clear that makes ``x-ace-upstream`` steer routing, and the dynamic
metadata from which ace-extproc's own Envoy adds ``x-ace-served-by`` and
``x-ace-trace-prefix-kv-cache`` to the response (no response-phase exchange). A
gateway that sends the response's headers on the routing stream (Envoy Gateway's
extension policy, the endpoint-picker protocol) gets the same headers in the answer
to them (``reported``).

Two ways to name the pod (``router.upstream_mode``, carried on ``Outcome.endpoint``):
cluster mode sets ``x-ace-upstream`` to the pod's own Envoy cluster; endpoint mode
names hosts of one destination cluster by ``ip:port``, primary first, then fallbacks
for Envoy's retries, in the Gateway API Inference Extension's endpoint-picker form.

``changes`` and ``metadata`` are the single definition of what Envoy is told; the
answers below only write them out.
"""

from __future__ import annotations

from typing import NamedTuple

from envoy.config.core.v3.base_pb2 import HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ProcessingResponse,
)

from ace_extproc.config import default_cluster
from ace_extproc.outcome import UPSTREAM_HEADER, Outcome

METADATA_NAMESPACE = "ace"
# The Gateway API Inference Extension's endpoint-picker protocol (kubernetes-sigs/
# gateway-api-inference-extension, docs/proposals/004-endpoint-picker-protocol, v0.4.0+):
# the picked endpoints as "ip:port[,ip:port...]" (the first used, retries go down the
# list) in this header AND in dynamic metadata envoy.lb/x-gateway-destination-endpoint,
# the same value in both. Envoy's override_host policy reads either.
GIE_HEADER = "x-gateway-destination-endpoint"
GIE_NAMESPACE = "envoy.lb"
# Endpoint mode: the destination cluster holding those hosts, for fleets of several
# destinations (a `cluster_header` route); the same name as ``Destination.cluster``.
DESTINATION_HEADER = "x-ace-destination"
# What ace-extproc did, on the response: the decision's trace, the pod it pinned, and
# the pod that answered (a retry's, where Envoy retried elsewhere).
TRACE_HEADER = "x-ace-trace-prefix-kv-cache"
PINNED_HEADER = "x-ace-pinned"
SERVED_BY_HEADER = "x-ace-served-by"
# Some gateways cap a streamed chunk at 64 KiB; stay under it with room for framing.
STREAM_CHUNK = 62_000

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

# Answers that carry nothing: built once, never mutated.
HEADERS_CONTINUE = ProcessingResponse(request_headers=HeadersResponse())
BODY_CONTINUE = ProcessingResponse(request_body=BodyResponse())
RESPONSE_HEADERS_CONTINUE = ProcessingResponse(response_headers=HeadersResponse())
# The native API (execute.py): the body as usual, and this one response's headers and
# whole body too, so it can be put in the envelope (Envoy's mode override, allowed
# only in a headers answer; it replaces the whole mode, so every field is given).
EXECUTE_HEADERS = ProcessingResponse(
    request_headers=HeadersResponse(),
    mode_override=ProcessingMode(
        request_header_mode=ProcessingMode.SEND,
        request_body_mode=ProcessingMode.BUFFERED,
        request_trailer_mode=ProcessingMode.SKIP,
        response_header_mode=ProcessingMode.SEND,
        response_body_mode=ProcessingMode.BUFFERED,
        response_trailer_mode=ProcessingMode.SKIP,
    ),
)


def _set(mutation: HeaderMutation, key: str, value: bytes) -> None:
    option = mutation.set_headers.add()
    option.header.key = key
    option.header.raw_value = value  # Envoy ignores a mutation given only in `value`
    option.append_action = _OVERWRITE


def endpoints(outcome: Outcome) -> str:
    """The endpoint-mode value: the pinned pod, then its fallbacks, comma-separated, as
    Envoy names their hosts (``Pod.endpoint``). Only an IP pod can be named: a hostname
    matches no host, so Envoy's fallback policy picks instead (the renderer refuses
    such pods in endpoint mode)."""
    pod = outcome.pod
    assert pod is not None
    if not outcome.fallbacks:
        return pod.endpoint
    return ",".join([pod.endpoint, *[p.endpoint for p in outcome.fallbacks if p != pod]])


class Changes(NamedTuple):
    """What an answer changes in the request."""

    headers: list[tuple[str, bytes]]  # set, overwriting
    remove: list[str]
    clear_route_cache: bool
    picked: str | None  # endpoint mode: the endpoint list, also in envoy.lb metadata


def changes(outcome: Outcome, client_upstream: bool) -> Changes:
    headers: list[tuple[str, bytes]] = []
    remove: list[str] = []
    clear = False
    picked = None
    if outcome.pod is not None:
        if outcome.endpoint:
            picked = endpoints(outcome)
            value = picked.encode()
            headers.append((UPSTREAM_HEADER, value))
            headers.append((GIE_HEADER, value))
            cluster = default_cluster(outcome.pod.destination)
            headers.append((DESTINATION_HEADER, cluster.encode()))
        else:
            headers.append((UPSTREAM_HEADER, outcome.pod.cluster.encode()))
        if outcome.upstream_auth is not None:  # the destination's key, not the client's
            headers.append(("authorization", outcome.upstream_auth))
        # Re-run routing on x-ace-upstream (cluster mode) or x-ace-destination (endpoint
        # mode, several destinations; with one, override_host reads the header anyway).
        clear = True
    elif client_upstream:
        # Defence in depth: Envoy's early header mutation should already have removed it.
        remove.append(UPSTREAM_HEADER)
        clear = True
    if outcome.path is not None:
        headers.append((":path", outcome.path.encode()))
    if outcome.body is not None:
        # A changed body needs its new length, or Envoy fails the request with 500.
        headers.append(("content-length", str(len(outcome.body)).encode()))
    return Changes(headers, remove, clear, picked)


def metadata(outcome: Outcome) -> list[tuple[str, str | float]]:
    """The ``ace`` namespace's dynamic metadata, from which Envoy writes the response
    headers and access log fields."""
    fields: list[tuple[str, str | float]] = [
        ("trace", outcome.trace),
        ("mode", outcome.mode),  # a StrEnum: the str itself (.value is a slow property)
        ("action", outcome.action),
        ("prefix_key", outcome.prefix_key),
        ("saved_tokens", float(outcome.saved_tokens)),
        # The same estimate's prompt size: the saved share is what holds in any tokenizer.
        ("prompt_tokens", float(outcome.prompt_tokens)),
    ]
    if outcome.pod is not None:
        fields.append(("served_by", outcome.pod.key))
    if outcome.would_pick is not None:
        fields.append(("pod", outcome.would_pick.key))
    if outcome.store_tenant:  # the observe filter remembers the answer's id (observe.py)
        fields.append(("store_tenant", outcome.store_tenant))
    if outcome.lora_pick:  # its answer frees the adapter (observe.py)
        fields.append(("lora_pick", float(outcome.lora_pick)))
    return fields


def _fill(
    common: CommonResponse, outcome: Outcome, client_upstream: bool, with_body: bool
) -> str | None:
    """Header (and, in buffered mode, body) mutations for the outcome; returns the
    endpoint list in endpoint mode, for the metadata.

    Built in place: upb copies a sub-message passed to a constructor, which for a
    16 KB body measured ~5x slower than filling the fields of one response.
    """
    common.SetInParent()  # an empty answer must still say which phase it answers
    change = changes(outcome, client_upstream)
    for key, value in change.headers:
        _set(common.header_mutation, key, value)
    if change.remove:  # touching the field, even with nothing, would make it present
        common.header_mutation.remove_headers.extend(change.remove)
    common.clear_route_cache = change.clear_route_cache
    if with_body and outcome.body is not None:
        common.body_mutation.body = outcome.body
    return change.picked


def _with_metadata(
    resp: ProcessingResponse, outcome: Outcome, picked: str | None = None
) -> ProcessingResponse:
    fields = resp.dynamic_metadata.fields
    if picked is not None:
        fields[GIE_NAMESPACE].struct_value.fields[GIE_HEADER].string_value = picked
    ace = fields[METADATA_NAMESPACE].struct_value.fields
    for key, value in metadata(outcome):
        if isinstance(value, str):
            ace[key].string_value = value
        else:
            ace[key].number_value = value
    return resp


def immediate(outcome: Outcome) -> ProcessingResponse:
    resp = ProcessingResponse()
    answer = resp.immediate_response
    answer.status.code = outcome.reject_status
    _set(answer.headers, "content-type", b"application/json")
    answer.body = outcome.reject_body
    answer.details = outcome.action
    return _with_metadata(resp, outcome)


def headers_decided(outcome: Outcome, client_upstream: bool) -> ProcessingResponse:
    """Buffered mode: the headers alone decided (a bypass); Envoy need not send the body."""
    if outcome.reject_status:
        return immediate(outcome)
    resp = ProcessingResponse()
    picked = _fill(resp.request_headers.response, outcome, client_upstream, False)
    # An override replaces the whole mode, and a response-header mode left at DEFAULT
    # means SEND: say SKIP, or the bypass would cost a response-phase exchange.
    resp.mode_override.request_body_mode = ProcessingMode.NONE
    resp.mode_override.response_header_mode = ProcessingMode.SKIP
    return _with_metadata(resp, outcome, picked)


def body_decided(outcome: Outcome, client_upstream: bool) -> ProcessingResponse:
    """Buffered mode: the answer to the buffered body."""
    if outcome.reject_status:
        return immediate(outcome)
    resp = ProcessingResponse()
    picked = _fill(resp.request_body.response, outcome, client_upstream, True)
    return _with_metadata(resp, outcome, picked)


def reported(outcome: Outcome | None, served_by: str) -> ProcessingResponse:
    """The answer to a response's headers on a gateway that sends them: the headers
    ace-extproc's own Envoy writes from the metadata (``envoy_config.RESPONSE_HEADERS``),
    each only where it has a value. ``served_by``: the answering pod's name, "" where
    the gateway did not say which endpoint served."""
    resp = ProcessingResponse()
    mutation = resp.response_headers.response.header_mutation
    resp.response_headers.response.SetInParent()
    if outcome is not None:
        if outcome.trace:
            _set(mutation, TRACE_HEADER, outcome.trace.encode())
        if outcome.pod is not None:
            _set(mutation, PINNED_HEADER, outcome.pod.key.encode())
    if served_by:
        _set(mutation, SERVED_BY_HEADER, served_by.encode())
    return resp


def response_replaced(body: bytes) -> ProcessingResponse:
    """The answer to a buffered response body: ``body`` (JSON) instead."""
    resp = ProcessingResponse()
    common = resp.response_body.response
    _set(common.header_mutation, "content-type", b"application/json")
    _set(common.header_mutation, "content-length", str(len(body)).encode())
    common.body_mutation.body = body
    return resp


def duplex_decided(
    outcome: Outcome,
    client_upstream: bool,
    body: bytes,
    ended: bool = True,
    has_body: bool = True,
) -> list[ProcessingResponse]:
    """Full-duplex streamed mode: the held headers answered, then the body so far (the
    rewritten one, if any) streamed back in chunks, the last saying whether the body
    ``ended`` there (Envoy forwards only what the processor returns). A request
    without a body (``has_body`` False) gets the headers answer alone."""
    if outcome.reject_status:
        return [immediate(outcome)]
    headers = ProcessingResponse()
    picked = _fill(headers.request_headers.response, outcome, client_upstream, False)
    out = [_with_metadata(headers, outcome, picked)]
    if not has_body:
        return out
    data = outcome.body if outcome.body is not None else body
    if not data and not ended:
        return out  # nothing yet: the chunks follow as they come
    view = memoryview(data)
    for start in range(0, max(len(data), 1), STREAM_CHUNK):
        out.append(
            streamed_chunk(
                view[start : start + STREAM_CHUNK], ended and start + STREAM_CHUNK >= len(data)
            )
        )
    return out


def streamed_chunk(data: bytes | memoryview, end_of_stream: bool) -> ProcessingResponse:
    """Full-duplex: one chunk of the request body, going on to the upstream."""
    chunk = ProcessingResponse()
    streamed = chunk.request_body.response.body_mutation.streamed_response
    streamed.body = bytes(data)
    streamed.end_of_stream = end_of_stream
    return chunk


def response_chunk(data: bytes, end_of_stream: bool) -> ProcessingResponse:
    """Full-duplex: one chunk of the response body, passed on to the client unchanged
    (Envoy forwards only what the processor returns)."""
    chunk = ProcessingResponse()
    streamed = chunk.response_body.response.body_mutation.streamed_response
    streamed.body = data
    streamed.end_of_stream = end_of_stream
    return chunk
