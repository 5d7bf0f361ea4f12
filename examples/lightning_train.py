"""A tiny character-level transformer language model, trained with Lightning and checkpointed by
``AsyncShardedCheckpoint`` — configured from YAML through LightningCLI::

    .venv/bin/python examples/lightning_train.py fit --config examples/lightning_cli.yaml

The corpus is generated from a fixed seed (no download). The callback section of the YAML is
all the checkpointing configuration there is; kill the job at any time and run the same command
again: it resumes from the newest committed checkpoint, mid-epoch, at the next unseen sample.

For ``examples/demo.py`` only, two environment variables add a small callback (nothing changes
without them): ``CKPT_DEMO_KILL_AT=<step>`` makes rank 0 SIGKILL the job's whole process group
right after that optimizer step (a simulated node failure), and ``CKPT_DEMO_WEIGHTS=<path>`` makes
rank 0 save the final model and optimizer state (plus a few timings) there with ``torch.save``.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, Dataset

# The callback works with either Lightning distribution; this script takes the unified `lightning`
# package when it is installed, or `pytorch_lightning` when it is not (or when
# LIGHTNING_PACKAGE=pytorch_lightning asks for it, as the tests do to run it under both).
try:
    if os.environ.get("LIGHTNING_PACKAGE") == "pytorch_lightning":
        raise ImportError("LIGHTNING_PACKAGE=pytorch_lightning")
    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI
except ImportError:
    os.environ["LIGHTNING_PACKAGE"] = "pytorch_lightning"
    import pytorch_lightning as pl
    from pytorch_lightning.cli import LightningCLI

WORDS = ("checkpoint snapshot persist commit manifest rank slice layer tensor buffer storage bucket "
         "resume epoch sample gradient optimizer scheduler budget overhead").split()


def corpus(n_chars: int = 40_000, seed: int = 7) -> str:
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_chars:
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + ". "
        out.append(sentence)
        size += len(sentence)
    return "".join(out)


class Windows(Dataset):
    """Fixed-length character windows of the corpus (inputs and next-character targets)."""

    def __init__(self, text: str, seq_len: int) -> None:
        self.vocab = sorted(set(text))
        ids = torch.tensor([self.vocab.index(c) for c in text])
        self.seq_len = seq_len
        self.data = ids

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int):
        chunk = self.data[i * self.seq_len:(i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class TextData(pl.LightningDataModule):
    def __init__(self, seq_len: int = 64, batch_size: int = 16, num_workers: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.dataset = Windows(corpus(), seq_len)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.hparams.batch_size, shuffle=True,
                          num_workers=self.hparams.num_workers, persistent_workers=self.hparams.num_workers > 0)


class TinyLM(pl.LightningModule):
    def __init__(self, vocab_size: int = 32, d_model: int = 128, layers: int = 2, heads: int = 4,
                 seq_len: int = 64, dropout: float = 0.1, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = torch.nn.Embedding(vocab_size, d_model)
        self.pos = torch.nn.Parameter(torch.zeros(seq_len, d_model))
        layer = torch.nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers)
        self.head = torch.nn.Linear(d_model, vocab_size)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq_len))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        return self.head(self.encoder(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class DemoHooks(pl.Callback):
    """What ``examples/demo.py`` needs from a run, switched on by ``CKPT_DEMO_*`` variables.

    Rank 0 prints a progress line every 10 steps, dies with its whole process group (``SIGKILL``)
    right after step ``kill_at``, and at the end saves the final model and optimizer state (and
    timings) to ``weights``. Appended after every other callback, so a checkpoint due at the kill
    step is started first, as in a real crash right after that step.
    """

    def __init__(self, kill_at: Optional[int] = None, weights: Optional[str] = None) -> None:
        self.kill_at, self.weights = kill_at, weights
        self.step_times: dict[int, float] = {}  # optimizer step -> batch start to batch end, seconds
        # Time in AsyncShardedCheckpoint's hooks that may take a checkpoint, by step: on_train_batch_end
        # (inside the step's time) and on_train_epoch_start (after an epoch's last step, whose checkpoint
        # waits for the epoch's end; between two steps). The final one (on_train_end) ends the run.
        self.ckpt_hook_s: dict[int, float] = {}
        self.ckpt_epoch_start_s: dict[int, float] = {}
        self.ckpt_taken: list[int] = []  # the steps whose checkpoint one of those hooks took
        self._t0 = 0.0

    def _ckpt(self, trainer: "pl.Trainer") -> Any:
        from lightning_ckpt import AsyncShardedCheckpoint

        return next((c for c in trainer.callbacks if isinstance(c, AsyncShardedCheckpoint)), None)

    def _log(self, trainer: "pl.Trainer", text: str) -> None:
        if trainer.global_rank == 0:
            print(f"[rank0] {text}", flush=True)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        ck = self._ckpt(trainer)
        if ck is not None:  # time the checkpoint callback's hooks: their whole cost to the training loop
            ck.on_train_batch_end = self._timed(ck, ck.on_train_batch_end, self.ckpt_hook_s)
            ck.on_train_epoch_start = self._timed(ck, ck.on_train_epoch_start, self.ckpt_epoch_start_s)
        per_epoch = trainer.num_training_batches
        if ck is not None and ck.resumed_from is not None:
            epoch, where = trainer.current_epoch, f"epoch {trainer.current_epoch}"
            done = ck.resumed_from - epoch * per_epoch  # one batch per step without gradient accumulation
            if trainer.accumulate_grad_batches == 1 and 0 <= done < per_epoch:
                where += f", continuing at batch {done + 1}/{per_epoch}"
            elif trainer.accumulate_grad_batches == 1 and done == per_epoch:
                where += " complete"
            self._log(trainer, f"RESUMED (resume=auto) from committed checkpoint at step {ck.resumed_from} ({where})")
        else:
            n = sum(p.numel() for p in pl_module.parameters())
            self._log(trainer, f"fresh start: {n:,} parameters, {per_epoch} steps/epoch x {trainer.world_size} "
                               f"ranks x batch {trainer.train_dataloader.batch_size}")

    def _timed(self, ck: Any, hook: Any, into: dict[int, float]) -> Any:
        def timed(trainer: "pl.Trainer", *args: Any, **kwargs: Any) -> None:
            before, start = ck.session.last_saved, time.perf_counter()
            hook(trainer, *args, **kwargs)
            into[trainer.global_step] = into.get(trainer.global_step, 0.0) + time.perf_counter() - start
            if ck.session.last_saved != before:
                self.ckpt_taken.append(trainer.global_step)

        return timed

    def on_train_batch_start(self, trainer: "pl.Trainer", *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        self.step_times[step] = time.perf_counter() - self._t0
        if step % 10 == 0:
            loss = outputs["loss"].item() if isinstance(outputs, dict) else float("nan")
            self._log(trainer, f"step {step:>4}/{trainer.max_steps}  epoch {trainer.current_epoch}  "
                               f"batch {batch_idx + 1:>2}/{trainer.num_training_batches}  loss {loss:.4f}")
        if step == self.kill_at and trainer.global_rank == 0:
            self._log(trainer, f"simulated crash: SIGKILL to the whole process group right after step {step} "
                               f"(epoch {trainer.current_epoch}, batch {batch_idx + 1}/{trainer.num_training_batches})")
            sys.stdout.flush()
            os.killpg(os.getpgid(0), signal.SIGKILL)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.weights and trainer.global_rank == 0:
            ck = self._ckpt(trainer)
            torch.save({"model": pl_module.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
                        "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                        "global_step": trainer.global_step, "resumed_from": ck.resumed_from if ck else None,
                        "batches_per_epoch": trainer.num_training_batches,
                        "step_times": self.step_times, "ckpt_hook_s": self.ckpt_hook_s,
                        "ckpt_epoch_start_s": self.ckpt_epoch_start_s, "ckpt_taken": self.ckpt_taken}, self.weights)
            self._log(trainer, f"done at step {trainer.global_step}; final model + optimizer state -> {self.weights}")


class CLI(LightningCLI):
    def before_fit(self) -> None:
        kill_at, weights = os.environ.get("CKPT_DEMO_KILL_AT"), os.environ.get("CKPT_DEMO_WEIGHTS")
        if kill_at or weights:
            self.trainer.callbacks.append(DemoHooks(int(kill_at) if kill_at else None, weights or None))


def main() -> None:
    torch.set_num_threads(1)  # two CPU ranks share this machine's cores
    CLI(TinyLM, TextData, seed_everything_default=1234)


if __name__ == "__main__":
    main()
