"""Both Lightning distributions, with one callback.

Lightning ships the same trainer twice: the unified ``lightning`` package (``lightning.pytorch``,
what most users install) and the standalone ``pytorch_lightning``. Their classes are distinct, so a
callback that subclasses one distribution's ``Callback`` is rejected by the other's
``LightningCLI`` (jsonargparse checks ``issubclass``) and misses the other's exceptions.

The front end is written once: its classes derive from the base class of *every* installed
distribution (the two bases define the same hooks, so either serves the method resolution), and
whatever is specific to a run (the exception to raise, the strategies to refuse) is looked up in
the distribution the running ``Trainer`` comes from (:func:`of`).
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from functools import lru_cache
from types import ModuleType
from typing import Any

NAMES = ("lightning.pytorch", "pytorch_lightning")
"""The trainer packages, the unified distribution first."""


@lru_cache(maxsize=None)
def installed() -> tuple[ModuleType, ...]:
    """The trainer packages that import here (at least one, else ``ImportError`` with the fix)."""
    found = []
    for name in NAMES:
        if importlib.util.find_spec(name.split(".")[0]) is None:
            continue
        found.append(importlib.import_module(name))
    if not found:
        raise ImportError("lightning_ckpt needs Lightning: pip install lightning (or pytorch-lightning)")
    return tuple(found)


def resolve(package: ModuleType, dotted: str) -> Any:
    """``package``'s object at the dotted path ``dotted`` (``"utilities.rank_zero"``,
    ``"callbacks.Callback"``), importing the submodules on the way."""
    obj: Any = package
    for part in dotted.split("."):
        obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(f"{obj.__name__}.{part}")
    return obj


def bases(attribute: str) -> tuple[type, ...]:
    """The class ``attribute`` (a dotted path such as ``"callbacks.Callback"``) of every installed
    distribution, to derive from all of them at once."""
    return tuple(resolve(package, attribute) for package in installed())


def of(obj: Any) -> ModuleType:
    """The trainer package ``obj`` (a ``Trainer``, strategy, ...) belongs to; a user's subclass
    belongs to the package of the Lightning class it derives from."""
    for cls in type(obj).__mro__:
        for package in installed():
            if cls.__module__ == package.__name__ or cls.__module__.startswith(package.__name__ + "."):
                return package
    raise TypeError(f"{type(obj).__qualname__} (from {type(obj).__module__}) comes from no Lightning "
                    f"distribution installed here ({', '.join(p.__name__ for p in installed())})")


_SIGTERM = "utilities.exceptions.SIGTERMException"


def sigterm_exception(trainer: Any) -> type[BaseException]:
    """The ``SIGTERMException`` of the trainer's distribution."""
    return resolve(of(trainer), _SIGTERM)


def sigterm_exceptions() -> tuple[type[BaseException], ...]:
    """Every installed distribution's ``SIGTERMException`` (for ``isinstance``)."""
    return tuple(resolve(package, _SIGTERM) for package in installed())


def notice(trainer: Any, message: str, warn: bool = False) -> None:
    """Say ``message`` once per job (rank 0) through the trainer's distribution: a log line, or a
    warning when it is about work that will not be resumed."""
    rank_zero = resolve(of(trainer), "utilities.rank_zero")
    (rank_zero.rank_zero_warn if warn else rank_zero.rank_zero_info)(message)


def log_figures(logger: Any, row: dict[str, Any]) -> None:
    """Rank 0: one finished save's (``ckpt/stall_ms``...) or flush's (``ckpt/level2_...``) figures
    to the trainer's ``logger`` (``None``: nothing)."""
    if logger is not None:
        prefix = "ckpt/" if row["kind"] == "save" else f"ckpt/level{row['level']}_"
        logger.log_metrics({f"{prefix}{k}": float(v) for k, v in row.items()
                            if isinstance(v, (int, float)) and k not in ("step", "time", "level")}, step=row["step"])


_NOT_RESUMABLE = r"You're resuming from a checkpoint that ended before the epoch ended"


def silence_not_resumable() -> Any:
    """Hide Lightning's "dataloader is not resumable" warning, which is wrong when this callback
    resumes the data position; returns the filter for :func:`unsilence` (call it at the first batch:
    the warning comes before it)."""
    warnings.filterwarnings("ignore", message=_NOT_RESUMABLE)
    return warnings.filters[0]


def unsilence(entry: Any) -> None:
    """Remove the filter :func:`silence_not_resumable` added (``None``: nothing to do); returns ``None``."""
    if entry is not None and entry in warnings.filters:
        warnings.filters.remove(entry)
        getattr(warnings, "_filters_mutated", lambda: None)()
    return None
