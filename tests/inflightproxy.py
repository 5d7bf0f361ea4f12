"""A TCP proxy on 127.0.0.1 in front of the moto server that counts S3 requests in flight at once.

Two kinds are counted: ``"part"`` (UploadPart: ``PUT ...?partNumber=``) and ``"range"`` (a GET
with a ``Range`` header). A request is in flight from the moment its head reaches the proxy until
just before the last byte of its response is passed on, so the count never exceeds what the
client really had outstanding, and two requests of a client that sends one at a time never
overlap. ``peak[kind]`` is the most seen at once, ``total[kind]`` how many passed. Everything is
forwarded byte for byte: real HTTP between the real client and the real server.
"""

from __future__ import annotations

import collections
import queue
import re
import socket
import threading
from typing import Callable

_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)")


def kind_of(head: bytes) -> str | None:
    """``"part"``, ``"range"`` or ``None`` for a request's head (request line and headers)."""
    line, _, headers = head.partition(b"\r\n")
    if line.startswith(b"PUT ") and re.search(rb"[?&]partNumber=", line):
        return "part"
    if line.startswith(b"GET ") and re.search(rb"(^|\r\n)range:", headers.lower()):
        return "range"
    return None


class LoopbackProxy:
    """Listen on 127.0.0.1:<port> for ``target`` (host, port); each connection goes to ``_serve``
    on a thread of its own. Subclasses set their state, then call ``super().__init__``."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self.listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        raise NotImplementedError


class InflightProxy(LoopbackProxy):
    """Forward 127.0.0.1:<port> to ``target`` (host, port), counting requests in flight by kind."""

    def __init__(self, target: tuple[str, int]) -> None:
        self._lock = threading.Lock()
        self.now: collections.Counter[str] = collections.Counter()
        self.peak: collections.Counter[str] = collections.Counter()
        self.total: collections.Counter[str] = collections.Counter()
        super().__init__(target)

    def reset(self) -> None:
        """Forget the peaks and totals (what is in flight now stays counted)."""
        with self._lock:
            self.peak.clear()
            self.total.clear()

    def _enter(self, kind: str) -> None:
        with self._lock:
            self.now[kind] += 1
            self.total[kind] += 1
            self.peak[kind] = max(self.peak[kind], self.now[kind])

    def _leave(self, kind: str) -> None:
        with self._lock:
            self.now[kind] -= 1

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.target)
        sent: queue.SimpleQueue[tuple[bytes, str | None]] = queue.SimpleQueue()  # (method, kind), in order
        threading.Thread(target=self._responses, args=(Framed(upstream, client), sent), daemon=True).start()
        requests = Framed(client, upstream)
        try:
            while (head := requests.head()) is not None:
                kind = kind_of(head)
                if kind is not None:
                    self._enter(kind)
                sent.put((head.split(b" ", 1)[0], kind))
                upstream.sendall(head)
                requests.body(head, lambda: None)
        except OSError:
            pass
        _close(client, upstream)

    def _responses(self, responses: "Framed", sent: "queue.SimpleQueue[tuple[bytes, str | None]]") -> None:
        try:
            while (head := responses.head()) is not None:
                status = int(head.split(b" ", 2)[1])
                if status < 200:  # 100 Continue: the final answer follows
                    responses.dst.sendall(head)
                    continue
                method, kind = sent.get(timeout=60)
                done: Callable[[], None] = (lambda k=kind: self._leave(k)) if kind is not None else (lambda: None)
                if method == b"HEAD" or status in (204, 304):
                    done()
                    responses.dst.sendall(head)
                else:
                    responses.dst.sendall(head)
                    responses.body(head, done)
        except (OSError, queue.Empty):
            pass
        _close(responses.src, responses.dst)
        while not sent.empty():  # requests the connection dropped before their answer
            if (kind := sent.get()[1]) is not None:
                self._leave(kind)


class Framed:
    """HTTP messages read from ``src`` and passed on to ``dst``, parsed just enough to find their ends."""

    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src, self.dst, self.buf = src, dst, b""

    def _fill(self) -> bool:
        chunk = self.src.recv(1 << 20)
        self.buf += chunk
        return bool(chunk)

    def head(self) -> bytes | None:
        """The next start line and headers (not yet passed on); ``None`` when ``src`` closed."""
        while b"\r\n\r\n" not in self.buf:
            if not self._fill():
                return None
        end = self.buf.index(b"\r\n\r\n") + 4
        head, self.buf = self.buf[:end], self.buf[end:]
        return head

    def body(self, head: bytes, before_last: Callable[[], None]) -> None:
        """Pass on the body that follows ``head``, calling ``before_last`` before its last bytes go."""
        lower = head.lower()
        if b"transfer-encoding: chunked" in lower:
            while (size := int(self._line(before=None).split(b";")[0], 16)) > 0:
                self._forward(size + 2, None)
            while self._line(before=before_last) != b"\r\n":
                pass
            return
        m = _LENGTH.search(lower)
        if m is None or int(m.group(1)) == 0:
            before_last()
            return
        self._forward(int(m.group(1)), before_last)

    def _line(self, before: Callable[[], None] | None) -> bytes:
        while b"\r\n" not in self.buf:
            if not self._fill():
                raise OSError("closed inside a chunked body")
        end = self.buf.index(b"\r\n") + 2
        line, self.buf = self.buf[:end], self.buf[end:]
        if before is not None and line == b"\r\n":
            before()
        self.dst.sendall(line)
        return line

    def _forward(self, n: int, before_last: Callable[[], None] | None) -> None:
        while n > 0:
            if not self.buf and not self._fill():
                raise OSError("closed inside a body")
            piece, self.buf = self.buf[:n], self.buf[n:]
            n -= len(piece)
            if n == 0 and before_last is not None:
                before_last()
            self.dst.sendall(piece)


def _close(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()
