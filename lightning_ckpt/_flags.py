"""The callback's flags: Lightning's names (the core's too), the first release's names behind a
``DeprecationWarning``, and errors in the words the user wrote."""

from __future__ import annotations

import re
from typing import Any, Mapping

from ckpt_engine.config import DEFAULT_KEEP_LAST, RENAMED, CheckpointConfig, ConfigError, renamed, resolve_config


def build_config(flags: Mapping[str, Any], old: Mapping[str, Any], config: Any = None) -> CheckpointConfig:
    """The core's configuration from the callback's arguments, validated now (before the trainer
    starts): ``flags`` under their names now, ``old`` the first release's names (:data:`RENAMED`:
    each one given warns once and counts as its new name), over ``config`` (a YAML file, a mapping
    or a ``CheckpointConfig``; the flags given win). With ``config``, ``keep_last`` left at its
    default (:data:`DEFAULT_KEEP_LAST`) yields to the config's. A :class:`ConfigError` names each flag
    as the user wrote it (``every_n_steps`` for a user who wrote the old name)."""
    given_old = {k: v for k, v in old.items() if v is not None}
    values = dict(flags)
    if config is not None and values.get("keep_last") == DEFAULT_KEEP_LAST:
        values.pop("keep_last")
    values = renamed({**values, **given_old}, "AsyncShardedCheckpoint")
    try:
        return resolve_config(config, values)
    except ConfigError as error:
        raise ConfigError(_in_user_words(str(error), {RENAMED[k]: k for k in given_old})) from None


def _in_user_words(message: str, names: dict[str, str]) -> str:
    """``message`` with the flag names now replaced by the old names the user gave."""
    for new, old in names.items():
        message = re.sub(rf"\b{new}\b", old, message)
    return message
