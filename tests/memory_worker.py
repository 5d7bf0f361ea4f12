"""One rank of a real job with a node-memory level (gloo, CPU), driven by test_memory_level.py.

Usage: ``python memory_worker.py MODE MEM DISK OUT [STEPS]`` with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
and ``CKPT_NODE`` (the simulated node) in the environment. The levels are the memory level at ``MEM``
(job ``test``, ``REPLICAS`` replicas, default 1) and, unless ``DISK`` is ``-``, a disk level at ``DISK``
(``HOLD_DISK=1`` holds its data-file writes at a gate that never opens: a disk that never receives a
checkpoint, so only memory has the newest ones).

Modes:

* ``save``: save ``make_state(s)`` / ``make_local(s, rank)`` for s in 1..STEPS, ``wait()`` after each,
  then ``wait(flush=True)`` unless the disk is held; write the counters, print ``saved``, then stay
  alive (the test SIGKILLs every rank: nothing is closed);
* ``restore``: ``latest_step()``, then ``restore()``; write both steps, the level, digests of the state
  and of this rank's local; then ``close()``;
* ``loop``: ``restore()`` (``restored <step> <level> <ok>``: ok when the state and this rank's local
  are those of that step), then save every step from there until SIGKILLed, printing
  ``committed <step>`` once ``wait()`` returned (this rank's part is in its node's memory) and
  ``replica_failed <n>`` when that counter grows. With ``LOCKSTEP=1`` a barrier follows every step,
  as training's collectives keep ranks within a step of each other; without, ranks go on when a
  peer dies.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from worker_exit import leave  # noqa: E402
from ckpt_engine import Checkpointer, NoCheckpointError, TorchDistComm  # noqa: E402
from ckpt_engine.testing import GatedStorage  # noqa: E402
from dist_worker import digest, make_local, make_state, write_result  # noqa: E402


def levels(mem: str, disk: str) -> list:
    out: list = [{"kind": "memory", "path": mem, "job": "test", "replicas": int(os.environ.get("REPLICAS", "1")),
                  "keep_last": int(os.environ.get("KEEP_MEM", "2"))}]
    if disk != "-":
        level2 = GatedStorage(disk)
        if os.environ.get("HOLD_DISK") != "1":
            level2.gate.set()
        out.append({"path": level2, "keep_last": 3})
    return out


def loop(ck: Checkpointer, rank: int) -> None:
    try:
        r = ck.restore()
        ok = digest(r.state) == digest(make_state(r.step)) and digest(r.local) == digest(make_local(r.step, rank))
        print(f"restored {r.step} {r.level} {ok}", flush=True)
        step = r.step
    except NoCheckpointError:
        print("restored none", flush=True)
        step = 0
    failed = 0
    while True:
        step += 1
        ck.save(make_state(step), step, make_local(step, rank))
        ck.wait()
        print(f"committed {step}", flush=True)
        if os.environ.get("LOCKSTEP") == "1":
            dist.barrier()
        if ck.counters.get("replica_failed", 0) > failed:
            failed = ck.counters["replica_failed"]
            print(f"replica_failed {failed}", flush=True)


def main() -> None:
    mode, mem, disk, out = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)  # several ranks share 2 cores in tests
    ck = Checkpointer(levels=levels(mem, disk), comm=TorchDistComm(), on_error="warn")
    result: dict = {"rank": rank}
    if mode == "save":
        for step in range(1, int(sys.argv[5]) + 1):
            ck.save(make_state(step), step, make_local(step, rank))
            ck.wait()
        if disk != "-" and os.environ.get("HOLD_DISK") != "1":
            ck.wait(flush=True)
        result.update(counters=dict(ck.counters))
        write_result(out, rank, result)
        print("saved", flush=True)
        time.sleep(600)
    elif mode == "loop":
        loop(ck, rank)
    elif mode == "restore":
        latest = ck.latest_step()  # what a script asks first (examples/plain_train.py)
        r = ck.restore()
        result.update(latest=latest, step=r.step, level=r.level, state=digest(r.state), local=digest(r.local),
                      failures=ck.load_failures)
        ck.close()
        write_result(out, rank, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave()
