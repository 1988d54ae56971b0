"""``auditor serve`` with TCP_NODELAY on every accepted connection (what the single-process
server already gets from asyncio), to measure the proposed fix for ``--workers N``.

uvicorn's multi-worker mode listens on a socket it created with protocol 0, so asyncio's
``_set_nodelay`` (which requires ``proto == IPPROTO_TCP``) skips the accepted connections;
the response's header and body writes then meet Nagle + delayed ACK: +40 ms per request.
Benchmark-only: ``python benchmarks/_serve_nodelay.py serve --workers 2 ...``.
"""

import socket

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


class NoDelayH11(H11Protocol):
    def connection_made(self, transport):
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _serve_nodelay import NoDelayH11 as Proto  # importable by name in spawned workers

    _run = uvicorn.run
    uvicorn.run = lambda *a, **kw: _run(*a, **{"http": Proto, **kw})
    from auditor.cli import app

    app()
