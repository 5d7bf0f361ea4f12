"""Python's cyclic garbage collector held off while a checkpoint has the training thread.

The collector runs on whichever thread allocates the container object that crosses its threshold,
and a full (generation 2) collection walks every tracked object of the process: in a Lightning job
(torch, Lightning, jsonargparse: about 430,000 objects) that took 195-260 ms on a 2-core machine
(``examples/demo.py``, 2026-11-28, at 228ab42). ``save()`` allocates a few hundred containers (the
encoded tree, the record), so now and then the collection that the training loop owed fell inside
it, and one checkpoint's stall read 235 ms where the others read 2-8 ms. That work is the process's,
not the checkpoint's: without the checkpoint the next allocation of the training step would have
run it. :func:`pause_collector` and :func:`resume_collector` hold automatic collections off for the
checkpoint's time on the training thread (``Checkpointer.save``, and a front end's capture with
it); the one that came due runs at the first allocation after it, in the training loop it belongs
to. Nothing else changes (``gc.collect()`` still collects; the collector ends as enabled as it was).
A pause lasts as long as the save: when ``on_busy="wait"`` waits for a buffer, that wait too.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0
_enable_at_end = False


def pause_collector() -> None:
    """No automatic garbage collection starts until the matching :func:`resume_collector` (on any
    thread: the collector is the process's). Call it right before ``try:``, and
    :func:`resume_collector` in its ``finally:``. Pauses nest and may overlap across threads: the
    collector is enabled again when the last one ends, unless it was disabled before the first one
    (then it stays as the user left it).

    Not a ``with`` block on purpose: entering one allocates (its ``__exit__``), which is where a
    collection that is due would start; these calls allocate nothing the collector tracks, so the
    collection starts at the first allocation after the pause, not while it begins or ends.
    """
    global _holders, _enable_at_end
    enabled = gc.isenabled()
    gc.disable()
    _lock.acquire()
    _enable_at_end = enabled if _holders == 0 else _enable_at_end or enabled
    _holders += 1
    _lock.release()


def resume_collector() -> None:
    """End the pause :func:`pause_collector` began (see there)."""
    global _holders, _enable_at_end
    _lock.acquire()
    _holders -= 1
    if _holders == 0 and _enable_at_end:
        _enable_at_end = False
        gc.enable()
    _lock.release()
