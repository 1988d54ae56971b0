"""A server that answers garbage, and a way to run a client against it with its memory capped.

:class:`GarbageServer` is a real TCP server (a thread of the test process) that reads each
HTTP request and answers it in one of :data:`MODES` — what a misrouted proxy, another program
on the port or a hostile host may send. ``GET /healthz`` answers ``{"status": "ok"}`` except
in the trickling modes, so a CLI gets past its first check and meets the garbage on its real
reads. :func:`run_capped` runs a command in a child process under ``RLIMIT_AS`` and reports
its exit status, output, peak memory (``ru_maxrss``) and time.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import socketserver
import struct
import subprocess
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass

#: What the server answers: ``endless`` (200, a chunked body that never ends), ``html``,
#: ``wrong_types`` (a JSON object whose every field is of the wrong type), ``nested`` (an
#: array nested 100,000 deep), ``trickle_headers`` / ``trickle_body`` (one byte every 0.2 s,
#: for ever), ``redirect`` (302 to itself), ``cursor_loop`` (a listing whose ``next_cursor``
#: is always the same), ``reset`` (the connection reset after the request), ``gzip_bomb``
#: (256 MiB of zeros, gzip-compressed to ~256 KiB).
MODES = ("endless", "html", "wrong_types", "nested", "trickle_headers", "trickle_body", "redirect", "cursor_loop",
         "reset", "gzip_bomb")

_WRONG = {"accepted": "all", "duplicates": None, "runs": "none", "next_cursor": 7, "run_id": 5, "world_size": "x",
          "sizes": [], "statistics": {"a": 1}, "consistent": "yes", "ranks": 3, "steps": "s", "status": 1}


def _gzip_bomb(mib: int = 256) -> bytes:
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    return b"".join(z.compress(zeros) for _ in range(mib)) + z.flush()


class GarbageServer:
    """Answers every request in ``mode`` (:data:`MODES`). ``requests`` counts them; ``url``
    is its base URL. A context manager; :meth:`close` stops it (trickling answers end)."""

    _bomb: bytes | None = None

    def __init__(self, mode: str):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode, self.requests, self._stop = mode, 0, threading.Event()
        if mode == "gzip_bomb" and GarbageServer._bomb is None:
            GarbageServer._bomb = _gzip_bomb()
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                try:
                    outer._serve(self.request)
                except OSError:
                    pass

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()

    def __enter__(self) -> "GarbageServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, sock: socket.socket) -> None:
        f = sock.makefile("rb")
        while not self._stop.is_set():
            line = f.readline(65536)
            if not line:
                return
            path = line.split(b" ")[1] if line.count(b" ") >= 2 else b"/"
            length = 0
            while (h := f.readline(65536)) not in (b"\r\n", b"\n", b""):
                if h.lower().startswith(b"content-length:"):
                    length = int(h.split(b":", 1)[1])
            f.read(length)
            self.requests += 1
            if not self._answer(sock, path):
                return

    def _send(self, sock, status: str, body: bytes, ctype: str = "application/json", extra: str = "") -> bool:
        sock.sendall(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
                     .encode() + body)
        return True

    def _trickle(self, sock, data: bytes) -> bool:
        while not self._stop.is_set():
            for b in data:
                if self._stop.wait(0.2):
                    return False
                sock.sendall(bytes([b]))
        return False

    def _answer(self, sock: socket.socket, path: bytes) -> bool:
        """Answer one request; False: the connection is done."""
        mode = self.mode
        if path.startswith(b"/healthz") and not mode.startswith("trickle"):
            return self._send(sock, "200 OK", b'{"status": "ok"}')
        if mode == "endless":
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"%x\r\n%s\r\n" % (65536, b"[" * 65536)
            while not self._stop.is_set():
                sock.sendall(chunk)
            return False
        if mode == "html":
            return self._send(sock, "200 OK", b"<html><body><h1>Welcome to nginx!</h1></body></html>", "text/html")
        if mode == "wrong_types":
            return self._send(sock, "200 OK", json.dumps(_WRONG).encode())
        if mode == "nested":
            return self._send(sock, "200 OK", b"[" * 100_000 + b"]" * 100_000)
        if mode == "trickle_headers":
            sock.sendall(b"HTTP/1.1 200 OK\r\n")
            return self._trickle(sock, b"X-Slow: " + b"a" * 60 + b"\r\n")
        if mode == "trickle_body":
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n")
            return self._trickle(sock, b'{"accepted": 1, ' + b" " * 60)
        if mode == "redirect":
            return self._send(sock, "302 Found", b"", extra=f"Location: {path.decode('latin-1')}\r\n")
        if mode == "cursor_loop":
            return self._send(sock, "200 OK", json.dumps({"runs": [], "steps": [], "next_cursor": "again"}).encode())
        if mode == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
            return False
        body = GarbageServer._bomb
        return self._send(sock, "200 OK", body, extra="Content-Encoding: gzip\r\n")


class StrangerServer:
    """Another HTTP service on the URL, no auditor: ``GET /healthz`` answers 200
    ``{"status": "ok"}`` (as many services' do), every other request a JSON 404. A context
    manager yielding its base URL; a thread of the test process."""

    def __init__(self):
        import http.server

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                ok = self.path == "/healthz"
                self._answer(200 if ok else 404, b'{"status": "ok"}' if ok else b'{"detail": "Not Found"}')

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._answer(404, b'{"detail": "Not Found"}')

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass
class Capped:
    """What :func:`run_capped` saw: exit status (negative: the signal), output, peak
    resident memory in bytes, wall seconds."""

    returncode: int
    stdout: str
    stderr: str
    maxrss: int
    seconds: float


#: The launcher :func:`run_capped` starts: it forks ``argv[3:]`` under ``RLIMIT_AS`` and writes
#: the child's ``ru_maxrss`` to ``argv[2]``. Linux keeps a process's peak RSS across ``exec``
#: (and a fork copies its parent's), so a child started straight from a large test process
#: (a pytest-xdist worker at 500 MB) would report that process's peak, not its own; the
#: launcher's child is forked from a small interpreter. A signal that ends the child ends
#: the launcher the same way.
_LAUNCHER = """
import os, resource, signal, sys
memory, out = int(sys.argv[1]), sys.argv[2]
pid = os.fork()
if pid == 0:
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    os.execvp(sys.argv[3], sys.argv[3:])
_, status, usage = os.wait4(pid, 0)
with open(out, "w") as f:
    f.write(str(usage.ru_maxrss))
code = os.waitstatus_to_exitcode(status)
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def run_capped(args: list[str], *, memory: int = 2 << 30, timeout: float = 60.0, env: dict | None = None,
               cwd: str | None = None) -> Capped:
    """Run ``args`` with ``RLIMIT_AS`` = ``memory`` bytes (a runaway fails with MemoryError
    instead of taking the machine), killed after ``timeout`` s (returncode −9, with its
    process group). Its peak memory is its own ``ru_maxrss``, measured by a small launcher
    (:data:`_LAUNCHER`), not inherited from this process nor shared with other children."""
    import signal
    import sys

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile("r", suffix=".maxrss") as peak:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(memory), peak.name, *args], stdout=out,
                                stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=cwd, start_new_session=True)

        def kill() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            proc.wait()
        finally:
            timer.cancel()
        seconds = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        text = peak.read().strip()
        return Capped(proc.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"),
                      int(text) * 1024 if text else 0, seconds)
