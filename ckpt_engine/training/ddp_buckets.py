"""A resumed DDP process reduces its gradients in the uninterrupted run's order.

Why it is needed: ``DistributedDataParallel`` with its defaults (``find_unused_parameters=False``,
also with ``static_graph=True``) builds its gradient buckets at construction and rebuilds them once,
after the process's first synchronised backward, in the order in which the gradients became ready
(``Reducer::rebuild_buckets``). A process that resumes from a checkpoint reduces its first step in
the construction layout, where the uninterrupted run at that step already used the rebuilt one. On
more than two ranks an all-reduce sums each element in an order set by its offset in the bucket
(a ring walks the buffer in chunks), so the first update after a restart differs in the last bits
and the runs drift apart. With two ranks ``a + b == b + a`` hides it.

What :class:`DDPBucketOrder` does:

* **Record.** During the process's first synchronised backward it notes the order in which DDP's
  gradients became ready (parameter names, a plain list that rides in the checkpoint), and how many
  of the passes that decide the buckets had run (one; two with ``static_graph=True``, whose first pass
  reduces in the construction layout and whose second records the order).
* **Replay.** After a restore, before the first real step, :meth:`~DDPBucketOrder.load_state_dict`
  runs one warm-up step through DDP whose forward is synthetic: a zero-valued sum over the
  parameters, built so that their gradients become ready in the recorded order (as many steps as
  the interrupted process had run of those passes). DDP all-reduces
  those zeros and rebuilds its buckets exactly as the uninterrupted run did; the gradients are then
  dropped (``None``, as after a restart). The warm-up reads only the parameters: no RNG draw, no
  BatchNorm update, no buffer broadcast (DDP's is turned off for it), no optimizer step, so it may run
  before or after the state is restored. Its cost is one all-reduce of the gradients' size at the
  restart and nothing per step (the recording hooks are cleared after the first backward):
  ``benchmarks/bench_exact_ddp.py``.

Order of calls, every rank, training thread::

    ddp = DistributedDataParallel(model)
    order = DDPBucketOrder(ddp)                     # before the first backward
    ...                                             # at a checkpoint:
    state = {"model": ..., "ddp": order.state_dict()}
    ...                                             # after a restore, before the first step:
    order.load_state_dict(state["ddp"])             # collective: every rank, same point

Where it cannot replay (a checkpoint without the order, a model whose parameters it does not name,
a DDP that reduces in Python), it says so once, naming ``find_unused_parameters=True``: DDP then
never rebuilds its buckets, and a resume is exact at the cost of a graph traversal per step.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Mapping

import torch
from torch.nn.parallel import DistributedDataParallel

from ..errors import CheckpointWarning

__all__ = ["DDPBucketOrder", "INEXACT_DDP_REMEDY"]

INEXACT_DDP_REMEDY = ("pass find_unused_parameters=True to DistributedDataParallel (Lightning: "
                      "strategy='ddp_find_unused_parameters_true'): DDP then never rebuilds its buckets")
"""The setting that makes a DDP resume exact where the bucket order cannot be replayed."""


def rebuilds_buckets(ddp: DistributedDataParallel) -> bool:
    """Whether ``ddp`` rebuilds its gradient buckets after its first backward (its defaults do;
    ``find_unused_parameters=True`` without ``static_graph`` never does)."""
    return bool(getattr(ddp, "static_graph", False)) or not ddp.find_unused_parameters


class DDPBucketOrder:
    """Records the order in which DDP's gradients become ready and replays it after a restore
    (see the module docstring), so that a resumed run reduces, and ends, bit for bit as the
    uninterrupted one on any number of ranks.

    Args:
        ddp: the ``DistributedDataParallel`` module, before its first backward in this process.
    """

    def __init__(self, ddp: DistributedDataParallel) -> None:
        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"DDPBucketOrder takes the DistributedDataParallel module, got {type(ddp).__name__}")
        self.ddp = ddp
        self._names = {p: name for name, p in ddp.module.named_parameters() if p.requires_grad}
        self._ready: list[str] = []
        self._passes = 0  # synchronised backward passes finished (a forward came after), up to _needed()
        self._in_pass = False  # a synchronised backward ran since the last forward
        # A gradient hook on each parameter runs when its AccumulateGrad node runs, as DDP's own hook;
        # a parameter that had none gets its hooks cleared at remove(), leaving nothing per step.
        self._bare = [p for p in self._names if p._backward_hooks is None]
        self._handles = [p.register_hook(functools.partial(self._note, name)) for p, name in self._names.items()]
        self._handles.append(ddp.register_forward_pre_hook(self._next_forward))

    @property
    def recorded(self) -> list[str]:
        """The parameters' names in the order their gradients became ready in the first synchronised
        backward (empty before it)."""
        return list(self._ready)

    def state_dict(self) -> dict[str, Any]:
        """``{"ready": [names...], "passes": n}``: plain values, identical on every rank (put it in the
        replicated state). ``passes``: the synchronised backward passes run so far, counted up to the
        ones that decide DDP's buckets (1; 2 with ``static_graph=True``)."""
        return {"ready": list(self._ready), "passes": min(self._passes + self._in_pass, _needed(self.ddp))}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> bool:
        """Replay the order ``state`` recorded (what :meth:`state_dict` returned at the checkpoint):
        zero-valued warm-up steps through DDP (as many as the interrupted process had run of those
        that decide its buckets), so its buckets are those of the uninterrupted run. Every rank calls
        it at the same point (the warm-up all-reduces), after the restore and before the first real
        step. Returns whether it replayed.

        Nothing to do (``False``, silently): DDP never rebuilds (``find_unused_parameters=True``), the
        checkpoint was taken before any backward, or this process already ran one (its buckets
        follow its own order, the same). Where it cannot replay (``state`` is ``None`` or holds no
        order, the order names parameters this model lacks, DDP reduces in Python) it returns ``False``
        and, on more than 2 ranks, warns once, naming the setting that makes the resume exact."""
        if not rebuilds_buckets(self.ddp) or self._passes or self._in_pass:
            return False
        ready = None if state is None else state.get("ready")
        if ready is None:
            return self._cannot("the checkpoint holds no DDP gradient order (written without DDPBucketOrder)")
        passes = min(int(state.get("passes", 1)), _needed(self.ddp)) if ready else 0  # type: ignore[union-attr]
        if not passes:
            return False
        by_name = {name: p for p, name in self._names.items()}
        missing = [name for name in ready if name not in by_name]
        if missing:
            return self._cannot(f"the checkpoint's DDP gradient order names parameters this model lacks: "
                                f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if getattr(self.ddp, "_use_python_reducer", False) or getattr(self.ddp, "_delay_all_reduce_all_params", False):
            return self._cannot("this DDP reduces without its C++ reducer (compiled autograd or all "
                                "parameters delayed), whose buckets cannot be replayed")
        for _ in range(passes):
            _warm_up(self.ddp, [by_name[name] for name in ready])
        if self._ready != list(ready):  # the autograd engine ordered them otherwise: say so, never assume
            return self._cannot("the warm-up's gradients became ready in another order than recorded "
                                f"({self._ready[:3]} ... against {list(ready)[:3]} ...)")
        return True

    def remove(self) -> None:
        """Stop recording (idempotent; done by itself once the passes that decide DDP's buckets ran)."""
        for handle in self._handles:
            handle.remove()
        for p in self._bare:  # a removed handle leaves torch's hook that calls into Python per step
            if not p._backward_hooks:
                p._backward_hooks = None
        self._handles, self._bare = [], []

    # ---- internals ---------------------------------------------------------------------------
    def _note(self, name: str, grad: torch.Tensor) -> None:
        """A gradient became ready: noted in the first synchronised backward (the one DDP records)."""
        if self.ddp.require_backward_grad_sync:
            self._in_pass = True
            if not self._passes:
                self._ready.append(name)

    def _next_forward(self, module: Any, args: Any) -> None:
        """A forward: the synchronised backward before it, if any, is complete (DDP rebuilds now or,
        ``static_graph``, after the second)."""
        if self._in_pass:
            self._passes, self._in_pass = self._passes + 1, False
            if self._passes >= _needed(self.ddp):
                self.remove()

    def _cannot(self, why: str) -> bool:
        world = self.ddp.process_group.size() if self.ddp.process_group is not None else 1
        if world > 2:  # with 2 ranks (or 1) the order of a sum of two cannot matter
            warnings.warn(f"DDPBucketOrder: {why}; the first update after this resume may differ from the "
                          f"uninterrupted run's in the last bits on {world} ranks. To make it exact, "
                          f"{INEXACT_DDP_REMEDY}.", CheckpointWarning, stacklevel=3)
        return False


def _needed(ddp: DistributedDataParallel) -> int:
    """The synchronised passes after which DDP's buckets are final: it rebuilds them after the first,
    or with ``static_graph=True`` (whose first pass only counts the gradients' hooks) the second."""
    return 2 if getattr(ddp, "static_graph", False) else 1


def _warm_up(ddp: DistributedDataParallel, ordered: list[torch.nn.Parameter]) -> None:
    """One step through ``ddp`` whose gradients, all zero, become ready in the order ``ordered``;
    every gradient is as it was before afterwards (``None`` after a restart), buffers untouched."""
    params = list(ddp.module.parameters())
    held = {p: p.grad.detach().clone() for p in params if p.grad is not None}  # DDP overwrites them in place
    for p in params:
        p.grad = None

    def synthetic(*_args: Any, **_kwargs: Any) -> torch.Tensor:
        # The autograd engine runs the newest ready node first: the term built last (the first in
        # ``ordered``) gets its gradient first, and so on down the chain of sums.
        total: torch.Tensor | None = None
        for p in reversed(ordered):
            term = p.sum() * 0
            total = term if total is None else total + term
        assert total is not None
        return total

    module, sync = ddp.module, ddp.require_forward_param_sync
    own = module.__dict__.get("forward")  # a forward set on the instance (e.g. by a wrapping library) is kept
    module.forward = synthetic  # the instance's attribute shadows the class's forward for this one call
    ddp.require_forward_param_sync = False  # no buffer broadcast: BatchNorm statistics stay as restored
    try:
        ddp().backward()
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own
        ddp.require_forward_param_sync = sync
        for p in params:
            p.grad = held.get(p)
