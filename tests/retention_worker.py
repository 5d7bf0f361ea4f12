"""A single-process job that saves every step with ``keep_last`` until it is SIGKILLed
(test_retention_restart.py).

``python retention_worker.py ROOT FIRST``: saves steps ``FIRST``, ``FIRST + 1``, ... (``FIRST`` is
``resume``: the newest committed step + 1, as a resumed job does; a number: a job started afresh,
or resumed from an older checkpoint). After its first commit and that commit's retention it prints
``retained STEP DIRNAME <JSON list of the committed directories>``, then ``committed STEP`` after
each later commit it sees. ``KEEP_LAST`` (default 2) in the environment.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckpt_engine import Checkpointer  # noqa: E402
from ckpt_engine.format.catalog import manifest_dirs  # noqa: E402


def main() -> None:
    root, first_arg = sys.argv[1:3]
    ck = Checkpointer(root, keep_last=int(os.environ.get("KEEP_LAST", "2")))
    first = (ck.latest_step() or 0) + 1 if first_arg == "resume" else int(first_arg)
    ck.save({"w": torch.full((256, 1024), float(first))}, first)
    ck.wait(retention=True)
    mine = ck.records[-1].dirname
    print(f"retained {first} {mine} {json.dumps([d for _, d in manifest_dirs(ck.storage)])}", flush=True)
    reported, step = first, first
    while True:
        step += 1
        ck.save({"w": torch.full((256, 1024), float(step))}, step)
        done = [r.step for r in ck.records if r.committed]
        if done and done[-1] != reported:
            reported = done[-1]
            print(f"committed {reported}", flush=True)


if __name__ == "__main__":
    main()
