"""A TCP proxy that keeps what the engine sent, so a test can compare the bytes a
client got through Envoy with the bytes the real engine wrote."""

from __future__ import annotations

import asyncio
import contextlib


class RecordingProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.sent_by_engine: list[bytearray] = []  # one per connection
        self._server: asyncio.Server | None = None

    @property
    def address(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        record = bytearray()
        self.sent_by_engine.append(record)
        try:
            engine_r, engine_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, keep: bool) -> None:
            with contextlib.suppress(OSError):
                while data := await r.read(65536):
                    if keep:
                        record.extend(data)
                    w.write(data)
                    await w.drain()
            with contextlib.suppress(OSError):
                w.close()

        await asyncio.gather(pipe(client_r, engine_w, False), pipe(engine_r, client_w, True))


def http_bodies(raw: bytes) -> list[tuple[dict[str, str], bytes]]:
    """The HTTP/1.1 responses on one connection: headers and decoded body of each."""
    out = []
    pos = 0
    while pos < len(raw):
        end = raw.index(b"\r\n\r\n", pos)
        lines = raw[pos:end].decode("latin-1").split("\r\n")[1:]
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
        pos = end + 4
        body = bytearray()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                eol = raw.index(b"\r\n", pos)
                size = int(raw[pos:eol].split(b";")[0], 16)
                pos = eol + 2
                if size == 0:
                    pos = raw.index(b"\r\n", pos) + 2  # no trailers from these engines
                    break
                body += raw[pos : pos + size]
                pos += size + 2
        else:
            size = int(headers.get("content-length", "0"))
            body += raw[pos : pos + size]
            pos += size
        out.append((headers, bytes(body)))
    return out
