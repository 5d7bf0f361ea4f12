"""What a reader accepts from storage: real, regular files below the root, of bounded size.

A checkpoint may come from an untrusted place (or a damaged one), and what a reader finds there
must not hang it, exhaust its memory or make it read outside the checkpoint:

* a FIFO blocks ``open()`` forever and a device (``/dev/zero``) never ends: only regular files
  are opened. The type is checked with ``lstat`` (which opens nothing), then the file is opened
  with ``O_NONBLOCK | O_NOFOLLOW`` and checked again with ``fstat``, so a file swapped in between
  is caught too;
* a symbolic link below the root (a step directory, a data file) could point out of the
  checkpoint: every component below the root is ``lstat``-ed and a link is refused;
* a metadata file is read only up to a limit its caller states (the format's caps, or the exact
  size the manifest records for an index file), checked against the real size before reading.

Object stores have neither links nor special files; there the type and size come from ``info()``.
A refusal is a :class:`FormatError` naming the path: the checkpoint is hostile or damaged (the
storage itself works), so the fallback skips it and the command line reports it unreadable.
Functions here take the root and a relative path (``/``-separated) and never import the storage.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any

from ..errors import FormatError

MAX_METADATA_BYTES = 128 << 20
"""Default read limit for metadata files (manifest, index, markers): the format's caps, see
``manifest.MAX_MANIFEST_BYTES`` and ``manifest.MAX_INDEX_BYTES``."""

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_CHUNK = 1 << 20


def _kind(mode: int) -> str:
    """How messages name a file type."""
    for test, name in ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


def local_kind(root: str, rel: str) -> str | None:
    """What ``rel`` below ``root`` is, without following links: ``"a file"``, ``"a directory"``,
    ``"a symbolic link"``, ``"a FIFO"``...; ``None`` when it does not exist."""
    try:
        return _kind(os.lstat(os.path.join(root, rel)).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return None


def lstat_below(root: str, rel: str, where: str) -> os.stat_result | None:
    """``lstat`` of ``rel`` below ``root``, refusing a symbolic link at any component below the root.

    ``None`` when it (or a directory on its way) does not exist. The root itself may be a link
    (``/scratch -> /mnt/...`` is a user's choice); what is inside a checkpoint may not.
    """
    path, st = root, None
    for part in rel.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            raise FormatError(f"{where}: refused: the path leaves the checkpoint root")
        path = os.path.join(path, part)
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if stat.S_ISLNK(st.st_mode):
            raise FormatError(f"{where}: refused: {path} is a symbolic link; a checkpoint's directories and files "
                              "must be real ones below its root (copy them in instead of linking)")
    return st


def regular_size(root: str, rel: str, where: str) -> int | None:
    """Size of regular file ``rel`` (no link on its way), ``None`` when missing; :class:`FormatError`
    for a FIFO, a device, a directory or a link."""
    st = lstat_below(root, rel, where)
    if st is None:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{where}: refused: it is {_kind(st.st_mode)}, not a regular file")
    return st.st_size


def open_regular(root: str, rel: str, where: str) -> int:
    """A read-only descriptor of regular file ``rel``; never blocks (FIFO) and never follows a link.

    Raises ``FileNotFoundError`` when it is missing (the storage reports that as unreadable).
    """
    first = lstat_below(root, rel, where)
    if first is None:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", os.path.join(root, rel))
    if not stat.S_ISREG(first.st_mode):
        raise FormatError(f"{where}: refused: it is {_kind(first.st_mode)}, not a regular file")
    fd = os.open(os.path.join(root, rel), _OPEN_FLAGS)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (first.st_dev, first.st_ino):
        os.close(fd)
        raise FormatError(f"{where}: refused: the file was replaced while it was being opened")
    return fd


def check_limit(size: int, limit: int, where: str) -> None:
    """A file of ``size`` bytes may be read whole only within ``limit``."""
    if size > limit:
        raise FormatError(f"{where}: {size} bytes, more than the {limit} a reader accepts for this file "
                          "(a damaged or hostile checkpoint)")


def read_regular(root: str, rel: str, limit: int, where: str) -> bytes:
    """Whole content of regular file ``rel`` when it holds at most ``limit`` bytes."""
    fd = open_regular(root, rel, where)
    try:
        check_limit(os.fstat(fd).st_size, limit, where)
        parts, got = [], 0
        while got <= limit:  # the file may grow meanwhile: never read past limit + 1
            part = os.read(fd, min(_CHUNK, limit + 1 - got))
            if not part:
                break
            parts.append(part)
            got += len(part)
    finally:
        os.close(fd)
    check_limit(got, limit, where)
    return b"".join(parts)


def object_size(fs: Any, path: str, where: str) -> int | None:
    """Size of object ``path`` from ``info()``; ``None`` when missing; :class:`FormatError` when it
    is not a file (a directory prefix) or its size is unknown."""
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    if info.get("type") not in ("file", None):
        raise FormatError(f"{where}: refused: it is a {info.get('type')}, not a file")
    size = info.get("size")
    if not isinstance(size, int) or size < 0:
        raise FormatError(f"{where}: refused: the storage does not say its size")
    return size


def read_object(fs: Any, path: str, limit: int, where: str) -> bytes:
    """Whole content of object ``path`` when it holds at most ``limit`` bytes (a ranged read of
    the size ``info()`` gave, so an object replaced meanwhile cannot make it read more)."""
    size = object_size(fs, path, where)
    if size is None:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
    check_limit(size, limit, where)
    data = bytes(fs.cat_file(path, start=0, end=size)) if size else b""
    check_limit(len(data), limit, where)
    return data
