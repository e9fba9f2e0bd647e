"""A trivial ext_proc server: the floor for a Python ext_proc doing ace-extproc's exchanges.

    python bench/trivial_extproc.py --listen 127.0.0.1:50061 --cluster ace_pod.sim.pod-0

Headers SEND, body BUFFERED (two exchanges), as ace-extproc's buffered mode: the headers
get an empty answer; the body is parsed (msgspec), pinned to one fixed pod cluster with
``x-ace-upstream`` + ``clear_route_cache``, rewritten with one added field (and its new
content-length), and answered with dynamic metadata for Envoy's response headers. No
routing logic: what it costs is gRPC, protobuf and JSON, nothing ace-specific.
Self-contained (no ace_extproc imports), so it runs as a script from any directory.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import AsyncIterator

import grpc
import msgspec
import uvloop
from envoy.config.core.v3.base_pb2 import HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HeaderMutation,
    HeadersResponse,
    ProcessingRequest,
    ProcessingResponse,
)

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_HEADERS_CONTINUE = ProcessingResponse(request_headers=HeadersResponse())
_ADDED_FIELD = b'"cache_salt":"trivial-extproc",'  # one field, as a router would add


class _Message(msgspec.Struct):
    role: str
    content: str


class _Chat(msgspec.Struct):
    # A typed decode, as a real router would do to read the prompt.
    model: str
    messages: list[_Message]


def _set(mutation: HeaderMutation, key: str, value: bytes) -> None:
    option = mutation.set_headers.add()
    option.header.key = key
    option.header.raw_value = value  # Envoy ignores a mutation given only in `value`
    option.append_action = _OVERWRITE


class TrivialProcessor(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, cluster: str, served_by: str) -> None:
        self.cluster = cluster.encode()
        self.served_by = served_by

    async def Process(
        self, request_iterator: AsyncIterator[ProcessingRequest], context: object
    ) -> AsyncIterator[ProcessingResponse]:
        # The Envoy config asks for request headers and the buffered body only.
        async for msg in request_iterator:
            if msg.HasField("request_body"):
                yield self._on_body(msg.request_body.body)
            else:
                yield _HEADERS_CONTINUE

    def _on_body(self, body: bytes) -> ProcessingResponse:
        chat = msgspec.json.decode(body, type=_Chat)
        start = body.index(b"{") + 1
        new_body = body[:start] + _ADDED_FIELD + body[start:]
        # Filled in place: nested constructors copy sub-messages (~5x slower for 16 KB).
        resp = ProcessingResponse()
        common = resp.request_body.response
        _set(common.header_mutation, "x-ace-upstream", self.cluster)
        _set(common.header_mutation, "content-length", str(len(new_body)).encode())
        common.body_mutation.body = new_body
        common.clear_route_cache = True  # re-run routing on x-ace-upstream
        ace = resp.dynamic_metadata.fields["ace"].struct_value.fields
        ace["served_by"].string_value = self.served_by
        ace["trace"].string_value = f"trivial model={chat.model} turns={len(chat.messages)}"
        return resp


async def serve(listen: str, cluster: str, served_by: str) -> None:
    limit = 64 * 1024 * 1024  # whole buffered bodies arrive in one message
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ]
    )
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(
        TrivialProcessor(cluster, served_by), server
    )
    if server.add_insecure_port(listen) == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    print(f"trivial ext_proc serving on {listen}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--listen", default="127.0.0.1:50061", help="gRPC host:port")
    ap.add_argument("--cluster", default="ace_pod.sim.pod-0", help="Envoy cluster to pin to")
    ap.add_argument("--served-by", default="pod-0", help="metadata for x-ace-served-by")
    args = ap.parse_args(argv)
    uvloop.run(serve(args.listen, args.cluster, args.served_by))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
