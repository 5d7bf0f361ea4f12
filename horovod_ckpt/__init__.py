"""Horovod front end for ckpt-suite: a few lines in an existing Horovod script.

* :class:`HorovodCheckpointer` — ``restore()`` before the loop, ``after_step()`` after every
  optimizer step, ``close()`` at the end; rank-sliced asynchronous checkpoints, exact resume.
* :class:`HorovodComm` — the core's communicator over Horovod's object collectives.
* :class:`DurableTorchState` — ``hvd.elastic.TorchState`` whose ``commit()`` also persists.
* :func:`init` — ``hvd.init()`` with tensor fusion off when the checkpoint configuration asks for a
  deterministic reduction (exact resume on more than 2 ranks).

Horovod itself is imported when one of these is used, so this package imports without it.
"""

from typing import Any

from .comm import HorovodComm
from .hook import HorovodCheckpointer
from .reduction import init

__all__ = ["HorovodCheckpointer", "HorovodComm", "DurableTorchState", "init"]


def __getattr__(name: str) -> Any:
    if name == "DurableTorchState":  # subclasses horovod's TorchState: import horovod only now
        from .elastic import DurableTorchState

        return DurableTorchState
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
