"""``DurableTorchState``: Horovod elastic's ``TorchState`` whose ``commit()`` also persists.

``hvd.elastic.run`` keeps the last ``commit()`` in host memory so the surviving workers can roll
back when one fails; a job that is stopped as a whole (preemption of every host, a crash of the
driver) loses it. This subclass turns every commit (or every N, by the core's policy flags,
counted in commits) into a durable asynchronous checkpoint as well, and the first ``sync()`` of
a new job starts from the newest one::

    state = DurableTorchState("s3://bucket/run", model=model, optimizer=optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...; state.commit()       # in-memory commit + durable checkpoint, persisted in the background

    train(state)
    state.close()                 # waits for pending persists

Order of events. ``sync()`` (``hvd.elastic.run`` calls it on every worker at start and after a
reset) (re)creates the checkpointer for the current set of workers; at the job's first sync,
every worker loads the newest durable checkpoint into the model, optimizers and attributes, and
the inherited sync then broadcasts rank 0's state as usual. ``commit()`` = in-memory save, durable save, host
check (in that order, so the durable checkpoint is the state being committed).

After a reset that changed the workers, the previous checkpointer is closed on a background
thread: a checkpoint whose writers did not all survive never commits (the previous one stays).
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

import horovod.torch as hvd
import torch
from horovod.torch.elastic import TorchState

from ckpt_engine import Checkpointer
from ckpt_engine.config import RENAMED, UNSET, renamed, resolve_config
from ckpt_engine.errors import ConfigError
from ckpt_engine.training.parts import Parts, split_weights
from ckpt_engine.training.session import TrainingSession

from . import reduction
from .comm import HorovodComm

_TRIGGERS = ("every_n_train_steps", "train_time_interval", "overhead_budget")


class DurableTorchState(TorchState):
    """A ``TorchState`` whose ``commit()`` also takes a durable, rank-sliced checkpoint.

    Args:
        dirpath: checkpoint root (local path or fsspec URL).
        model, optimizer, **kwargs: as for ``TorchState`` (plain attributes such as ``epoch`` and
            ``batch`` must be plain values: numbers, strings, lists, dicts).
        config, every_n_train_steps, train_time_interval, overhead_budget, max_interval, keep_last, levels, storage_options:
            the configuration's flags (Lightning's names; ``path``, ``every_n_steps`` and
            ``every_seconds`` still work, deprecated); steps count commits (default: every commit). The config's
            ``deterministic_reduction: true`` is checked against this worker's environment, whatever
            the number of workers (an elastic job may grow past 2): call ``horovod_ckpt.init(config)``
            before ``hvd.init()``; elastic resets read the same environment.
        commit_timeout: seconds rank 0 waits for every writer (short: workers come and go).
    """

    def __init__(self, dirpath: str | None = None, model: Any = None, optimizer: Any = None, *,
                 config: Any = None, every_n_train_steps: int | None = None, train_time_interval: Any = None,
                 overhead_budget: float | None = None, max_interval: float | None = None,
                 keep_last: int | None = UNSET, levels: list[Any] | None = None,
                 storage_options: dict[str, Any] | None = None, commit_timeout: float = 120.0,
                 **kwargs: Any) -> None:
        old = {k: kwargs.pop(k) for k in RENAMED if k in kwargs and k != "final_checkpoint"}
        flags = renamed({"dirpath": dirpath, "every_n_train_steps": every_n_train_steps,
                         "train_time_interval": train_time_interval, "overhead_budget": overhead_budget,
                         "max_interval": max_interval, "keep_last": keep_last, "levels": levels,
                         "storage_options": storage_options, **old}, "DurableTorchState")
        if config is None and all(flags[k] is None for k in _TRIGGERS):
            flags["every_n_train_steps"] = 1
        self._durable_config = resolve_config(config, flags)
        self._durable_policy = self._durable_config.policy()
        refused = reduction.refusal(self._durable_config.deterministic_reduction,
                                    [os.environ.get(reduction.FUSION_THRESHOLD)])
        if refused:
            raise ConfigError(refused)
        self._commit_timeout = commit_timeout
        self._session: TrainingSession | None = None
        self._world: tuple[int, int] | None = None
        self._restored_once = False
        self._retiring: list[threading.Thread] = []
        self.durable_step = 0
        """Commits so far, over every incarnation of the job: the step of the durable checkpoints."""
        self.restored_step: int | None = None
        """The durable checkpoint the job started from (``None``: a fresh start)."""
        super().__init__(model=model, optimizer=optimizer, **kwargs)

    # ---- the elastic protocol ----------------------------------------------------------------
    def sync(self) -> None:
        self._ensure_session()
        if not self._restored_once:
            self._restored_once = True
            self._restore_durable()
        super().sync()

    def commit(self) -> None:
        self.save()
        self._durable_save()
        self.check_host_updates()

    def reset(self) -> None:
        super().reset()
        self._retire()

    def close(self) -> None:
        """Wait for every pending durable checkpoint, then stop (every worker)."""
        if self._session is not None:
            self._session.close()
            self._session = None
        for t in self._retiring:
            t.join()
        self._retiring = []

    # ---- durable checkpoints -----------------------------------------------------------------
    def _ensure_session(self) -> TrainingSession:
        world = (hvd.rank(), hvd.size())
        if self._session is not None and self._world == world:
            return self._session
        self._retire()
        comm = HorovodComm(prefix="ckpt.elastic")
        session = TrainingSession(self._durable_config, self._capture, name="DurableTorchState",
                                  policy=self._durable_policy, commit_timeout=self._commit_timeout)
        session.start(comm)
        self._session, self._world = session, world
        # Every worker counts commits from the same number (a worker that joined late has none).
        self.durable_step = int(comm.broadcast(self.durable_step))
        return session

    def _retire(self) -> None:
        old, self._session, self._world = self._session, None, None
        if old is not None:
            t = threading.Thread(target=_close_quietly, args=(old,), name="ckpt-elastic-retire", daemon=True)
            t.start()
            self._retiring.append(t)

    def _restore_durable(self) -> None:
        # Every worker takes part (a collective: the newest checkpoint that verifies everywhere,
        # falling back past damaged ones; failures raised on every worker); the inherited sync()
        # that follows broadcasts rank 0's state anyway, as after any elastic reset.
        resumed = self._ensure_session().restore()
        if resumed is None:
            return
        for name, handler in self._handlers.items():
            saved = resumed.replicated["objects"][name]
            if isinstance(handler.value, torch.nn.Module):
                saved = {**saved, **resumed.first["buffers"].get(name, {})}
            handler.value.load_state_dict(saved)
        for name, value in resumed.replicated["attrs"].items():
            if name in self._saved_state:
                setattr(self, name, value)
        self.save()
        self.durable_step = self.restored_step = resumed.step

    def _durable_save(self) -> None:
        session = self._ensure_session()
        self.durable_step += 1
        if session.due(self.durable_step):
            session.save(self.durable_step)

    def _capture(self) -> Parts:
        objects: dict[str, Any] = {}
        buffers: dict[str, Any] = {}
        for name, handler in self._handlers.items():
            value = handler.value
            if isinstance(value, torch.nn.Module):
                objects[name], buffers[name] = split_weights(value.state_dict(), (n for n, _ in value.named_buffers()))
            elif value is not None:
                objects[name] = value.state_dict()
        return Parts({"objects": objects, "attrs": dict(self._saved_state), "step": self.durable_step},
                     {"buffers": buffers})

    @property
    def checkpointer(self) -> Checkpointer | None:
        """The engine's checkpointer for the current workers (records, counters)."""
        return self._session.ck if self._session is not None else None


def _close_quietly(session: TrainingSession) -> None:
    try:
        session.close(release_memory=False)  # a memory level's node directory serves the restarted job too
    except Exception as e:  # noqa: BLE001 - a retired checkpointer's failure only loses its own save
        warnings.warn(f"horovod_ckpt: a checkpoint of the previous set of workers did not commit: {e}",
                      stacklevel=1)
