"""Opening a checkpoint root: :func:`open_storage` picks the implementation for a URL.

This machine's files (a path, ``file://``) get :class:`~.local.LocalStorage`, which writes through
``os`` (``O_DIRECT``, fsync of files and directories); every other fsspec URL (``memory://``,
``s3://``, ``abfs://``, ``gs://``, chained URLs such as ``dir::file://``) gets
:class:`~.fsspec_storage.FsspecStorage`. The choice is made on the filesystem fsspec opens for the
URL, not on its spelling, so ``local://`` and ``file://`` end up alike.
"""

from __future__ import annotations

from typing import Any

from fsspec.implementations.local import LocalFileSystem

from . import base
from .base import Storage, open_url
from .fsspec_storage import FsspecStorage
from .local import LocalStorage


def open_storage(url: str, storage_options: dict[str, Any] | None = None, *,
                 retry_deadline: float = 60.0) -> Storage:
    """The checkpoint root at ``url``: a :class:`~.local.LocalStorage` for this machine's files, a
    :class:`~.fsspec_storage.FsspecStorage` for any other fsspec URL.

    ``storage_options``: fsspec options of the URL's filesystem (an endpoint, ``max_concurrency`` on
    S3; credentials belong in the environment, see docs/storage.md). ``retry_deadline``: seconds to keep
    retrying transient errors on remote filesystems. A URL whose fsspec backend is not installed is a
    :class:`~ckpt_engine.errors.StorageError` naming the package to install. Opening writes nothing.
    """
    fs, root = open_url(url, storage_options)  # opened once, here
    implementation = LocalStorage if isinstance(fs, LocalFileSystem) else FsspecStorage
    storage = implementation.__new__(implementation)
    storage._setup(str(url), fs, root, retry_deadline)
    return storage


base._opener = open_storage  # what the deprecated Storage(url) calls (base.Storage.__new__)
