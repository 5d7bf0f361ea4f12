"""Strict JSON for files read from a checkpoint: exactly what the writer emits, nothing more.

Python's ``json`` module accepts more than RFC 8259: ``NaN`` and ``Infinity``, numbers beyond a
double (``1e999`` becomes inf), and an object that repeats a key (the last one silently wins, so
two readers may disagree on what a file says). A checkpoint may be hostile, so a reader accepts
none of these, and turns every parse failure, a too-deep nesting included, into a
:class:`FormatError` naming the file.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..errors import FormatError


def parse_json(raw: bytes, where: str) -> Any:
    """Strict JSON (RFC 8259, as the writer emits it), or a :class:`FormatError` naming ``where``.

    Python's parser accepts ``NaN``/``Infinity``, numbers beyond a double (``1e999`` as inf) and
    repeated keys (the last one silently wins): a writer never emits any, so a reader refuses
    them. Nesting beyond the interpreter's recursion limit is an error too, not a crash.
    """
    try:
        return json.loads(raw, object_pairs_hook=_unique_keys, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise FormatError(f"{where}: not valid JSON (nested too deeply)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"{where}: not valid JSON ({str(e)[:200]})") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"key {key[:40]!r} appears twice in one object")
    return d


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"number {text[:40]} is beyond a double's range")
    return x
