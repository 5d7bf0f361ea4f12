"""The one configuration schema shared by the Lightning callback and the Horovod hook.

Flags (keyword arguments or YAML keys): ``path``, ``every_n_steps``, ``every_seconds``,
``overhead_budget``, ``max_interval``, ``keep_last``, ``levels``, ``storage_options``,
``restore_route`` (``auto``, ``read`` or ``exchange``: how a restore on several ranks gets the
replicated state, see ``ckpt_engine.load.exchange``), ``deterministic_reduction`` (read by the
Horovod hook: gradients summed in the same order in every run, so that a resume on more than 2
ranks is bit-identical; see ``horovod_ckpt.reduction``). The three
triggers are mutually exclusive; ``max_interval`` ("at least every ... seconds") composes with any.
``storage_options`` go to fsspec; the one the library reads too, ``max_concurrency`` (on S3: the
parts of one file uploaded, or ranges of one read fetched, at once; s3fs's default 10), is checked
here to be a positive integer.
Validation happens here, once, with messages that echo the bad key or value. A front end's
flags, over a YAML file or mapping, become one :class:`CheckpointConfig` in :func:`resolve_config`
(one ``keep_last`` default, :data:`DEFAULT_KEEP_LAST`, for every front end).

``levels`` (instead of ``path``) lists the persistence levels, fastest first: each entry a path, or
a mapping ``{path: ..., storage_options: {...}, keep_last: N}``; the top-level ``storage_options``
and ``keep_last`` are the defaults of entries that do not set their own. In YAML::

    levels:
      - /local_nvme/run                      # level 1: commit here first
      - path: s3://bucket/run                # level 2: flushed in the background
        keep_last: 10
    keep_last: 2

The first level may be the node's memory (``kind: memory``, levels/memory.py): checkpoints
committed in ``/dev/shm`` (or ``path``), each rank's part also sent to ``replicas`` peer ranks on
other nodes, within ``budget`` bytes per node; ``job`` names the owner of that memory (default:
derived from the other levels, so that a restarted job finds it)::

    levels:
      - {kind: memory, replicas: 1, budget: 8GiB}
      - /local_nvme/run
      - s3://bucket/run
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from .errors import ConfigError
from .load.exchange import ROUTES
from .training.policy import Adaptive, EveryNSteps, EverySeconds, MaxInterval, Policy


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


@dataclass(frozen=True)
class CheckpointConfig:
    """Validated checkpoint settings (see the module docstring for the flags)."""

    path: Any = None
    """A directory or fsspec URL; in code also a ``Storage`` (e.g. a ``ckpt_engine.testing`` double)."""
    every_n_steps: int | None = None
    every_seconds: float | None = None
    overhead_budget: float | None = None
    max_interval: float | None = None
    keep_last: int | None = None
    levels: tuple[LevelSpec, ...] | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    restore_route: str = "auto"
    deterministic_reduction: bool = False
    """Horovod: tensor fusion off, each tensor reduced alone (``horovod_ckpt.init`` applies it at ``hvd.init()``)."""

    def __post_init__(self) -> None:
        if (self.path is None) == (self.levels is None):
            raise ConfigError("give exactly one of 'path' or 'levels' (the checkpoint location)")
        _check(isinstance(self.storage_options, Mapping), "storage_options", type(self.storage_options).__name__,
               "a mapping")
        _check_storage_options(self.storage_options, "storage_options")
        _check(self.keep_last is None or (type(self.keep_last) is int and self.keep_last > 0), "keep_last",
               self.keep_last, "a positive integer")
        if self.levels is not None:
            object.__setattr__(self, "levels", parse_levels(self.levels, storage_options=self.storage_options,
                                                            keep_last=self.keep_last, allow_storage=True))
        elif not _is_storage(self.path) and (not isinstance(self.path, str) or not self.path):
            raise ConfigError(f"'path' must be a non-empty string (or, in code, a Storage), got {self.path!r}")
        _check(self.restore_route in ROUTES, "restore_route", self.restore_route,
               f"one of {', '.join(map(repr, ROUTES))}")
        _check(type(self.deterministic_reduction) is bool, "deterministic_reduction", self.deterministic_reduction,
               "true or false")
        triggers = [k for k in ("every_n_steps", "every_seconds", "overhead_budget") if getattr(self, k) is not None]
        if len(triggers) > 1:
            raise ConfigError(f"{' and '.join(triggers)} are mutually exclusive: choose one trigger "
                              "(max_interval composes with any of them)")
        _check(self.every_n_steps is None or (type(self.every_n_steps) is int and self.every_n_steps > 0),
               "every_n_steps", self.every_n_steps, "a positive integer")
        _check(self.every_seconds is None or _positive(self.every_seconds), "every_seconds", self.every_seconds,
               "a positive number of seconds")
        _check(self.overhead_budget is None or (_positive(self.overhead_budget) and self.overhead_budget < 1),
               "overhead_budget", self.overhead_budget, "a fraction in (0, 1), e.g. 0.035")
        _check(self.max_interval is None or _positive(self.max_interval), "max_interval", self.max_interval,
               "a positive number of seconds")

    @property
    def location(self) -> str:
        """The checkpoint root as text: ``path`` (a ``Storage``'s URL), or the first (fastest) level's."""
        if self.path is not None:
            return LevelSpec(self.path).location
        return self.levels[0].location  # type: ignore[index]

    def policy(self) -> Policy:
        """The trigger policy these settings describe.

        Without any trigger, nothing is saved periodically (the front ends still save final and
        preemption checkpoints) unless ``max_interval`` is set.
        """
        inner: Policy | None = None
        if self.every_n_steps is not None:
            inner = EveryNSteps(self.every_n_steps)
        elif self.every_seconds is not None:
            inner = EverySeconds(self.every_seconds)
        elif self.overhead_budget is not None:
            inner = Adaptive(self.overhead_budget)
        if self.max_interval is not None:
            return MaxInterval(inner or Never(), self.max_interval)
        return inner or Never()

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "configuration") -> "CheckpointConfig":
        """Build from a mapping; unknown keys fail naming them and the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; "
                              f"known keys: {', '.join(sorted(known))}")
        return cls(**dict(values))

    @classmethod
    def from_yaml(cls, file: str, **overrides: Any) -> "CheckpointConfig":
        """Read a YAML mapping of the flags from ``file``; keyword ``overrides`` win."""
        return cls.from_dict({**read_yaml(file), **overrides}, source=file)


def read_yaml(file: str) -> dict[str, Any]:
    """The mapping of flags in the YAML ``file`` (empty file: ``{}``), not validated yet; a
    :class:`ConfigError` names the file when it cannot be read or is not a mapping."""
    try:
        with open(file, encoding="utf-8") as f:
            values = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"cannot read checkpoint config {file!r}: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{file}: not valid YAML ({e})") from e
    if not isinstance(values, dict):
        raise ConfigError(f"{file}: expected a mapping of checkpoint flags, got {type(values).__name__}")
    return values


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()
"""The default of a front end's flag that a YAML ``config`` may set (``keep_last``, whose ``None``
means "keep every checkpoint")."""

DEFAULT_KEEP_LAST = 3
"""Committed checkpoints kept when neither the flags nor the YAML say (every front end)."""


def given_flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    """The flags a caller gave: :data:`UNSET` and ``None`` are "not given", except
    ``keep_last=None`` (keep every checkpoint)."""
    return {k: v for k, v in flags.items() if v is not UNSET and (v is not None or k == "keep_last")}


def resolve_config(config: "str | Mapping[str, Any] | CheckpointConfig | None",
                   flags: Mapping[str, Any]) -> CheckpointConfig:
    """The one configuration of a front end: ``config`` (a YAML file, a mapping, a
    ``CheckpointConfig`` or ``None``) with the code ``flags`` that were given (:func:`given_flags`)
    on top. ``keep_last`` is :data:`DEFAULT_KEEP_LAST` when neither sets it (before validation, so
    it is also the default of every level); a ``CheckpointConfig`` is taken as it is."""
    given = given_flags(flags)
    if isinstance(config, CheckpointConfig):
        return dataclasses.replace(config, **given) if given else config
    source = "configuration"
    values: dict[str, Any] = {}
    if isinstance(config, Mapping):
        values = dict(config)
    elif config is not None:
        source, values = str(config), read_yaml(str(config))
    merged = {**values, **given}
    if "keep_last" not in merged:
        merged["keep_last"] = DEFAULT_KEEP_LAST
    return CheckpointConfig.from_dict(merged, source=source)


class Never(Policy):
    """No periodic checkpoint (the front ends still save final and preemption checkpoints)."""

    name = "never"

    def first_due(self, step: int) -> int:
        return 2**62

    def next_due(self, step: int) -> int:
        return 2**62


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
