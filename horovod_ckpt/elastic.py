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

import threading
import warnings
from typing import Any

import horovod.torch as hvd
import torch
from horovod.torch.elastic import TorchState

from ckpt_engine import Checkpointer
from ckpt_engine.errors import NoCheckpointError
from ckpt_engine.training.resumable import rng_state
from ckpt_engine.training.schedule import Schedule

from .comm import HorovodComm
from .hook import _UNSET, given_flags, make_checkpointer, resolve_config


class DurableTorchState(TorchState):
    """A ``TorchState`` whose ``commit()`` also takes a durable, rank-sliced checkpoint.

    Args:
        path: checkpoint root (local path or fsspec URL).
        model, optimizer, **kwargs: as for ``TorchState`` (plain attributes such as ``epoch`` and
            ``batch`` must be plain values: numbers, strings, lists, dicts).
        config, every_n_steps, every_seconds, overhead_budget, max_interval, keep_last, levels,
            storage_options: the core's flags; steps count commits (default: every commit).
        commit_timeout: seconds rank 0 waits for every writer (short: workers come and go).
    """

    def __init__(self, path: str | None = None, model: Any = None, optimizer: Any = None, *,
                 config: Any = None, every_n_steps: int | None = None, every_seconds: float | None = None,
                 overhead_budget: float | None = None, max_interval: float | None = None,
                 keep_last: int | None = _UNSET, levels: list[Any] | None = None,
                 storage_options: dict[str, Any] | None = None, commit_timeout: float = 120.0,
                 **kwargs: Any) -> None:
        flags = {"path": path, "every_n_steps": every_n_steps, "every_seconds": every_seconds,
                 "overhead_budget": overhead_budget, "max_interval": max_interval, "keep_last": keep_last,
                 "levels": levels, "storage_options": storage_options}
        given = given_flags(flags)
        if not any(k in given for k in ("every_n_steps", "every_seconds", "overhead_budget")) and config is None:
            given["every_n_steps"] = 1
        self._durable_config = resolve_config(config, given)
        self._durable_policy = self._durable_config.policy()
        self._commit_timeout = commit_timeout
        self._ck: Checkpointer | None = None
        self._schedule: Schedule | None = None
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
        self._ensure_checkpointer()
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
        if self._ck is not None:
            self._ck.close()
            self._ck = None
        for t in self._retiring:
            t.join()
        self._retiring = []

    # ---- durable checkpoints -----------------------------------------------------------------
    def _ensure_checkpointer(self) -> None:
        world = (hvd.rank(), hvd.size())
        if self._ck is not None and self._world == world:
            return
        self._retire()
        comm = HorovodComm(prefix="ckpt.elastic")
        self._ck = make_checkpointer(self._durable_config, comm, commit_timeout=self._commit_timeout)
        self._schedule = Schedule(self._durable_policy, self._ck)
        self._world = world
        # Every worker counts commits from the same number (a worker that joined late has none).
        self.durable_step = int(comm.broadcast(self.durable_step))

    def _retire(self) -> None:
        old, self._ck, self._schedule, self._world = self._ck, None, None, None
        if old is not None:
            t = threading.Thread(target=_close_quietly, args=(old,), name="ckpt-elastic-retire", daemon=True)
            t.start()
            self._retiring.append(t)

    def _restore_durable(self) -> None:
        assert self._ck is not None
        # Every worker takes part (a collective: the newest checkpoint that verifies everywhere,
        # falling back past damaged ones; failures raised on every worker); the inherited sync()
        # that follows broadcasts rank 0's state anyway, as after any elastic reset.
        try:
            restored = self._ck.restore()
        except NoCheckpointError:
            return
        state, local, step = restored.state, restored.first, restored.step
        for name, handler in self._handlers.items():
            saved = state["objects"][name]
            if isinstance(handler.value, torch.nn.Module):
                saved = {**saved, **local["buffers"].get(name, {})}
            handler.value.load_state_dict(saved)
        for name, value in state["attrs"].items():
            if name in self._saved_state:
                setattr(self, name, value)
        self.save()
        self.durable_step = self.restored_step = int(step)

    def _durable_save(self) -> None:
        self._ensure_checkpointer()
        assert self._ck is not None and self._schedule is not None
        self.durable_step += 1
        if not self._schedule.should_save(self.durable_step):
            return
        objects: dict[str, Any] = {}
        buffers: dict[str, Any] = {}
        for name, handler in self._handlers.items():
            value = handler.value
            if isinstance(value, torch.nn.Module):
                weights = value.state_dict()
                own = {n for n, _ in value.named_buffers()}
                objects[name] = {k: v for k, v in weights.items() if k not in own}
                buffers[name] = {k: v.detach().clone() for k, v in weights.items() if k in own}
            elif value is not None:
                objects[name] = value.state_dict()
        state = {"objects": objects, "attrs": dict(self._saved_state), "step": self.durable_step}
        self._ck.save(state, self.durable_step, {"buffers": buffers, "rng": rng_state()})
        self._schedule.saved(self.durable_step)

    @property
    def checkpointer(self) -> Checkpointer | None:
        """The engine's checkpointer for the current workers (records, counters)."""
        return self._ck


def _close_quietly(ck: Checkpointer) -> None:
    try:
        ck.close()
    except Exception as e:  # noqa: BLE001 - a retired checkpointer's failure only loses its own save
        warnings.warn(f"horovod_ckpt: a checkpoint of the previous set of workers did not commit: {e}",
                      stacklevel=1)
