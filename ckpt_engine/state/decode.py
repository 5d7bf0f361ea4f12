"""Typed JSON back to values: the reading side of :mod:`values`, safe on hostile input.

A checkpoint may come from an untrusted place, so every node is checked against the format
(``docs/FORMAT.md``, *Value trees*) and every failure is a :class:`FormatError` naming the file:
unknown nodes, tensor references outside the table, keys that are unhashable or repeated,
numbers outside their type's range, devices torch does not know, trees deeper than
:data:`~ckpt_engine.state.values.MAX_DEPTH`. Nothing here runs code from the checkpoint.
"""

from __future__ import annotations

import base64
import math
from typing import Any, Callable

import numpy as np
import torch

from ..errors import FormatError
from .values import _NUMPY_AS_TENSOR, _NUMPY_INLINE, JSON, MAX_DEPTH, MAX_NDIM, parse_dtype


def decode(tree: JSON, tensor: Callable[[int], Any], *, count: int | None = None, where: str = "") -> object:
    """Rebuild the value that :func:`encode` produced; ``tensor(i)`` returns table entry ``i``.

    Raises :class:`FormatError` (prefixed with ``where``, the file) for any node that is not part
    of the format, a tensor index outside ``[0, count)``, a key that is not hashable or appears
    twice, a number out of its type's range, or a tree deeper than :data:`MAX_DEPTH`: a hostile
    tree never escapes as another exception, nor reads a tensor it does not name.
    """
    return _Decoder(tensor, count, where).dec(tree, 0, False)


class _Decoder:
    """One :func:`decode`: methods rather than nested closures, because closures that call each
    other form a reference cycle, and through ``tensor`` it kept every decoded tensor alive until
    the garbage collector ran (a whole restored state, after the caller had dropped it)."""

    def __init__(self, tensor: Callable[[int], Any], count: int | None, where: str) -> None:
        self.tensor, self.count, self.where = tensor, count, where
        self.prefix = f"{where}: " if where else ""

    def bad(self, v: JSON, why: str = "") -> Any:
        raise FormatError(f"{self.prefix}malformed value node {_preview(v)}{why}")

    def dec(self, v: JSON, depth: int, key: bool) -> object:
        if v is None or isinstance(v, (bool, str, int)):
            return v
        if isinstance(v, dict) and len(v) in (1, 2) and next(iter(v)) == "$tensor":
            return self.ref(v, key)
        if not isinstance(v, (list, dict)) or (isinstance(v, dict) and len(v) != 1):
            return self.bad(v)
        if depth >= MAX_DEPTH and (isinstance(v, list) or next(iter(v)) in ("$tuple", "$dict", "$np")):
            raise FormatError(f"{self.prefix}value tree nested deeper than {MAX_DEPTH} levels (a hostile or "
                              "damaged checkpoint: ckpt-suite never writes one)")
        if isinstance(v, list):
            return [self.dec(x, depth + 1, key) for x in v]
        tag, body = next(iter(v.items()))
        if tag == "$f":
            return _float(body, self.prefix)
        if tag == "$tuple" and isinstance(body, list):
            return tuple([self.dec(x, depth + 1, key) for x in body])
        if tag == "$dict" and isinstance(body, list):
            return self.mapping(v, body, depth + 1, key)
        if tag == "$np" and isinstance(body, list) and len(body) == 2 and body[0] in _NUMPY_INLINE:
            scalar = _np_scalar(body[0], self.dec(body[1], depth + 1, key))
            return self.bad(v, f" (not a {body[0]} value)") if scalar is None else scalar
        if tag == "$bytes" and isinstance(body, str):
            return _b64(body, self.prefix)
        if tag == "$ndarray" and isinstance(body, dict):
            return _dec_ndarray(body, self.prefix)
        if tag == "$dtype":
            return parse_dtype(body, self.where)
        if tag == "$size" and isinstance(body, list) and len(body) <= MAX_NDIM \
                and all(type(x) is int and 0 <= x < 1 << 63 for x in body):
            return torch.Size(body)
        if tag == "$device" and isinstance(body, str) and len(body) <= 64:
            device = _device(body)
            return self.bad(v, " (not a torch device)") if device is None else device
        return self.bad(v)

    def ref(self, v: dict, key: bool) -> object:
        i = v["$tensor"]
        if type(i) is not int or i < 0 or (self.count is not None and i >= self.count):
            return self.bad(v, f": tensor index out of the table (it has {self.count} entries)"
                            if self.count is not None else "")
        if len(v) == 2 and v.get("as") != "numpy":
            return self.bad(v)
        if key:
            return self.bad(v, ": a tensor cannot be a dict key")
        t = self.tensor(i)
        if len(v) == 1:
            return t
        try:
            return t.numpy()
        except (TypeError, RuntimeError, ValueError) as e:
            return self.bad(v, f": tensor {i} cannot be a NumPy array ({e})")

    def mapping(self, v: JSON, pairs: list, depth: int, key: bool) -> dict:
        out: dict = {}
        for p in pairs:
            if not isinstance(p, list) or len(p) != 2:
                return self.bad(v)
            k = self.dec(p[0], depth, True)
            try:
                duplicate = k in out
            except TypeError:
                return self.bad(v, f": dict key {_preview(p[0])} is not hashable")
            if duplicate:
                return self.bad(v, f": dict key {_preview(p[0])} appears twice")
            out[k] = self.dec(p[1], depth, key)
        return out


def check_tree(tree: JSON, dtypes: "list[str] | tuple[str, ...]", where: str) -> None:
    """Validate a value tree whose tensor references index a table of ``dtypes`` (nothing is read).

    Called when a manifest or index file is parsed, so every reader (load, inspect, export) sees
    a malformed tree as a :class:`FormatError` naming the file before it reads any tensor.
    """
    decode(tree, lambda i: _Probe(dtypes[i], where), count=len(dtypes), where=where)


class _Probe:
    """Stands in for a tensor while a tree is validated: ``as: numpy`` needs a NumPy dtype."""

    def __init__(self, dtype: str, where: str) -> None:
        self.dtype, self.where = dtype, where

    def numpy(self) -> "_Probe":
        if self.dtype not in _NUMPY_AS_TENSOR:
            raise TypeError(f"dtype {self.dtype} has no NumPy equivalent")
        return self


def _preview(v: JSON) -> str:
    """A short description of a node for messages (never recursive: the node may be hostile)."""
    if isinstance(v, dict):
        return f"with keys {[str(k)[:20] for k in list(v)[:4]]}"
    if isinstance(v, list):
        return f"(a list of {len(v)})"
    return repr(v)[:80] if not isinstance(v, int) or v.bit_length() < 256 else f"(an integer of {v.bit_length()} bits)"


def _float(body: JSON, prefix: str = "") -> float:
    if type(body) is float:
        return body
    if type(body) is int:
        try:
            return float(body)
        except OverflowError:
            raise FormatError(f"{prefix}float node {_preview(body)} is out of a double's range") from None
    if body in ("nan", "inf", "-inf"):
        return float(body)  # type: ignore[arg-type]
    raise FormatError(f"{prefix}malformed float node {_preview(body)}")


def _np_scalar(dtype: str, value: object) -> object:
    """NumPy scalar ``dtype(value)``; ``None`` when ``value`` is not a number of that dtype's range."""
    if type(value) not in (bool, int, float):
        return None
    try:
        with np.errstate(all="raise"):
            return np.dtype(dtype).type(value)
    except (OverflowError, ValueError, TypeError, ArithmeticError):
        return None


def _device(name: str) -> torch.device | None:
    try:
        return torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        return None


def _dec_ndarray(body: dict, prefix: str = "") -> np.ndarray:
    dtype, shape, data = body.get("dtype"), body.get("shape"), body.get("data")
    if dtype not in _NUMPY_INLINE or not isinstance(shape, list) or not isinstance(data, str) or len(shape) > MAX_NDIM \
            or not all(type(s) is int and s >= 0 for s in shape):
        raise FormatError(f"{prefix}malformed $ndarray node (dtype {str(dtype)[:20]!r}, shape {_preview(shape)})")
    raw = _b64(data, prefix)
    if math.prod(shape) * np.dtype(dtype).itemsize != len(raw):
        raise FormatError(f"{prefix}$ndarray of shape {shape} and dtype {dtype} does not match its {len(raw)} bytes")
    try:
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    except (ValueError, TypeError, OverflowError, MemoryError) as e:
        raise FormatError(f"{prefix}$ndarray of shape {shape} cannot be built ({e})") from None


def _b64(data: str, prefix: str = "") -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except ValueError as e:  # binascii.Error
        raise FormatError(f"{prefix}malformed base64 payload ({e})") from None
