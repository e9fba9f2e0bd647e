"""An ``Outcome`` as Envoy ext_proc responses: header and body mutations, the
route-cache clear that makes ``x-ace-upstream`` steer routing, and the dynamic
metadata from which Envoy adds ``x-ace-served-by`` and
``x-ace-trace-prefix-kv-cache`` to the response (no response-phase exchange).
"""

from __future__ import annotations

from envoy.config.core.v3.base_pb2 import HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ProcessingResponse,
)

from ace_extproc.processor import UPSTREAM_HEADER, Outcome

METADATA_NAMESPACE = "ace"
# Some gateways cap a streamed chunk at 64 KiB; stay under it with room for framing.
STREAM_CHUNK = 62_000

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

# Answers that carry nothing: built once, never mutated.
HEADERS_CONTINUE = ProcessingResponse(request_headers=HeadersResponse())
BODY_CONTINUE = ProcessingResponse(request_body=BodyResponse())


def _set(mutation: HeaderMutation, key: str, value: bytes) -> None:
    option = mutation.set_headers.add()
    option.header.key = key
    option.header.raw_value = value  # Envoy ignores a mutation given only in `value`
    option.append_action = _OVERWRITE


def _fill(common: CommonResponse, outcome: Outcome, client_upstream: bool, with_body: bool) -> None:
    """Header (and, in buffered mode, body) mutations for the outcome.

    Built in place: upb copies a sub-message passed to a constructor, which for a
    16 KB body measured ~5x slower than filling the fields of one response.
    """
    common.SetInParent()  # an empty answer must still say which phase it answers
    if outcome.pod is not None:
        mutation = common.header_mutation
        _set(mutation, UPSTREAM_HEADER, outcome.pod.cluster.encode())
        if outcome.body is not None:
            # A changed body needs its new length, or Envoy fails the request with 500.
            _set(mutation, "content-length", str(len(outcome.body)).encode())
            if with_body:
                common.body_mutation.body = outcome.body
        common.clear_route_cache = True  # re-run routing on x-ace-upstream
    elif client_upstream:
        # Defence in depth: Envoy's early header mutation should already have removed it.
        common.header_mutation.remove_headers.append(UPSTREAM_HEADER)
        common.clear_route_cache = True


def _with_metadata(resp: ProcessingResponse, outcome: Outcome) -> ProcessingResponse:
    ace = resp.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
    ace["trace"].string_value = outcome.trace
    ace["mode"].string_value = outcome.mode.value
    ace["action"].string_value = outcome.action
    ace["prefix_key"].string_value = outcome.prefix_key
    if outcome.pod is not None:
        ace["served_by"].string_value = outcome.pod.key
    if outcome.would_pick is not None:
        ace["pod"].string_value = outcome.would_pick.key
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
    _fill(resp.request_headers.response, outcome, client_upstream, False)
    resp.mode_override.request_body_mode = ProcessingMode.NONE
    return _with_metadata(resp, outcome)


def body_decided(outcome: Outcome, client_upstream: bool) -> ProcessingResponse:
    """Buffered mode: the answer to the buffered body."""
    if outcome.reject_status:
        return immediate(outcome)
    resp = ProcessingResponse()
    _fill(resp.request_body.response, outcome, client_upstream, True)
    return _with_metadata(resp, outcome)


def duplex_decided(
    outcome: Outcome, client_upstream: bool, body: bytes
) -> list[ProcessingResponse]:
    """Full-duplex streamed mode: the held headers answer, then the body streamed back
    in chunks (Envoy forwards only what the processor returns)."""
    if outcome.reject_status:
        return [immediate(outcome)]
    headers = ProcessingResponse()
    _fill(headers.request_headers.response, outcome, client_upstream, False)
    out = [_with_metadata(headers, outcome)]
    data = outcome.body if outcome.body is not None else body
    view = memoryview(data)
    for start in range(0, max(len(data), 1), STREAM_CHUNK):
        chunk = ProcessingResponse()
        streamed = chunk.request_body.response.body_mutation.streamed_response
        streamed.body = bytes(view[start : start + STREAM_CHUNK])
        streamed.end_of_stream = start + STREAM_CHUNK >= len(data)
        out.append(chunk)
    return out
