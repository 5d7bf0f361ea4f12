"""Multi-level section of ``bench_save.py``: a fast local level in front of S3 (moto), one process.

For the same state, back to back: ``s3 direct``, ``local only``, ``local only + raw upload`` (an s3fs
upload of the same bytes started just before each save: the contention any upload causes here, without
our code) and ``local + s3`` (``levels=[local, "s3://..."]``: durable on level 1 and on S3). Every save
follows the previous one's ``wait()``, so with two levels its snapshot runs beside the previous flush.
moto is single-threaded Python holding objects in memory: only the ratios mean anything.
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

from _common import StateSpec, make_state, state_bytes

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def _run(ck: Any, state: dict, reps: int, beside: Any = None) -> dict[str, Any]:
    """``reps`` saves after a first one (which allocates the buffer, left out); ``beside``: run in a thread
    started just before each save and joined after it."""
    stalls, durable = [], []
    for step in range(reps + 1):
        thread = threading.Thread(target=beside) if beside is not None and step else None
        if thread is not None:
            thread.start()
            time.sleep(0.05)
        start = time.perf_counter()
        ck.save(state, step)
        stall = time.perf_counter() - start
        ck.wait()
        if thread is not None:
            thread.join()
        if step:
            stalls.append(stall)
            durable.append(time.perf_counter() - start)
        ck.wait(retention=True)  # untimed: the next save does not run beside this one's retention
    out: dict[str, Any] = {"stall_s": statistics.median(stalls), "durable_s": statistics.median(durable),
                           "stalls": stalls, "durables": durable}
    if ck.levels[1:]:
        ck.wait(flush=True)
        flushed = [r for r in ck.flush_records if r.committed and r.step > 0]
        out.update(l2_durable_s=statistics.median(r.durable_s for r in flushed) if flushed else float("nan"),
                   l2_lag_s=statistics.median(r.lag_s for r in flushed) if flushed else float("nan"),
                   **{k: ck.counters[k] for k in ("flushed", "flush_skipped", "flush_bytes")})
    ck.close()
    return out


def bench_levels(size_mib: int, reps: int, workdir: str) -> tuple[dict[str, Any], str]:
    """Figures and a Markdown report of the set-ups; none and a note when moto is not installed."""
    try:
        importlib.import_module("moto.server")
        import s3server
    except ImportError as e:
        return {}, f"multi-level section skipped: {e} (install the test extra: pip install 'ckpt-suite[test]')"
    from ckpt_engine import Checkpointer
    from ckpt_engine.storage import open_storage

    state = make_state(StateSpec(size_mib))
    server = s3server.start()
    saved_env = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    s3server.make_bucket(server, "bench")
    run = uuid.uuid4().hex[:8]
    raw, data = open_storage(f"s3://bench/raw-{run}"), bytes(state_bytes(state))
    try:
        with tempfile.TemporaryDirectory(dir=workdir) as local:
            rows = {"s3 direct": _run(Checkpointer(f"s3://bench/direct-{run}", keep_last=1), state, reps),
                    "local only": _run(Checkpointer(os.path.join(local, "one"), keep_last=1), state, reps),
                    "local only + raw upload": _run(Checkpointer(os.path.join(local, "ref"), keep_last=1), state,
                                                    reps, lambda: raw.write_stream("raw.bin", [data])),
                    "local + s3": _run(Checkpointer(levels=[os.path.join(local, "l1"), f"s3://bench/l2-{run}"],
                                                    keep_last=1), state, reps)}
    finally:
        server.stop()
        for k, v in saved_env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    direct, one, two, ref = rows["s3 direct"], rows["local only"], rows["local + s3"], rows["local only + raw upload"]
    lines = [f"## Multi-level: {size_mib} MiB, 1 process, median of {reps} saves (S3 = moto on loopback)", "",
             "| set-up | stall ms | durable on level 1 s | durable on S3 s |", "|---|---|---|---|",
             f"| s3 direct | {direct['stall_s'] * 1e3:.1f} | | {direct['durable_s']:.3f} |",
             f"| local only | {one['stall_s'] * 1e3:.1f} | {one['durable_s']:.3f} | |",
             f"| local only + raw upload beside | {ref['stall_s'] * 1e3:.1f} | {ref['durable_s']:.3f} | |",
             f"| local + s3 | {two['stall_s'] * 1e3:.1f} | {two['durable_s']:.3f} | {two['l2_durable_s']:.3f} "
             f"(flushed {two['flushed']}, skipped {two['flush_skipped']}) |", "",
             f"- time to durable, level 1 ÷ straight to S3: **{two['durable_s'] / direct['durable_s']:.3f}**",
             f"- training-side stall, two levels ÷ one level: **{two['stall_s'] / one['stall_s']:.2f}**; "
             f"÷ one level with a raw upload beside (the same contention, without our code): "
             f"**{two['stall_s'] / ref['stall_s']:.2f}**",
             f"- time to durable on S3 through level 1 ÷ straight: {two['l2_durable_s'] / direct['durable_s']:.2f} "
             "(includes waiting behind the previous flush)"]
    return rows, "\n".join(lines)
