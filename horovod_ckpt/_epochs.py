"""The script's epoch loop, as :class:`~horovod_ckpt.HorovodCheckpointer` drives and records it.

A checkpoint records the loop (:meth:`EpochLoop.loop_state`: the script's epoch, whether its body
ended, and how the script's numbering maps to the sampler's) beside the sampler's data position;
a restore (:meth:`EpochLoop.resume`) turns both back into the epoch to run next and how far into
it the ranks were. Training thread only.
"""

from __future__ import annotations

from typing import Any, Iterator

from ckpt_engine.training.position import read_position
from ckpt_engine.training.resumable import set_rng_state


class EpochLoop:
    """Where the training loop stands: ``epoch``, ``samples_in_epoch``, ``batch_in_epoch``."""

    def __init__(self, sampler: Any, world_size: int) -> None:
        self.sampler, self.world_size = sampler, world_size
        self.epoch = 0
        self.samples_in_epoch = 0
        self.batch_in_epoch = 0
        self.loop: dict[str, Any] | None = None  # while epochs() drives the loop: see loop_state()
        self._resume_epoch: int | None = None     # after resume(): the script's next epoch, when known

    def resume(self, data: dict[str, Any] | None, rng: dict[str, Any] | None, loop: dict[str, Any] | None) -> None:
        """After a restore: put the sampler at the saved position (any version this code wrote) and
        find the script's next epoch."""
        sampler_epoch, pos = None, read_position(data)
        if pos is not None and self.sampler is not None:
            # Between restore() and the resumed iteration the DataLoader draws its own seed from the
            # global RNG (at iter()); the uninterrupted run had no such draw mid-epoch, so the
            # restored RNG is put back once more when the iteration starts.
            on_start = (lambda: set_rng_state(rng)) if rng is not None else None
            sampler_epoch, done = self.sampler.resume_at(pos, on_start)
            self.samples_in_epoch = done if pos["mode"] == "global" else done * self.world_size
            bs = pos["batch_size"] or 0
            self.batch_in_epoch = self.samples_in_epoch // (self.world_size * bs) if bs else 0
        self._resume_epoch = next_epoch(loop, sampler_epoch)
        if self._resume_epoch is not None:
            self.epoch = self._resume_epoch

    def epochs(self, start: int, stop: int) -> Iterator[int]:
        """The epochs still to run, in the script's numbering (see ``HorovodCheckpointer.epochs``)."""
        first = start if self._resume_epoch is None else max(start, self._resume_epoch)
        for epoch in range(first, stop):
            if self.sampler is not None and hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(epoch)
            self.epoch = epoch
            self.loop = loop_state(epoch, self.sampler)
            yield epoch
            self.loop = {**self.loop, "ended": True}

    def after_step(self) -> None:
        """One optimizer step done: the sampler counts it; without ``epochs()``, follow its epoch."""
        if self.sampler is not None:
            self.sampler.note_step()
            if self.loop is None:
                self.epoch = self.sampler.running_epoch

    def data_position(self) -> dict[str, Any] | None:
        """The sampler's position, as a checkpoint records it (``None`` without a sampler)."""
        return self.sampler.data_position() if self.sampler is not None else None


def loop_state(epoch: int, sampler: Any) -> dict[str, Any]:
    """What a checkpoint records of the loop ``epochs()`` drives: the script's ``epoch``, whether its
    body ``ended`` (set when the loop moves on; only the last epoch's is ever saved so), and
    ``offset``, the script's number minus the sampler's (0 when ``epochs()`` sets the sampler's
    epoch; else the sampler counts its own iterations), ``None`` without one."""
    offset = epoch - sampler.next_epoch if sampler is not None else None
    return {"epoch": epoch, "ended": False, "offset": offset}


def next_epoch(loop: dict[str, Any] | None, sampler_epoch: int | None) -> int | None:
    """The script's epoch to run next after a restore: the sampler's resumed epoch (already one
    further when the checkpoint ended an epoch) in the script's numbering; without a sampler, the
    saved epoch, or the next when its body had ended; ``None`` when the checkpoint does not say."""
    if sampler_epoch is not None:
        return sampler_epoch + (loop["offset"] if loop is not None and loop["offset"] is not None else 0)
    if loop is not None:
        return int(loop["epoch"]) + (1 if loop["ended"] else 0)
    return None
