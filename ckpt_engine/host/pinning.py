"""Page-locking memory this process mapped itself (``cudaHostRegister``), so that CUDA copies into it
run asynchronously at full speed, as into torch's own pinned memory.

A memory level's snapshot buffers are files of its tmpfs, mapped (save/filebuffers.py). When the state
lives on a GPU, registering that mapping lets the device-to-host copy land in the memory checkpoint
itself: persist then commits it by a hard link, as on CPU, instead of copying 1.5 GB from a pinned
staging buffer into tmpfs per save (a GPT-2 with AdamW). Registration can fail (no CUDA, a kernel or
sandbox that cannot lock file pages): :func:`register` then says ``False`` and the caller uses torch's
pinned memory instead.
"""

from __future__ import annotations

import threading

import torch


def _cudart() -> object | None:
    """torch's binding of the CUDA runtime, or ``None`` where there is no CUDA."""
    if not torch.cuda.is_available():
        return None
    try:
        return torch.cuda.cudart()
    except (AssertionError, RuntimeError, AttributeError):  # a build without the bindings
        return None


def _call(name: str, *args: int) -> bool:
    """``cudart.<name>(*args)`` on a thread of its own; whether it returned ``cudaSuccess``.

    A failing runtime call also sets its host thread's "last error", which torch reads after its
    next kernel launch on that thread and raises as that kernel's failure. The binding cannot clear
    it (it has no ``cudaGetLastError``), so the call runs on a thread that ends with it."""
    rt = _cudart()
    if rt is None:
        return False
    result: list[bool] = []

    def call() -> None:
        try:
            result.append(int(getattr(rt, name)(*args)) == 0)
        except (AttributeError, RuntimeError, TypeError):
            result.append(False)

    thread = threading.Thread(target=call, name="ckpt-cudart", daemon=True)
    thread.start()
    thread.join()
    return bool(result and result[0])


def register(address: int, nbytes: int) -> bool:
    """Page-lock the ``nbytes`` mapped at ``address`` for CUDA copies; whether CUDA did.

    The memory must stay mapped until :func:`unregister` is called for ``address``."""
    return nbytes > 0 and _call("cudaHostRegister", address, nbytes, 0)


def unregister(address: int) -> None:
    """Undo :func:`register` for ``address`` (the pages stay mapped; only the lock goes)."""
    _call("cudaHostUnregister", address)
