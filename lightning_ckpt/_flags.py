"""The callback's flags: Lightning's names beside the core's, and errors in the words the user wrote."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any, Optional

from ckpt_engine.config import CheckpointConfig, ConfigError, resolve_config

ALIASES = (("path", "dirpath"), ("every_n_steps", "every_n_train_steps"), ("every_seconds", "train_time_interval"))
"""The core's flag names and the Lightning ones the callback accepts for them (``ModelCheckpoint``'s)."""


def build_config(*, path: Optional[str], dirpath: Optional[str], every_n_steps: Optional[int],
                 every_n_train_steps: Optional[int], every_seconds: Optional[float],
                 train_time_interval: Optional[timedelta | float], overhead_budget: Optional[float],
                 max_interval: Optional[float], keep_last: Optional[int], levels: Optional[list[str]],
                 storage_options: Optional[dict[str, Any]], restore_route: Optional[str] = None) -> CheckpointConfig:
    """The core's configuration from the callback's arguments, validated now (before the trainer
    starts); a :class:`ConfigError` names each flag as the user wrote it (``every_n_train_steps``,
    not the core's ``every_n_steps``)."""
    interval = train_time_interval.total_seconds() if isinstance(train_time_interval, timedelta) \
        else train_time_interval
    given = {"path": dirpath, "every_n_steps": every_n_train_steps, "every_seconds": interval}
    aliases = {core: alias for core, alias in ALIASES if given[core] is not None}
    flags = {"path": _one_of("path", path, "dirpath", dirpath),
             "every_n_steps": _one_of("every_n_steps", every_n_steps, "every_n_train_steps", every_n_train_steps),
             "every_seconds": _one_of("every_seconds", every_seconds, "train_time_interval", interval),
             "overhead_budget": overhead_budget, "max_interval": max_interval, "keep_last": keep_last,
             "levels": levels, "storage_options": storage_options, "restore_route": restore_route}
    try:
        return resolve_config(None, flags)
    except ConfigError as error:
        raise ConfigError(_in_user_words(str(error), aliases)) from None


def _in_user_words(message: str, aliases: dict[str, str]) -> str:
    """``message`` with the core's flag names replaced by the Lightning names the user gave."""
    for core, alias in aliases.items():
        message = re.sub(rf"\b{core}\b", alias, message)
    return message


def _one_of(name: str, value: Any, alias: str, alias_value: Any) -> Any:
    if value is not None and alias_value is not None:
        raise ValueError(f"give {name!r} or Lightning's {alias!r}, not both ({value!r} and {alias_value!r})")
    return value if value is not None else alias_value
