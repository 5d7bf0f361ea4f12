"""Persist to S3 (moto's server over real HTTP on loopback) next to local disk, same state, one run.

Reports our time from ``save()`` to committed as a throughput, as a ratio to a raw s3fs upload of the
same bytes (one object, the same multipart block size) and, for reference, to local disk::

    .venv/bin/python benchmarks/bench_s3.py [--size-mib 256] [--reps 3]

moto keeps objects in memory and is single-threaded Python, so absolute numbers say nothing about
a real object store; the ratio says how much the engine adds on top of the client.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid

import fsspec
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import s3server  # noqa: E402  (tests/s3server.py: starts and stops the moto server)

from ckpt_engine import Checkpointer  # noqa: E402


def make_state(size_mib: int) -> dict:
    g = torch.Generator().manual_seed(0)
    n = size_mib * 2**20 // 4 // 16
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(16)} | {"step": 1}


def ours(url: str, state: dict, reps: int) -> list[float]:
    times = []
    with Checkpointer(url, keep_last=1) as ck:
        for step in range(reps + 1):
            start = time.perf_counter()
            ck.save(state, step)
            ck.wait()
            times.append(time.perf_counter() - start)
    return times[1:]  # the first save allocates its buffer


def raw_upload(url: str, data: memoryview, reps: int) -> list[float]:
    fs, root = fsspec.core.url_to_fs(url)  # s3fs itself, the same client object the engine's storage uses
    times = []
    for rep in range(reps):
        start = time.perf_counter()
        with fs.open(f"{root}/raw-{rep}.bin", "wb", block_size=64 << 20) as f:
            f.write(data)
        times.append(time.perf_counter() - start)
    return times


def raw_local(path: str, data: memoryview, reps: int) -> list[float]:
    times = []
    for rep in range(reps):
        start = time.perf_counter()
        fd = os.open(os.path.join(path, f"raw-{rep}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
        times.append(time.perf_counter() - start)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="benchmarks/out")
    args = p.parse_args()
    state = make_state(args.size_mib)
    data = memoryview(torch.cat([t.reshape(-1) for t in state.values() if isinstance(t, torch.Tensor)])
                      .view(torch.uint8).numpy())
    server = s3server.start()
    os.environ.update(server.env)
    s3server.make_bucket(server, "bench")
    try:
        run = uuid.uuid4().hex[:8]
        with tempfile.TemporaryDirectory(dir="/tmp") as local:
            rows = {
                "raw s3fs upload": raw_upload(f"s3://bench/raw-{run}", data, args.reps),
                "ours to s3": ours(f"s3://bench/ours-{run}", state, args.reps),
                "raw local write+fsync": raw_local(local, data, args.reps),
                "ours to local disk": ours(os.path.join(local, "ours"), state, args.reps),
            }
    finally:
        server.stop()
    gbs = {k: len(data) / statistics.median(v) / 1e9 for k, v in rows.items()}
    lines = [f"# bench_s3: {args.size_mib} MiB, median of {args.reps}", "",
             "| contender | median s | GB/s | ÷ its raw limit |", "|---|---|---|---|"]
    limit = {"ours to s3": "raw s3fs upload", "ours to local disk": "raw local write+fsync"}
    for k, v in rows.items():
        ratio = f"{gbs[k] / gbs[limit[k]]:.2f}" if k in limit else "1 (limit)"
        lines.append(f"| {k} | {statistics.median(v):.3f} | {gbs[k]:.2f} | {ratio} |")
    report = "\n".join(lines)
    print(report)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_s3.md"), "w") as f:
        f.write(report + "\n")
    with open(os.path.join(args.out, "bench_s3.json"), "w") as f:
        json.dump({"size_mib": args.size_mib, "seconds": rows, "gb_per_s": gbs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
