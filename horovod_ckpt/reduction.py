"""Deterministic gradient reduction under Horovod: tensor fusion off, from ``hvd.init()`` on.

Why. Horovod packs the tensors that are ready in one cycle (``HOROVOD_CYCLE_TIME``, 1 ms) into a
fusion buffer of up to ``HOROVOD_FUSION_THRESHOLD`` bytes (128 MiB) and reduces the buffer at once.
Which tensors share a buffer, and where in it each one lies, depends on timing. With more than 2
ranks a ring allreduce sums each element in an order set by its offset in the buffer (the segment
it falls in), so the same gradients give sums that differ in their last bits from run to run, and a
resumed run drifts from the uninterrupted one. On 2 ranks each sum is one addition, and
``a + b == b + a`` bit for bit: there the order does not matter.

What Horovod 0.28 honours. ``hvd.init()`` reads ``HOROVOD_FUSION_THRESHOLD`` from the environment
when it starts its background thread (``operations.cc``); nothing changes it afterwards (autotuning
leaves a threshold that was set alone), and Horovod offers no way to read it back. At ``0`` (any
value that parses to 0 or less) no two tensors share a buffer: each is reduced alone, at its own
size, in the same order of additions in every run. Fixed groups
(``hvd.DistributedOptimizer(groups=N)``) are not enough by themselves: the groups that are ready in
the same cycle are fused together (two 4-rank runs differed); ``HOROVOD_DISABLE_GROUP_FUSION=1``,
also read at ``hvd.init()``, keeps each group in a fused buffer of its own, but it needs the script's
optimizer built with groups and leaves every other tensor to timing. So the one switch is the fusion
threshold, and it must be in the environment when ``hvd.init()`` runs.

Where it is applied. :class:`~horovod_ckpt.HorovodCheckpointer` is built after ``hvd.init()``, too
late. :func:`init` takes the place of ``hvd.init()``: it puts the threshold into ``os.environ``
(left there, so every later ``hvd.init()`` of the process, an elastic reset's included, reads it),
then starts Horovod. Re-initialising a running Horovod (``hvd.shutdown()``, then ``hvd.init()`` on
every rank at the same point) was tried and is not offered: under ``horovodrun`` with Gloo it gave
bit-identical runs, but 2 of 17 such 4-rank jobs on a loaded machine failed (the one whose output
was kept, in the second initialisation: ``connect [127.0.0.1]:<port>: Connection refused``).
Horovod 0.28.1's rendezvous server forgets which ranks finished a scope whenever any scope completes
(``finished_list.clear()`` in ``runner/http/http_server.py``): once a rank's one-rank cross-node
scope completes before every rank has left the node-local scope, that scope is never cleared and
keeps the first initialisation's addresses, which a rank of the second may read before their owner
replaces them. Under MPI a second initialisation is impossible anyway. So :func:`init` after
``hvd.init()`` with fusion on refuses, and the hook never touches Horovod's initialisation: it
checks. With ``deterministic_reduction`` asked for and fusion on for more than 2 ranks, it raises
on every rank, naming the ways to turn fusion off; without it, a resume on more than 2 ranks with
fusion on warns once on rank 0 (:func:`resume_warning`).

What is in effect is judged by the environment variable, the value ``hvd.init()`` read unless the
script changed it afterwards, which nothing can detect.
"""

from __future__ import annotations

import os
import re
from typing import Any, Sequence

from ckpt_engine.comm import Comm
from ckpt_engine.config import resolve_config
from ckpt_engine.errors import ConfigError

from .comm import import_horovod

FUSION_THRESHOLD = "HOROVOD_FUSION_THRESHOLD"
KEY = "deterministic_reduction"
FIXES = ("call horovod_ckpt.init(config) in place of hvd.init(), on every rank, or launch with "
         "`horovodrun --fusion-threshold-mb 0 ...` (HOROVOD_FUSION_THRESHOLD=0 in every rank's environment)")


def fusion_off(value: str | None) -> bool:
    """Whether ``hvd.init()`` turns tensor fusion off with ``HOROVOD_FUSION_THRESHOLD=value``: the
    value parsed as Horovod parses it (C's ``strtol``: leading digits, else 0) is 0 or less.
    ``None`` (not set) is Horovod's default, 128 MiB."""
    if value is None:
        return False
    number = re.match(r"\s*([+-]?\d+)", value)
    return int(number.group(1)) <= 0 if number else True


def describe(value: str | None) -> str:
    """``HOROVOD_FUSION_THRESHOLD`` as a message names it."""
    return f"{FUSION_THRESHOLD}={value!r}" if value is not None else f"{FUSION_THRESHOLD} unset (128 MiB)"


def requested(config: Any = None, flag: bool | None = None) -> bool:
    """``deterministic_reduction``: ``flag`` when given, else the key of ``config`` (a YAML file, a
    mapping or a ``CheckpointConfig``, validated as the front ends validate it), else ``False``."""
    if config is not None:
        return resolve_config(config, {KEY: flag}).deterministic_reduction
    if flag is not None and type(flag) is not bool:
        raise ConfigError(f"{KEY}={flag!r} is invalid: expected true or false")
    return bool(flag)


def init(config: Any = None, *, deterministic_reduction: bool | None = None, **init_kwargs: Any) -> bool:
    """``hvd.init(**init_kwargs)`` with the gradient reduction the checkpoint configuration asks for.

    Call it in place of ``hvd.init()``, on every rank, before anything else starts Horovod.
    ``config`` is the YAML file (or mapping, or ``CheckpointConfig``) the hook gets;
    ``deterministic_reduction`` wins over its key. When deterministic reduction is asked for,
    ``HOROVOD_FUSION_THRESHOLD=0`` is set in ``os.environ`` (and stays set) before Horovod starts.
    When Horovod already runs, nothing is started again: with fusion on and deterministic reduction
    asked for, a :class:`~ckpt_engine.errors.ConfigError` says what to do (a second initialisation
    is not reliable, see the module's docstring). Returns whether tensor fusion is off (the
    reduction deterministic on any number of ranks).
    """
    want = requested(config, deterministic_reduction)
    hvd = import_horovod()
    if hvd.is_initialized():
        if want and not fusion_off(os.environ.get(FUSION_THRESHOLD)):
            raise ConfigError(f"horovod_ckpt.init({KEY}=True) after Horovod was started with tensor fusion on "
                              f"({describe(os.environ.get(FUSION_THRESHOLD))}): Horovod reads it at hvd.init() only, "
                              "and starting it a second time is not reliable. Call horovod_ckpt.init() in place of "
                              "hvd.init(), or launch with `horovodrun --fusion-threshold-mb 0 ...`")
        return fusion_off(os.environ.get(FUSION_THRESHOLD))
    if want:
        os.environ[FUSION_THRESHOLD] = "0"
    hvd.init(**init_kwargs)
    return fusion_off(os.environ.get(FUSION_THRESHOLD))


def settings(comm: Comm) -> list[str | None]:
    """Every rank's ``HOROVOD_FUSION_THRESHOLD``, by rank; one all-gather, on more than 2 ranks only
    (on 1 or 2 the order of a sum does not change it: nothing is gathered, ``[]``). Every rank."""
    if comm.world_size <= 2:
        return []
    return list(comm.all_gather(os.environ.get(FUSION_THRESHOLD)))


def _fused_ranks(values: Sequence[str | None]) -> list[int]:
    return [rank for rank, value in enumerate(values) if not fusion_off(value)]


def _fused_said(values: Sequence[str | None]) -> str:
    fused = _fused_ranks(values)
    said = sorted({describe(values[r]) for r in fused})
    where = "every rank" if len(fused) == len(values) else f"rank(s) {', '.join(map(str, fused))}"
    return f"{' / '.join(said)} on {where}"


def refusal(wanted: bool, values: Sequence[str | None]) -> str | None:
    """The error to raise (on every rank: ``values`` are all ranks', :func:`settings`) when
    deterministic reduction is asked for and fusion is on somewhere; ``None`` otherwise."""
    if not wanted or not _fused_ranks(values):
        return None
    return (f"{KEY}=True, but Horovod's tensor fusion is on ({_fused_said(values)} when hvd.init() ran): on more "
            "than 2 ranks the gradients would be summed in an order that depends on timing, and a resumed run would "
            f"not be bit-identical. To turn it off, {FIXES}")


def resume_warning(values: Sequence[str | None]) -> str | None:
    """What rank 0 says when it resumes more than 2 ranks with fusion on (``values``: every
    rank's, :func:`settings`); ``None`` when the reduction is deterministic."""
    if not _fused_ranks(values):
        return None
    return (f"HorovodCheckpointer.restore: resumed on {len(values)} ranks with Horovod's tensor fusion on "
            f"({_fused_said(values)}): Horovod packs gradients into buffers by timing, which changes the order "
            "of their sums on more than 2 ranks, so this run will not end bit-identical to an uninterrupted one. "
            f"For an exact resume set `{KEY}: true` in the checkpoint YAML (or {KEY}=True) and {FIXES}")
