"""An ``Outcome`` as Envoy ext_proc responses: header and body mutations, the
route-cache clear that makes ``x-ace-upstream`` steer routing, and the dynamic
metadata from which Envoy adds ``x-ace-served-by`` and
``x-ace-trace-prefix-kv-cache`` to the response (no response-phase exchange).
"""

from __future__ import annotations

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ImmediateResponse,
    ProcessingResponse,
    StreamedBodyResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus

from ace_extproc.processor import UPSTREAM_HEADER, Outcome

METADATA_NAMESPACE = "ace"
# Some gateways cap a streamed chunk at 64 KiB; stay under it with room for framing.
STREAM_CHUNK = 62_000

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

# Answers that carry nothing: built once, never mutated.
HEADERS_CONTINUE = ProcessingResponse(request_headers=HeadersResponse())
BODY_CONTINUE = ProcessingResponse(request_body=BodyResponse())


def _header(key: str, value: bytes) -> HeaderValueOption:
    # Envoy reads mutations from raw_value only; a mutation in `value` is ignored.
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value), append_action=_OVERWRITE)


def _common(outcome: Outcome, client_upstream: bool, with_body: bool) -> CommonResponse | None:
    """Header (and, in buffered mode, body) mutations, or None when there are none."""
    if outcome.pod is not None:
        sets = [_header(UPSTREAM_HEADER, outcome.pod.cluster.encode())]
        body = None
        if outcome.body is not None:
            # A changed body needs its new length, or Envoy fails the request with 500.
            sets.append(_header("content-length", str(len(outcome.body)).encode()))
            if with_body:
                body = BodyMutation(body=outcome.body)
        return CommonResponse(
            header_mutation=HeaderMutation(set_headers=sets),
            body_mutation=body,
            clear_route_cache=True,  # re-run routing on x-ace-upstream
        )
    if client_upstream:
        # Defence in depth: Envoy's early header mutation should already have removed it.
        return CommonResponse(
            header_mutation=HeaderMutation(remove_headers=[UPSTREAM_HEADER]),
            clear_route_cache=True,
        )
    return None


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
    resp = ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=outcome.reject_status),
            headers=HeaderMutation(set_headers=[_header("content-type", b"application/json")]),
            body=outcome.reject_body,
            details=outcome.action,
        )
    )
    return _with_metadata(resp, outcome)


def headers_decided(outcome: Outcome, client_upstream: bool) -> ProcessingResponse:
    """Buffered mode: the headers alone decided (a bypass); Envoy need not send the body."""
    if outcome.reject_status:
        return immediate(outcome)
    resp = ProcessingResponse(
        request_headers=HeadersResponse(response=_common(outcome, client_upstream, False)),
        mode_override=ProcessingMode(request_body_mode=ProcessingMode.NONE),
    )
    return _with_metadata(resp, outcome)


def body_decided(outcome: Outcome, client_upstream: bool) -> ProcessingResponse:
    """Buffered mode: the answer to the buffered body."""
    if outcome.reject_status:
        return immediate(outcome)
    resp = ProcessingResponse(
        request_body=BodyResponse(response=_common(outcome, client_upstream, True))
    )
    return _with_metadata(resp, outcome)


def duplex_decided(
    outcome: Outcome, client_upstream: bool, body: bytes
) -> list[ProcessingResponse]:
    """Full-duplex streamed mode: the held headers answer, then the body streamed back
    in chunks (Envoy forwards only what the processor returns)."""
    if outcome.reject_status:
        return [immediate(outcome)]
    headers = ProcessingResponse(
        request_headers=HeadersResponse(response=_common(outcome, client_upstream, False))
    )
    out = [_with_metadata(headers, outcome)]
    data = outcome.body if outcome.body is not None else body
    for start in range(0, max(len(data), 1), STREAM_CHUNK):
        chunk = data[start : start + STREAM_CHUNK]
        last = start + STREAM_CHUNK >= len(data)
        mutation = BodyMutation(
            streamed_response=StreamedBodyResponse(body=chunk, end_of_stream=last)
        )
        out.append(
            ProcessingResponse(
                request_body=BodyResponse(response=CommonResponse(body_mutation=mutation))
            )
        )
    return out
