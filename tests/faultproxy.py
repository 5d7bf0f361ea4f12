"""A TCP proxy on 127.0.0.1 in front of the moto server that injects transient HTTP failures.

``fail(n, how)`` makes the next ``n`` connections fail: ``"503"`` answers them with
*503 Slow Down*, ``"drop"`` closes them without a word; ``fail(-1, ...)`` fails every one until
``heal()``. Everything else is forwarded byte for byte. Real HTTP, real clients, real retries.
"""

from __future__ import annotations

import socket
import threading

_503 = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: 97\r\n\r\n"
        b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>\n\n\n\n\n\n")


class FaultProxy:
    """Forward 127.0.0.1:<port> to ``target`` (host, port), failing connections on request."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._remaining, self._how = 0, "503"
        self.injected = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def fail(self, n: int, how: str = "503") -> None:
        with self._lock:
            self._remaining, self._how = n, how

    def heal(self) -> None:
        self.fail(0)

    def close(self) -> None:
        self._closed = True
        self.listener.close()

    def _take_fault(self) -> str | None:
        with self._lock:
            if self._remaining == 0:
                return None
            if self._remaining > 0:
                self._remaining -= 1
            self.injected += 1
            return self._how

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        fault = self._take_fault()
        if fault is not None:
            try:
                if fault == "503":
                    client.settimeout(5)
                    _read_headers(client)
                    client.sendall(_503)
            finally:
                client.close()
            return
        upstream = socket.create_connection(self.target)
        threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
        _pipe(client, upstream)


def _read_headers(sock: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return
        data += chunk


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while chunk := src.recv(1 << 20):
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
