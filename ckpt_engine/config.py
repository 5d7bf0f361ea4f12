"""The one configuration schema shared by the Lightning callback and the Horovod hook.

Flags (keyword arguments or YAML keys), under Lightning's ``ModelCheckpoint`` names where it has
the concept: ``dirpath``, ``every_n_train_steps``, ``train_time_interval`` (seconds, or a
``timedelta``), ``overhead_budget``, ``max_interval``, ``keep_last``, ``levels``,
``storage_options``, ``restore_route`` (``auto``, ``read`` or ``exchange``: how a restore on several
ranks gets the replicated state, see ``ckpt_engine.load.exchange``), ``deterministic_reduction``
(read by the Horovod hook: gradients summed in the same order in every run, so that a resume on
more than 2 ranks is bit-identical; see ``horovod_ckpt.reduction``), ``save_on_train_end`` and
``save_on_sigterm`` (read by the front ends: the final checkpoints). The three triggers are
mutually exclusive; ``max_interval`` ("at least every ... seconds") composes with any.
The names of the first release (``path``, ``every_n_steps``, ``every_seconds``, and the Horovod
hook's ``final_checkpoint``) still work, with a :class:`DeprecationWarning` once per name
(:data:`RENAMED`, :func:`renamed`).
``storage_options`` go to fsspec; the one the library reads too, ``max_concurrency`` (on S3: the
parts of one file uploaded, or ranges of one read fetched, at once; s3fs's default 10), is checked
here to be a positive integer.
Validation happens here, once, with messages that echo the bad key or value. A front end's
flags, over a YAML file or mapping, become one :class:`CheckpointConfig` in :func:`resolve_config`
(one ``keep_last`` default, :data:`DEFAULT_KEEP_LAST`, for every front end).

``levels`` (instead of ``dirpath``) lists the persistence levels, fastest first: each entry a path, or
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
import functools
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping

import yaml

from .config_levels import LevelSpec, _check, _check_storage_options, _is_storage, _positive, parse_levels
from .errors import ConfigError
from .load.exchange import ROUTES
from .training.policy import Adaptive, EveryNSteps, EverySeconds, MaxInterval, Policy


RENAMED: Mapping[str, str] = {"path": "dirpath", "every_n_steps": "every_n_train_steps",
                              "every_seconds": "train_time_interval", "final_checkpoint": "save_on_train_end"}
"""The flags of the first release and their names now (Lightning's ``ModelCheckpoint``'s): the old
ones still work for one release, with a :class:`DeprecationWarning`."""
_warned: set[str] = set()


def renamed(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``values`` with each old flag name (:data:`RENAMED`) replaced by its name now, warning once per
    process and name (a ``DeprecationWarning`` naming both, and ``where``); both names given is a
    :class:`ConfigError`."""
    out = dict(values)
    for old, new in RENAMED.items():
        if old not in out:
            continue
        if new in out and out[new] is not None and out[old] is not None:
            raise ConfigError(f"{where}: give {new!r} or its old name {old!r}, not both "
                              f"({out[new]!r} and {out[old]!r})")
        value = out.pop(old)
        if value is not None or new not in out:
            out[new] = value
        _warn_once(old, where, stacklevel=5)
    return out


def _warn_once(old: str, where: str, stacklevel: int) -> None:
    """The ``DeprecationWarning`` of the old flag name ``old`` (:data:`RENAMED`), once per process."""
    if old not in _warned:
        _warned.add(old)
        warnings.warn(f"{where}: {old!r} is deprecated and will be removed in the next release; "
                      f"use {RENAMED[old]!r} (Lightning's name)", DeprecationWarning, stacklevel=stacklevel)


@dataclass(frozen=True)
class CheckpointConfig:
    """Validated checkpoint settings, the options object every front end accepts (the module
    docstring lists the flags)."""

    dirpath: Any = None
    """A directory or fsspec URL; in code also a ``Storage`` (e.g. a ``ckpt_engine.testing`` double)."""
    every_n_train_steps: int | None = None
    train_time_interval: float | None = None
    """Seconds (a ``timedelta`` is converted)."""
    overhead_budget: float | None = None
    max_interval: float | None = None
    keep_last: int | None = None
    levels: tuple[LevelSpec, ...] | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    restore_route: str = "auto"
    deterministic_reduction: bool = False
    """Horovod: tensor fusion off, each tensor reduced alone (``horovod_ckpt.init`` applies it at ``hvd.init()``)."""
    save_on_train_end: bool = True
    """Front ends: a final checkpoint when training ends (Lightning's ``on_train_end``, Horovod's ``close()``)."""
    save_on_sigterm: bool = True
    """Front ends: on SIGTERM, a checkpoint at a step every rank agrees on, then the signal goes on."""

    def __post_init__(self) -> None:
        if isinstance(self.train_time_interval, timedelta):
            object.__setattr__(self, "train_time_interval", self.train_time_interval.total_seconds())
        if (self.dirpath is None) == (self.levels is None):
            raise ConfigError("give exactly one of 'dirpath' or 'levels' (the checkpoint location)")
        _check(isinstance(self.storage_options, Mapping), "storage_options", type(self.storage_options).__name__,
               "a mapping")
        _check_storage_options(self.storage_options, "storage_options")
        _check(self.keep_last is None or (type(self.keep_last) is int and self.keep_last > 0), "keep_last",
               self.keep_last, "a positive integer")
        if self.levels is not None:
            object.__setattr__(self, "levels", parse_levels(self.levels, storage_options=self.storage_options,
                                                            keep_last=self.keep_last, allow_storage=True))
        elif not _is_storage(self.dirpath) and (not isinstance(self.dirpath, str) or not self.dirpath):
            raise ConfigError(f"'dirpath' must be a non-empty string (or, in code, a Storage), got {self.dirpath!r}")
        _check(self.restore_route in ROUTES, "restore_route", self.restore_route,
               f"one of {', '.join(map(repr, ROUTES))}")
        for key in ("deterministic_reduction", "save_on_train_end", "save_on_sigterm"):
            _check(type(getattr(self, key)) is bool, key, getattr(self, key), "true or false")
        triggers = [k for k in ("every_n_train_steps", "train_time_interval", "overhead_budget")
                    if getattr(self, k) is not None]
        if len(triggers) > 1:
            raise ConfigError(f"{' and '.join(triggers)} are mutually exclusive: choose one trigger "
                              "(max_interval composes with any of them)")
        _check(self.every_n_train_steps is None
               or (type(self.every_n_train_steps) is int and self.every_n_train_steps > 0),
               "every_n_train_steps", self.every_n_train_steps, "a positive integer")
        _check(self.train_time_interval is None or _positive(self.train_time_interval), "train_time_interval",
               self.train_time_interval, "a positive number of seconds (or a timedelta)")
        _check(self.overhead_budget is None or (_positive(self.overhead_budget) and self.overhead_budget < 1),
               "overhead_budget", self.overhead_budget, "a fraction in (0, 1), e.g. 0.035")
        _check(self.max_interval is None or _positive(self.max_interval), "max_interval", self.max_interval,
               "a positive number of seconds")

    # the first release's names, read (CheckpointConfig(...) takes them too: _accept_old_names below)
    @property
    def path(self) -> Any:
        """Deprecated: :attr:`dirpath`."""
        _warn_once("path", "CheckpointConfig", stacklevel=3)
        return self.dirpath

    @property
    def every_n_steps(self) -> int | None:
        """Deprecated: :attr:`every_n_train_steps`."""
        _warn_once("every_n_steps", "CheckpointConfig", stacklevel=3)
        return self.every_n_train_steps

    @property
    def every_seconds(self) -> float | None:
        """Deprecated: :attr:`train_time_interval`."""
        _warn_once("every_seconds", "CheckpointConfig", stacklevel=3)
        return self.train_time_interval

    @property
    def location(self) -> str:
        """The checkpoint root as text: ``dirpath`` (a ``Storage``'s URL), or the first (fastest) level's."""
        if self.dirpath is not None:
            return LevelSpec(self.dirpath).location
        return self.levels[0].location  # type: ignore[index]

    def policy(self) -> Policy:
        """The trigger policy these settings describe.

        Without any trigger, nothing is saved periodically (the front ends still save final and
        preemption checkpoints) unless ``max_interval`` is set.
        """
        inner: Policy | None = None
        if self.every_n_train_steps is not None:
            inner = EveryNSteps(self.every_n_train_steps)
        elif self.train_time_interval is not None:
            inner = EverySeconds(self.train_time_interval)
        elif self.overhead_budget is not None:
            inner = Adaptive(self.overhead_budget)
        if self.max_interval is not None:
            return MaxInterval(inner or Never(), self.max_interval)
        return inner or Never()

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "configuration") -> "CheckpointConfig":
        """Build from a mapping; unknown keys fail naming them and the known ones; the old names
        (:data:`RENAMED`) still work, warning."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = renamed(values, source)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; "
                              f"known keys: {', '.join(sorted(known))}")
        return cls(**dict(values))

    @classmethod
    def from_yaml(cls, file: str, **overrides: Any) -> "CheckpointConfig":
        """Read a YAML mapping of the flags from ``file``; keyword ``overrides`` win."""
        return cls.from_dict({**read_yaml(file), **overrides}, source=file)


def _accept_old_names(init: Any) -> Any:
    """``CheckpointConfig(path=...)`` and the other old names (:data:`RENAMED`) still work, warning."""

    @functools.wraps(init)
    def __init__(self: CheckpointConfig, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **renamed(kwargs, "CheckpointConfig"))

    return __init__


CheckpointConfig.__init__ = _accept_old_names(CheckpointConfig.__init__)  # type: ignore[method-assign]


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
        given = renamed(given, "flags")
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
