"""The optimizer's hyper-parameters across a restore: the checkpoint's, or the script's.

Why: Horovod scripts scale the learning rate by the number of ranks (``lr = args.lr * hvd.size()``,
as in Horovod's ``pytorch_mnist.py``). ``optimizer.load_state_dict`` writes the saved
``param_groups`` over what the script set, so a job saved on 2 ranks and continued on 3 trains at
the 2-rank rate. Either may be wanted; neither may be silent:

* ``"checkpoint"`` (the default): the restored values stay; when the world size changed and they
  differ from the script's, rank 0 warns, naming each value (:func:`changed_message`);
* ``"script"``: after the optimizer state (momentum, ``exp_avg``...) is loaded, every param group's
  keys other than ``params`` get the script's values back, and so does an LR scheduler's
  ``base_lrs``; the scheduler's position (``last_epoch``) stays restored. With a scheduler that
  has ``base_lrs``, ``lr`` is the restored (scheduled) rate times script base / restored base: the
  schedule continues where it was, on the script's scale (exact for schedulers proportional to the
  base: LinearLR, StepLR, LambdaLR...). Keys a scheduler drives besides ``lr`` (OneCycleLR's
  momentum) restart from the script's values (:func:`put_back`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

OptimizerHparams = Literal["checkpoint", "script"]
CHOICES: tuple[str, ...] = ("checkpoint", "script")


def check_choice(value: Any) -> OptimizerHparams:
    """``value`` when it is a valid ``optimizer_hparams``; else a ``ValueError`` echoing it."""
    if value not in CHOICES:
        raise ValueError(f"optimizer_hparams={value!r} is invalid: use 'checkpoint' (keep the restored "
                         "learning rate and other hyper-parameters) or 'script' (keep the values this script set)")
    return value


@dataclass(frozen=True)
class Hparams:
    """Per param group, every key but ``params``; the scheduler's ``base_lrs`` when it has them."""

    groups: tuple[dict[str, Any], ...]
    base_lrs: tuple[Any, ...] | None

    @staticmethod
    def of(optimizer: Any, scheduler: Any) -> "Hparams":
        groups = tuple({k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups)
        base = getattr(scheduler, "base_lrs", None)
        return Hparams(groups, tuple(copy.deepcopy(base)) if base is not None else None)


def differences(restored: Hparams, script: Hparams) -> list[tuple[str, Any, Any]]:
    """``(name, restored value, script value)`` of each value that differs. A scheduled ``lr``
    (a scheduler with ``base_lrs``) is compared by its base, ``initial_lr``: the script's ``lr`` at
    restore time is the schedule's first value, not a rate to compare with a restored one."""
    out = []
    many = len(script.groups) > 1
    for i, (r, s) in enumerate(zip(restored.groups, script.groups)):
        for key in s:
            if key == "lr" and script.base_lrs is not None and "initial_lr" in s:
                continue
            if key in r and not _same(r[key], s[key]):
                label = "lr (the scheduler's base)" if key == "initial_lr" else key
                out.append((f"param group {i} {label}" if many else label, r[key], s[key]))
    return out


def changed_message(restored: Hparams, script: Hparams, saved_world: int, world: int) -> str | None:
    """``"checkpoint"``: the warning to give when the world size changed and hyper-parameters
    differ (rank 0 gives it), naming each value; ``None`` otherwise."""
    diffs = differences(restored, script) if saved_world != world else []
    if not diffs:
        return None
    said = "; ".join(f"{name}: restored {_show(r)} (saved by {saved_world} ranks), script {_show(s)} ({world} ranks)"
                     for name, r, s in diffs)
    return (f"HorovodCheckpointer.restore: the checkpoint was saved by {saved_world} ranks and this job has {world}; "
            f"the optimizer keeps the checkpoint's hyper-parameters, not this script's: {said}. Pass "
            "optimizer_hparams='script' to keep the script's values (the optimizer state stays restored)")


def after_restore(choice: OptimizerHparams, optimizer: Any, scheduler: Any, script: Hparams | None,
                  saved_world: int, world: int, rank: int) -> str | None:
    """Once the optimizer state is loaded (``script``: the values the script had set before):
    ``"script"`` puts them back; ``"checkpoint"`` returns rank 0's warning, if one is due."""
    if script is None:
        return None
    if choice == "script":
        put_back(optimizer, scheduler, script)
        return None
    return changed_message(Hparams.of(optimizer, scheduler), script, saved_world, world) if rank == 0 else None


def put_back(optimizer: Any, scheduler: Any, script: Hparams) -> None:
    """``"script"``: the script's values over the restored ones (see the module docstring)."""
    restored_base = getattr(scheduler, "base_lrs", None)
    for i, (group, mine) in enumerate(zip(optimizer.param_groups, script.groups)):
        lr = group.get("lr")
        group.update(copy.deepcopy(mine))
        if restored_base is not None and script.base_lrs is not None and i < len(restored_base) and lr is not None:
            group["lr"] = lr * (script.base_lrs[i] / restored_base[i]) if restored_base[i] else mine.get("lr")
    if scheduler is not None and script.base_lrs is not None:
        scheduler.base_lrs = list(script.base_lrs)
        if hasattr(scheduler, "_last_lr"):  # get_last_lr() reports what the groups now hold
            scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # tensors of several elements
        return False


def _show(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else repr(value)
