"""The ``levels`` flag of the configuration (config.py): one :class:`LevelSpec` per level, validated,
and the checks the whole schema shares.

``levels`` (instead of ``dirpath``) lists the persistence levels, fastest first: each entry a path,
or a mapping ``{path: ..., storage_options: {...}, keep_last: N}``, or node memory
(``{kind: memory, replicas: 1, budget: 8GiB}``, the first only); config.py's docstring shows them
in YAML.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import ConfigError


@dataclass(frozen=True)
class LevelSpec:
    """One persistence level as configured: where, with which fsspec options, how many to keep.

    ``path`` is a path or fsspec URL, or a ``Storage`` instance when built in code (tests wrap one).
    """

    path: Any
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    keep_last: int | None = None
    kind: str = "storage"
    """``"storage"`` (a directory or fsspec URL) or ``"memory"`` (node memory, levels/memory.py)."""
    replicas: int = 1
    """Memory level: peer ranks on other nodes that get a copy of each rank's part (0: none)."""
    budget: int | None = None
    """Memory level: bytes one node may hold in checkpoints (its ranks' parts and the replicas it keeps)."""
    job: str | None = None
    """Memory level: the job that owns the node's memory (default: derived from the other levels)."""

    @property
    def memory(self) -> bool:
        """Whether this is a node-memory level."""
        return self.kind == "memory"

    @property
    def location(self) -> str:
        """The level's root as text (a ``Storage``'s URL)."""
        return self.path if isinstance(self.path, str) else str(getattr(self.path, "url", self.path))


_LEVEL_KEYS = ("path", "storage_options", "keep_last", "kind", "replicas", "budget", "job")
_MEMORY_KEYS = ("replicas", "budget", "job")
DEFAULT_MEMORY_ROOT = "/dev/shm/ckpt-suite"
"""Where a memory level lives when its ``path`` is not given: the node's shared memory."""
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(value: Any, key: str) -> int:
    """A byte count from an int or a text such as ``"8GiB"``, ``"500 MB"``; :class:`ConfigError` otherwise."""
    if type(value) is int and value > 0:
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS and float(m.group(1)) > 0:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ConfigError(f"{key}={value!r} is invalid: expected a positive number of bytes, e.g. 8589934592 or '8GiB'")


def parse_levels(entries: Any, *, storage_options: Mapping[str, Any] | None = None, keep_last: int | None = None,
                 allow_storage: bool = False) -> tuple[LevelSpec, ...]:
    """Validate ``levels`` entries (fastest first) into :class:`LevelSpec`; raises :class:`ConfigError`.

    Each entry is a path string or a mapping with ``path`` and optionally ``storage_options`` and
    ``keep_last``; ``storage_options`` / ``keep_last`` given here are the defaults of entries that do
    not set their own. ``allow_storage``: entries (or their ``path``) may be ``Storage`` objects.
    """
    if isinstance(entries, (str, bytes, Mapping)) or not isinstance(entries, (list, tuple)) or not entries:
        raise ConfigError(f"'levels' must be a non-empty list of paths or {{path: ...}} mappings, got {entries!r}")
    specs = tuple(_level(e, i, storage_options or {}, keep_last, allow_storage) for i, e in enumerate(entries))
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        key = spec.location.removeprefix("file://").rstrip("/")
        if key in seen:
            raise ConfigError(f"levels[{i}] ({spec.location!r}) is the same place as levels[{seen[key]}]; "
                              "each level needs its own root")
        seen[key] = i
    return specs


def level_specs(path: Any, levels: Any, storage_options: Mapping[str, Any] | None,
                keep_last: int | None) -> tuple[LevelSpec, ...]:
    """The levels of a checkpointer: ``path`` as the only one, or the validated ``levels`` (which
    may hold ``Storage`` objects), with ``storage_options`` and ``keep_last`` as their defaults."""
    if (path is None) == (levels is None):
        raise ConfigError("give exactly one of path (one level) or levels=[fastest, ..., slowest]; "
                          f"got path={path!r}, levels={levels!r}")
    if levels is None:
        return (LevelSpec(path, dict(storage_options or {}), keep_last),)
    return parse_levels(levels, storage_options=storage_options, keep_last=keep_last, allow_storage=True)


def _level(entry: Any, i: int, options: Mapping[str, Any], keep_last: int | None, allow_storage: bool) -> LevelSpec:
    where = f"levels[{i}]"
    if isinstance(entry, LevelSpec):
        entry = {k: getattr(entry, k) for k in _LEVEL_KEYS if entry.memory or k not in _MEMORY_KEYS}
    if not isinstance(entry, Mapping):
        entry = {"path": entry}
    unknown = sorted(set(entry) - set(_LEVEL_KEYS), key=str)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; a level takes "
                          f"{', '.join(_LEVEL_KEYS)}")
    kind = entry.get("kind") or "storage"
    _check(kind in ("storage", "memory"), f"{where}.kind", kind, "'storage' or 'memory' (node memory)")
    if kind == "memory":
        return _memory_level(entry, where, i, keep_last)
    extra = sorted(k for k in _MEMORY_KEYS if entry.get(k) is not None)
    if extra:
        raise ConfigError(f"{where}: {', '.join(extra)} apply to a memory level only (kind: memory)")
    path = entry.get("path")
    is_storage = allow_storage and _is_storage(path)
    if not is_storage and (not isinstance(path, str) or not path):
        raise ConfigError(f"{where}: 'path' must be a non-empty string (a directory or fsspec URL), got {path!r}")
    own = entry.get("storage_options")
    _check(own is None or isinstance(own, Mapping), f"{where}.storage_options", own, "a mapping")
    _check_storage_options(options if own is None else own,
                           "storage_options" if own is None else f"{where}.storage_options")
    level_keep = entry["keep_last"] if "keep_last" in entry else keep_last  # an explicit null keeps all
    _check(level_keep is None or (type(level_keep) is int and level_keep > 0), f"{where}.keep_last", level_keep,
           "a positive integer")
    return LevelSpec(path, dict(options if own is None else own), level_keep)


def _memory_level(entry: Mapping[str, Any], where: str, i: int, keep_last: int | None) -> LevelSpec:
    """A node-memory level: the first of the levels, a local directory (default
    :data:`DEFAULT_MEMORY_ROOT`), ``replicas`` >= 0, an optional ``budget`` in bytes, an optional ``job``."""
    if i != 0:
        raise ConfigError(f"{where}: a memory level must be the first (fastest) of the levels")
    path = entry.get("path") or DEFAULT_MEMORY_ROOT
    _check(isinstance(path, str) and "://" not in path.removeprefix("file://"), f"{where}.path", path,
           "a local directory in the node's memory (a tmpfs such as /dev/shm)")
    if entry.get("storage_options"):
        raise ConfigError(f"{where}: a memory level is a local directory and takes no storage_options")
    replicas = entry.get("replicas", 1)
    _check(type(replicas) is int and replicas >= 0, f"{where}.replicas", replicas, "an integer >= 0")
    budget = entry.get("budget")
    job = entry.get("job")
    _check(job is None or (isinstance(job, str) and re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", job) is not None),
           f"{where}.job", job, "1-64 letters, digits, '_', '.' or '-'")
    level_keep = entry["keep_last"] if "keep_last" in entry else keep_last
    _check(level_keep is None or (type(level_keep) is int and level_keep > 0), f"{where}.keep_last", level_keep,
           "a positive integer")
    return LevelSpec(path.removeprefix("file://"), {}, level_keep, "memory", replicas,
                     None if budget is None else parse_bytes(budget, f"{where}.budget"), job)


def _is_storage(x: object) -> bool:
    """A :class:`~ckpt_engine.storage.Storage` given in code (tests and benchmarks wrap one; YAML cannot)."""
    from .storage import Storage  # lazily: the schema itself does not need fsspec

    return isinstance(x, Storage)


def _check_storage_options(options: Mapping[str, Any], where: str) -> None:
    """The storage options the library reads itself: ``max_concurrency`` (S3 parts in flight per file)."""
    if "max_concurrency" in options:
        value = options["max_concurrency"]
        _check(type(value) is int and value > 0, f"{where}.max_concurrency", value,
               "a positive integer (on S3: the parts of one file sent, or ranges read, at once)")


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def _check(ok: bool, key: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: expected {expected}")
