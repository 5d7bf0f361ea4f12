"""A Hugging Face GPT-2 trained with Lightning on one GPU, checkpointed every 10 steps: through the
node-memory level (with and without ``pipeline=True``) against the local disk alone and no checkpoints.

The workload of a new user: ``transformers``' ``GPT2LMHeadModel(GPT2Config())`` (124 M parameters,
AdamW: 1.5 GB checkpointed), ``precision="bf16-mixed"``, a plain ``DataLoader(shuffle=True)`` of
random tokens (batch 16 x 1024). Each contender is one fit of ``--steps`` steps in this process, in
rounds that alternate the contenders. Figures per fit: **train** (from the start of step 5 to the end
of the last step, the device synchronized at both ends: the target, ``fit time``), **drain** (the
callback's own ``on_train_end``: the last checkpoint made durable, reported on its own), **fit**
(both), the median stall and the counters (saved, waited, flushed, skipped). Overheads are against the
fastest no-checkpoint fit of the run. ``--tiny``: a 2-layer model for a few steps on the CPU, so that
this script does not rot (tests/test_gpu.py).

    PYTHONPATH=. python3 benchmarks/bench_gpu_lightning.py --out benchmarks/out           # one GPU
    PYTHONPATH=. python3 benchmarks/bench_gpu_lightning.py --tiny --out /tmp/bgl          # CPU, seconds
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import statistics
import sys
import time
import traceback
import warnings
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

CONTENDERS = ("none", "disk", "memory", "memory_pipeline")
FIRST_TIMED = 5
"""The timed part starts at this step (``fit time from step 5``): CUDA and the allocator warmed up."""


def _config(tiny: bool) -> tuple[Any, int, int]:
    """GPT-2's configuration, the batch size and the sequence length."""
    from transformers import GPT2Config

    if tiny:
        return GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64), 4, 64
    return GPT2Config(), 16, 1024


def _module(tiny: bool, steps: int) -> Any:
    """The LightningModule and its data: a fresh GPT-2 (seed 0) and ``steps`` batches of tokens."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import GPT2LMHeadModel

    cfg, batch, seq = _config(tiny)

    class GPT2(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT2LMHeadModel(cfg)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            return self.model(input_ids=tokens, labels=tokens).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(1)
            tokens = torch.randint(0, cfg.vocab_size, (steps * batch, seq), generator=g)
            return DataLoader(TensorDataset(tokens), batch_size=batch, shuffle=True)

    L.seed_everything(0, verbose=False)
    return GPT2()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _marks() -> tuple[Any, Any]:
    """Two callbacks around ours: the first times the steps and the start of ``on_train_end``, the
    second its end (so the drain is ours alone)."""
    import lightning as L

    class Before(L.Callback):
        def __init__(self) -> None:
            self.start = self.end_of_steps = float("nan")
            self.steps = 0

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == FIRST_TIMED:
                _sync()
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            self.steps = trainer.global_step

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            _sync()
            self.end_of_steps = time.perf_counter()

    class After(L.Callback):
        def __init__(self) -> None:
            self.end = float("nan")
            self.ours: Any = None
            self.ck: Any = None  # ours' Checkpointer, kept for its figures (it is closed at teardown)
            self.buffers: list[str] = []

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if self.ours is not None and trainer.global_step == trainer.max_steps - 1:
                pool = self.ours.ck._pool  # what the snapshots are copied into (closed with the fit)
                self.buffers = sorted({f"{type(b).__name__}{' pinned' if b.pinned else ''}" for b in pool._free})

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.end = time.perf_counter()
            self.ck = self.ours.ck if self.ours is not None else None

    return Before(), After()


def fit(contender: str, steps: int, every: int, work: str, shm: str, tiny: bool, tag: str) -> dict[str, Any]:
    """One fit under ``contender``; its figures."""
    import lightning as L

    from lightning_ckpt import AsyncShardedCheckpoint

    disk = os.path.join(work, f"disk-{tag}")
    shutil.rmtree(disk, ignore_errors=True)
    before, after = _marks()
    callbacks: list[Any] = [before]
    ours = None
    if contender != "none":
        where: dict[str, Any] = {"dirpath": disk}
        if contender.startswith("memory"):
            where = {"levels": [{"kind": "memory", "path": shm, "job": f"bench-{tag}"}, disk]}
        ours = AsyncShardedCheckpoint(**where, every_n_train_steps=every, keep_last=2,
                                      pipeline=contender.endswith("pipeline"))
        callbacks.append(ours)
        after.ours = ours
    callbacks.append(after)
    module = _module(tiny, steps)
    trainer = L.Trainer(accelerator="cpu" if tiny else "gpu", devices=1, precision="bf16-mixed", max_steps=steps,
                        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0,
                        default_root_dir=work)
    trainer.fit(module)
    _sync()
    done = time.perf_counter()
    row: dict[str, Any] = {"contender": contender, "tag": tag, "steps": before.steps,
                           "train_s": before.end_of_steps - before.start, "drain_s": after.end - before.end_of_steps,
                           "fit_s": done - before.start}
    if ours is not None:
        ck = after.ck
        counters = dict(ck.counters) if ck is not None else {}
        records = list(ck.records) if ck is not None else []
        stalls = [r.stall_s * 1e3 for r in records]
        row.update({"counters": {k: v for k, v in counters.items() if v},
                    "stall_ms_median": statistics.median(stalls) if stalls else float("nan"),
                    "stall_ms_max": max(stalls) if stalls else float("nan"),
                    "checkpoint_bytes": records[-1].bytes if records else 0,
                    "stalls_ms": [[r.step, round(r.stall_s * 1e3, 1)] for r in records],
                    "allocations": ck._pool.allocations if ck is not None else 0})
        row["buffers"] = after.buffers
    row["params"] = sum(t.numel() for t in module.parameters())
    del trainer, module, ours, after
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    shutil.rmtree(disk, ignore_errors=True)
    return row


def report(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The figures as Markdown: per contender the median of its fits, against the fastest baseline."""
    base = min((r["train_s"] for r in rows if r["contender"] == "none"), default=float("nan"))
    base_fit = min((r["fit_s"] for r in rows if r["contender"] == "none"), default=float("nan"))
    lines = [f"Run {meta['date'][:10]}, device {meta['device']}, torch {meta['torch']}, lightning "
             f"{meta['lightning']}, transformers {meta['transformers']}, {meta['cpus']} cores, commit {meta['commit']}; "
             f"{meta['steps']} steps, a checkpoint every {meta['every']}, timed from step {FIRST_TIMED}; "
             f"memory level in {meta['shm']}, disk level in {meta['disk']}.", "",
             "| contender | fits | train s (median) | overhead, steps (min vs min) | overhead, steps (median) "
             "| drain s | fit incl. drain | median / max stall ms | buffers (made) | counters |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in CONTENDERS:
        mine = [r for r in rows if r["contender"] == name]
        if not mine:
            continue
        train = [r["train_s"] for r in mine]
        last = mine[-1]
        lines.append(f"| {name} | {len(mine)} | {statistics.median(train):.2f} | {min(train) / base - 1:+.1%} | "
                     f"{statistics.median(train) / base - 1:+.1%} | "
                     f"{statistics.median(r['drain_s'] for r in mine):.2f} | "
                     f"{min(r['fit_s'] for r in mine) / base_fit - 1:+.1%} | "
                     f"{last.get('stall_ms_median', float('nan')):.1f} / {last.get('stall_ms_max', float('nan')):.0f} | "
                     f"{', '.join(last.get('buffers', [])) or '-'} ({last.get('allocations', 0)}) | "
                     f"{json.dumps(last.get('counters', {}), sort_keys=True) if 'counters' in last else '-'} |")
    median = {name: statistics.median(r["train_s"] for r in rows if r["contender"] == name) / base - 1
              for name in CONTENDERS if any(r["contender"] == name for r in rows)}
    lines.append("")
    if "memory" in median and "memory_pipeline" in median:
        worst = max(median["memory"], median["memory_pipeline"])
        lines += [f"- target: a checkpoint every {meta['every']} steps through the memory level costs ≤ 5 % of the "
                  f"training time (median of the fits): {median['memory']:+.1%} without `pipeline`, "
                  f"{median['memory_pipeline']:+.1%} with → {'PASS' if worst <= 0.05 else 'FAIL'}",
                  f"- target: `pipeline=True` never slower than without: {median['memory_pipeline']:+.1%} against "
                  f"{median['memory']:+.1%} → {'PASS' if median['memory_pipeline'] <= median['memory'] else 'FAIL'}"]
    lines.append("- the drain (the callback's `on_train_end`: the last checkpoint on every level) is reported on its "
                 "own; `fit incl. drain` adds it, against the fastest fit without checkpoints")
    return "\n".join(lines) + "\n"


def _meta(a: argparse.Namespace) -> dict[str, Any]:
    import subprocess

    import lightning
    import transformers

    def df(path: str) -> str:
        try:
            st = os.statvfs(path)
            return f"{st.f_bavail * st.f_frsize / 2**30:.0f} GiB free"
        except OSError as e:
            return str(e)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip() or "unknown"
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
            "torch": torch.__version__, "lightning": lightning.__version__, "transformers": transformers.__version__,
            "cpus": os.cpu_count(), "commit": commit, "steps": a.steps, "every": a.every,
            "shm": f"{os.path.dirname(a.shm.rstrip('/')) or '/'} ({df(os.path.dirname(a.shm.rstrip('/')) or '/')})",
            "disk": f"{a.work} ({df(a.work)})", "argv": sys.argv[1:]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--budget-s", type=float, default=300.0, help="start no new round after this many seconds")
    p.add_argument("--work", default="/var/tmp/bench_gpu_lightning", help="the disk level's parent directory")
    p.add_argument("--shm", default="/dev/shm/ckpt-bench", help="the memory level's directory")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--from", dest="source", help="re-render the report of this bench_gpu_lightning.json into --out")
    a = p.parse_args(argv)
    if a.source:
        with open(a.source) as f:
            saved = json.load(f)
        text = report(saved["rows"], saved["meta"]) + "".join(f"\nFailed: {e}\n" for e in saved["meta"].get("errors", []))
        with open(os.path.join(a.out, "bench_gpu_lightning.md"), "w") as f:
            f.write(text)
        print(text)
        return
    if a.tiny:
        a.steps, a.every, a.rounds = min(a.steps, 12), min(a.every, 4), 1
    warnings.filterwarnings("ignore")
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    meta, rows, t0, errors = _meta(a), [], time.perf_counter(), []
    names = [c for c in a.contenders.split(",") if c]
    for r in range(a.rounds):
        if r and time.perf_counter() - t0 > a.budget_s:
            break
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            try:
                row = fit(name, a.steps, a.every, a.work, a.shm, a.tiny, f"{name}-{r}")
            except Exception as e:  # reported in the table's notes; the other contenders still run
                traceback.print_exc()
                errors.append(f"{name}, round {r}: {type(e).__name__}: {e}")
                continue
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta["total_s"], meta["errors"] = time.perf_counter() - t0, errors
    text = report(rows, meta) + "".join(f"\nFailed: {e}\n" for e in errors)
    print(text, flush=True)
    with open(os.path.join(a.out, "bench_gpu_lightning.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(a.out, "bench_gpu_lightning.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
