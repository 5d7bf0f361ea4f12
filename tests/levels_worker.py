"""One rank of a real multi-process job with two persistence levels (gloo, CPU), driven by test_levels.py.

Usage: ``python levels_worker.py MODE L1 L2 OUT [STEPS]`` with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
in the environment. ``L1`` may contain ``{rank}`` (a node-local level: each rank its own directory);
``L2`` may be ``-`` (one level only). Environment: ``KEEP_L1`` / ``KEEP_L2`` (retention per level) and
``HOLD_L2``, which holds level 2's data-file writes at a gate (:class:`ckpt_engine.testing.GatedStorage`)
so that what level 2 lags behind is decided by events, not by how slow it is:

* ``saves`` (mode ``save``): held while the rank saves; after step 1 the rank waits until its
  flusher is held copying step 1, and opens the gate after its last save;
* ``rank1`` (mode ``crashloop``): rank 1's writes are held once the restart's flush is done, so
  every later flush stays partial (rank 0's files there, rank 1's not) until the SIGKILL.

Modes:

* ``save``: save ``make_state(s)`` for s in 1..STEPS, ``wait()`` after each (level-1 commit),
  rank 0 noting level 2's newest step each time; then ``close()`` (waits for the flushes);
* ``load``: ``load()`` (a collective here), write digests and the level it came from;
* ``crashloop``: wait for the restart's flush, print ``recovered <level-2 newest>``, then save
  every step until SIGKILLed, printing ``committed <step>``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from worker_exit import leave  # noqa: E402
from ckpt_engine import Checkpointer, TorchDistComm  # noqa: E402
from ckpt_engine.format.catalog import manifest_dirs  # noqa: E402
from ckpt_engine.storage import Storage  # noqa: E402
from ckpt_engine.testing import GatedStorage  # noqa: E402
from dist_worker import digest, make_local, make_state, write_result  # noqa: E402

HOLD = os.environ.get("HOLD_L2", "")


def levels(l1: str, l2: str, rank: int) -> list:
    out: list = [{"path": l1.format(rank=rank), "keep_last": int(os.environ.get("KEEP_L1", "2"))}]
    if l2 != "-":
        level2 = GatedStorage(l2)
        if HOLD != "saves":
            level2.gate.set()
        out.append({"path": level2, "keep_last": int(os.environ.get("KEEP_L2", "3"))})
    return out


def newest(storage: "Storage") -> int | None:
    found = manifest_dirs(storage)
    return found[-1][0] if found else None


def main() -> None:
    mode, l1, l2, out = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)  # several ranks share 2 cores in tests
    chosen = levels(l1, l2, rank)
    level2 = chosen[1]["path"] if len(chosen) > 1 else None
    ck = Checkpointer(levels=chosen, comm=TorchDistComm())
    result: dict = {"rank": rank, "node_local": ck._dest.levels[0].node_local}
    if mode == "save":
        seen = []
        for step in range(1, int(sys.argv[5]) + 1):
            ck.save(make_state(step), step, make_local(step, rank))
            ck.wait()
            if HOLD == "saves" and step == 1:  # held on step 1 before step 2 exists: no race with it
                assert level2.blocked.wait(120), "level 2's flusher never reached its gate"
            if rank == 0 and level2 is not None:
                seen.append([step, newest(level2)])
        if HOLD == "saves":
            level2.gate.set()
        ck.close()
        result.update(seen=seen, counters=dict(ck.counters), stalls=[r.stall_s for r in ck.records],
                      flushes=[r.__dict__ for r in ck.flush_records])
    elif mode == "load":  # restore(): every rank together; load(): this process alone
        r = ck.restore()
        result.update(state=digest(r.state), step=r.step, level=r.level, local=digest(r.local),
                      local0=digest(r.first), failures=ck.load_failures)
        alone = ck.load()
        result.update(alone={"state": digest(alone), "step": ck.loaded_manifest.step, "level": ck.loaded_level,
                             "local": digest(ck.load_local())})
        ck.close()
    elif mode == "crashloop":
        ck.wait(flush=True)
        print(f"recovered {newest(level2)} {ck.latest_step()}", flush=True)
        if HOLD == "rank1" and rank == 1:
            level2.gate.clear()
        step = ck.latest_step() or 0
        while True:
            step += 1
            ck.save(make_state(step), step, make_local(step, rank))
            ck.wait()
            print(f"committed {step}", flush=True)
    write_result(out, rank, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave()  # worker_exit.py: no interpreter finalization once the work is done
