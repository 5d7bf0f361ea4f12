"""Persist to S3 (moto's server over real HTTP on loopback) next to raw S3 clients and local disk.

What it measures: ``benchmarks/README.md``, section bench_s3. The same bytes, the same parts in flight
(``--in-flight``; ours through ``max_concurrency``) and the same part and range size for every client:
moto copies the whole object for every GET, so on moto more, smaller ranges only lose. moto keeps objects
in memory and is single-threaded Python: only the ratios (the engine's cost on top of the clients) count.

Usage::

    .venv/bin/python benchmarks/bench_s3.py --size-mib 256 --reps 3   # ~1.5 min
    .venv/bin/python benchmarks/bench_s3.py --size-mib 32 --reps 1    # quick
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import tempfile
import time
import uuid
from typing import Callable

import fsspec
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]
import s3server  # noqa: E402  (tests/s3server.py: starts and stops the moto server)
from _common import gbps, parser, table, write_fsync, write_report  # noqa: E402

from ckpt_engine import Checkpointer  # noqa: E402
from ckpt_engine.storage import fsspec_storage  # noqa: E402

LIMIT = {"ours to s3": "raw s3fs upload", "ours to local disk": "raw local write+fsync",
         "ours read-back from s3": "raw s3fs read-back"}
"""Each of ours and the raw contender it is measured against."""
READS = ("raw s3fs read-back", "raw boto3 read-back", "ours read-back from s3", "ours load() from s3")
RATIOS = {"ours to s3 ÷ raw s3fs upload": ("ours to s3", "raw s3fs upload"),
          "ours to s3 ÷ raw boto3 upload": ("ours to s3", "raw boto3 upload"),
          "ours to s3 ÷ s3fs file object": ("ours to s3", "raw s3fs file object (1 part at a time)"),
          "ours read-back ÷ raw s3fs read-back": ("ours read-back from s3", "raw s3fs read-back"),
          "ours read-back ÷ raw boto3 read-back": ("ours read-back from s3", "raw boto3 read-back"),
          "ours load() ÷ raw s3fs read-back": ("ours load() from s3", "raw s3fs read-back")}
Contender = Callable[[int], object]
"""One timed run of a contender (its argument: the repetition); what it returns, if callable, runs untimed after."""


def interleaved(contenders: dict[str, Contender], reps: int) -> dict[str, list[float]]:
    """Seconds of each contender, run in turn once per repetition, so that a drifting background load weighs
    on all alike; a function a contender returns runs untimed before the next (ours: its retention)."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for rep in range(reps):
        for name, fn in contenders.items():
            start = time.perf_counter()
            settle = fn(rep)
            times[name].append(time.perf_counter() - start)
            if callable(settle):
                settle()
    return times


def ours(ck: Checkpointer, state: dict, where: str, reads: bool) -> dict[str, Contender]:
    """Our ``save`` until committed; with ``reads``, the newest data file read back into a buffer (ranged
    GETs) and ``load()``. Saves once first: the first save allocates its buffer."""
    ck.save(state, 0)
    ck.wait()
    data = f"{ck.records[-1].dirname}/rank-00000.bin"
    buf = memoryview(bytearray(ck.storage.size(data) or 0))

    def save(rep: int) -> Callable[[], None]:
        ck.save(state, rep + 1)
        ck.wait()
        return lambda: ck.wait(retention=True)  # untimed: the older checkpoint deleted before the next runs

    def read_back(_: int) -> None:
        with ck.storage.reader(f"{ck.records[-1].dirname}/rank-00000.bin") as r:
            r.read_into(0, buf)

    out: dict[str, Contender] = {f"ours to {where}": save}
    if reads:
        out.update({f"ours read-back from {where}": read_back, f"ours load() from {where}": lambda _: ck.load()})
    return out


def raw_clients(url: str, bucket: str, data: bytes, part: int, n: int, endpoint: str) -> dict[str, Contender]:
    """s3fs (the client the engine's storage uses) and boto3, at the same part size and concurrency."""
    import boto3
    from boto3.s3.transfer import TransferConfig

    fs, root = fsspec.core.url_to_fs(url)
    s3, key = boto3.client("s3", endpoint_url=endpoint), f"{url.rsplit('/', 1)[1]}/boto3.bin"
    cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=n)

    def file_object(_: int) -> None:
        with fs.open(f"{root}/raw-file.bin", "wb", block_size=part) as f:
            f.write(data)

    return {"raw s3fs upload": lambda _: fs.pipe_file(f"{root}/raw.bin", data, chunksize=part, max_concurrency=n),
            "raw s3fs file object (1 part at a time)": file_object,
            "raw boto3 upload": lambda _: s3.upload_fileobj(io.BytesIO(data), bucket, key, Config=cfg),
            "raw s3fs read-back": lambda _: fs.cat_file(f"{root}/raw.bin", chunksize=part, max_concurrency=n),
            "raw boto3 read-back": lambda _: s3.download_fileobj(bucket, key, io.BytesIO(), Config=cfg)}


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--in-flight", type=int, default=8, help="parts in flight, for every contender")
    p.add_argument("--part-mib", type=int, default=fsspec_storage._OBJECT_BLOCK >> 20,
                   help="part size of every upload and range size of every read (default: our part size)")
    args = p.parse_args()
    part, n = args.part_mib << 20, args.in_flight
    fsspec_storage._OBJECT_BLOCK = fsspec_storage._READ_BLOCK = part
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(args.size_mib * 2**20 // 64, generator=g) for i in range(16)} | {"step": 1}
    raw = torch.cat([t.reshape(-1) for t in state.values() if isinstance(t, torch.Tensor)]).view(torch.uint8)
    raw = raw.numpy().tobytes()  # the raw clients take bytes (botocore refuses a memoryview)
    server = s3server.start()
    os.environ.update(server.env)
    s3server.make_bucket(server, "bench")
    try:
        run = uuid.uuid4().hex[:8]
        with Checkpointer(f"s3://bench/ours-{run}", keep_last=1, storage_options={"max_concurrency": n}) as ck:
            every = {**raw_clients(f"s3://bench/raw-{run}", "bench", raw, part, n, server.endpoint),
                     **ours(ck, state, "s3", reads=True)}
            # every write first, then every read: the reads find the objects the writes left
            rows = interleaved({k: v for k, v in every.items() if k not in READS}, args.reps)
            rows |= interleaved({k: every[k] for k in READS}, args.reps)
        with tempfile.TemporaryDirectory(dir="/tmp") as local, \
                Checkpointer(os.path.join(local, "ours"), keep_last=1) as ck:
            rows |= interleaved({"raw local write+fsync": lambda _: write_fsync(os.path.join(local, "raw.bin"),
                                                                                [memoryview(raw)]),
                                 **ours(ck, state, "local disk", reads=False)}, args.reps)
    finally:
        server.stop()
    med = {k: statistics.median(v) for k, v in rows.items()}
    gbs = {k: gbps(len(raw), s) for k, s in med.items()}
    ratios = {k: med[a] / med[b] for k, (a, b) in RATIOS.items()}
    lines = [f"# bench_s3: {args.size_mib} MiB, {n} parts in flight of {args.part_mib} MiB, median of {args.reps}",
             "", *table(["contender", "median s", "GB/s", "÷ its raw limit"],
                        [[k, f"{med[k]:.3f}", f"{gbs[k]:.3f}", f"{gbs[k] / gbs[LIMIT[k]]:.2f}" if k in LIMIT
                          else "1 (limit)"] for k in rows]),
             "", *table(["time ratio (lower is better for ours)", "×"], [[k, f"{v:.2f}"] for k, v in ratios.items()])]
    doc = {"size_mib": args.size_mib, "in_flight": n, "part_mib": args.part_mib}
    for prefix, keys in (("", [k for k in rows if k not in READS]), ("read_", READS)):
        doc |= {f"{prefix}seconds": {k: rows[k] for k in keys}, f"{prefix}gb_per_s": {k: gbs[k] for k in keys}}
    write_report(args.out, "bench_s3", "\n".join(lines) + "\n", {**doc, "time_ratios": ratios})
    return 0


if __name__ == "__main__":
    sys.exit(main())
