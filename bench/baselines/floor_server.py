"""The floor of an HTTP server on this machine, for bench/throughput.py's "HTTP floor" rows: do-nothing
responders answering every request with a fixed body the size of the scorer's answer.

- ``python``: uvloop and httptools, what mnn-rollout's REST path is built on (uvicorn's protocol parses
  with httptools): parse the request, gather its body, write one fixed answer; nothing else;
- ``c``: ``floor.c`` (compiled here with ``cc`` on first use), epoll, one fixed answer per read.

    python bench/baselines/floor_server.py {python,c} PORT WORKERS

Each of WORKERS processes binds 127.0.0.1:PORT with SO_REUSEPORT; this process waits for them and
stops them on SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

BODY = (b'{"model_name":"scorer","model_version":"v1","id":"0123456789abcdef.v1","outputs":[{"name":"score",'
        b'"datatype":"FP32","shape":[1,1],"data":[0.5]}]}')
ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY)
HERE = Path(__file__).resolve().parent


class Floor(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        import httptools

        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.body = []
        self.transport.write(ANSWER)


def serve_python(port: int) -> None:
    import uvloop

    async def main() -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(512)
        server = await asyncio.get_running_loop().create_server(Floor, sock=sock)
        await server.serve_forever()

    uvloop.run(main())


def c_binary() -> Path:
    out = HERE.parent.parent / ".bench-venv" / "floor"
    source = HERE / "floor.c"
    if not out.exists() or out.stat().st_mtime < source.stat().st_mtime:
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cc", "-O2", "-o", str(out), str(source)], check=True)
    return out


def main() -> None:
    kind, port, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if kind == "c":
        binary = c_binary()
        children = [subprocess.Popen([str(binary), str(port)]) for _ in range(workers)]
    else:
        children = [subprocess.Popen([sys.executable, __file__, "serve-python", str(port)]) for _ in range(workers)]

    def stop(*_: object) -> None:
        for child in children:
            child.kill()

    signal.signal(signal.SIGTERM, stop)
    os.wait()  # the first to exit (a worker that could not bind, or all on SIGTERM) ends them all:
    stop()  # a floor row never runs on fewer processes than it says
    for child in children:
        child.wait()


if __name__ == "__main__":
    if sys.argv[1] == "serve-python":
        serve_python(int(sys.argv[2]))
    else:
        main()
