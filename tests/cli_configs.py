"""Run ``examples/lightning_train.py fit --config CFG`` for several configurations in one process,
as the command line would, and record how each ended (the configuration-error tests; one process
instead of one per configuration saves Lightning's import, ~6 s, per case).

Usage: ``python cli_configs.py OUT.json CFG [CFG ...]``; OUT.json maps each CFG to ``{"rc", "stderr"}``:
``rc`` is the exit status the command would have had (``SystemExit``'s code, 1 for an exception,
whose traceback then ends ``stderr`` as the interpreter would print it).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import traceback

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "lightning_train.py")


def run_one(cfg: str) -> dict:
    """The example's ``fit --config cfg``, run as ``__main__``: its exit status and what it wrote to stderr."""
    err = io.StringIO()
    sys.argv = [EXAMPLE, "fit", "--config", cfg]
    rc = 0
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_path(EXAMPLE, run_name="__main__")
        except SystemExit as e:  # sys.exit(n), or sys.exit("message"): printed, status 1
            if e.code is None or isinstance(e.code, int):
                rc = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                rc = 1
        except BaseException:  # noqa: BLE001 - reported as the interpreter would
            traceback.print_exc()
            rc = 1
    return {"rc": rc, "stderr": err.getvalue()}


def main() -> None:
    out, cfgs = sys.argv[1], sys.argv[2:]
    results = {cfg: run_one(cfg) for cfg in cfgs}
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
