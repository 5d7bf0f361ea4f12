"""Bounded retries with backoff for transient object-store errors.

Object stores fail transiently (HTTP 5xx, throttling, dropped connections, timeouts) far more
often than local disks, and the clients' own retries give up after a few attempts. We retry an
operation for up to ``deadline`` seconds with exponential backoff and jitter, and only when the
error (or one it was raised from) is transient: a missing key or a refused credential fails at
once, since retrying it only delays the message the user needs. So does *501 Not Implemented*: a
5xx, but the server's permanent answer that it lacks the API (s3rver's ListMultipartUploads).
"""

from __future__ import annotations

import errno
import random
import time
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")

_TRANSIENT_ERRNOS = {errno.ECONNRESET, errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EAGAIN, errno.EPIPE,
                     errno.EBUSY, errno.ECONNABORTED, errno.EHOSTUNREACH, errno.ENETUNREACH}
_TRANSIENT_CODES = {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "Throttling",
                    "ThrottlingException", "RequestTimeTooSkewed", "503", "500", "502", "504"}
_TRANSIENT_NAMES = {"EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
                    "ServerDisconnectedError", "ClientConnectorError", "ClientOSError", "ClientPayloadError",
                    "IncompleteReadError", "ResponseStreamingError", "ProtocolError"}


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the exceptions it was raised from (cause, else context), each once."""
    seen = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _answer(e: BaseException) -> tuple[str, int]:
    """``(error code, HTTP status)`` of a botocore-style error (``response`` dict), else ``("", 0)``."""
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return "", 0
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return str(response.get("Error", {}).get("Code", "")), status if isinstance(status, int) else 0


def is_not_implemented(error: BaseException) -> bool:
    """Whether the server answered that it lacks the operation (HTTP 501, ``NotImplemented``).

    s3fs turns that answer into ``OSError(ENOSYS)`` raised from botocore's ``ClientError``.
    """
    for e in _chain(error):
        if isinstance(e, NotImplementedError) or (isinstance(e, OSError) and e.errno == errno.ENOSYS):
            return True
        code, status = _answer(e)
        if code in ("NotImplemented", "501") or status == 501:
            return True
    return False


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` or any exception in its cause chain is worth retrying."""
    if is_not_implemented(error):
        return False
    for e in _chain(error):
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
            return False
        if isinstance(e, (ConnectionError, TimeoutError)) or type(e).__name__ in _TRANSIENT_NAMES:
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        code, status = _answer(e)
        if code in _TRANSIENT_CODES or status >= 500:
            return True
    return False


def retrying(fn: Callable[[], T], deadline: float, *, sleep: Callable[[float], None] = time.sleep,
             clock: Callable[[], float] = time.monotonic) -> T:
    """Call ``fn`` until it succeeds, retrying transient errors for up to ``deadline`` seconds.

    The last error is re-raised when the deadline passes or the error is not transient; its
    ``ckpt_attempts`` attribute says how many attempts were made.
    """
    end = clock() + deadline
    delay, attempts = 0.05, 0
    while True:
        attempts += 1
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified below, re-raised unchanged
            if not is_transient(e) or clock() + delay > end:
                try:
                    e.ckpt_attempts = attempts  # type: ignore[attr-defined]
                except AttributeError:
                    pass
                raise
        sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 5.0)
