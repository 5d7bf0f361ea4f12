"""A TCP proxy on 127.0.0.1 in front of the moto server that injects transient HTTP failures.

``fail(n, how)`` makes the next ``n`` connections fail: ``"503"`` answers them with
*503 Slow Down*, ``"drop"`` closes them without a word; ``fail(-1, ...)`` fails every one until
``heal()``. ``reply(pattern, status, code)`` answers every request whose request line matches
``pattern`` (a regex, e.g. one for ``GET /<bucket>?uploads``) with that S3-style error instead of
forwarding it: a server that lacks an API. Everything else is forwarded byte for byte. Real HTTP,
real clients, real retries.
"""

from __future__ import annotations

import re
import socket
import threading

from inflightproxy import Framed, LoopbackProxy  # the same listener and HTTP framing (requests here, both ways there)

_503 = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: 97\r\n\r\n"
        b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>\n\n\n\n\n\n")


class FaultProxy(LoopbackProxy):
    """Forward 127.0.0.1:<port> to ``target`` (host, port), failing connections on request."""

    def __init__(self, target: tuple[str, int]) -> None:
        self._lock = threading.Lock()
        self._remaining, self._how = 0, "503"
        self.injected = 0
        self._replies: list[tuple[re.Pattern[bytes], bytes]] = []
        self.replied = 0
        super().__init__(target)

    def fail(self, n: int, how: str = "503") -> None:
        with self._lock:
            self._remaining, self._how = n, how

    def heal(self) -> None:
        self.fail(0)

    def reply(self, pattern: str, status: int, code: str, message: str = "injected by faultproxy") -> None:
        """Answer requests whose request line matches ``pattern`` with ``status`` and an S3 error ``code``.

        Applies to connections opened from now on (close pooled clients first, or use a fresh one).
        """
        body = f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
        head = (f"HTTP/1.1 {status} {code}\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        with self._lock:
            self._replies.append((re.compile(pattern.encode()), head + body))

    def _take_fault(self) -> str | None:
        with self._lock:
            if self._remaining == 0:
                return None
            if self._remaining > 0:
                self._remaining -= 1
            self.injected += 1
            return self._how

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
        if self._replies:
            self._forward_requests(client, upstream)
        else:
            _pipe(client, upstream)

    def _forward_requests(self, client: socket.socket, upstream: socket.socket) -> None:
        """Forward one request at a time (clients do not pipeline), answering matching ones here.

        Headers go upstream as soon as they are read and the body is streamed after them (a
        client that sends ``Expect: 100-continue`` waits for the server before sending it). A
        matching request closes the connection after the reply (``Connection: close``): the
        client had read the responses of earlier requests before it sent this one.
        """
        stream = Framed(client, upstream)
        try:
            while (head := stream.head()) is not None:
                answer = self._answer_for(head.split(b"\r\n", 1)[0])
                if answer is not None:
                    client.sendall(answer)
                    break
                upstream.sendall(head)
                stream.body(head, lambda: None)
        except OSError:
            pass
        for s in (client, upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _answer_for(self, request_line: bytes) -> bytes | None:
        with self._lock:
            for pattern, answer in self._replies:
                if pattern.search(request_line):
                    self.replied += 1
                    return answer
        return None


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
