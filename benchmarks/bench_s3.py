"""Persist to S3 (moto's server over real HTTP on loopback) next to raw S3 clients and local disk.

Times, for the same state and the same bytes, with the same number of parts in flight
(``--in-flight``, ours through the ``max_concurrency`` storage option) and the same part size:

* upload: our ``save()`` until committed (shard file, index, manifest, ``latest``) against a raw
  s3fs upload of the bytes as one object (``pipe_file``: concurrent multipart), a raw boto3 one
  (``upload_fileobj`` with a ``TransferConfig``), and, for reference, s3fs's file object (one part
  at a time: how ours went before);
* read-back: our reader filling a buffer with the rank's data file, as concurrent ranged GETs,
  against s3fs's concurrent ``cat_file`` and boto3's ``download_fileobj`` of the same bytes (ranges
  of the part size for all three), and our whole ``load()`` (tensor by tensor, every byte checked);
* local disk: ours against write+fsync, for reference.

    .venv/bin/python benchmarks/bench_s3.py [--size-mib 256] [--reps 3] [--in-flight 8] [--part-mib 64]

moto keeps objects in memory and is single-threaded Python, so absolute numbers say nothing about
a real object store; the ratios say how much the engine adds on top of the clients. moto also
copies the whole object for every GET, under a per-object lock, so on moto reads cost per request
(ranged or not) in proportion to the object's size: more, smaller ranges only lose there, the
opposite of a real store. Hence the same range size for every reader here.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from typing import Callable

import fsspec
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import s3server  # noqa: E402  (tests/s3server.py: starts and stops the moto server)

from ckpt_engine import Checkpointer  # noqa: E402
from ckpt_engine.storage import fsspec_storage  # noqa: E402

LIMIT = {"ours to s3": "raw s3fs upload", "ours to local disk": "raw local write+fsync",
         "ours read-back from s3": "raw s3fs read-back"}
"""Each of ours and the raw contender it is measured against."""
READS = ("raw s3fs read-back", "raw boto3 read-back", "ours read-back from s3", "ours load() from s3")
"""Rows kept apart in the JSON (``read_seconds``) from the writes (``seconds``)."""


def make_state(size_mib: int) -> dict:
    g = torch.Generator().manual_seed(0)
    n = size_mib * 2**20 // 4 // 16
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(16)} | {"step": 1}


Contender = Callable[[int], object]
"""One timed run of a contender; its argument is the repetition number. What it returns, if
callable, runs untimed after it (see :func:`interleaved`)."""


def interleaved(contenders: dict[str, Contender], reps: int) -> dict[str, list[float]]:
    """Seconds of each contender, run in turn once per repetition: a background load that drifts
    during the run weighs on all of them alike. A contender may return a function, run untimed
    before the next one starts (ours: waiting for the deletion of its older checkpoint)."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for rep in range(reps):
        for name, fn in contenders.items():
            start = time.perf_counter()
            settle = fn(rep)
            times[name].append(time.perf_counter() - start)
            if callable(settle):
                settle()
    return times


def ours(ck: Checkpointer, state: dict, suffix: str, reads: bool) -> dict[str, Contender]:
    """Our ``save`` until committed; with ``reads``, reading the newest rank data file back into a
    buffer (ranged GETs) and ``load()``. Saves once first: the first save allocates its buffer."""
    ck.save(state, 0)
    ck.wait()

    def data() -> str:
        return f"{ck.records[-1].dirname}/rank-00000.bin"

    buf = memoryview(bytearray(ck.storage.size(data()) or 0))

    def save(rep: int) -> Callable[[], None]:
        ck.save(state, rep + 1)
        ck.wait()
        # untimed (interleaved): the older checkpoint's objects deleted before the next contender runs
        return lambda: ck.wait(retention=True)

    def read_back(_: int) -> None:
        with ck.storage.reader(data()) as r:
            r.read_into(0, buf)

    if not reads:
        return {f"ours to {suffix}": save}
    return {f"ours to {suffix}": save, f"ours read-back from {suffix}": read_back,
            f"ours load() from {suffix}": lambda _: ck.load()}


def s3fs_contenders(url: str, data: bytes, part: int, in_flight: int) -> dict[str, Contender]:
    fs, root = fsspec.core.url_to_fs(url)  # the s3fs client the engine's storage uses
    key = f"{root}/raw.bin"

    def file_object(rep: int) -> None:
        with fs.open(f"{root}/raw-file.bin", "wb", block_size=part) as f:
            f.write(data)

    return {"raw s3fs upload": lambda _: fs.pipe_file(key, data, chunksize=part, max_concurrency=in_flight),
            "raw s3fs file object (1 part at a time)": file_object,
            "raw s3fs read-back": lambda _: fs.cat_file(key, chunksize=part, max_concurrency=in_flight)}


def boto3_contenders(bucket: str, prefix: str, data: bytes, part: int, in_flight: int,
                     endpoint: str) -> dict[str, Contender]:
    import boto3
    from boto3.s3.transfer import TransferConfig

    s3 = boto3.client("s3", endpoint_url=endpoint)
    cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=in_flight)
    key = f"{prefix}/boto3.bin"
    return {"raw boto3 upload": lambda _: s3.upload_fileobj(io.BytesIO(data), bucket, key, Config=cfg),
            "raw boto3 read-back": lambda _: s3.download_fileobj(bucket, key, io.BytesIO(), Config=cfg)}


def raw_local(path: str, data: bytes) -> Contender:
    def write(rep: int) -> None:
        fd = os.open(os.path.join(path, "raw.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, data)
        os.fsync(fd)
        os.close(fd)

    return write


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--in-flight", type=int, default=8, help="parts in flight, for every contender")
    p.add_argument("--part-mib", type=int, default=fsspec_storage._OBJECT_BLOCK >> 20,
                   help="part size of every upload and range size of every read (default: our part size)")
    p.add_argument("--out", default="benchmarks/out")
    args = p.parse_args()
    part, n = args.part_mib << 20, args.in_flight
    fsspec_storage._OBJECT_BLOCK = fsspec_storage._READ_BLOCK = part
    state = make_state(args.size_mib)
    data = torch.cat([t.reshape(-1) for t in state.values() if isinstance(t, torch.Tensor)]).view(torch.uint8)
    raw = data.numpy().tobytes()  # the raw clients take bytes (botocore refuses a memoryview)
    server = s3server.start()
    os.environ.update(server.env)
    s3server.make_bucket(server, "bench")
    try:
        run = uuid.uuid4().hex[:8]
        with Checkpointer(f"s3://bench/ours-{run}", keep_last=1, storage_options={"max_concurrency": n}) as ck:
            uploads = {**s3fs_contenders(f"s3://bench/raw-{run}", raw, part, n),
                       **boto3_contenders("bench", f"boto3-{run}", raw, part, n, server.endpoint),
                       **ours(ck, state, "s3", reads=True)}
            writes = [k for k in uploads if k not in READS]
            # every write first, then every read: the reads find the objects the writes left
            rows = interleaved({k: uploads[k] for k in writes}, args.reps)
            rows |= interleaved({k: uploads[k] for k in READS}, args.reps)
        with tempfile.TemporaryDirectory(dir="/tmp") as local, \
                Checkpointer(os.path.join(local, "ours"), keep_last=1) as ck:
            rows |= interleaved({"raw local write+fsync": raw_local(local, raw),
                                 **ours(ck, state, "local disk", reads=False)}, args.reps)
    finally:
        server.stop()
    report(args, rows, len(raw))
    return 0


def report(args: argparse.Namespace, rows: dict[str, list[float]], nbytes: int) -> None:
    med = {k: statistics.median(v) for k, v in rows.items()}
    gbs = {k: nbytes / s / 1e9 for k, s in med.items()}
    ratios = {"ours to s3 ÷ raw s3fs upload": med["ours to s3"] / med["raw s3fs upload"],
              "ours to s3 ÷ raw boto3 upload": med["ours to s3"] / med["raw boto3 upload"],
              "ours to s3 ÷ s3fs file object": med["ours to s3"] / med["raw s3fs file object (1 part at a time)"],
              "ours read-back ÷ raw s3fs read-back": med["ours read-back from s3"] / med["raw s3fs read-back"],
              "ours read-back ÷ raw boto3 read-back": med["ours read-back from s3"] / med["raw boto3 read-back"],
              "ours load() ÷ raw s3fs read-back": med["ours load() from s3"] / med["raw s3fs read-back"]}
    lines = [f"# bench_s3: {args.size_mib} MiB, {args.in_flight} parts in flight of {args.part_mib} MiB, "
             f"median of {args.reps}", "", "| contender | median s | GB/s | ÷ its raw limit |", "|---|---|---|---|"]
    for k in rows:
        ratio = f"{gbs[k] / gbs[LIMIT[k]]:.2f}" if k in LIMIT else "1 (limit)"
        lines.append(f"| {k} | {med[k]:.3f} | {gbs[k]:.3f} | {ratio} |")
    lines += ["", "| time ratio (lower is better for ours) | × |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in ratios.items()]
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_s3.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "bench_s3.json"), "w") as f:
        writes = [k for k in rows if k not in READS]
        json.dump({"size_mib": args.size_mib, "in_flight": args.in_flight, "part_mib": args.part_mib,
                   "seconds": {k: rows[k] for k in writes}, "gb_per_s": {k: gbs[k] for k in writes},
                   "read_seconds": {k: rows[k] for k in READS}, "read_gb_per_s": {k: gbs[k] for k in READS},
                   "time_ratios": ratios}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
