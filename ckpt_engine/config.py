"""The one configuration schema shared by the Lightning callback and the Horovod hook.

Flags (keyword arguments or YAML keys): ``path``, ``every_n_steps``, ``every_seconds``,
``overhead_budget``, ``max_interval``, ``keep_last``, ``levels``, ``storage_options``. The three
triggers are mutually exclusive; ``max_interval`` ("at least every ... seconds") composes with any.
Validation happens here, once, with messages that echo the bad key or value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from .errors import CheckpointError
from .policy import Adaptive, EveryNSteps, EverySeconds, MaxInterval, Policy


class ConfigError(CheckpointError, ValueError):
    """A configuration key or value is invalid."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Validated checkpoint settings (see the module docstring for the flags)."""

    path: str | None = None
    every_n_steps: int | None = None
    every_seconds: float | None = None
    overhead_budget: float | None = None
    max_interval: float | None = None
    keep_last: int | None = None
    levels: tuple[str, ...] | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.path is None) == (self.levels is None):
            raise ConfigError("give exactly one of 'path' or 'levels' (the checkpoint location)")
        if self.levels is not None:
            if isinstance(self.levels, str) or not self.levels or not all(isinstance(x, str) for x in self.levels):
                raise ConfigError(f"'levels' must be a non-empty list of paths, got {self.levels!r}")
            object.__setattr__(self, "levels", tuple(self.levels))
            if len(self.levels) > 1:
                raise ConfigError(f"'levels' with {len(self.levels)} entries: multi-level persistence is not "
                                  "supported by this version; give one level or 'path'")
        elif not isinstance(self.path, str) or not self.path:
            raise ConfigError(f"'path' must be a non-empty string, got {self.path!r}")
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
        _check(self.keep_last is None or (type(self.keep_last) is int and self.keep_last > 0), "keep_last",
               self.keep_last, "a positive integer")
        _check(isinstance(self.storage_options, Mapping), "storage_options", type(self.storage_options).__name__,
               "a mapping")

    @property
    def location(self) -> str:
        """The checkpoint root (``path``, or the single level)."""
        return self.path if self.path is not None else self.levels[0]  # type: ignore[index]

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
        try:
            with open(file, encoding="utf-8") as f:
                values = yaml.safe_load(f) or {}
        except OSError as e:
            raise ConfigError(f"cannot read checkpoint config {file!r}: {e}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{file}: not valid YAML ({e})") from e
        if not isinstance(values, dict):
            raise ConfigError(f"{file}: expected a mapping of checkpoint flags, got {type(values).__name__}")
        return cls.from_dict({**values, **overrides}, source=file)


class Never(Policy):
    """No periodic checkpoint (the front ends still save final and preemption checkpoints)."""

    name = "never"

    def first_due(self, step: int) -> int:
        return 2**62

    def next_due(self, step: int) -> int:
        return 2**62


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def _check(ok: bool, key: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: expected {expected}")
